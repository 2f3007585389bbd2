-- Idle stretches count each idle record once (review finding: a record delivered twice made a phantom
-- stretch and a false "mid-run stalls" hint). The sink delivers at least once, and job_idle_segments
-- (sql/0018) is a plain MergeTree filled by a materialized view: a copy of an idle record is stored
-- twice. The views of sql/0028 sorted groupArray of the records into runs and split where a record
-- does not start where the previous one ended, so the copy (which starts before the previous record's
-- end) opened a stretch of its own: 10:00-10:05 and 10:05-10:10 idle, the second record twice, gave
-- two stretches, 10:00 for 600 s and 10:05 for 300 s, instead of one of 600 s.
--  * job_idle_day_stretches and job_idle_stretches: the same views with groupUniqArray, each record
--    once. The arrays are per attempt and GPU (and day), so records of two GPUs of a job idle over the
--    same time are never merged. job_idle_segments has no record id; within one attempt on one GPU a
--    record is its (start_ms, end_ms, gpu_ms): an attempt holds a GPU in one slot (streams/join.py adds
--    an attempt's MIG instances of one GPU up into one holder), so it has at most one idle record of a
--    GPU starting at a given time (record id = GPU / start / slot), and equal values are copies.
--  * the closed days already worked out (idle_stretches_daily, sql/0028) whose idle records hold a
--    copy are worked out again: the days are found once (a GROUP BY on job_idle_segments' own sort
--    key, read in order, so memory stays flat however long the retention), kept in
--    idle_stretch_rework_days for the next statements, which then write a deleted row for each stretch
--    that is gone, the stretches that changed, and the day's record count (rows, as
--    gpuledger/warehouse/idle_stretches.py counts them), each with a version above every stored one;
--    the helper table is dropped last. Every write skips what is there already, so a file run again
--    adds nothing. The scan reads five columns of every stored idle record: plan the upgrade of a
--    large warehouse for it; apply it with the close runs stopped.

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
            arraySort(groupUniqArray((start_ms, end_ms, gpu_ms))) AS segs
        FROM job_idle_segments
        GROUP BY job_id, attempt, cluster, gpu_uuid, tenant, queue, node, gpu_model, day
    )
)
ARRAY JOIN stretches AS st;

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
                arraySort(groupUniqArray((start_ms, end_ms, gpu_ms))) AS segs
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

-- The worked-out days whose idle records hold a copy: records of one attempt and GPU with one start.
CREATE TABLE IF NOT EXISTS idle_stretch_rework_days
(
    cluster  LowCardinality(String),
    day      Date
)
ENGINE = ReplacingMergeTree
ORDER BY (cluster, day);

INSERT INTO idle_stretch_rework_days
SELECT DISTINCT cluster, copy_day
FROM
(
    SELECT cluster, any(day) AS copy_day
    FROM job_idle_segments
    WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_days)
    GROUP BY job_id, attempt, cluster, gpu_uuid, start_ms
    HAVING count() > 1
)
SETTINGS optimize_aggregation_in_order = 1;

-- Stretches of those days that are gone: a deleted row each (as idle_stretches.refresh).
INSERT INTO idle_stretches_daily
SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms,
       (SELECT max(version) + 1 FROM idle_stretches_daily), 1
FROM idle_stretches_daily FINAL
WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_rework_days)
  AND (cluster, job_id, attempt, gpu_uuid, start_ms) NOT IN
      (SELECT cluster, job_id, attempt, gpu_uuid, start_ms FROM job_idle_day_stretches
       WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_rework_days));

-- Their stretches, where not stored as they are.
INSERT INTO idle_stretches_daily
SELECT cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms,
       (SELECT max(version) + 1 FROM idle_stretches_daily), 0
FROM job_idle_day_stretches
WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_rework_days)
  AND (cluster, job_id, attempt, gpu_uuid, start_ms, end_ms, gpu_ms) NOT IN
      (SELECT cluster, job_id, attempt, gpu_uuid, start_ms, end_ms, gpu_ms FROM idle_stretches_daily FINAL
       WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_rework_days));

-- Their record counts, where not stored.
INSERT INTO idle_stretch_days
SELECT cluster, day, count(), (SELECT max(version) + 1 FROM idle_stretch_days)
FROM job_idle_segments
WHERE (cluster, day) IN (SELECT cluster, day FROM idle_stretch_rework_days)
GROUP BY cluster, day
HAVING (cluster, day, count()) NOT IN
       (SELECT cluster, day, argMax(segments, version) FROM idle_stretch_days GROUP BY cluster, day);

DROP TABLE IF EXISTS idle_stretch_rework_days SYNC;
