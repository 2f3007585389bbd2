-- Load per node in 5-minute buckets (issue #13 point 3; docs/performance.md "Dashboard and report
-- queries"). The operations dashboard's "load by node" chart grouped the per-GPU table usage_gpu_5m
-- (one row per GPU and 5 minutes: 20 M rows for a week of 10,000 GPUs) into nodes on every view; this
-- table keeps the same sums per node, GPU model and queue, 8x fewer rows on 8-GPU nodes, filled by its
-- materialized view from usage_raw as usage_gpu_5m is, and back-filled from usage_gpu_5m (same sums).
-- The view's rows are partial sums of their key (ts, node, model, queue): parts not merged yet, and on a
-- cluster one row per shard holding some of the node's GPUs. Read it with sum() over the key, as every
-- dashboard metric does (a second GROUP BY in the view cost more than the chart's own, 0.9 s vs 0.35 s).
-- The back-fill runs only into an empty table, so a file run again after it adds nothing; apply it
-- with the sinks stopped, as 0018. Retention follows usage_gpu_5m's (GPULEDGER_RETENTION_LOAD_5M_DAYS).

CREATE TABLE IF NOT EXISTS usage_node_5m
(
    ts                    DateTime('UTC'),
    day                   Date,
    cluster               LowCardinality(String),
    node                  LowCardinality(String),
    gpu_model             LowCardinality(String),
    queue                 LowCardinality(String),
    total_gpu_ms          UInt64,
    executing_gpu_ms      UInt64,
    idle_gpu_ms           UInt64,
    unallocated_gpu_ms    UInt64,
    down_gpu_ms           UInt64,
    util_weighted_gpu_ms  Float64,
    util_gpu_ms           UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (ts, cluster, node, gpu_model, queue, day)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS usage_node_5m_mv TO usage_node_5m AS
SELECT
    toStartOfFiveMinutes(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS ts,
    day, cluster, node, gpu_model, queue,
    sum(gpu_ms) AS total_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS util_gpu_ms
FROM usage_raw
GROUP BY ts, day, cluster, node, gpu_model, queue;

INSERT INTO usage_node_5m
SELECT
    ts, day, cluster, node, gpu_model, queue,
    sum(total_gpu_ms), sum(executing_gpu_ms), sum(idle_gpu_ms), sum(unallocated_gpu_ms), sum(down_gpu_ms),
    sum(util_weighted_gpu_ms), sum(util_gpu_ms)
FROM usage_gpu_5m
WHERE (SELECT count() FROM usage_node_5m) = 0
GROUP BY ts, day, cluster, node, gpu_model, queue;

CREATE OR REPLACE VIEW node_load_5m AS
SELECT
    ts, day, cluster, node, gpu_model, queue,
    total_gpu_ms, executing_gpu_ms, idle_gpu_ms, unallocated_gpu_ms, down_gpu_ms, util_weighted_gpu_ms, util_gpu_ms
FROM usage_node_5m;
