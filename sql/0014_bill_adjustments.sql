-- Adjustments and the deduplication audit (docs/accounting.md §6a, docs/reliability.md "Closed periods").

-- Corrections of closed days, booked into the next open day of the cluster (booked_day) by a close
-- run: the difference between a closed day's figures recomputed from current data and what was
-- closed plus the adjustments already booked for it, at attempt grain. reason:
--   late_lifecycle_outcome: an attempt's outcome known after the close moved its executing time
--                           between compute and failed_retry (a -x / +x pair);
--   late_samples:           usage for the closed day arrived after the close (or an earlier
--                           adjustment is corrected).
-- Append-only like the closed tables; amounts are signed.
CREATE TABLE IF NOT EXISTS bill_adjustments
(
    booked_day          Date,
    corrects_day        Date,
    cluster             LowCardinality(String),
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    line                LowCardinality(String),
    definition_version  LowCardinality(String),
    reason              LowCardinality(String),
    gpu_ms              Int64,
    effective_gpu_ms    Int64,
    cost_micros         Int128,
    currency            LowCardinality(String),
    bill_run_id         String,
    booked_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(booked_day)
ORDER BY (booked_day, cluster, tenant, corrects_day, job_id, attempt, line);

-- Deduplication audit: per UTC day and table, rows (usage records counted) against distinct
-- (cluster, record_id) in usage_raw. duplicates > 0 means the same record was written more than once
-- (a backfill, a repair, a replay, a second sink): the live views count it that many times; closed
-- bills count it once. `gpuledger bills audit` prints it and exports it as gpuledger_usage_duplicate_records.
CREATE VIEW IF NOT EXISTS usage_dedup_audit AS
WITH ids AS (SELECT day, uniqExact(cluster, record_id) AS distinct_records FROM usage_raw GROUP BY day)
SELECT t.day AS day, t.source_table AS source_table, t.rows AS rows, ids.distinct_records AS distinct_records,
       toInt64(t.rows) - toInt64(ids.distinct_records) AS duplicates
FROM
(
    SELECT day, 'usage_raw' AS source_table, count() AS rows FROM usage_raw GROUP BY day
    UNION ALL
    SELECT day, 'usage_by_job_daily' AS source_table, sum(slices) AS rows FROM usage_by_job_daily GROUP BY day
    UNION ALL
    SELECT day, 'usage_capacity_daily' AS source_table, sum(slices) AS rows FROM usage_capacity_daily GROUP BY day
) AS t
INNER JOIN ids ON ids.day = t.day;
