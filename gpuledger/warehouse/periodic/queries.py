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


#: a job's usage sums per cluster, job and definition version from usage_by_job_daily, as job_cost's
#: usage side adds them up (sql/0031), for the jobs whose usage reaches into [d0, d1]: job_cost's rows
#: of a period are these (a job with usage in it is one row of that side)
_PERIOD_USAGE = """
    SELECT cluster, job_id, definition_version, min(tenant) AS u_tenant, min(queue) AS u_queue,
           uniqExact(attempt) AS u_attempts, sum(gpu_ms) AS u_gpu_ms,
           sumIf(gpu_ms, state = 'allocated_idle') AS u_idle_gpu_ms, sum(effective_gpu_ms) AS u_effective_gpu_ms,
           sum(cost_micros) AS u_cost_micros
    FROM {db}.usage_by_job_daily WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
    GROUP BY cluster, job_id, definition_version HAVING max(day) >= {{d0:Date}} AND min(day) <= {{d1:Date}}"""

#: the columns of the periodic reports' job rows (the jobs report's, `gpuledger report jobs`)
TOP_JOB_COLUMNS = ("job_id", "tenant", "queue", "attempts", "failed_attempts", "gpu_hours", "effective_gpu_hours",
                   "idle_gpu_hours", "cost")


def period_jobs(client, database: str, start: dt.date, end: dt.date, top: int,
                idle_share: float | None = None) -> tuple[list[dict], list[dict]]:
    """The jobs with usage in [start, end], read once for two sections:
    - the first `top` rows of the jobs report over the period (reports.fetch "jobs" with day_from, day_to
      and limit: its order, its money of closed and open days), TOP_JOB_COLUMNS of them;
    - with `idle_share`, job_cost's rows (job_id, tenant, failed_attempts, and cost, gpu_hours,
      idle_gpu_hours and share from the job's usage sums) of the jobs that had a failed attempt or were
      idle more than `idle_share` of their held GPU-time.
    Joined from job_cost's usage side (the period's jobs), its attempts side and the money, as job_cost
    and the jobs report join them, without job_cost's set of every job either side knows; one query
    where the weekly report made three (0.2 s against 0.35 s at 100 M records)."""
    db = quoted_database(database)
    money, params = base.job_money_sql(client, db, "1", carbon_too=False)
    fallback = {"gpu_hours": "u_gpu_ms / 3600000", "idle_gpu_hours": "u_idle_gpu_ms / 3600000",
                "effective_gpu_hours": "u_effective_gpu_ms / 3600000", "cost": "u_cost_micros / 1e6"}
    money_columns = ", ".join(f"if(m.money = 1, {base.JOB_MONEY_COLUMNS[col]}, {expr}) AS {col}"
                              for col, expr in fallback.items())
    # the flagged condition is stated here only: the query marks the rows, Python keeps the marked ones
    flagged = "failed_attempts > 0 OR idle_share > {share:Float64}" if idle_share is not None else "0"
    rows = query(client, f"""
        WITH u AS ({_PERIOD_USAGE.format(db=db)}),
        a AS (SELECT cluster, job_id, argMin(tenant, attempt) AS a_tenant, argMin(queue, attempt) AS a_queue,
                     count() AS a_attempts, countIf(outcome = 'failed') AS failed_attempts
              FROM {db}.job_attempts GROUP BY cluster, job_id)
        SELECT *, {flagged} AS is_flagged FROM (
            SELECT *, row_number() OVER (ORDER BY {base.JOBS_ORDER}) AS rank,
                   if(usage_gpu_hours > 0, usage_idle_gpu_hours / usage_gpu_hours, 0.) AS idle_share FROM (
                SELECT toString(u.cluster) AS cluster, u.job_id AS job_id,
                       toString(u.definition_version) AS definition_version,
                       if(a_tenant != '', a_tenant, u_tenant) AS tenant, if(a_queue != '', a_queue, u_queue) AS queue,
                       greatest(a_attempts, u_attempts) AS attempts, failed_attempts, {money_columns},
                       u_gpu_ms / 3600000 AS usage_gpu_hours, u_idle_gpu_ms / 3600000 AS usage_idle_gpu_hours,
                       u_cost_micros / 1e6 AS usage_cost
                FROM u LEFT JOIN a USING (cluster, job_id)
                LEFT JOIN ({money}) AS m
                  ON u.cluster = m.cluster AND u.job_id = m.job_id AND u.definition_version = m.definition_version))
        WHERE rank <= {{top:UInt64}} OR is_flagged
        ORDER BY rank""", {**params, "d0": start, "d1": end, "top": top, "share": idle_share or 0.0})
    first = [{c: r[c] for c in TOP_JOB_COLUMNS} for r in rows if r["rank"] <= top]
    marked = [{"job_id": r["job_id"], "tenant": r["tenant"], "failed_attempts": r["failed_attempts"],
               "cost": r["usage_cost"], "idle_gpu_hours": r["usage_idle_gpu_hours"], "gpu_hours": r["usage_gpu_hours"],
               "share": r["idle_share"]}
              for r in rows if r["is_flagged"]]
    return first, marked


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
    job_gpu_usage grouped once per attempt and GPU (the columns of job_gpu_balance this needs), by the
    64-bit keys of sql/0032 rather than five columns, each attempt's GPUs then in one array: no window
    functions over every attempt of the period; the names of the few GPUs found are read after (weekly
    report at 100 M records: ~0.08 s against 0.18-0.24 s by the columns, 0.32 s through the view)."""
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
    found = client.query(f"""
        SELECT g.1 AS gpu_key, g.2 AS util_pct, median_pct FROM
        (
            SELECT attempt_key, median(w / u) AS median_pct, count() AS gpus, groupArray((gpu_key, w / u)) AS per_gpu
            FROM
            (
                SELECT gpu_key, any(attempt_key) AS attempt_key,
                       sumIf(util_weighted_gpu_ms, state = 'executing') AS w, sumIf(util_gpu_ms, state = 'executing') AS u,
                       min(first_start_ms) AS f, max(last_end_ms) AS l
                FROM {db}.job_gpu_usage {('WHERE ' + ' AND '.join(where)) if where else ''}
                GROUP BY gpu_key
                HAVING {' AND '.join(having)}
            )
            GROUP BY attempt_key HAVING gpus > 1
        )
        ARRAY JOIN per_gpu AS g
        WHERE g.2 < median_pct * {{ratio:Float64}}""", parameters=p).result_rows
    if not found:
        return []
    names = {key: (job, attempt, gpu) for key, job, attempt, gpu in client.query(f"""
        SELECT DISTINCT gpu_key, job_id, attempt, concat(toString(node), '/', substring(gpu_uuid, 5, 8))
        FROM {db}.job_gpu_usage WHERE gpu_key IN {{keys:Array(UInt64)}}""",
        parameters={"keys": sorted({key for key, _, _ in found})}).result_rows}
    rows = [{"job_id": names[key][0], "attempt": names[key][1], "gpu": names[key][2], "util_pct": util,
             "median_pct": median} for key, util, median in found]
    return sorted(rows, key=lambda r: (r["job_id"], r["attempt"], r["util_pct"]))


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
