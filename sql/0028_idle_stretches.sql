-- Idle stretches of closed days kept, not recomputed on every view (issue #13 point 3;
-- docs/performance.md "Dashboard and report queries"). job_idle_stretches (sql/0018) sorted every idle
-- record of every attempt and GPU into runs on each query: 10.7 M records for a week of 10,000 GPUs,
-- 1.2-1.8 s on 2 cores for the "idle stretches" chart. Now:
--  * job_idle_day_stretches: the same runs, cut at UTC midnight (records never cross it), per day;
--  * idle_stretches_daily keeps them for each day the bill close has worked out (gpuledger/warehouse/
--    idle_stretches.py, from `gpuledger bills close`), and idle_stretch_days the number of idle records
--    each day's stretches were made of. A close run works a day out again when that number changed (a
--    late record): it writes the day's stretches with a new version and a deleted row for each stretch
--    that is gone (ReplacingMergeTree(version, is_deleted), read with FINAL);
--  * job_idle_stretches joins the runs again: stretches of worked-out days that touch neither midnight
--    as they are; the pieces that touch one, with the idle records of days not worked out (open days),
--    sorted into runs again, so a stretch across midnight is one stretch. Late idle records of a
--    worked-out day show once the next close run has worked it out again.
-- The back-fill works out the closed days (committed close runs), version 1, and writes each day's
-- record count last; a file interrupted before that writes the same rows again (same keys, same
-- version: one kept). Apply it with the sinks stopped, as 0018.

CREATE TABLE IF NOT EXISTS idle_stretches_daily
(
    cluster     LowCardinality(String),
    day         Date,
    tenant      LowCardinality(String),
    queue       LowCardinality(String),
    job_id      String,
    attempt     UInt32,
    node        LowCardinality(String),
    gpu_uuid    String,
    gpu_model   LowCardinality(String),
    start_ms    Int64,
    end_ms      Int64,
    gpu_ms      UInt64,
    version     UInt64,
    is_deleted  UInt8
)
ENGINE = ReplacingMergeTree(version, is_deleted)
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, cluster, gpu_uuid, start_ms);

CREATE TABLE IF NOT EXISTS idle_stretch_days
(
    cluster   LowCardinality(String),
    day       Date,
    segments  UInt64,
    version   UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (cluster, day);

-- The runs of idle records of one attempt on one GPU within a UTC day: sorted by start, split where a
-- record does not start where the previous one ended (as sql/0018).
CREATE OR REPLACE VIEW job_idle_day_stretches AS
SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
       st.1 AS start_ms, st.2 AS end_ms, st.3 AS gpu_ms
FROM
(
    SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
        arrayMap(run -> (run[1].1, arrayMax(arrayMap(x -> x.2, run)), arraySum(arrayMap(x -> x.3, run))),
                 arraySplit((x, i) -> i > 1 AND x.1 != segs[i - 1].2, segs, arrayEnumerate(segs))) AS stretches
    FROM
    (
        SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
            arraySort(groupArray((start_ms, end_ms, gpu_ms))) AS segs
        FROM job_idle_segments
        GROUP BY job_id, attempt, cluster, gpu_uuid, tenant, queue, node, gpu_model, day
    )
)
ARRAY JOIN stretches AS st;

INSERT INTO idle_stretches_daily
SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms, 1, 0
FROM job_idle_day_stretches
WHERE (cluster, day) IN (SELECT cluster, day FROM closed_days WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
  AND (cluster, day) NOT IN (SELECT cluster, day FROM idle_stretch_days);

INSERT INTO idle_stretch_days
SELECT cluster, day, count(), 1
FROM job_idle_segments
WHERE (cluster, day) IN (SELECT cluster, day FROM closed_days WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
  AND (cluster, day) NOT IN (SELECT cluster, day FROM idle_stretch_days)
GROUP BY cluster, day;

-- Midnight of a stretch's day in ms: toUInt16 of a Date is its day number since 1970-01-01.
CREATE OR REPLACE VIEW job_idle_stretches AS
SELECT
    s.cluster AS cluster, s.tenant AS tenant, s.queue AS queue, s.job_id AS job_id, s.attempt AS attempt,
    s.node AS node, s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model,
    fromUnixTimestamp64Milli(s.start_ms, 'UTC') AS stretch_start,
    fromUnixTimestamp64Milli(s.end_ms, 'UTC') AS stretch_end,
    (s.end_ms - s.start_ms) / 1000 AS duration_seconds,
    s.gpu_ms / 1000 AS idle_gpu_seconds,
    s.start_ms - a.attempt_start_ms AS offset_ms
FROM
(
    SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms
    FROM idle_stretches_daily FINAL
    WHERE start_ms != toInt64(toUInt16(day)) * 86400000 AND end_ms != (toInt64(toUInt16(day)) + 1) * 86400000
    UNION ALL
    SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, st.1, st.2, st.3
    FROM
    (
        SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
            arrayMap(run -> (run[1].1, arrayMax(arrayMap(x -> x.2, run)), arraySum(arrayMap(x -> x.3, run))),
                     arraySplit((x, i) -> i > 1 AND x.1 != segs[i - 1].2, segs, arrayEnumerate(segs))) AS stretches
        FROM
        (
            SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model,
                arraySort(groupArray((start_ms, end_ms, gpu_ms))) AS segs
            FROM
            (
                SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms
                FROM idle_stretches_daily FINAL
                WHERE start_ms = toInt64(toUInt16(day)) * 86400000 OR end_ms = (toInt64(toUInt16(day)) + 1) * 86400000
                UNION ALL
                SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms
                FROM job_idle_segments
                WHERE day IN (SELECT day FROM usage_capacity_daily
                              WHERE (cluster, day) NOT IN (SELECT cluster, day FROM idle_stretch_days))
                  AND (cluster, day) NOT IN (SELECT cluster, day FROM idle_stretch_days)
            )
            GROUP BY job_id, attempt, cluster, gpu_uuid, tenant, queue, node, gpu_model
        )
    )
    ARRAY JOIN stretches AS st
) AS s
LEFT JOIN
(
    SELECT cluster, job_id, attempt, min(first_start_ms) AS attempt_start_ms
    FROM usage_by_job_daily
    WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
    GROUP BY cluster, job_id, attempt
) AS a ON s.cluster = a.cluster AND s.job_id = a.job_id AND s.attempt = a.attempt;
