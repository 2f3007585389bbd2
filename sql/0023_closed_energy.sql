-- Energy of closed days, for carbon (issue #13 point 3; docs/carbon.md "Closed days").
-- A carbon figure is energy x PUE x the grid intensity valid at the usage record's start. Computed from
-- usage_raw over every day a report covers, it read every record of every day with FINAL and joined each
-- to the intensity series (16-19 s for a week's bills at 100 M records). Now:
--  * the bill close (gpuledger/warehouse/bills.py) writes, for each day it closes, the deduplicated energy
--    of the jobs' usage (executing, allocated idle) per hour, attempt and state into closed_energy, under
--    its bill run; its adjustment pass writes the difference late records make to a closed day in its
--    look-back window, under the run that finds them, with the same keys (the day corrected);
--  * energy is kept in whole millijoules (each record's energy_j rounded, then summed), so a recomputed
--    day compares exactly equal and running the close again writes nothing;
--  * the carbon definition (PUE, zones) and the intensity series are applied when a figure is read, as
--    before: a new definition or a corrected series changes closed days' carbon too;
--  * energy is summed per hour before the intensity is joined (open days too): every record of an hour
--    takes the value valid at its start, the same as the hour's start wherever the zone's series changes
--    only on the hour. Days of a zone whose series has a value within an hour are worked out record by
--    record from usage_raw (carbon_record_days).
-- The back-fill below writes the energy of the days already closed, under the run id 'sql/0023', and
-- commits it with a bill_runs row of that id (data first, the run's row last, as a close run does). It
-- skips days that already have energy rows, so a file interrupted after it is safe to run again. (No
-- aliases on the inserted values: an alias named like a column would stand for it in WHERE.)

CREATE TABLE IF NOT EXISTS closed_energy
(
    day                 Date,
    cluster             LowCardinality(String),
    hour                Int64,
    tenant              LowCardinality(String),
    queue               LowCardinality(String),
    job_id              String,
    attempt             UInt32,
    definition_version  LowCardinality(String),
    state               LowCardinality(String),
    energy_mj           Int64,
    records             Int64,
    bill_run_id         String,
    closed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, day, tenant, job_id, attempt, hour, state, definition_version);

INSERT INTO closed_energy (day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state, energy_mj, records, bill_run_id)
SELECT day, cluster, intDiv(start_ms, 3600000) AS hour, tenant, queue, job_id, attempt, definition_version, state,
       sum(toInt64(round(energy_j * 1000))), toInt64(count()), 'sql/0023'
FROM usage_raw FINAL
WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
  AND (cluster, day) IN (SELECT cluster, day FROM closed_days WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
  AND (cluster, day) NOT IN (SELECT cluster, day FROM closed_energy)
GROUP BY day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state;

INSERT INTO bill_runs (bill_run_id, days, clusters, definition_version, grace_s, horizons, closed_rows, adjustment_rows)
SELECT 'sql/0023', arraySort(groupUniqArray(day)), arraySort(groupUniqArray(toString(cluster))), '', 0, map(), 0, 0
FROM closed_days
WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs) AND 'sql/0023' NOT IN (SELECT bill_run_id FROM bill_runs)
HAVING count() > 0;

-- The (cluster, day) pairs whose carbon is worked out record by record: days of a zone whose intensity
-- series has a value starting within an hour on that day. Every other day's energy is summed per hour
-- first (closed days: closed_energy; open days: usage_raw) and takes the intensity valid at the hour's
-- start, which every record of the hour also takes. Empty while no carbon definition is recorded.
CREATE OR REPLACE VIEW carbon_record_days AS
SELECT DISTINCT c.cluster AS cluster, c.day AS day
FROM usage_capacity_daily AS c
CROSS JOIN carbon_definition_current AS d
WHERE (if(mapContains(d.zones, toString(c.cluster)), d.zones[toString(c.cluster)], toString(c.cluster)), c.day) IN (
    SELECT zone, toDate(fromUnixTimestamp64Milli(valid_from_ms, 'UTC')) FROM carbon_intensity_current
    WHERE valid_from_ms % 3600000 != 0);

-- Carbon of every usage record, each record id once (FINAL of sql/0022 instead of LIMIT 1 BY).
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
    FROM (SELECT * FROM usage_raw FINAL) AS u
    CROSS JOIN carbon_definition_current AS d
) AS x
ASOF LEFT JOIN
(
    SELECT zone, valid_from_ms, gco2e_per_kwh, toUInt8(1) AS found FROM carbon_intensity_current
) AS ci
ON x.zone = ci.zone AND x.start_ms >= ci.valid_from_ms;

-- Carbon of tenants' jobs per UTC day (same columns as in sql/0020): closed days from closed_energy per
-- hour (committed runs); open days from usage_raw, each record id once, per hour; the days of
-- carbon_record_days from usage_raw record by record. The bills and jobs reports build the same figures
-- (gpuledger/warehouse/reports.py with carbon.py's pieces) with their filters applied to every part.
CREATE OR REPLACE VIEW tenant_daily_carbon AS
SELECT
    x.day AS day, x.cluster AS cluster, x.tenant AS tenant, x.definition_version AS definition_version,
    x.carbon_version AS carbon_version,
    sum(x.energy_j) / 3600000 AS energy_kwh,
    sum(x.energy_j * x.pue) / 3600000 AS facility_energy_kwh,
    sum(x.energy_j / 3600000 * x.pue * if(ci.found = 1, ci.gco2e_per_kwh, x.default_gco2e_per_kwh)) / 1000 AS co2e_kg
FROM
(
    SELECT
        u.day AS day, u.cluster AS cluster, u.tenant AS tenant, u.definition_version AS definition_version,
        u.start_ms AS start_ms, u.energy_j AS energy_j,
        d.carbon_version AS carbon_version, d.pue AS pue, d.default_gco2e_per_kwh AS default_gco2e_per_kwh,
        if(mapContains(d.zones, u.cluster), d.zones[u.cluster], u.cluster) AS zone
    FROM
    (
        SELECT e.day AS day, toString(e.cluster) AS cluster, toString(e.tenant) AS tenant,
               toString(e.definition_version) AS definition_version, e.hour * 3600000 AS start_ms,
               sum(e.energy_mj) / 1000 AS energy_j
        FROM closed_energy AS e
        WHERE e.bill_run_id IN (SELECT bill_run_id FROM bill_runs)
          AND (e.cluster, e.day) NOT IN (SELECT cluster, day FROM carbon_record_days)
        GROUP BY e.day, e.cluster, e.tenant, e.definition_version, e.hour
        UNION ALL
        SELECT r.day AS day, toString(r.cluster) AS cluster, toString(r.tenant) AS tenant,
               toString(r.definition_version) AS definition_version,
               if((r.cluster, r.day) IN (SELECT cluster, day FROM carbon_record_days), r.start_ms,
                  intDiv(r.start_ms, 3600000) * 3600000) AS bucket_ms,
               sum(r.energy_j) AS energy_j
        FROM usage_raw AS r FINAL
        WHERE r.job_id != '' AND r.state IN ('executing', 'allocated_idle')
          AND ((r.cluster, r.day) IN (SELECT DISTINCT cluster, day FROM usage_capacity_daily
                                      WHERE (cluster, day) NOT IN (SELECT cluster, day FROM closed_days
                                                                   WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs)))
               OR (r.cluster, r.day) IN (SELECT cluster, day FROM carbon_record_days))
        GROUP BY r.day, r.cluster, r.tenant, r.definition_version, bucket_ms
    ) AS u
    CROSS JOIN carbon_definition_current AS d
) AS x
ASOF LEFT JOIN
(
    SELECT zone, valid_from_ms, gco2e_per_kwh, toUInt8(1) AS found FROM carbon_intensity_current
) AS ci
ON x.zone = ci.zone AND x.start_ms >= ci.valid_from_ms
GROUP BY day, cluster, tenant, definition_version, carbon_version;
