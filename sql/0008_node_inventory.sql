-- Node inventory: which nodes exist and which GPUs (uuid, model) each carries, as a NodeTick (line 1)
-- reports them. usage_raw only knows GPUs that produced usage, so CPU-only nodes (an empty GPU list) and
-- per-node GPU counts live here. One row per node per report; ReplacingMergeTree keeps the newest report
-- of each node, so read it with FINAL (or argMax by seen_ms).
-- Writer: the sink, one row per gpu-samples tick (gpuledger/sink/rows.py: inventory_row, source 'gpu-samples',
-- with the Kafka coordinates); the trace replays' inventory ticks come the same way, through Kafka.
CREATE TABLE IF NOT EXISTS node_inventory
(
    cluster          LowCardinality(String),
    node             String,
    seen_ms          Int64,
    day              Date DEFAULT toDate(fromUnixTimestamp64Milli(seen_ms, 'UTC')),
    gpu_count        UInt16,
    gpu_uuids        Array(String),
    gpu_models       Array(String),
    source           LowCardinality(String) DEFAULT '',
    kafka_topic      LowCardinality(String) DEFAULT '',
    kafka_partition  Int32 DEFAULT -1,
    kafka_offset     Int64 DEFAULT -1,
    inserted_at      DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(seen_ms)
ORDER BY (cluster, node);
