-- Aggregates for dashboards and reports, and the hourly health history (issue #13, points 2 and 3;
-- docs/retention.md). The views of sql/0010 that scanned usage_raw and gpu_health row by row now read
-- tables that materialized views keep up to date; their names, columns and numbers stay the same.
--
-- Each aggregate is filled by a materialized view from the moment it exists, then back-filled from
-- the rows already stored by an INSERT ... SELECT below, so an upgraded warehouse is complete. Run
-- `gpuledger migrate` for this file with the sinks stopped: rows written between a view's creation and
-- its back-fill would be counted twice (a sink that resumes later writes through the views as usual).
--
-- Every aggregate sums GPU time (gpu_ms) and weights utilization by it; none counts rows as time,
-- so per-tick records and segment records (sql/0017) give the same figures.
--
-- Retention (TTL) is not written here: migrations are checksummed and never change, while retention
-- is configuration. `gpuledger migrate` applies GPULEDGER_RETENTION_* as ALTER TABLE ... MODIFY TTL
-- after the migrations (gpuledger/warehouse/migrations.py, apply_retention).

-- ---------------------------------------------------------------- latest state per GPU
-- One row per GPU after merging. The -ArgMax combinator aggregates only the records with the
-- GPU's latest end_ms, and merges partial states of equal end_ms (several holders of a shared GPU
-- written in different blocks) instead of keeping one of them.
CREATE TABLE IF NOT EXISTS gpu_latest
(
    cluster      LowCardinality(String),
    gpu_uuid     String,
    last_end_ms  SimpleAggregateFunction(max, Int64),
    node         AggregateFunction(maxArgMax, String, Int64),
    gpu_model    AggregateFunction(maxArgMax, String, Int64),
    -- 3 down, 2 executing, 1 allocated_idle, 0 unallocated: the highest rank at the latest end wins
    state_rank   AggregateFunction(maxArgMax, UInt8, Int64),
    job_id       AggregateFunction(minIfArgMax, String, UInt8, Int64),
    tenant       AggregateFunction(minIfArgMax, String, UInt8, Int64),
    queue        AggregateFunction(minIfArgMax, String, UInt8, Int64),
    jobs         AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    tenants      AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    queues       AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    share_milli  AggregateFunction(sumIfArgMax, UInt64, UInt8, Int64),
    -- -1 for no utilization: a NULL argument would make -ArgMax skip the record altogether
    util_pct     AggregateFunction(maxArgMax, Float64, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (cluster, gpu_uuid)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_latest_mv TO gpu_latest AS
SELECT
    cluster, gpu_uuid,
    max(end_ms) AS last_end_ms,
    maxArgMaxState(toString(usage_raw.node), usage_raw.end_ms) AS node,
    maxArgMaxState(toString(usage_raw.gpu_model), usage_raw.end_ms) AS gpu_model,
    maxArgMaxState(toUInt8(multiIf(usage_raw.state = 'down', 3, usage_raw.state = 'executing', 2, usage_raw.state = 'allocated_idle', 1, 0)), usage_raw.end_ms) AS state_rank,
    minIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS job_id,
    minIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenant,
    minIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queue,
    groupUniqArrayIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS jobs,
    groupUniqArrayIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenants,
    groupUniqArrayIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queues,
    sumIfArgMaxState(toUInt64(usage_raw.share_milli), toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS share_milli,
    maxArgMaxState(ifNull(usage_raw.util_pct, -1.), usage_raw.end_ms) AS util_pct
FROM usage_raw
GROUP BY cluster, gpu_uuid;

INSERT INTO gpu_latest
SELECT
    cluster, gpu_uuid,
    max(end_ms) AS last_end_ms,
    maxArgMaxState(toString(usage_raw.node), usage_raw.end_ms) AS node,
    maxArgMaxState(toString(usage_raw.gpu_model), usage_raw.end_ms) AS gpu_model,
    maxArgMaxState(toUInt8(multiIf(usage_raw.state = 'down', 3, usage_raw.state = 'executing', 2, usage_raw.state = 'allocated_idle', 1, 0)), usage_raw.end_ms) AS state_rank,
    minIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS job_id,
    minIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenant,
    minIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queue,
    groupUniqArrayIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS jobs,
    groupUniqArrayIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenants,
    groupUniqArrayIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queues,
    sumIfArgMaxState(toUInt64(usage_raw.share_milli), toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS share_milli,
    maxArgMaxState(ifNull(usage_raw.util_pct, -1.), usage_raw.end_ms) AS util_pct
FROM usage_raw
GROUP BY cluster, gpu_uuid;

CREATE OR REPLACE VIEW gpu_current AS
SELECT
    cluster,
    toLowCardinality(maxArgMaxMerge(g.node)) AS node,
    gpu_uuid,
    toLowCardinality(maxArgMaxMerge(g.gpu_model)) AS gpu_model,
    arrayElement(['unallocated', 'allocated_idle', 'executing', 'down'], maxArgMaxMerge(g.state_rank) + 1) AS state,
    minIfArgMaxMerge(g.job_id) AS job_id,
    minIfArgMaxMerge(g.tenant) AS tenant,
    minIfArgMaxMerge(g.queue) AS queue,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.jobs)), ' ') AS jobs,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.tenants)), ' ') AS tenants,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.queues)), ' ') AS queues,
    sumIfArgMaxMerge(g.share_milli) / 1000 AS allocated_share,
    if(maxArgMaxMerge(g.util_pct) < 0, NULL, maxArgMaxMerge(g.util_pct)) AS util_pct,
    fromUnixTimestamp64Milli(max(g.last_end_ms), 'UTC') AS last_seen
FROM gpu_latest AS g
GROUP BY cluster, gpu_uuid;

-- ---------------------------------------------------------------- per-GPU load, 5 minutes and hourly
-- Buckets are those of each record's start, as before. util_* sum util_pct x gpu_ms over executing
-- records that have util_pct. The 5-minute table has the states as columns and sums them on merge,
-- so its view reads it with FINAL instead of grouping 20 M rows a week of a 10,000-GPU fleet again.
CREATE TABLE IF NOT EXISTS usage_gpu_5m
(
    ts                    DateTime('UTC'),
    day                   Date,
    cluster               LowCardinality(String),
    node                  LowCardinality(String),
    gpu_uuid              String,
    gpu_model             LowCardinality(String),
    queue                 LowCardinality(String),
    total_gpu_ms          UInt64,
    executing_gpu_ms      UInt64,
    idle_gpu_ms           UInt64,
    unallocated_gpu_ms    UInt64,
    down_gpu_ms           UInt64,
    util_weighted_gpu_ms  Float64,
    util_gpu_ms           UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (ts, cluster, node, gpu_uuid, gpu_model, queue, day)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_gpu_5m_mv TO usage_gpu_5m AS
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

INSERT INTO usage_gpu_5m
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

CREATE OR REPLACE VIEW gpu_load_5m AS
SELECT
    ts, day, cluster, node, gpu_uuid, gpu_model, queue,
    total_gpu_ms, executing_gpu_ms, idle_gpu_ms, unallocated_gpu_ms, down_gpu_ms,
    util_weighted_gpu_ms, util_gpu_ms
FROM usage_gpu_5m FINAL;

CREATE TABLE IF NOT EXISTS usage_gpu_hourly
(
    hour                  DateTime('UTC'),
    day                   Date,
    cluster               LowCardinality(String),
    node                  LowCardinality(String),
    gpu_uuid              String,
    gpu_model             LowCardinality(String),
    state                 LowCardinality(String),
    gpu_ms                UInt64,
    effective_gpu_ms      UInt64,
    cost_micros           Int128,
    util_weighted_gpu_ms  Float64,
    util_gpu_ms           UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, hour, gpu_model, node, gpu_uuid, state, day)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_gpu_hourly_mv TO usage_gpu_hourly AS
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model, state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(usage_raw.effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(usage_raw.cost_micros)) AS cost_micros,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms
FROM usage_raw
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model, state;

INSERT INTO usage_gpu_hourly
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model, state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(usage_raw.effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(usage_raw.cost_micros)) AS cost_micros,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms
FROM usage_raw
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model, state;

CREATE OR REPLACE VIEW utilization_hourly AS
SELECT
    hour, day, cluster, gpu_model,
    sum(gpu_ms) AS capacity_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS allocated_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(effective_gpu_ms, state = 'executing') AS executing_effective_gpu_ms,
    sumIf(util_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
    sumIf(util_gpu_ms, state = 'executing') AS util_gpu_ms,
    toFloat64(sumIf(cost_micros, state = 'unallocated')) / 1e6 AS unallocated_cost
FROM usage_gpu_hourly
GROUP BY hour, day, cluster, gpu_model;

-- ---------------------------------------------------------------- health history, hourly
-- gpu_health keeps per-sample rows for GPULEDGER_RETENTION_HEALTH_DAYS; this keeps an hour per GPU
-- for much longer (GPULEDGER_RETENTION_HEALTH_HOURLY_DAYS).
CREATE TABLE IF NOT EXISTS gpu_health_hourly
(
    hour               DateTime('UTC'),
    day                Date,
    cluster            LowCardinality(String),
    node               LowCardinality(String),
    gpu_uuid           String,
    gpu_model          LowCardinality(String),
    samples            SimpleAggregateFunction(sum, UInt64),
    sampled_ms         SimpleAggregateFunction(sum, UInt64),
    unhealthy_samples  SimpleAggregateFunction(sum, UInt64),
    max_temperature_c  AggregateFunction(max, Nullable(Float64)),
    temperature_c      AggregateFunction(avg, Nullable(Float64)),
    power_w            AggregateFunction(avg, Nullable(Float64)),
    util_gpu_pct       AggregateFunction(avg, Nullable(Float64)),
    max_mem_used_bytes AggregateFunction(max, Nullable(UInt64)),
    xid_count          SimpleAggregateFunction(sum, UInt64),
    xid_codes          AggregateFunction(groupUniqArrayArray, Array(UInt32)),
    down_reasons       AggregateFunction(groupUniqArrayIf, String, UInt8),
    max_ecc_dbe_total  AggregateFunction(max, Nullable(UInt64))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, hour, node, gpu_model, day)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_health_hourly_mv TO gpu_health_hourly AS
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model,
    count() AS samples,
    sum(toUInt64(interval_ms)) AS sampled_ms,
    countIf(health != 'ok') AS unhealthy_samples,
    maxState(gpu_health.temperature_c) AS max_temperature_c,
    avgState(gpu_health.temperature_c) AS temperature_c,
    avgState(gpu_health.power_w) AS power_w,
    avgState(gpu_health.util_gpu_pct) AS util_gpu_pct,
    maxState(mem_used_bytes) AS max_mem_used_bytes,
    sum(toUInt64(length(xid_errors))) AS xid_count,
    groupUniqArrayArrayState(xid_errors) AS xid_codes,
    groupUniqArrayIfState(down_reason, toUInt8(down_reason != '')) AS down_reasons,
    maxState(ecc_dbe_total) AS max_ecc_dbe_total
FROM gpu_health
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model;

INSERT INTO gpu_health_hourly
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model,
    count() AS samples,
    sum(toUInt64(interval_ms)) AS sampled_ms,
    countIf(health != 'ok') AS unhealthy_samples,
    maxState(gpu_health.temperature_c) AS max_temperature_c,
    avgState(gpu_health.temperature_c) AS temperature_c,
    avgState(gpu_health.power_w) AS power_w,
    avgState(gpu_health.util_gpu_pct) AS util_gpu_pct,
    maxState(mem_used_bytes) AS max_mem_used_bytes,
    sum(toUInt64(length(xid_errors))) AS xid_count,
    groupUniqArrayArrayState(xid_errors) AS xid_codes,
    groupUniqArrayIfState(down_reason, toUInt8(down_reason != '')) AS down_reasons,
    maxState(ecc_dbe_total) AS max_ecc_dbe_total
FROM gpu_health
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model;

-- Hourly health history per GPU, for ranges longer than the per-sample retention.
CREATE VIEW IF NOT EXISTS gpu_health_history AS
SELECT
    hour, day, cluster, node, gpu_uuid, gpu_model,
    sum(samples) AS samples,
    sum(sampled_ms) / 1000 AS sampled_seconds,
    sum(unhealthy_samples) AS unhealthy_samples,
    maxMerge(max_temperature_c) AS max_temperature_c,
    avgMerge(temperature_c) AS avg_temperature_c,
    avgMerge(power_w) AS avg_power_w,
    avgMerge(util_gpu_pct) AS avg_util_gpu_pct,
    maxMerge(max_mem_used_bytes) AS max_mem_used_bytes,
    sum(xid_count) AS xid_count,
    arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArrayMerge(xid_codes))), ' ') AS xid_codes,
    arrayStringConcat(arraySort(groupUniqArrayIfMerge(down_reasons)), '; ') AS down_reasons,
    maxMerge(max_ecc_dbe_total) AS max_ecc_dbe_total
FROM gpu_health_hourly
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model;

CREATE OR REPLACE VIEW gpu_health_daily AS
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
    FROM usage_gpu_hourly
    GROUP BY day, cluster, node, gpu_uuid, gpu_model
) AS u
LEFT JOIN
(
    SELECT day, cluster, gpu_uuid,
        maxMerge(max_temperature_c) AS max_temperature_c,
        avgMerge(temperature_c) AS avg_temperature_c,
        sum(xid_count) AS xid_count,
        arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArrayMerge(xid_codes))), ' ') AS xid_codes,
        arrayStringConcat(arraySort(groupUniqArrayIfMerge(down_reasons)), '; ') AS down_reasons
    FROM gpu_health_hourly
    GROUP BY day, cluster, gpu_uuid
) AS h ON u.day = h.day AND u.cluster = h.cluster AND u.gpu_uuid = h.gpu_uuid;

-- ---------------------------------------------------------------- per job attempt and GPU
-- Executing and allocated-idle time of every job attempt on every GPU (the balance view), and the
-- executing time of every attempt by GPU model and 10-point utilization bucket (the histogram).
CREATE TABLE IF NOT EXISTS job_gpu_usage
(
    job_id                String,
    attempt               UInt32,
    cluster               LowCardinality(String),
    gpu_uuid              String,
    node                  LowCardinality(String),
    gpu_model             LowCardinality(String),
    tenant                LowCardinality(String),
    queue                 LowCardinality(String),
    state                 LowCardinality(String),
    gpu_ms                SimpleAggregateFunction(sum, UInt64),
    util_weighted_gpu_ms  SimpleAggregateFunction(sum, Float64),
    util_gpu_ms           SimpleAggregateFunction(sum, UInt64),
    first_start_ms        SimpleAggregateFunction(min, Int64),
    last_end_ms           SimpleAggregateFunction(max, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS job_gpu_usage_mv TO job_gpu_usage AS
SELECT
    job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM usage_raw
WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
GROUP BY job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state;

INSERT INTO job_gpu_usage
SELECT
    job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM usage_raw
WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
GROUP BY job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state;

CREATE TABLE IF NOT EXISTS job_util_buckets
(
    job_id           String,
    attempt          UInt32,
    cluster          LowCardinality(String),
    tenant           LowCardinality(String),
    queue            LowCardinality(String),
    gpu_model        LowCardinality(String),
    util_bucket_pct  UInt8,
    gpu_ms           UInt64,
    slices           UInt64
)
ENGINE = SummingMergeTree
ORDER BY (job_id, attempt, cluster, tenant, queue, gpu_model, util_bucket_pct)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS job_util_buckets_mv TO job_util_buckets AS
SELECT
    job_id, attempt, cluster, tenant, queue, gpu_model,
    toUInt8(least(floor(assumeNotNull(util_pct) / 10), 9) * 10) AS util_bucket_pct,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    count() AS slices
FROM usage_raw
WHERE state = 'executing' AND util_pct IS NOT NULL AND job_id != ''
GROUP BY job_id, attempt, cluster, tenant, queue, gpu_model, util_bucket_pct;

INSERT INTO job_util_buckets
SELECT
    job_id, attempt, cluster, tenant, queue, gpu_model,
    toUInt8(least(floor(assumeNotNull(util_pct) / 10), 9) * 10) AS util_bucket_pct,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    count() AS slices
FROM usage_raw
WHERE state = 'executing' AND util_pct IS NOT NULL AND job_id != ''
GROUP BY job_id, attempt, cluster, tenant, queue, gpu_model, util_bucket_pct;

CREATE OR REPLACE VIEW job_util_histogram AS
SELECT
    cluster, tenant, queue, job_id, attempt, gpu_model,
    util_bucket_pct,
    concat(leftPad(toString(util_bucket_pct), 2, '0'), '-', toString(util_bucket_pct + 10), '%') AS util_bucket,
    sum(gpu_ms) / 1000 AS gpu_seconds,
    sum(slices) AS slices
FROM job_util_buckets
GROUP BY cluster, tenant, queue, job_id, attempt, gpu_model, util_bucket_pct;

CREATE OR REPLACE VIEW job_gpu_balance AS
SELECT
    cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
    concat(toString(node), '/', substring(gpu_uuid, 5, 8)) AS gpu,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS idle_gpu_seconds,
    sumIf(job_gpu_usage.util_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
    sumIf(job_gpu_usage.util_gpu_ms, state = 'executing') AS util_gpu_ms,
    if(util_gpu_ms = 0, NULL, util_weighted_gpu_ms / util_gpu_ms) AS mean_util_pct,
    toInt64(min(job_gpu_usage.first_start_ms)) AS first_start_ms,
    toInt64(max(job_gpu_usage.last_end_ms)) AS last_end_ms
FROM job_gpu_usage
GROUP BY cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model;

-- Idle records of job attempts (allocated but not executing), the only rows idle stretches are
-- made of. A stretch is a run of idle records of one attempt on one GPU, each starting where the
-- previous one ended (an executing record in between ends the run, as before).
CREATE TABLE IF NOT EXISTS job_idle_segments
(
    cluster    LowCardinality(String),
    tenant     LowCardinality(String),
    queue      LowCardinality(String),
    job_id     String,
    attempt    UInt32,
    node       LowCardinality(String),
    gpu_uuid   String,
    gpu_model  LowCardinality(String),
    day        Date,
    start_ms   Int64,
    end_ms     Int64,
    gpu_ms     UInt64
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, cluster, gpu_uuid, start_ms)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS job_idle_segments_mv TO job_idle_segments AS
SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, day, start_ms, end_ms, gpu_ms
FROM usage_raw
WHERE job_id != '' AND state = 'allocated_idle';

INSERT INTO job_idle_segments
SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, day, start_ms, end_ms, gpu_ms
FROM usage_raw
WHERE job_id != '' AND state = 'allocated_idle';

-- Stretches from the sorted idle records of each attempt and GPU, split where a record does not start
-- where the previous one ended (arrays, not window functions: a filter on job_id reaches the
-- table's primary key). offset_ms counts from the attempt's first executing or idle record
-- (usage_by_job_daily).
CREATE OR REPLACE VIEW job_idle_stretches AS
SELECT
    s.cluster AS cluster, s.tenant AS tenant, s.queue AS queue, s.job_id AS job_id, s.attempt AS attempt,
    s.node AS node, s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model,
    fromUnixTimestamp64Milli(st.1, 'UTC') AS stretch_start,
    fromUnixTimestamp64Milli(st.2, 'UTC') AS stretch_end,
    (st.2 - st.1) / 1000 AS duration_seconds,
    st.3 / 1000 AS idle_gpu_seconds,
    st.1 - a.attempt_start_ms AS offset_ms
FROM
(
    SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
        arrayMap(run -> (run[1].1, arrayMax(arrayMap(x -> x.2, run)), arraySum(arrayMap(x -> x.3, run))),
                 arraySplit((x, i) -> i > 1 AND x.1 != segs[i - 1].2, segs, arrayEnumerate(segs))) AS stretches
    FROM
    (
        SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
            arraySort(groupArray((start_ms, end_ms, gpu_ms))) AS segs
        FROM job_idle_segments
        GROUP BY job_id, attempt, cluster, gpu_uuid, tenant, queue, node, gpu_model
    )
) AS s
ARRAY JOIN s.stretches AS st
LEFT JOIN
(
    SELECT cluster, job_id, attempt, min(first_start_ms) AS attempt_start_ms
    FROM usage_by_job_daily
    WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
    GROUP BY cluster, job_id, attempt
) AS a ON s.cluster = a.cluster AND s.job_id = a.job_id AND s.attempt = a.attempt;

-- ---------------------------------------------------------------- bills
-- The bill views join each attempt's outcome. They read it from job_attempt_outcomes (one merged
-- column of job_attempts_state, not every column of job_attempts), and only for the attempts of the
-- usage rows the query keeps: a filter on day reaches usage_by_job_daily before the join.
CREATE VIEW IF NOT EXISTS job_attempt_outcomes AS
SELECT cluster, job_id, attempt, argMinMerge(outcome) AS outcome
FROM job_attempts_state
GROUP BY cluster, job_id, attempt;

CREATE OR REPLACE VIEW tenant_daily_bill AS
SELECT
    day, tenant, definition_version,
    sumIf(line_gpu_ms, line = 'compute') / 3600000 AS compute_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'compute') / 3600000 AS compute_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'compute') / 1e6 AS compute_cost,
    sumIf(line_cost_micros, line = 'compute') AS compute_cost_micros,
    sumIf(line_gpu_ms, line = 'idle') / 3600000 AS idle_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'idle') / 1e6 AS idle_cost,
    sumIf(line_cost_micros, line = 'idle') AS idle_cost_micros,
    sumIf(line_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'failed_retry') / 1e6 AS failed_retry_cost,
    sumIf(line_cost_micros, line = 'failed_retry') AS failed_retry_cost_micros,
    sum(line_gpu_ms) / 3600000 AS total_gpu_hours,
    sum(line_effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(line_cost_micros) / 1e6 AS total_cost,
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
    FROM usage_by_job_daily AS u
    LEFT JOIN job_attempt_outcomes AS a
        ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
    WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != ''
)
GROUP BY day, tenant, definition_version;

CREATE OR REPLACE VIEW job_cost_by_attempt AS
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
LEFT JOIN job_attempt_outcomes AS a
    ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != '';
