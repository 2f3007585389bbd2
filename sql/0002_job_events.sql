-- Line 2 as received: one row per JobEvent (watermarks are not stored). GPUs as parallel arrays.
CREATE TABLE IF NOT EXISTS job_events
(
    schema_version     UInt8,
    event_id           String,
    ts_ms              Int64,
    day                Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    kind               String,
    cluster            String,
    job_id             String,
    attempt            UInt32,
    tenant             String,
    queue              String,
    priority           Int32,
    requested_gpus     Float64,
    gpu_nodes          Array(String),
    gpu_uuids          Array(String),
    gpu_share_milli    Array(UInt16),
    gpu_container_ids  Array(String),
    aliases            Map(String, String),
    reason             String,
    kafka_topic        LowCardinality(String),
    kafka_partition    Int32,
    kafka_offset       Int64,
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, job_id, attempt, ts_ms, event_id);

-- One row per (cluster, job_id, attempt) after merging. Every column is an order-insensitive,
-- duplicate-insensitive aggregate (min/max/argMin/uniqExact), so redelivered or late events
-- do not change the result.
CREATE TABLE IF NOT EXISTS job_attempts_state
(
    cluster          String,
    job_id           String,
    attempt          UInt32,
    tenant           AggregateFunction(argMin, String, Int64),
    queue            AggregateFunction(argMin, String, Int64),
    priority         AggregateFunction(argMin, Int32, Int64),
    requested_gpus   SimpleAggregateFunction(max, Float64),
    allocated_gpus   SimpleAggregateFunction(max, Float64),
    queued_ms        AggregateFunction(min, Nullable(Int64)),
    allocated_ms     AggregateFunction(min, Nullable(Int64)),
    started_ms       AggregateFunction(min, Nullable(Int64)),
    ended_ms         AggregateFunction(min, Nullable(Int64)),
    outcome          AggregateFunction(argMin, String, Int64),
    events           AggregateFunction(uniqExact, String),
    first_seen_ms    SimpleAggregateFunction(min, Int64),
    last_seen_ms     SimpleAggregateFunction(max, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (cluster, job_id, attempt);

CREATE MATERIALIZED VIEW IF NOT EXISTS job_attempts_mv TO job_attempts_state AS
SELECT
    cluster, job_id, attempt,
    argMinState(tenant, ts_ms) AS tenant,
    argMinState(queue, ts_ms) AS queue,
    argMinState(priority, ts_ms) AS priority,
    max(requested_gpus) AS requested_gpus,
    max(if(kind = 'allocated', arraySum(gpu_share_milli) / 1000, 0.)) AS allocated_gpus,
    minState(if(kind IN ('submitted', 'queued', 'retried'), ts_ms, NULL)) AS queued_ms,
    minState(if(kind = 'allocated', ts_ms, NULL)) AS allocated_ms,
    minState(if(kind = 'started', ts_ms, NULL)) AS started_ms,
    minState(if(kind IN ('completed', 'failed', 'preempted', 'cancelled'), ts_ms, NULL)) AS ended_ms,
    -- the first terminal event decides the outcome; '' while the attempt runs
    argMinStateIf(kind, ts_ms, kind IN ('completed', 'failed', 'preempted', 'cancelled')) AS outcome,
    uniqExactState(event_id) AS events,
    min(ts_ms) AS first_seen_ms,
    max(ts_ms) AS last_seen_ms
FROM job_events
GROUP BY cluster, job_id, attempt;

CREATE VIEW IF NOT EXISTS job_attempts AS
SELECT
    *,
    allocated_ms - queued_ms AS queue_wait_ms
FROM
(
    SELECT
        cluster, job_id, attempt,
        argMinMerge(tenant) AS tenant,
        argMinMerge(queue) AS queue,
        argMinMerge(priority) AS priority,
        max(requested_gpus) AS requested_gpus,
        max(allocated_gpus) AS allocated_gpus,
        minMerge(queued_ms) AS queued_ms,
        minMerge(allocated_ms) AS allocated_ms,
        minMerge(started_ms) AS started_ms,
        minMerge(ended_ms) AS ended_ms,
        argMinMerge(outcome) AS outcome,
        uniqExactMerge(events) AS events,
        min(first_seen_ms) AS first_seen_ms,
        max(last_seen_ms) AS last_seen_ms
    FROM job_attempts_state
    GROUP BY cluster, job_id, attempt
);
