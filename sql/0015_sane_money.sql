-- Sane values or none; no silent defaults in money (docs/accounting.md, §4a and §4b).
--
-- 1. Every usage record says which price-history entry priced it (price_version) and whether its GPU
--    model had no price or coefficient of its own (priced_by_default: priced under the ledger's
--    [unpriced] policy). Rows written before read '' and false.
-- 2. Cost sums cannot wrap: one record costs at most MAX_RECORD_COST_MICROS (5.2e13, streams/pricing.py),
--    which fits usage_raw's UInt64, but a UInt64 sum of 355,000 such records would wrap without error.
--    The aggregate tables sum cost in Int128 (the views over them inherit it), and their materialized
--    views widen each record before summing. MODIFY COLUMN rewrites the (small) aggregate tables once;
--    MODIFY QUERY swaps a view's query atomically (no insert is missed).
-- 3. The bill views carry the GPU-hours priced by default, so reports can footnote them.

ALTER TABLE usage_raw ADD COLUMN IF NOT EXISTS price_version LowCardinality(String) DEFAULT '' AFTER definition_version;
ALTER TABLE usage_raw ADD COLUMN IF NOT EXISTS priced_by_default Bool DEFAULT false AFTER price_version;

ALTER TABLE usage_by_job_daily MODIFY COLUMN cost_micros SimpleAggregateFunction(sum, Int128);
ALTER TABLE usage_by_job_daily ADD COLUMN IF NOT EXISTS priced_by_default_gpu_ms SimpleAggregateFunction(sum, UInt64) DEFAULT 0;
ALTER TABLE usage_capacity_daily MODIFY COLUMN cost_micros SimpleAggregateFunction(sum, Int128);
ALTER TABLE usage_capacity_daily ADD COLUMN IF NOT EXISTS priced_by_default_gpu_ms SimpleAggregateFunction(sum, UInt64) DEFAULT 0;

ALTER TABLE usage_by_job_daily_mv MODIFY QUERY
SELECT
    day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    -- qualified: inside this SELECT a bare gpu_ms would mean the alias sum(gpu_ms)
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM usage_raw
GROUP BY day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version;

ALTER TABLE usage_capacity_daily_mv MODIFY QUERY
SELECT
    day, cluster, gpu_model, state, definition_version,
    uniqExactState(gpu_uuid) AS gpus,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM usage_raw
GROUP BY day, cluster, gpu_model, state, definition_version;

-- The bill views of sql/0004, each with one column more at the end: priced_by_default_gpu_hours
-- (GPU-hours of the row priced under the [unpriced] policy; 0 when every model had its own price).
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
    LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
        ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
    WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != ''
)
GROUP BY day, tenant, definition_version;

CREATE OR REPLACE VIEW job_cost AS
WITH
    u AS
    (
        SELECT
            cluster, job_id, definition_version,
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
        FROM usage_by_job_daily
        WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
        GROUP BY cluster, job_id, definition_version
    ),
    a AS
    (
        SELECT
            cluster, job_id,
            argMin(tenant, attempt) AS a_tenant,
            argMin(queue, attempt) AS a_queue,
            count() AS a_attempts,
            countIf(outcome = 'failed') AS a_failed_attempts,
            argMax(outcome, attempt) AS a_last_outcome,
            max(requested_gpus) AS a_requested_gpus,
            sum(coalesce(queue_wait_ms, 0)) / 1000 AS a_queue_wait_seconds,
            sum(coalesce(queue_wait_ms, 0) * requested_gpus) / 3600000 AS a_queue_wait_gpu_hours
        FROM job_attempts
        GROUP BY cluster, job_id
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
    u_cost_micros / 1e6 AS cost,
    u_cost_micros AS cost_micros,
    u_energy_j / 3600000 AS energy_kwh,
    -- NULL for jobs with no usage yet (the outer join fills unmatched sides with defaults)
    if(u_seen = 1, u_first_day, NULL) AS first_day,
    if(u_seen = 1, u_last_day, NULL) AS last_day,
    a_queue_wait_seconds AS queue_wait_seconds,
    a_queue_wait_gpu_hours AS queue_wait_gpu_hours,
    u_priced_by_default_gpu_ms / 3600000 AS priced_by_default_gpu_hours
FROM u
FULL OUTER JOIN a USING (cluster, job_id);
