-- Keys of an attempt and of an attempt's GPU in job_gpu_usage (issue #13 point 3; docs/performance.md
-- "Dashboard and report queries"). Stragglers group job_gpu_usage's rows per attempt and GPU, then per
-- attempt: over the 719,200 rows of the benchmark's week that grouping by cluster, job id, attempt,
-- node and GPU UUID (two strings among them) took most of the weekly report's 0.18-0.24 s for them.
-- gpu_key and attempt_key are 64-bit hashes of those columns, computed when a row is written (the
-- materialized view's rows included) and by the mutation below for the rows already there (until it
-- has run, a part without them computes them as it is read); grouped by them, the stragglers take
-- ~0.08 s. A hash can collide: two of the 360,000 attempt GPUs of a week share one with a chance of
-- about 4e-9, and the stragglers are hints, never money.

ALTER TABLE job_gpu_usage
    ADD COLUMN IF NOT EXISTS gpu_key UInt64 MATERIALIZED cityHash64(cluster, job_id, attempt, node, gpu_uuid),
    ADD COLUMN IF NOT EXISTS attempt_key UInt64 MATERIALIZED cityHash64(cluster, job_id, attempt);

ALTER TABLE job_gpu_usage MATERIALIZE COLUMN gpu_key;

ALTER TABLE job_gpu_usage MATERIALIZE COLUMN attempt_key;
