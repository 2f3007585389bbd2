-- Exactly-once effect of the sink (docs/reliability.md, "Exactly-once into ClickHouse") and
-- per-tenant bills for services (docs/reliability.md, "Access"; the per-user views are in 0011,
-- after tenant_access exists).

-- Insert deduplication on plain MergeTree tables: the sink writes every block with an
-- insert_deduplication_token naming its Kafka offset range, and with
-- deduplicate_blocks_in_dependent_materialized_views = 1, so a block written again after a crash
-- is dropped by each table on its own — also by a materialized view's target when the source
-- table took the block but the view's insert was lost. The window only has to cover the blocks a
-- crashed sink may write again (its last flush), so 1000 blocks per table is ample.
ALTER TABLE usage_raw MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE usage_by_job_daily MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE usage_capacity_daily MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE job_events MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE job_attempts_state MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE scheduler_snapshots MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE scheduler_preemptions MODIFY SETTING non_replicated_deduplication_window = 1000;

-- The sink's progress per consumer group, topic and partition. Before a block is written a
-- 'pending' row records its offset range [from_offset, to_offset) and, for the usage topic, each
-- GPU's horizon (end of the latest record taken) before the block; after it, a 'done' row records
-- the horizons after it. The row with the highest seq wins (ReplacingMergeTree keeps the table
-- small). A restarted sink skips messages below a done range and rebuilds a pending range exactly.
CREATE TABLE IF NOT EXISTS sink_progress
(
    consumer     String,
    topic        String,
    partition    Int32,
    epoch        UInt32,
    from_offset  Int64,
    to_offset    Int64,
    phase        LowCardinality(String),
    horizons     Map(String, Int64),
    seq          UInt64,
    written_at   DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (consumer, topic, partition);

-- Per-tenant bills. Parameterized views for a service that serves one tenant at a time:
--   SELECT * FROM tenant_daily_bill_for(tenant = 'vision')
CREATE VIEW IF NOT EXISTS tenant_daily_bill_for AS
SELECT * FROM tenant_daily_bill WHERE tenant = {tenant:String};

CREATE VIEW IF NOT EXISTS job_cost_for AS
SELECT * FROM job_cost WHERE tenant = {tenant:String};
