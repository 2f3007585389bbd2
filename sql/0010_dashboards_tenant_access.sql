-- Read models behind the Superset dashboards (superset/bundle) and the periodic reports
-- (gpuledger/warehouse/periodic/commands.py), GPU health samples, and per-tenant access.
--
-- Every view here is plain SQL over the ledger's tables, so the dashboards, the reports and ad-hoc
-- SQL agree by construction. Units: *_gpu_ms / *_gpu_seconds / *_gpu_hours as named, cost in
-- currency units, utilization percent (0..100) where named *_pct.

-- Line 1's health fields, one row per GPU per tick: what the operations view shows as a GPU's health
-- record (temperature, Xid errors, down reason). Written by whoever consumes gpu-samples into the
-- warehouse (gpuledger.superset.health_rows turns a NodeTick into these rows); the views below work (with empty health columns) without it.
CREATE TABLE IF NOT EXISTS gpu_health
(
    cluster         LowCardinality(String),
    node            LowCardinality(String),
    gpu_uuid        String,
    gpu_model       LowCardinality(String),
    ts_ms           Int64,
    interval_ms     UInt32,
    day             Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    health          LowCardinality(String),
    down_reason     String,
    temperature_c   Nullable(Float64),
    power_w         Nullable(Float64),
    util_gpu_pct    Nullable(Float64),
    mem_used_bytes  Nullable(UInt64),
    xid_errors      Array(UInt32),
    ecc_dbe_total   Nullable(UInt64),
    kafka_topic     LowCardinality(String) DEFAULT '',
    kafka_partition Int32 DEFAULT -1,
    kafka_offset    Int64 DEFAULT -1,
    inserted_at     DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, ts_ms);

CREATE VIEW IF NOT EXISTS gpu_health_samples AS
SELECT
    fromUnixTimestamp64Milli(ts_ms, 'UTC') AS ts,
    day, cluster, node, gpu_uuid, gpu_model, health, down_reason,
    temperature_c, power_w, util_gpu_pct, mem_used_bytes, xid_errors,
    length(xid_errors) AS xid_count
FROM gpu_health;

-- Per-tenant access (row-level security). One row grants a principal (a Superset role, or a
-- ClickHouse role where the server has access management) the rows of one tenant; the latest row
-- per (principal, tenant) wins, active = 0 revokes. `gpuledger superset import --grants-from-warehouse`
-- turns the active grants into Superset row-level-security rules on the tenant-scoped datasets.
-- (chDB has no users or roles, so ClickHouse row policies are not created here.)
CREATE TABLE IF NOT EXISTS tenant_access
(
    principal   String,
    tenant      String,
    active      UInt8 DEFAULT 1,
    granted_by  String DEFAULT '',
    granted_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(granted_at)
ORDER BY (principal, tenant);

-- ---------------------------------------------------------------- operations
-- Every GPU as of its last usage slice: state, the job(s), tenant(s) and queue(s) on it then.
-- A shared GPU lists every holder (job_id/tenant/queue are the first, jobs/tenants/queues all).
CREATE VIEW IF NOT EXISTS gpu_current AS
SELECT
    u.cluster AS cluster,
    u.node AS node,
    u.gpu_uuid AS gpu_uuid,
    u.gpu_model AS gpu_model,
    multiIf(countIf(u.state = 'down') > 0, 'down',
            countIf(u.state = 'executing') > 0, 'executing',
            countIf(u.state = 'allocated_idle') > 0, 'allocated_idle', 'unallocated') AS state,
    minIf(u.job_id, u.job_id != '') AS job_id,
    minIf(u.tenant, u.tenant != '') AS tenant,
    minIf(u.queue, u.queue != '') AS queue,
    arrayStringConcat(arraySort(groupUniqArrayIf(u.job_id, u.job_id != '')), ' ') AS jobs,
    arrayStringConcat(arraySort(groupUniqArrayIf(toString(u.tenant), u.tenant != '')), ' ') AS tenants,
    arrayStringConcat(arraySort(groupUniqArrayIf(toString(u.queue), u.queue != '')), ' ') AS queues,
    sumIf(u.share_milli, u.job_id != '') / 1000 AS allocated_share,
    maxOrNull(u.util_pct) AS util_pct,
    fromUnixTimestamp64Milli(max(u.end_ms), 'UTC') AS last_seen
FROM usage_raw AS u
INNER JOIN
(
    SELECT cluster, gpu_uuid, max(end_ms) AS last_end_ms FROM usage_raw GROUP BY cluster, gpu_uuid
) AS l ON u.cluster = l.cluster AND u.gpu_uuid = l.gpu_uuid AND u.end_ms = l.last_end_ms
GROUP BY u.cluster, u.node, u.gpu_uuid, u.gpu_model;

-- Load history per GPU in 5-minute buckets (bucket of each slice's start), by the queue holding it
-- ('' for down/unallocated time).
CREATE VIEW IF NOT EXISTS gpu_load_5m AS
SELECT
    toStartOfFiveMinutes(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS ts,
    day, cluster, node, gpu_uuid, gpu_model, queue,
    sum(gpu_ms) AS total_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_gpu_ms
FROM usage_raw
GROUP BY ts, day, cluster, node, gpu_uuid, gpu_model, queue;

-- Health record per GPU and day: down time from the usage records, temperature and Xid errors from
-- the health samples.
CREATE VIEW IF NOT EXISTS gpu_health_daily AS
SELECT
    u.day AS day, u.cluster AS cluster, u.node AS node, u.gpu_uuid AS gpu_uuid, u.gpu_model AS gpu_model,
    u.down_seconds AS down_seconds,
    u.capacity_seconds AS capacity_seconds,
    h.max_temperature_c AS max_temperature_c,
    h.avg_temperature_c AS avg_temperature_c,
    h.xid_count AS xid_count,
    h.xid_codes AS xid_codes,
    h.down_reasons AS down_reasons
FROM
(
    SELECT day, cluster, node, gpu_uuid, gpu_model,
        sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds,
        sum(gpu_ms) / 1000 AS capacity_seconds
    FROM usage_raw
    GROUP BY day, cluster, node, gpu_uuid, gpu_model
) AS u
LEFT JOIN
(
    SELECT day, cluster, gpu_uuid,
        maxOrNull(temperature_c) AS max_temperature_c,
        avgOrNull(temperature_c) AS avg_temperature_c,
        sum(length(xid_errors)) AS xid_count,
        arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArray(xid_errors))), ' ') AS xid_codes,
        arrayStringConcat(arraySort(groupUniqArrayIf(down_reason, down_reason != '')), '; ') AS down_reasons
    FROM gpu_health
    GROUP BY day, cluster, gpu_uuid
) AS h ON u.day = h.day AND u.cluster = h.cluster AND u.gpu_uuid = h.gpu_uuid;

-- ---------------------------------------------------------------- algorithm (tenant-scoped)
-- Utilization distribution: executing GPU-time of each job attempt by 10-point utilization bucket.
CREATE VIEW IF NOT EXISTS job_util_histogram AS
SELECT
    cluster, tenant, queue, job_id, attempt, gpu_model,
    toUInt8(least(floor(assumeNotNull(util_pct) / 10), 9) * 10) AS util_bucket_pct,
    concat(leftPad(toString(util_bucket_pct), 2, '0'), '-', toString(util_bucket_pct + 10), '%') AS util_bucket,
    sum(gpu_ms) / 1000 AS gpu_seconds,
    count() AS slices
FROM usage_raw
WHERE state = 'executing' AND util_pct IS NOT NULL AND job_id != ''
GROUP BY cluster, tenant, queue, job_id, attempt, gpu_model, util_bucket_pct;

-- Balance across a job's GPUs: per attempt and GPU, executing and idle time and the time-weighted
-- utilization while executing.
CREATE VIEW IF NOT EXISTS job_gpu_balance AS
SELECT
    cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
    concat(toString(node), '/', substring(gpu_uuid, 5, 8)) AS gpu,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS idle_gpu_seconds,
    sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_gpu_ms,
    if(util_gpu_ms = 0, NULL, util_weighted_gpu_ms / util_gpu_ms) AS mean_util_pct,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM usage_raw
WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
GROUP BY cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model;

-- Idle stretches: maximal runs of back-to-back allocated-but-not-executing slices of one attempt on
-- one GPU (loading, checkpoints, hangs, waiting for peers).
CREATE VIEW IF NOT EXISTS job_idle_stretches AS
SELECT
    cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
    fromUnixTimestamp64Milli(min(start_ms), 'UTC') AS stretch_start,
    fromUnixTimestamp64Milli(max(end_ms), 'UTC') AS stretch_end,
    (max(end_ms) - min(start_ms)) / 1000 AS duration_seconds,
    sum(gpu_ms) / 1000 AS idle_gpu_seconds,
    min(start_ms) - any(attempt_start_ms) AS offset_ms
FROM
(
    SELECT *,
        sum(is_new) OVER (PARTITION BY cluster, gpu_uuid, job_id, attempt ORDER BY start_ms
                          ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS stretch
    FROM
    (
        SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms, state,
            min(start_ms) OVER (PARTITION BY cluster, job_id, attempt) AS attempt_start_ms,
            if(state = 'allocated_idle'
               AND lagInFrame(state, 1, '') OVER w = 'allocated_idle'
               AND lagInFrame(end_ms, 1, toInt64(-1)) OVER w = start_ms, 0, 1) AS is_new
        FROM usage_raw
        WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
        WINDOW w AS (PARTITION BY cluster, gpu_uuid, job_id, attempt ORDER BY start_ms
                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
    )
)
WHERE state = 'allocated_idle'
GROUP BY cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, stretch;

-- Job cost by attempt, GPU model and bill line (compute / idle / failed_retry, as in tenant_daily_bill).
CREATE VIEW IF NOT EXISTS job_cost_by_attempt AS
SELECT
    u.day AS day, u.cluster AS cluster, u.tenant AS tenant, u.queue AS queue, u.job_id AS job_id,
    u.attempt AS attempt, concat('attempt ', toString(u.attempt)) AS attempt_label,
    u.gpu_model AS gpu_model, u.definition_version AS definition_version,
    a.outcome AS outcome,
    multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
    u.gpu_ms / 3600000 AS gpu_hours,
    u.effective_gpu_ms / 3600000 AS effective_gpu_hours,
    u.cost_micros / 1e6 AS cost,
    u.cost_micros AS cost_micros
FROM usage_by_job_daily AS u
LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
    ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != '';

-- ---------------------------------------------------------------- management
-- The three utilization layers' ingredients per hour (bucket of each slice's start), cluster and
-- GPU model; ratios are taken after summing (scheduling = allocated / (capacity - down), execution =
-- executing / allocated, hardware = util_weighted / util / 100), exactly as `gpuledger report utilization`.
CREATE VIEW IF NOT EXISTS utilization_hourly AS
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day, cluster, gpu_model,
    sum(gpu_ms) AS capacity_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS allocated_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(effective_gpu_ms, state = 'executing') AS executing_effective_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_gpu_ms,
    sumIf(cost_micros, state = 'unallocated') / 1e6 AS unallocated_cost
FROM usage_raw
GROUP BY hour, day, cluster, gpu_model;

-- Idle waste (allocated but not executing) per day, queue and tenant: the bill's idle line by queue.
CREATE VIEW IF NOT EXISTS idle_waste_daily AS
SELECT
    day, cluster, queue, tenant, gpu_model,
    sum(gpu_ms) / 3600000 AS idle_gpu_hours,
    sum(effective_gpu_ms) / 3600000 AS idle_effective_gpu_hours,
    sum(cost_micros) / 1e6 AS idle_cost
FROM usage_by_job_daily
WHERE state = 'allocated_idle' AND job_id != ''
GROUP BY day, cluster, queue, tenant, gpu_model;
