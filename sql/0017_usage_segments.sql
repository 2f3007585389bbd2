-- Segments, not ticks (issue #13, docs/accounting.md "Segments"). The worker writes one usage record
-- per GPU, holder and state for a stretch of samples, cut at the ledger's aligned window ([segments]
-- window_s, default 60 s, dividing an hour so hourly and daily buckets split exactly), instead of one
-- per sample. sample_count is the number of samples a record covers; rows written before read 1 (one
-- record per sample). Nothing else changes: gpu_ms, effective_gpu_ms, cost_micros and energy_j are the
-- sums of the per-sample figures, and util_pct / util_metric_pct / mem_used_bytes the gpu_ms-weighted
-- means over the segment's samples, which all measure utilization (or all do not), so every view and
-- aggregate that weights util by gpu_ms (usage_by_job_daily_mv, gpu_load_5m, utilization_hourly,
-- job_gpu_balance) gives the same figures as over per-sample rows. job_idle_stretches joins back-to-back
-- segments as it joined back-to-back samples; job_util_histogram buckets a segment by its mean.

ALTER TABLE usage_raw ADD COLUMN IF NOT EXISTS sample_count UInt32 DEFAULT 1 AFTER priced_by_default;
