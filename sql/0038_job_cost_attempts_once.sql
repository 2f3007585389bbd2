-- job_cost carries a job's attempt sums on one row only (review finding: `report jobs` showed a job's
-- queue wait, opportunity cost, attempts and failed attempts on each of its definition-version rows,
-- so totalling the report counted the wait twice for a job whose usage crossed a definition change).
-- 0031's view LEFT JOINed the per-job attempt sums (a, keyed by cluster and job) onto the per-(cluster,
-- job, definition_version) usage rows (u). Here attempts, failed_attempts, queue_wait_seconds and
-- queue_wait_gpu_hours are on the row of the version the job's usage started under (the smallest
-- first_start_ms; on a tie the smaller version) and 0 on its other rows; a job with no usage yet has
-- one row ('' version) and keeps them there. last_outcome and requested_gpus describe the job and stay
-- on every row. The first version is worked out where the jobs are listed (k), which already reads
-- usage_by_job_daily: two more of its columns, no other scan; a filter on cluster or job_id still
-- reaches every table read (docs/accounting.md, "Job cost"). Same columns and types as 0031's.

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
    -- every job either side knows (job_attempts_state: the table behind job_attempts), and the version
    -- its usage started under ('' for a job with no usage yet, as the left join fills u's)
    k AS
    (
        SELECT cluster, job_id,
               argMinIf(definition_version, (first_start_ms, definition_version), with_usage) AS k_first_version
        FROM
        (SELECT cluster, job_id, definition_version, first_start_ms, toUInt8(1) AS with_usage
         FROM usage_by_job_daily WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
         UNION ALL SELECT cluster, job_id, '', toInt64(0), toUInt8(0) FROM job_attempts_state)
        GROUP BY cluster, job_id
    )
SELECT
    cluster,
    job_id,
    if(a_tenant != '', a_tenant, u_tenant) AS tenant,
    if(a_queue != '', a_queue, u_queue) AS queue,
    definition_version,
    if(definition_version = k_first_version, greatest(a_attempts, u_attempts), 0) AS attempts,
    if(definition_version = k_first_version, a_failed_attempts, 0) AS failed_attempts,
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
    if(definition_version = k_first_version, a_queue_wait_seconds, 0) AS queue_wait_seconds,
    if(definition_version = k_first_version, a_queue_wait_gpu_hours, 0) AS queue_wait_gpu_hours,
    u_priced_by_default_gpu_ms / 3600000 AS priced_by_default_gpu_hours
FROM k
LEFT JOIN u USING (cluster, job_id)
LEFT JOIN a USING (cluster, job_id);
