-- Two fixes to views the Superset dashboards read (superset/build_bundle.py).
--
-- job_gpu_balance (sql/0018): `gpu`, the label the algorithm dashboard's per-GPU charts group by, was
-- node + '/' + the 8 characters after 'GPU-' of the UUID, so two GPUs of one node whose UUIDs share those
-- characters were one bar, their utilization averaged and their hours added: the old agents' placeholders
-- GPU-unreadable-0 and GPU-unreadable-1, MIG instances of one GPU, other vendors' IDs. A label is now
-- node + '/' + those 8 characters (as before) where no other GPU of that cluster and node (in
-- job_gpu_usage, whatever the job: a chart without a Job filter groups every job's rows by label) has the
-- same ones, else node + '/' + the whole UUID. So every GPU of a (cluster, node) has its own label, random
-- NVIDIA UUIDs keep their short one, and `gpuledger report job` lists them the same way. The charts split
-- their bars by cluster, so labels need be unique within a cluster only. Same columns and types.
--
-- idle_waste_daily (sql/0010): its rows added the idle cost of every definition version of a day, queue,
-- tenant and GPU model, whatever their currencies. It now has a row per definition version and a last
-- column `definition_version` (the dashboards' calculated `currency` column reads that version's
-- currency, as the bill views'); the other columns keep their names, types and meaning.
-- tests/integration/test_bundle_gpu_labels.py checks both.

CREATE OR REPLACE VIEW job_gpu_balance AS
SELECT
    b.cluster AS cluster, b.tenant AS tenant, b.queue AS queue, b.job_id AS job_id, b.attempt AS attempt,
    b.node AS node, b.gpu_uuid AS gpu_uuid, b.gpu_model AS gpu_model,
    concat(toString(b.node), '/', if(s.gpus > 1, b.gpu_uuid, b.short_label)) AS gpu,
    b.executing_gpu_seconds AS executing_gpu_seconds, b.idle_gpu_seconds AS idle_gpu_seconds,
    b.util_weighted_gpu_ms AS util_weighted_gpu_ms, b.util_gpu_ms AS util_gpu_ms,
    b.mean_util_pct AS mean_util_pct, b.first_start_ms AS first_start_ms, b.last_end_ms AS last_end_ms
FROM
(
    SELECT
        cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
        substring(gpu_uuid, 5, 8) AS short_label,
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
LEFT JOIN
(
    SELECT cluster, node, substring(gpu_uuid, 5, 8) AS short_label,
           uniqExact(gpu_uuid) AS gpus
    FROM job_gpu_usage
    GROUP BY cluster, node, short_label
    HAVING gpus > 1
) AS s ON s.cluster = b.cluster AND s.node = b.node AND s.short_label = b.short_label;

CREATE OR REPLACE VIEW idle_waste_daily AS
SELECT
    day, cluster, queue, tenant, gpu_model,
    sum(gpu_ms) / 3600000 AS idle_gpu_hours,
    sum(effective_gpu_ms) / 3600000 AS idle_effective_gpu_hours,
    sum(cost_micros) / 1e6 AS idle_cost,
    definition_version
FROM usage_by_job_daily
WHERE state = 'allocated_idle' AND job_id != ''
GROUP BY day, cluster, queue, tenant, gpu_model, definition_version;
