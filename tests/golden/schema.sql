-- The warehouse schema after every migration in sql/ (tests/integration/test_schema_snapshot.py).
-- Do not edit: GPULEDGER_UPDATE_GOLDEN=1 rewrites it; review the diff like a migration.

CREATE TABLE {db}.alerts
(
    `schema_version` UInt8,
    `alert_id` String,
    `rule` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `cluster` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `gpus` Array(String),
    `status` LowCardinality(String),
    `version` UInt8,
    `opened_at_ms` Int64,
    `closed_at_ms` Nullable(Int64),
    `window_start_ms` Int64,
    `window_end_ms` Int64,
    `message` String,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(opened_at_ms, 'UTC')),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, alert_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.alerts_latest
(
    `alert_id` String,
    `rule` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `cluster` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `gpus` Array(String),
    `status` LowCardinality(String),
    `opened_at` DateTime64(3, 'UTC'),
    `closed_at` Nullable(DateTime64(3, 'UTC')),
    `open_minutes` Float64,
    `window_start_ms` Int64,
    `window_end_ms` Int64,
    `message` String,
    `day` Date
)
AS SELECT
    alert_id,
    rule,
    definition_version,
    cluster,
    job_id,
    attempt,
    tenant,
    queue,
    gpus,
    status,
    fromUnixTimestamp64Milli(opened_at_ms, 'UTC') AS opened_at,
    if(closed_at_ms IS NULL, NULL, fromUnixTimestamp64Milli(assumeNotNull(closed_at_ms), 'UTC')) AS closed_at,
    (ifNull(closed_at_ms, window_end_ms) - opened_at_ms) / 60000 AS open_minutes,
    window_start_ms,
    window_end_ms,
    message,
    day
FROM {db}.alerts
FINAL;

CREATE TABLE {db}.approvals
(
    `approval_id` String,
    `cluster` LowCardinality(String) DEFAULT '',
    `job_id` String,
    `attempt` UInt32 DEFAULT 0,
    `status` LowCardinality(String),
    `ts_ms` Int64,
    `decided_by` String,
    `note` String,
    `target` String,
    `cost_micros` Int64,
    `cost_low_micros` Int64,
    `cost_high_micros` Int64,
    `threshold_micros` Int64,
    `currency` LowCardinality(String),
    `gpu_hours` Float64,
    `wall_hours` Float64,
    `estimate` String,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (approval_id, ts_ms)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.approvals_current
(
    `approval_id` String,
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `status` String,
    `requested_ms` Int64,
    `updated_ms` Int64,
    `decided_by` String,
    `note` String,
    `target` String,
    `estimated_cost` Float64,
    `estimated_cost_high` Float64,
    `threshold_cost` Float64,
    `currency` String,
    `gpu_hours` Float64,
    `wall_hours` Float64,
    `needs_reapproval` String
)
AS SELECT
    *,
    if((cluster = '') AND (status IN ('pending', 'approved')), concat('names no cluster (recorded before sql/0044 from an estimate that names none): an approval of it ', 'admits no job; estimate job ', job_id, ' again with --cluster and decide the new approval'), '') AS needs_reapproval
FROM
(
    SELECT
        approval_id,
        if(max(cluster) != '', max(cluster), JSONExtractString(argMin(estimate, ts_ms), 'cluster')) AS cluster,
        argMax(job_id, ts_ms) AS job_id,
        greatest(max(attempt), JSONExtract(argMin(estimate, ts_ms), 'attempt', 'UInt32')) AS attempt,
        argMax(status, ts_ms) AS status,
        min(ts_ms) AS requested_ms,
        max(ts_ms) AS updated_ms,
        argMax(decided_by, ts_ms) AS decided_by,
        argMax(note, ts_ms) AS note,
        argMax(target, ts_ms) AS target,
        argMax(cost_micros, ts_ms) / 1000000. AS estimated_cost,
        argMax(cost_high_micros, ts_ms) / 1000000. AS estimated_cost_high,
        argMax(threshold_micros, ts_ms) / 1000000. AS threshold_cost,
        argMax(currency, ts_ms) AS currency,
        argMax(gpu_hours, ts_ms) AS gpu_hours,
        argMax(wall_hours, ts_ms) AS wall_hours
    FROM {db}.approvals
    GROUP BY approval_id
);

CREATE TABLE {db}.bill_adjustments
(
    `booked_day` Date,
    `corrects_day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `reason` LowCardinality(String),
    `gpu_ms` Int64,
    `effective_gpu_ms` Int64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `booked_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(booked_day)
ORDER BY (booked_day, cluster, tenant, corrects_day, job_id, attempt, line)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.bill_runs
(
    `bill_run_id` String,
    `created_at` DateTime64(3, 'UTC') DEFAULT now64(3),
    `days` Array(Date),
    `clusters` Array(String),
    `definition_version` LowCardinality(String),
    `grace_s` Float64,
    `horizons` Map(String, Int64),
    `closed_rows` UInt64,
    `adjustment_rows` UInt64
)
ENGINE = MergeTree
ORDER BY (created_at, bill_run_id)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.busy_unallocated_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_ms` UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, node, gpu_uuid, day)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.busy_unallocated_daily_mv TO {db}.busy_unallocated_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    node,
    gpu_uuid,
    sum(gpu_ms) AS gpu_ms
FROM {db}.usage_raw
WHERE (state = 'unallocated') AND (util_pct > 1)
GROUP BY
    day,
    cluster,
    node,
    gpu_uuid;

CREATE VIEW {db}.capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` UInt64,
    `capacity_gpu_seconds` Float64,
    `down_gpu_seconds` Float64,
    `unallocated_gpu_seconds` Float64,
    `allocated_idle_gpu_seconds` Float64,
    `executing_gpu_seconds` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `unallocated_cost` Float64,
    `energy_kwh` Float64
)
AS SELECT
    day,
    cluster,
    gpu_model,
    definition_version,
    uniqExactMerge(gpus) AS gpus,
    sum(gpu_ms) / 1000 AS capacity_gpu_seconds,
    sumIf(gpu_ms, state = 'down') / 1000 AS down_gpu_seconds,
    sumIf(gpu_ms, state = 'unallocated') / 1000 AS unallocated_gpu_seconds,
    sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS allocated_idle_gpu_seconds,
    sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
    sum(effective_gpu_ms) / 3600000 AS effective_gpu_hours,
    sum(cost_micros) / 1000000. AS cost,
    sumIf(cost_micros, state = 'unallocated') / 1000000. AS unallocated_cost,
    sum(energy_j) / 3600000 AS energy_kwh
FROM {db}.usage_capacity_daily
GROUP BY
    day,
    cluster,
    gpu_model,
    definition_version;

CREATE TABLE {db}.capacity_forecast
(
    `run_id` String,
    `created_at` DateTime64(3, 'UTC'),
    `day` Date,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `kind` LowCardinality(String),
    `demand_gpu_hours` Float64,
    `lower_gpu_hours` Float64,
    `upper_gpu_hours` Float64,
    `capacity_gpu_hours` Float64,
    `method` String
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(created_at)
ORDER BY (run_id, gpu_model, queue, day)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.capacity_forecast_latest
(
    `day` Date,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `kind` LowCardinality(String),
    `demand_gpu_hours` Float64,
    `lower_gpu_hours` Float64,
    `upper_gpu_hours` Float64,
    `capacity_gpu_hours` Float64,
    `method` String,
    `run_id` String,
    `created_at` DateTime64(3, 'UTC')
)
AS SELECT
    day,
    gpu_model,
    queue,
    kind,
    demand_gpu_hours,
    lower_gpu_hours,
    upper_gpu_hours,
    capacity_gpu_hours,
    method,
    run_id,
    created_at
FROM {db}.capacity_forecast
WHERE run_id = (
    SELECT argMax(run_id, created_at)
    FROM {db}.capacity_forecast
);

CREATE VIEW {db}.carbon_definition_current
(
    `carbon_version` String,
    `pue` Float64,
    `default_gco2e_per_kwh` Float64,
    `zones` Map(String, String)
)
AS SELECT
    argMax(carbon_version, recorded_at) AS carbon_version,
    argMax(pue, recorded_at) AS pue,
    argMax(default_gco2e_per_kwh, recorded_at) AS default_gco2e_per_kwh,
    argMax(zones, recorded_at) AS zones
FROM {db}.carbon_definitions
HAVING count() > 0;

CREATE TABLE {db}.carbon_definitions
(
    `carbon_version` String,
    `pue` Float64,
    `default_gco2e_per_kwh` Float64,
    `default_source` String,
    `zones` Map(String, String),
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (carbon_version, recorded_at)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.carbon_intensity
(
    `zone` String,
    `valid_from_ms` Int64,
    `gco2e_per_kwh` Float64,
    `source` String,
    `loaded_by` String,
    `loaded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (zone, valid_from_ms, loaded_at)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.carbon_intensity_current
(
    `zone` String,
    `valid_from_ms` Int64,
    `gco2e_per_kwh` Float64
)
AS SELECT
    zone,
    valid_from_ms,
    argMax(gco2e_per_kwh, loaded_at) AS gco2e_per_kwh
FROM {db}.carbon_intensity
GROUP BY
    zone,
    valid_from_ms;

CREATE VIEW {db}.carbon_record_days
(
    `cluster` LowCardinality(String),
    `day` Date
)
AS WITH
    within_hour AS
    (
        SELECT DISTINCT
            c.cluster AS cluster,
            c.day AS day
        FROM {db}.usage_capacity_daily AS c
        CROSS JOIN {db}.carbon_definition_current AS d
        WHERE (if(mapContains(d.zones, toString(c.cluster)), d.zones[toString(c.cluster)], toString(c.cluster)), c.day) IN (
            SELECT
                zone,
                toDate(fromUnixTimestamp64Milli(valid_from_ms, 'UTC'))
            FROM {db}.carbon_intensity_current
            WHERE (valid_from_ms % 3600000) != 0
        )
    ),
    closed AS
    (
        SELECT
            cluster,
            day,
            sum(records) AS records
        FROM {db}.closed_energy
        WHERE (bill_run_id IN (
            SELECT bill_run_id
            FROM {db}.bill_runs
        )) AND ((cluster, day) IN (
            SELECT
                cluster,
                day
            FROM within_hour
        ))
        GROUP BY
            cluster,
            day
    )
SELECT
    cluster,
    day
FROM within_hour
WHERE (cluster, day) NOT IN (
    SELECT
        e.cluster,
        e.day
    FROM closed AS e
    LEFT JOIN
    (
        SELECT
            cluster,
            day,
            count() AS held
        FROM {db}.usage_raw
        WHERE (cluster, day) IN (
            SELECT
                cluster,
                day
            FROM closed
        )
        GROUP BY
            cluster,
            day
    ) AS r ON (e.cluster = r.cluster) AND (e.day = r.day)
    WHERE r.held < e.records
);

CREATE TABLE {db}.closed_cluster_idle
(
    `booked_day` Date,
    `corrects_day` Date,
    `cluster` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` Int64,
    `cost_micros` Int128,
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(booked_day)
ORDER BY (cluster, booked_day, corrects_day, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_days
(
    `day` Date,
    `cluster` LowCardinality(String),
    `bill_run_id` String,
    `horizon_ms` Int64,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (cluster, day)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_energy
(
    `day` Date,
    `cluster` LowCardinality(String),
    `hour` Int64,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `definition_version` LowCardinality(String),
    `state` LowCardinality(String),
    `energy_mj` Int64,
    `records` Int64,
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, tenant, job_id, attempt, hour, state, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_job_cost
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `outcome` LowCardinality(String),
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, job_id, attempt, line, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_queue_efficiency
(
    `day` Date,
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `tenant` LowCardinality(String),
    `attempts` UInt64,
    `requested_gpu_seconds` Float64,
    `allocated_gpu_seconds` Float64,
    `executed_gpu_seconds` Float64,
    `waits` UInt64,
    `queue_wait_p50_s` Nullable(Float64),
    `queue_wait_p90_s` Nullable(Float64),
    `queue_wait_p99_s` Nullable(Float64),
    `queue_wait_mean_s` Nullable(Float64),
    `queue_wait_max_s` Nullable(Float64),
    `definition_version` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, queue, tenant)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.closed_tenant_bill
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `line` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `currency` LowCardinality(String),
    `bill_run_id` String,
    `closed_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, line, definition_version)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.coefficients
(
    `model` LowCardinality(String),
    `coefficient` Float64,
    `valid_from` Date,
    `version` String,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.definitions
(
    `definition_version` String,
    `fingerprint` String,
    `content` String,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (definition_version, fingerprint)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.gpu_card_monthly
(
    `gpu_uuid` String,
    `month` Date,
    `gpu_model` String,
    `avg_temperature_c` Nullable(Float64),
    `max_temperature_c` Nullable(Float64),
    `avg_util_pct` Nullable(Float64),
    `avg_power_w` Nullable(Float64),
    `xid_errors` UInt64
)
AS SELECT
    gpu_uuid,
    toStartOfMonth(day) AS month,
    argMax(toString(gpu_model), hour) AS gpu_model,
    avgMerge(temperature_c) AS avg_temperature_c,
    maxMerge(max_temperature_c) AS max_temperature_c,
    avgMerge(util_gpu_pct) AS avg_util_pct,
    avgMerge(power_w) AS avg_power_w,
    sum(xid_count) AS xid_errors
FROM {db}.gpu_health_hourly
GROUP BY
    gpu_uuid,
    month;

CREATE VIEW {db}.gpu_cards
(
    `gpu_uuid` String,
    `gpu_model` String,
    `cluster` String,
    `node` String,
    `serial` String,
    `board_part_number` String,
    `vbios_version` String,
    `first_seen` DateTime64(3, 'UTC'),
    `last_seen` DateTime64(3, 'UTC'),
    `nodes` UInt64,
    `placements` String,
    `repairs` UInt64,
    `last_repaired` Nullable(DateTime64(3, 'UTC')),
    `flag` String,
    `down_seconds` Float64,
    `xid_errors` UInt64,
    `avg_temperature_c` Nullable(Float64),
    `max_temperature_c` Nullable(Float64)
)
AS SELECT
    s.gpu_uuid AS gpu_uuid,
    s.gpu_model AS gpu_model,
    p.cluster AS cluster,
    p.node AS node,
    s.serial AS serial,
    s.board_part_number AS board_part_number,
    s.vbios_version AS vbios_version,
    s.first_seen AS first_seen,
    s.last_seen AS last_seen,
    s.nodes AS nodes,
    p.placements AS placements,
    r.repairs AS repairs,
    if(r.repairs > 0, r.last_repaired, NULL) AS last_repaired,
    arrayStringConcat(arrayFilter(f -> (f != ''), [if(r.repairs >= 2, 'suggest lower-priority work', ''), if(length(x.at_once) > 1, concat('reported by ', toString(length(x.at_once)), ' nodes at once: ', arrayStringConcat(x.at_once, ', '), if(match(s.gpu_uuid, '^GPU-unreadable-[0-9]+$'), ' (an old agent\'s placeholder for an unreadable GPU: upgrade the agents)', ' (cloned agent?)')), '')]), '; ') AS flag,
    d.down_seconds AS down_seconds,
    h.xid_errors AS xid_errors,
    h.avg_temperature_c AS avg_temperature_c,
    h.max_temperature_c AS max_temperature_c
FROM
(
    SELECT
        gpu_uuid,
        argMax(toString(gpu_model), last_seen_ms) AS gpu_model,
        argMaxIf(serial, last_seen_ms, serial != '') AS serial,
        argMaxIf(board_part_number, last_seen_ms, board_part_number != '') AS board_part_number,
        argMaxIf(vbios_version, last_seen_ms, vbios_version != '') AS vbios_version,
        fromUnixTimestamp64Milli(min(first_seen_ms), 'UTC') AS first_seen,
        fromUnixTimestamp64Milli(max(last_seen_ms), 'UTC') AS last_seen,
        uniqExact(cluster, node) AS nodes
    FROM {db}.gpu_sightings
    GROUP BY gpu_uuid
) AS s
LEFT JOIN
(
    SELECT
        gpu_uuid,
        argMax(c, (last_ms, c, n)) AS cluster,
        argMax(n, (last_ms, c, n)) AS node,
        arrayStringConcat(arrayMap(x -> concat(x.2, '/', x.3), arraySort(groupArray((first_ms, c, n)))), ', ') AS placements
    FROM
    (
        SELECT
            gpu_uuid,
            toString(cluster) AS c,
            node AS n,
            min(first_seen_ms) AS first_ms,
            max(last_seen_ms) AS last_ms
        FROM {db}.gpu_sightings
        GROUP BY
            gpu_uuid,
            cluster,
            node
    )
    GROUP BY gpu_uuid
) AS p ON s.gpu_uuid = p.gpu_uuid
LEFT JOIN
(
    SELECT
        gpu_uuid,
        count() AS repairs,
        fromUnixTimestamp64Milli(max(repaired_ms), 'UTC') AS last_repaired
    FROM {db}.gpu_repairs
    GROUP BY gpu_uuid
) AS r ON s.gpu_uuid = r.gpu_uuid
LEFT JOIN
(
    SELECT
        gpu_uuid,
        sum(gpu_ms) / 1000 AS down_seconds
    FROM {db}.gpu_down_records
    FINAL
    GROUP BY gpu_uuid
) AS d ON s.gpu_uuid = d.gpu_uuid
LEFT JOIN
(
    SELECT
        gpu_uuid,
        sum(xid_count) AS xid_errors,
        avgMerge(temperature_c) AS avg_temperature_c,
        maxMerge(max_temperature_c) AS max_temperature_c
    FROM {db}.gpu_health_hourly
    GROUP BY gpu_uuid
) AS h ON s.gpu_uuid = h.gpu_uuid
LEFT JOIN
(
    SELECT
        gpu_uuid,
        arraySort(groupUniqArrayArray(placements)) AS at_once
    FROM {db}.gpu_uuid_shared_hours
    GROUP BY gpu_uuid
) AS x ON s.gpu_uuid = x.gpu_uuid;

CREATE VIEW {db}.gpu_current
(
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `state` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `jobs` String,
    `tenants` String,
    `queues` String,
    `allocated_share` Float64,
    `util_pct` Nullable(Float64),
    `last_seen` DateTime64(3, 'UTC')
)
AS SELECT
    cluster,
    toLowCardinality(maxArgMaxMerge(g.node)) AS node,
    gpu_uuid,
    toLowCardinality(maxArgMaxMerge(g.gpu_model)) AS gpu_model,
    arrayElement(['unallocated', 'allocated_idle', 'executing', 'down'], maxArgMaxMerge(g.state_rank) + 1) AS state,
    minIfArgMaxMerge(g.job_id) AS job_id,
    minIfArgMaxMerge(g.tenant) AS tenant,
    minIfArgMaxMerge(g.queue) AS queue,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.jobs)), ' ') AS jobs,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.tenants)), ' ') AS tenants,
    arrayStringConcat(arraySort(groupUniqArrayIfArgMaxMerge(g.queues)), ' ') AS queues,
    sumIfArgMaxMerge(g.share_milli) / 1000 AS allocated_share,
    if(maxArgMaxMerge(g.util_pct) < 0, NULL, maxArgMaxMerge(g.util_pct)) AS util_pct,
    fromUnixTimestamp64Milli(max(g.last_end_ms), 'UTC') AS last_seen
FROM {db}.gpu_latest AS g
GROUP BY
    cluster,
    gpu_uuid;

CREATE TABLE {db}.gpu_down_records
(
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `day` Date,
    `start_ms` Int64,
    `record_id` String,
    `gpu_ms` UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, start_ms, record_id)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.gpu_down_records_mv TO {db}.gpu_down_records
(
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `day` Date,
    `start_ms` Int64,
    `record_id` String,
    `gpu_ms` UInt64
)
AS SELECT
    cluster,
    gpu_uuid,
    day,
    start_ms,
    record_id,
    gpu_ms
FROM {db}.usage_raw
WHERE state = 'down';

CREATE TABLE {db}.gpu_health
(
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `ts_ms` Int64,
    `interval_ms` UInt32,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `health` LowCardinality(String),
    `down_reason` String,
    `temperature_c` Nullable(Float64),
    `power_w` Nullable(Float64),
    `util_gpu_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `xid_errors` Array(UInt32),
    `ecc_dbe_total` Nullable(UInt64),
    `kafka_topic` LowCardinality(String) DEFAULT '',
    `kafka_partition` Int32 DEFAULT -1,
    `kafka_offset` Int64 DEFAULT -1,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY day
ORDER BY (cluster, gpu_uuid, ts_ms)
SETTINGS non_replicated_deduplication_window = 1000, ttl_only_drop_parts = 1, index_granularity = 8192;

CREATE VIEW {db}.gpu_health_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `down_seconds` Float64,
    `capacity_seconds` Float64,
    `max_temperature_c` Nullable(Float64),
    `avg_temperature_c` Nullable(Float64),
    `xid_count` UInt64,
    `xid_codes` String,
    `down_reasons` String
)
AS SELECT
    u.day AS day,
    u.cluster AS cluster,
    u.node AS node,
    u.gpu_uuid AS gpu_uuid,
    u.gpu_model AS gpu_model,
    u.down_seconds AS down_seconds,
    u.capacity_seconds AS capacity_seconds,
    h.max_temperature_c AS max_temperature_c,
    h.avg_temperature_c AS avg_temperature_c,
    h.xid_count AS xid_count,
    h.xid_codes AS xid_codes,
    h.down_reasons AS down_reasons
FROM
(
    SELECT
        day,
        cluster,
        node,
        gpu_uuid,
        gpu_model,
        sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds,
        sum(gpu_ms) / 1000 AS capacity_seconds
    FROM {db}.usage_gpu_hourly
    GROUP BY
        day,
        cluster,
        node,
        gpu_uuid,
        gpu_model
) AS u
LEFT JOIN
(
    SELECT
        day,
        cluster,
        gpu_uuid,
        maxMerge(max_temperature_c) AS max_temperature_c,
        avgMerge(temperature_c) AS avg_temperature_c,
        sum(xid_count) AS xid_count,
        arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArrayMerge(xid_codes))), ' ') AS xid_codes,
        arrayStringConcat(arraySort(groupUniqArrayIfMerge(down_reasons)), '; ') AS down_reasons
    FROM {db}.gpu_health_hourly
    GROUP BY
        day,
        cluster,
        gpu_uuid
) AS h ON (u.day = h.day) AND (u.cluster = h.cluster) AND (u.gpu_uuid = h.gpu_uuid);

CREATE VIEW {db}.gpu_health_history
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `samples` UInt64,
    `sampled_seconds` Float64,
    `unhealthy_samples` UInt64,
    `max_temperature_c` Nullable(Float64),
    `avg_temperature_c` Nullable(Float64),
    `avg_power_w` Nullable(Float64),
    `avg_util_gpu_pct` Nullable(Float64),
    `max_mem_used_bytes` Nullable(UInt64),
    `xid_count` UInt64,
    `xid_codes` String,
    `down_reasons` String,
    `max_ecc_dbe_total` Nullable(UInt64)
)
AS SELECT
    hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    sum(samples) AS samples,
    sum(sampled_ms) / 1000 AS sampled_seconds,
    sum(unhealthy_samples) AS unhealthy_samples,
    maxMerge(max_temperature_c) AS max_temperature_c,
    avgMerge(temperature_c) AS avg_temperature_c,
    avgMerge(power_w) AS avg_power_w,
    avgMerge(util_gpu_pct) AS avg_util_gpu_pct,
    maxMerge(max_mem_used_bytes) AS max_mem_used_bytes,
    sum(xid_count) AS xid_count,
    arrayStringConcat(arrayMap(x -> toString(x), arraySort(groupUniqArrayArrayMerge(xid_codes))), ' ') AS xid_codes,
    arrayStringConcat(arraySort(groupUniqArrayIfMerge(down_reasons)), '; ') AS down_reasons,
    maxMerge(max_ecc_dbe_total) AS max_ecc_dbe_total
FROM {db}.gpu_health_hourly
GROUP BY
    hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model;

CREATE TABLE {db}.gpu_health_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `samples` SimpleAggregateFunction(sum, UInt64),
    `sampled_ms` SimpleAggregateFunction(sum, UInt64),
    `unhealthy_samples` SimpleAggregateFunction(sum, UInt64),
    `max_temperature_c` AggregateFunction(max, Nullable(Float64)),
    `temperature_c` AggregateFunction(avg, Nullable(Float64)),
    `power_w` AggregateFunction(avg, Nullable(Float64)),
    `util_gpu_pct` AggregateFunction(avg, Nullable(Float64)),
    `max_mem_used_bytes` AggregateFunction(max, Nullable(UInt64)),
    `xid_count` SimpleAggregateFunction(sum, UInt64),
    `xid_codes` AggregateFunction(groupUniqArrayArray, Array(UInt32)),
    `down_reasons` AggregateFunction(groupUniqArrayIf, String, UInt8),
    `max_ecc_dbe_total` AggregateFunction(max, Nullable(UInt64))
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, hour, node, gpu_model, day)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.gpu_health_hourly_mv TO {db}.gpu_health_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `samples` UInt64,
    `sampled_ms` UInt64,
    `unhealthy_samples` UInt64,
    `max_temperature_c` AggregateFunction(max, Nullable(Float64)),
    `temperature_c` AggregateFunction(avg, Nullable(Float64)),
    `power_w` AggregateFunction(avg, Nullable(Float64)),
    `util_gpu_pct` AggregateFunction(avg, Nullable(Float64)),
    `max_mem_used_bytes` AggregateFunction(max, Nullable(UInt64)),
    `xid_count` UInt64,
    `xid_codes` AggregateFunction(groupUniqArrayArray, Array(UInt32)),
    `down_reasons` AggregateFunction(groupUniqArrayIf, String, UInt8),
    `max_ecc_dbe_total` AggregateFunction(max, Nullable(UInt64))
)
AS SELECT
    toStartOfHour(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    count() AS samples,
    sum(toUInt64(interval_ms)) AS sampled_ms,
    countIf(health != 'ok') AS unhealthy_samples,
    maxState(gpu_health.temperature_c) AS max_temperature_c,
    avgState(gpu_health.temperature_c) AS temperature_c,
    avgState(gpu_health.power_w) AS power_w,
    avgState(gpu_health.util_gpu_pct) AS util_gpu_pct,
    maxState(mem_used_bytes) AS max_mem_used_bytes,
    sum(toUInt64(length(xid_errors))) AS xid_count,
    groupUniqArrayArrayState(xid_errors) AS xid_codes,
    groupUniqArrayIfState(down_reason, toUInt8(down_reason != '')) AS down_reasons,
    maxState(ecc_dbe_total) AS max_ecc_dbe_total
FROM {db}.gpu_health
GROUP BY
    hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model;

CREATE VIEW {db}.gpu_health_samples
(
    `ts` DateTime64(3, 'UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `health` LowCardinality(String),
    `down_reason` String,
    `temperature_c` Nullable(Float64),
    `power_w` Nullable(Float64),
    `util_gpu_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `xid_errors` Array(UInt32),
    `xid_count` UInt64
)
AS SELECT
    fromUnixTimestamp64Milli(ts_ms, 'UTC') AS ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    health,
    down_reason,
    temperature_c,
    power_w,
    util_gpu_pct,
    mem_used_bytes,
    xid_errors,
    length(xid_errors) AS xid_count
FROM {db}.gpu_health;

CREATE VIEW {db}.gpu_labels
(
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu` String
)
AS SELECT
    cluster,
    node,
    gpu_uuid,
    concat(toString(node), '/', if(count() OVER (PARTITION BY cluster, node, substring(gpu_uuid, 5, 8)) > 1, gpu_uuid, substring(gpu_uuid, 5, 8))) AS gpu
FROM
(
    SELECT DISTINCT
        cluster,
        node,
        gpu_uuid
    FROM {db}.job_gpu_usage
);

CREATE TABLE {db}.gpu_latest
(
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `last_end_ms` SimpleAggregateFunction(max, Int64),
    `node` AggregateFunction(maxArgMax, String, Int64),
    `gpu_model` AggregateFunction(maxArgMax, String, Int64),
    `state_rank` AggregateFunction(maxArgMax, UInt8, Int64),
    `job_id` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `tenant` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `queue` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `jobs` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `tenants` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `queues` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `share_milli` AggregateFunction(sumIfArgMax, UInt64, UInt8, Int64),
    `util_pct` AggregateFunction(maxArgMax, Float64, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (cluster, gpu_uuid)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.gpu_latest_mv TO {db}.gpu_latest
(
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `last_end_ms` Int64,
    `node` AggregateFunction(maxArgMax, String, Int64),
    `gpu_model` AggregateFunction(maxArgMax, String, Int64),
    `state_rank` AggregateFunction(maxArgMax, UInt8, Int64),
    `job_id` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `tenant` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `queue` AggregateFunction(minIfArgMax, String, UInt8, Int64),
    `jobs` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `tenants` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `queues` AggregateFunction(groupUniqArrayIfArgMax, String, UInt8, Int64),
    `share_milli` AggregateFunction(sumIfArgMax, UInt64, UInt8, Int64),
    `util_pct` AggregateFunction(maxArgMax, Float64, Int64)
)
AS SELECT
    cluster,
    gpu_uuid,
    max(end_ms) AS last_end_ms,
    maxArgMaxState(toString(usage_raw.node), usage_raw.end_ms) AS node,
    maxArgMaxState(toString(usage_raw.gpu_model), usage_raw.end_ms) AS gpu_model,
    maxArgMaxState(toUInt8(multiIf(usage_raw.state = 'down', 3, usage_raw.state = 'executing', 2, usage_raw.state = 'allocated_idle', 1, 0)), usage_raw.end_ms) AS state_rank,
    minIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS job_id,
    minIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenant,
    minIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queue,
    groupUniqArrayIfArgMaxState(usage_raw.job_id, toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS jobs,
    groupUniqArrayIfArgMaxState(toString(usage_raw.tenant), toUInt8(usage_raw.tenant != ''), usage_raw.end_ms) AS tenants,
    groupUniqArrayIfArgMaxState(toString(usage_raw.queue), toUInt8(usage_raw.queue != ''), usage_raw.end_ms) AS queues,
    sumIfArgMaxState(toUInt64(usage_raw.share_milli), toUInt8(usage_raw.job_id != ''), usage_raw.end_ms) AS share_milli,
    maxArgMaxState(ifNull(usage_raw.util_pct, -1.), usage_raw.end_ms) AS util_pct
FROM {db}.usage_raw
GROUP BY
    cluster,
    gpu_uuid;

CREATE VIEW {db}.gpu_load_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
AS SELECT
    ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    queue,
    total_gpu_ms,
    executing_gpu_ms,
    idle_gpu_ms,
    unallocated_gpu_ms,
    down_gpu_ms,
    util_weighted_gpu_ms,
    util_gpu_ms
FROM {db}.usage_gpu_5m
FINAL;

CREATE TABLE {db}.gpu_repairs
(
    `repair_id` String,
    `gpu_uuid` String,
    `repaired_ms` Int64,
    `note` String,
    `recorded_by` String,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (gpu_uuid, repaired_ms, repair_id)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.gpu_sightings
(
    `gpu_uuid` String,
    `cluster` LowCardinality(String),
    `node` String,
    `gpu_model` LowCardinality(String),
    `serial` String,
    `board_part_number` String,
    `vbios_version` String,
    `first_seen_ms` SimpleAggregateFunction(min, Int64),
    `last_seen_ms` SimpleAggregateFunction(max, Int64),
    `reports` SimpleAggregateFunction(sum, UInt64)
)
ENGINE = AggregatingMergeTree
ORDER BY (gpu_uuid, cluster, node, gpu_model, serial, board_part_number, vbios_version)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW {db}.gpu_sightings_mv TO {db}.gpu_sightings
(
    `gpu_uuid` String,
    `cluster` LowCardinality(String),
    `node` String,
    `gpu_model` LowCardinality(String),
    `serial` String,
    `board_part_number` String,
    `vbios_version` String,
    `first_seen_ms` Int64,
    `last_seen_ms` Int64,
    `reports` UInt64
)
AS SELECT
    gpu_uuids[i] AS gpu_uuid,
    cluster,
    node,
    toLowCardinality(gpu_models[i]) AS gpu_model,
    gpu_serials[i] AS serial,
    gpu_board_part_numbers[i] AS board_part_number,
    gpu_vbios_versions[i] AS vbios_version,
    min(seen_ms) AS first_seen_ms,
    max(seen_ms) AS last_seen_ms,
    count() AS reports
FROM {db}.node_inventory
ARRAY JOIN arrayEnumerate(gpu_uuids) AS i
GROUP BY
    gpu_uuid,
    cluster,
    node,
    gpu_model,
    serial,
    board_part_number,
    vbios_version;

CREATE VIEW {db}.gpu_uuid_shared_hours
(
    `gpu_uuid` String,
    `hour` DateTime('UTC'),
    `placements` Array(String)
)
AS SELECT
    gpu_uuid,
    hour,
    arraySort(groupUniqArray(concat(toString(cluster), '/', toString(node)))) AS placements
FROM {db}.gpu_health_hourly
WHERE gpu_uuid IN (
    SELECT gpu_uuid
    FROM
    (
        SELECT
            gpu_uuid,
            min(first_seen_ms) AS first_ms,
            max(last_seen_ms) AS last_ms
        FROM {db}.gpu_sightings
        GROUP BY
            gpu_uuid,
            cluster,
            node
    )
    GROUP BY gpu_uuid
    HAVING (count() > 1) AND arrayExists((a, i) -> arrayExists((b, j) -> ((i != j) AND ((a.1) < (b.2)) AND ((b.1) < (a.2))), s, arrayEnumerate(s)), groupArray((first_ms, last_ms)) AS s, arrayEnumerate(s))
)
GROUP BY
    gpu_uuid,
    hour
HAVING length(placements) > 1;

CREATE TABLE {db}.idle_stretch_days
(
    `cluster` LowCardinality(String),
    `day` Date,
    `segments` UInt64,
    `version` UInt64
)
ENGINE = ReplacingMergeTree(version)
ORDER BY (cluster, day)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.idle_stretches_daily
(
    `cluster` LowCardinality(String),
    `day` Date,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `start_ms` Int64,
    `end_ms` Int64,
    `gpu_ms` UInt64,
    `version` UInt64,
    `is_deleted` UInt8
)
ENGINE = ReplacingMergeTree(version, is_deleted)
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, cluster, gpu_uuid, start_ms)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.idle_waste_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `tenant` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64,
    `definition_version` LowCardinality(String)
)
AS SELECT
    day,
    cluster,
    queue,
    tenant,
    gpu_model,
    sum(gpu_ms) / 3600000 AS idle_gpu_hours,
    sum(effective_gpu_ms) / 3600000 AS idle_effective_gpu_hours,
    sum(cost_micros) / 1000000. AS idle_cost,
    definition_version
FROM {db}.usage_by_job_daily
WHERE (state = 'allocated_idle') AND (job_id != '')
GROUP BY
    day,
    cluster,
    queue,
    tenant,
    gpu_model,
    definition_version;

CREATE VIEW {db}.job_attempt_outcomes
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `outcome` String
)
AS SELECT
    cluster,
    job_id,
    attempt,
    argMinMerge(outcome) AS outcome
FROM {db}.job_attempts_state
GROUP BY
    cluster,
    job_id,
    attempt;

CREATE VIEW {db}.job_attempts
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` String,
    `queue` String,
    `priority` Int32,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `allocated_gpus` SimpleAggregateFunction(max, Float64),
    `queued_ms` Nullable(Int64),
    `allocated_ms` Nullable(Int64),
    `started_ms` Nullable(Int64),
    `ended_ms` Nullable(Int64),
    `outcome` String,
    `events` UInt64,
    `first_seen_ms` SimpleAggregateFunction(min, Int64),
    `last_seen_ms` SimpleAggregateFunction(max, Int64),
    `queue_wait_ms` Nullable(Int64)
)
AS SELECT
    *,
    allocated_ms - queued_ms AS queue_wait_ms
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
        argMinMerge(tenant) AS tenant,
        argMinMerge(queue) AS queue,
        argMinMerge(priority) AS priority,
        max(requested_gpus) AS requested_gpus,
        max(allocated_gpus) AS allocated_gpus,
        minMerge(queued_ms) AS queued_ms,
        minMerge(allocated_ms) AS allocated_ms,
        minMerge(started_ms) AS started_ms,
        minMerge(ended_ms) AS ended_ms,
        argMinMerge(outcome) AS outcome,
        uniqExactMerge(events) AS events,
        min(first_seen_ms) AS first_seen_ms,
        max(last_seen_ms) AS last_seen_ms
    FROM {db}.job_attempts_state
    GROUP BY
        cluster,
        job_id,
        attempt
);

CREATE MATERIALIZED VIEW {db}.job_attempts_mv TO {db}.job_attempts_state
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` AggregateFunction(argMin, String, Int64),
    `queue` AggregateFunction(argMin, String, Int64),
    `priority` AggregateFunction(argMin, Int32, Int64),
    `requested_gpus` Float64,
    `allocated_gpus` Float64,
    `queued_ms` AggregateFunction(min, Nullable(Int64)),
    `allocated_ms` AggregateFunction(min, Nullable(Int64)),
    `started_ms` AggregateFunction(min, Nullable(Int64)),
    `ended_ms` AggregateFunction(min, Nullable(Int64)),
    `outcome` AggregateFunction(argMin, String, Int64),
    `events` AggregateFunction(uniqExact, String),
    `first_seen_ms` Int64,
    `last_seen_ms` Int64
)
AS SELECT
    cluster,
    job_id,
    attempt,
    argMinState(tenant, ts_ms) AS tenant,
    argMinState(queue, ts_ms) AS queue,
    argMinState(priority, ts_ms) AS priority,
    max(requested_gpus) AS requested_gpus,
    max(if(kind = 'allocated', arraySum(gpu_share_milli) / 1000, 0.)) AS allocated_gpus,
    minState(if((kind IN ('submitted', 'queued', 'retried')), ts_ms, NULL)) AS queued_ms,
    minState(if(kind = 'allocated', ts_ms, NULL)) AS allocated_ms,
    minState(if(kind = 'started', ts_ms, NULL)) AS started_ms,
    minState(if((kind IN ('completed', 'failed', 'preempted', 'cancelled')), ts_ms, NULL)) AS ended_ms,
    argMinStateIf(kind, ts_ms, (kind IN ('completed', 'failed', 'preempted', 'cancelled'))) AS outcome,
    uniqExactState(event_id) AS events,
    min(ts_ms) AS first_seen_ms,
    max(ts_ms) AS last_seen_ms
FROM {db}.job_events
GROUP BY
    cluster,
    job_id,
    attempt;

CREATE TABLE {db}.job_attempts_state
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` AggregateFunction(argMin, String, Int64),
    `queue` AggregateFunction(argMin, String, Int64),
    `priority` AggregateFunction(argMin, Int32, Int64),
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `allocated_gpus` SimpleAggregateFunction(max, Float64),
    `queued_ms` AggregateFunction(min, Nullable(Int64)),
    `allocated_ms` AggregateFunction(min, Nullable(Int64)),
    `started_ms` AggregateFunction(min, Nullable(Int64)),
    `ended_ms` AggregateFunction(min, Nullable(Int64)),
    `outcome` AggregateFunction(argMin, String, Int64),
    `events` AggregateFunction(uniqExact, String),
    `first_seen_ms` SimpleAggregateFunction(min, Int64),
    `last_seen_ms` SimpleAggregateFunction(max, Int64)
)
ENGINE = AggregatingMergeTree
ORDER BY (cluster, job_id, attempt)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.job_checkpoint_time
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `checkpoints` UInt64,
    `checkpoint_seconds` Float64
)
AS SELECT
    cluster,
    job_id,
    attempt,
    length(ends) AS checkpoints,
    arraySum(arrayMap((b, e) -> greatest(e - b, 0), arraySlice(begins, 1, length(ends)), ends)) / 1000 AS checkpoint_seconds
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
        arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_begin')) AS begins,
        arraySlice(arraySort(groupArrayIf(ts_ms, kind = 'checkpoint_end')), 1, countIf(kind = 'checkpoint_begin')) AS ends
    FROM
    (
        SELECT DISTINCT
            cluster,
            job_id,
            attempt,
            kind,
            ts_ms,
            event_id
        FROM {db}.job_events
        WHERE kind IN ('checkpoint_begin', 'checkpoint_end')
    )
    GROUP BY
        cluster,
        job_id,
        attempt
);

CREATE VIEW {db}.job_cost
(
    `cluster` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `definition_version` LowCardinality(String),
    `attempts` UInt64,
    `failed_attempts` UInt64,
    `last_outcome` String,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `gpu_hours` Float64,
    `executing_gpu_hours` Float64,
    `idle_gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` Int128,
    `energy_kwh` Float64,
    `first_day` Nullable(Date),
    `last_day` Nullable(Date),
    `queue_wait_seconds` Float64,
    `queue_wait_gpu_hours` Float64,
    `priced_by_default_gpu_hours` Float64
)
AS WITH
    u AS
    (
        SELECT
            cluster,
            job_id,
            definition_version,
            toUInt8(1) AS u_seen,
            min(tenant) AS u_tenant,
            min(queue) AS u_queue,
            uniqExact(attempt) AS u_attempts,
            sum(gpu_ms) AS u_gpu_ms,
            sumIf(gpu_ms, state = 'executing') AS u_executing_gpu_ms,
            sumIf(gpu_ms, state = 'allocated_idle') AS u_idle_gpu_ms,
            sum(effective_gpu_ms) AS u_effective_gpu_ms,
            sum(cost_micros) AS u_cost_micros,
            sum(energy_j) AS u_energy_j,
            min(day) AS u_first_day,
            max(day) AS u_last_day,
            sum(priced_by_default_gpu_ms) AS u_priced_by_default_gpu_ms
        FROM {db}.usage_by_job_daily
        WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
        GROUP BY
            cluster,
            job_id,
            definition_version
    ),
    a AS
    (
        SELECT
            cluster,
            job_id,
            argMin(tenant, attempt) AS a_tenant,
            argMin(queue, attempt) AS a_queue,
            count() AS a_attempts,
            countIf(outcome = 'failed') AS a_failed_attempts,
            argMax(outcome, attempt) AS a_last_outcome,
            max(requested_gpus) AS a_requested_gpus,
            sum(coalesce(queue_wait_ms, 0)) / 1000 AS a_queue_wait_seconds,
            sum(coalesce(queue_wait_ms, 0) * requested_gpus) / 3600000 AS a_queue_wait_gpu_hours
        FROM {db}.job_attempts
        GROUP BY
            cluster,
            job_id
    ),
    k AS
    (
        SELECT
            cluster,
            job_id,
            argMinIf(definition_version, (first_start_ms, definition_version), with_usage) AS k_first_version
        FROM
        (
            SELECT
                cluster,
                job_id,
                definition_version,
                first_start_ms,
                toUInt8(1) AS with_usage
            FROM {db}.usage_by_job_daily
            WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
            UNION ALL
            SELECT
                cluster,
                job_id,
                '',
                toInt64(0),
                toUInt8(0)
            FROM {db}.job_attempts_state
        )
        GROUP BY
            cluster,
            job_id
    )
SELECT
    cluster,
    job_id,
    if(a_tenant != '', a_tenant, u_tenant) AS tenant,
    if(a_queue != '', a_queue, u_queue) AS queue,
    definition_version,
    if(definition_version = k_first_version, greatest(a_attempts, u_attempts), 0) AS attempts,
    if(definition_version = k_first_version, a_failed_attempts, 0) AS failed_attempts,
    a_last_outcome AS last_outcome,
    a_requested_gpus AS requested_gpus,
    u_gpu_ms / 3600000 AS gpu_hours,
    u_executing_gpu_ms / 3600000 AS executing_gpu_hours,
    u_idle_gpu_ms / 3600000 AS idle_gpu_hours,
    u_effective_gpu_ms / 3600000 AS effective_gpu_hours,
    u_cost_micros / 1000000. AS cost,
    u_cost_micros AS cost_micros,
    u_energy_j / 3600000 AS energy_kwh,
    if(u_seen = 1, u_first_day, NULL) AS first_day,
    if(u_seen = 1, u_last_day, NULL) AS last_day,
    if(definition_version = k_first_version, a_queue_wait_seconds, 0) AS queue_wait_seconds,
    if(definition_version = k_first_version, a_queue_wait_gpu_hours, 0) AS queue_wait_gpu_hours,
    u_priced_by_default_gpu_ms / 3600000 AS priced_by_default_gpu_hours
FROM k
LEFT JOIN u USING (cluster, job_id)
LEFT JOIN a USING (cluster, job_id);

CREATE VIEW {db}.job_cost_by_attempt
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `attempt_label` String,
    `gpu_model` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `outcome` String,
    `line` String,
    `gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` SimpleAggregateFunction(sum, Int128)
)
AS SELECT
    u.day AS day,
    u.cluster AS cluster,
    u.tenant AS tenant,
    u.queue AS queue,
    u.job_id AS job_id,
    u.attempt AS attempt,
    concat('attempt ', toString(u.attempt)) AS attempt_label,
    u.gpu_model AS gpu_model,
    u.definition_version AS definition_version,
    a.outcome AS outcome,
    multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
    u.gpu_ms / 3600000 AS gpu_hours,
    u.effective_gpu_ms / 3600000 AS effective_gpu_hours,
    u.cost_micros / 1000000. AS cost,
    u.cost_micros AS cost_micros
FROM {db}.usage_by_job_daily AS u
LEFT JOIN {db}.job_attempt_outcomes AS a ON (u.cluster = a.cluster) AND (u.job_id = a.job_id) AND (u.attempt = a.attempt)
WHERE (u.state IN ('executing', 'allocated_idle')) AND (u.job_id != '');

CREATE VIEW {db}.job_cost_for
AS SELECT *
FROM {db}.job_cost
WHERE tenant = {tenant:String};

CREATE TABLE {db}.job_events
(
    `schema_version` UInt8,
    `event_id` String,
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `kind` String,
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `tenant` String,
    `queue` String,
    `priority` Int32,
    `requested_gpus` Float64,
    `gpu_nodes` Array(String),
    `gpu_uuids` Array(String),
    `gpu_share_milli` Array(UInt16),
    `gpu_container_ids` Array(String),
    `aliases` Map(String, String),
    `reason` String,
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, job_id, attempt, ts_ms, event_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.job_gpu_balance
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `gpu` String,
    `executing_gpu_seconds` Float64,
    `idle_gpu_seconds` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `mean_util_pct` Nullable(Float64),
    `first_start_ms` Int64,
    `last_end_ms` Int64
)
AS SELECT
    b.cluster AS cluster,
    b.tenant AS tenant,
    b.queue AS queue,
    b.job_id AS job_id,
    b.attempt AS attempt,
    b.node AS node,
    b.gpu_uuid AS gpu_uuid,
    b.gpu_model AS gpu_model,
    l.gpu AS gpu,
    b.executing_gpu_seconds AS executing_gpu_seconds,
    b.idle_gpu_seconds AS idle_gpu_seconds,
    b.util_weighted_gpu_ms AS util_weighted_gpu_ms,
    b.util_gpu_ms AS util_gpu_ms,
    b.mean_util_pct AS mean_util_pct,
    b.first_start_ms AS first_start_ms,
    b.last_end_ms AS last_end_ms
FROM
(
    SELECT
        cluster,
        tenant,
        queue,
        job_id,
        attempt,
        node,
        gpu_uuid,
        gpu_model,
        sumIf(gpu_ms, state = 'executing') / 1000 AS executing_gpu_seconds,
        sumIf(gpu_ms, state = 'allocated_idle') / 1000 AS idle_gpu_seconds,
        sumIf(job_gpu_usage.util_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
        sumIf(job_gpu_usage.util_gpu_ms, state = 'executing') AS util_gpu_ms,
        if(util_gpu_ms = 0, NULL, util_weighted_gpu_ms / util_gpu_ms) AS mean_util_pct,
        toInt64(min(job_gpu_usage.first_start_ms)) AS first_start_ms,
        toInt64(max(job_gpu_usage.last_end_ms)) AS last_end_ms
    FROM {db}.job_gpu_usage
    GROUP BY
        cluster,
        tenant,
        queue,
        job_id,
        attempt,
        node,
        gpu_uuid,
        gpu_model
) AS b
INNER JOIN {db}.gpu_labels AS l ON (l.cluster = b.cluster) AND (l.node = b.node) AND (l.gpu_uuid = b.gpu_uuid);

CREATE TABLE {db}.job_gpu_usage
(
    `job_id` String,
    `attempt` UInt32,
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `node` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `state` LowCardinality(String),
    `gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `util_weighted_gpu_ms` SimpleAggregateFunction(sum, Float64),
    `util_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `first_start_ms` SimpleAggregateFunction(min, Int64),
    `last_end_ms` SimpleAggregateFunction(max, Int64),
    `gpu_key` UInt64 MATERIALIZED cityHash64(cluster, job_id, attempt, node, gpu_uuid),
    `attempt_key` UInt64 MATERIALIZED cityHash64(cluster, job_id, attempt)
)
ENGINE = AggregatingMergeTree
ORDER BY (job_id, attempt, cluster, gpu_uuid, node, gpu_model, tenant, queue, state)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.job_gpu_usage_mv TO {db}.job_gpu_usage
(
    `job_id` String,
    `attempt` UInt32,
    `cluster` LowCardinality(String),
    `gpu_uuid` String,
    `node` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `state` LowCardinality(String),
    `gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `first_start_ms` Int64,
    `last_end_ms` Int64
)
AS SELECT
    job_id,
    attempt,
    cluster,
    gpu_uuid,
    node,
    gpu_model,
    tenant,
    queue,
    state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms
FROM {db}.usage_raw
WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
GROUP BY
    job_id,
    attempt,
    cluster,
    gpu_uuid,
    node,
    gpu_model,
    tenant,
    queue,
    state;

CREATE VIEW {db}.job_idle_day_stretches
(
    `cluster` LowCardinality(String),
    `day` Date,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `start_ms` Int64,
    `end_ms` Int64,
    `gpu_ms` UInt64
)
AS SELECT
    cluster,
    day,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model,
    st.1 AS start_ms,
    st.2 AS end_ms,
    st.3 AS gpu_ms
FROM
(
    SELECT
        cluster,
        day,
        tenant,
        queue,
        job_id,
        attempt,
        node,
        gpu_uuid,
        gpu_model,
        arrayMap(run -> ((run[1]).1, arrayMax(arrayMap(x -> (x.2), run)), arraySum(arrayMap(x -> (x.3), run))), arraySplit((x, i) -> ((i > 1) AND ((x.1) != ((segs[i - 1]).2))), segs, arrayEnumerate(segs))) AS stretches
    FROM
    (
        SELECT
            cluster,
            day,
            tenant,
            queue,
            job_id,
            attempt,
            node,
            gpu_uuid,
            gpu_model,
            arraySort(groupUniqArray((start_ms, end_ms, gpu_ms))) AS segs
        FROM {db}.job_idle_segments
        GROUP BY
            job_id,
            attempt,
            cluster,
            gpu_uuid,
            tenant,
            queue,
            node,
            gpu_model,
            day
    )
)
ARRAY JOIN stretches AS st;

CREATE TABLE {db}.job_idle_segments
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `day` Date,
    `start_ms` Int64,
    `end_ms` Int64,
    `gpu_ms` UInt64
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, cluster, gpu_uuid, start_ms)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.job_idle_segments_mv TO {db}.job_idle_segments
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `day` Date,
    `start_ms` Int64,
    `end_ms` Int64,
    `gpu_ms` UInt64
)
AS SELECT
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    node,
    gpu_uuid,
    gpu_model,
    day,
    start_ms,
    end_ms,
    gpu_ms
FROM {db}.usage_raw
WHERE (job_id != '') AND (state = 'allocated_idle');

CREATE VIEW {db}.job_idle_stretches
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `stretch_start` DateTime64(3, 'UTC'),
    `stretch_end` DateTime64(3, 'UTC'),
    `duration_seconds` Float64,
    `idle_gpu_seconds` Float64,
    `offset_ms` Int64
)
AS SELECT
    s.cluster AS cluster,
    s.tenant AS tenant,
    s.queue AS queue,
    s.job_id AS job_id,
    s.attempt AS attempt,
    s.node AS node,
    s.gpu_uuid AS gpu_uuid,
    s.gpu_model AS gpu_model,
    fromUnixTimestamp64Milli(s.start_ms, 'UTC') AS stretch_start,
    fromUnixTimestamp64Milli(s.end_ms, 'UTC') AS stretch_end,
    (s.end_ms - s.start_ms) / 1000 AS duration_seconds,
    s.gpu_ms / 1000 AS idle_gpu_seconds,
    s.start_ms - a.attempt_start_ms AS offset_ms
FROM
(
    SELECT
        cluster,
        tenant,
        queue,
        job_id,
        attempt,
        node,
        gpu_uuid,
        gpu_model,
        start_ms,
        end_ms,
        gpu_ms
    FROM {db}.idle_stretches_daily
    FINAL
    WHERE (start_ms != (toInt64(toUInt16(day)) * 86400000)) AND (end_ms < ((toInt64(toUInt16(day)) + 1) * 86400000)) AND ((cluster, job_id, attempt, gpu_uuid, start_ms) NOT IN (
        SELECT
            cluster,
            job_id,
            attempt,
            gpu_uuid,
            end_ms
        FROM {db}.idle_stretches_daily
        FINAL
        WHERE end_ms >= ((toInt64(toUInt16(day)) + 1) * 86400000)
    ))
    UNION ALL
    SELECT
        cluster,
        tenant,
        queue,
        job_id,
        attempt,
        node,
        gpu_uuid,
        gpu_model,
        st.1,
        st.2,
        st.3
    FROM
    (
        SELECT
            cluster,
            tenant,
            queue,
            job_id,
            attempt,
            node,
            gpu_uuid,
            gpu_model,
            arrayMap(run -> ((run[1]).1, arrayMax(arrayMap(x -> (x.2), run)), arraySum(arrayMap(x -> (x.3), run))), arraySplit((x, i) -> ((i > 1) AND ((x.1) != ((segs[i - 1]).2))), segs, arrayEnumerate(segs))) AS stretches
        FROM
        (
            SELECT
                cluster,
                tenant,
                queue,
                job_id,
                attempt,
                node,
                gpu_uuid,
                gpu_model,
                arraySort(groupUniqArray((start_ms, end_ms, gpu_ms))) AS segs
            FROM
            (
                SELECT
                    cluster,
                    tenant,
                    queue,
                    job_id,
                    attempt,
                    node,
                    gpu_uuid,
                    gpu_model,
                    start_ms,
                    end_ms,
                    gpu_ms
                FROM {db}.idle_stretches_daily
                FINAL
                WHERE (start_ms = (toInt64(toUInt16(day)) * 86400000)) OR (end_ms >= ((toInt64(toUInt16(day)) + 1) * 86400000)) OR ((cluster, job_id, attempt, gpu_uuid, start_ms) IN (
                    SELECT
                        cluster,
                        job_id,
                        attempt,
                        gpu_uuid,
                        end_ms
                    FROM {db}.idle_stretches_daily
                    FINAL
                    WHERE end_ms >= ((toInt64(toUInt16(day)) + 1) * 86400000)
                ))
                UNION ALL
                SELECT
                    cluster,
                    tenant,
                    queue,
                    job_id,
                    attempt,
                    node,
                    gpu_uuid,
                    gpu_model,
                    start_ms,
                    end_ms,
                    gpu_ms
                FROM {db}.job_idle_segments
                WHERE (day IN (
                    SELECT day
                    FROM {db}.usage_capacity_daily
                    WHERE (cluster, day) NOT IN (
                        SELECT
                            cluster,
                            day
                        FROM {db}.idle_stretch_days
                    )
                )) AND ((cluster, day) NOT IN (
                    SELECT
                        cluster,
                        day
                    FROM {db}.idle_stretch_days
                ))
            )
            GROUP BY
                job_id,
                attempt,
                cluster,
                gpu_uuid,
                tenant,
                queue,
                node,
                gpu_model
        )
    )
    ARRAY JOIN stretches AS st
) AS s
LEFT JOIN
(
    SELECT
        cluster,
        job_id,
        attempt,
        min(first_start_ms) AS attempt_start_ms
    FROM {db}.usage_by_job_daily
    WHERE (job_id != '') AND (state IN ('executing', 'allocated_idle'))
    GROUP BY
        cluster,
        job_id,
        attempt
) AS a ON (s.cluster = a.cluster) AND (s.job_id = a.job_id) AND (s.attempt = a.attempt);

CREATE TABLE {db}.job_progress
(
    `schema_version` UInt8,
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `cluster` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `step` Int64,
    `samples` Nullable(Int64),
    `tokens` Nullable(Int64),
    `epoch` Nullable(Float64),
    `samples_per_s` Nullable(Float64),
    `tokens_per_s` Nullable(Float64),
    `step_time_ms` Nullable(Float64),
    `loss` Nullable(Float64),
    `rank_ids` Array(UInt32),
    `rank_step_time_ms` Array(Float64),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (job_id, attempt, ts_ms)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.job_progress_clustered
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `ts_ms` Int64,
    `step` Int64,
    `samples` Nullable(Int64),
    `tokens` Nullable(Int64),
    `epoch` Nullable(Float64),
    `loss` Nullable(Float64),
    `step_time_ms` Nullable(Float64),
    `rank_ids` Array(UInt32),
    `rank_step_time_ms` Array(Float64)
)
AS SELECT
    if((p.cluster = '') AND (length(k.clusters) = 1), k.clusters[1], p.cluster) AS cluster,
    p.job_id AS job_id,
    p.attempt AS attempt,
    p.ts_ms AS ts_ms,
    p.step AS step,
    p.r.1 AS samples,
    p.r.2 AS tokens,
    p.r.3 AS epoch,
    p.r.4 AS loss,
    p.r.5 AS step_time_ms,
    p.r.6 AS rank_ids,
    p.r.7 AS rank_step_time_ms
FROM
(
    SELECT
        toString(cluster) AS cluster,
        job_id,
        attempt,
        ts_ms,
        step,
        argMin((samples, tokens, epoch, loss, step_time_ms, rank_ids, rank_step_time_ms), (kafka_partition, kafka_offset)) AS r
    FROM {db}.job_progress
    GROUP BY
        cluster,
        job_id,
        attempt,
        ts_ms,
        step
) AS p
LEFT JOIN
(
    SELECT
        job_id,
        attempt,
        groupUniqArray(c) AS clusters
    FROM
    (
        SELECT
            job_id,
            attempt,
            toString(cluster) AS c
        FROM {db}.job_gpu_usage
        WHERE job_id IN (
            SELECT job_id
            FROM {db}.job_progress
            WHERE cluster = ''
        )
        UNION ALL
        SELECT
            job_id,
            attempt,
            toString(cluster) AS c
        FROM {db}.job_progress
        WHERE (cluster != '') AND (job_id IN (
            SELECT job_id
            FROM {db}.job_progress
            WHERE cluster = ''
        ))
    )
    GROUP BY
        job_id,
        attempt
) AS k ON (p.job_id = k.job_id) AND (p.attempt = k.attempt);

CREATE VIEW {db}.job_progress_deltas
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `ts_ms` Int64,
    `step` Int64,
    `tokens` Nullable(Int64),
    `samples` Nullable(Int64),
    `epoch` Nullable(Float64),
    `loss` Nullable(Float64),
    `step_time_ms` Nullable(Float64),
    `window_start` DateTime('UTC'),
    `d_ms` Int64,
    `d_step` Int64,
    `d_tokens` Int64,
    `d_tokens_ms` Int64
)
AS SELECT
    cluster,
    job_id,
    attempt,
    ts_ms,
    step,
    tokens,
    samples,
    epoch,
    loss,
    step_time_ms,
    toStartOfInterval(fromUnixTimestamp64Milli(ts_ms, 'UTC'), toIntervalMinute(10)) AS window_start,
    if(n = 1, 0, ts_ms - prev_ts) AS d_ms,
    if(n = 1, 0, step - prev_step) AS d_step,
    if((tokens IS NULL) OR (prev_tokens IS NULL), 0, assumeNotNull(tokens) - assumeNotNull(prev_tokens)) AS d_tokens,
    if((tokens IS NULL) OR (prev_tokens IS NULL), 0, ts_ms - assumeNotNull(prev_tokens_ts)) AS d_tokens_ms
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
        ts_ms,
        step,
        tokens,
        samples,
        epoch,
        loss,
        step_time_ms,
        row_number() OVER w AS n,
        lagInFrame(ts_ms, 1, 0) OVER w AS prev_ts,
        lagInFrame(step, 1, 0) OVER w AS prev_step,
        anyLast(tokens) OVER before AS prev_tokens,
        anyLast(if(tokens IS NULL, NULL, ts_ms)) OVER before AS prev_tokens_ts
    FROM {db}.job_progress_clustered
    WINDOW
        w AS (PARTITION BY cluster, job_id, attempt ORDER BY ts_ms ASC, step ASC ROWS BETWEEN 1 PRECEDING AND CURRENT ROW),
        before AS (PARTITION BY cluster, job_id, attempt ORDER BY ts_ms ASC, step ASC ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
);

CREATE VIEW {db}.job_progress_windows
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `window_start` DateTime('UTC'),
    `steps` Int64,
    `seconds` Float64,
    `steps_per_s` Float64,
    `tokens_per_s` Float64,
    `reports` UInt64,
    `util_pct` Nullable(Float64)
)
AS SELECT
    p.cluster AS cluster,
    p.job_id AS job_id,
    p.attempt AS attempt,
    p.window_start AS window_start,
    p.steps AS steps,
    p.seconds AS seconds,
    p.steps / p.seconds AS steps_per_s,
    if(p.token_seconds > 0, p.tokens / p.token_seconds, 0) AS tokens_per_s,
    p.reports AS reports,
    u.util_pct AS util_pct
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
        window_start,
        sum(d_step) AS steps,
        sum(d_ms) / 1000 AS seconds,
        sum(d_tokens) AS tokens,
        sum(d_tokens_ms) / 1000 AS token_seconds,
        count() AS reports
    FROM {db}.job_progress_deltas
    WHERE (d_ms > 0) OR (d_step != 0) OR (d_tokens != 0)
    GROUP BY
        cluster,
        job_id,
        attempt,
        window_start
) AS p
LEFT JOIN
(
    SELECT
        toString(cluster) AS cluster,
        job_id,
        attempt,
        toStartOfInterval(fromUnixTimestamp64Milli(start_ms, 'UTC'), toIntervalMinute(10)) AS window_start,
        sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) / nullIf(sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)), 0) AS util_pct
    FROM {db}.usage_raw
    FINAL
    WHERE job_id IN (
        SELECT DISTINCT job_id
        FROM {db}.job_progress
    )
    GROUP BY
        cluster,
        job_id,
        attempt,
        window_start
) AS u ON (p.cluster = u.cluster) AND (p.job_id = u.job_id) AND (p.attempt = u.attempt) AND (p.window_start = u.window_start)
WHERE p.seconds > 0;

CREATE VIEW {db}.job_rank_step_times
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `rank` UInt32,
    `mean_step_time_ms` Float64,
    `reports` UInt64
)
AS SELECT
    cluster,
    job_id,
    attempt,
    rank,
    avg(rank_time) AS mean_step_time_ms,
    count() AS reports
FROM {db}.job_progress_clustered
ARRAY JOIN
    rank_ids AS rank,
    rank_step_time_ms AS rank_time
GROUP BY
    cluster,
    job_id,
    attempt,
    rank;

CREATE VIEW {db}.job_training_signals
(
    `cluster` String,
    `job_id` String,
    `attempt` UInt32,
    `first_ms` Int64,
    `last_ms` Int64,
    `reports` UInt64,
    `steps` Int64,
    `tokens` Int64,
    `last_loss` Nullable(Float64),
    `span_seconds` Float64,
    `span_gpu_hours` Float64,
    `span_cost` Float64,
    `span_energy_j` Float64,
    `cost_per_step` Nullable(Float64),
    `cost_per_million_tokens` Nullable(Float64),
    `checkpoints` UInt64,
    `checkpoint_seconds` Float64
)
AS SELECT
    p.cluster AS cluster,
    p.job_id AS job_id,
    p.attempt AS attempt,
    p.first_ms AS first_ms,
    p.last_ms AS last_ms,
    p.reports AS reports,
    p.steps AS steps,
    p.tokens AS tokens,
    p.last_loss AS last_loss,
    (p.last_ms - p.first_ms) / 1000 AS span_seconds,
    u.gpu_ms / 3600000 AS span_gpu_hours,
    u.cost_micros / 1000000. AS span_cost,
    u.energy_j AS span_energy_j,
    (u.cost_micros / 1000000.) / nullIf(p.steps, 0) AS cost_per_step,
    ((u.token_cost_micros / 1000000.) / nullIf(p.tokens, 0)) * 1000000. AS cost_per_million_tokens,
    coalesce(c.checkpoints, 0) AS checkpoints,
    coalesce(c.checkpoint_seconds, 0) AS checkpoint_seconds
FROM
(
    SELECT
        cluster,
        job_id,
        attempt,
        min(ts_ms) AS first_ms,
        max(ts_ms) AS last_ms,
        count() AS reports,
        argMax(step, (ts_ms, step)) - argMin(step, (ts_ms, step)) AS steps,
        coalesce(argMax(tokens, (ts_ms, step)), 0) - coalesce(argMin(tokens, (ts_ms, step)), 0) AS tokens,
        argMax(loss, (ts_ms, step)) AS last_loss
    FROM {db}.job_progress_clustered
    GROUP BY
        cluster,
        job_id,
        attempt
) AS p
LEFT JOIN
(
    SELECT
        r.cluster AS cluster,
        r.job_id AS job_id,
        r.attempt AS attempt,
        sum(r.gpu_ms * r.part) AS gpu_ms,
        sum(r.cost_micros * r.part) AS cost_micros,
        sum(r.energy_j * r.part) AS energy_j,
        sum(r.cost_micros * r.token_part) AS token_cost_micros
    FROM
    (
        SELECT
            u.cluster AS cluster,
            u.job_id AS job_id,
            u.attempt AS attempt,
            u.gpu_ms AS gpu_ms,
            u.cost_micros AS cost_micros,
            u.energy_j AS energy_j,
            greatest(least(u.end_ms, s.last_ms) - greatest(u.start_ms, s.first_ms), 0) / greatest(u.end_ms - u.start_ms, 1) AS part,
            greatest(least(u.end_ms, s.tokens_last_ms) - greatest(u.start_ms, s.tokens_first_ms), 0) / greatest(u.end_ms - u.start_ms, 1) AS token_part
        FROM
        (
            SELECT
                toString(cluster) AS cluster,
                job_id,
                attempt,
                start_ms,
                end_ms,
                gpu_ms,
                cost_micros,
                energy_j
            FROM {db}.usage_raw
            FINAL
            WHERE (state IN ('executing', 'allocated_idle')) AND (job_id IN (
                SELECT DISTINCT job_id
                FROM {db}.job_progress
            ))
        ) AS u
        INNER JOIN
        (
            SELECT
                cluster,
                job_id,
                attempt,
                min(ts_ms) AS first_ms,
                max(ts_ms) AS last_ms,
                minIf(ts_ms, tokens IS NOT NULL) AS tokens_first_ms,
                maxIf(ts_ms, tokens IS NOT NULL) AS tokens_last_ms
            FROM {db}.job_progress_clustered
            GROUP BY
                cluster,
                job_id,
                attempt
        ) AS s ON (u.cluster = s.cluster) AND (u.job_id = s.job_id) AND (u.attempt = s.attempt)
    ) AS r
    GROUP BY
        r.cluster,
        r.job_id,
        r.attempt
) AS u ON (p.cluster = u.cluster) AND (p.job_id = u.job_id) AND (p.attempt = u.attempt)
LEFT JOIN {db}.job_checkpoint_time AS c ON (p.cluster = c.cluster) AND (p.job_id = c.job_id) AND (p.attempt = c.attempt);

CREATE TABLE {db}.job_util_buckets
(
    `job_id` String,
    `attempt` UInt32,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `util_bucket_pct` UInt8,
    `gpu_ms` UInt64,
    `slices` UInt64
)
ENGINE = SummingMergeTree
ORDER BY (job_id, attempt, cluster, tenant, queue, gpu_model, util_bucket_pct)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.job_util_buckets_mv TO {db}.job_util_buckets
(
    `job_id` String,
    `attempt` UInt32,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `util_bucket_pct` UInt8,
    `gpu_ms` UInt64,
    `slices` UInt64
)
AS SELECT
    job_id,
    attempt,
    cluster,
    tenant,
    queue,
    gpu_model,
    toUInt8(least(floor(assumeNotNull(util_pct) / 10), 9) * 10) AS util_bucket_pct,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    count() AS slices
FROM {db}.usage_raw
WHERE (state = 'executing') AND (util_pct IS NOT NULL) AND (job_id != '')
GROUP BY
    job_id,
    attempt,
    cluster,
    tenant,
    queue,
    gpu_model,
    util_bucket_pct;

CREATE VIEW {db}.job_util_histogram
(
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `util_bucket_pct` UInt8,
    `util_bucket` String,
    `gpu_seconds` Float64,
    `slices` UInt64
)
AS SELECT
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    util_bucket_pct,
    concat(leftPad(toString(util_bucket_pct), 2, '0'), '-', toString(util_bucket_pct + 10), '%') AS util_bucket,
    sum(gpu_ms) / 1000 AS gpu_seconds,
    sum(slices) AS slices
FROM {db}.job_util_buckets
GROUP BY
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    util_bucket_pct;

CREATE VIEW {db}.my_job_cost
(
    `cluster` String,
    `job_id` String,
    `tenant` String,
    `queue` String,
    `definition_version` LowCardinality(String),
    `attempts` UInt64,
    `failed_attempts` UInt64,
    `last_outcome` String,
    `requested_gpus` SimpleAggregateFunction(max, Float64),
    `gpu_hours` Float64,
    `executing_gpu_hours` Float64,
    `idle_gpu_hours` Float64,
    `effective_gpu_hours` Float64,
    `cost` Float64,
    `cost_micros` UInt64,
    `energy_kwh` Float64,
    `first_day` Nullable(Date),
    `last_day` Nullable(Date),
    `queue_wait_seconds` Float64,
    `queue_wait_gpu_hours` Float64
)
AS SELECT *
FROM {db}.job_cost
WHERE tenant IN (
    SELECT tenant
    FROM {db}.tenant_access
    FINAL
    WHERE (active = 1) AND ((principal = currentUser()) OR has(currentRoles(), principal))
);

CREATE VIEW {db}.my_tenant_daily_bill
(
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_gpu_hours` Float64,
    `compute_effective_gpu_hours` Float64,
    `compute_cost` Float64,
    `compute_cost_micros` UInt64,
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64,
    `idle_cost_micros` UInt64,
    `failed_retry_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `failed_retry_cost` Float64,
    `failed_retry_cost_micros` UInt64,
    `total_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_cost` Float64,
    `total_cost_micros` UInt64
)
AS SELECT *
FROM {db}.tenant_daily_bill
WHERE tenant IN (
    SELECT tenant
    FROM {db}.tenant_access
    FINAL
    WHERE (active = 1) AND ((principal = currentUser()) OR has(currentRoles(), principal))
);

CREATE TABLE {db}.node_inventory
(
    `cluster` LowCardinality(String),
    `node` String,
    `seen_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(seen_ms, 'UTC')),
    `gpu_count` UInt16,
    `gpu_uuids` Array(String),
    `gpu_models` Array(String),
    `source` LowCardinality(String) DEFAULT '',
    `kafka_topic` LowCardinality(String) DEFAULT '',
    `kafka_partition` Int32 DEFAULT -1,
    `kafka_offset` Int64 DEFAULT -1,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3),
    `gpu_serials` Array(String) DEFAULT [],
    `gpu_board_part_numbers` Array(String) DEFAULT [],
    `gpu_vbios_versions` Array(String) DEFAULT []
)
ENGINE = ReplacingMergeTree(seen_ms)
ORDER BY (cluster, node)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.node_load_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
AS SELECT
    ts,
    day,
    cluster,
    node,
    gpu_model,
    queue,
    total_gpu_ms,
    executing_gpu_ms,
    idle_gpu_ms,
    unallocated_gpu_ms,
    down_gpu_ms,
    util_weighted_gpu_ms,
    util_gpu_ms
FROM {db}.usage_node_5m;

CREATE TABLE {db}.prices
(
    `model` LowCardinality(String),
    `valid_from` Date,
    `version` String,
    `depreciation_per_hour` Float64,
    `maintenance_per_hour` Float64,
    `recorded_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (model, valid_from)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.queue_efficiency
(
    `day` Date,
    `cluster` String,
    `queue` String,
    `attempts` UInt64,
    `requested_gpu_seconds` Float64,
    `allocated_gpu_seconds` Float64,
    `executed_gpu_seconds` Float64,
    `allocated_to_requested` Nullable(Float64),
    `executed_to_allocated` Nullable(Float64),
    `executed_to_requested` Nullable(Float64),
    `waits` UInt64,
    `queue_wait_p50_s` Nullable(Float64),
    `queue_wait_p90_s` Nullable(Float64),
    `queue_wait_p99_s` Nullable(Float64),
    `queue_wait_mean_s` Nullable(Float64),
    `queue_wait_max_s` Nullable(Float64)
)
AS WITH
    u AS
    (
        SELECT
            cluster,
            job_id,
            attempt,
            sumIf(gpu_ms, (state IN ('allocated_idle', 'executing'))) AS u_allocated_gpu_ms,
            sumIf(gpu_ms, state = 'executing') AS u_executed_gpu_ms,
            max(last_end_ms) AS u_last_end_ms
        FROM {db}.usage_by_job_daily
        WHERE job_id != ''
        GROUP BY
            cluster,
            job_id,
            attempt
    )
SELECT
    day,
    cluster,
    queue,
    attempts,
    requested_gpu_seconds,
    allocated_gpu_seconds,
    executed_gpu_seconds,
    if(requested_gpu_seconds = 0, NULL, allocated_gpu_seconds / requested_gpu_seconds) AS allocated_to_requested,
    if(allocated_gpu_seconds = 0, NULL, executed_gpu_seconds / allocated_gpu_seconds) AS executed_to_allocated,
    if(requested_gpu_seconds = 0, NULL, executed_gpu_seconds / requested_gpu_seconds) AS executed_to_requested,
    waits,
    round(wait_p50, 3) AS queue_wait_p50_s,
    round(wait_p90, 3) AS queue_wait_p90_s,
    round(wait_p99, 3) AS queue_wait_p99_s,
    round(wait_mean, 3) AS queue_wait_mean_s,
    round(wait_max, 3) AS queue_wait_max_s
FROM
(
    SELECT
        toDate(fromUnixTimestamp64Milli(coalesce(a.queued_ms, a.first_seen_ms), 'UTC')) AS day,
        a.cluster AS cluster,
        a.queue AS queue,
        count() AS attempts,
        sum(a.requested_gpus * (coalesce(a.ended_ms, greatest(a.last_seen_ms, u.u_last_end_ms)) - coalesce(a.queued_ms, a.first_seen_ms))) / 1000 AS requested_gpu_seconds,
        sum(u.u_allocated_gpu_ms) / 1000 AS allocated_gpu_seconds,
        sum(u.u_executed_gpu_ms) / 1000 AS executed_gpu_seconds,
        count(a.queue_wait_ms) AS waits,
        quantileExactInclusive(0.5)(a.queue_wait_ms / 1000) AS wait_p50,
        quantileExactInclusive(0.9)(a.queue_wait_ms / 1000) AS wait_p90,
        quantileExactInclusive(0.99)(a.queue_wait_ms / 1000) AS wait_p99,
        avg(a.queue_wait_ms / 1000) AS wait_mean,
        max(a.queue_wait_ms / 1000) AS wait_max
    FROM {db}.job_attempts AS a
    LEFT JOIN u ON (a.cluster = u.cluster) AND (a.job_id = u.job_id) AND (a.attempt = u.attempt)
    GROUP BY
        day,
        cluster,
        queue
);

CREATE TABLE {db}.rebill_runs
(
    `rebill_id` String,
    `day_from` Date,
    `day_to` Date,
    `coefficients_as_of` Date,
    `created_at` DateTime64(3, 'UTC') DEFAULT now64(3),
    `cost_recomputed` Bool DEFAULT false
)
ENGINE = MergeTree
ORDER BY rebill_id
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.rebilled_usage
(
    `rebill_id` String,
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpu_ms` UInt64,
    `coefficient` Float64,
    `coefficient_version` String,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `original_cost_micros` Int128 DEFAULT cost_micros,
    `energy_j` Float64 DEFAULT 0,
    `price_version` String DEFAULT '',
    `priced_by_default` Bool DEFAULT false
)
ENGINE = MergeTree
ORDER BY (rebill_id, day, tenant, job_id, attempt, gpu_model, state)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.reclaim_suggestions
(
    `schema_version` UInt8,
    `suggestion_id` String,
    `definition_version` LowCardinality(String),
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `status` LowCardinality(String),
    `version` UInt8,
    `opened_at_ms` Int64,
    `withdrawn_at_ms` Nullable(Int64),
    `execution_rate` Float64,
    `window_ms` Int64,
    `job_ids` Array(String),
    `job_attempts` Array(UInt32),
    `job_tenants` Array(String),
    `job_gpus` Array(Array(String)),
    `job_gpus_freed` Array(Float64),
    `job_execution_rates` Array(Float64),
    `job_idle_cost_micros` Array(Int64),
    `gpus_freed` Float64,
    `waiting_gpus` Float64,
    `waiting_jobs` UInt32,
    `waiting_priority` Int32,
    `waiting_queues` Array(String),
    `idle_cost_micros` Int64,
    `currency` LowCardinality(String),
    `message` String,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(opened_at_ms, 'UTC')),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(version)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, suggestion_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE VIEW {db}.reclaim_suggestions_latest
(
    `suggestion_id` String,
    `definition_version` LowCardinality(String),
    `cluster` LowCardinality(String),
    `queue` LowCardinality(String),
    `status` LowCardinality(String),
    `opened_at` DateTime64(3, 'UTC'),
    `withdrawn_at` Nullable(DateTime64(3, 'UTC')),
    `opened_at_ms` Int64,
    `withdrawn_at_ms` Nullable(Int64),
    `execution_rate` Float64,
    `window_ms` Int64,
    `job_ids` Array(String),
    `job_attempts` Array(UInt32),
    `job_tenants` Array(String),
    `job_gpus` Array(Array(String)),
    `job_gpus_freed` Array(Float64),
    `job_execution_rates` Array(Float64),
    `job_idle_cost_micros` Array(Int64),
    `gpus_freed` Float64,
    `waiting_gpus` Float64,
    `waiting_jobs` UInt32,
    `waiting_priority` Int32,
    `waiting_queues` Array(String),
    `idle_cost_micros` Int64,
    `currency` LowCardinality(String),
    `message` String,
    `day` Date
)
AS SELECT
    suggestion_id,
    definition_version,
    cluster,
    queue,
    status,
    fromUnixTimestamp64Milli(opened_at_ms, 'UTC') AS opened_at,
    if(withdrawn_at_ms IS NULL, NULL, fromUnixTimestamp64Milli(assumeNotNull(withdrawn_at_ms), 'UTC')) AS withdrawn_at,
    opened_at_ms,
    withdrawn_at_ms,
    execution_rate,
    window_ms,
    job_ids,
    job_attempts,
    job_tenants,
    job_gpus,
    job_gpus_freed,
    job_execution_rates,
    job_idle_cost_micros,
    gpus_freed,
    waiting_gpus,
    waiting_jobs,
    waiting_priority,
    waiting_queues,
    idle_cost_micros,
    currency,
    message,
    day
FROM {db}.reclaim_suggestions
FINAL;

CREATE TABLE {db}.scheduler_preemptions
(
    `cluster` LowCardinality(String),
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `queue` LowCardinality(String),
    `job_id` String,
    `by_job_id` String,
    `rule` LowCardinality(String),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms, job_id)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE TABLE {db}.scheduler_snapshots
(
    `schema_version` UInt8,
    `cluster` LowCardinality(String),
    `ts_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')),
    `queue` LowCardinality(String),
    `queue_priority` Int32,
    `quota_gpus` Float64,
    `allocated_gpus` Float64,
    `pending_jobs` UInt32,
    `pending_gpus` Float64,
    `pending_priorities` Array(Int32),
    `pending_jobs_by_priority` Array(UInt32),
    `pending_gpus_by_priority` Array(Float64),
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, queue, ts_ms)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE TABLE {db}.schema_migrations
(
    `version` String,
    `name` String,
    `checksum` String,
    `applied_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY version
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.sink_progress
(
    `consumer` String,
    `topic` String,
    `partition` Int32,
    `epoch` UInt32,
    `from_offset` Int64,
    `to_offset` Int64,
    `phase` LowCardinality(String),
    `horizons` Map(String, Int64),
    `seq` UInt64,
    `written_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(seq)
ORDER BY (consumer, topic, partition)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.tenant_access
(
    `principal` String,
    `tenant` String,
    `active` UInt8 DEFAULT 1,
    `granted_by` String DEFAULT '',
    `granted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(granted_at)
ORDER BY (principal, tenant)
SETTINGS index_granularity = 8192;

CREATE VIEW {db}.tenant_daily_bill
(
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_gpu_hours` Float64,
    `compute_effective_gpu_hours` Float64,
    `compute_cost` Float64,
    `compute_cost_micros` Int128,
    `idle_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `idle_cost` Float64,
    `idle_cost_micros` Int128,
    `failed_retry_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `failed_retry_cost` Float64,
    `failed_retry_cost_micros` Int128,
    `total_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_cost` Float64,
    `total_cost_micros` Int128,
    `priced_by_default_gpu_hours` Float64
)
AS SELECT
    day,
    tenant,
    definition_version,
    sumIf(line_gpu_ms, line = 'compute') / 3600000 AS compute_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'compute') / 3600000 AS compute_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'compute') / 1000000. AS compute_cost,
    sumIf(line_cost_micros, line = 'compute') AS compute_cost_micros,
    sumIf(line_gpu_ms, line = 'idle') / 3600000 AS idle_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'idle') / 1000000. AS idle_cost,
    sumIf(line_cost_micros, line = 'idle') AS idle_cost_micros,
    sumIf(line_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_gpu_hours,
    sumIf(line_effective_gpu_ms, line = 'failed_retry') / 3600000 AS failed_retry_effective_gpu_hours,
    sumIf(line_cost_micros, line = 'failed_retry') / 1000000. AS failed_retry_cost,
    sumIf(line_cost_micros, line = 'failed_retry') AS failed_retry_cost_micros,
    sum(line_gpu_ms) / 3600000 AS total_gpu_hours,
    sum(line_effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(line_cost_micros) / 1000000. AS total_cost,
    sum(line_cost_micros) AS total_cost_micros,
    sum(line_priced_by_default_gpu_ms) / 3600000 AS priced_by_default_gpu_hours
FROM
(
    SELECT
        u.day AS day,
        u.tenant AS tenant,
        u.definition_version AS definition_version,
        multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line,
        u.gpu_ms AS line_gpu_ms,
        u.effective_gpu_ms AS line_effective_gpu_ms,
        u.cost_micros AS line_cost_micros,
        u.priced_by_default_gpu_ms AS line_priced_by_default_gpu_ms
    FROM {db}.usage_by_job_daily AS u
    LEFT JOIN {db}.job_attempt_outcomes AS a ON (u.cluster = a.cluster) AND (u.job_id = a.job_id) AND (u.attempt = a.attempt)
    WHERE (u.state IN ('executing', 'allocated_idle')) AND (u.job_id != '')
)
GROUP BY
    day,
    tenant,
    definition_version;

CREATE VIEW {db}.tenant_daily_bill_for
AS SELECT *
FROM {db}.tenant_daily_bill
WHERE tenant = {tenant:String};

CREATE VIEW {db}.tenant_daily_carbon
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `carbon_version` String,
    `energy_kwh` Float64,
    `facility_energy_kwh` Float64,
    `co2e_kg` Float64
)
AS WITH
    (
        SELECT groupArray((toString(cluster), day))
        FROM {db}.usage_by_job_hourly_exact_days
    ) AS exact_days
SELECT
    x.day AS day,
    x.cluster AS cluster,
    x.tenant AS tenant,
    x.definition_version AS definition_version,
    x.carbon_version AS carbon_version,
    sum(x.energy_j) / 3600000 AS energy_kwh,
    sum(x.energy_j * x.pue) / 3600000 AS facility_energy_kwh,
    sum(((x.energy_j / 3600000) * x.pue) * if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh)) / 1000 AS co2e_kg
FROM
(
    SELECT
        u.day AS day,
        u.cluster AS cluster,
        u.tenant AS tenant,
        u.definition_version AS definition_version,
        u.start_ms AS start_ms,
        u.energy_j AS energy_j,
        d.carbon_version AS carbon_version,
        d.pue AS pue,
        d.default_gco2e_per_kwh AS default_gco2e_per_kwh,
        if(mapContains(d.zones, u.cluster), d.zones[u.cluster], u.cluster) AS zone
    FROM
    (
        SELECT
            e.day AS day,
            toString(e.cluster) AS cluster,
            toString(e.tenant) AS tenant,
            toString(e.definition_version) AS definition_version,
            e.hour * 3600000 AS start_ms,
            sum(e.energy_mj) / 1000 AS energy_j
        FROM {db}.closed_energy AS e
        WHERE (e.bill_run_id IN (
            SELECT bill_run_id
            FROM {db}.bill_runs
        )) AND ((e.cluster, e.day) NOT IN (
            SELECT
                cluster,
                day
            FROM {db}.carbon_record_days
        ))
        GROUP BY
            e.day,
            e.cluster,
            e.tenant,
            e.definition_version,
            e.hour
        UNION ALL
        SELECT
            h.day AS day,
            toString(h.cluster) AS cluster,
            toString(h.tenant) AS tenant,
            toString(h.definition_version) AS definition_version,
            h.hour * 3600000 AS start_ms,
            sum(h.energy_j) AS energy_j
        FROM {db}.usage_by_job_hourly AS h
        WHERE (h.job_id != '') AND (h.state IN ('executing', 'allocated_idle')) AND has(exact_days, (toString(h.cluster), h.day))
        GROUP BY
            h.day,
            h.cluster,
            h.tenant,
            h.definition_version,
            h.hour
        UNION ALL
        SELECT
            r.day AS day,
            toString(r.cluster) AS cluster,
            toString(r.tenant) AS tenant,
            toString(r.definition_version) AS definition_version,
            if(((r.cluster, r.day) IN (
                SELECT
                    cluster,
                    day
                FROM {db}.carbon_record_days
            )), r.start_ms, intDiv(r.start_ms, 3600000) * 3600000) AS bucket_ms,
            sum(r.energy_j) AS energy_j
        FROM {db}.usage_raw AS r
        FINAL
        WHERE (r.job_id != '') AND (r.state IN ('executing', 'allocated_idle')) AND (((r.cluster, r.day) IN (
            SELECT DISTINCT
                cluster,
                day
            FROM {db}.usage_capacity_daily
            WHERE ((cluster, day) NOT IN (
                SELECT
                    cluster,
                    day
                FROM {db}.closed_days
                WHERE bill_run_id IN (
                    SELECT bill_run_id
                    FROM {db}.bill_runs
                )
            )) AND (NOT has(exact_days, (toString(cluster), day)))
        )) OR ((r.cluster, r.day) IN (
            SELECT
                cluster,
                day
            FROM {db}.carbon_record_days
        )))
        GROUP BY
            r.day,
            r.cluster,
            r.tenant,
            r.definition_version,
            bucket_ms
    ) AS u
    CROSS JOIN {db}.carbon_definition_current AS d
) AS x
ASOF LEFT JOIN
(
    SELECT
        zone,
        valid_from_ms,
        gco2e_per_kwh,
        toUInt8(1) AS found
    FROM {db}.carbon_intensity_current
) AS ci ON (x.zone = ci.zone) AND (x.start_ms >= ci.valid_from_ms)
GROUP BY
    day,
    cluster,
    tenant,
    definition_version,
    carbon_version;

CREATE VIEW {db}.tenant_daily_rebill
(
    `rebill_id` String,
    `day` Date,
    `tenant` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `compute_effective_gpu_hours` Float64,
    `idle_effective_gpu_hours` Float64,
    `failed_retry_effective_gpu_hours` Float64,
    `total_effective_gpu_hours` Float64,
    `total_gpu_hours` Float64,
    `total_cost_micros` Int128,
    `compute_cost_micros` Int128,
    `idle_cost_micros` Int128,
    `failed_retry_cost_micros` Int128,
    `original_total_cost_micros` Int128,
    `priced_by_default_gpu_hours` Float64
)
AS SELECT
    r.rebill_id AS rebill_id,
    r.day AS day,
    r.tenant AS tenant,
    r.definition_version AS definition_version,
    sumIf(r.effective_gpu_ms, (r.state = 'executing') AND (a.outcome != 'failed')) / 3600000 AS compute_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, r.state = 'allocated_idle') / 3600000 AS idle_effective_gpu_hours,
    sumIf(r.effective_gpu_ms, (r.state = 'executing') AND (a.outcome = 'failed')) / 3600000 AS failed_retry_effective_gpu_hours,
    sum(r.effective_gpu_ms) / 3600000 AS total_effective_gpu_hours,
    sum(r.gpu_ms) / 3600000 AS total_gpu_hours,
    sum(r.cost_micros) AS total_cost_micros,
    sumIf(r.cost_micros, (r.state = 'executing') AND (a.outcome != 'failed')) AS compute_cost_micros,
    sumIf(r.cost_micros, r.state = 'allocated_idle') AS idle_cost_micros,
    sumIf(r.cost_micros, (r.state = 'executing') AND (a.outcome = 'failed')) AS failed_retry_cost_micros,
    sum(r.original_cost_micros) AS original_total_cost_micros,
    sumIf(r.gpu_ms, r.priced_by_default) / 3600000 AS priced_by_default_gpu_hours
FROM {db}.rebilled_usage AS r
LEFT JOIN
(
    SELECT
        cluster,
        job_id,
        attempt,
        outcome
    FROM {db}.job_attempts
) AS a ON (r.cluster = a.cluster) AND (r.job_id = a.job_id) AND (r.attempt = a.attempt)
WHERE (r.state IN ('executing', 'allocated_idle')) AND (r.job_id != '')
GROUP BY
    rebill_id,
    day,
    tenant,
    definition_version;

CREATE TABLE {db}.unallocated_util_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `util_step` UInt8,
    `gpu_ms` UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, node, gpu_uuid, day, util_step)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.unallocated_util_daily_mv TO {db}.unallocated_util_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `util_step` UInt8,
    `gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    node,
    gpu_uuid,
    toUInt8(least(ceil(assumeNotNull(util_pct)), 255)) AS util_step,
    sum(gpu_ms) AS gpu_ms
FROM {db}.usage_raw
WHERE (state = 'unallocated') AND (util_pct > 0)
GROUP BY
    day,
    cluster,
    node,
    gpu_uuid,
    util_step;

CREATE TABLE {db}.usage_by_job_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `slices` SimpleAggregateFunction(sum, UInt64),
    `gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `effective_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `cost_micros` SimpleAggregateFunction(sum, Int128),
    `energy_j` SimpleAggregateFunction(sum, Float64),
    `util_weighted_gpu_ms` SimpleAggregateFunction(sum, Float64),
    `util_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `first_start_ms` SimpleAggregateFunction(min, Int64),
    `last_end_ms` SimpleAggregateFunction(max, Int64),
    `priced_by_default_gpu_ms` SimpleAggregateFunction(sum, UInt64) DEFAULT 0
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW {db}.usage_by_job_daily_mv TO {db}.usage_by_job_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `slices` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `energy_j` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `first_start_ms` Int64,
    `last_end_ms` Int64,
    `priced_by_default_gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    state,
    definition_version,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    min(start_ms) AS first_start_ms,
    max(end_ms) AS last_end_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    tenant,
    queue,
    job_id,
    attempt,
    gpu_model,
    state,
    definition_version;

CREATE TABLE {db}.usage_by_job_hourly
(
    `day` Date,
    `cluster` LowCardinality(String),
    `hour` Int64,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `definition_version` LowCardinality(String),
    `state` LowCardinality(String),
    `records` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` UInt64,
    `energy_j` Float64,
    `energy_mj` Int64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, hour, state, tenant, queue, job_id, attempt, definition_version)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE VIEW {db}.usage_by_job_hourly_exact_days
(
    `cluster` LowCardinality(String),
    `day` Date
)
AS SELECT
    a.cluster AS cluster,
    a.day AS day
FROM
(
    SELECT
        cluster,
        day,
        sum(records) AS n
    FROM {db}.usage_by_job_hourly
    WHERE (cluster, day) IN (
        SELECT DISTINCT
            cluster,
            day
        FROM {db}.usage_capacity_daily
        WHERE ((cluster, day) NOT IN (
            SELECT
                cluster,
                day
            FROM {db}.closed_days
            WHERE bill_run_id IN (
                SELECT bill_run_id
                FROM {db}.bill_runs
            )
        )) AND ((cluster, day) NOT IN (
            SELECT
                cluster,
                day
            FROM {db}.carbon_record_days
        ))
    )
    GROUP BY
        cluster,
        day
) AS a
INNER JOIN
(
    SELECT
        cluster,
        day,
        count() AS n
    FROM {db}.usage_raw
    FINAL
    WHERE day IN (
        SELECT DISTINCT day
        FROM {db}.usage_capacity_daily
        WHERE (cluster, day) NOT IN (
            SELECT
                cluster,
                day
            FROM {db}.closed_days
            WHERE bill_run_id IN (
                SELECT bill_run_id
                FROM {db}.bill_runs
            )
        )
    )
    GROUP BY
        cluster,
        day
) AS r ON (a.cluster = r.cluster) AND (a.day = r.day)
WHERE a.n = r.n;

CREATE MATERIALIZED VIEW {db}.usage_by_job_hourly_mv TO {db}.usage_by_job_hourly
(
    `day` Date,
    `cluster` LowCardinality(String),
    `hour` Int64,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `definition_version` LowCardinality(String),
    `state` LowCardinality(String),
    `records` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` UInt64,
    `energy_j` Float64,
    `energy_mj` Int64
)
AS SELECT
    day,
    cluster,
    intDiv(start_ms, 3600000) AS hour,
    tenant,
    queue,
    job_id,
    attempt,
    definition_version,
    state,
    count() AS records,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(cost_micros) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(toInt64(round(usage_raw.energy_j * 1000))) AS energy_mj
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    hour,
    tenant,
    queue,
    job_id,
    attempt,
    definition_version,
    state;

CREATE TABLE {db}.usage_capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` AggregateFunction(uniqExact, String),
    `slices` SimpleAggregateFunction(sum, UInt64),
    `gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `effective_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `cost_micros` SimpleAggregateFunction(sum, Int128),
    `energy_j` SimpleAggregateFunction(sum, Float64),
    `util_weighted_gpu_ms` SimpleAggregateFunction(sum, Float64),
    `util_gpu_ms` SimpleAggregateFunction(sum, UInt64),
    `priced_by_default_gpu_ms` SimpleAggregateFunction(sum, UInt64) DEFAULT 0
)
ENGINE = AggregatingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, gpu_model, state, definition_version)
SETTINGS index_granularity = 8192, non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW {db}.usage_capacity_daily_mv TO {db}.usage_capacity_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `definition_version` LowCardinality(String),
    `gpus` AggregateFunction(uniqExact, String),
    `slices` UInt64,
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `energy_j` Float64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `priced_by_default_gpu_ms` UInt64
)
AS SELECT
    day,
    cluster,
    gpu_model,
    state,
    definition_version,
    uniqExactState(gpu_uuid) AS gpus,
    count() AS slices,
    sum(gpu_ms) AS gpu_ms,
    sum(effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(cost_micros)) AS cost_micros,
    sum(energy_j) AS energy_j,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    sum(if(priced_by_default, usage_raw.gpu_ms, toUInt64(0))) AS priced_by_default_gpu_ms
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    gpu_model,
    state,
    definition_version;

CREATE VIEW {db}.usage_carbon
(
    `day` Date,
    `cluster` LowCardinality(String),
    `record_id` String,
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `definition_version` LowCardinality(String),
    `start_ms` Int64,
    `energy_j` Float64,
    `carbon_version` String,
    `pue` Float64,
    `zone` String,
    `gco2e_per_kwh` Float64,
    `intensity_source` String,
    `co2e_g` Float64
)
AS SELECT
    x.day AS day,
    x.cluster AS cluster,
    x.record_id AS record_id,
    x.gpu_uuid AS gpu_uuid,
    x.gpu_model AS gpu_model,
    x.state AS state,
    x.tenant AS tenant,
    x.queue AS queue,
    x.job_id AS job_id,
    x.attempt AS attempt,
    x.definition_version AS definition_version,
    x.start_ms AS start_ms,
    x.energy_j AS energy_j,
    x.carbon_version AS carbon_version,
    x.pue AS pue,
    x.zone AS zone,
    if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh) AS gco2e_per_kwh,
    if(ci.found = 1, 'loaded', 'default') AS intensity_source,
    ((x.energy_j / 3600000) * x.pue) * if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh) AS co2e_g
FROM
(
    SELECT
        u.day AS day,
        toString(u.cluster) AS cluster,
        u.record_id AS record_id,
        u.gpu_uuid AS gpu_uuid,
        toString(u.gpu_model) AS gpu_model,
        toString(u.state) AS state,
        toString(u.tenant) AS tenant,
        toString(u.queue) AS queue,
        u.job_id AS job_id,
        u.attempt AS attempt,
        toString(u.definition_version) AS definition_version,
        u.start_ms AS start_ms,
        u.energy_j AS energy_j,
        d.carbon_version AS carbon_version,
        d.pue AS pue,
        d.default_gco2e_per_kwh AS default_gco2e_per_kwh,
        if(mapContains(d.zones, toString(u.cluster)), d.zones[toString(u.cluster)], toString(u.cluster)) AS zone
    FROM
    (
        SELECT *
        FROM {db}.usage_raw
        FINAL
    ) AS u
    CROSS JOIN {db}.carbon_definition_current AS d
) AS x
ASOF LEFT JOIN
(
    SELECT
        zone,
        valid_from_ms,
        gco2e_per_kwh,
        toUInt8(1) AS found
    FROM {db}.carbon_intensity_current
) AS ci ON (x.zone = ci.zone) AND (x.start_ms >= ci.valid_from_ms);

CREATE VIEW {db}.usage_dedup_audit
(
    `day` Date,
    `source_table` String,
    `rows` UInt64,
    `distinct_records` UInt64,
    `duplicates` Int64
)
AS WITH
    ids AS
    (
        SELECT
            day,
            uniqExact(cluster, record_id) AS distinct_records
        FROM {db}.usage_raw
        GROUP BY day
    )
SELECT
    t.day AS day,
    t.source_table AS source_table,
    t.rows AS rows,
    ids.distinct_records AS distinct_records,
    toInt64(t.rows) - toInt64(ids.distinct_records) AS duplicates
FROM
(
    SELECT
        day,
        'usage_raw' AS source_table,
        count() AS rows
    FROM {db}.usage_raw
    GROUP BY day
    UNION ALL
    SELECT
        day,
        'usage_by_job_daily' AS source_table,
        sum(slices) AS rows
    FROM {db}.usage_by_job_daily
    GROUP BY day
    UNION ALL
    SELECT
        day,
        'usage_capacity_daily' AS source_table,
        sum(slices) AS rows
    FROM {db}.usage_capacity_daily
    GROUP BY day
) AS t
INNER JOIN ids ON ids.day = t.day;

CREATE TABLE {db}.usage_exact_hours
(
    `cluster` LowCardinality(String),
    `day` Date,
    `hour` Int64,
    `records` UInt64,
    `checked_at` DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(records)
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, hour)
SETTINGS index_granularity = 8192;

CREATE TABLE {db}.usage_gpu_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (ts, cluster, node, gpu_uuid, gpu_model, queue, day)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.usage_gpu_5m_mv TO {db}.usage_gpu_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
AS SELECT
    toStartOfFiveMinutes(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    queue,
    sum(gpu_ms) AS total_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_gpu_ms
FROM {db}.usage_raw
GROUP BY
    ts,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    queue;

CREATE TABLE {db}.usage_gpu_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `gpu_uuid` String,
    `node` LowCardinality(String),
    `queue` LowCardinality(String),
    `state` LowCardinality(String),
    `records` UInt64,
    `gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (day, cluster, gpu_model, gpu_uuid, node, queue, state)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.usage_gpu_daily_mv TO {db}.usage_gpu_daily
(
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `gpu_uuid` String,
    `node` LowCardinality(String),
    `queue` LowCardinality(String),
    `state` LowCardinality(String),
    `records` UInt64,
    `gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64
)
AS SELECT
    day,
    cluster,
    gpu_model,
    gpu_uuid,
    node,
    queue,
    state,
    count() AS records,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms
FROM {db}.usage_raw
GROUP BY
    day,
    cluster,
    gpu_model,
    gpu_uuid,
    node,
    queue,
    state;

CREATE TABLE {db}.usage_gpu_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `util_metric_weighted_gpu_ms` Float64 DEFAULT 0,
    `util_metric_gpu_ms` UInt64 DEFAULT 0
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, hour, gpu_model, node, gpu_uuid, state, day)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.usage_gpu_hourly_mv TO {db}.usage_gpu_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `state` LowCardinality(String),
    `gpu_ms` UInt64,
    `effective_gpu_ms` UInt64,
    `cost_micros` Int128,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `util_metric_weighted_gpu_ms` Float64,
    `util_metric_gpu_ms` UInt64
)
AS SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(usage_raw.effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(usage_raw.cost_micros)) AS cost_micros,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_metric_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_metric_gpu_ms
FROM {db}.usage_raw
GROUP BY
    hour,
    day,
    cluster,
    node,
    gpu_uuid,
    gpu_model,
    state;

CREATE TABLE {db}.usage_node_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
ENGINE = SummingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (ts, cluster, node, gpu_model, queue, day)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE MATERIALIZED VIEW {db}.usage_node_5m_mv TO {db}.usage_node_5m
(
    `ts` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `queue` LowCardinality(String),
    `total_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `idle_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64
)
AS SELECT
    toStartOfFiveMinutes(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS ts,
    day,
    cluster,
    node,
    gpu_model,
    queue,
    sum(gpu_ms) AS total_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(assumeNotNull(util_pct) * gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_weighted_gpu_ms,
    sumIf(gpu_ms, (state = 'executing') AND (util_pct IS NOT NULL)) AS util_gpu_ms
FROM {db}.usage_raw
GROUP BY
    ts,
    day,
    cluster,
    node,
    gpu_model,
    queue;

CREATE TABLE {db}.usage_raw
(
    `schema_version` UInt8,
    `record_id` String,
    `cluster` LowCardinality(String),
    `node` LowCardinality(String),
    `gpu_uuid` String,
    `gpu_model` LowCardinality(String),
    `start_ms` Int64,
    `end_ms` Int64,
    `day` Date DEFAULT toDate(fromUnixTimestamp64Milli(start_ms, 'UTC')),
    `state` LowCardinality(String),
    `job_id` String,
    `attempt` UInt32,
    `tenant` LowCardinality(String),
    `queue` LowCardinality(String),
    `share_milli` UInt16,
    `gpu_ms` UInt64,
    `util_pct` Nullable(Float64),
    `util_metric_pct` Nullable(Float64),
    `mem_used_bytes` Nullable(UInt64),
    `energy_j` Float64,
    `coefficient` Float64,
    `coefficient_version` LowCardinality(String),
    `effective_gpu_ms` UInt64,
    `cost_micros` UInt64,
    `definition_version` LowCardinality(String),
    `price_version` LowCardinality(String) DEFAULT '',
    `priced_by_default` Bool DEFAULT false,
    `sample_count` UInt32 DEFAULT 1,
    `kafka_topic` LowCardinality(String),
    `kafka_partition` Int32,
    `kafka_offset` Int64,
    `inserted_at` DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, intDiv(start_ms, 3600000), gpu_uuid, start_ms, record_id)
SETTINGS non_replicated_deduplication_window = 1000, index_granularity = 8192;

CREATE VIEW {db}.utilization_hourly
(
    `hour` DateTime('UTC'),
    `day` Date,
    `cluster` LowCardinality(String),
    `gpu_model` LowCardinality(String),
    `capacity_gpu_ms` UInt64,
    `down_gpu_ms` UInt64,
    `unallocated_gpu_ms` UInt64,
    `allocated_gpu_ms` UInt64,
    `executing_gpu_ms` UInt64,
    `executing_effective_gpu_ms` UInt64,
    `util_weighted_gpu_ms` Float64,
    `util_gpu_ms` UInt64,
    `unallocated_cost` Float64
)
AS SELECT
    hour,
    day,
    cluster,
    gpu_model,
    sum(gpu_ms) AS capacity_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, (state IN ('allocated_idle', 'executing'))) AS allocated_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(effective_gpu_ms, state = 'executing') AS executing_effective_gpu_ms,
    sumIf(util_metric_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
    sumIf(util_metric_gpu_ms, state = 'executing') AS util_gpu_ms,
    toFloat64(sumIf(cost_micros, state = 'unallocated')) / 1000000. AS unallocated_cost
FROM {db}.usage_gpu_hourly
GROUP BY
    hour,
    day,
    cluster,
    gpu_model;
