"""The ledger's table reports: rows read from the warehouse views (`fetch`); report_text.py renders
them for people or programs.

Why one file: every `gpuledger report` table shares one set of filters (`REPORT_FILTERS`, `_where`),
parameter handling and money columns; each report is one short query function below.

Every user-supplied value reaches ClickHouse as a server-side parameter (`{name:Type}`); the only
SQL assembled here is from fixed fragments and whitelisted column names.

Units: *_gpu_hours, *_gpu_seconds, cost in currency units (and exact *_cost_micros where kept),
utilizations as ratios 0..1.
"""

from __future__ import annotations

import datetime as dt
import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator, Sequence


from gpuledger.warehouse.client import quoted_database

REPORTS = ("bills", "jobs", "queues", "utilization", "capacity", "unmatched", "alerts", "suggestions")

#: filter name -> (column, ClickHouse type, operator); the column is quoted SQL, never user input
_FILTERS: dict[str, tuple[str, str, str]] = {
    "day_from": ("day", "Date", ">="),
    "day_to": ("day", "Date", "<="),
    "cluster": ("cluster", "String", "="),
    "tenant": ("tenant", "String", "="),
    "queue": ("queue", "String", "="),
    "gpu_model": ("gpu_model", "String", "="),
    "job_id": ("job_id", "String", "="),
    "definition_version": ("definition_version", "String", "="),
}

REPORT_FILTERS: dict[str, frozenset[str]] = {
    "bills": frozenset({"day_from", "day_to", "cluster", "tenant", "queue", "definition_version"}),
    "jobs": frozenset({"day_from", "day_to", "cluster", "tenant", "queue", "job_id", "definition_version"}),
    "queues": frozenset({"day_from", "day_to", "cluster", "tenant", "queue"}),
    "utilization": frozenset({"day_from", "day_to", "cluster", "tenant", "queue", "gpu_model", "definition_version"}),
    "capacity": frozenset({"day_from", "day_to", "cluster", "gpu_model", "definition_version"}),
    "unmatched": frozenset({"day_from", "day_to", "cluster"}),
    "alerts": frozenset({"day_from", "day_to", "cluster", "tenant", "queue", "job_id"}),
    "suggestions": frozenset({"day_from", "day_to", "cluster", "queue"}),
}
#: options that are not row filters
_REPORT_OPTIONS: dict[str, frozenset[str]] = {
    "bills": frozenset({"limit", "idle_redistribution", "ledger_idle_redistribution", "currency"}),
    "jobs": frozenset({"limit", "reference_cost_per_gpu_hour", "currency"}),
    "queues": frozenset({"limit"}),
    "utilization": frozenset({"limit", "by"}),
    "capacity": frozenset({"limit", "currency"}),
    "unmatched": frozenset({"limit", "busy_floor_pct"}),
    "alerts": frozenset({"limit"}),
    "suggestions": frozenset({"limit", "followed_within_s"}),
}

#: `report unmatched`: utilization above which unallocated GPU time is busy; sql/0025 aggregates it
DEFAULT_BUSY_FLOOR_PCT = 1.0

UTILIZATION_DIMENSIONS = ("day", "cluster", "gpu_model", "queue", "tenant", "job_id")
#: dimensions capacity is known by; tenant and queue hold no capacity (down/unallocated have neither)
_CAPACITY_DIMENSIONS = frozenset({"day", "cluster", "gpu_model"})


def _coerce(name: str, value: Any) -> Any:
    if _FILTERS[name][1] == "Date":
        if isinstance(value, dt.datetime):  # report days are UTC days; an aware time may be on another there
            return (value.astimezone(dt.timezone.utc) if value.tzinfo else value).date()
        if isinstance(value, dt.date):
            return value
        try:
            return dt.date.fromisoformat(str(value))
        except ValueError:
            raise ValueError(f"{name} must be a date (YYYY-MM-DD), got {value!r}") from None
    return str(value)


def _where(filters: dict[str, Any], names: Iterable[str], prefix: str = "") -> tuple[list[str], dict[str, Any]]:
    """WHERE conditions and parameters for the given filters (None values are ignored)."""
    conds, params = [], {}
    for name in names:
        value = filters.get(name)
        if value is None:
            continue
        column, ch_type, op = _FILTERS[name]
        conds.append(f"{prefix}{column} {op} {{{name}:{ch_type}}}")
        params[name] = _coerce(name, value)
    return conds, params


def _check(name: str, filters: dict[str, Any]) -> None:
    if name not in REPORTS:
        raise ValueError(f"unknown report {name!r}; reports: {', '.join(REPORTS)}")
    allowed = REPORT_FILTERS[name] | _REPORT_OPTIONS[name]
    unknown = sorted(set(filters) - allowed)
    if unknown:
        raise ValueError(f"report {name!r} takes no {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}")


def _limit(filters: dict[str, Any], params: dict[str, Any]) -> str:
    limit = filters.get("limit")
    if limit is None:
        return ""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
    params["limit"] = limit
    return " LIMIT {limit:UInt64}"


def _and(conds: Sequence[str]) -> str:
    return " AND ".join(conds) if conds else "1"


def _query(client, sql: str, params: dict[str, Any]) -> list[dict]:
    return list(client.query(sql, parameters=params).named_results())


# --------------------------------------------------------------------------- the reports
def _recorded_by_version(client, db: str, *path: str) -> dict[str, str]:
    """definition_version -> the string at `path` of its latest recorded content (`gpuledger migrate`
    records the definitions); '' where the content has none."""
    keys = ", ".join(f"'{k}'" for k in path)
    try:
        rows = _query(client, f"SELECT definition_version, argMax(JSONExtractString(content, {keys}), recorded_at) "
                              f"AS value FROM {db}.definitions GROUP BY definition_version", {})
    except Exception:  # an older warehouse without the accounting library
        rows = []
    return {r["definition_version"]: r["value"] for r in rows}


def definition_currencies(client, db: str, fallback: str | None) -> dict[str, str]:
    """definition_version -> currency, as recorded with the definition (`gpuledger migrate`)."""
    out = {dv: c for dv, c in _recorded_by_version(client, db, "currency").items() if c}
    if fallback:
        out.setdefault("", fallback)
    return out


def currency_of(currencies: dict[str, str], dv: str) -> str:
    return currencies.get(dv) or currencies.get("", "")


IDLE_POLICIES = ("none", "even", "usage")


def definition_idle_policies(client, db: str) -> dict[str, str]:
    """definition_version -> its [idle] redistribution, as recorded with the definition (`gpuledger
    migrate`: content.definitions.idle_redistribution); a version recorded without one is left out."""
    return {dv: p for dv, p in _recorded_by_version(client, db, "definitions", "idle_redistribution").items()
            if p in IDLE_POLICIES}


def check_idle_policies(*named: tuple[str, str | None]) -> None:
    """Each (name, policy) given (not None) is one of IDLE_POLICIES, else a ValueError naming it."""
    for name, value in named:
        if value is not None and value not in IDLE_POLICIES:
            raise ValueError(f"{name} must be none, even or usage; got {value!r}")


def idle_policy_of(client, db: str, filters: dict[str, Any]) -> tuple[Callable[[str], str], set[str]]:
    """The cluster idle policy of a definition version's rows (docs/accounting.md §6): the
    `idle_redistribution` filter where given (a what-if view over every row), else the policy recorded
    with the version (§7: a versioned definition), else `ledger_idle_redistribution` (the running
    ledger's), else none; and the policies a row can have."""
    override, fallback = filters.get("idle_redistribution"), filters.get("ledger_idle_redistribution") or "none"
    check_idle_policies(("idle_redistribution", override), ("ledger_idle_redistribution", fallback))
    if override:
        return (lambda dv: override), {override}
    recorded = definition_idle_policies(client, db)
    return (lambda dv: recorded.get(dv, fallback)), {*recorded.values(), fallback}


#: bill lines and the prefixes of their columns
_BILL_LINES = (("compute", "compute"), ("idle", "idle"), ("failed_retry", "failed_retry"))


def _bill_row(key: dict, amounts: dict[str, list[int]], currency: str) -> dict:
    """One report row in tenant_daily_bill's shape from {line: [gpu_ms, eff, cost]}."""
    row = dict(key)
    row["currency"] = currency
    total = [0, 0, 0]
    for line, prefix in _BILL_LINES:
        g, e, c = amounts.get(line, (0, 0, 0))
        row[f"{prefix}_gpu_hours"] = g / 3600000
        row[f"{prefix}_effective_gpu_hours"] = e / 3600000
        row[f"{prefix}_cost"] = c / 1e6
        row[f"{prefix}_cost_micros"] = c
        total = [total[0] + g, total[1] + e, total[2] + c]
    row["total_gpu_hours"] = total[0] / 3600000
    row["total_effective_gpu_hours"] = total[1] / 3600000
    row["total_cost"] = total[2] / 1e6
    row["total_cost_micros"] = total[2]
    return row


def _bills(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """Tenant bills per UTC day, cluster, tenant and definition version, with `status`:
    - closed: the day is closed for the cluster; the figures are the closed rows (closed_tenant_bill),
      which never change;
    - open: live figures from usage deduplicated by record id;
    - adjustment: corrections of a closed day (`corrects_day`, `reason`) booked on `day`, the next day
      that was open when they were found (gpuledger/warehouse/bills.py).
    Money carries its `currency`."""
    from gpuledger.warehouse import bills as b

    _limit(filters, {})  # the other reports' check: 0 is no row, a negative limit an error
    policy_of, policies = idle_policy_of(client, db, filters)
    shares = policies != {"none"}
    # Redistribution shares depend on every tenant billed that day, so the tenant filter is
    # applied after the shares are computed.
    names = sorted(REPORT_FILTERS["bills"] - ({"tenant"} if shares else set()))
    conds, params = _where(filters, names)
    adj_conds = [c.replace("day ", "booked_day ", 1) if c.startswith("day ") else c for c in conds]
    currencies = definition_currencies(client, db, filters.get("currency"))
    groups: dict[tuple, dict[str, list[int]]] = {}
    row_currency: dict[tuple, str] = {}

    def add(key: tuple, line: str, g: int, e: int, c: int, currency: str | None = None) -> None:
        acc = groups.setdefault(key, {}).setdefault(line, [0, 0, 0])
        acc[0] += int(g)
        acc[1] += int(e)
        acc[2] += int(c)
        if currency:
            row_currency[key] = currency

    lines, carbon_of, carbon_version = _billed_lines(client, db, conds, params, with_carbon=True)
    # each tenant's cost per queue, cluster and day: the weights of the cluster idle's shares
    units: dict[tuple, dict[tuple[str, str], int]] = {}
    for day, status, cluster, tenant, queue, dv, line, g, e, c, currency in lines:
        add((day, status, cluster, tenant, dv, None, None), line, g, e, c, currency)
        _add_unit(units, day, cluster, dv, tenant, queue, c)
    adj_sql = (f"SELECT booked_day, corrects_day, toString(reason) AS reason, toString(cluster) AS cluster, "
               f"toString(tenant) AS tenant, toString(line) AS line, toString(definition_version) AS definition_version, "
               f"sum(gpu_ms) AS g, sum(effective_gpu_ms) AS e, sum(cost_micros) AS c, toString(any(currency)) AS currency "
               f"FROM {db}.bill_adjustments WHERE {b.committed(db)} AND {_and(adj_conds)} "
               "GROUP BY booked_day, corrects_day, reason, cluster, tenant, line, definition_version")
    for r in _query(client, adj_sql, params):
        add((r["booked_day"], "adjustment", r["cluster"], r["tenant"], r["definition_version"], r["corrects_day"],
             r["reason"]), r["line"], r["g"], r["e"], r["c"], r["currency"])
    order = {"closed": 0, "open": 0, "adjustment": 1}
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], order[k[1]], k[3], k[2], k[4], str(k[5]), str(k[6]))):
        day, status, cluster, tenant, dv, corrects, reason = key
        head = {"day": day, "status": status, "cluster": cluster, "tenant": tenant, "definition_version": dv}
        if status == "adjustment":
            head.update(corrects_day=corrects, reason=reason)
        rows.append(_bill_row(head, groups[key], row_currency.get(key) or currency_of(currencies, dv)))
    _flag_priced_by_default(client, db, rows, filters.get("queue"))
    for row in rows:  # carbon of the day's usage; none on adjustment rows (docs/carbon.md)
        kg = None if row["status"] == "adjustment" else carbon_of.get(
            (row["day"], row["cluster"], row["tenant"], row["definition_version"]))
        row["co2e_kg"] = kg
        row["carbon_version"] = carbon_version if kg is not None else None
    billed = [r for r in rows if r["status"] != "adjustment"]
    if any(policy_of(r["definition_version"]) != "none" for r in billed):  # else no cluster idle columns
        if filters.get("cluster") is not None or filters.get("queue") is not None:
            # the shares are those of every tenant and queue of the day's cluster, whatever this report shows
            units = _billed_units(client, db, filters)
        _redistribute_cluster_idle(client, db, billed, policy_of, units, filters.get("queue"))
    if filters.get("tenant") is not None:
        rows = [r for r in rows if r["tenant"] == filters["tenant"]]
    return rows if filters.get("limit") is None else rows[: filters["limit"]]


def _add_unit(units: dict, day, cluster: str, dv: str, tenant: str, queue: str, cost: int) -> None:
    acc = units.setdefault((day, cluster, dv), {})
    acc[(tenant, queue)] = acc.get((tenant, queue), 0) + int(cost)


def _billed_lines(client, db: str, conds: Sequence[str], params: dict[str, Any], *, with_carbon: bool
                  ) -> tuple[list[tuple], dict[tuple, float], str | None]:
    """The closed and open bill lines of the days `conds` select, each as (day, status, cluster, tenant,
    queue, definition_version, line, gpu_ms, effective_gpu_ms, cost_micros, currency or None), with the
    carbon per day, cluster, tenant and definition version and the carbon version (empty and None
    without `with_carbon`)."""
    from gpuledger.warehouse import bills as b

    closed_sql = (f"SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(line) AS line, "
                  f"toString(definition_version) AS definition_version, sum(gpu_ms) AS g, sum(effective_gpu_ms) AS e, "
                  f"sum(cost_micros) AS c, toString(any(currency)) AS currency, toString(queue) AS queue "
                  f"FROM {db}.closed_tenant_bill WHERE {b.committed(db)} AND {_and(conds)} "
                  "GROUP BY day, cluster, tenant, queue, line, definition_version")
    lines = [(r["day"], "closed", r["cluster"], r["tenant"], r["queue"], r["definition_version"], r["line"],
              r["g"], r["e"], r["c"], r["currency"]) for r in _query(client, closed_sql, params)]
    basis, carbon_of, carbon_version = _open_basis_and_carbon(client, db, conds, params, with_carbon=with_carbon)
    for (day, cluster, tenant, queue, _job, _att, dv, line), (g, e, c) in b.job_lines(
            basis, b.fetch_outcomes(client, db, failed_only=True)).items():
        lines.append((day, "open", cluster, tenant, queue, dv, line, g, e, c, None))
    return lines, carbon_of, carbon_version


def _billed_units(client, db: str, filters: dict[str, Any]) -> dict[tuple, dict[tuple[str, str], int]]:
    """{(day, cluster, definition_version): {(tenant, queue): cost_micros}} of the closed and open bills
    of every cluster, tenant and queue (adjustments aside), for the days and definition `filters` select."""
    conds, params = _where(filters, ("day_from", "day_to", "definition_version"))
    units: dict[tuple, dict[tuple[str, str], int]] = {}
    for day, _status, cluster, tenant, queue, dv, _line, _g, _e, c, _currency in _billed_lines(
            client, db, conds, params, with_carbon=False)[0]:
        _add_unit(units, day, cluster, dv, tenant, queue, c)
    return units


def _redistribute_cluster_idle(client, db: str, rows: list[dict], policy_of: Callable[[str], str],
                               units: dict[tuple, dict[tuple[str, str], int]], queue: str | None) -> None:
    """Add each tenant's part of its cluster's idle (unallocated) cost of the day: equal parts per tenant
    ('even') or in proportion to the tenant's cost that day ('usage'; evenly when none cost anything),
    each definition version's idle as its own policy says (`policy_of`; 'none': no parts, the idle stays
    the platform's); the parts of a cluster's day add up to its idle cost exactly. The idle of a cluster
    goes to the tenants billed on that cluster only.
    The shares are worked out per tenant and queue over every tenant of the cluster's day (`units`),
    whatever the report filters, so that a report for one cluster or queue shows the same parts as the
    whole report and the per-queue reports add up to the cluster's idle: 'even' gives each tenant an
    equal part and splits it among the tenant's queues by their cost (equally when they cost nothing)."""
    from gpuledger.streams.attribution import split_integer
    from gpuledger.warehouse import bills as b

    # closed days: the idle their close stored (sql/0039), open days: their unallocated usage, each
    # record once (usage_capacity_daily sums every stored copy); corrections of a closed day's idle are
    # shared on the day they are booked on, so a closed day's parts never change
    days = [key[0] for key in units]
    idle: dict[tuple, int] = {}
    if days:
        exact_days, raw_days, _open, _bucket, _record, day_params = _live_days(client, db, None)
        idle = b.cluster_idle_by_day(client, db, exact_days, raw_days, day_params, min(days), max(days))
    parts: dict[tuple, int] = {}  # (day, cluster, dv, tenant, queue) -> part
    for key, costs in units.items():
        policy = policy_of(key[2])
        if policy == "none":
            continue
        total = int(idle.get(key, 0))
        ordered = sorted(costs)
        # 'usage' with nothing to weigh by (every tenant on a zero-priced model) shares evenly: the idle
        # would otherwise go to nobody and the parts would not add up to it
        if policy == "even" or not any(costs.values()):
            tenants = sorted({t for t, _ in ordered})
            for tenant, tenant_part in zip(tenants, split_integer(total, [1] * len(tenants))):
                mine = [u for u in ordered if u[0] == tenant]
                weights = [costs[u] for u in mine]
                if not any(weights):
                    weights = [1] * len(mine)
                for u, part in zip(mine, split_integer(tenant_part, weights)):
                    parts[(*key, *u)] = part
        else:
            for u, part in zip(ordered, split_integer(total, [costs[u] for u in ordered])):
                parts[(*key, *u)] = part
    for row in rows:
        key = (row["day"], row["cluster"], row["definition_version"])
        part = sum(p for (t, q), p in ((u, parts.get((*key, *u), 0)) for u in units.get(key, {}))
                   if t == row["tenant"] and (queue is None or q == queue))
        row["cluster_idle_cost_micros"] = part
        row["cluster_idle_cost"] = part / 1e6
        row["billed_total_cost_micros"] = int(row["total_cost_micros"]) + part
        row["billed_total_cost"] = row["billed_total_cost_micros"] / 1e6


def _jobs(client, db: str, filters: dict[str, Any]) -> list[dict]:
    with one_reading():  # a limited report reads the money twice (_top_job_keys), the open days once
        return _read_jobs(client, db, filters)


def _read_jobs(client, db: str, filters: dict[str, Any]) -> list[dict]:
    names = REPORT_FILTERS["jobs"] - {"day_from", "day_to"}
    conds, params = _where(filters, sorted(names))
    # a job belongs to a period when its usage overlaps it
    if filters.get("day_from") is not None:
        conds.append("last_day >= {day_from:Date}")
        params["day_from"] = _coerce("day_from", filters["day_from"])
    if filters.get("day_to") is not None:
        conds.append("first_day <= {day_to:Date}")
        params["day_to"] = _coerce("day_to", filters["day_to"])
    ref = filters.get("reference_cost_per_gpu_hour")
    if ref is not None:
        ref = float(ref)
        if not math.isfinite(ref) or ref < 0:
            raise ValueError(f"reference_cost_per_gpu_hour must be a non-negative number, got {ref!r}")
        params["ref"] = ref
        opportunity = "queue_wait_gpu_hours * {ref:Float64}"
    else:
        opportunity = "CAST(NULL AS Nullable(Float64))"
    # the money of the cluster and job asked for (their parameters are already set), else of every one:
    # a job's own report then reads its money only (0.06 s against 0.17 s at 100 M records)
    scope = [cond for name, cond in (("cluster", "cluster = {cluster:String}"), ("job_id", "job_id = {job_id:String}"))
             if name in params]
    limit = filters.get("limit")
    if limit is not None:
        _limit(filters, {})  # the other reports' check: a non-negative integer
        if limit == 0:
            return []
    with_carbon = _CARBON.get()
    top: set[tuple[str, str, str]] | None = None
    if limit and limit <= TOP_JOBS_READ_ALONE:
        # the first `limit` jobs found first, then full rows for them only (a filter on job_id reaches
        # job_cost's tables, sql/0031): a period's top 10 of 45,000 jobs is not built 45,000 rows wide
        top = _top_job_keys(client, db, filters, conds, params, scope, limit)
        conds.append("job_id IN {top_job_ids:Array(String)}")
        scope.append("job_id IN {top_job_ids:Array(String)}")
        params["top_job_ids"] = sorted({key[1] for key in top})
    jobs = f"SELECT *, {opportunity} AS opportunity_cost FROM {db}.job_cost WHERE {_and(conds)}"
    money, more = job_money_sql(client, db, " AND ".join(scope) or "1", carbon_too=with_carbon)
    currencies = definition_currencies(client, db, filters.get("currency"))
    named = {dv: cur for dv, cur in currencies.items() if dv}
    params.update(more, currency_dv=list(named), currency=list(named.values()), currency_default=currencies.get("", ""))
    # job_cost's rows with the money of closed and open days and the carbon (job_money_sql), most
    # expensive first: one query, so that a 45,000-job report is joined and ordered by the engine
    replaced = ", ".join(f"if(m.money = 1, {expr}, j.{col}) AS {col}" for col, expr in JOB_MONEY_COLUMNS.items())
    ident = "cluster, job_id, tenant, queue, definition_version"
    carbon = "m.has_energy = 1 AND {carbon_known:UInt8} = 1" if with_carbon else "0"
    sql = f"""
        SELECT {", ".join(f"j.{k} AS {k}" for k in ident.split(", "))},
               if(m.money = 1 AND m.open = 0, 'closed', 'open') AS status,
               transform(j.definition_version, {{currency_dv:Array(String)}}, {{currency:Array(String)}},
                         {{currency_default:String}}) AS currency,
               j.* EXCEPT ({ident}) REPLACE ({replaced}),
               if({carbon}, {"m.co2e_kg" if with_carbon else "0."}, NULL) AS co2e_kg,
               if({carbon}, {{carbon_version:String}}, NULL) AS carbon_version
        FROM ({jobs}) AS j
        LEFT JOIN ({money}) AS m
          ON j.cluster = m.cluster AND j.job_id = m.job_id AND j.definition_version = m.definition_version
        ORDER BY {JOBS_ORDER}
        {"LIMIT {limit:UInt64}" if limit else ""}"""
    if limit:
        params["limit"] = limit
    rows = _query(client, sql, params)
    if top is not None:  # the ids' rows in other clusters or versions left out
        rows = [r for r in rows if (r["cluster"], r["job_id"], r["definition_version"]) in top]
    return rows


#: a jobs report with a limit up to this finds its jobs first, then reads their rows (_top_job_keys)
TOP_JOBS_READ_ALONE = 1000
#: the jobs report's money columns from job_money_sql's sums (m), where a job has money rows
JOB_MONEY_COLUMNS = {"gpu_hours": "(m.x + m.i) / 3600000", "executing_gpu_hours": "m.x / 3600000",
                      "idle_gpu_hours": "m.i / 3600000", "effective_gpu_hours": "m.e / 3600000",
                      "cost": "m.c / 1e6", "cost_micros": "m.c"}
#: the jobs report's order: most expensive first, a total order (a job's row per definition version)
JOBS_ORDER = "coalesce(cost, 0) DESC, coalesce(gpu_hours, 0) DESC, cluster, job_id, definition_version"


def _top_job_keys(client, db: str, filters: dict[str, Any], conds: list[str], params: dict[str, Any],
                  scope: list[str], limit: int) -> set[tuple[str, str, str]]:
    """(cluster, job_id, definition_version) of the first `limit` rows of the jobs report under `conds`
    (the filters'): the report's order over job_cost's cost and GPU-hours and the money without the
    carbon (which does not order it), the columns no other part of the report needs left unread."""
    money, more = job_money_sql(client, db, " AND ".join(scope) or "1", carbon_too=False)
    ordered = {col: f"if(m.money = 1, {JOB_MONEY_COLUMNS[col]}, j.{col}) AS {col}" for col in ("cost", "gpu_hours")}
    jobs = f"SELECT cluster, job_id, definition_version, cost, gpu_hours FROM {db}.job_cost WHERE {_and(conds)}"
    named = {name for name, value in filters.items() if value is not None} - {"limit", "currency"}
    if named & {"day_from", "day_to"} and named <= {"day_from", "day_to", "cluster", "reference_cost_per_gpu_hour"}:
        # a period's jobs have usage; job_cost's rows with usage are the usage side's rows (sql/0031:
        # one per cluster, job and version, each joined to one job), so the attempts are not read
        jobs = f"""
            SELECT toString(cluster) AS cluster, job_id, toString(definition_version) AS definition_version,
                   sum(cost_micros) / 1e6 AS cost, sum(gpu_ms) / 3600000 AS gpu_hours,
                   min(day) AS first_day, max(day) AS last_day
            FROM {db}.usage_by_job_daily
            WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
                  {"AND cluster = {cluster:String}" if "cluster" in named else ""}
            GROUP BY cluster, job_id, definition_version
            HAVING {_and([c for name, c in (("day_from", "last_day >= {day_from:Date}"),
                                             ("day_to", "first_day <= {day_to:Date}")) if name in named])}"""
    rows = client.query(f"""
        SELECT j.cluster AS cluster, j.job_id AS job_id, j.definition_version AS definition_version,
               {ordered["cost"]}, {ordered["gpu_hours"]}
        FROM ({jobs}) AS j
        LEFT JOIN ({money}) AS m
          ON j.cluster = m.cluster AND j.job_id = m.job_id AND j.definition_version = m.definition_version
        ORDER BY {JOBS_ORDER} LIMIT {{top_limit:UInt64}}""", parameters={**params, **more, "top_limit": limit})
    return {(str(r[0]), r[1], str(r[2])) for r in rows.result_rows}


#: the open days' state read once for every report built inside `one_reading` (None outside it)
_ONE_READING: ContextVar[dict | None] = ContextVar("one_reading", default=None)
#: whether the bills and jobs reports work out carbon (False inside `without_carbon`)
_CARBON: ContextVar[bool] = ContextVar("carbon", default=True)


@contextmanager
def without_carbon() -> Iterator[None]:
    """Bills and jobs reports fetched inside leave co2e_kg and carbon_version empty and read no energy:
    for callers that show none (the periodic reports), as the carbon is a third or more of those
    reads at 100 M records (its intensity join, closed_energy, the record days read raw)."""
    token = _CARBON.set(False)
    try:
        yield
    finally:
        _CARBON.reset(token)


def _carbon_definition(client, db: str) -> dict | None:
    """The carbon definition the reports work with: the recorded one, none inside `without_carbon`."""
    from gpuledger.warehouse import carbon

    return carbon.definition_now(client, db.strip("`")) if _CARBON.get() else None


@contextmanager
def one_reading() -> Iterator[None]:
    """Reports and queries fetched inside read the open days, their exactness (each cluster's day
    counted once: `_exact_days`) and the carbon record days once (`_live_days`): a periodic report reads
    the bills, the queues and the jobs' money (periodic.queries.period_jobs) over one period, and the
    exactness count costs ~0.1 s at 100 M records. For one report build: a close run in between is not
    seen. Inside another, the outer one's reading holds."""
    if _ONE_READING.get() is not None:
        yield
        return
    token = _ONE_READING.set({})
    try:
        yield
    finally:
        _ONE_READING.reset(token)


def _once(key: tuple, read: Callable[[], Any]) -> Any:
    """read(), kept under `key` for the rest of the one_reading around the call (none: read again)."""
    cache = _ONE_READING.get()
    if cache is None:
        return read()
    if key not in cache:
        cache[key] = read()
    return cache[key]


def _live_days(client, db: str, definition: dict | None) -> tuple[str, str, str, str, str, dict[str, Any]]:
    return _once((id(client), db, repr(definition)), lambda: _read_live_days(client, db, definition))


def _open_days(client, db: str) -> dict[str, list[dt.date]]:
    """{cluster: open days with usage}, read once in one_reading."""
    from gpuledger.warehouse import bills as b

    return _once((id(client), db, "open days"), lambda: b.days_by_cluster(client, b.open_days_sql(db)))


def _exact_days(client, db: str, days: dict[str, list[dt.date]]) -> dict[str, list[dt.date]]:
    """bills.exact_hourly_days of `days`, trusting the hours a close run found exact and nothing changed
    since (checked_hours); in one_reading each cluster's day is worked out once, whichever report asks
    (counting a day of 100 M records with FINAL: ~0.1 s), and only days asked for."""
    from gpuledger.warehouse import bills as b

    cache = _ONE_READING.get()
    if cache is None:
        return b.exact_hourly_days(client, db, days, checked_hours=True)
    known: dict[tuple[str, dt.date], bool] = cache.setdefault((id(client), db, "exact days"), {})
    missing = {c: [d for d in ds if (c, d) not in known] for c, ds in days.items()}
    missing = {c: ds for c, ds in missing.items() if ds}
    if missing:
        found = b.exact_hourly_days(client, db, missing, checked_hours=True)
        for c, ds in missing.items():
            exact = set(found.get(c, ()))
            known.update(((c, d), d in exact) for d in ds)
    out = {c: [d for d in ds if known[(c, d)]] for c, ds in days.items()}
    return {c: ds for c, ds in out.items() if ds}


def _read_live_days(client, db: str, definition: dict | None) -> tuple[str, str, str, str, str, dict[str, Any]]:
    """How a report reads live usage (bills.live_usage_sql), the days resolved first (days_condition: no
    per-row set lookups): (days read from usage_by_job_hourly: open days where it is exact, not record
    days; days read from usage_raw: the other open days, and the days of carbon_record_days (closed ones
    only while usage_raw holds their records: carbon.record_days); whether a row's day is open; the raw
    rows' carbon time bucket; the record days; their parameters)."""
    from gpuledger.warehouse import bills as b
    from gpuledger.warehouse import carbon

    open_days = _open_days(client, db)
    record = carbon.record_days(client, db.strip("`")) if definition else {}
    exact = _exact_days(client, db, {c: [d for d in days if d not in record.get(c, ())]
                                     for c, days in open_days.items()})
    raw = {c: sorted(set(days) - set(exact.get(c, ())) | set(record.get(c, ())))
           for c, days in {**record, **open_days}.items()}
    conds, params = {}, {}
    for name, days in (("open_days", open_days), ("exact_days", exact), ("raw_days", raw), ("record_days", record)):
        conds[name], more = b.days_condition({c: d for c, d in days.items() if d}, name)
        params.update(more)
    is_open = "1" if conds["record_days"] == "0" else conds["open_days"]
    return (conds["exact_days"], conds["raw_days"], is_open, carbon.bucket_sql(conds["record_days"]),
            conds["record_days"], params)


def job_money_sql(client, db: str, scope_cond: str, carbon_too: bool = True) -> tuple[str, dict[str, Any]]:
    """SQL of each job's GPU-time, money and carbon per cluster, job and definition version (and its
    parameters): money (x executing, i idle GPU-ms, e effective GPU-ms, c cost micros; money = 1 where
    there are any) from its closed rows and adjustments on closed days and live deduplicated usage on
    open days (open = 1 where it has usage on an open day); carbon (co2e_kg, where has_energy = 1) from
    closed_energy and the same read of the live usage, summed per hour (docs/carbon.md). The open days'
    usage is read once for both. carbon_known: whether a carbon definition is recorded. `scope_cond`
    limits every part to some clusters or jobs (columns all of them have; "1": every job). Without
    `carbon_too`, the money only (no co2e_kg nor has_energy): the energy is not read."""
    from gpuledger.warehouse import bills as b
    from gpuledger.warehouse import carbon

    definition = _carbon_definition(client, db)
    exact_days, raw_days, is_open, bucket, record_days, day_params = _live_days(client, db, definition)
    params = {**carbon.definition_params(definition), **day_params, "carbon_known": int(definition is not None),
              "carbon_version": definition["carbon_version"] if definition is not None else ""}
    keys = "toString(cluster) AS cluster, job_id, toString(definition_version) AS definition_version"
    no_energy = "toUInt8(0) AS has_energy, toInt64(0) AS start_ms, toFloat64(0) AS energy_j"
    if not carbon_too:  # one bucket per day read raw, not one per carbon bucket
        bucket = "0"
    live = f"SELECT *, {is_open} AS is_open FROM ({b.live_usage_sql(db, exact_days, raw_days, bucket, [scope_cond])})"
    # columns: job, open (usage on an open day), money (a money row), x, i, e, c, has_energy, start_ms, energy_j
    energy = f"""
        SELECT {keys}, toUInt8(0), toUInt8(0), toInt64(0), toInt64(0), toInt64(0), toInt128(0),
               toUInt8(1), hour * {carbon.HOUR_MS}, sum(energy_mj) / 1000
        FROM (SELECT cluster, job_id, definition_version, hour, energy_mj FROM {db}.closed_energy
              WHERE {b.committed(db)} AND {scope_cond} AND NOT {record_days})
        GROUP BY cluster, job_id, definition_version, hour
        UNION ALL""" if carbon_too else ""
    parts = f"""
        SELECT {keys}, toUInt8(0) AS open, toUInt8(1) AS money,
               sumIf(toInt64(gpu_ms), line != 'idle') AS x, sumIf(toInt64(gpu_ms), line = 'idle') AS i,
               sum(toInt64(effective_gpu_ms)) AS e, sum(toInt128(cost_micros)) AS c, {no_energy}
        FROM {db}.closed_job_cost WHERE {b.committed(db)} AND {scope_cond}
        GROUP BY cluster, job_id, definition_version
        UNION ALL
        SELECT {keys}, toUInt8(0), toUInt8(1),
               sumIf(gpu_ms, line != 'idle'), sumIf(gpu_ms, line = 'idle'), sum(effective_gpu_ms), sum(cost_micros),
               {no_energy}
        FROM {db}.bill_adjustments WHERE {b.committed(db)} AND {scope_cond}
        GROUP BY cluster, job_id, definition_version
        UNION ALL{energy}
        SELECT {keys}, toUInt8(max(is_open)), toUInt8(max(is_open)),
               sumIf(toInt64(gpu_ms), is_open AND state = 'executing'),
               sumIf(toInt64(gpu_ms), is_open AND state = 'allocated_idle'),
               sumIf(toInt64(effective_gpu_ms), is_open), sumIf(cost_micros, is_open),
               toUInt8(1), bucket_ms, sum(energy_mj) / 1000
        FROM ({live})
        GROUP BY cluster, job_id, definition_version, bucket_ms"""
    sums = "max(open) AS open, max(money) AS money, sum(x) AS x, sum(i) AS i, sum(e) AS e, sum(c) AS c"
    if not carbon_too:
        return f"SELECT cluster, job_id, definition_version, {sums} FROM ({parts}) GROUP BY ALL", params
    sql = carbon.co2e_sql(db, parts, ("cluster", "job_id", "definition_version"),
                          f"{sums}, max(has_energy) AS has_energy")
    return sql, params


def open_basis_sql(client, db: str, day_from: dt.date, day_to: dt.date) -> tuple[str, dict[str, Any]]:
    """SQL and parameters of the open days' bill basis of [day_from, day_to] (as _open_basis_and_carbon
    reads it, without carbon): per day, cluster, tenant, queue, job, attempt, definition version and
    state, its gpu_ms, effective_gpu_ms, cost_micros and records, each record id once, as a close run
    reads it. Closed days give no row."""
    conds, params = _where({"day_from": day_from, "day_to": day_to}, ("day_from", "day_to"))
    grouped, params, _ = _grouped_open_usage_sql(client, db, conds, params, None)
    return f"SELECT * FROM ({grouped}) WHERE state != '' AND records > 0", params


def _grouped_open_usage_sql(client, db: str, conds: Sequence[str], params: dict[str, Any],
                            definition: dict | None) -> tuple[str, dict[str, Any], str]:
    """The open days' usage grouped per attempt and state (and, with a carbon `definition`, also per day,
    cluster, tenant, version and carbon bucket with state ''), its parameters and the record days'
    condition (_open_basis_and_carbon)."""
    from gpuledger.warehouse import bills as b

    exact_days, raw_days, is_open, bucket, record_days, day_params = _live_days(client, db, definition)
    params = {**params, **day_params}
    live = f"SELECT *, {is_open} AS is_open FROM ({b.live_usage_sql(db, exact_days, raw_days, bucket, conds)})"
    # rows with a state: the basis (per attempt and state); rows without: energy per hour (state ''). The
    # usage comes grouped per attempt, state and hour; the two groupings are made of those rows. Without
    # a carbon definition, the basis only (0.06 s against 0.09 s for an open day of 13.6 M records)
    basis_keys = "day, cluster, tenant, queue, job_id, attempt, definition_version, state"
    grouping = (f"GROUPING SETS (({basis_keys}), (day, cluster, tenant, definition_version, bucket_ms))"
                if definition is not None else basis_keys)
    grouped = f"""
        SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(queue) AS queue, job_id,
               attempt, toString(definition_version) AS definition_version, toString(state) AS state,
               toInt64({"bucket_ms" if definition is not None else "0"}) AS start_ms, toUInt64(sum(g)) AS gpu_ms,
               toUInt64(sum(e)) AS effective_gpu_ms,
               sum(c) AS cost_micros, toUInt64(sum(n)) AS records, sum(j) / 1000 AS energy_j
        FROM (
            SELECT day, cluster, tenant, queue, job_id, attempt, definition_version, state, bucket_ms,
                   sumIf(gpu_ms, is_open) AS g, sumIf(effective_gpu_ms, is_open) AS e,
                   sumIf(cost_micros, is_open) AS c, sumIf(records, is_open) AS n, sum(energy_mj) AS j
            FROM ({live})
            GROUP BY day, cluster, tenant, queue, job_id, attempt, definition_version, state, bucket_ms)
        GROUP BY {grouping}"""
    return grouped, params, record_days


def _open_basis_and_carbon(client, db: str, conds: Sequence[str], params: dict[str, Any], *,
                           with_carbon: bool) -> tuple[list[dict], dict[tuple, float], str | None]:
    """The open days' bill basis (jobs' usage per day, attempt and state, each record id once, as a close
    run reads it: bills.fetch_day_usage) and the carbon (kg CO2e) per day, cluster, tenant and definition version of every
    day `conds` select, with the carbon version (None without a definition). One query: the open days'
    records are read once for both (GROUPING SETS); closed days' carbon comes from closed_energy
    (docs/carbon.md). Without `with_carbon`, the basis only."""
    from gpuledger.warehouse import bills as b
    from gpuledger.warehouse import carbon

    definition = _carbon_definition(client, db) if with_carbon else None
    grouped, params, record_days = _grouped_open_usage_sql(client, db, conds, params, definition)
    if definition is None:
        rows = _query(client, grouped, params)
    else:
        closed = f"""
            SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, '' AS queue, '' AS job_id,
                   toUInt32(0) AS attempt, toString(definition_version) AS definition_version, '' AS state,
                   toInt64(hour * {carbon.HOUR_MS}) AS start_ms, toUInt64(0) AS gpu_ms, toUInt64(0) AS effective_gpu_ms,
                   toInt128(0) AS cost_micros, toUInt64(0) AS records, sum(energy_mj) / 1000 AS energy_j
            FROM (SELECT day, cluster, tenant, definition_version, hour, energy_mj FROM {db}.closed_energy
                  WHERE {b.committed(db)} AND NOT {record_days} AND {_and(conds)})
            GROUP BY day, cluster, tenant, definition_version, hour"""
        rows = _query(client, carbon.intensity_join_sql(db, f"{grouped} UNION ALL {closed}"),
                      {**params, **carbon.definition_params(definition)})
    basis = [r for r in rows if r["state"] and r["records"]]
    grams: dict[tuple, list[float]] = {}
    if definition is not None:
        for r in rows:
            if not r["state"]:
                grams.setdefault((r["day"], r["cluster"], r["tenant"], r["definition_version"]), []).append(r["co2e_g"])
    # fsum: exact, so the figure does not depend on the order the rows came in
    kg = {key: math.fsum(values) / 1000 for key, values in grams.items()}
    return basis, kg, definition["carbon_version"] if definition else None


def _queues(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """Queue efficiency per cohort day, cluster and queue (and tenant, with the tenant filter):
    closed rows (closed_queue_efficiency, as the latest run that wrote the cohort day left them) for
    closed days, live figures from deduplicated usage for open ones; `status` says which."""
    from gpuledger.warehouse import bills as b

    conds, params = _where(filters, sorted(REPORT_FILTERS["queues"] - {"tenant"}))
    by_tenant = filters.get("tenant") is not None
    if by_tenant:
        params["tenant"] = str(filters["tenant"])
    tenant_cond = "tenant = {tenant:String}" if by_tenant else "tenant = ''"
    cols = ("day, toString(cluster) AS cluster, toString(queue) AS queue, toString(tenant) AS tenant, attempts, "
            "requested_gpu_seconds, allocated_gpu_seconds, executed_gpu_seconds, "
            "if(requested_gpu_seconds = 0, NULL, allocated_gpu_seconds / requested_gpu_seconds) AS allocated_to_requested, "
            "if(allocated_gpu_seconds = 0, NULL, executed_gpu_seconds / allocated_gpu_seconds) AS executed_to_allocated, "
            "if(requested_gpu_seconds = 0, NULL, executed_gpu_seconds / requested_gpu_seconds) AS executed_to_requested, "
            "waits, queue_wait_p50_s, queue_wait_p90_s, queue_wait_p99_s, queue_wait_mean_s, queue_wait_max_s")
    # per cohort day and cluster the latest committed run's rows: a later run revises a closed cohort's
    # figures (an attempt allocated after the close, §6a), it does not add to them
    closed = (f"SELECT 'closed' AS status, {cols} FROM ({b.latest_queue_rows_sql(db)}) "
              f"WHERE {tenant_cond} AND {_and(conds)}")
    attempt_conds = ["a.tenant = {tenant:String}"] if by_tenant else []
    if filters.get("cluster") is not None:
        attempt_conds.append("a.cluster = {cluster:String}")
    # the open cohorts only: their attempts' usage is all that is deduplicated
    open_cohorts = [*conds, f"(cluster, day) NOT IN ({b.closed_days_sql(db)})"]
    # the open days whose hourly sums are exact (each counted once in one_reading, where the bills and
    # jobs reports ask too): every open day, not only the range's, since a cohort's usage runs on after
    # its cohort day
    cluster = params.get("cluster")
    open_days = {c: ds for c, ds in _open_days(client, db).items() if cluster is None or c == cluster}
    exact_days, day_params = b.days_condition(_exact_days(client, db, open_days), "exact_days")
    params.update(day_params)
    live = b.queue_efficiency_sql(db, ["cluster = {cluster:String}"] if filters.get("cluster") is not None else [],
                                  attempt_conds, by_tenant, open_cohorts, exact_days)
    opened = (f"SELECT 'open' AS status, {cols} FROM ({live}) WHERE {_and(conds)} "
              f"AND (cluster, day) NOT IN ({b.closed_days_sql(db)})")
    sql = f"SELECT day, status, * EXCEPT (day, status) FROM ({closed} UNION ALL {opened}) ORDER BY day, cluster, queue"
    rows = _query(client, sql + _limit(filters, params), params)
    if not by_tenant:
        for r in rows:
            del r["tenant"]
    return rows


def _capacity(client, db: str, filters: dict[str, Any]) -> list[dict]:
    conds, params = _where(filters, sorted(REPORT_FILTERS["capacity"]))
    sql = f"SELECT * FROM {db}.capacity_daily WHERE {_and(conds)} ORDER BY day, cluster, gpu_model, definition_version"
    rows = _query(client, sql + _limit(filters, params), params)
    currencies = definition_currencies(client, db, filters.get("currency")) if rows else {}
    for r in rows:
        r["currency"] = currency_of(currencies, r["definition_version"])
    return rows


def _unmatched(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """What the ledger could not match, one row per finding (docs/reliability.md, "Nothing unmatched
    in silence"):
    - unknown_node: an allocation on a node that never sent a GPU sample (not in node_inventory);
    - allocation_gpu_not_billed: an allocation naming more GPUs on a node than the attempt was billed
      for there (a UUID or index the node's agent does not report, e.g. a MIG UUID without the
      agent's MIG inventory); its MIG instances count as one GPU at least, since several instances
      of one GPU are billed together on their parent;
    - mig_allocation: an allocation naming MIG instances (billed as shares of the parent GPU; listed
      so that MIG use is visible; `gpus_billed`, GPUs not names, says whether they resolved);
    - busy_unallocated: GPU time that no allocation holds while the GPU works (use above
      `busy_floor_pct`, default 1 %): a job the scheduler does not know, or a missing event."""
    conds, params = _where(filters, sorted(REPORT_FILTERS["unmatched"]))
    where = _and(conds)
    floor = filters.get("busy_floor_pct", DEFAULT_BUSY_FLOOR_PCT)
    try:
        params["floor"] = float(floor)
    except (TypeError, ValueError):
        params["floor"] = math.nan
    # a floor below 0 counted every unallocated GPU that reports a utilization as busy
    if not (math.isfinite(params["floor"]) and 0 <= params["floor"] <= 100):
        raise ValueError(f"busy_floor_pct must be a number of percent from 0 to 100, got {floor!r}")
    # the default floor's own per-day aggregate (sql/0025, 100x fewer rows), else any whole-number
    # floor's (sql/0033: util_step > F exactly when util_pct > F), else the scan of the records
    aggregate = ((f"{db}.busy_unallocated_daily", "1") if params["floor"] == DEFAULT_BUSY_FLOOR_PCT else
                 (f"{db}.unallocated_util_daily", "util_step > {floor:Float64}")
                 if params["floor"].is_integer() and 0 <= params["floor"] <= 100 else None)
    if aggregate:
        busy = f"""
            SELECT cluster, node, gpu_uuid, min(day) AS first_day, sum(gpu_ms) AS gpu_ms
            FROM {aggregate[0]} WHERE {aggregate[1]} AND {where} GROUP BY cluster, node, gpu_uuid HAVING gpu_ms > 0"""
    else:
        busy = f"""
            SELECT cluster, node, gpu_uuid, min(day) AS first_day, sum(gpu_ms) AS gpu_ms
            FROM {db}.usage_raw WHERE state = 'unallocated' AND util_pct > {{floor:Float64}} AND {where}
            GROUP BY cluster, node, gpu_uuid"""
    sql = f"""
        WITH allocations AS (
            -- gpus_least: the fewest GPUs the names can be billed on, each whole GPU (UUID or index) its
            -- own and the MIG instances one parent at least (several instances of one GPU add up on it,
            -- docs/accounting.md §1b; the warehouse keeps no MIG inventory to tell their parents apart)
            SELECT cluster, job_id, attempt, node, groupUniqArray(ref) AS refs, min(day) AS first_day,
                   uniqExactIf(ref, startsWith(ref, 'MIG-')) AS mig_refs,
                   length(refs) - mig_refs + (mig_refs > 0) AS gpus_least
            FROM (SELECT cluster, job_id, attempt, day, node, ref FROM {db}.job_events
                  ARRAY JOIN gpu_nodes AS node, gpu_uuids AS ref
                  WHERE kind = 'allocated' AND {where})
            GROUP BY cluster, job_id, attempt, node
        ),
        billed AS (
            -- the per-job aggregate (sql/0018, sorted by job): the GPUs each allocation's attempt was billed
            -- on, on whatever day (its first record is at the allocation), without scanning usage_raw
            SELECT cluster, job_id, attempt, node, uniqExact(gpu_uuid) AS gpus
            FROM {db}.job_gpu_usage
            WHERE (job_id, attempt, cluster) IN (SELECT job_id, attempt, cluster FROM allocations)
            GROUP BY cluster, job_id, attempt, node
        ),
        known_nodes AS (SELECT DISTINCT cluster, node FROM {db}.node_inventory)
        SELECT kind, first_day AS day, cluster, node, job_id, attempt, gpus_named, gpus_billed, gpu_hours, detail FROM (
            SELECT multiIf(k.node = '', 'unknown_node', b.gpus < a.gpus_least, 'allocation_gpu_not_billed',
                           'mig_allocation') AS kind,
                   a.first_day AS first_day, a.cluster AS cluster, a.node AS node, a.job_id AS job_id, a.attempt AS attempt,
                   length(a.refs) AS gpus_named, b.gpus AS gpus_billed, CAST(NULL AS Nullable(Float64)) AS gpu_hours,
                   arrayStringConcat(arraySort(a.refs), ' ') AS detail
            FROM allocations AS a
            LEFT JOIN billed AS b USING (cluster, job_id, attempt, node)
            LEFT JOIN known_nodes AS k ON k.cluster = a.cluster AND k.node = a.node
            WHERE k.node = '' OR b.gpus < a.gpus_least OR a.mig_refs > 0
            UNION ALL
            SELECT 'busy_unallocated' AS kind, first_day, cluster, node, '' AS job_id, toUInt32(0) AS attempt,
                   toUInt64(0) AS gpus_named, toUInt64(0) AS gpus_billed, gpu_ms / 3600000 AS gpu_hours,
                   gpu_uuid AS detail
            FROM ({busy})
        )
        ORDER BY kind, cluster, node, job_id, attempt, detail"""
    return _query(client, sql + _limit(filters, params), params)


def _alerts(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """Behaviour alerts (docs/alerts.md), one row per alert in its latest status, oldest first; `day`
    is the day it opened."""
    conds, params = _where(filters, sorted(REPORT_FILTERS["alerts"]))
    sql = f"""
        SELECT opened_at, closed_at, status, rule, cluster, job_id, attempt, tenant, queue,
               arrayStringConcat(gpus, ' ') AS gpus, round(open_minutes, 1) AS open_minutes,
               definition_version, message
        FROM {db}.alerts_latest WHERE {_and(conds)}
        ORDER BY opened_at, cluster, job_id, attempt, rule"""
    return _query(client, sql + _limit(filters, params), params)


#: lifecycle kinds that end an attempt (schemas/models.py TERMINAL_KINDS): a named job released its GPUs
_RELEASED = "('completed', 'failed', 'preempted', 'cancelled')"


def _suggestions(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """Reclaim suggestions (docs/alerts.md, "Reclaim"), one row per suggestion in its latest status.
    `followed`: a job it named ended (released its GPUs) within `followed_within_s` (default 3600,
    the ledger's [reclaim] followed_within_s) after it opened; `released_gpus` the GPUs those jobs held."""
    conds, params = _where(filters, sorted(REPORT_FILTERS["suggestions"]))
    params["within"] = int(float(filters.get("followed_within_s", 3600.0)) * 1000)
    sql = f"""
        WITH s AS (SELECT * FROM {db}.reclaim_suggestions_latest WHERE {_and(conds)}),
        named AS (
            SELECT suggestion_id, cluster, opened_at_ms, job_id, attempt, gpus_freed
            FROM s ARRAY JOIN job_ids AS job_id, job_attempts AS attempt, job_gpus_freed AS gpus_freed
        ),
        ended AS (
            SELECT cluster, job_id, attempt, min(ts_ms) AS end_ms FROM {db}.job_events
            WHERE kind IN {_RELEASED} AND (cluster, job_id) IN (SELECT cluster, job_id FROM named)
            GROUP BY cluster, job_id, attempt
        ),
        released AS (
            SELECT n.suggestion_id AS suggestion_id, count() AS released_jobs, sum(n.gpus_freed) AS released_gpus
            FROM named AS n INNER JOIN ended AS e ON e.cluster = n.cluster AND e.job_id = n.job_id
                                                   AND e.attempt = n.attempt
            WHERE e.end_ms >= n.opened_at_ms AND e.end_ms <= n.opened_at_ms + {{within:Int64}}
            GROUP BY n.suggestion_id
        )
        SELECT s.opened_at AS opened_at, s.withdrawn_at AS withdrawn_at, s.status AS status, s.cluster AS cluster,
               s.queue AS queue, s.execution_rate AS execution_rate, arrayStringConcat(s.job_ids, ' ') AS jobs,
               s.gpus_freed AS gpus_freed, s.waiting_gpus AS waiting_gpus, s.waiting_priority AS waiting_priority,
               s.idle_cost_micros / 1e6 AS idle_cost, s.currency AS currency,
               CAST(ifNull(r.released_jobs, 0) > 0 AS Bool) AS followed, ifNull(r.released_gpus, 0) AS released_gpus,
               s.message AS message
        FROM s LEFT JOIN released AS r ON r.suggestion_id = s.suggestion_id
        ORDER BY opened_at, cluster, queue"""
    return _query(client, sql + _limit(filters, params), params)


def _dimensions(by: Any) -> list[str]:
    if by is None:
        by = ("day", "cluster")
    if isinstance(by, str):
        by = [part.strip() for part in by.split(",") if part.strip()]
    dims = list(dict.fromkeys(by))
    bad = [d for d in dims if d not in UTILIZATION_DIMENSIONS]
    if bad or not dims:
        raise ValueError(f"utilization 'by' takes {', '.join(UTILIZATION_DIMENSIONS)} (comma-separated); got {by!r}")
    # a stable, readable column order whatever order the caller gave
    return [d for d in UTILIZATION_DIMENSIONS if d in dims]


def _utilization(client, db: str, filters: dict[str, Any]) -> list[dict]:
    """Three layers per group: scheduling = allocated / (capacity − down), execution = executing /
    allocated, hardware = time-weighted util over executing slices that report it; each also as a
    share of capacity. Grouped by tenant or queue, capacity and down are those of the group's
    day/cluster/gpu_model (tenants hold no capacity), so tenants' scheduling shares add up."""
    dims = _dimensions(filters.get("by"))
    cap_dims = [d for d in dims if d in _CAPACITY_DIMENSIONS]
    cap_conds, params = _where(filters, sorted(REPORT_FILTERS["utilization"] - {"tenant", "queue"}))
    job_conds, job_params = _where(filters, ["tenant", "queue"])
    params.update(job_params)
    use_conds = cap_conds + job_conds
    if {"tenant", "queue", "job_id"} & set(dims):
        use_conds.append("job_id != ''")  # down/unallocated slices belong to no tenant, queue or job
    dim_sql = ", ".join(dims)
    usage = (
        f"SELECT {dim_sql}, "
        "sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS allocated_ms, "
        "sumIf(gpu_ms, state = 'executing') AS executing_ms, "
        "sumIf(util_weighted_gpu_ms, state = 'executing') AS util_weighted_ms, "
        "sumIf(util_gpu_ms, state = 'executing') AS util_ms "
        f"FROM {db}.usage_by_job_daily WHERE {_and(use_conds)} GROUP BY {dim_sql}"
    )
    capacity = (
        ("SELECT " + "".join(f"{d}, " for d in cap_dims))
        + "sum(gpu_ms) AS capacity_ms, sumIf(gpu_ms, state = 'down') AS down_ms "
        + f"FROM {db}.usage_by_job_daily WHERE {_and(cap_conds)}"
        + (f" GROUP BY {', '.join(cap_dims)}" if cap_dims else "")
    )
    join = f"LEFT JOIN ({capacity}) AS c USING ({', '.join(cap_dims)})" if cap_dims else f"CROSS JOIN ({capacity}) AS c"
    sql = f"""
        SELECT {dim_sql},
            capacity_ms / 1000 AS capacity_gpu_seconds,
            down_ms / 1000 AS down_gpu_seconds,
            allocated_ms / 1000 AS allocated_gpu_seconds,
            executing_ms / 1000 AS executing_gpu_seconds,
            if(capacity_ms - down_ms <= 0, NULL, allocated_ms / (capacity_ms - down_ms)) AS scheduling_utilization,
            if(allocated_ms = 0, NULL, executing_ms / allocated_ms) AS execution_utilization,
            if(util_ms = 0, NULL, util_weighted_ms / util_ms / 100) AS hardware_utilization,
            if(capacity_ms = 0, NULL, allocated_ms / capacity_ms) AS scheduling_share_of_capacity,
            if(capacity_ms = 0, NULL, executing_ms / capacity_ms) AS execution_share_of_capacity,
            if(capacity_ms = 0 OR util_ms = 0, NULL,
               util_weighted_ms / util_ms / 100 * executing_ms / capacity_ms) AS hardware_share_of_capacity
        FROM ({usage}) AS g {join}
        ORDER BY {dim_sql}"""
    return _query(client, sql + _limit(filters, params), params)


_FETCHERS = {"bills": _bills, "jobs": _jobs, "queues": _queues, "utilization": _utilization, "capacity": _capacity,
             "unmatched": _unmatched, "alerts": _alerts, "suggestions": _suggestions}


def fetch(client, database: str, name: str, **filters) -> list[dict]:
    """Rows of one report as dicts (dates as datetime.date, absent values as None).

    Filters (each report takes a subset; an unknown one is an error): day_from, day_to (inclusive
    UTC dates), cluster, tenant, queue, gpu_model, job_id, definition_version, limit. The jobs report
    takes `reference_cost_per_gpu_hour` (opportunity cost of waiting = queue_wait_gpu_hours × it;
    None leaves opportunity_cost empty); utilization takes `by`: any of day, cluster, gpu_model,
    queue, tenant (a list or comma-separated; default day,cluster)."""
    _check(name, filters)
    return _FETCHERS[name](client, quoted_database(database), filters)


def _flag_priced_by_default(client, db: str, rows: list[dict], queue: str | None = None) -> None:
    """priced_by_default_gpu_hours of each bill row (not adjustments): its GPU time of models priced
    under the [unpriced] policy, from the usage aggregate (docs/accounting.md §4b), read for the rows' days
    (and only the `queue` filter's queue, as the rows' money is)."""
    days = sorted({row["day"] for row in rows if row.get("status") != "adjustment"})
    queue_cond = " AND queue = {queue:String}" if queue is not None else ""
    hours = {(r["day"], str(r["cluster"]), str(r["tenant"]), str(r["definition_version"])): r["h"] for r in _query(
        client, f"SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(definition_version) "
                f"AS definition_version, sum(priced_by_default_gpu_ms) / 3600000 AS h FROM {db}.usage_by_job_daily "
                "WHERE day IN {days:Array(Date)} AND priced_by_default_gpu_ms > 0 AND job_id != '' "
                f"AND state IN ('executing', 'allocated_idle'){queue_cond} "
                "GROUP BY day, cluster, tenant, definition_version",
        {"days": days, **({"queue": str(queue)} if queue is not None else {})})} if days else {}
    for row in rows:
        if row.get("status") != "adjustment":
            row["priced_by_default_gpu_hours"] = hours.get(
                (row["day"], row["cluster"], row["tenant"], row["definition_version"]), 0.0)
