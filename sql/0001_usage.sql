-- Line of the ledger's own output: one row per UsageRecord (a slice of one GPU's time in one state).
-- Kafka coordinates of the source message are kept so that exactly-once can be checked/enforced later.
CREATE TABLE IF NOT EXISTS usage_raw
(
    schema_version      UInt8,
    record_id           String,
    cluster             LowCardinality(String),
    node                LowCardinality(String),
    gpu_uuid            String,
    gpu_model           LowCardinality(String),
    start_ms            Int64,
    end_ms              Int64,
    -- UTC day of the slice's start; computed here so every writer agrees on it
    day                 Date DEFAULT toDate(fromUnixTimestamp64Milli(start_ms, 'UTC')),
    state               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    share_milli         UInt16,
    gpu_ms              UInt64,
    util_pct            Nullable(Float64),
    -- utilization under the agreed definition (mean, or 100/0 above/below a threshold)
    util_metric_pct     Nullable(Float64),
    mem_used_bytes      Nullable(UInt64),
    energy_j            Float64,
    coefficient         Float64,
    coefficient_version LowCardinality(String),
    effective_gpu_ms    UInt64,
    cost_micros         UInt64,
    definition_version  LowCardinality(String),
    kafka_topic         LowCardinality(String),
    kafka_partition     Int32,
    kafka_offset        Int64,
    inserted_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
-- per-GPU time queries ("what ran on this GPU yesterday") read one contiguous range
ORDER BY (cluster, gpu_uuid, start_ms, record_id);

-- Bill grain: per day, job attempt, GPU model and state. Sums are SimpleAggregateFunction so
-- that first/last slice times can ride along (min/max) in the same AggregatingMergeTree.
CREATE TABLE IF NOT EXISTS usage_by_job_daily
(
    day                  Date,
    cluster              LowCardinality(String),
    tenant               LowCardinality(String),
    queue                LowCardinality(String),
    job_id               String,
    attempt              UInt32,
    gpu_model            LowCardinality(String),
    state                LowCardinality(String),
    definition_version   LowCardinality(String),
    slices               SimpleAggregateFunction(sum, UInt64),
    gpu_ms               SimpleAggregateFunction(sum, UInt64),
    effective_gpu_ms     SimpleAggregateFunction(sum, UInt64),
    cost_micros          SimpleAggregateFunction(sum, UInt64),
    energy_j             SimpleAggregateFunction(sum, Float64),
    -- Σ util_metric_pct × gpu_ms over slices that have it, and the gpu_ms of those slices:
    -- their ratio is the hardware utilization under the agreed definition (percent)
    util_weighted_gpu_ms SimpleAggregateFunction(sum, Float64),
    util_gpu_ms          SimpleAggregateFunction(sum, UInt64),
    first_start_ms       SimpleAggregateFunction(min, Int64),
    last_end_ms          SimpleAggregateFunction(max, Int64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version);

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_by_job_daily_mv TO usage_by_job_daily AS
SELECT
    day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(cost_micros) AS cost_micros,
    sum(energy_j) AS energy_j,
    -- qualified: inside this SELECT a bare gpu_ms would mean the alias sum(gpu_ms)
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM usage_raw
GROUP BY day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version;

-- Capacity grain: per day, cluster, GPU model and state (the identity capacity = Σ states).
CREATE TABLE IF NOT EXISTS usage_capacity_daily
(
    day                  Date,
    cluster              LowCardinality(String),
    gpu_model            LowCardinality(String),
    state                LowCardinality(String),
    definition_version   LowCardinality(String),
    gpus                 AggregateFunction(uniqExact, String),
    slices               SimpleAggregateFunction(sum, UInt64),
    gpu_ms               SimpleAggregateFunction(sum, UInt64),
    effective_gpu_ms     SimpleAggregateFunction(sum, UInt64),
    cost_micros          SimpleAggregateFunction(sum, UInt64),
    energy_j             SimpleAggregateFunction(sum, Float64),
    util_weighted_gpu_ms SimpleAggregateFunction(sum, Float64),
    util_gpu_ms          SimpleAggregateFunction(sum, UInt64)
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, gpu_model, state, definition_version);

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_capacity_daily_mv TO usage_capacity_daily AS
SELECT
    day, cluster, gpu_model, state, definition_version,
    uniqExactState(gpu_uuid) AS gpus,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(cost_micros) AS cost_micros,
    sum(energy_j) AS energy_j,
    -- qualified: inside this SELECT a bare gpu_ms would mean the alias sum(gpu_ms)
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms
FROM usage_raw
GROUP BY day, cluster, gpu_model, state, definition_version;
