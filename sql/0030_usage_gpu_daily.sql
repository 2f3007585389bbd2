-- Usage per GPU, day, queue and state, for the periodic reports (issue #13 point 3; docs/performance.md
-- "Dashboard and report queries"). The inventory report (cards per model, the cards under a utilization
-- threshold and the queues that held them) and the weekly report's down GPUs grouped every usage record
-- of the period by GPU: 11.4 s and 2.4 s at 100 M records on 2 cores. This table keeps those sums per
-- GPU and day (with the queue that held it, '' when none, and the state), a few rows per GPU a day.
-- Like the reads it replaces, it sums every record inserted (the sink delivers at least once), as the
-- utilization report and the dashboards' aggregates do; `records` counts them.
-- Filled by its materialized view and back-filled from usage_raw (only into an empty table: a file run
-- again adds nothing; apply it with the sinks stopped, as 0018). Retention follows usage_raw's
-- (GPULEDGER_RETENTION_USAGE_DAYS).

CREATE TABLE IF NOT EXISTS usage_gpu_daily
(
    day                   Date,
    cluster               LowCardinality(String),
    gpu_model             LowCardinality(String),
    gpu_uuid              String,
    node                  LowCardinality(String),
    queue                 LowCardinality(String),
    state                 LowCardinality(String),
    records               UInt64,
    gpu_ms                UInt64,
    util_weighted_gpu_ms  Float64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, gpu_model, gpu_uuid, node, queue, state)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_gpu_daily_mv TO usage_gpu_daily AS
SELECT
    day, cluster, gpu_model, gpu_uuid, node, queue, state,
    count() AS records, sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms
FROM usage_raw
GROUP BY day, cluster, gpu_model, gpu_uuid, node, queue, state;

INSERT INTO usage_gpu_daily
SELECT
    day, cluster, gpu_model, gpu_uuid, node, queue, state,
    count(), sum(gpu_ms), sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * gpu_ms))
FROM usage_raw
WHERE (SELECT count() FROM usage_gpu_daily) = 0
GROUP BY day, cluster, gpu_model, gpu_uuid, node, queue, state;
