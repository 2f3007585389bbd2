-- job_cost read per job (issue #13 point 3; docs/performance.md "Dashboard and report queries").
-- 0015's job_cost joined the per-job usage sums and the per-job attempt sums with FULL OUTER JOIN
-- USING (cluster, job_id). ClickHouse does not push a filter on the joined keys through a full join,
-- so reading one job (a job report, a Superset chart filtered by job, a top-N list's rows) grouped
-- every job first: 0.12 s for one job at 100 M records on 2 cores, about what all 45,000 take.
-- Here the jobs are the distinct keys of both sides, and each side is LEFT JOINed to them: a filter
-- on cluster or job_id reaches every table read (one job: 0.035 s). Same columns, types and rows as
-- 0015's view (tests/integration/test_job_cost_view.py compares the two on random jobs).

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
    ),
    -- every job either side knows (job_attempts_state: the table behind job_attempts)
    k AS
    (
        SELECT DISTINCT cluster, job_id FROM
        (SELECT cluster, job_id FROM usage_by_job_daily WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
         UNION ALL SELECT cluster, job_id FROM job_attempts_state)
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
    -- NULL for jobs with no usage yet (the left join fills unmatched rows with defaults)
    if(u_seen = 1, u_first_day, NULL) AS first_day,
    if(u_seen = 1, u_last_day, NULL) AS last_day,
    a_queue_wait_seconds AS queue_wait_seconds,
    a_queue_wait_gpu_hours AS queue_wait_gpu_hours,
    u_priced_by_default_gpu_ms / 3600000 AS priced_by_default_gpu_hours
FROM k
LEFT JOIN u USING (cluster, job_id)
LEFT JOIN a USING (cluster, job_id);
