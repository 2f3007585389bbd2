-- The warehouse schema after every migration in sql/ (tests/integration/test_schema_snapshot.py).
-- Do not edit: GPULEDGER_UPDATE_GOLDEN=1 rewrites it; review the diff like a migration.

CREATE TABLE {db}.bill_adjustments
(
    `booked_day` Date,
    `corrects_day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `reason` LowCardinality(String),
    `gpu_ms` Int64,
    `effective_gpu_ms` Int64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `booked_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(booked_day)
ORDER BY (booked_day, cluster, tenant, corrects_day, job_id, attempt, line)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.bill_runs
(
    `bill_run_id` String,
    `created_at` DateTime64(3, 'UTC') DEFAULT now64(3),
    `days` Array(Date),
    `clusters` Array(String),
    `definition_version` LowCardinality(String),
    `grace_s` Float64,
    `horizons` Map(String, Int64),
    `closed_rows` UInt64,
    `adjustment_rows` UInt64
)
ENGINE = MergeTree
ORDER BY (created_at, bill_run_id)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` UInt64,
    `capacity_gpu_seconds` Float64,
    `down_gpu_seconds` Float64,
    `unallocated_gpu_seconds` Float64,
    `allocated_idle_gpu_seconds` Float64,
    `executing_gpu_seconds` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `unallocated_cost` Float64,
    `energy_kwh` Float64
)
AS SELECT
    day,
    cluster,
    gpu_model,
    definition_version,
    uniqExactMerge(gpus) AS gpus,
    sum(gpu_ms) / 1000 AS capacity_gpu_seconds,
    sumIf(gpu_ms, state = 'down') / 1000 AS down_gpu_seconds,
    sumIf(gpu_ms, state = 'unallocated') / 1000 AS unallocated_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS allocated_idle_gpu_seconds,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sum(effective_gpu_ms) / 3600000 AS effective_gpu_hours,
    sum(cost_micros) / 1000000. AS cost,
    sumIf(cost_micros, state = 'unallocated') / 1000000. AS unallocated_cost,
    sum(energy_j) / 3600000 AS energy_kwh
FROM {db}.usage_capacity_daily
GROUP BY
    day,
    cluster,
    gpu_model,
    definition_version;

CREATE TABLE {db}.closed_days
(
    `day` Date,
    `cluster` LowCardinality(String),
    `bill_run_id` String,
    `horizon_ms` Int64,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (cluster, day)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_job_cost
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `outcome` LowCardinality(String),
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, job_id, attempt, line, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_queue_efficiency
(
    `day` Date,
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `tenant` LowCardinality(String),
    `attempts` UInt64,
    `requested_gpu_seconds` Float64,
    `allocated_gpu_seconds` Float64,
    `executed_gpu_seconds` Float64,
    `waits` UInt64,
    `queue_wait_p50_s` Nullable(Float64),
    `queue_wait_p90_s` Nullable(Float64),
    `queue_wait_p99_s` Nullable(Float64),
    `queue_wait_mean_s` Nullable(Float64),
    `queue_wait_max_s` Nullable(Float64),
    `definition_version` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, queue, tenant)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_tenant_bill
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, line, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.coefficients
(
    `model` LowCardinality(String),
    `coefficient` Float64,
    `valid_from` Date,
    `version` String,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.definitions
(
    `definition_version` String,
    `fingerprint` String,
    `content` String,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (definition_version, fingerprint)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.gpu_current
(
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `state` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `jobs` String,
    `tenants` String,
    `queues` String,
    `allocated_share` Float64,
    `util_pct` Nullable(Float64),
    `last_seen` DateTime64(3, 'UTC')
)
AS SELECT
    u.cluster AS cluster,
    u.node AS node,
    u.gpu_uuid AS gpu_uuid,
    u.gpu_model AS gpu_model,
    multiIf(countIf(u.state = 'down') > 0, 'down', countIf(u.state = 'executing') > 0, 'executing', countIf(u.state = 'allocated_idle') > 0, 'allocated_idle', 'unallocated') AS state,
    minIf(u.job_id, u.job_id != '') AS job_id,
    minIf(u.tenant, u.tenant != '') AS tenant,
    minIf(u.queue, u.queue != '') AS queue,
    arrayStringConcat(arraySort(groupUniqArrayIf(u.job_id, u.job_id != '')), ' ') AS jobs,
    arrayStringConcat(arraySort(groupUniqArrayIf(toString(u.tenant), u.tenant != '')), ' ') AS tenants,
    arrayStringConcat(arraySort(groupUniqArrayIf(toString(u.queue), u.queue != '')), ' ') AS queues,
    sumIf(u.share_milli, u.job_id != '') / 1000 AS allocated_share,
    maxOrNull(u.util_pct) AS util_pct,
    fromUnixTimestamp64Milli(max(u.end_ms), 'UTC') AS last_seen
FROM {db}.usage_raw AS u
INNER JOIN
(
    SELECT
        cluster,
        gpu_uuid,
        max(end_ms) AS last_end_ms
    FROM {db}.usage_raw
    GROUP BY
        cluster,
        gpu_uuid
) AS l ON (u.cluster = l.cluster) AND (u.gpu_uuid = l.gpu_uuid) AND (u.end_ms = l.last_end_ms)
GROUP BY
    u.cluster,
    u.node,
    u.gpu_uuid,
    u.gpu_model;

CREATE TABLE {db}.gpu_health
(
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `ts_ms` Int64,
    `interval_ms` UInt32,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `health` LowCardinality(String),
    `down_reason` String,
    `temperature_c` Nullable(Float64),
    `power_w` Nullable(Float64),
    `util_gpu_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `xid_errors` Array(UInt32),
    `ecc_dbe_total` Nullable(UInt64),
    `kafka_topic` LowCardinality(String) DEFAULT '',
    `kafka_partition` Int32 DEFAULT -1,
    `kafka_offset` Int64 DEFAULT -1,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, ts_ms)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.gpu_health_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `down_seconds` Float64,
    `capacity_seconds` Float64,
    `max_temperature_c` Nullable(Float64),
    `avg_temperature_c` Nullable(Float64),
    `xid_count` UInt64,
    `xid_codes` String,
    `down_reasons` String
)
AS SELECT
    u.day AS day,
    u.cluster AS cluster,
    u.node AS node,
    u.gpu_uuid AS gpu_uuid,
    u.gpu_model AS gpu_model,
    u.down_seconds AS down_seconds,
    u.capacity_seconds AS capacity_seconds,
    h.max_temperature_c AS max_temperature_c,
    h.avg_temperature_c AS avg_temperature_c,
    h.xid_count AS xid_count,
    h.xid_codes AS xid_codes,
    h.down_reasons AS down_reasons
FROM
(
    SELECT
        day,
        cluster,
        node,
        gpu_uuid,
        gpu_model,
        sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds,
        sum(gpu_ms) / 1000 AS capacity_seconds
    FROM {db}.usage_raw
    GROUP BY
        day,
        cluster,
        node,
        gpu_uuid,
        gpu_model
) AS u
LEFT JOIN
(
    SELECT
        day,
        cluster,
        gpu_uuid,
        maxOrNull(temperature_c) AS max_temperature_c,
        avgOrNull(temperature_c) AS avg_temperature_c,
        sum(length(xid_errors)) AS xid_count,
        arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArray(xid_errors))), ' ') AS xid_codes,
        arrayStringConcat(arraySort(groupUniqArrayIf(down_reason, down_reason != '')), '; ') AS down_reasons
    FROM {db}.gpu_health
    GROUP BY
        day,
        cluster,
        gpu_uuid
) AS h ON (u.day = h.day) AND (u.cluster = h.cluster) AND (u.gpu_uuid = h.gpu_uuid);

CREATE VIEW {db}.gpu_health_samples
(
    `ts` DateTime64(3, 'UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `health` LowCardinality(String),
    `down_reason` String,
    `temperature_c` Nullable(Float64),
    `power_w` Nullable(Float64),
    `util_gpu_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `xid_errors` Array(UInt32),
    `xid_count` UInt64
)
AS SELECT
    fromUnixTimestamp64Milli(ts_ms, 'UTC') AS ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    health,
    down_reason,
    temperature_c,
    power_w,
    util_gpu_pct,
    mem_used_bytes,
    xid_errors,
    length(xid_errors) AS xid_count
FROM {db}.gpu_health;

CREATE VIEW {db}.gpu_load_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
AS SELECT
    toStartOfFiveMinutes(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    queue,
    sum(gpu_ms) AS total_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_gpu_ms
FROM {db}.usage_raw
GROUP BY
    ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    queue;

CREATE VIEW {db}.idle_waste_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `tenant` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64
)
AS SELECT
    day,
    cluster,
    queue,
    tenant,
    gpu_model,
    sum(gpu_ms) / 3600000 AS idle_gpu_hours,
    sum(effective_gpu_ms) / 3600000 AS idle_effective_gpu_hours,
    sum(cost_micros) / 1000000. AS idle_cost
FROM {db}.usage_by_job_daily
WHERE (state = 'allocated_idle') AND (job_id != '')
GROUP BY
    day,
    cluster,
    queue,
    tenant,
    gpu_model;

CREATE VIEW {db}.job_attempts
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` String,
    `queue` String,
    `priority` Int32,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `allocated_gpus` SimpleAggregateFunction(max, Float64),
    `queued_ms` Nullable(Int64),
    `allocated_ms` Nullable(Int64),
    `started_ms` Nullable(Int64),
    `ended_ms` Nullable(Int64),
    `outcome` String,
    `events` UInt64,
    `first_seen_ms` SimpleAggregateFunction(min, Int64),
    `last_seen_ms` SimpleAggregateFunction(max, Int64),
    `queue_wait_ms` Nullable(Int64)
)
AS SELECT
    *,
    allocated_ms - queued_ms AS queue_wait_ms
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
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
    FROM {db}.job_attempts_state
    GROUP BY
        cluster,
        job_id,
        attempt
);

CREATE MATERIALIZED VIEW {db}.job_attempts_mv TO {db}.job_attempts_state
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` AggregateFunction(argMin, String, Int64),
    `queue` AggregateFunction(argMin, String, Int64),
    `priority` AggregateFunction(argMin, Int32, Int64),
    `requested_gpus` Float64,
    `allocated_gpus` Float64,
    `queued_ms` AggregateFunction(min, Nullable(Int64)),
    `allocated_ms` AggregateFunction(min, Nullable(Int64)),
    `started_ms` AggregateFunction(min, Nullable(Int64)),
    `ended_ms` AggregateFunction(min, Nullable(Int64)),
    `outcome` AggregateFunction(argMin, String, Int64),
    `events` AggregateFunction(uniqExact, String),
    `first_seen_ms` Int64,
    `last_seen_ms` Int64
)
AS SELECT
    cluster,
    job_id,
    attempt,
    argMinState(tenant, ts_ms) AS tenant,
    argMinState(queue, ts_ms) AS queue,
    argMinState(priority, ts_ms) AS priority,
    max(requested_gpus) AS requested_gpus,
    max(if(kind = 'allocated', arraySum(gpu_share_milli) / 1000, 0.)) AS allocated_gpus,
    minState(if((kind IN ('submitted', 'queued', 'retried')), ts_ms, NULL)) AS queued_ms,
    minState(if(kind = 'allocated', ts_ms, NULL)) AS allocated_ms,
    minState(if(kind = 'started', ts_ms, NULL)) AS started_ms,
    minState(if((kind IN ('completed', 'failed', 'preempted', 'cancelled')), ts_ms, NULL)) AS ended_ms,
    argMinStateIf(kind, ts_ms, (kind IN ('completed', 'failed', 'preempted', 'cancelled'))) AS outcome,
    uniqExactState(event_id) AS events,
    min(ts_ms) AS first_seen_ms,
    max(ts_ms) AS last_seen_ms
FROM {db}.job_events
GROUP BY
    cluster,
    job_id,
    attempt;

CREATE TABLE {db}.job_attempts_state
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` AggregateFunction(argMin, String, Int64),
    `queue` AggregateFunction(argMin, String, Int64),
    `priority` AggregateFunction(argMin, Int32, Int64),
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `allocated_gpus` SimpleAggregateFunction(max, Float64),
    `queued_ms` AggregateFunction(min, Nullable(Int64)),
    `allocated_ms` AggregateFunction(min, Nullable(Int64)),
    `started_ms` AggregateFunction(min, Nullable(Int64)),
    `ended_ms` AggregateFunction(min, Nullable(Int64)),
    `outcome` AggregateFunction(argMin, String, Int64),
    `events` AggregateFunction(uniqExact, String),
    `first_seen_ms` SimpleAggregateFunction(min, Int64),
    `last_seen_ms` SimpleAggregateFunction(max, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (cluster, job_id, attempt)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.job_cost
(
    `cluster` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `definition_version` LowCardinality(String),
    `attempts` UInt64,
    `failed_attempts` UInt64,
    `last_outcome` String,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `gpu_hours` Float64,
    `executing_gpu_hours` Float64,
    `idle_gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` Int128,
    `energy_kwh` Float64,
    `first_day` Nullable(Date),
    `last_day` Nullable(Date),
    `queue_wait_seconds` Float64,
    `queue_wait_gpu_hours` Float64,
    `priced_by_default_gpu_hours` Float64
)
AS WITH
    u AS
    (
        SELECT
            cluster,
            job_id,
            definition_version,
            toUInt8(1) AS u_seen,
            min(tenant) AS u_tenant,
            min(queue) AS u_queue,
            uniqExact(attempt) AS u_attempts,
            sum(gpu_ms) AS u_gpu_ms,
            sumIf(gpu_ms, state = 'executing') AS u_executing_gpu_ms,
            sumIf(gpu_ms, state = 'allocated_idle') AS u_idle_gpu_ms,
            sum(effective_gpu_ms) AS u_effective_gpu_ms,
            sum(cost_micros) AS u_cost_micros,
            sum(energy_j) AS u_energy_j,
            min(day) AS u_first_day,
            max(day) AS u_last_day,
            sum(priced_by_default_gpu_ms) AS u_priced_by_default_gpu_ms
        FROM {db}.usage_by_job_daily
        WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
        GROUP BY
            cluster,
            job_id,
            definition_version
    ),
    a AS
    (
        SELECT
            cluster,
            job_id,
            argMin(tenant, attempt) AS a_tenant,
            argMin(queue, attempt) AS a_queue,
            count() AS a_attempts,
            countIf(outcome = 'failed') AS a_failed_attempts,
            argMax(outcome, attempt) AS a_last_outcome,
            max(requested_gpus) AS a_requested_gpus,
            sum(coalesce(queue_wait_ms, 0)) / 1000 AS a_queue_wait_seconds,
            sum(coalesce(queue_wait_ms, 0) * requested_gpus) / 3600000 AS a_queue_wait_gpu_hours
        FROM {db}.job_attempts
        GROUP BY
            cluster,
            job_id
    )
SELECT
    cluster,
    job_id,
    if(a_tenant != '', a_tenant, u_tenant) AS tenant,
    if(a_queue != '', a_queue, u_queue) AS queue,
    definition_version,
    greatest(a_attempts, u_attempts) AS attempts,
    a_failed_attempts AS failed_attempts,
    a_last_outcome AS last_outcome,
    a_requested_gpus AS requested_gpus,
    u_gpu_ms / 3600000 AS gpu_hours,
    u_executing_gpu_ms / 3600000 AS executing_gpu_hours,
    u_idle_gpu_ms / 3600000 AS idle_gpu_hours,
    u_effective_gpu_ms / 3600000 AS effective_gpu_hours,
    u_cost_micros / 1000000. AS cost,
    u_cost_micros AS cost_micros,
    u_energy_j / 3600000 AS energy_kwh,
    if(u_seen = 1, u_first_day, NULL) AS first_day,
    if(u_seen = 1, u_last_day, NULL) AS last_day,
    a_queue_wait_seconds AS queue_wait_seconds,
    a_queue_wait_gpu_hours AS queue_wait_gpu_hours,
    u_priced_by_default_gpu_ms / 3600000 AS priced_by_default_gpu_hours
FROM u
FULL OUTER JOIN a USING (cluster, job_id);

CREATE VIEW {db}.job_cost_by_attempt
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `attempt_label` String,
    `gpu_model` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `outcome` String,
    `line` String,
    `gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` SimpleAggregateFunction(sum, UInt64)
)
AS SELECT
    u.day AS day,
    u.cluster AS cluster,
    u.tenant AS tenant,
    u.queue AS queue,
    u.job_id AS job_id,
    u.attempt AS attempt,
    concat('attempt ', toString(u.attempt)) AS attempt_label,
    u.gpu_model AS gpu_model,
    u.definition_version AS definition_version,
    a.outcome AS outcome,
    multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
    u.gpu_ms / 3600000 AS gpu_hours,
    u.effective_gpu_ms / 3600000 AS effective_gpu_hours,
    u.cost_micros / 1000000. AS cost,
    u.cost_micros AS cost_micros
FROM {db}.usage_by_job_daily AS u
LEFT JOIN
(
    SELECT
        cluster,
        job_id,
        attempt,
        outcome
    FROM {db}.job_attempts
) AS a ON (u.cluster = a.cluster) AND (u.job_id = a.job_id) AND (u.attempt = a.attempt)
WHERE (u.state IN ('executing', 'allocated_idle')) AND (u.job_id != '');

CREATE VIEW {db}.job_cost_for
AS SELECT *
FROM {db}.job_cost
WHERE tenant = {tenant:String};

CREATE TABLE {db}.job_events
(
    `schema_version` UInt8,
    `event_id` String,
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `kind` String,
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` String,
    `queue` String,
    `priority` Int32,
    `requested_gpus` Float64,
    `gpu_nodes` Array(String),
    `gpu_uuids` Array(String),
    `gpu_share_milli` Array(UInt16),
    `gpu_container_ids` Array(String),
    `aliases` Map(String, String),
    `reason` String,
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, job_id, attempt, ts_ms, event_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.job_gpu_balance
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `gpu` String,
    `executing_gpu_seconds` Float64,
    `idle_gpu_seconds` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `mean_util_pct` Nullable(Float64),
    `first_start_ms` Int64,
    `last_end_ms` Int64
)
AS SELECT
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model,
    concat(toString(node), '/', substring(gpu_uuid, 5, 8)) AS gpu,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS idle_gpu_seconds,
    sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_gpu_ms,
    if(util_gpu_ms = 0, NULL, util_weighted_gpu_ms / util_gpu_ms) AS mean_util_pct,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM {db}.usage_raw
WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
GROUP BY
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model;

CREATE VIEW {db}.job_idle_stretches
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `stretch_start` DateTime64(3, 'UTC'),
    `stretch_end` DateTime64(3, 'UTC'),
    `duration_seconds` Float64,
    `idle_gpu_seconds` Float64,
    `offset_ms` Int64
)
AS SELECT
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model,
    fromUnixTimestamp64Milli(min(start_ms), 'UTC') AS stretch_start,
    fromUnixTimestamp64Milli(max(end_ms), 'UTC') AS stretch_end,
    (max(end_ms) - min(start_ms)) / 1000 AS duration_seconds,
    sum(gpu_ms) / 1000 AS idle_gpu_seconds,
    min(start_ms) - any(attempt_start_ms) AS offset_ms
FROM
(
    SELECT
        *,
        sum(is_new) OVER (PARTITION BY cluster, gpu_uuid, job_id, attempt ORDER BY start_ms ASC ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS stretch
    FROM
    (
        SELECT
            cluster,
            tenant,
            queue,
            job_id,
            attempt,
            node,
            gpu_uuid,
            gpu_model,
            start_ms,
            end_ms,
            gpu_ms,
            state,
            min(start_ms) OVER (PARTITION BY cluster, job_id, attempt) AS attempt_start_ms,
            if((state = 'allocated_idle') AND (lagInFrame(state, 1, '') OVER w = 'allocated_idle') AND (lagInFrame(end_ms, 1, toInt64(-1)) OVER w = start_ms), 0, 1) AS is_new
        FROM {db}.usage_raw
        WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
        WINDOW w AS (PARTITION BY cluster, gpu_uuid, job_id, attempt ORDER BY start_ms ASC ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    )
)
WHERE state = 'allocated_idle'
GROUP BY
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model,
    stretch;

CREATE VIEW {db}.job_util_histogram
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `util_bucket_pct` UInt8,
    `util_bucket` String,
    `gpu_seconds` Float64,
    `slices` UInt64
)
AS SELECT
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    toUInt8(least(floor(assumeNotNull(util_pct) / 10), 9) * 10) AS util_bucket_pct,
    concat(leftPad(toString(util_bucket_pct), 2, '0'), '-', toString(util_bucket_pct + 10), '%') AS util_bucket,
    sum(gpu_ms) / 1000 AS gpu_seconds,
    count() AS slices
FROM {db}.usage_raw
WHERE (state = 'executing') AND (util_pct IS NOT NULL) AND (job_id != '')
GROUP BY
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    util_bucket_pct;

CREATE VIEW {db}.my_job_cost
(
    `cluster` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `definition_version` LowCardinality(String),
    `attempts` UInt64,
    `failed_attempts` UInt64,
    `last_outcome` String,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `gpu_hours` Float64,
    `executing_gpu_hours` Float64,
    `idle_gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` UInt64,
    `energy_kwh` Float64,
    `first_day` Nullable(Date),
    `last_day` Nullable(Date),
    `queue_wait_seconds` Float64,
    `queue_wait_gpu_hours` Float64
)
AS SELECT *
FROM {db}.job_cost
WHERE tenant IN (
    SELECT tenant
    FROM {db}.tenant_access
    FINAL
    WHERE (active = 1) AND ((principal = currentUser()) OR has(currentRoles(), principal))
);

CREATE VIEW {db}.my_tenant_daily_bill
(
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_gpu_hours` Float64,
    `compute_effective_gpu_hours` Float64,
    `compute_cost` Float64,
    `compute_cost_micros` UInt64,
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64,
    `idle_cost_micros` UInt64,
    `failed_retry_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `failed_retry_cost` Float64,
    `failed_retry_cost_micros` UInt64,
    `total_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_cost` Float64,
    `total_cost_micros` UInt64
)
AS SELECT *
FROM {db}.tenant_daily_bill
WHERE tenant IN (
    SELECT tenant
    FROM {db}.tenant_access
    FINAL
    WHERE (active = 1) AND ((principal = currentUser()) OR has(currentRoles(), principal))
);

CREATE TABLE {db}.node_inventory
(
    `cluster` LowCardinality(String),
    `node` String,
    `seen_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(seen_ms, 'UTC')),
    `gpu_count` UInt16,
    `gpu_uuids` Array(String),
    `gpu_models` Array(String),
    `source` LowCardinality(String) DEFAULT '',
    `kafka_topic` LowCardinality(String) DEFAULT '',
    `kafka_partition` Int32 DEFAULT -1,
    `kafka_offset` Int64 DEFAULT -1,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(seen_ms)
ORDER BY (cluster, node)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE TABLE {db}.prices
(
    `model` LowCardinality(String),
    `valid_from` Date,
    `version` String,
    `depreciation_per_hour` Float64,
    `maintenance_per_hour` Float64,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.queue_efficiency
(
    `day` Date,
    `cluster` String,
    `queue` String,
    `attempts` UInt64,
    `requested_gpu_seconds` Float64,
    `allocated_gpu_seconds` Float64,
    `executed_gpu_seconds` Float64,
    `allocated_to_requested` Nullable(Float64),
    `executed_to_allocated` Nullable(Float64),
    `executed_to_requested` Nullable(Float64),
    `waits` UInt64,
    `queue_wait_p50_s` Nullable(Float64),
    `queue_wait_p90_s` Nullable(Float64),
    `queue_wait_p99_s` Nullable(Float64),
    `queue_wait_mean_s` Nullable(Float64),
    `queue_wait_max_s` Nullable(Float64)
)
AS WITH
    u AS
    (
        SELECT
            cluster,
            job_id,
            attempt,
            sumIf(gpu_ms, (state IN ('allocated_idle', 'executing'))) AS u_allocated_gpu_ms,
            sumIf(gpu_ms, state = 'executing') AS u_executed_gpu_ms,
            max(last_end_ms) AS u_last_end_ms
        FROM {db}.usage_by_job_daily
        WHERE job_id != ''
        GROUP BY
            cluster,
            job_id,
            attempt
    )
SELECT
    day,
    cluster,
    queue,
    attempts,
    requested_gpu_seconds,
    allocated_gpu_seconds,
    executed_gpu_seconds,
    if(requested_gpu_seconds = 0, NULL, allocated_gpu_seconds / requested_gpu_seconds) AS allocated_to_requested,
    if(allocated_gpu_seconds = 0, NULL, executed_gpu_seconds / allocated_gpu_seconds) AS executed_to_allocated,
    if(requested_gpu_seconds = 0, NULL, executed_gpu_seconds / requested_gpu_seconds) AS executed_to_requested,
    waits,
    round(wait_p50, 3) AS queue_wait_p50_s,
    round(wait_p90, 3) AS queue_wait_p90_s,
    round(wait_p99, 3) AS queue_wait_p99_s,
    round(wait_mean, 3) AS queue_wait_mean_s,
    round(wait_max, 3) AS queue_wait_max_s
FROM
(
    SELECT
        toDate(fromUnixTimestamp64Milli(coalesce(a.queued_ms, a.first_seen_ms), 'UTC')) AS day,
        a.cluster AS cluster,
        a.queue AS queue,
        count() AS attempts,
        sum(a.requested_gpus * (coalesce(a.ended_ms, greatest(a.last_seen_ms, u.u_last_end_ms)) - coalesce(a.queued_ms, a.first_seen_ms))) / 1000 AS requested_gpu_seconds,
        sum(u.u_allocated_gpu_ms) / 1000 AS allocated_gpu_seconds,
        sum(u.u_executed_gpu_ms) / 1000 AS executed_gpu_seconds,
        count(a.queue_wait_ms) AS waits,
        quantileExactInclusive(0.5)(a.queue_wait_ms / 1000) AS wait_p50,
        quantileExactInclusive(0.9)(a.queue_wait_ms / 1000) AS wait_p90,
        quantileExactInclusive(0.99)(a.queue_wait_ms / 1000) AS wait_p99,
        avg(a.queue_wait_ms / 1000) AS wait_mean,
        max(a.queue_wait_ms / 1000) AS wait_max
    FROM {db}.job_attempts AS a
    LEFT JOIN u ON (a.cluster = u.cluster) AND (a.job_id = u.job_id) AND (a.attempt = u.attempt)
    GROUP BY
        day,
        cluster,
        queue
);

CREATE TABLE {db}.rebill_runs
(
    `rebill_id` String,
    `day_from` Date,
    `day_to` Date,
    `coefficients_as_of` Date,
    `created_at` DateTime64(3, 'UTC') DEFAULT now64(3),
    `cost_recomputed` Bool DEFAULT false
)
ENGINE = MergeTree
ORDER BY rebill_id
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.rebilled_usage
(
    `rebill_id` String,
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `coefficient` Float64,
    `coefficient_version` String,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `original_cost_micros` Int128 DEFAULT cost_micros,
    `energy_j` Float64 DEFAULT 0,
    `price_version` String DEFAULT '',
    `priced_by_default` Bool DEFAULT false
)
ENGINE = MergeTree
ORDER BY (rebill_id, day, tenant, job_id, attempt, gpu_model, state)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.scheduler_preemptions
(
    `cluster` LowCardinality(String),
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `queue` LowCardinality(String),
    `job_id` String,
    `by_job_id` String,
    `rule` LowCardinality(String),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms, job_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE TABLE {db}.scheduler_snapshots
(
    `schema_version` UInt8,
    `cluster` LowCardinality(String),
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `queue` LowCardinality(String),
    `queue_priority` Int32,
    `quota_gpus` Float64,
    `allocated_gpus` Float64,
    `pending_jobs` UInt32,
    `pending_gpus` Float64,
    `pending_priorities` Array(Int32),
    `pending_jobs_by_priority` Array(UInt32),
    `pending_gpus_by_priority` Array(Float64),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE TABLE {db}.schema_migrations
(
    `version` String,
    `name` String,
    `checksum` String,
    `applied_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY version
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.sink_progress
(
    `consumer` String,
    `topic` String,
    `partition` Int32,
    `epoch` UInt32,
    `from_offset` Int64,
    `to_offset` Int64,
    `phase` LowCardinality(String),
    `horizons` Map(String, Int64),
    `seq` UInt64,
    `written_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (consumer, topic, partition)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.tenant_access
(
    `principal` String,
    `tenant` String,
    `active` UInt8 DEFAULT 1,
    `granted_by` String DEFAULT '',
    `granted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(granted_at)
ORDER BY (principal, tenant)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.tenant_daily_bill
(
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_gpu_hours` Float64,
    `compute_effective_gpu_hours` Float64,
    `compute_cost` Float64,
    `compute_cost_micros` Int128,
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64,
    `idle_cost_micros` Int128,
    `failed_retry_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `failed_retry_cost` Float64,
    `failed_retry_cost_micros` Int128,
    `total_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_cost` Float64,
    `total_cost_micros` Int128,
    `priced_by_default_gpu_hours` Float64
)
AS SELECT
    day,
    tenant,
    definition_version,
    sumIf(line_gpu_ms, line = 'compute') / 3600000 AS compute_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'compute') / 3600000 AS compute_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'compute') / 1000000. AS compute_cost,
    sumIf(line_cost_micros, line = 'compute') AS compute_cost_micros,
    sumIf(line_gpu_ms, line = 'idle') / 3600000 AS idle_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'idle') / 1000000. AS idle_cost,
    sumIf(line_cost_micros, line = 'idle') AS idle_cost_micros,
    sumIf(line_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'failed_retry') / 1000000. AS failed_retry_cost,
    sumIf(line_cost_micros, line = 'failed_retry') AS failed_retry_cost_micros,
    sum(line_gpu_ms) / 3600000 AS total_gpu_hours,
    sum(line_effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(line_cost_micros) / 1000000. AS total_cost,
    sum(line_cost_micros) AS total_cost_micros,
    sum(line_priced_by_default_gpu_ms) / 3600000 AS priced_by_default_gpu_hours
FROM
(
    SELECT
        u.day AS day,
        u.tenant AS tenant,
        u.definition_version AS definition_version,
        multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
        u.gpu_ms AS line_gpu_ms,
        u.effective_gpu_ms AS line_effective_gpu_ms,
        u.cost_micros AS line_cost_micros,
        u.priced_by_default_gpu_ms AS line_priced_by_default_gpu_ms
    FROM {db}.usage_by_job_daily AS u
    LEFT JOIN
    (
        SELECT
            cluster,
            job_id,
            attempt,
            outcome
        FROM {db}.job_attempts
    ) AS a ON (u.cluster = a.cluster) AND (u.job_id = a.job_id) AND (u.attempt = a.attempt)
    WHERE (u.state IN ('executing', 'allocated_idle')) AND (u.job_id != '')
)
GROUP BY
    day,
    tenant,
    definition_version;

CREATE VIEW {db}.tenant_daily_bill_for
AS SELECT *
FROM {db}.tenant_daily_bill
WHERE tenant = {tenant:String};

CREATE VIEW {db}.tenant_daily_rebill
(
    `rebill_id` String,
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_effective_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_gpu_hours` Float64,
    `total_cost_micros` Int128,
    `compute_cost_micros` Int128,
    `idle_cost_micros` Int128,
    `failed_retry_cost_micros` Int128,
    `original_total_cost_micros` Int128,
    `priced_by_default_gpu_hours` Float64
)
AS SELECT
    r.rebill_id AS rebill_id,
    r.day AS day,
    r.tenant AS tenant,
    r.definition_version AS definition_version,
    sumIf(r.effective_gpu_ms, (r.state = 'executing') AND (a.outcome != 'failed')) / 3600000 AS compute_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, r.state = 'allocated_idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, (r.state = 'executing') AND (a.outcome = 'failed')) / 3600000 AS failed_retry_effective_gpu_hours,
    sum(r.effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(r.gpu_ms) / 3600000 AS total_gpu_hours,
    sum(r.cost_micros) AS total_cost_micros,
    sumIf(r.cost_micros, (r.state = 'executing') AND (a.outcome != 'failed')) AS compute_cost_micros,
    sumIf(r.cost_micros, r.state = 'allocated_idle') AS idle_cost_micros,
    sumIf(r.cost_micros, (r.state = 'executing') AND (a.outcome = 'failed')) AS failed_retry_cost_micros,
    sum(r.original_cost_micros) AS original_total_cost_micros,
    sumIf(r.gpu_ms, r.priced_by_default) / 3600000 AS priced_by_default_gpu_hours
FROM {db}.rebilled_usage AS r
LEFT JOIN
(
    SELECT
        cluster,
        job_id,
        attempt,
        outcome
    FROM {db}.job_attempts
) AS a ON (r.cluster = a.cluster) AND (r.job_id = a.job_id) AND (r.attempt = a.attempt)
WHERE (r.state IN ('executing', 'allocated_idle')) AND (r.job_id != '')
GROUP BY
    rebill_id,
    day,
    tenant,
    definition_version;

CREATE TABLE {db}.usage_by_job_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `slices` SimpleAggregateFunction(sum, UInt64),
    `gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `effective_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `cost_micros` SimpleAggregateFunction(sum, Int128),
    `energy_j` SimpleAggregateFunction(sum, Float64),
    `util_weighted_gpu_ms` SimpleAggregateFunction(sum, Float64),
    `util_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `first_start_ms` SimpleAggregateFunction(min, Int64),
    `last_end_ms` SimpleAggregateFunction(max, Int64),
    `priced_by_default_gpu_ms` SimpleAggregateFunction(sum, UInt64) DEFAULT 0
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW {db}.usage_by_job_daily_mv TO {db}.usage_by_job_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `slices` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `energy_j` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `first_start_ms` Int64,
    `last_end_ms` Int64,
    `priced_by_default_gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    state,
    definition_version,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    state,
    definition_version;

CREATE TABLE {db}.usage_capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` AggregateFunction(uniqExact, String),
    `slices` SimpleAggregateFunction(sum, UInt64),
    `gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `effective_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `cost_micros` SimpleAggregateFunction(sum, Int128),
    `energy_j` SimpleAggregateFunction(sum, Float64),
    `util_weighted_gpu_ms` SimpleAggregateFunction(sum, Float64),
    `util_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `priced_by_default_gpu_ms` SimpleAggregateFunction(sum, UInt64) DEFAULT 0
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, gpu_model, state, definition_version)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW {db}.usage_capacity_daily_mv TO {db}.usage_capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` AggregateFunction(uniqExact, String),
    `slices` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `energy_j` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `priced_by_default_gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    gpu_model,
    state,
    definition_version,
    uniqExactState(gpu_uuid) AS gpus,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    gpu_model,
    state,
    definition_version;

CREATE VIEW {db}.usage_dedup_audit
(
    `day` Date,
    `source_table` String,
    `rows` UInt64,
    `distinct_records` UInt64,
    `duplicates` Int64
)
AS WITH
    ids AS
    (
        SELECT
            day,
            uniqExact(cluster, record_id) AS distinct_records
        FROM {db}.usage_raw
        GROUP BY day
    )
SELECT
    t.day AS day,
    t.source_table AS source_table,
    t.rows AS rows,
    ids.distinct_records AS distinct_records,
    toInt64(t.rows) - toInt64(ids.distinct_records) AS duplicates
FROM
(
    SELECT
        day,
        'usage_raw' AS source_table,
        count() AS rows
    FROM {db}.usage_raw
    GROUP BY day
    UNION ALL
    SELECT
        day,
        'usage_by_job_daily' AS source_table,
        sum(slices) AS rows
    FROM {db}.usage_by_job_daily
    GROUP BY day
    UNION ALL
    SELECT
        day,
        'usage_capacity_daily' AS source_table,
        sum(slices) AS rows
    FROM {db}.usage_capacity_daily
    GROUP BY day
) AS t
INNER JOIN ids ON ids.day = t.day;

CREATE TABLE {db}.usage_raw
(
    `schema_version` UInt8,
    `record_id` String,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `start_ms` Int64,
    `end_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(start_ms, 'UTC')),
    `state` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `share_milli` UInt16,
    `gpu_ms` UInt64,
    `util_pct` Nullable(Float64),
    `util_metric_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `energy_j` Float64,
    `coefficient` Float64,
    `coefficient_version` LowCardinality(String),
    `effective_gpu_ms` UInt64,
    `cost_micros` UInt64,
    `definition_version` LowCardinality(String),
    `price_version` LowCardinality(String) DEFAULT '',
    `priced_by_default` Bool DEFAULT false,
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, start_ms, record_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.utilization_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `capacity_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `allocated_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `executing_effective_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `unallocated_cost` Float64
)
AS SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day,
    cluster,
    gpu_model,
    sum(gpu_ms) AS capacity_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, (state IN ('allocated_idle', 'executing'))) AS allocated_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(effective_gpu_ms, state = 'executing') AS executing_effective_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_gpu_ms,
    sumIf(cost_micros, state = 'unallocated') / 1000000. AS unallocated_cost
FROM {db}.usage_raw
GROUP BY
    hour,
    day,
    cluster,
    gpu_model;
