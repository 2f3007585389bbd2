-- One definition of a GPU's label (sql/0050's rule, which job_gpu_balance and the stragglers report each
-- wrote out): node + '/' + the 8 characters after 'GPU-' of the UUID, or node + '/' + the whole UUID where
-- another GPU of that cluster and node (in job_gpu_usage, whatever the job) has the same 8 characters.
-- gpu_labels has one row per (cluster, node, gpu_uuid); job_gpu_balance takes `gpu` from it, and
-- `gpuledger report` (stragglers) names the GPUs it found through it. Same columns and types as before.

CREATE OR REPLACE VIEW gpu_labels AS
SELECT
    cluster, node, gpu_uuid,
    concat(toString(node), '/',
           if(count() OVER (PARTITION BY cluster, node, substring(gpu_uuid, 5, 8)) > 1,
              gpu_uuid, substring(gpu_uuid, 5, 8))) AS gpu
FROM (SELECT DISTINCT cluster, node, gpu_uuid FROM job_gpu_usage);

CREATE OR REPLACE VIEW job_gpu_balance AS
SELECT
    b.cluster AS cluster, b.tenant AS tenant, b.queue AS queue, b.job_id AS job_id, b.attempt AS attempt,
    b.node AS node, b.gpu_uuid AS gpu_uuid, b.gpu_model AS gpu_model, l.gpu AS gpu,
    b.executing_gpu_seconds AS executing_gpu_seconds, b.idle_gpu_seconds AS idle_gpu_seconds,
    b.util_weighted_gpu_ms AS util_weighted_gpu_ms, b.util_gpu_ms AS util_gpu_ms,
    b.mean_util_pct AS mean_util_pct, b.first_start_ms AS first_start_ms, b.last_end_ms AS last_end_ms
FROM
(
    SELECT
        cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
        sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
        sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS idle_gpu_seconds,
        sumIf(job_gpu_usage.util_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
        sumIf(job_gpu_usage.util_gpu_ms, state = 'executing') AS util_gpu_ms,
        if(util_gpu_ms = 0, NULL, util_weighted_gpu_ms / util_gpu_ms) AS mean_util_pct,
        toInt64(min(job_gpu_usage.first_start_ms)) AS first_start_ms,
        toInt64(max(job_gpu_usage.last_end_ms)) AS last_end_ms
    FROM job_gpu_usage
    GROUP BY cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model
) AS b
INNER JOIN gpu_labels AS l ON l.cluster = b.cluster AND l.node = b.node AND l.gpu_uuid = b.gpu_uuid;
