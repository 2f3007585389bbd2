-- Line 3: one row per queue per scheduler snapshot; pending demand by priority as parallel arrays.
CREATE TABLE IF NOT EXISTS scheduler_snapshots
(
    schema_version            UInt8,
    cluster                   LowCardinality(String),
    ts_ms                     Int64,
    day                       Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    queue                     LowCardinality(String),
    queue_priority            Int32,
    quota_gpus                Float64,
    allocated_gpus            Float64,
    pending_jobs              UInt32,
    pending_gpus              Float64,
    pending_priorities        Array(Int32),
    pending_jobs_by_priority  Array(UInt32),
    pending_gpus_by_priority  Array(Float64),
    kafka_topic               LowCardinality(String),
    kafka_partition           Int32,
    kafka_offset              Int64,
    inserted_at               DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms);

-- Preemption rules fired, as reported with each snapshot (their own table: a preemption may
-- name a queue that the snapshot does not list).
CREATE TABLE IF NOT EXISTS scheduler_preemptions
(
    cluster          LowCardinality(String),
    ts_ms            Int64,
    day              Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    queue            LowCardinality(String),
    job_id           String,
    by_job_id        String,
    rule             LowCardinality(String),
    kafka_topic      LowCardinality(String),
    kafka_partition  Int32,
    kafka_offset     Int64,
    inserted_at      DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms, job_id);
