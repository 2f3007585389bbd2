-- Read models: the bills and efficiency tables. Units in names: *_gpu_hours, *_gpu_seconds,
-- cost in currency units (micros / 1e6) beside exact *_cost_micros.

-- Tenant bill per UTC day, three lines:
--   compute      = executing GPU-time of attempts that did not fail
--   idle         = allocated-but-not-executing GPU-time of every attempt
--   failed_retry = executing GPU-time of attempts whose outcome is 'failed'
-- Cluster idle (unallocated) and down time belong to the platform and are not billed here.
CREATE VIEW IF NOT EXISTS tenant_daily_bill AS
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
    sum(line_cost_micros) AS total_cost_micros
FROM
(
    SELECT
        u.day AS day,
        u.tenant AS tenant,
        u.definition_version AS definition_version,
        multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
        u.gpu_ms AS line_gpu_ms,
        u.effective_gpu_ms AS line_effective_gpu_ms,
        u.cost_micros AS line_cost_micros
    FROM usage_by_job_daily AS u
    LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
        ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
    WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != ''
)
GROUP BY day, tenant, definition_version;

-- Job cost over all its attempts and GPUs (GPU-time held = executing + allocated idle), with
-- queue waiting beside it: queue_wait_gpu_hours = Σ attempts (allocated − queued) × requested GPUs,
-- which the jobs report prices at a reference cost (opportunity cost). Waits of attempts that
-- are not allocated yet are not counted.
CREATE VIEW IF NOT EXISTS job_cost AS
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
            max(day) AS u_last_day
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
    a_queue_wait_gpu_hours AS queue_wait_gpu_hours
FROM u
FULL OUTER JOIN a USING (cluster, job_id);

-- Queue efficiency per queue and cohort day (the UTC day an attempt was queued), so that
-- requested, allocated and executed GPU-time of one set of attempts are compared:
--   requested = requested_gpus × (ended, else last seen in events or usage − queued)
--   allocated = allocated_idle + executing, executed = executing (from usage, all days)
--   queue wait = allocated_ms − queued_ms per attempt (attempts not yet allocated excluded)
CREATE VIEW IF NOT EXISTS queue_efficiency AS
WITH
    u AS
    (
        SELECT
            cluster, job_id, attempt,
            sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS u_allocated_gpu_ms,
            sumIf(gpu_ms, state = 'executing') AS u_executed_gpu_ms,
            max(last_end_ms) AS u_last_end_ms
        FROM usage_by_job_daily
        WHERE job_id != ''
        GROUP BY cluster, job_id, attempt
    )
SELECT
    day, cluster, queue, attempts,
    requested_gpu_seconds, allocated_gpu_seconds, executed_gpu_seconds,
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
        sum(a.requested_gpus * (coalesce(a.ended_ms, greatest(a.last_seen_ms, u.u_last_end_ms))
                                - coalesce(a.queued_ms, a.first_seen_ms))) / 1000 AS requested_gpu_seconds,
        sum(u.u_allocated_gpu_ms) / 1000 AS allocated_gpu_seconds,
        sum(u.u_executed_gpu_ms) / 1000 AS executed_gpu_seconds,
        count(a.queue_wait_ms) AS waits,
        quantileExactInclusive(0.5)(a.queue_wait_ms / 1000) AS wait_p50,
        quantileExactInclusive(0.9)(a.queue_wait_ms / 1000) AS wait_p90,
        quantileExactInclusive(0.99)(a.queue_wait_ms / 1000) AS wait_p99,
        avg(a.queue_wait_ms / 1000) AS wait_mean,
        max(a.queue_wait_ms / 1000) AS wait_max
    FROM job_attempts AS a
    LEFT JOIN u ON a.cluster = u.cluster AND a.job_id = u.job_id AND a.attempt = u.attempt
    GROUP BY day, cluster, queue
);

-- Capacity per UTC day, cluster and GPU model: capacity = down + unallocated + allocated_idle + executing.
CREATE VIEW IF NOT EXISTS capacity_daily AS
SELECT
    day, cluster, gpu_model, definition_version,
    uniqExactMerge(gpus) AS gpus,
    sum(gpu_ms) / 1000 AS capacity_gpu_seconds,
    sumIf(gpu_ms, state = 'down') / 1000 AS down_gpu_seconds,
    sumIf(gpu_ms, state = 'unallocated') / 1000 AS unallocated_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS allocated_idle_gpu_seconds,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sum(effective_gpu_ms) / 3600000 AS effective_gpu_hours,
    sum(cost_micros) / 1e6 AS cost,
    sumIf(cost_micros, state = 'unallocated') / 1e6 AS unallocated_cost,
    sum(energy_j) / 3600000 AS energy_kwh
FROM usage_capacity_daily
GROUP BY day, cluster, gpu_model, definition_version;
