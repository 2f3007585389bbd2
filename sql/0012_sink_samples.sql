-- The sink now also consumes gpu-samples (line 1) into gpu_health and node_inventory; their blocks
-- carry insert-deduplication tokens like every other sink table (see 0009), so a retried block is
-- stored once.
ALTER TABLE gpu_health MODIFY SETTING non_replicated_deduplication_window = 1000;
ALTER TABLE node_inventory MODIFY SETTING non_replicated_deduplication_window = 1000;
