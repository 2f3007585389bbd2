-- The carbon view's open days from the hourly usage table (issue #13 point 3; sql/0027). The cockpit's
-- "carbon by tenant" chart read the open day's 13.5 M records with FINAL and grouped them per hour
-- (0.8-1.0 s on 2 cores). Open days where usage_by_job_hourly is exact now come from it.

-- The open days (not closed for their cluster) where usage_by_job_hourly is exact: it counted as many
-- records as usage_raw holds distinct ones (FINAL), so no record was inserted twice. Days worked out
-- record by record for carbon (carbon_record_days) are left out: their carbon needs each record's
-- start. (gpuledger/warehouse/bills.py exact_hourly_days is the same check for days a report names.)
CREATE OR REPLACE VIEW usage_by_job_hourly_exact_days AS
SELECT a.cluster AS cluster, a.day AS day
FROM
(
    SELECT cluster, day, sum(records) AS n
    FROM usage_by_job_hourly
    WHERE (cluster, day) IN (SELECT DISTINCT cluster, day FROM usage_capacity_daily
                             WHERE (cluster, day) NOT IN (SELECT cluster, day FROM closed_days
                                                          WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
                               AND (cluster, day) NOT IN (SELECT cluster, day FROM carbon_record_days))
    GROUP BY cluster, day
) AS a
INNER JOIN
(
    -- only the dates in the filter: a (cluster, day) pair looked up per record cost 0.3 s more a day
    SELECT cluster, day, count() AS n
    FROM usage_raw FINAL
    WHERE day IN (SELECT DISTINCT day FROM usage_capacity_daily
                  WHERE (cluster, day) NOT IN (SELECT cluster, day FROM closed_days
                                               WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs)))
    GROUP BY cluster, day
) AS r ON a.cluster = r.cluster AND a.day = r.day
WHERE a.n = r.n;

-- As sql/0023, with the open days split: exact ones from usage_by_job_hourly per hour, the others (a
-- record written twice, records gone from usage_raw) from usage_raw, each record id once, per hour. The
-- exact days are a scalar, worked out once for both parts (as an IN subquery in each, twice).
CREATE OR REPLACE VIEW tenant_daily_carbon AS
WITH (SELECT groupArray((toString(cluster), day)) FROM usage_by_job_hourly_exact_days) AS exact_days
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
        SELECT h.day AS day, toString(h.cluster) AS cluster, toString(h.tenant) AS tenant,
               toString(h.definition_version) AS definition_version, h.hour * 3600000 AS start_ms,
               sum(h.energy_j) AS energy_j
        FROM usage_by_job_hourly AS h
        WHERE h.job_id != '' AND h.state IN ('executing', 'allocated_idle')
          AND has(exact_days, (toString(h.cluster), h.day))
        GROUP BY h.day, h.cluster, h.tenant, h.definition_version, h.hour
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
                                                                   WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
                                        AND NOT has(exact_days, (toString(cluster), day)))
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
