-- Idle stretches across midnight stay one after the bill close when a record crosses midnight (review
-- finding: the close split them). A tick goes whole to the window it starts in (streams/join.py) and
-- agents stamp ticks with the wall clock, so the last idle record of a day may end after midnight: a tick
-- 23:59:58-00:00:03 is a record of D1. job_idle_stretches (sql/0037) sent a kept stretch of a worked-out
-- day (idle_stretches_daily) back to be joined again only if it ended at exactly the next midnight or
-- started at exactly its own: D1's stretch ending 00:00:03 and D2's starting 00:00:03 were each taken as
-- final, two stretches where the open days gave one (and the job report's longest stretches and stall
-- hints changed with the close). Now a kept stretch is joined again when it may go on across midnight:
--  * forward, when it ends at or after the next midnight (with the next day's stretch, or the open day's
--    idle records that start where it ends);
--  * backward, when it starts at its day's midnight (as before) or where a kept stretch of the same
--    attempt and GPU that reaches past its own day's midnight ends. Only a stretch of an earlier day
--    can: one that reaches past midnight ends after every start of its own day.
-- The same view otherwise (sql/0037: each idle record once, per attempt and GPU). Nothing is back-filled:
-- idle_stretches_daily keeps each day's stretches cut at the records' days, which were right.

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
    WHERE start_ms != toInt64(toUInt16(day)) * 86400000 AND end_ms < (toInt64(toUInt16(day)) + 1) * 86400000
      AND (cluster, job_id, attempt, gpu_uuid, start_ms) NOT IN
          (SELECT cluster, job_id, attempt, gpu_uuid, end_ms FROM idle_stretches_daily FINAL
           WHERE end_ms >= (toInt64(toUInt16(day)) + 1) * 86400000)
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
                arraySort(groupUniqArray((start_ms, end_ms, gpu_ms))) AS segs
            FROM
            (
                SELECT cluster, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms
                FROM idle_stretches_daily FINAL
                WHERE start_ms = toInt64(toUInt16(day)) * 86400000 OR end_ms >= (toInt64(toUInt16(day)) + 1) * 86400000
                   OR (cluster, job_id, attempt, gpu_uuid, start_ms) IN
                      (SELECT cluster, job_id, attempt, gpu_uuid, end_ms FROM idle_stretches_daily FINAL
                       WHERE end_ms >= (toInt64(toUInt16(day)) + 1) * 86400000)
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
