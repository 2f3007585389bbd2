-- Training signals from reports that are valid but odd (review of the views of sql/0042 and sql/0047):
--  * two reports of one attempt at the same ts_ms with different steps (a forced report in the same
--    millisecond as the last one; both are kept, sql/0047 tells reports apart by their step) were taken
--    in no particular order, and job_progress_windows left out every report that came 0 ms after the one
--    before it: steps 0, 100, 150 (the last two at 2 min), 200 at 1..3 min made 150 steps (or 250, in the
--    other order) in the windows, not 200. Reports are now ordered by (ts_ms, step) in every view, and a
--    report 0 ms after the one before it still adds its steps and tokens to its window;
--  * a report without a token count (`tokens` NULL: a forced report, a code path that gives the step only)
--    between reports with one was taken as 0 tokens, so the next report's change was its whole count: 4,096
--    tokens a step, steps 0..500 a minute apart, the third report without tokens gave 2,457,600 tokens
--    in the windows, not 2,048,000. A report's change in tokens is now from the last report before it
--    that has a count (0 where either has none), over the time since that report (`d_tokens_ms`, a new
--    last column of job_progress_deltas): the windows add up to the attempt's count, and a window's
--    tokens_per_s is its tokens over the time they took (0 where no report of it has a count, as before);
--  * job_training_signals divided the cost of the span between the first and last reports by the tokens
--    between the first and last reports *that have a count*: a first or last report without one made
--    a shorter token span priced at the whole span's cost (0.0488 per million tokens, not 0.0391, with
--    the last of the golden pilot's six reports without tokens). cost_per_million_tokens is now the cost
--    of the token span (its first to its last report with a count) over its tokens; span_cost,
--    cost_per_step and the other columns keep their meaning.
-- Steps or tokens that go back within an attempt (a restart from a checkpoint in the same attempt) stay
-- lost progress, as before: a negative change in its window, and `steps` of job_training_signals is the
-- last report's step less the first's. Nothing is back-filled; the views keep their columns.

CREATE OR REPLACE VIEW job_progress_deltas AS
SELECT
    cluster, job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
    toStartOfInterval(fromUnixTimestamp64Milli(ts_ms, 'UTC'), INTERVAL 10 MINUTE) AS window_start,
    if(n = 1, 0, ts_ms - prev_ts) AS d_ms,
    if(n = 1, 0, step - prev_step) AS d_step,
    if(tokens IS NULL OR prev_tokens IS NULL, 0, assumeNotNull(tokens) - assumeNotNull(prev_tokens)) AS d_tokens,
    if(tokens IS NULL OR prev_tokens IS NULL, 0, ts_ms - assumeNotNull(prev_tokens_ts)) AS d_tokens_ms
FROM
(
    SELECT
        cluster, job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
        row_number() OVER w AS n,
        lagInFrame(ts_ms, 1, 0) OVER w AS prev_ts,
        lagInFrame(step, 1, 0) OVER w AS prev_step,
        last_value(tokens) OVER before AS prev_tokens,
        last_value(if(tokens IS NULL, NULL, ts_ms)) OVER before AS prev_tokens_ts
    FROM job_progress_clustered
    WINDOW w AS (PARTITION BY cluster, job_id, attempt ORDER BY ts_ms, step ROWS BETWEEN 1 PRECEDING AND CURRENT ROW),
           before AS (PARTITION BY cluster, job_id, attempt ORDER BY ts_ms, step
                      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
);

CREATE OR REPLACE VIEW job_progress_windows AS
SELECT
    p.cluster AS cluster, p.job_id AS job_id, p.attempt AS attempt, p.window_start AS window_start,
    p.steps AS steps, p.seconds AS seconds, p.steps / p.seconds AS steps_per_s,
    if(p.token_seconds > 0, p.tokens / p.token_seconds, 0) AS tokens_per_s, p.reports AS reports,
    u.util_pct AS util_pct
FROM
(
    SELECT cluster, job_id, attempt, window_start, sum(d_step) AS steps, sum(d_ms) / 1000 AS seconds,
           sum(d_tokens) AS tokens, sum(d_tokens_ms) / 1000 AS token_seconds, count() AS reports
    FROM job_progress_deltas WHERE d_ms > 0 OR d_step != 0 OR d_tokens != 0
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

CREATE OR REPLACE VIEW job_training_signals AS
SELECT
    p.cluster AS cluster, p.job_id AS job_id, p.attempt AS attempt, p.first_ms AS first_ms, p.last_ms AS last_ms,
    p.reports AS reports, p.steps AS steps, p.tokens AS tokens, p.last_loss AS last_loss,
    (p.last_ms - p.first_ms) / 1000 AS span_seconds,
    u.gpu_ms / 3600000 AS span_gpu_hours, u.cost_micros / 1e6 AS span_cost, u.energy_j AS span_energy_j,
    u.cost_micros / 1e6 / nullIf(p.steps, 0) AS cost_per_step,
    u.token_cost_micros / 1e6 / nullIf(p.tokens, 0) * 1e6 AS cost_per_million_tokens,
    coalesce(c.checkpoints, 0) AS checkpoints, coalesce(c.checkpoint_seconds, 0) AS checkpoint_seconds
FROM
(
    SELECT cluster, job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms, count() AS reports,
           argMax(step, (ts_ms, step)) - argMin(step, (ts_ms, step)) AS steps,
           coalesce(argMax(tokens, (ts_ms, step)), 0) - coalesce(argMin(tokens, (ts_ms, step)), 0) AS tokens,
           argMax(loss, (ts_ms, step)) AS last_loss
    FROM job_progress_clustered GROUP BY cluster, job_id, attempt
) AS p
LEFT JOIN
(
    SELECT r.cluster AS cluster, r.job_id AS job_id, r.attempt AS attempt,
           sum(r.gpu_ms * r.part) AS gpu_ms, sum(r.cost_micros * r.part) AS cost_micros,
           sum(r.energy_j * r.part) AS energy_j, sum(r.cost_micros * r.token_part) AS token_cost_micros
    FROM
    (
        SELECT u.cluster AS cluster, u.job_id AS job_id, u.attempt AS attempt, u.gpu_ms AS gpu_ms,
               u.cost_micros AS cost_micros, u.energy_j AS energy_j,
               greatest(least(u.end_ms, s.last_ms) - greatest(u.start_ms, s.first_ms), 0)
                   / greatest(u.end_ms - u.start_ms, 1) AS part,
               greatest(least(u.end_ms, s.tokens_last_ms) - greatest(u.start_ms, s.tokens_first_ms), 0)
                   / greatest(u.end_ms - u.start_ms, 1) AS token_part
        FROM
        (
            SELECT toString(cluster) AS cluster, job_id, attempt, start_ms, end_ms, gpu_ms, cost_micros, energy_j
            FROM usage_raw FINAL
            WHERE state IN ('executing', 'allocated_idle') AND job_id IN (SELECT DISTINCT job_id FROM job_progress)
        ) AS u
        INNER JOIN (SELECT cluster, job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms,
                           minIf(ts_ms, tokens IS NOT NULL) AS tokens_first_ms,
                           maxIf(ts_ms, tokens IS NOT NULL) AS tokens_last_ms
                    FROM job_progress_clustered GROUP BY cluster, job_id, attempt) AS s
            ON u.cluster = s.cluster AND u.job_id = s.job_id AND u.attempt = s.attempt
    ) AS r
    GROUP BY r.cluster, r.job_id, r.attempt
) AS u ON p.cluster = u.cluster AND p.job_id = u.job_id AND p.attempt = u.attempt
LEFT JOIN job_checkpoint_time AS c ON p.cluster = c.cluster AND p.job_id = c.job_id AND p.attempt = c.attempt;
