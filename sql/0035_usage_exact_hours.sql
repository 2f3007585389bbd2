-- Hours of open days whose usage_by_job_hourly counts were found exact (issue #13 point 3;
-- docs/performance.md "Dashboard and report queries"; gpuledger/warehouse/bills.py).
-- A report reads an open day from usage_by_job_hourly only when the table counted as many records as
-- usage_raw holds distinct ones (sql/0027). Counting the distinct ones reads the whole day with FINAL:
-- ~0.1 s of every report at 10,000 GPUs. `gpuledger bills close` (cron) writes here, per hour, the
-- count it found when the two agreed; a report then counts with FINAL only the hours whose hourly count
-- has changed since, and checks the day's plain count() (deleted records show there). Why that is
-- exact: the hourly count only grows (its view counts every insert), so an hour whose count still equals
-- the one stored had no insert since, and held each record once then; a plain count() of the day equal
-- to the hourly count then says nothing was deleted either. Nothing here is trusted by a close run,
-- which always counts. An hour's count only grows, so the engine keeps the largest one (its version);
-- a reader takes max(records). checked_at is when it was found. Retention follows usage_raw's
-- (GPULEDGER_RETENTION_USAGE_DAYS).

CREATE TABLE IF NOT EXISTS usage_exact_hours
(
    cluster     LowCardinality(String),
    day         Date,
    hour        Int64,
    records     UInt64,
    checked_at  DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(records)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, hour);
