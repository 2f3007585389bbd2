-- Each progress report once (review finding on sql/0021 and sql/0042, "re-sent job_progress stored
-- twice"): a report a producer sends again (a client's retry, a replay of the topic) arrives at a new
-- offset, so the sink writes it in another block under another insert-deduplication token and
-- job_progress holds both copies (sql/0045's deduplication window only catches a block written again).
-- Every view over the reports read the copies: job_training_signals and job_rank_step_times counted the
-- report twice (`reports`), and job_progress_deltas gave it a second row. job_progress_clustered, which
-- job_progress_deltas, job_progress_windows, job_rank_step_times and job_training_signals read, now
-- takes one row per report, identified by what it reports: (cluster, job_id, attempt, ts_ms, step);
-- where copies differ, the first received (lowest partition and offset) is kept. The check is made when
-- the view is read, so it holds for copies in different parts or on different shards (no merge is
-- waited for) and for copies written before this file. The table keeps every copy as received.

CREATE OR REPLACE VIEW job_progress_clustered AS
SELECT
    if(p.cluster = '' AND length(k.clusters) = 1, k.clusters[1], p.cluster) AS cluster,
    p.job_id AS job_id, p.attempt AS attempt, p.ts_ms AS ts_ms, p.step AS step, p.r.1 AS samples,
    p.r.2 AS tokens, p.r.3 AS epoch, p.r.4 AS loss, p.r.5 AS step_time_ms,
    p.r.6 AS rank_ids, p.r.7 AS rank_step_time_ms
FROM
(
    SELECT toString(cluster) AS cluster, job_id, attempt, ts_ms, step,
           argMin((samples, tokens, epoch, loss, step_time_ms, rank_ids, rank_step_time_ms),
                  (kafka_partition, kafka_offset)) AS r
    FROM job_progress
    GROUP BY cluster, job_id, attempt, ts_ms, step
) AS p
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
