-- usage_raw rebuilt for the open day (issue #13 point 3, docs/performance.md "Dashboard and report
-- queries"). Reports and the bill close read the usage of days not yet closed deduplicated by record id;
-- with usage_raw sorted GPU first and deduplicated with LIMIT 1 BY, that read every row of the month and
-- hashed every record id (5-11 s at 100 M rows). Now:
--  * the sort key is (cluster, day, hour, gpu_uuid, start_ms, record_id), hour = intDiv(start_ms, 3600000):
--    one day is one contiguous range of each part, and the sink's recent inserts (the last minutes of
--    every GPU) overlap the merged parts only in their own hour, so FINAL merges that hour and reads
--    the rest of the day as it is; "what ran on this GPU yesterday" reads 24 short ranges;
--  * the engine is ReplacingMergeTree: a record id is gpu_uuid/start_ms/slot, so copies of a record
--    (a replay, a second sink) share the whole sort key; merges keep one, and `FINAL` reads each
--    record once where they have not merged yet (gpuledger/warehouse/bills.py dedup_usage_sql).
-- The materialized views fire on inserts as before: each copy still reaches the live aggregates
-- (usage_dedup_audit counts them), as it did.
--
-- The rebuild: a new table, a copy of every row, an exchange of the two names (materialized views follow
-- the name usage_raw), the old table dropped. Apply it with the sinks stopped: rows written between
-- the copy and the exchange would stay in the old table. The migrator runs the EXCHANGE only while
-- usage_raw's sort key is not yet the new one, so a file interrupted anywhere is safe to run again
-- (gpuledger/warehouse/migrations.py); copying twice is harmless (the copies merge away).
-- The DROP is SYNC: an Atomic database otherwise keeps a dropped table's data for 8 minutes
-- (database_atomic_delay_before_drop_table_sec), here a copy of every usage record.
-- Retention (TTL) is configuration: `gpuledger migrate` sets it on the new table after the migrations.

CREATE TABLE IF NOT EXISTS usage_raw_by_day
(
    schema_version      UInt8,
    record_id           String,
    cluster             LowCardinality(String),
    node                LowCardinality(String),
    gpu_uuid            String,
    gpu_model           LowCardinality(String),
    start_ms            Int64,
    end_ms              Int64,
    day                 Date DEFAULT toDate(fromUnixTimestamp64Milli(start_ms, 'UTC')),
    state               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    share_milli         UInt16,
    gpu_ms              UInt64,
    util_pct            Nullable(Float64),
    util_metric_pct     Nullable(Float64),
    mem_used_bytes      Nullable(UInt64),
    energy_j            Float64,
    coefficient         Float64,
    coefficient_version LowCardinality(String),
    effective_gpu_ms    UInt64,
    cost_micros         UInt64,
    definition_version  LowCardinality(String),
    price_version       LowCardinality(String) DEFAULT '',
    priced_by_default   Bool DEFAULT false,
    sample_count        UInt32 DEFAULT 1,
    kafka_topic         LowCardinality(String),
    kafka_partition     Int32,
    kafka_offset        Int64,
    inserted_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, intDiv(start_ms, 3600000), gpu_uuid, start_ms, record_id)
SETTINGS non_replicated_deduplication_window = 1000;

INSERT INTO usage_raw_by_day SELECT * FROM usage_raw;

EXCHANGE TABLES usage_raw AND usage_raw_by_day;

DROP TABLE IF EXISTS usage_raw_by_day SYNC;
