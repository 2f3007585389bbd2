"""The warehouse queries the periodic reports share: periods, tenant costs, top jobs, reclaim savings,
stragglers and the period's data coverage. Numbers come from the same views as `gpuledger report`
(gpuledger.reports.fetch) and the dashboards (sql/0010_dashboards_tenant_access.sql), so the three agree.

Why one file: every query here serves two or more of the reports (builders.py), and their periods'
bounds (FIRST_DAY .. LAST_DAY) are checked where the periods are made."""

from __future__ import annotations

import datetime as dt
from typing import Any, Sequence

from gpuledger.warehouse import reports as base
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.periodic.model import Coverage

LAYERS = ("scheduling_utilization", "execution_utilization", "hardware_utilization")


def query(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


#: the days a ClickHouse Date holds: a day outside reads as the nearest of them (clamped), so a period
#: reaching outside is refused rather than reported from other days
FIRST_DAY, LAST_DAY = dt.date(1970, 1, 1), dt.date(2149, 6, 6)


def as_date(value: Any) -> dt.date:
    if isinstance(value, dt.datetime):
        day = value.date()
    elif isinstance(value, dt.date):
        day = value
    else:
        try:
            day = dt.date.fromisoformat(str(value))
        except ValueError:  # the flag named: a bare "day is out of range for month" says not which option
            raise ValueError(f"as_of (--as-of) must be a UTC day YYYY-MM-DD, got {value!r}") from None
    if not FIRST_DAY <= day <= LAST_DAY:
        raise ValueError(f"as_of (--as-of) must be a UTC day from {FIRST_DAY} to {LAST_DAY}, got {str(value)!r}")
    return day


def period_start(end: dt.date, days: int) -> dt.date:
    """The first day of the `days` days ending on `end`; refused where it would be before FIRST_DAY
    (a ClickHouse Date clamps it; far enough back, date arithmetic overflows)."""
    most = (end - FIRST_DAY).days + 1
    if days > most:
        raise ValueError(f"the {days:,}-day period ending {end} would start before {FIRST_DAY}, the first day the "
                         f"warehouse holds: at most {most:,} days end on {end}")
    return end - dt.timedelta(days=days - 1)


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


def currencies(rows: Sequence[dict]) -> list[str]:
    """The currencies of rows' money (their `currency`), sorted."""
    return sorted({r["currency"] for r in rows})


def fill_unknown_currency(rows: list[dict], currencies_known: set[str] | None = None) -> list[dict]:
    """Rows whose currency is unknown ('': a version with none recorded, and no ledger currency given)
    in the one currency the others have (or `currencies_known` holds, where rows are a part of them): a
    closed row carries the currency it was closed in, the open days' rows of the same version none; with
    several known currencies they stay unknown."""
    known = ({r["currency"] for r in rows} if currencies_known is None else set(currencies_known)) - {""}
    if len(known) == 1:
        only = known.pop()
        for r in rows:
            r["currency"] = r["currency"] or only
    return rows


def money_total(rows: Sequence[dict], key: str) -> float | str:
    """The sum of a money column: a number in one currency; in several, one sum per currency as text
    ("0.06 EUR; 0.06 USD"), as sums of different currencies mean nothing."""
    found = currencies(rows)
    if len(found) <= 1:
        return total(rows, key)
    return "; ".join(f"{total([r for r in rows if r['currency'] == c], key):,.2f} {c}" for c in found)


def tenant_costs(client, database: str, start: dt.date, end: dt.date, *, idle_redistribution: str | None = None,
                 ledger_idle_redistribution: str = "none", currency: str = "") -> list[dict]:
    """The bills report over [start, end] per tenant and currency (never adding two currencies), with
    the cluster idle shared as `report bills` shares it: each definition version's as its recorded
    [idle] policy says (`ledger_idle_redistribution` for a version with none recorded), every row's as
    `idle_redistribution` says where given; cluster_idle_cost and billed_total_cost where a row shares
    it. `currency`: the ledger's, for versions with none recorded."""
    base.check_idle_policies(("idle_redistribution (--idle-redistribution)", idle_redistribution),
                             ("ledger_idle_redistribution", ledger_idle_redistribution))
    bills = fill_unknown_currency(base.fetch(client, database, "bills", day_from=start, day_to=end,
                                             idle_redistribution=idle_redistribution or None,
                                             ledger_idle_redistribution=ledger_idle_redistribution or "none",
                                             **({"currency": currency} if currency else {})))
    shared = any("cluster_idle_cost" in r for r in bills)
    money = ["compute_cost", "idle_cost", "failed_retry_cost", "total_cost"] + (
        ["cluster_idle_cost", "billed_total_cost"] if shared else [])
    out: dict[tuple[str, str], dict] = {}
    for r in bills:
        t = out.setdefault((r["tenant"], r["currency"]), {"tenant": r["tenant"], "currency": r["currency"],
                                                          **dict.fromkeys(money, 0.0), "effective_gpu_hours": 0.0})
        for k in money[:4]:
            t[k] += r[k]
        if shared:  # adjustment rows take no share (the bills report gives them none)
            t["cluster_idle_cost"] += r.get("cluster_idle_cost") or 0.0
            t["billed_total_cost"] += r.get("billed_total_cost", r["total_cost"])
        t["effective_gpu_hours"] += r["total_effective_gpu_hours"]
    rank = "billed_total_cost" if shared else "total_cost"
    rows = sorted(out.values(), key=lambda r: (-r[rank], r["tenant"], r["currency"]))
    for r in rows:
        r["idle_share"] = r["idle_cost"] / r["total_cost"] if r["total_cost"] else None
    return rows


def fleet_layers(client, database: str, start: dt.date, end: dt.date) -> dict[str, float | None]:
    """The three utilization layers of the whole fleet over [start, end] (every cluster together), as
    the utilization report defines them (reports._utilization), which groups by at least one column."""
    db = quoted_database(database)
    (cap, down, alloc, execu, weighted, sampled), = client.query(f"""
        SELECT sum(gpu_ms), sumIf(gpu_ms, state = 'down'), sumIf(gpu_ms, state IN ('allocated_idle', 'executing')),
               sumIf(gpu_ms, state = 'executing'), sumIf(util_weighted_gpu_ms, state = 'executing'),
               sumIf(util_gpu_ms, state = 'executing')
        FROM {db}.usage_by_job_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}""",
        parameters={"d0": start, "d1": end}).result_rows
    return {"scheduling_utilization": alloc / (cap - down) if cap - down > 0 else None,
            "execution_utilization": execu / alloc if alloc else None,
            "hardware_utilization": weighted / sampled / 100 if sampled else None}


#: the columns of the periodic reports' job rows (the jobs report's, `gpuledger report jobs`); the cluster
#: first, as two clusters' job-1 are two jobs, side by side
TOP_JOB_COLUMNS = ("cluster", "job_id", "tenant", "queue", "attempts", "failed_attempts", "gpu_hours",
                   "effective_gpu_hours", "idle_gpu_hours", "cost")

#: a period's money per cluster, job, definition version and attempt: the closed rows of its days, the
#: adjustments booked on them (where the bills report books them) and the open days' basis ({open}: each
#: record once, reports.open_basis_sql), idle where the bills have it (bills.line_of: allocated idle)
_ATTEMPT_MONEY = """
    SELECT cluster, job_id, definition_version, attempt, any(tenant) AS attempt_tenant,
           any(queue) AS attempt_queue, sumIf(g, NOT idle) AS ax, sumIf(g, idle) AS ai, sum(e) AS ae,
           sum(c) AS ac, anyIf(currency, currency != '') AS attempt_currency
    FROM (
        SELECT toString(cluster) AS cluster, job_id, toString(definition_version) AS definition_version, attempt,
               toString(tenant) AS tenant, toString(queue) AS queue, line = 'idle' AS idle, toInt64(gpu_ms) AS g,
               toInt64(effective_gpu_ms) AS e, toInt128(cost_micros) AS c, toString(currency) AS currency
        FROM {db}.closed_job_cost WHERE {committed} AND day BETWEEN {{d0:Date}} AND {{d1:Date}}
        UNION ALL
        SELECT toString(cluster), job_id, toString(definition_version), attempt, toString(tenant), toString(queue),
               line = 'idle', toInt64(gpu_ms), toInt64(effective_gpu_ms), toInt128(cost_micros), toString(currency)
        FROM {db}.bill_adjustments WHERE {committed} AND booked_day BETWEEN {{d0:Date}} AND {{d1:Date}}
        UNION ALL
        SELECT cluster, job_id, definition_version, attempt, tenant, queue, state = 'allocated_idle',
               toInt64(gpu_ms), toInt64(effective_gpu_ms), toInt128(cost_micros), ''
        FROM ({open}))
    GROUP BY cluster, job_id, definition_version, attempt"""

#: the period's money per cluster, job and definition version, ranked (rank 1 first, `{order}`), with
#: every row's (currency, version) pair of the whole period (fill_unknown_currency looks at them all);
#: an attempt is failed as job_attempts says now (bills.fetch_outcomes)
_JOB_MONEY = """
    SELECT *, row_number() OVER (ORDER BY {order}) AS rank,
           groupUniqArray((currency, definition_version)) OVER () AS period_currencies
    FROM (
        SELECT cluster, job_id, definition_version, argMin(attempt_tenant, attempt) AS tenant,
               argMin(attempt_queue, attempt) AS queue, count() AS attempts,
               countIf(failed) AS failed_attempts, sum(ax) AS x, sum(ai) AS i, x + i AS held,
               sum(ae) AS e, sum(ac) AS c, sumIf(ac, failed) AS failed_c,
               anyIf(attempt_currency, attempt_currency != '') AS currency
        FROM (
            SELECT *, (cluster, job_id, attempt) IN (
                SELECT toString(cluster), job_id, attempt FROM {db}.job_attempts WHERE outcome = 'failed') AS failed
            FROM ({attempts}))
        GROUP BY cluster, job_id, definition_version)"""

#: the orders of period_job_rows: the jobs report's (reports.JOBS_ORDER: the most expensive first) and
#: the most GPU-hours first
_JOB_ORDERS = {"cost": "c DESC, held DESC, cluster, job_id, definition_version",
               "gpu_hours": "held DESC, job_id, cluster, definition_version"}


def period_job_rows(client, database: str, start: dt.date, end: dt.date, currency: str = "", *,
                    order: str = "cost", top: int | None = None, idle_share: float | None = None) -> list[dict]:
    """Every job's money on the days of [start, end] only, per cluster, job and definition version, in
    `order` (cost: the jobs report's, reports.JOBS_ORDER; gpu_hours: the most GPU-hours first): the parts
    the bills report adds up per tenant, so a period's jobs add up to its bills, and a job running across
    periods shows each period its part:
    - closed days: closed_job_cost, and the adjustments booked on the period's days;
    - open days: the bill basis (each record id once, reports.open_basis_sql), its lines as a close run
      makes them (bills.line_of).
    With `top`, only the first `top` rows, and with `idle_share` also every later row of a job with a
    failed attempt or idle more than `idle_share` of its held GPU-time (period_jobs). One query.
    Each row: tenant, queue (of its first attempt), attempts and failed_attempts (attempts with usage
    in the period, failed as job_attempts says now), gpu_hours, effective_gpu_hours, idle_gpu_hours,
    cost, failed_cost (what its failed attempts cost in the period: every line of theirs), idle_share
    (idle of held GPU-time) and currency (its definition version's; `currency` where none is recorded)."""
    from gpuledger.warehouse import bills as b

    if order not in _JOB_ORDERS:
        raise ValueError(f"order must be one of {', '.join(_JOB_ORDERS)}; got {order!r}")
    db = quoted_database(database)
    open_sql, params = base.open_basis_sql(client, db, start, end)
    sql = _JOB_MONEY.format(order=_JOB_ORDERS[order], db=db, attempts=_ATTEMPT_MONEY.format(
        db=db, committed=b.committed(db), open=open_sql))
    params = {**params, "d0": start, "d1": end}
    if top is not None:
        keep = ["rank <= {top:UInt64}"]
        params["top"] = top
        if idle_share is not None:
            keep.append("failed_attempts > 0 OR if(held > 0, i / held, 0) > {idle_share:Float64}")
            params["idle_share"] = float(idle_share)
        sql = f"SELECT * FROM ({sql}) WHERE {' OR '.join(keep)}"
    found = query(client, f"{sql} ORDER BY rank", params)
    named = base.definition_currencies(client, db, currency or None)
    rows = []
    for j in found:
        held, i = int(j["held"]), int(j["i"])
        rows.append({"cluster": j["cluster"], "job_id": j["job_id"], "definition_version": j["definition_version"],
                     "tenant": j["tenant"], "queue": j["queue"], "attempts": int(j["attempts"]),
                     "failed_attempts": int(j["failed_attempts"]), "gpu_hours": held / 3_600_000,
                     "effective_gpu_hours": int(j["e"]) / 3_600_000, "idle_gpu_hours": i / 3_600_000,
                     "cost": int(j["c"]) / 1e6, "failed_cost": int(j["failed_c"]) / 1e6,
                     "idle_share": i / held if held > 0 else 0.0,
                     "currency": j["currency"] or base.currency_of(named, j["definition_version"])})
    # the currencies the period's rows know, the rows not kept included
    known = {c or base.currency_of(named, dv) for c, dv in found[0]["period_currencies"]} if found else set()
    return fill_unknown_currency(rows, known)


def job_columns(rows: Sequence[dict], columns: Sequence[str]) -> list[dict]:
    """`columns` of the rows, and each row's currency where they hold several."""
    keep = [*columns, "currency"] if len(currencies(rows)) > 1 else list(columns)
    return [{c: r[c] for c in keep} for r in rows]


def period_jobs(client, database: str, start: dt.date, end: dt.date, top: int,
                idle_share: float | None = None, currency: str = "") -> tuple[list[dict], list[dict]]:
    """The jobs' money on the period's days (period_job_rows), read once for two sections:
    - the `top` most expensive, TOP_JOB_COLUMNS of them (and currency, where several);
    - with `idle_share`, the jobs that had a failed attempt with usage in the period or were idle more
      than `idle_share` of their held GPU-time in it: cluster, job_id, tenant, failed_attempts, cost (their
      failed attempts' cost in the period), job_cost (the job's whole cost in the period), gpu_hours,
      idle_gpu_hours, share, currency."""
    rows = period_job_rows(client, database, start, end, currency, top=top, idle_share=idle_share)
    first = job_columns(rows[:top], TOP_JOB_COLUMNS)
    if idle_share is None:
        return first, []
    marked = [{"cluster": r["cluster"], "job_id": r["job_id"], "tenant": r["tenant"], "failed_attempts": r["failed_attempts"],
               "cost": r["failed_cost"], "job_cost": r["cost"], "idle_gpu_hours": r["idle_gpu_hours"],
               "gpu_hours": r["gpu_hours"], "share": r["idle_share"], "currency": r["currency"]}
              for r in rows if r["failed_attempts"] > 0 or r["idle_share"] > idle_share]
    return first, marked


def largest_jobs(client, database: str, start: dt.date, end: dt.date, top: int, currency: str = "") -> list[dict]:
    """The `top` jobs with the most GPU-hours on the period's days (period_job_rows: each record once)."""
    rows = period_job_rows(client, database, start, end, currency, order="gpu_hours", top=top)
    return job_columns(rows[:top], ("cluster", "job_id", "tenant", "queue", "attempts", "gpu_hours", "effective_gpu_hours",
                                    "idle_gpu_hours", "cost"))


def unsampled_cards(client, database: str, cards: Sequence[str], start: dt.date, end: dt.date) -> set[str]:
    """Of `cards` (each executing in [start, end]), those with no utilization sample while executing:
    none in any attempt's executing time on them that reaches into the period (job_gpu_usage;
    usage_gpu_daily keeps no sampled time). Their utilization is unknown, not 0 %. An attempt sampled
    only outside the period counts as sampled: unknown is said only where it surely is."""
    if not cards:
        return set()
    db = quoted_database(database)
    day_ms = lambda d: int(dt.datetime.combine(d, dt.time(), dt.timezone.utc).timestamp() * 1000)  # noqa: E731
    sampled = {r[0] for r in client.query(f"""
        SELECT gpu_uuid FROM {db}.job_gpu_usage
        WHERE gpu_uuid IN {{cards:Array(String)}} AND state = 'executing'
          AND last_end_ms > {{t0:Int64}} AND first_start_ms < {{t1:Int64}}
        GROUP BY gpu_uuid HAVING sum(util_gpu_ms) > 0""",
        parameters={"cards": list(cards), "t0": day_ms(start), "t1": day_ms(end + dt.timedelta(days=1))}).result_rows}
    return set(cards) - sampled


def followed_suggestions(client, database: str, start: dt.date, end: dt.date, within_s: float) -> list[dict]:
    """Jobs released on a reclaim suggestion (docs/alerts.md, "Followed suggestions"): every job attempt
    a suggestion opened in [start, end] named that ended (completed, failed, preempted, cancelled)
    within `within_s` after it opened, with its cluster, its GPUs, its execution rate then, when it
    ended, and what an idle GPU-hour of it cost (its idle cost / its idle GPU-hours, from usage, priced under
    `definition_version`: the currency is that version's). One row per released
    attempt, from the latest suggestion that named it before it ended: a job named again by a later
    suggestion (the first withdrawn, then demand back) released its GPUs once."""
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
                   sumIf(gpu_ms, state = 'allocated_idle') AS idle_gpu_ms,
                   toString(anyIf(definition_version, state = 'allocated_idle')) AS idle_definition_version
            FROM {db}.usage_raw WHERE (cluster, job_id) IN (SELECT cluster, job_id FROM named)
            GROUP BY cluster, job_id, attempt
        )
        SELECT cluster, queue, job_id, attempt, suggested_ms, released_ms, gpus_freed, execution_rate, idle_cost_per_gpu_hour,
               definition_version
        FROM (
            SELECT n.cluster AS cluster, n.queue AS queue, n.job_id AS job_id, n.attempt AS attempt,
                   n.opened_at_ms AS suggested_ms, e.end_ms AS released_ms, n.gpus_freed AS gpus_freed,
                   n.rate AS execution_rate,
                   if(ifNull(i.idle_gpu_ms, 0) = 0, 0, i.idle_cost_micros / 1e6 / (i.idle_gpu_ms / 3600000))
                       AS idle_cost_per_gpu_hour, ifNull(i.idle_definition_version, '') AS definition_version
            FROM named AS n
            INNER JOIN ended AS e ON e.cluster = n.cluster AND e.job_id = n.job_id AND e.attempt = n.attempt
            LEFT JOIN idle AS i ON i.cluster = n.cluster AND i.job_id = n.job_id AND i.attempt = n.attempt
            WHERE e.end_ms >= n.opened_at_ms AND e.end_ms <= n.opened_at_ms + {{within:Int64}}
            ORDER BY suggested_ms DESC
            LIMIT 1 BY cluster, job_id, attempt
        )
        ORDER BY suggested_ms, cluster, queue, job_id, attempt""", {"d0": start, "d1": end, "within": int(within_s * 1000)})


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
    # the cluster too: an attempt is (cluster, job_id, attempt), and two clusters' job-1 are two jobs
    names = {key: (cluster, job, attempt, gpu) for key, cluster, job, attempt, gpu in client.query(f"""
        SELECT DISTINCT u.gpu_key, toString(u.cluster), u.job_id, u.attempt, l.gpu
        FROM (SELECT gpu_key, cluster, job_id, attempt, node, gpu_uuid FROM {db}.job_gpu_usage
              WHERE gpu_key IN {{keys:Array(UInt64)}}) AS u
        INNER JOIN {db}.gpu_labels AS l ON l.cluster = u.cluster AND l.node = u.node AND l.gpu_uuid = u.gpu_uuid""",
        parameters={"keys": sorted({key for key, _, _ in found})}).result_rows}
    rows = [{"cluster": names[key][0], "job_id": names[key][1], "attempt": names[key][2], "gpu": names[key][3],
             "util_pct": util, "median_pct": median} for key, util, median in found]
    return sorted(rows, key=lambda r: (r["job_id"], r["cluster"], r["attempt"], r["util_pct"]))


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
