-- One GPU UUID reported by two nodes at the same time (a cloned agent or VM image), shown to operators
-- whatever the gpu-samples partitioning (review finding after 682a933; docs/reliability.md, "One GPU, one
-- node"). The worker refuses such a tick only when both nodes share a gpu-samples partition; nodes go to
-- partitions by a hash of their name, so most clones were compared by nothing and said nothing. The sink
-- stores every node's health rows, refused or not, so the warehouse sees both nodes.
--
-- gpu_uuid_shared_hours: one row per GPU UUID and hour in which two or more (cluster, node) reported it,
-- with those "<cluster>/<node>" (`placements`). Read from gpu_health_hourly (kept 730 days; no per-tick
-- rows), and only for the UUIDs whose first..last seen on two (cluster, node) overlap in gpu_sightings (a
-- small table): grouping every GPU's hours took 0.9-1.3 s on 7.2 M hourly rows, this 14 ms. Both tests
-- keep a real move out: a GPU moved shows on its new node after it left the old one (no overlap, even
-- within one hour); one moved away and back overlaps but shares no hour with the other node.
--
-- gpu_cards as in sql/0046; `flag` also says "reported by N nodes at once: <placements> (cloned agent?)",
-- joined to the repair flag by "; ". Agents before 682a933 named an unreadable GPU "GPU-unreadable-<index>"
-- on every node: such a UUID's flag says to upgrade the agents instead. Same columns.
-- `gpuledger report inventory` lists the GPUs of its period that two nodes reported at once.

CREATE OR REPLACE VIEW gpu_uuid_shared_hours AS
SELECT gpu_uuid, hour, arraySort(groupUniqArray(concat(toString(cluster), '/', toString(node)))) AS placements
FROM gpu_health_hourly
WHERE gpu_uuid IN
(
    SELECT gpu_uuid
    FROM
    (
        SELECT gpu_uuid, min(first_seen_ms) AS first_ms, max(last_seen_ms) AS last_ms
        FROM gpu_sightings
        GROUP BY gpu_uuid, cluster, node
    )
    GROUP BY gpu_uuid
    HAVING count() > 1
       AND arrayExists((a, i) -> arrayExists((b, j) -> i != j AND a.1 < b.2 AND b.1 < a.2, s, arrayEnumerate(s)),
                       groupArray((first_ms, last_ms)) AS s, arrayEnumerate(s))
)
GROUP BY gpu_uuid, hour
HAVING length(placements) > 1;

CREATE OR REPLACE VIEW gpu_cards AS
SELECT
    s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model, p.cluster AS cluster, p.node AS node,
    s.serial AS serial, s.board_part_number AS board_part_number,
    s.vbios_version AS vbios_version, s.first_seen AS first_seen, s.last_seen AS last_seen, s.nodes AS nodes,
    p.placements AS placements,
    r.repairs AS repairs, if(r.repairs > 0, r.last_repaired, NULL) AS last_repaired,
    arrayStringConcat(arrayFilter(f -> f != '', [
        if(r.repairs >= 2, 'suggest lower-priority work', ''),
        if(length(x.at_once) > 1, concat('reported by ', toString(length(x.at_once)), ' nodes at once: ',
                                         arrayStringConcat(x.at_once, ', '),
                                         if(match(s.gpu_uuid, '^GPU-unreadable-[0-9]+$'),
                                            ' (an old agent\'s placeholder for an unreadable GPU: upgrade the agents)',
                                            ' (cloned agent?)')), '')]), '; ') AS flag,
    d.down_seconds AS down_seconds, h.xid_errors AS xid_errors,
    h.avg_temperature_c AS avg_temperature_c, h.max_temperature_c AS max_temperature_c
FROM
(
    SELECT
        gpu_uuid,
        argMax(toString(gpu_model), last_seen_ms) AS gpu_model,
        argMaxIf(serial, last_seen_ms, serial != '') AS serial,
        argMaxIf(board_part_number, last_seen_ms, board_part_number != '') AS board_part_number,
        argMaxIf(vbios_version, last_seen_ms, vbios_version != '') AS vbios_version,
        fromUnixTimestamp64Milli(min(first_seen_ms), 'UTC') AS first_seen,
        fromUnixTimestamp64Milli(max(last_seen_ms), 'UTC') AS last_seen,
        uniqExact(cluster, node) AS nodes
    FROM gpu_sightings
    GROUP BY gpu_uuid
) AS s
LEFT JOIN
(
    SELECT
        gpu_uuid,
        argMax(c, (last_ms, c, n)) AS cluster,
        argMax(n, (last_ms, c, n)) AS node,
        arrayStringConcat(arrayMap(x -> concat(x.2, '/', x.3), arraySort(groupArray((first_ms, c, n)))), ', ') AS placements
    FROM
    (
        SELECT gpu_uuid, toString(cluster) AS c, node AS n, min(first_seen_ms) AS first_ms, max(last_seen_ms) AS last_ms
        FROM gpu_sightings
        GROUP BY gpu_uuid, cluster, node
    )
    GROUP BY gpu_uuid
) AS p ON s.gpu_uuid = p.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, count() AS repairs, fromUnixTimestamp64Milli(max(repaired_ms), 'UTC') AS last_repaired
    FROM gpu_repairs
    GROUP BY gpu_uuid
) AS r ON s.gpu_uuid = r.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(gpu_ms) / 1000 AS down_seconds
    FROM gpu_down_records FINAL
    GROUP BY gpu_uuid
) AS d ON s.gpu_uuid = d.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(xid_count) AS xid_errors, avgMerge(temperature_c) AS avg_temperature_c,
           maxMerge(max_temperature_c) AS max_temperature_c
    FROM gpu_health_hourly
    GROUP BY gpu_uuid
) AS h ON s.gpu_uuid = h.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, arraySort(groupUniqArrayArray(placements)) AS at_once
    FROM gpu_uuid_shared_hours
    GROUP BY gpu_uuid
) AS x ON s.gpu_uuid = x.gpu_uuid;
