-- Price history and re-billing cost (docs/accounting.md, §4c).

-- Unit prices per GPU model with validity dates; full history, like `coefficients` (sql/0007).
-- Source of truth is the ledger config file ([[prices]], or the older [prices.MODEL] tables, valid
-- from 1970-01-01); `gpuledger migrate` / `coefficients sync` copy it here and refuse an entry whose
-- values changed (history is append-only).
CREATE TABLE IF NOT EXISTS prices
(
    model                  LowCardinality(String),
    valid_from             Date,
    version                String,
    depreciation_per_hour  Float64,
    maintenance_per_hour   Float64,
    recorded_at            DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from);

-- A re-bill may recompute cost too (`gpuledger rebill --cost`): with the prices valid on the as-of
-- day, beside the original cost, which the rows keep.
ALTER TABLE rebill_runs ADD COLUMN IF NOT EXISTS cost_recomputed Bool DEFAULT false;
ALTER TABLE rebilled_usage MODIFY COLUMN cost_micros Int128;
ALTER TABLE rebilled_usage ADD COLUMN IF NOT EXISTS original_cost_micros Int128 DEFAULT cost_micros;
ALTER TABLE rebilled_usage ADD COLUMN IF NOT EXISTS energy_j Float64 DEFAULT 0;
ALTER TABLE rebilled_usage ADD COLUMN IF NOT EXISTS price_version String DEFAULT '';
ALTER TABLE rebilled_usage ADD COLUMN IF NOT EXISTS priced_by_default Bool DEFAULT false;

-- The tenant bill of a re-bill run (sql/0007), with the cost lines beside the effective GPU-hours,
-- the original cost, and the GPU-hours priced by default.
CREATE OR REPLACE VIEW tenant_daily_rebill AS
SELECT
    r.rebill_id AS rebill_id,
    r.day AS day,
    r.tenant AS tenant,
    r.definition_version AS definition_version,
    sumIf(r.effective_gpu_ms, r.state = 'executing' AND a.outcome != 'failed') / 3600000 AS compute_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, r.state = 'allocated_idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, r.state = 'executing' AND a.outcome = 'failed') / 3600000 AS failed_retry_effective_gpu_hours,
    sum(r.effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(r.gpu_ms) / 3600000 AS total_gpu_hours,
    sum(r.cost_micros) AS total_cost_micros,
    sumIf(r.cost_micros, r.state = 'executing' AND a.outcome != 'failed') AS compute_cost_micros,
    sumIf(r.cost_micros, r.state = 'allocated_idle') AS idle_cost_micros,
    sumIf(r.cost_micros, r.state = 'executing' AND a.outcome = 'failed') AS failed_retry_cost_micros,
    sum(r.original_cost_micros) AS original_total_cost_micros,
    sumIf(r.gpu_ms, r.priced_by_default) / 3600000 AS priced_by_default_gpu_hours
FROM rebilled_usage AS r
LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
    ON r.cluster = a.cluster AND r.job_id = a.job_id AND r.attempt = a.attempt
WHERE r.state IN ('executing', 'allocated_idle') AND r.job_id != ''
GROUP BY rebill_id, day, tenant, definition_version;
