-- GPU cards of warehouses upgraded through sql/0020 (docs/gpu-cards.md). 0020 back-filled gpu_sightings
-- from gpu_health alone, which keeps 14 days of samples, so a GPU seen before then started its card
-- (first seen, age, months) at most 14 days before the upgrade. gpu_health_hourly keeps 730 days:
-- every GPU, cluster, node and model in it gets a sighting (identity '', as 0020's back-fill) from
-- its first to its last hour there.
--
-- An hour is known, not the tick: last seen is the last hour's start (a later sighting wins the
-- max); first seen is the first hour's start, unless a sighting already stored for the same GPU,
-- cluster, node and model falls within that hour or before it (kept: it is the tick's time).
-- reports 0: these are not inventory reports. min, max and a sum of 0 merge away a second copy,
-- so this file run again (or with the sinks running) changes nothing.
INSERT INTO gpu_sightings
SELECT
    gpu_uuid, cluster, node, gpu_model, '' AS serial, '' AS board_part_number, '' AS vbios_version,
    if(countIf(seen = 1) > 0 AND minIf(ms, seen = 1) < minIf(ms, seen = 0) + 3600000,
       minIf(ms, seen = 1), minIf(ms, seen = 0)) AS first_seen_ms,
    maxIf(ms, seen = 0) AS last_seen_ms,
    toUInt64(0) AS reports
FROM
(
    SELECT gpu_uuid, cluster, toString(node) AS node, gpu_model, toInt64(toUnixTimestamp(hour)) * 1000 AS ms,
           toUInt8(0) AS seen
    FROM gpu_health_hourly
    UNION ALL
    SELECT gpu_uuid, cluster, node, gpu_model, first_seen_ms AS ms, toUInt8(1) AS seen
    FROM gpu_sightings
)
GROUP BY gpu_uuid, cluster, node, gpu_model
HAVING countIf(seen = 0) > 0;
