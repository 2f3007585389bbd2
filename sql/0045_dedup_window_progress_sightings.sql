-- Deduplication window for the sink tables and view targets that lacked one (review finding on 0019,
-- 0020, 0021): a block the sink writes again after a crash carries the same insert-deduplication token
-- (docs/reliability.md, "Exactly-once into ClickHouse"), but a MergeTree without
-- non_replicated_deduplication_window keeps no tokens, so the block was stored twice: job_progress (the
-- sink's progress reports; job_training_signals counted each report twice) and gpu_sightings (the
-- target of gpu_sightings_mv over node_inventory; a GPU's reports doubled). alerts and
-- reclaim_suggestions (ReplacingMergeTree: a copy folds only at a merge) get the window too. Rows
-- written twice before this file stay. The value is the one of 0009 and 0012.
ALTER TABLE job_progress MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE gpu_sightings MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE alerts MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE reclaim_suggestions MODIFY SETTING non_replicated_deduplication_window = 1000;
