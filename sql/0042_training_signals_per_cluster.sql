-- Training signals per cluster, each usage record once (review findings on the views of sql/0021):
--  * Slurm numbers jobs per cluster, but the views grouped and joined by (job_id, attempt) only: job 1234
--    of cluster a and job 1234 of cluster b were one attempt, their steps, cost and cost per step mixed
--    (the estimate was fixed for this in gpuledger/warehouse/estimate.py, load_pilot). Every view below
--    now keys an attempt by (cluster, job_id, attempt);
--  * job_training_signals read usage_raw as stored: a record written twice (a replay, a second sink),
--    visible until the ReplacingMergeTree merges it, doubled the span's cost and GPU-hours. It and
--    job_progress_windows now read `usage_raw FINAL` (each (cluster, record_id) once, as the bills read it).
-- A progress report may name no cluster (a ProgressReporter not given `cluster=`: job_progress.cluster
-- ''). job_progress_clustered gives such a report the one cluster its attempt ran in (its executing or
-- allocated-idle usage in job_gpu_usage, and the clusters its other reports name), as load_pilot does;
-- where that is not one cluster the report keeps '' and is matched to no usage.
-- The views keep their columns, with `cluster` added first. Nothing is back-filled.

CREATE OR REPLACE VIEW job_progress_clustered AS
SELECT
    if(p.cluster = '' AND length(k.clusters) = 1, k.clusters[1], toString(p.cluster)) AS cluster,
    p.job_id AS job_id, p.attempt AS attempt, p.ts_ms AS ts_ms, p.step AS step, p.samples AS samples,
    p.tokens AS tokens, p.epoch AS epoch, p.loss AS loss, p.step_time_ms AS step_time_ms,
    p.rank_ids AS rank_ids, p.rank_step_time_ms AS rank_step_time_ms
FROM job_progress AS p
LEFT JOIN
(
    SELECT job_id, attempt, groupUniqArray(c) AS clusters
    FROM
    (
        SELECT job_id, attempt, toString(cluster) AS c FROM job_gpu_usage
        WHERE job_id IN (SELECT job_id FROM job_progress WHERE cluster = '')
        UNION ALL
        SELECT job_id, attempt, toString(cluster) AS c FROM job_progress
        WHERE cluster != '' AND job_id IN (SELECT job_id FROM job_progress WHERE cluster = '')
    )
    GROUP BY job_id, attempt
) AS k ON p.job_id = k.job_id AND p.attempt = k.attempt;

CREATE OR REPLACE VIEW job_progress_deltas AS
SELECT
    cluster, job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
    toStartOfInterval(fromUnixTimestamp64Milli(ts_ms, 'UTC'), INTERVAL 10 MINUTE) AS window_start,
    if(prev_ts = 0, 0, ts_ms - prev_ts) AS d_ms,
    if(prev_ts = 0, 0, step - prev_step) AS d_step,
    if(prev_ts = 0 OR tokens IS NULL, 0, assumeNotNull(tokens) - prev_tokens) AS d_tokens
FROM
(
    SELECT
        cluster, job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
        lagInFrame(ts_ms, 1, 0) OVER w AS prev_ts,
        lagInFrame(step, 1, 0) OVER w AS prev_step,
        lagInFrame(coalesce(tokens, 0), 1, 0) OVER w AS prev_tokens
    FROM job_progress_clustered
    WINDOW w AS (PARTITION BY cluster, job_id, attempt ORDER BY ts_ms ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
);

CREATE OR REPLACE VIEW job_progress_windows AS
SELECT
    p.cluster AS cluster, p.job_id AS job_id, p.attempt AS attempt, p.window_start AS window_start,
    p.steps AS steps, p.seconds AS seconds, p.steps / p.seconds AS steps_per_s,
    p.tokens / p.seconds AS tokens_per_s, p.reports AS reports,
    u.util_pct AS util_pct
FROM
(
    SELECT cluster, job_id, attempt, window_start, sum(d_step) AS steps, sum(d_ms) / 1000 AS seconds,
           sum(d_tokens) AS tokens, count() AS reports
    FROM job_progress_deltas WHERE d_ms > 0
    GROUP BY cluster, job_id, attempt, window_start
) AS p
LEFT JOIN
(
    SELECT toString(cluster) AS cluster, job_id, attempt,
           toStartOfInterval(fromUnixTimestamp64Milli(start_ms, 'UTC'), INTERVAL 10 MINUTE) AS window_start,
           sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL)
               / nullIf(sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL), 0) AS util_pct
    FROM usage_raw FINAL
    WHERE job_id IN (SELECT DISTINCT job_id FROM job_progress)
    GROUP BY cluster, job_id, attempt, window_start
) AS u
ON p.cluster = u.cluster AND p.job_id = u.job_id AND p.attempt = u.attempt AND p.window_start = u.window_start
WHERE p.seconds > 0;

CREATE OR REPLACE VIEW job_rank_step_times AS
SELECT cluster, job_id, attempt, rank, avg(rank_time) AS mean_step_time_ms, count() AS reports
FROM job_progress_clustered
ARRAY JOIN rank_ids AS rank, rank_step_time_ms AS rank_time
GROUP BY cluster, job_id, attempt, rank;

CREATE OR REPLACE VIEW job_checkpoint_time AS
SELECT cluster, job_id, attempt, length(ends) AS checkpoints,
       arraySum(arrayMap((b, e) -> greatest(e - b, 0), arraySlice(begins, 1, length(ends)), ends)) / 1000
           AS checkpoint_seconds
FROM
(
    SELECT cluster, job_id, attempt,
           arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_begin')) AS begins,
           arraySlice(arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_end')), 1,
                      countIf(kind = 'checkpoint_begin')) AS ends
    FROM
    (   -- each event once: job_events keeps every copy the sink delivers (a pair stored twice was two checkpoints)
        SELECT DISTINCT cluster, job_id, attempt, kind, ts_ms, event_id FROM job_events
        WHERE kind IN ('checkpoint_begin', 'checkpoint_end')
    )
    GROUP BY cluster, job_id, attempt
);

CREATE OR REPLACE VIEW job_training_signals AS
SELECT
    p.cluster AS cluster, p.job_id AS job_id, p.attempt AS attempt, p.first_ms AS first_ms, p.last_ms AS last_ms,
    p.reports AS reports, p.steps AS steps, p.tokens AS tokens, p.last_loss AS last_loss,
    (p.last_ms - p.first_ms) / 1000 AS span_seconds,
    u.gpu_ms / 3600000 AS span_gpu_hours, u.cost_micros / 1e6 AS span_cost, u.energy_j AS span_energy_j,
    u.cost_micros / 1e6 / nullIf(p.steps, 0) AS cost_per_step,
    u.cost_micros / 1e6 / nullIf(p.tokens, 0) * 1e6 AS cost_per_million_tokens,
    coalesce(c.checkpoints, 0) AS checkpoints, coalesce(c.checkpoint_seconds, 0) AS checkpoint_seconds
FROM
(
    SELECT cluster, job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms, count() AS reports,
           argMax(step, ts_ms) - argMin(step, ts_ms) AS steps,
           coalesce(argMax(tokens, ts_ms), 0) - coalesce(argMin(tokens, ts_ms), 0) AS tokens,
           argMax(loss, ts_ms) AS last_loss
    FROM job_progress_clustered GROUP BY cluster, job_id, attempt
) AS p
LEFT JOIN
(
    SELECT r.cluster AS cluster, r.job_id AS job_id, r.attempt AS attempt,
           sum(r.gpu_ms * r.part) AS gpu_ms, sum(r.cost_micros * r.part) AS cost_micros,
           sum(r.energy_j * r.part) AS energy_j
    FROM
    (
        SELECT u.cluster AS cluster, u.job_id AS job_id, u.attempt AS attempt, u.gpu_ms AS gpu_ms,
               u.cost_micros AS cost_micros, u.energy_j AS energy_j,
               greatest(least(u.end_ms, s.last_ms) - greatest(u.start_ms, s.first_ms), 0)
                   / greatest(u.end_ms - u.start_ms, 1) AS part
        FROM
        (
            SELECT toString(cluster) AS cluster, job_id, attempt, start_ms, end_ms, gpu_ms, cost_micros, energy_j
            FROM usage_raw FINAL
            WHERE state IN ('executing', 'allocated_idle') AND job_id IN (SELECT DISTINCT job_id FROM job_progress)
        ) AS u
        INNER JOIN (SELECT cluster, job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms
                    FROM job_progress_clustered GROUP BY cluster, job_id, attempt) AS s
            ON u.cluster = s.cluster AND u.job_id = s.job_id AND u.attempt = s.attempt
    ) AS r
    GROUP BY r.cluster, r.job_id, r.attempt
) AS u ON p.cluster = u.cluster AND p.job_id = u.job_id AND p.attempt = u.attempt
LEFT JOIN job_checkpoint_time AS c ON p.cluster = c.cluster AND p.job_id = c.job_id AND p.attempt = c.attempt;
