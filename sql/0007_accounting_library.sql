-- The accounting library in the warehouse: coefficient history, the definition versions
-- bills were computed with, and re-bills (past periods recomputed with other coefficients,
-- beside — never instead of — the original bills).

-- Throughput coefficients against the baseline card, with validity periods; full history.
-- Source of truth is the ledger config file; `gpuledger migrate` / `coefficients sync` copy it here.
CREATE TABLE IF NOT EXISTS coefficients
(
    model        LowCardinality(String),
    coefficient  Float64,
    valid_from   Date,
    version      String,
    recorded_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from);

-- Every definition version ever used, with a fingerprint of its content: a version whose
-- content changed without a new version number is refused (bills must never change silently).
CREATE TABLE IF NOT EXISTS definitions
(
    definition_version  String,
    fingerprint         String,
    content             String,
    recorded_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (definition_version, fingerprint);

CREATE TABLE IF NOT EXISTS rebill_runs
(
    rebill_id          String,
    day_from           Date,
    day_to             Date,
    coefficients_as_of Date,
    created_at         DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY rebill_id;

-- Re-billed usage at bill grain: same GPU time and cost, effective GPU time recomputed with the
-- coefficient valid on `coefficients_as_of` of the run.
CREATE TABLE IF NOT EXISTS rebilled_usage
(
    rebill_id            String,
    day                  Date,
    cluster              LowCardinality(String),
    tenant               LowCardinality(String),
    queue                LowCardinality(String),
    job_id               String,
    attempt              UInt32,
    gpu_model            LowCardinality(String),
    state                LowCardinality(String),
    definition_version   LowCardinality(String),
    gpu_ms               UInt64,
    coefficient          Float64,
    coefficient_version  String,
    effective_gpu_ms     UInt64,
    cost_micros          UInt64
)
ENGINE = MergeTree
ORDER BY (rebill_id, day, tenant, job_id, attempt, gpu_model, state);

-- The tenant bill of a re-bill run, with the same three lines as tenant_daily_bill.
CREATE VIEW IF NOT EXISTS tenant_daily_rebill AS
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
    sum(r.cost_micros) AS total_cost_micros
FROM rebilled_usage AS r
LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
    ON r.cluster = a.cluster AND r.job_id = a.job_id AND r.attempt = a.attempt
WHERE r.state IN ('executing', 'allocated_idle') AND r.job_id != ''
GROUP BY rebill_id, day, tenant, definition_version;
