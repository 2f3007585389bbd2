-- Training signals, pilot-run approvals and the capacity forecast (issue #15, points 3 to 5;
-- docs/planning.md says how every figure is computed).
--
-- job_progress holds line 4, the optional progress reports of training jobs (schemas/models.py
-- JobProgress, topic <prefix>job-progress, written by the sink). The views below join it to the
-- job's usage records and lifecycle events: cost per step and per million tokens, the step rate per
-- 10-minute window beside the GPUs' utilization ("busy vs productive"), per-rank step times, and
-- the time spent in checkpoints.

-- ---------------------------------------------------------------- line 4: progress reports
CREATE TABLE IF NOT EXISTS job_progress
(
    schema_version     UInt8,
    ts_ms              Int64,
    day                Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    -- '' where the job did not say
    cluster            LowCardinality(String),
    job_id             String,
    attempt            UInt32,
    step               Int64,
    samples            Nullable(Int64),
    tokens             Nullable(Int64),
    epoch              Nullable(Float64),
    samples_per_s      Nullable(Float64),
    tokens_per_s       Nullable(Float64),
    step_time_ms       Nullable(Float64),
    loss               Nullable(Float64),
    -- per-rank step times, parallel arrays (empty when the job reports none)
    rank_ids           Array(UInt32),
    rank_step_time_ms  Array(Float64),
    kafka_topic        LowCardinality(String),
    kafka_partition    Int32,
    kafka_offset       Int64,
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, ts_ms);

-- Each report with the step, token and sample progress since the attempt's previous report
-- (0 for the first), and the 10-minute window (UTC) it falls in.
CREATE VIEW IF NOT EXISTS job_progress_deltas AS
SELECT
    job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
    toStartOfInterval(fromUnixTimestamp64Milli(ts_ms, 'UTC'), INTERVAL 10 MINUTE) AS window_start,
    if(prev_ts = 0, 0, ts_ms - prev_ts) AS d_ms,
    if(prev_ts = 0, 0, step - prev_step) AS d_step,
    if(prev_ts = 0 OR tokens IS NULL, 0, assumeNotNull(tokens) - prev_tokens) AS d_tokens
FROM
(
    SELECT
        job_id, attempt, ts_ms, step, tokens, samples, epoch, loss, step_time_ms,
        lagInFrame(ts_ms, 1, 0) OVER w AS prev_ts,
        lagInFrame(step, 1, 0) OVER w AS prev_step,
        lagInFrame(coalesce(tokens, 0), 1, 0) OVER w AS prev_tokens
    FROM job_progress
    WINDOW w AS (PARTITION BY job_id, attempt ORDER BY ts_ms ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
);

-- Step rate per attempt and 10-minute window (steps made in the window / the time they took), with
-- the GPU-time-weighted utilization of the attempt's GPUs while executing in the same window.
CREATE VIEW IF NOT EXISTS job_progress_windows AS
SELECT
    p.job_id AS job_id, p.attempt AS attempt, p.window_start AS window_start,
    p.steps AS steps, p.seconds AS seconds, p.steps / p.seconds AS steps_per_s,
    p.tokens / p.seconds AS tokens_per_s, p.reports AS reports,
    u.util_pct AS util_pct
FROM
(
    SELECT job_id, attempt, window_start, sum(d_step) AS steps, sum(d_ms) / 1000 AS seconds,
           sum(d_tokens) AS tokens, count() AS reports
    FROM job_progress_deltas WHERE d_ms > 0
    GROUP BY job_id, attempt, window_start
) AS p
LEFT JOIN
(
    SELECT job_id, attempt,
           toStartOfInterval(fromUnixTimestamp64Milli(start_ms, 'UTC'), INTERVAL 10 MINUTE) AS window_start,
           sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL)
               / nullIf(sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL), 0) AS util_pct
    FROM usage_raw
    WHERE job_id IN (SELECT DISTINCT job_id FROM job_progress)
    GROUP BY job_id, attempt, window_start
) AS u
ON p.job_id = u.job_id AND p.attempt = u.attempt AND p.window_start = u.window_start
WHERE p.seconds > 0;

-- Mean step time of each rank of each attempt (the reports that name ranks).
CREATE VIEW IF NOT EXISTS job_rank_step_times AS
SELECT job_id, attempt, rank, avg(rank_time) AS mean_step_time_ms, count() AS reports
FROM job_progress
ARRAY JOIN rank_ids AS rank, rank_step_time_ms AS rank_time
GROUP BY job_id, attempt, rank;

-- Checkpoint time per attempt: each checkpoint_end paired with the checkpoint_begin before it
-- (begins and ends in time order; an open checkpoint is not counted).
CREATE VIEW IF NOT EXISTS job_checkpoint_time AS
SELECT job_id, attempt, length(ends) AS checkpoints,
       arraySum(arrayMap((b, e) -> greatest(e - b, 0), arraySlice(begins, 1, length(ends)), ends)) / 1000
           AS checkpoint_seconds
FROM
(
    SELECT job_id, attempt,
           arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_begin')) AS begins,
           arraySlice(arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_end')), 1,
                      countIf(kind = 'checkpoint_begin')) AS ends
    FROM job_events
    WHERE kind IN ('checkpoint_begin', 'checkpoint_end')
    GROUP BY job_id, attempt
);

-- Per attempt: progress between its first and last report, and the cost, GPU-time and energy of
-- its usage records over the same span (each record counted by the part of it inside the span).
CREATE VIEW IF NOT EXISTS job_training_signals AS
SELECT
    p.job_id AS job_id, p.attempt AS attempt, p.first_ms AS first_ms, p.last_ms AS last_ms,
    p.reports AS reports, p.steps AS steps, p.tokens AS tokens, p.last_loss AS last_loss,
    (p.last_ms - p.first_ms) / 1000 AS span_seconds,
    u.gpu_ms / 3600000 AS span_gpu_hours, u.cost_micros / 1e6 AS span_cost, u.energy_j AS span_energy_j,
    u.cost_micros / 1e6 / nullIf(p.steps, 0) AS cost_per_step,
    u.cost_micros / 1e6 / nullIf(p.tokens, 0) * 1e6 AS cost_per_million_tokens,
    coalesce(c.checkpoints, 0) AS checkpoints, coalesce(c.checkpoint_seconds, 0) AS checkpoint_seconds
FROM
(
    SELECT job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms, count() AS reports,
           argMax(step, ts_ms) - argMin(step, ts_ms) AS steps,
           coalesce(argMax(tokens, ts_ms), 0) - coalesce(argMin(tokens, ts_ms), 0) AS tokens,
           argMax(loss, ts_ms) AS last_loss
    FROM job_progress GROUP BY job_id, attempt
) AS p
LEFT JOIN
(
    SELECT r.job_id AS job_id, r.attempt AS attempt,
           sum(r.gpu_ms * r.part) AS gpu_ms, sum(r.cost_micros * r.part) AS cost_micros,
           sum(r.energy_j * r.part) AS energy_j
    FROM
    (
        SELECT u.job_id AS job_id, u.attempt AS attempt, u.gpu_ms AS gpu_ms, u.cost_micros AS cost_micros,
               u.energy_j AS energy_j,
               greatest(least(u.end_ms, s.last_ms) - greatest(u.start_ms, s.first_ms), 0)
                   / greatest(u.end_ms - u.start_ms, 1) AS part
        FROM usage_raw AS u
        INNER JOIN (SELECT job_id, attempt, min(ts_ms) AS first_ms, max(ts_ms) AS last_ms
                    FROM job_progress GROUP BY job_id, attempt) AS s
            ON u.job_id = s.job_id AND u.attempt = s.attempt
        WHERE u.state IN ('executing', 'allocated_idle')
    ) AS r
    GROUP BY r.job_id, r.attempt
) AS u ON p.job_id = u.job_id AND p.attempt = u.attempt
LEFT JOIN job_checkpoint_time AS c ON p.job_id = c.job_id AND p.attempt = c.attempt;

-- ---------------------------------------------------------------- pilot-run approvals
-- Append-only: every status change of an estimate is a row (pending, then approved or rejected);
-- the current status of an approval is its latest row. `gpuledger approvals` writes it and sends
-- each row to the <prefix>approvals topic (schemas/models.py ApprovalDecision).
CREATE TABLE IF NOT EXISTS approvals
(
    approval_id       String,
    job_id            String,
    status            LowCardinality(String),
    ts_ms             Int64,
    decided_by        String,
    note              String,
    target            String,
    cost_micros       Int64,
    cost_low_micros   Int64,
    cost_high_micros  Int64,
    threshold_micros  Int64,
    currency          LowCardinality(String),
    gpu_hours         Float64,
    wall_hours        Float64,
    -- the whole estimate as JSON (inputs, figures, interval), for the record
    estimate          String,
    inserted_at       DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (approval_id, ts_ms);

CREATE VIEW IF NOT EXISTS approvals_current AS
SELECT approval_id, argMax(job_id, ts_ms) AS job_id, argMax(status, ts_ms) AS status,
       min(ts_ms) AS requested_ms, max(ts_ms) AS updated_ms, argMax(decided_by, ts_ms) AS decided_by,
       argMax(note, ts_ms) AS note, argMax(target, ts_ms) AS target,
       argMax(cost_micros, ts_ms) / 1e6 AS estimated_cost, argMax(cost_high_micros, ts_ms) / 1e6 AS estimated_cost_high,
       argMax(threshold_micros, ts_ms) / 1e6 AS threshold_cost, argMax(currency, ts_ms) AS currency,
       argMax(gpu_hours, ts_ms) AS gpu_hours, argMax(wall_hours, ts_ms) AS wall_hours
FROM approvals GROUP BY approval_id;

-- ---------------------------------------------------------------- capacity forecast
-- One run of `gpuledger forecast run` writes the daily demand history it fitted and the forecast
-- with its bands, per GPU model and queue (queue '*': the model's total, fitted on its own), beside
-- the model's capacity. capacity_forecast_latest keeps only the latest run.
CREATE TABLE IF NOT EXISTS capacity_forecast
(
    run_id              String,
    created_at          DateTime64(3, 'UTC'),
    day                 Date,
    gpu_model           LowCardinality(String),
    queue               LowCardinality(String),
    -- 'history' (measured) or 'forecast'
    kind                LowCardinality(String),
    demand_gpu_hours    Float64,
    lower_gpu_hours     Float64,
    upper_gpu_hours     Float64,
    capacity_gpu_hours  Float64,
    -- e.g. 'ETS(A,Ad,A,7) 80%'
    method              String
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(created_at)
ORDER BY (run_id, gpu_model, queue, day);

CREATE VIEW IF NOT EXISTS capacity_forecast_latest AS
SELECT day, gpu_model, queue, kind, demand_gpu_hours, lower_gpu_hours, upper_gpu_hours, capacity_gpu_hours,
       method, run_id, created_at
FROM capacity_forecast
WHERE run_id = (SELECT argMax(run_id, created_at) FROM capacity_forecast);
