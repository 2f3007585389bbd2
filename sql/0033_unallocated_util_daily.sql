-- Unallocated GPU time per day, GPU and whole-percent utilization step (issue #13 point 3). `gpuledger
-- report unmatched --busy-floor-pct F` lists as busy_unallocated the unallocated records with
-- utilization above F. At the default floor it reads busy_unallocated_daily (sql/0025); any other floor
-- scanned every unallocated record (1.2-1.9 s at 100 M records). util_step is ceil(util_pct), so for a
-- whole-number floor F, util_pct > F exactly when util_step > F: every whole-number floor from 0 to 100
-- reads this table, summed over its steps. A floor with a fraction still scans usage_raw. Records
-- without utilization, or at 0 %, are above no floor from 0 up and are not kept.
-- Filled by its materialized view as records arrive and back-filled from usage_raw (only into an empty
-- table: a file run again adds nothing; apply it with the sinks stopped, as 0018). Like the scan it
-- replaces, it counts every stored copy of a record. tests/integration/test_unmatched_floors.py checks
-- that both paths agree.

CREATE TABLE IF NOT EXISTS unallocated_util_daily
(
    day         Date,
    cluster     LowCardinality(String),
    node        LowCardinality(String),
    gpu_uuid    String,
    util_step   UInt8,
    gpu_ms      UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, node, gpu_uuid, day, util_step)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS unallocated_util_daily_mv TO unallocated_util_daily AS
SELECT day, cluster, node, gpu_uuid, toUInt8(least(ceil(assumeNotNull(util_pct)), 255)) AS util_step, sum(gpu_ms) AS gpu_ms
FROM usage_raw
WHERE state = 'unallocated' AND util_pct > 0
GROUP BY day, cluster, node, gpu_uuid, util_step;

INSERT INTO unallocated_util_daily
SELECT day, cluster, node, gpu_uuid, toUInt8(least(ceil(assumeNotNull(util_pct)), 255)) AS util_step, sum(gpu_ms)
FROM usage_raw
WHERE state = 'unallocated' AND util_pct > 0 AND (SELECT count() FROM unallocated_util_daily) = 0
GROUP BY day, cluster, node, gpu_uuid, util_step;
