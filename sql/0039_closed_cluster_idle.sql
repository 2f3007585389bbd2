-- Cluster idle of closed days (review finding: `report bills --idle-redistribution even|usage` read the
-- cluster idle it shares live from usage_capacity_daily, a summing aggregate that keeps every stored copy
-- of a record: a record stored twice doubled a closed day's cluster idle, and a late unallocated record
-- changed a closed bill without a word). Now:
--  * the bill close (gpuledger/warehouse/bills.py) writes, for each day it closes, each cluster's
--    unallocated GPU-time and cost per definition version, each record once (read as the close reads
--    the jobs' usage), under its bill run: booked_day = corrects_day = the day;
--  * its adjustment pass compares the closed days of its look-back window with their unallocated usage
--    now and books the difference on the cluster's next open day (booked_day), naming the day it
--    corrects (corrects_day), as it books the jobs' late usage in bill_adjustments;
--  * the report shares, on each day, the rows booked on it (committed runs only), plus on an open day
--    its live unallocated usage, each record once. A closed day's figure never changes.
-- The back-fill below writes the cluster idle of the days already closed, under the run id 'sql/0039',
-- and commits it with a bill_runs row of that id (data first, the run's row last, as a close run does).
-- It skips days that already have rows, so a file interrupted after it is safe to run again. (No aliases
-- on the inserted values: an alias named like a column would stand for it in WHERE.)

CREATE TABLE IF NOT EXISTS closed_cluster_idle
(
    booked_day          Date,
    corrects_day        Date,
    cluster             LowCardinality(String),
    definition_version  LowCardinality(String),
    gpu_ms              Int64,
    cost_micros         Int128,
    bill_run_id         String,
    closed_at           DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(booked_day)
ORDER BY (cluster, booked_day, corrects_day, definition_version);

INSERT INTO closed_cluster_idle (booked_day, corrects_day, cluster, definition_version, gpu_ms, cost_micros, bill_run_id)
SELECT day, day, cluster, definition_version, toInt64(sum(gpu_ms)), sum(toInt128(cost_micros)), 'sql/0039'
FROM usage_raw FINAL
WHERE state = 'unallocated'
  AND (cluster, day) IN (SELECT cluster, day FROM closed_days WHERE bill_run_id IN (SELECT bill_run_id FROM bill_runs))
  AND (cluster, day) NOT IN (SELECT cluster, corrects_day FROM closed_cluster_idle)
GROUP BY day, cluster, definition_version;

INSERT INTO bill_runs (bill_run_id, days, clusters, definition_version, grace_s, horizons, closed_rows, adjustment_rows)
SELECT 'sql/0039', arraySort(groupUniqArray(booked_day)), arraySort(groupUniqArray(toString(cluster))), '', 0, map(), 0, 0
FROM closed_cluster_idle
WHERE bill_run_id = 'sql/0039' AND 'sql/0039' NOT IN (SELECT bill_run_id FROM bill_runs)
HAVING count() > 0;
