"""The warehouse queries the periodic reports share: periods, tenant costs, top jobs, idle by queue,
stragglers and the period's data coverage. Numbers come from the same views as `gpuledger report`
(gpuledger.reports.fetch) and the dashboards (sql/0010_dashboards_tenant_access.sql), so the three agree."""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

from gpuledger.warehouse import reports as base
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.periodic.model import Coverage

LAYERS = ("scheduling_utilization", "execution_utilization", "hardware_utilization")


def query(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


def as_date(value: Any) -> dt.date:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    return dt.date.fromisoformat(str(value))


def last_day(client, database: str) -> dt.date | None:
    db = quoted_database(database)
    rows = client.query(f"SELECT max(day) AS d, count() AS n FROM {db}.usage_by_job_daily").result_rows
    return rows[0][0] if rows and rows[0][1] else None


def period_end(client, database: str, as_of: Any) -> dt.date:
    if as_of is not None:
        return as_date(as_of)
    return last_day(client, database) or dt.datetime.now(dt.timezone.utc).date()


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def total(rows: Sequence[dict], key: str) -> float:
    return float(sum(r.get(key) or 0 for r in rows))


def tenant_costs(client, database: str, start: dt.date, end: dt.date) -> list[dict]:
    out: dict[str, dict] = {}
    for r in base.fetch(client, database, "bills", day_from=start, day_to=end):
        t = out.setdefault(r["tenant"], {"tenant": r["tenant"], "compute_cost": 0.0, "idle_cost": 0.0,
                                          "failed_retry_cost": 0.0, "total_cost": 0.0, "effective_gpu_hours": 0.0})
        for k in ("compute_cost", "idle_cost", "failed_retry_cost", "total_cost"):
            t[k] += r[k]
        t["effective_gpu_hours"] += r["total_effective_gpu_hours"]
    rows = sorted(out.values(), key=lambda r: (-r["total_cost"], r["tenant"]))
    for r in rows:
        r["idle_share"] = r["idle_cost"] / r["total_cost"] if r["total_cost"] else None
    return rows


def top_jobs(client, database: str, start: dt.date, end: dt.date, top: int) -> list[dict]:
    cols = ("job_id", "tenant", "queue", "attempts", "failed_attempts", "gpu_hours", "effective_gpu_hours",
            "idle_gpu_hours", "cost")
    rows = base.fetch(client, database, "jobs", day_from=start, day_to=end, limit=top)
    return [{c: r[c] for c in cols} for r in rows]


#: a job's usage sums per cluster, job and definition version from usage_by_job_daily, as job_cost's
#: usage side adds them up (sql/0031), for the jobs whose usage reaches into [d0, d1]: job_cost's rows
#: of a period are these (a job with usage in it is one row of that side)
_PERIOD_USAGE = """
    SELECT cluster, job_id, definition_version, min(tenant) AS u_tenant, sum(gpu_ms) AS u_gpu_ms,
           sumIf(gpu_ms, state = 'allocated_idle') AS u_idle_gpu_ms, sum(cost_micros) AS u_cost_micros
    FROM {db}.usage_by_job_daily WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
    GROUP BY cluster, job_id, definition_version HAVING max(day) >= {{d0:Date}} AND min(day) <= {{d1:Date}}"""


def largest_jobs(client, database: str, start: dt.date, end: dt.date, top: int) -> list[dict]:
    """The `top` rows of job_cost by GPU-hours among the jobs with usage in [start, end]. Ranked from
    the usage sums first, then only those jobs' rows read from job_cost (a filter on job_id reaches its
    tables): 45,000 jobs' rows are not built to keep 10 (0.07 s against 0.15 s at 100 M records)."""
    db = quoted_database(database)
    p = {"d0": start, "d1": end, "top": top}
    order = "ORDER BY gpu_hours DESC, job_id, cluster, definition_version LIMIT {top:UInt32}"
    ids = [r[0] for r in client.query(f"""
        SELECT job_id, u_gpu_ms / 3600000 AS gpu_hours, cluster, definition_version
        FROM ({_PERIOD_USAGE.format(db=db)}) {order}""", parameters=p).result_rows]
    return query(client, f"""
        SELECT job_id, tenant, queue, attempts, gpu_hours, effective_gpu_hours, idle_gpu_hours, cost
        FROM {db}.job_cost WHERE job_id IN {{ids:Array(String)}} AND last_day >= {{d0:Date}} AND first_day <= {{d1:Date}}
        {order}""", {**p, "ids": ids})


def flagged_jobs(client, database: str, start: dt.date, end: dt.date, idle_share: float) -> list[dict]:
    """job_cost's rows (job_id, tenant, failed_attempts, cost, idle_gpu_hours, gpu_hours and share, the
    idle share) of the jobs with usage in [start, end] that had a failed attempt or were idle more than
    `idle_share` of their held GPU-time; joined from the usage side and the attempts side alone, as
    job_cost joins them (the tenant its attempts name, else its usage's), without its set of every job
    either side knows: 0.09 s against 0.14 s at 100 M records."""
    db = quoted_database(database)
    return query(client, f"""
        WITH u AS ({_PERIOD_USAGE.format(db=db)}),
        a AS (SELECT cluster, job_id, argMin(tenant, attempt) AS a_tenant, countIf(outcome = 'failed') AS failed_attempts
              FROM {db}.job_attempts GROUP BY cluster, job_id)
        SELECT job_id, if(a_tenant != '', a_tenant, u_tenant) AS tenant, failed_attempts, u_cost_micros / 1e6 AS cost,
               u_idle_gpu_ms / 3600000 AS idle_gpu_hours, u_gpu_ms / 3600000 AS gpu_hours,
               if(gpu_hours > 0, idle_gpu_hours / gpu_hours, 0) AS share
        FROM u LEFT JOIN a USING (cluster, job_id)
        WHERE failed_attempts > 0 OR (gpu_hours > 0 AND idle_gpu_hours / gpu_hours > {{share:Float64}})""",
                 {"d0": start, "d1": end, "share": idle_share})


def idle_by_queue(client, database: str, start: dt.date, end: dt.date) -> dict[str, dict]:
    db = quoted_database(database)
    rows = query(client, f"""
        SELECT queue, sum(idle_gpu_hours) AS idle_gpu_hours, sum(idle_cost) AS idle_cost
        FROM {db}.idle_waste_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} GROUP BY queue""",
              {"d0": start, "d1": end})
    return {r["queue"]: r for r in rows}


def followed_suggestions(client, database: str, start: dt.date, end: dt.date, within_s: float) -> list[dict]:
    """Jobs released on a reclaim suggestion (docs/alerts.md, "Followed suggestions"): every job a
    suggestion opened in [start, end] named that ended (completed, failed, preempted, cancelled)
    within `within_s` after it opened, with its GPUs, its execution rate then, when it ended, and what
    an idle GPU-hour of it cost (its idle cost / its idle GPU-hours, from usage)."""
    db = quoted_database(database)
    return query(client, f"""
        WITH named AS (
            SELECT cluster, queue, opened_at_ms, job_id, attempt, gpus_freed, rate
            FROM {db}.reclaim_suggestions FINAL
            ARRAY JOIN job_ids AS job_id, job_attempts AS attempt, job_gpus_freed AS gpus_freed,
                       job_execution_rates AS rate
            WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        ),
        ended AS (
            SELECT cluster, job_id, attempt, min(ts_ms) AS end_ms FROM {db}.job_events
            WHERE kind IN ('completed', 'failed', 'preempted', 'cancelled')
              AND (cluster, job_id) IN (SELECT cluster, job_id FROM named)
            GROUP BY cluster, job_id, attempt
        ),
        idle AS (
            SELECT cluster, job_id, attempt, sumIf(cost_micros, state = 'allocated_idle') AS idle_cost_micros,
                   sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms
            FROM {db}.usage_raw WHERE (cluster, job_id) IN (SELECT cluster, job_id FROM named)
            GROUP BY cluster, job_id, attempt
        )
        SELECT n.queue AS queue, n.job_id AS job_id, n.attempt AS attempt, n.opened_at_ms AS suggested_ms,
               e.end_ms AS released_ms, n.gpus_freed AS gpus_freed, n.rate AS execution_rate,
               if(ifNull(i.idle_gpu_ms, 0) = 0, 0, i.idle_cost_micros / 1e6 / (i.idle_gpu_ms / 3600000)) AS idle_cost_per_gpu_hour
        FROM named AS n
        INNER JOIN ended AS e ON e.cluster = n.cluster AND e.job_id = n.job_id AND e.attempt = n.attempt
        LEFT JOIN idle AS i ON i.cluster = n.cluster AND i.job_id = n.job_id AND i.attempt = n.attempt
        WHERE e.end_ms >= n.opened_at_ms AND e.end_ms <= n.opened_at_ms + {{within:Int64}}
        ORDER BY suggested_ms, queue, job_id, attempt""", {"d0": start, "d1": end, "within": int(within_s * 1000)})


def stragglers(client, database: str, *, job_id: str | None = None, start: dt.date | None = None,
                end: dt.date | None = None, ratio: float = 0.8) -> list[dict]:
    """GPUs of multi-GPU attempts whose utilization is under `ratio` x the attempt's median. Read from
    job_gpu_usage grouped once per attempt and GPU (the columns of job_gpu_balance this needs), each
    attempt's GPUs then in one array: no window functions over every attempt of the period (weekly
    report at 100 M records: 0.18 s against 0.32 s through the view)."""
    db = quoted_database(database)
    where, having, p = [], ["u > 0"], {"ratio": ratio}
    if job_id is not None:
        where.append("job_id = {job:String}")
        p["job"] = job_id
    if start is not None:  # the attempt's GPU-time reaches into the period: it ends on or after its first day
        having.append("l >= toUnixTimestamp64Milli(toDateTime64({d0:Date}, 3, 'UTC'))")
        p["d0"] = start
    if end is not None:  # ... and starts before the day after its last
        having.append("f < toUnixTimestamp64Milli(toDateTime64({d1:Date} + 1, 3, 'UTC'))")
        p["d1"] = end
    return query(client, f"""
        SELECT job_id, attempt, g.1 AS gpu, g.2 AS util_pct, median_pct FROM
        (
            SELECT cluster, job_id, attempt, median(w / u) AS median_pct, count() AS gpus,
                   groupArray((concat(toString(node), '/', substring(gpu_uuid, 5, 8)), w / u)) AS per_gpu
            FROM
            (
                SELECT cluster, job_id, attempt, node, gpu_uuid,
                       sumIf(util_weighted_gpu_ms, state = 'executing') AS w, sumIf(util_gpu_ms, state = 'executing') AS u,
                       min(first_start_ms) AS f, max(last_end_ms) AS l
                FROM {db}.job_gpu_usage {('WHERE ' + ' AND '.join(where)) if where else ''}
                GROUP BY cluster, job_id, attempt, node, gpu_uuid
                HAVING {' AND '.join(having)}
            )
            GROUP BY cluster, job_id, attempt HAVING gpus > 1
        )
        ARRAY JOIN per_gpu AS g
        WHERE g.2 < median_pct * {{ratio:Float64}}
        ORDER BY job_id, attempt, util_pct""", p)


def balance_score(utils: Sequence[float]) -> float | None:
    """Mean over max of the per-GPU utilizations: 1.0 when every GPU works equally hard."""
    vals = [u for u in utils if u is not None]
    if not vals or max(vals) <= 0:
        return None
    return sum(vals) / len(vals) / max(vals)


def coverage(client, database: str, start: dt.date, end: dt.date) -> Coverage:
    """The span of usage in the period's days: what a "monthly" report built from six hours is built from."""
    db = quoted_database(database)
    days = (end - start).days + 1
    # the first and last day with usage from the daily sums (sql/0030), then only those days' records:
    # a record's day is its start's, and one that ends past midnight ends on the next day
    (d0, d1, n, latest), = client.query(
        f"SELECT minIf(day, day BETWEEN {{d0:Date}} AND {{d1:Date}}), maxIf(day, day BETWEEN {{d0:Date}} AND {{d1:Date}}), "
        f"countIf(day BETWEEN {{d0:Date}} AND {{d1:Date}}), max(day) FROM {db}.usage_gpu_daily",
        parameters={"d0": start, "d1": end}).result_rows
    if not n:
        return Coverage(days, None, None)
    # the first record starts in the first hour of its day with usage (usage_gpu_hourly, where it still
    # holds that day): only that hour's records are read
    (hours, until), = client.query(f"SELECT count(), (toInt64(toUnixTimestamp(min(hour))) + 3600) * 1000 "
                                   f"FROM {db}.usage_gpu_hourly WHERE day = {{d0:Date}}", parameters={"d0": d0}).result_rows
    within = " AND start_ms < {until:Int64}" if hours else ""
    (first,), = client.query(f"SELECT min(start_ms) FROM {db}.usage_raw WHERE day = {{d0:Date}}{within}",
                             parameters={"d0": d0, "until": until}).result_rows
    if latest == d1:  # no usage after the period: its last end is the fleet's latest (gpu_latest, per GPU)
        (last,), = client.query(f"SELECT max(last_end_ms) FROM {db}.gpu_latest").result_rows
    else:
        (last,), = client.query(f"SELECT max(end_ms) FROM {db}.usage_raw WHERE day IN ({{d1:Date}}, {{before:Date}})",
                                parameters={"d1": d1, "before": max(d0, d1 - dt.timedelta(days=1))}).result_rows
    return Coverage(days, first, last)
