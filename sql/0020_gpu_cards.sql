-- GPU ID cards and carbon (issue #15, points 1 and 2). How the figures are computed: docs/gpu-cards.md
-- and docs/carbon.md.

-- ---------------------------------------------------------------- GPU identity
-- What the agent reads once per GPU at start (NVML serial, board part number, VBIOS), parallel to
-- gpu_uuids; '' where it could not read it. Rows of agents before these fields keep them empty.
ALTER TABLE node_inventory ADD COLUMN IF NOT EXISTS gpu_serials Array(String) DEFAULT [];
ALTER TABLE node_inventory ADD COLUMN IF NOT EXISTS gpu_board_part_numbers Array(String) DEFAULT [];
ALTER TABLE node_inventory ADD COLUMN IF NOT EXISTS gpu_vbios_versions Array(String) DEFAULT [];

-- Where and when each GPU was seen: one row per GPU, cluster, node and identity after merging, with
-- the first and last tick seen there. node_inventory keeps only each node's newest report
-- (ReplacingMergeTree), so the materialized view catches every report as it is written; this table
-- is the card's placement history (first/last seen, nodes it sat in, identity).
CREATE TABLE IF NOT EXISTS gpu_sightings
(
    gpu_uuid           String,
    cluster            LowCardinality(String),
    node               String,
    gpu_model          LowCardinality(String),
    serial             String,
    board_part_number  String,
    vbios_version      String,
    first_seen_ms      SimpleAggregateFunction(min, Int64),
    last_seen_ms       SimpleAggregateFunction(max, Int64),
    reports            SimpleAggregateFunction(sum, UInt64)
)
ENGINE = AggregatingMergeTree
ORDER BY (gpu_uuid, cluster, node, gpu_model, serial, board_part_number, vbios_version);

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_sightings_mv TO gpu_sightings AS
SELECT
    gpu_uuids[i] AS gpu_uuid, cluster, node, toLowCardinality(gpu_models[i]) AS gpu_model,
    gpu_serials[i] AS serial, gpu_board_part_numbers[i] AS board_part_number, gpu_vbios_versions[i] AS vbios_version,
    min(seen_ms) AS first_seen_ms, max(seen_ms) AS last_seen_ms, count() AS reports
FROM node_inventory
ARRAY JOIN arrayEnumerate(gpu_uuids) AS i
GROUP BY gpu_uuid, cluster, node, gpu_model, serial, board_part_number, vbios_version;

-- Back-fill from the per-sample health rows already stored (they hold every tick within their
-- retention; node_inventory only each node's latest). No identity in them: '' there.
INSERT INTO gpu_sightings
SELECT
    gpu_uuid, cluster, toString(node) AS node, gpu_model, '' AS serial, '' AS board_part_number, '' AS vbios_version,
    min(ts_ms) AS first_seen_ms, max(ts_ms) AS last_seen_ms, count() AS reports
FROM gpu_health
GROUP BY gpu_uuid, cluster, node, gpu_model;

-- ---------------------------------------------------------------- repairs
-- Repairs an operator records (`gpuledger gpu repair UUID --note ... --at ...`). Append-only: a row is
-- never changed or deleted; who recorded it and when stay with it.
CREATE TABLE IF NOT EXISTS gpu_repairs
(
    repair_id    String,
    gpu_uuid     String,
    repaired_ms  Int64,
    note         String,
    recorded_by  String,
    recorded_at  DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (gpu_uuid, repaired_ms, repair_id);

-- ---------------------------------------------------------------- carbon
-- Grid carbon intensity per zone (a cluster name, or a region [carbon.zones] maps clusters to), valid
-- from valid_from_ms until the zone's next row. Loaded from CSV (`gpuledger carbon load`); history is
-- kept: a later load of the same (zone, valid_from_ms) supersedes the earlier one, which stays stored.
CREATE TABLE IF NOT EXISTS carbon_intensity
(
    zone           String,
    valid_from_ms  Int64,
    gco2e_per_kwh  Float64,
    source         String,
    loaded_by      String,
    loaded_at      DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (zone, valid_from_ms, loaded_at);

-- The [carbon] definition of the ledger TOML as recorded (`gpuledger migrate`, `gpuledger carbon load`):
-- the latest recorded one is the definition every carbon figure uses, and names its version.
CREATE TABLE IF NOT EXISTS carbon_definitions
(
    carbon_version         String,
    pue                    Float64,
    default_gco2e_per_kwh  Float64,
    default_source         String,
    zones                  Map(String, String),
    recorded_at            DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
ORDER BY (carbon_version, recorded_at);

-- No row until a definition is recorded (HAVING): then carbon figures are absent, never made up.
CREATE OR REPLACE VIEW carbon_definition_current AS
SELECT
    argMax(carbon_version, recorded_at) AS carbon_version,
    argMax(pue, recorded_at) AS pue,
    argMax(default_gco2e_per_kwh, recorded_at) AS default_gco2e_per_kwh,
    argMax(zones, recorded_at) AS zones
FROM carbon_definitions
HAVING count() > 0;

CREATE OR REPLACE VIEW carbon_intensity_current AS
SELECT zone, valid_from_ms, argMax(gco2e_per_kwh, loaded_at) AS gco2e_per_kwh
FROM carbon_intensity
GROUP BY zone, valid_from_ms;

-- Carbon of every usage record (each record id once): energy_j x PUE x the zone's intensity valid at
-- the record's start (ASOF JOIN on valid_from_ms), or the definition's default where none is loaded.
-- gpuledger/warehouse/carbon.py builds the same figures with filters applied before the join.
CREATE OR REPLACE VIEW usage_carbon AS
SELECT
    x.day AS day, x.cluster AS cluster, x.record_id AS record_id, x.gpu_uuid AS gpu_uuid, x.gpu_model AS gpu_model,
    x.state AS state, x.tenant AS tenant, x.queue AS queue, x.job_id AS job_id, x.attempt AS attempt,
    x.definition_version AS definition_version, x.start_ms AS start_ms, x.energy_j AS energy_j,
    x.carbon_version AS carbon_version, x.pue AS pue, x.zone AS zone,
    if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh) AS gco2e_per_kwh,
    if(ci.found = 1, 'loaded', 'default') AS intensity_source,
    x.energy_j / 3600000 * x.pue * if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh) AS co2e_g
FROM
(
    SELECT
        u.day AS day, toString(u.cluster) AS cluster, u.record_id AS record_id, u.gpu_uuid AS gpu_uuid,
        toString(u.gpu_model) AS gpu_model, toString(u.state) AS state, toString(u.tenant) AS tenant,
        toString(u.queue) AS queue, u.job_id AS job_id, u.attempt AS attempt,
        toString(u.definition_version) AS definition_version, u.start_ms AS start_ms, u.energy_j AS energy_j,
        d.carbon_version AS carbon_version, d.pue AS pue, d.default_gco2e_per_kwh AS default_gco2e_per_kwh,
        if(mapContains(d.zones, toString(u.cluster)), d.zones[toString(u.cluster)], toString(u.cluster)) AS zone
    FROM (SELECT * FROM usage_raw LIMIT 1 BY cluster, record_id) AS u
    CROSS JOIN carbon_definition_current AS d
) AS x
ASOF LEFT JOIN
(
    SELECT zone, valid_from_ms, gco2e_per_kwh, toUInt8(1) AS found FROM carbon_intensity_current
) AS ci
ON x.zone = ci.zone AND x.start_ms >= ci.valid_from_ms;

-- Carbon of tenants' jobs per UTC day: the states a tenant bill charges (executing, allocated idle).
-- A sibling of tenant_daily_bill (sql/0018), which stays as it is.
CREATE OR REPLACE VIEW tenant_daily_carbon AS
SELECT
    day, cluster, tenant, definition_version, carbon_version,
    sum(energy_j) / 3600000 AS energy_kwh,
    sum(energy_j * pue) / 3600000 AS facility_energy_kwh,
    sum(co2e_g) / 1000 AS co2e_kg
FROM usage_carbon
WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
GROUP BY day, cluster, tenant, definition_version, carbon_version;

-- ---------------------------------------------------------------- the cards, for dashboards
-- One row per GPU: identity (newest non-empty values), first/last seen, nodes, repairs, down time, Xid
-- errors, temperature; `flag` when back from repair twice (REPAIRS_BEFORE_LOWER_PRIORITY in
-- gpuledger/warehouse/cards.py, which builds the full card and checks it agrees with this view).
CREATE OR REPLACE VIEW gpu_cards AS
SELECT
    s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model, s.serial AS serial, s.board_part_number AS board_part_number,
    s.vbios_version AS vbios_version, s.first_seen AS first_seen, s.last_seen AS last_seen, s.nodes AS nodes,
    r.repairs AS repairs, if(r.repairs > 0, r.last_repaired, NULL) AS last_repaired,
    if(r.repairs >= 2, 'suggest lower-priority work', '') AS flag,
    d.down_seconds AS down_seconds, h.xid_errors AS xid_errors,
    h.avg_temperature_c AS avg_temperature_c, h.max_temperature_c AS max_temperature_c
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
    FROM gpu_sightings
    GROUP BY gpu_uuid
) AS s
LEFT JOIN
(
    SELECT gpu_uuid, count() AS repairs, fromUnixTimestamp64Milli(max(repaired_ms), 'UTC') AS last_repaired
    FROM gpu_repairs
    GROUP BY gpu_uuid
) AS r ON s.gpu_uuid = r.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(gpu_ms) / 1000 AS down_seconds
    FROM (SELECT gpu_uuid, gpu_ms FROM usage_raw WHERE state = 'down' LIMIT 1 BY cluster, record_id)
    GROUP BY gpu_uuid
) AS d ON s.gpu_uuid = d.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(xid_count) AS xid_errors, avgMerge(temperature_c) AS avg_temperature_c,
           maxMerge(max_temperature_c) AS max_temperature_c
    FROM gpu_health_hourly
    GROUP BY gpu_uuid
) AS h ON s.gpu_uuid = h.gpu_uuid;

-- The card's monthly figures: temperature, utilization, power and Xid errors per GPU and month.
CREATE OR REPLACE VIEW gpu_card_monthly AS
SELECT
    gpu_uuid, toStartOfMonth(day) AS month, argMax(toString(gpu_model), hour) AS gpu_model,
    avgMerge(temperature_c) AS avg_temperature_c, maxMerge(max_temperature_c) AS max_temperature_c,
    avgMerge(util_gpu_pct) AS avg_util_pct, avgMerge(power_w) AS avg_power_w, sum(xid_count) AS xid_errors
FROM gpu_health_hourly
GROUP BY gpu_uuid, month;
