-- A node is (cluster, node), on the GPU ID cards and on old approvals (review findings; this file holds both).
--
-- gpu_cards (sql/0026; the operations dashboard's GPU ID cards chart, docs/gpu-cards.md): a card gave only
-- its count of nodes (counted per cluster and node), never which, so a card seen on c1/node001 and
-- c2/node001 read "2 nodes" and the chart could not tell the clusters apart; nor could the dashboard's
-- Cluster and Node filters reach it. The card now lists every place it sat, "<cluster>/<node>" in the
-- order first seen (`placements`), and names the cluster and node it was last seen on (`cluster`, `node`).
--
-- approvals_current (sql/0044): an approval recorded before sql/0044 whose estimate names no cluster
-- (estimates written before `gpuledger estimate` knew the cluster) has cluster '': approving it wrote
-- an approval under the topic key "/<job id>", which no cluster's admission hook reads, and nothing
-- said so. `needs_reapproval` gives the reason such a pending or approved approval admits no job
-- ('' for every other); `gpuledger approvals approve` refuses it (docs/planning.md, "Approvals").

CREATE OR REPLACE VIEW gpu_cards AS
SELECT
    s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model, p.cluster AS cluster, p.node AS node,
    s.serial AS serial, s.board_part_number AS board_part_number,
    s.vbios_version AS vbios_version, s.first_seen AS first_seen, s.last_seen AS last_seen, s.nodes AS nodes,
    p.placements AS placements,
    r.repairs AS repairs, if(r.repairs > 0, r.last_repaired, NULL) AS last_repaired,
    if(r.repairs >= 2, 'suggest lower-priority work', '') AS flag,
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
) AS h ON s.gpu_uuid = h.gpu_uuid;

-- approvals_current as in sql/0044, with needs_reapproval.
CREATE OR REPLACE VIEW approvals_current AS
SELECT *,
       if(cluster = '' AND status IN ('pending', 'approved'),
          concat('names no cluster (recorded before sql/0044 from an estimate that names none): an approval of it ',
                 'admits no job; estimate job ', job_id, ' again with --cluster and decide the new approval'),
          '') AS needs_reapproval
FROM
(
    SELECT approval_id,
           if(max(cluster) != '', max(cluster), JSONExtractString(argMin(estimate, ts_ms), 'cluster')) AS cluster,
           argMax(job_id, ts_ms) AS job_id,
           greatest(max(attempt), JSONExtract(argMin(estimate, ts_ms), 'attempt', 'UInt32')) AS attempt,
           argMax(status, ts_ms) AS status,
           min(ts_ms) AS requested_ms, max(ts_ms) AS updated_ms, argMax(decided_by, ts_ms) AS decided_by,
           argMax(note, ts_ms) AS note, argMax(target, ts_ms) AS target,
           argMax(cost_micros, ts_ms) / 1e6 AS estimated_cost, argMax(cost_high_micros, ts_ms) / 1e6 AS estimated_cost_high,
           argMax(threshold_micros, ts_ms) / 1e6 AS threshold_cost, argMax(currency, ts_ms) AS currency,
           argMax(gpu_hours, ts_ms) AS gpu_hours, argMax(wall_hours, ts_ms) AS wall_hours
    FROM approvals GROUP BY approval_id
);
