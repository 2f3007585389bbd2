-- GPU time that no allocation holds while the GPU works, per day and GPU (issue #13 point 3). `gpuledger
-- report unmatched` lists it as busy_unallocated: unallocated records with utilization above a floor
-- (default 1 %). It scanned every unallocated record of every day (1.1-1.7 s at 100 M records); at the
-- default floor it now reads this table, filled by its materialized view as records arrive and
-- back-filled from usage_raw (only into an empty table: a file run again adds nothing; apply it with the
-- sinks stopped, as 0018). Like the scan it replaces, it counts every stored copy of a record.
-- The floor here is the report's default (DEFAULT_BUSY_FLOOR_PCT in gpuledger/warehouse/reports.py); another
-- floor scans usage_raw as before. tests/integration/test_golden_scenarios.py checks that both paths agree.

CREATE TABLE IF NOT EXISTS busy_unallocated_daily
(
    day         Date,
    cluster     LowCardinality(String),
    node        LowCardinality(String),
    gpu_uuid    String,
    gpu_ms      UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, node, gpu_uuid, day)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS busy_unallocated_daily_mv TO busy_unallocated_daily AS
SELECT day, cluster, node, gpu_uuid, sum(gpu_ms) AS gpu_ms
FROM usage_raw
WHERE state = 'unallocated' AND util_pct > 1
GROUP BY day, cluster, node, gpu_uuid;

INSERT INTO busy_unallocated_daily
SELECT day, cluster, node, gpu_uuid, sum(gpu_ms)
FROM usage_raw
WHERE state = 'unallocated' AND util_pct > 1 AND (SELECT count() FROM busy_unallocated_daily) = 0
GROUP BY day, cluster, node, gpu_uuid;
