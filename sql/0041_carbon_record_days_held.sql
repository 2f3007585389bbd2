-- A closed record day's carbon outlives its usage records (review finding; docs/carbon.md "Closed days").
-- carbon_record_days (0023) listed every day of a zone whose series has a value within an hour, open or
-- closed, and every carbon read (the bills and jobs reports, tenant_daily_carbon) took those days from
-- usage_raw record by record, never from closed_energy. Once usage retention dropped a closed day's
-- records (GPULEDGER_RETENTION_USAGE_DAYS is shorter than the bills'), or a sub-hour series was loaded
-- for days whose records had already gone, the day's carbon was gone too, although closed_energy still
-- held its energy. Now a closed day (committed closed_energy rows) is a record day only while usage_raw
-- still holds at least as many rows for it as closed_energy counted records; otherwise its carbon comes
-- from closed_energy per hour at the intensity valid at the hour's start, as on other closed days. A
-- plain count() of the day's rows reads only usage_raw's sort-key columns, and only for closed days of
-- such zones; copies not merged yet and other states' rows only count more, so the records expiring
-- (all of them, or the older part of a month while a later-written part waits) is what it sees. Every
-- reader of carbon_record_days (the reports through carbon.record_days, tenant_daily_carbon,
-- usage_by_job_hourly_exact_days) follows; open days are unchanged.

CREATE OR REPLACE VIEW carbon_record_days AS
WITH
    within_hour AS
    (
        SELECT DISTINCT c.cluster AS cluster, c.day AS day
        FROM usage_capacity_daily AS c
        CROSS JOIN carbon_definition_current AS d
        WHERE (if(mapContains(d.zones, toString(c.cluster)), d.zones[toString(c.cluster)], toString(c.cluster)), c.day) IN (
            SELECT zone, toDate(fromUnixTimestamp64Milli(valid_from_ms, 'UTC')) FROM carbon_intensity_current
            WHERE valid_from_ms % 3600000 != 0)
    ),
    closed AS
    (
        SELECT cluster, day, sum(records) AS records
        FROM closed_energy
        WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs)
          AND (cluster, day) IN (SELECT cluster, day FROM within_hour)
        GROUP BY cluster, day
    )
SELECT cluster, day
FROM within_hour
WHERE (cluster, day) NOT IN (
    SELECT e.cluster, e.day
    FROM closed AS e
    LEFT JOIN
    (
        SELECT cluster, day, count() AS held
        FROM usage_raw
        WHERE (cluster, day) IN (SELECT cluster, day FROM closed)
        GROUP BY cluster, day
    ) AS r ON e.cluster = r.cluster AND e.day = r.day
    WHERE r.held < e.records);
