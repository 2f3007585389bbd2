-- The cockpit's hardware utilization follows the agreed definition (docs/accounting.md §2; review
-- finding: under aggregation = "above_threshold" the cockpit said 0.65 where `report utilization` said 0.5).
-- utilization_hourly (sql/0018) read usage_gpu_hourly, whose view weighted the measured util_pct: the
-- time-weighted mean busy whatever the definition. The reports weight util_metric_pct (100 or 0 per record
-- under above_threshold), which usage_gpu_hourly did not keep.
--  * usage_gpu_hourly gets util_metric_weighted_gpu_ms and util_metric_gpu_ms (Σ util_metric_pct × gpu_ms
--    and the gpu_ms of records that have one), filled by its view from now on (MODIFY QUERY swaps the
--    query atomically: no insert is missed). util_weighted_gpu_ms / util_gpu_ms stay the measured mean.
--  * utilization_hourly reads the new columns under its old names, so its util_weighted_gpu_ms /
--    util_gpu_ms (and the bundle's hardware_utilization) is the definition's layer, as the report's.
--  * the hours usage_gpu_hourly holds are back-filled from usage_raw: rows carrying only the new sums
--    (every other sum 0), which the SummingMergeTree folds into the hour's row. Only while no row has
--    the new sums yet, so a file run again adds nothing; apply it with the sinks stopped, like 0018.
--    Hours whose records usage_raw no longer holds (usage retention shorter than the hourly one) keep
--    0 and read no hardware utilization rather than the measured mean.

ALTER TABLE usage_gpu_hourly ADD COLUMN IF NOT EXISTS util_metric_weighted_gpu_ms Float64 DEFAULT 0;
ALTER TABLE usage_gpu_hourly ADD COLUMN IF NOT EXISTS util_metric_gpu_ms UInt64 DEFAULT 0;

ALTER TABLE usage_gpu_hourly_mv MODIFY QUERY
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model, state,
    sum(usage_raw.gpu_ms) AS gpu_ms,
    sum(usage_raw.effective_gpu_ms) AS effective_gpu_ms,
    sum(toInt128(usage_raw.cost_micros)) AS cost_micros,
    sum(if(util_pct IS NULL, 0., assumeNotNull(util_pct) * usage_raw.gpu_ms)) AS util_weighted_gpu_ms,
    sum(if(util_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_gpu_ms,
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)) AS util_metric_weighted_gpu_ms,
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms)) AS util_metric_gpu_ms
FROM usage_raw
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model, state;

INSERT INTO usage_gpu_hourly
    (hour, day, cluster, node, gpu_uuid, gpu_model, state, gpu_ms, effective_gpu_ms, cost_micros,
     util_weighted_gpu_ms, util_gpu_ms, util_metric_weighted_gpu_ms, util_metric_gpu_ms)
SELECT
    toStartOfHour(fromUnixTimestamp64Milli(start_ms, 'UTC')) AS hour,
    day, cluster, node, gpu_uuid, gpu_model, state,
    toUInt64(0), toUInt64(0), toInt128(0), 0., toUInt64(0),
    sum(if(util_metric_pct IS NULL, 0., assumeNotNull(util_metric_pct) * usage_raw.gpu_ms)),
    sum(if(util_metric_pct IS NULL, toUInt64(0), usage_raw.gpu_ms))
FROM usage_raw
WHERE (SELECT count() FROM usage_gpu_hourly WHERE util_metric_gpu_ms > 0) = 0
    AND day >= (SELECT min(day) FROM usage_gpu_hourly)
GROUP BY hour, day, cluster, node, gpu_uuid, gpu_model, state;

CREATE OR REPLACE VIEW utilization_hourly AS
SELECT
    hour, day, cluster, gpu_model,
    sum(gpu_ms) AS capacity_gpu_ms,
    sumIf(gpu_ms, state = 'down') AS down_gpu_ms,
    sumIf(gpu_ms, state = 'unallocated') AS unallocated_gpu_ms,
    sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS allocated_gpu_ms,
    sumIf(gpu_ms, state = 'executing') AS executing_gpu_ms,
    sumIf(effective_gpu_ms, state = 'executing') AS executing_effective_gpu_ms,
    sumIf(util_metric_weighted_gpu_ms, state = 'executing') AS util_weighted_gpu_ms,
    sumIf(util_metric_gpu_ms, state = 'executing') AS util_gpu_ms,
    toFloat64(sumIf(cost_micros, state = 'unallocated')) / 1e6 AS unallocated_cost
FROM usage_gpu_hourly
GROUP BY hour, day, cluster, gpu_model;
