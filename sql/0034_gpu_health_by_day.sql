-- gpu_health partitioned by day (docs/retention.md, "How rows expire"). It keeps per-sample rows for
-- GPULEDGER_RETENTION_HEALTH_DAYS (default 14) and is the largest table per GPU-day. Partitioned by
-- month, each day that expired left a month's part partly expired, and every TTL merge (one every
-- few hours per partition) rewrote the rest of that part: up to a month of samples read and written
-- again several times a day to drop one day. By day, a day's rows are their own parts, which expire
-- whole; with ttl_only_drop_parts (set here, and by retention.py on every partitioned table with a
-- TTL) expired parts are dropped, never rewritten.
--
-- The rebuild, as sql/0022's: a new table, a copy of every row, an exchange of the two names
-- (materialized views follow the name gpu_health), the old table dropped. Apply it with the sinks
-- stopped: rows written between the copy and the exchange would stay in the old table. The
-- migrator runs the EXCHANGE only while gpu_health's partition key is not yet the new one
-- (gpuledger/warehouse/migrations.py), and the copy starts from an empty table (TRUNCATE), so a file
-- interrupted anywhere is safe to run again and copies no row twice.
-- The DROP is SYNC: an Atomic database otherwise keeps a dropped table's data for 8 minutes.
-- Retention (TTL) is configuration: `gpuledger migrate` sets it on the new table after the migrations.

-- gpu_health's columns, as they are (sql/0010, 0012), with the new partitioning
CREATE TABLE IF NOT EXISTS gpu_health_by_day AS gpu_health
ENGINE = MergeTree
PARTITION BY day
ORDER BY (cluster, gpu_uuid, ts_ms)
SETTINGS non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1;

TRUNCATE TABLE IF EXISTS gpu_health_by_day;

-- The copy goes a day at a time (ORDER BY day): an insert block then touches one or two partitions,
-- not one part in each of the table's days per block; a block may still span more than a hundred
-- days where there are few samples a day, hence no limit on partitions per block.
INSERT INTO gpu_health_by_day SELECT * FROM gpu_health ORDER BY day
SETTINGS max_partitions_per_insert_block = 0;

EXCHANGE TABLES gpu_health AND gpu_health_by_day;

DROP TABLE IF EXISTS gpu_health_by_day SYNC;
