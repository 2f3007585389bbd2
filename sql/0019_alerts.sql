-- Behaviour alerts and reclaim suggestions (issue #14, docs/alerts.md), as `gpuledger watch` publishes
-- them on `<prefix>alerts` and `<prefix>reclaim-suggestions` and the sink stores them. Each is
-- published when it opens and again, with the same id, when it closes (or is withdrawn): the tables
-- replace by id and keep the row with the later `version` (0 open, 1 closed), so `FINAL` (or the
-- *_latest views) gives one row per alert in its latest status. A message sent twice (a restart of
-- the watcher or the sink) writes the same row again, which the replacement drops too.

CREATE TABLE IF NOT EXISTS alerts
(
    schema_version      UInt8,
    alert_id            String,
    rule                LowCardinality(String),
    definition_version  LowCardinality(String),
    cluster             LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    gpus                Array(String),
    status              LowCardinality(String),
    version             UInt8,
    opened_at_ms        Int64,
    closed_at_ms        Nullable(Int64),
    window_start_ms     Int64,
    window_end_ms       Int64,
    message             String,
    day                 Date DEFAULT toDate(fromUnixTimestamp64Milli(opened_at_ms, 'UTC')),
    kafka_topic         LowCardinality(String),
    kafka_partition     Int32,
    kafka_offset        Int64,
    inserted_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, alert_id);

CREATE TABLE IF NOT EXISTS reclaim_suggestions
(
    schema_version      UInt8,
    suggestion_id       String,
    definition_version  LowCardinality(String),
    cluster             LowCardinality(String),
    queue               LowCardinality(String),
    status              LowCardinality(String),
    version             UInt8,
    opened_at_ms        Int64,
    withdrawn_at_ms     Nullable(Int64),
    execution_rate      Float64,
    window_ms           Int64,
    job_ids             Array(String),
    job_attempts        Array(UInt32),
    job_tenants         Array(String),
    job_gpus            Array(Array(String)),
    job_gpus_freed      Array(Float64),
    job_execution_rates Array(Float64),
    job_idle_cost_micros Array(Int64),
    gpus_freed          Float64,
    waiting_gpus        Float64,
    waiting_jobs        UInt32,
    waiting_priority    Int32,
    waiting_queues      Array(String),
    idle_cost_micros    Int64,
    currency            LowCardinality(String),
    message             String,
    day                 Date DEFAULT toDate(fromUnixTimestamp64Milli(opened_at_ms, 'UTC')),
    kafka_topic         LowCardinality(String),
    kafka_partition     Int32,
    kafka_offset        Int64,
    inserted_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, suggestion_id);

-- One row per alert in its latest status, with times as DateTime64 for dashboards and reports.
CREATE VIEW IF NOT EXISTS alerts_latest AS
SELECT
    alert_id, rule, definition_version, cluster, job_id, attempt, tenant, queue, gpus, status,
    fromUnixTimestamp64Milli(opened_at_ms, 'UTC') AS opened_at,
    if(closed_at_ms IS NULL, NULL, fromUnixTimestamp64Milli(assumeNotNull(closed_at_ms), 'UTC')) AS closed_at,
    (ifNull(closed_at_ms, window_end_ms) - opened_at_ms) / 60000 AS open_minutes,
    window_start_ms, window_end_ms, message, day
FROM alerts FINAL;

CREATE VIEW IF NOT EXISTS reclaim_suggestions_latest AS
SELECT
    suggestion_id, definition_version, cluster, queue, status,
    fromUnixTimestamp64Milli(opened_at_ms, 'UTC') AS opened_at,
    if(withdrawn_at_ms IS NULL, NULL, fromUnixTimestamp64Milli(assumeNotNull(withdrawn_at_ms), 'UTC')) AS withdrawn_at,
    opened_at_ms, withdrawn_at_ms, execution_rate, window_ms, job_ids, job_attempts, job_tenants, job_gpus,
    job_gpus_freed, job_execution_rates, job_idle_cost_micros, gpus_freed, waiting_gpus, waiting_jobs,
    waiting_priority, waiting_queues, idle_cost_micros, currency, message, day
FROM reclaim_suggestions FINAL;
