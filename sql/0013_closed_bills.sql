-- Closed periods (docs/accounting.md §6a, docs/reliability.md "Closed periods"). A billing day of a
-- cluster closes once the warehouse's event-time horizon of that cluster (max end_ms of usage_raw) has
-- passed the end of the day plus GPULEDGER_BILLS_CLOSE_GRACE_S. Closing (gpuledger/warehouse/bills.py) writes the
-- day's bill rows here, computed from usage deduplicated by record_id. Every table here is append-only:
-- rows are inserted once by a close run and never updated or deleted. Later data for a closed day is
-- booked as adjustments (sql/0014), never by changing these rows.

-- One row per close run that wrote anything.
CREATE TABLE IF NOT EXISTS bill_runs
(
    bill_run_id         String,
    created_at          DateTime64(3, 'UTC') DEFAULT now64(3),
    days                Array(Date),
    clusters            Array(String),
    definition_version  LowCardinality(String),
    grace_s             Float64,
    horizons            Map(String, Int64),
    closed_rows         UInt64,
    adjustment_rows     UInt64
)
ENGINE = MergeTree
ORDER BY (created_at, bill_run_id);

-- Which (cluster, day) are closed, and by which run. Days without billable usage are closed too (a
-- day with no rows), so that data arriving for them later is an adjustment like any other.
CREATE TABLE IF NOT EXISTS closed_days
(
    day          Date,
    cluster      LowCardinality(String),
    bill_run_id  String,
    horizon_ms   Int64,
    closed_at    DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (cluster, day);

-- The closed tenant bill: per day, cluster, tenant, queue, line (compute | idle | failed_retry) and
-- definition version. Same lines as tenant_daily_bill, from deduplicated usage.
CREATE TABLE IF NOT EXISTS closed_tenant_bill
(
    day                 Date,
    cluster             LowCardinality(String),
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    line                LowCardinality(String),
    definition_version  LowCardinality(String),
    gpu_ms              UInt64,
    effective_gpu_ms    UInt64,
    cost_micros         Int128,  -- sums of bounded records cannot wrap (docs/accounting.md §4b)
    currency            LowCardinality(String),
    bill_run_id         String,
    closed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, line, definition_version);

-- The closed job cost at attempt grain: per day, cluster, job attempt and line, with the attempt's
-- outcome as known at the close (the outcome decides compute vs failed_retry). Adjustments are
-- worked out against these rows.
CREATE TABLE IF NOT EXISTS closed_job_cost
(
    day                 Date,
    cluster             LowCardinality(String),
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    outcome             LowCardinality(String),
    line                LowCardinality(String),
    definition_version  LowCardinality(String),
    gpu_ms              UInt64,
    effective_gpu_ms    UInt64,
    cost_micros         Int128,  -- sums of bounded records cannot wrap (docs/accounting.md §4b)
    currency            LowCardinality(String),
    bill_run_id         String,
    closed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, job_id, attempt, line, definition_version);

-- The closed queue efficiency per cohort day (the UTC day attempts were queued), cluster and queue,
-- as queue_efficiency computes it at the close (from deduplicated usage): one row for all tenants
-- (tenant = '') and one per tenant (quantiles do not add up, so both are kept).
CREATE TABLE IF NOT EXISTS closed_queue_efficiency
(
    day                     Date,
    cluster                 LowCardinality(String),
    queue                   LowCardinality(String),
    tenant                  LowCardinality(String),
    attempts                UInt64,
    requested_gpu_seconds   Float64,
    allocated_gpu_seconds   Float64,
    executed_gpu_seconds    Float64,
    waits                   UInt64,
    queue_wait_p50_s        Nullable(Float64),
    queue_wait_p90_s        Nullable(Float64),
    queue_wait_p99_s        Nullable(Float64),
    queue_wait_mean_s       Nullable(Float64),
    queue_wait_max_s        Nullable(Float64),
    definition_version      LowCardinality(String),
    bill_run_id             String,
    closed_at               DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, queue, tenant);
