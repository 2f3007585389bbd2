-- Usage per hour and job attempt, for the open days of the bills and jobs reports and the carbon
-- chart (issue #13 point 3; docs/performance.md "Dashboard and report queries").
-- Open days were read from usage_raw with FINAL, each record once, and grouped per attempt, state and
-- hour on every report: 13.5 M records for a day of 10,000 GPUs, 0.7-0.8 s of each report on 2 cores.
-- This table keeps the same sums per hour, filled by its materialized view from every insert into
-- usage_raw (every state, so its record count can be compared with usage_raw's), 50,000 rows a day.
-- The view sums whatever is inserted, copies too, while FINAL keeps one copy of a record, and the sink
-- delivers at least once. So a reader trusts the table for a (cluster, day) only when it counted exactly
-- as many records as usage_raw holds distinct ones (gpuledger/warehouse/bills.py exact_hourly_days):
-- then no record was inserted twice, and its sums are the deduplicated ones. Any other day is read from usage_raw, as
-- before. (A day whose records were deleted or expired in usage_raw fails the check too, and is read
-- from usage_raw.) energy_mj is each record's energy rounded to whole millijoules, then summed, as the
-- bill close writes closed_energy (sql/0023).
-- The back-fill runs only into an empty table, from the rows usage_raw holds; apply it with the sinks
-- stopped, as 0018 (rows inserted meanwhile are counted twice, which the check sees: those days are
-- read from usage_raw). Retention follows usage_raw's (GPULEDGER_RETENTION_USAGE_DAYS).

CREATE TABLE IF NOT EXISTS usage_by_job_hourly
(
    day                 Date,
    cluster             LowCardinality(String),
    hour                Int64,
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    definition_version  LowCardinality(String),
    state               LowCardinality(String),
    records             UInt64,
    gpu_ms              UInt64,
    effective_gpu_ms    UInt64,
    cost_micros         UInt64,
    energy_j            Float64,
    energy_mj           Int64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, hour, state, tenant, queue, job_id, attempt, definition_version)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_by_job_hourly_mv TO usage_by_job_hourly AS
SELECT
    day, cluster, intDiv(start_ms, 3600000) AS hour, tenant, queue, job_id, attempt, definition_version, state,
    count() AS records, sum(gpu_ms) AS gpu_ms, sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(cost_micros) AS cost_micros, sum(energy_j) AS energy_j,
    sum(toInt64(round(usage_raw.energy_j * 1000))) AS energy_mj  -- the column, not the alias above
FROM usage_raw
GROUP BY day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state;

INSERT INTO usage_by_job_hourly
SELECT
    day, cluster, intDiv(start_ms, 3600000), tenant, queue, job_id, attempt, definition_version, state,
    count(), sum(gpu_ms), sum(effective_gpu_ms), sum(cost_micros), sum(energy_j), sum(toInt64(round(energy_j * 1000)))
FROM usage_raw
WHERE (SELECT count() FROM usage_by_job_hourly) = 0
GROUP BY day, cluster, intDiv(start_ms, 3600000), tenant, queue, job_id, attempt, definition_version, state;
