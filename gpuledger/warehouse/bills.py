"""Closed billing periods (docs/accounting.md §6a, docs/reliability.md "Closed periods").

Why one file: closing, adjusting, publishing and auditing billing days share the closed tables'
rules (what counts, run ids, horizons) stated once below.

A billing day D of a cluster closes once the warehouse's event-time horizon of that cluster — the
largest `end_ms` in `usage_raw` for it, i.e. the lifecycle watermark as far as the warehouse has seen
it (the worker closes usage only behind the watermark) — has reached the end of D plus the grace
`GPULEDGER_BILLS_CLOSE_GRACE_S`. Closing writes the day's bill rows into the append-only tables of
sql/0013, computed from usage deduplicated by (cluster, record_id), under a new bill run. A close run
that writes anything commits by inserting its `bill_runs` row last; readers only trust rows whose
run is in `bill_runs`, so a run that died half-way leaves nothing that counts.

At every run the closed days of the last `GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS` are recomputed from
current data and compared, attempt by attempt, with what was closed plus the adjustments already
booked; the difference is booked into the cluster's next open day as `bill_adjustments` rows with a
reason (`diff_adjustments`). Running the closer again with nothing new books nothing.

Closing also writes each day's energy per hour into `closed_energy` (carbon of closed days, sql/0023);
the adjustment pass writes the difference late records make there (`diff_amounts`), keyed by the day
they belong to, under the same run. Likewise each day's cluster idle (unallocated usage, each record
once) into `closed_cluster_idle` (sql/0039), the idle `report bills --idle-redistribution` shares; the
difference late records make to it is booked on the next open day (`diff_amounts`), as adjustments
are, so a closed day's share never changes.

One close run at a time per warehouse on a host: `close_due` holds an exclusive lock file
(`close_lock_path`, fcntl.flock) for the whole run; a second run waits for it, or with `lock_wait_s`
gives up and does nothing (`gpuledger bills close` does, for cron). Across hosts there is no lock: just
before a run writes anything it reads `bill_runs` again and leaves out every cluster for which a run
committed since it started (the next run does that cluster's work from the new state), so two closers
on two hosts double a bill only if both commit in the moment between that read and the commit.

After closing, a run notes the open days' hours whose hourly usage (sql/0027) it found exact
(`record_exact_hours`, sql/0035), so that the reports count only the hours written since
(`exact_hourly_days`).

The pure parts (lines, due days, the diff, messages) are plain functions tested in
tests/unit/test_bills.py; the rest reads and writes the warehouse.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import logging
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gpuledger.warehouse import idle_stretches
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.retention import closed_rows_kept_from

log = logging.getLogger(__name__)

DAY_MS = 86_400_000
EPOCH = dt.date(1970, 1, 1)
LINES = ("compute", "idle", "failed_retry")
LATE_OUTCOME = "late_lifecycle_outcome"
LATE_SAMPLES = "late_samples"
REASONS = (LATE_OUTCOME, LATE_SAMPLES)

#: (day, cluster, tenant, queue, job_id, attempt, definition_version)
AttemptDay = tuple
#: [gpu_ms, effective_gpu_ms, cost_micros]
Amount = list


# --------------------------------------------------------------------------- pure parts
def line_of(state: str, outcome: str | None) -> str:
    """The bill line of usage in `state` of an attempt with `outcome` (as tenant_daily_bill)."""
    if state == "allocated_idle":
        return "idle"
    return "failed_retry" if outcome == "failed" else "compute"


def day_end_ms(day: dt.date) -> int:
    return ((day - EPOCH).days + 1) * DAY_MS


def last_due_day(horizon_ms: int, grace_s: float) -> dt.date | None:
    """The last day D with end of D + grace <= horizon (None before 1970-01-01 closes)."""
    n = (horizon_ms - int(round(grace_s * 1000))) // DAY_MS - 1
    return EPOCH + dt.timedelta(days=n) if n >= 0 else None


def days_between(first: dt.date, last: dt.date) -> list[dt.date]:
    return [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]


def job_lines(basis: Iterable[Mapping[str, Any]], outcomes: Mapping[tuple, str]) -> dict[tuple, Amount]:
    """Attempt-day line amounts: {(day, cluster, tenant, queue, job_id, attempt, dv, line): [gpu_ms, eff, cost]}.

    `basis` rows: day, cluster, tenant, queue, job_id, attempt, definition_version, state, gpu_ms,
    effective_gpu_ms, cost_micros (executing / allocated_idle usage of jobs, deduplicated);
    `outcomes`: {(cluster, job_id, attempt): outcome}."""
    out: dict[tuple, Amount] = {}
    for r in basis:
        outcome = outcomes.get((r["cluster"], r["job_id"], int(r["attempt"])), "")
        key = (r["day"], r["cluster"], r["tenant"], r["queue"], r["job_id"], int(r["attempt"]),
               r["definition_version"], line_of(r["state"], outcome))
        acc = out.setdefault(key, [0, 0, 0])
        acc[0] += int(r["gpu_ms"])
        acc[1] += int(r["effective_gpu_ms"])
        acc[2] += int(r["cost_micros"])
    return out


def tenant_lines(lines: Mapping[tuple, Amount]) -> dict[tuple, Amount]:
    """Attempt-day lines summed to (day, cluster, tenant, queue, line, dv)."""
    out: dict[tuple, Amount] = {}
    for (day, cluster, tenant, queue, _job, _attempt, dv, line), amount in lines.items():
        acc = out.setdefault((day, cluster, tenant, queue, line, dv), [0, 0, 0])
        for i in range(3):
            acc[i] += amount[i]
    return out


def diff_adjustments(booked: Mapping[tuple, Amount], now: Mapping[tuple, Amount],
                     outcomes: Mapping[tuple, str]) -> list[tuple[tuple, str, Amount]]:
    """What to book so that booked + adjustments == now, attempt by attempt, with the reason.

    Keys are those of `job_lines` (attempt-day × line). For each attempt-day, with L the line its
    executing time belongs to under the attempt's current outcome (compute, or failed_retry when it
    failed) and O the other one:
    - what is booked on O moves to L: (O, −booked[O]) and (L, +booked[O]), reason late_lifecycle_outcome;
    - L's remaining difference, now[L] − booked[L] − booked[O], is late_samples;
    - idle's difference, now[idle] − booked[idle], is late_samples.
    Zero amounts are left out. Returns [(key, reason, [gpu_ms, eff, cost])], in key order."""
    groups: dict[tuple, dict[str, tuple[Amount, Amount]]] = {}
    zero = [0, 0, 0]
    for source, index in ((booked, 0), (now, 1)):
        for key, amount in source.items():
            pair = groups.setdefault(key[:7], {}).setdefault(key[7], ([0, 0, 0], [0, 0, 0]))
            for i in range(3):
                pair[index][i] += amount[i]
    out: list[tuple[tuple, str, Amount]] = []

    def add(group: tuple, line: str, reason: str, amount: Sequence[int]) -> None:
        if any(amount):
            out.append((group + (line,), reason, list(amount)))

    for group in sorted(groups, key=lambda g: tuple(str(x) for x in g)):
        lines = groups[group]
        b = {line: lines.get(line, (zero, zero))[0] for line in LINES}
        n = {line: lines.get(line, (zero, zero))[1] for line in LINES}
        _day, cluster, _tenant, _queue, job_id, attempt, _dv = group
        cur = line_of("executing", outcomes.get((cluster, job_id, attempt), ""))
        other = "compute" if cur == "failed_retry" else "failed_retry"
        # usage now on `other` can only come from an outcome that is not the current one: none
        moved = b[other]
        add(group, other, LATE_OUTCOME, [-x for x in moved])
        add(group, cur, LATE_OUTCOME, moved)
        add(group, cur, LATE_SAMPLES, [n[cur][i] + n[other][i] - b[cur][i] - b[other][i] for i in range(3)])
        add(group, "idle", LATE_SAMPLES, [n["idle"][i] - b["idle"][i] for i in range(3)])
    return out


#: (day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state)
EnergyKey = tuple
ENERGY_KEYS = ("day", "cluster", "hour", "tenant", "queue", "job_id", "attempt", "definition_version", "state")


def diff_amounts(booked: Mapping[tuple, Sequence[int]], now: Mapping[tuple, Sequence[int]]) -> list[tuple]:
    """The rows that make booked + rows == now: [(key, [a, b])] for every key whose two amounts differ,
    in key order. For closed_energy (sql/0023: whole millijoules and record count per EnergyKey) and
    closed_cluster_idle (sql/0039: gpu_ms and cost_micros per day and definition version)."""
    out = []
    for key in sorted(set(booked) | set(now), key=lambda k: tuple(str(x) for x in k)):
        b, n = booked.get(key, (0, 0)), now.get(key, (0, 0))
        delta = [int(n[0]) - int(b[0]), int(n[1]) - int(b[1])]
        if any(delta):
            out.append((key, delta))
    return out


# --------------------------------------------------------------------------- SQL helpers
def _q(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


COMMITTED = "bill_run_id IN (SELECT bill_run_id FROM {db}.bill_runs)"


def committed(db: str) -> str:
    """SQL condition: the row belongs to a committed bill run."""
    return COMMITTED.format(db=db)


def closed_days_sql(db: str) -> str:
    """(cluster, day) pairs that are closed (by committed runs)."""
    return f"SELECT cluster, day FROM {db}.closed_days WHERE {committed(db)}"


def open_days_sql(db: str) -> str:
    """(cluster, day) pairs with usage that are not closed, from the small per-day aggregate: as an
    `IN` filter it reaches usage_raw's sort key (cluster, day, ...), where `NOT IN closed` scanned.
    A day that still has committed closed bill rows is not open, even once its closed_days row is gone:
    under GPULEDGER_RETENTION_BILLS_DAYS the tables expire at their own merges (docs/retention.md), and
    the day must not read both closed and live."""
    return (f"SELECT DISTINCT cluster, day FROM {db}.usage_capacity_daily "
            f"WHERE (cluster, day) NOT IN ({closed_days_sql(db)}) "
            f"AND (cluster, day) NOT IN (SELECT cluster, day FROM {db}.closed_tenant_bill WHERE {committed(db)})")


def days_by_cluster(client, sql: str) -> dict[str, list[dt.date]]:
    """{cluster: sorted days} of a query returning (cluster, day) pairs (open_days_sql, carbon_record_days)."""
    out: dict[str, list[dt.date]] = {}
    for r in _q(client, f"SELECT toString(cluster) AS cluster, day FROM ({sql}) ORDER BY cluster, day"):
        out.setdefault(r["cluster"], []).append(r["day"])
    return out


def days_condition(days: Mapping[str, Sequence[dt.date]], name: str) -> tuple[str, dict[str, Any]]:
    """SQL condition (and its parameters, named `name`_...) true for rows of these clusters' days, written
    `cluster = c AND day IN (...)` per cluster: it reaches usage_raw's sort key, and costs no per-row
    lookup of a (cluster, day) tuple in a set (0.08 s against 0.4 s for one open day of 13.5 M records)."""
    if not days:
        return "0", {}
    terms, params = [], {}
    for i, cluster in enumerate(sorted(days)):
        terms.append(f"(cluster = {{{name}_c{i}:String}} AND day IN {{{name}_d{i}:Array(Date)}})")
        params[f"{name}_c{i}"] = cluster
        params[f"{name}_d{i}"] = sorted(days[cluster])
    return f"({' OR '.join(terms)})", params


def dedup_usage_sql(db: str, conds: Sequence[str] = (), columns: str = "*") -> str:
    """usage_raw with each (cluster, record_id) once: `FINAL` of the ReplacingMergeTree (sql/0022: a
    record id is gpu_uuid/start_ms/slot, so copies of a record share the whole sort key and are
    identical; merges keep one, FINAL folds those not merged yet)."""
    where = " AND ".join(conds) if conds else "1"
    return f"SELECT {columns} FROM {db}.usage_raw FINAL WHERE {where}"


#: the usage a bill (and its carbon) charges: jobs' executing and allocated-idle time
BILLED_USAGE = ("job_id != ''", "state IN ('executing', 'allocated_idle')")


#: usage_raw's hour, as usage_by_job_hourly and usage_raw's sort key have it
RAW_HOUR = "intDiv(start_ms, 3600000)"
#: per (day, hour) for _hour_counts: the records the hourly table counted, the count stored as exact
#: (sql/0035), and usage_raw's distinct records
HOURLY_COUNT = "SELECT day, hour, sum(records) AS n FROM {db}.usage_by_job_hourly"
STORED_COUNT = "SELECT day, hour, max(records) AS n FROM {db}.usage_exact_hours"
DISTINCT_COUNT = f"SELECT day, {RAW_HOUR} AS hour, count() AS n FROM {{db}}.usage_raw FINAL"


def exact_hourly_days(client, db: str, days: Mapping[str, Sequence[dt.date]], *,
                      checked_hours: bool = False) -> dict[str, list[dt.date]]:
    """The days of `days` ({cluster: days}) whose usage_by_job_hourly sums are exact (sql/0027): the
    table counted as many records as usage_raw holds distinct ones, so no record was inserted twice
    (its materialized view sums every copy; FINAL keeps one). One count per cluster (grouped by day:
    grouping by the cluster too cost twice as much).

    With `checked_hours` (the reports), an hour `record_exact_hours` found exact (sql/0035) whose hourly
    count is still the one stored is taken as exact without counting it again: the count only grows, so
    that hour had no insert since. On a day with such hours only the other hours are counted with FINAL
    (and must agree hour by hour), and the day must hold as many rows as the hourly table counted (a
    plain count(), answered from the primary key): a record deleted since shows there. At 13.6 M records
    a day this takes ~45 ms (the latest hour's FINAL, in the sink's small parts, most of it) against
    ~110 ms. A close run counts every day whole (the default)."""
    out: dict[str, list[dt.date]] = {}
    for cluster in sorted(days):
        wanted = sorted(days[cluster])
        summed = _hour_counts(client, HOURLY_COUNT.format(db=db), cluster, wanted)
        checked = _hour_counts(client, STORED_COUNT.format(db=db), cluster, wanted) if checked_hours else {}
        steady = {key for key, n in summed.items() if n and checked.get(key) == n}
        per_day: dict[dt.date, int] = {}
        for (day, _), n in summed.items():
            per_day[day] = per_day.get(day, 0) + n
        exact = []
        trusted_days = sorted({day for day, _ in steady})
        whole = [day for day in wanted if day not in trusted_days]
        if whole:  # no hour to trust: the day's distinct records, counted at once
            distinct = {r["day"]: int(r["n"]) for r in _q(
                client, f"SELECT day, count() AS n FROM {db}.usage_raw FINAL WHERE cluster = {{cluster:String}} "
                        "AND day IN {days:Array(Date)} GROUP BY day", {"cluster": cluster, "days": whole})}
            exact += [day for day in whole if distinct.get(day) and per_day.get(day) == distinct[day]]
        recount = sorted(hour for (day, hour), n in summed.items()
                         if n and day in trusted_days and (day, hour) not in steady)
        distinct_hours = _hour_counts(client, DISTINCT_COUNT.format(db=db), cluster, wanted, recount) if recount else {}
        for day in trusted_days:
            counted_again = all(distinct_hours.get((d, hour), 0) == n for (d, hour), n in summed.items()
                                if d == day and n and (d, hour) not in steady)
            # no GROUP BY: a count() on a primary-key range is answered from the index (~3 ms against ~35)
            held = _q(client, f"SELECT count() AS n FROM {db}.usage_raw WHERE cluster = {{cluster:String}} "
                              "AND day = {day:Date}", {"cluster": cluster, "day": day})[0]["n"]
            if counted_again and held == per_day[day]:
                exact.append(day)
        if exact:
            out[cluster] = sorted(exact)
    return out


def _hour_counts(client, select: str, cluster: str, days: Sequence[dt.date],
                 hours: Sequence[int] | None = None) -> dict[tuple[dt.date, int], int]:
    """{(day, hour): n} of `select` (SELECT day, hour, <aggregate> AS n FROM <table>) over the cluster's
    days (and only these hours, where given: a condition on usage_raw's sort key)."""
    where = "cluster = {cluster:String} AND day IN {days:Array(Date)}"
    params: dict[str, Any] = {"cluster": cluster, "days": list(days)}
    if hours is not None:
        where += f" AND {RAW_HOUR} IN {{hours:Array(Int64)}}"
        params["hours"] = list(hours)
    return {(r["day"], int(r["hour"])): int(r["n"])
            for r in _q(client, f"{select} WHERE {where} GROUP BY day, hour", params)}


def record_exact_hours(client, database: str, days: Mapping[str, Sequence[dt.date]],
                       horizons: Mapping[str, int] | None = None) -> int:
    """Store in usage_exact_hours (sql/0035) the hours of `days` ({cluster: days}) whose hourly count
    equals usage_raw's distinct count, counting with FINAL only the hours not stored with their present
    count already. With `horizons` ({cluster: event-time horizon, ms}), an hour that ends after its
    cluster's horizon is left out: it is still being written, and would change at once. Returns how many
    hours were stored. `gpuledger bills close` runs it over the open days, so that a report counts only
    the hours that changed since (exact_hourly_days)."""
    from gpuledger.warehouse import insert_rows

    db = quoted_database(database)
    checked_at = dt.datetime.now(dt.timezone.utc)
    rows = []
    for cluster in sorted(days):
        wanted = sorted(days[cluster])
        summed = _hour_counts(client, HOURLY_COUNT.format(db=db), cluster, wanted)
        stored = _hour_counts(client, STORED_COUNT.format(db=db), cluster, wanted)
        until = (horizons or {}).get(cluster)
        todo = {hour for (day, hour), n in summed.items()
                if n and stored.get((day, hour)) != n and (until is None or (hour + 1) * 3_600_000 <= until)}
        if not todo:
            continue
        distinct = _hour_counts(client, DISTINCT_COUNT.format(db=db), cluster, wanted, sorted(todo))
        rows += [dict(cluster=cluster, day=day, hour=hour, records=n, checked_at=checked_at)
                 for (day, hour), n in sorted(summed.items()) if hour in todo and distinct.get((day, hour)) == n]
    if rows:
        insert_rows(client, "usage_exact_hours", rows, database=database)
    return len(rows)


def live_usage_sql(db: str, exact_days: str, raw_days: str, bucket: str, conds: Sequence[str] = ()) -> str:
    """Jobs' billed usage per day, cluster, tenant, queue, attempt, definition version, state and carbon
    bucket (bucket_ms), each record once: records, gpu_ms, effective_gpu_ms, cost_micros (Int128),
    energy_j, energy_mj (each record rounded to whole millijoules, then summed). Days where `exact_days`
    holds (conditions of days_condition) come from usage_by_job_hourly, their bucket the hour; days where
    `raw_days` holds from usage_raw deduplicated, their bucket `bucket` (carbon.bucket_sql). `conds`:
    more conditions on columns both tables have."""
    keys = "day, cluster, tenant, queue, job_id, attempt, definition_version, state"
    sums = ("toUInt64(sum({n})) AS records, toUInt64(sum(gpu_ms)) AS gpu_ms, "
            "toUInt64(sum(effective_gpu_ms)) AS effective_gpu_ms, sum(toInt128(cost_micros)) AS cost_micros, "
            "toFloat64(sum(energy_j)) AS energy_j, toInt64(sum(energy_mj)) AS energy_mj")
    raw = dedup_usage_sql(db, [*BILLED_USAGE, raw_days, *conds],
                          f"{keys}, gpu_ms, effective_gpu_ms, cost_micros, energy_j, "
                          f"toInt64(round(energy_j * 1000)) AS energy_mj, toInt64({bucket}) AS bucket_ms")
    raw = f"SELECT {keys}, bucket_ms, {sums.format(n='1')} FROM ({raw}) GROUP BY {keys}, bucket_ms"
    where = " AND ".join([*BILLED_USAGE, exact_days, *conds])
    hourly = (f"SELECT {keys}, toInt64(hour * 3600000) AS bucket_ms, {sums.format(n='records')} "
              f"FROM {db}.usage_by_job_hourly WHERE {where} GROUP BY {keys}, hour")
    # a part no day comes from is left out (the other gives the columns when neither reads any): planning
    # the FINAL read of usage_raw costs 40-50 ms at 100 M records even when it reads nothing
    if raw_days == "0":
        return hourly
    return raw if exact_days == "0" else f"{hourly} UNION ALL {raw}"


def _energy_key(r: Mapping[str, Any]) -> EnergyKey:
    return (r["day"], str(r["cluster"]), int(r["hour"]), str(r["tenant"]), str(r["queue"]), r["job_id"],
            int(r["attempt"]), str(r["definition_version"]), str(r["state"]))


#: (condition of the days read from usage_by_job_hourly, of those read from usage_raw, their parameters)
DayReads = tuple


def day_reads(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date) -> DayReads:
    """Where a close run reads a cluster's days from: usage_by_job_hourly on the days where it is exact
    (exact_hourly_days), usage_raw with FINAL on the others. Worked out once for both reads of the days
    (fetch_day_usage, fetch_cluster_idle)."""
    days = days_between(day_from, day_to)
    exact = exact_hourly_days(client, db, {cluster: days}).get(cluster, [])
    exact_cond, params = days_condition({cluster: exact} if exact else {}, "exact_days")
    exact_days = set(exact)
    raw = [d for d in days if d not in exact_days]
    raw_cond, more = days_condition({cluster: raw} if raw else {}, "raw_days")
    return exact_cond, raw_cond, {**params, **more}


def fetch_day_usage(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date,
                    reads: DayReads | None = None) -> list[dict]:
    """The jobs' executing and allocated-idle usage of a cluster's days per hour, attempt and state,
    each record id once: day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state,
    gpu_ms, effective_gpu_ms, cost_micros, energy_mj (whole millijoules, each record rounded), records.
    The bill basis (job_lines sums the rows per line) and the closed days' energy (keyed per row) of a
    close run, from one read: usage_by_job_hourly on the days where it is exact (exact_hourly_days),
    usage_raw with FINAL on the others (`reads`, else day_reads)."""
    exact_cond, raw_cond, params = reads or day_reads(client, db, cluster, day_from, day_to)
    hourly = live_usage_sql(db, exact_cond, raw_cond, "intDiv(start_ms, 3600000) * 3600000")
    return _q(client, f"""
        SELECT day, toString(cluster) AS cluster, intDiv(bucket_ms, 3600000) AS hour, toString(tenant) AS tenant,
               toString(queue) AS queue, job_id, attempt, toString(definition_version) AS definition_version,
               toString(state) AS state, gpu_ms, effective_gpu_ms, cost_micros, energy_mj, records
        FROM ({hourly})""", params)


def cluster_idle_sql(db: str, exact_days: str, raw_days: str, conds: Sequence[str] = ()) -> str:
    """Each cluster's unallocated (cluster idle) usage per day and definition version, each record once:
    day, cluster, definition_version, gpu_ms (Int64), cost_micros (Int128). Days where `exact_days` holds
    come from usage_by_job_hourly (it holds every state), days where `raw_days` holds from usage_raw
    deduplicated, as live_usage_sql. `conds`: more conditions on columns both tables have."""
    keys = "day, cluster, definition_version"
    sums = "toInt64(sum(gpu_ms)) AS gpu_ms, sum(toInt128(cost_micros)) AS cost_micros"
    idle = "state = 'unallocated'"
    raw = dedup_usage_sql(db, [idle, raw_days, *conds], f"{keys}, gpu_ms, cost_micros")
    raw = f"SELECT {keys}, {sums} FROM ({raw}) GROUP BY {keys}"
    hourly = f"SELECT {keys}, {sums} FROM {db}.usage_by_job_hourly WHERE {' AND '.join([idle, exact_days, *conds])} GROUP BY {keys}"
    if raw_days == "0":
        return hourly
    return raw if exact_days == "0" else f"{hourly} UNION ALL {raw}"


#: (day, definition_version) -> [gpu_ms, cost_micros] of a cluster
IdleAmounts = dict


def fetch_cluster_idle(client, db: str, reads: DayReads) -> IdleAmounts:
    """A cluster's unallocated usage per day and definition version, each record once, of the days of
    `reads` (day_reads): what a closed day shares as its cluster idle (sql/0039)."""
    exact_cond, raw_cond, params = reads
    return {(r["day"], str(r["definition_version"])): [int(r["gpu_ms"]), int(r["cost_micros"])]
            for r in _q(client, cluster_idle_sql(db, exact_cond, raw_cond), params)}


def _booked_cluster_idle(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date) -> IdleAmounts:
    """closed_cluster_idle of committed runs for a cluster's closed days in the range (what their close
    stored plus the corrections booked since), per corrected day and definition version."""
    sql = (f"SELECT corrects_day, toString(definition_version) AS definition_version, sum(gpu_ms) AS gpu_ms, "
           f"sum(cost_micros) AS cost_micros FROM {db}.closed_cluster_idle WHERE cluster = {{cluster:String}} "
           f"AND corrects_day BETWEEN {{day_from:Date}} AND {{day_to:Date}} AND {committed(db)} "
           "GROUP BY corrects_day, definition_version")
    return {(r["corrects_day"], r["definition_version"]): [int(r["gpu_ms"]), int(r["cost_micros"])]
            for r in _q(client, sql, {"cluster": cluster, "day_from": day_from, "day_to": day_to})}


def cluster_idle_by_day(client, db: str, exact_days: str, raw_days: str, params: Mapping[str, Any],
                        day_from: dt.date, day_to: dt.date) -> dict[tuple, int]:
    """{(day, cluster, definition_version): cost_micros} of the cluster idle each day shares (`report bills
    --idle-redistribution`): the closed_cluster_idle rows booked on it by committed runs (a closed day's
    own, stored when it closed, and corrections of earlier days booked on it), plus, on the open days
    (`exact_days` / `raw_days`, conditions of days_condition), their unallocated usage each record once."""
    span = ["day BETWEEN {idle_from:Date} AND {idle_to:Date}"]
    live = cluster_idle_sql(db, exact_days, raw_days, span) if (exact_days, raw_days) != ("0", "0") else ""
    closed = (f"SELECT booked_day AS day, cluster, definition_version, cost_micros FROM {db}.closed_cluster_idle "
              f"WHERE {committed(db)} AND booked_day BETWEEN {{idle_from:Date}} AND {{idle_to:Date}}")
    sql = closed + (f" UNION ALL SELECT day, cluster, definition_version, cost_micros FROM ({live})" if live else "")
    return {(r["day"], r["cluster"], r["definition_version"]): int(r["cost_micros"]) for r in _q(
        client, f"SELECT day, toString(cluster) AS cluster, toString(definition_version) AS definition_version, "
                f"sum(cost_micros) AS cost_micros FROM ({sql}) GROUP BY day, cluster, definition_version",
        {**params, "idle_from": day_from, "idle_to": day_to})}


def day_energy(rows: Iterable[Mapping[str, Any]]) -> dict[EnergyKey, list[int]]:
    """{energy key: [energy_mj, records]} of fetch_day_usage's rows."""
    out: dict[EnergyKey, list[int]] = {}
    for r in rows:
        acc = out.setdefault(_energy_key(r), [0, 0])
        acc[0] += int(r["energy_mj"])
        acc[1] += int(r["records"])
    return out


def _booked_energy(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date) -> dict[EnergyKey, list[int]]:
    """closed_energy of committed runs for a cluster's closed days in the range, summed per key."""
    sql = (f"SELECT day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state, "
           f"sum(energy_mj) AS energy_mj, sum(records) AS records FROM {db}.closed_energy "
           f"WHERE cluster = {{cluster:String}} AND day BETWEEN {{day_from:Date}} AND {{day_to:Date}} AND {committed(db)} "
           "GROUP BY day, cluster, hour, tenant, queue, job_id, attempt, definition_version, state")
    return {_energy_key(r): [int(r["energy_mj"]), int(r["records"])]
            for r in _q(client, sql, {"cluster": cluster, "day_from": day_from, "day_to": day_to})}


def _energy_rows(items: Iterable[tuple[EnergyKey, Sequence[int]]], run_id: str) -> list[dict]:
    return [{**dict(zip(ENERGY_KEYS, key)), "energy_mj": int(mj), "records": int(n), "bill_run_id": run_id}
            for key, (mj, n) in items]


def fetch_outcomes(client, db: str, cluster: str | None = None, failed_only: bool = False) -> dict[tuple, str]:
    """{(cluster, job_id, attempt): outcome} of every attempt, or of the failed ones only: the only
    outcome that moves a line (line_of), for readers that need nothing else (the bills report)."""
    conds, params = [], {}
    if cluster is not None:
        conds.append("cluster = {cluster:String}")
        params["cluster"] = cluster
    if failed_only:
        conds.append("outcome = 'failed'")
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    return {(r["cluster"], r["job_id"], int(r["attempt"])): r["outcome"]
            for r in _q(client, f"SELECT cluster, job_id, attempt, outcome FROM {db}.job_attempts {where}", params)}


COHORT_DAY = "toDate(fromUnixTimestamp64Milli(coalesce(a.queued_ms, a.first_seen_ms), 'UTC'))"


def queue_efficiency_sql(db: str, usage_conds: Sequence[str] = (), attempt_conds: Sequence[str] = (),
                         by_tenant: bool = False, cohort_conds: Sequence[str] = (), exact_days: str = "0") -> str:
    """The queue_efficiency view's figures (sql/0004) over deduplicated usage, per cohort day, cluster,
    queue and (by_tenant) tenant; tenant is '' for all tenants together.
    `attempt_conds`: on job_attempts AS a; `cohort_conds`: on the attempt's columns plus `day`, its
    cohort day. Only the usage of the chosen attempts is deduplicated, and only from the first day
    any of them was seen: an attempt's usage starts at one of its own events (the join opens a holder
    at the allocation's time), so none of it lies before its first_seen_ms. With `attempt_conds` (some
    tenants' or clusters' attempts) the usage rows are matched to the cohort before grouping; without,
    most rows since that day are the cohort's, and the join below drops the others after grouping
    (a per-row lookup of the attempt in the cohort cost more than it saved: ~0.3 s of 1 s at 100 M).
    `exact_days`: a condition (days_condition) true on days whose usage_by_job_hourly sums are exact
    (exact_hourly_days): those days' usage is summed from there, not deduplicated from usage_raw, and
    the running attempts' last ends from job_gpu_usage (a maximum, which copies of a record do not
    change; a job's records are all executing or allocated idle): an open day's cohort at 100 M records
    read in ~0.2 s (and the exactness count, ~0.1 s, that the bills share) against 0.45 s."""
    where = " AND ".join(attempt_conds) if attempt_conds else "1"
    cohort_where = " AND ".join(cohort_conds) if cohort_conds else "1"
    match = (["(cluster, job_id, attempt) IN (SELECT cluster, job_id, attempt FROM cohort)"] if attempt_conds else [])
    # NULL for an empty cohort (min() would give 1970-01-01): then no usage row is read, where min()
    # made a range of closed days read all of usage_raw FINAL (3-4 s at 100 M records)
    since = "day >= (SELECT toDate(fromUnixTimestamp64Milli(minOrNull(first_seen_ms), 'UTC')) FROM cohort)"
    sums = ("sumIf(gpu_ms, state IN ('allocated_idle', 'executing')) AS u_allocated_gpu_ms, "
            "sumIf(gpu_ms, state = 'executing') AS u_executed_gpu_ms")
    if exact_days == "0":
        inner = dedup_usage_sql(db, ["job_id != ''", *usage_conds, *match, since],
                                "cluster, record_id, job_id, attempt, state, gpu_ms, end_ms")
        usage = f"SELECT cluster, job_id, attempt, {sums}, max(end_ms) AS u_last_end_ms FROM ({inner}) GROUP BY ALL"
    else:
        inner = dedup_usage_sql(db, ["job_id != ''", *usage_conds, *match, since, f"NOT {exact_days}"],
                                "cluster, record_id, job_id, attempt, state, gpu_ms")
        hourly = " AND ".join(["job_id != ''", *usage_conds, *match, since, exact_days])
        # the last end counts only while an attempt runs (requested = up to its end, else its last usage)
        ends = " AND ".join(["job_id IN (SELECT job_id FROM cohort WHERE ended_ms IS NULL)", *usage_conds])
        usage = f"""
            SELECT s.*, e.u_last_end_ms AS u_last_end_ms FROM (
                SELECT cluster, job_id, attempt, sum(u_allocated_gpu_ms) AS u_allocated_gpu_ms,
                       sum(u_executed_gpu_ms) AS u_executed_gpu_ms
                FROM (SELECT cluster, job_id, attempt, {sums} FROM ({inner}) GROUP BY ALL
                      UNION ALL
                      SELECT cluster, job_id, attempt, {sums} FROM {db}.usage_by_job_hourly WHERE {hourly} GROUP BY ALL)
                GROUP BY ALL) AS s
            LEFT JOIN (SELECT cluster, job_id, attempt, max(last_end_ms) AS u_last_end_ms FROM {db}.job_gpu_usage
                       WHERE {ends} GROUP BY ALL) AS e
              ON s.cluster = e.cluster AND s.job_id = e.job_id AND s.attempt = e.attempt"""
    tenant = "toString(a.tenant)" if by_tenant else "''"
    return f"""
        WITH cohort AS (
            SELECT * FROM (SELECT a.*, {COHORT_DAY} AS day FROM {db}.job_attempts AS a WHERE {where})
            WHERE {cohort_where}
        ),
        u AS ({usage})
        SELECT day, cluster, queue, tenant, attempts,
            requested_gpu_seconds, allocated_gpu_seconds, executed_gpu_seconds,
            if(requested_gpu_seconds = 0, NULL, allocated_gpu_seconds / requested_gpu_seconds) AS allocated_to_requested,
            if(allocated_gpu_seconds = 0, NULL, executed_gpu_seconds / allocated_gpu_seconds) AS executed_to_allocated,
            if(requested_gpu_seconds = 0, NULL, executed_gpu_seconds / requested_gpu_seconds) AS executed_to_requested,
            waits,
            round(wait_p50, 3) AS queue_wait_p50_s, round(wait_p90, 3) AS queue_wait_p90_s,
            round(wait_p99, 3) AS queue_wait_p99_s, round(wait_mean, 3) AS queue_wait_mean_s,
            round(wait_max, 3) AS queue_wait_max_s
        FROM
        (
            SELECT
                a.day AS day, a.cluster AS cluster, a.queue AS queue, {tenant} AS tenant,
                count() AS attempts,
                sum(a.requested_gpus * (coalesce(a.ended_ms, greatest(a.last_seen_ms, u.u_last_end_ms))
                                        - coalesce(a.queued_ms, a.first_seen_ms))) / 1000 AS requested_gpu_seconds,
                sum(u.u_allocated_gpu_ms) / 1000 AS allocated_gpu_seconds,
                sum(u.u_executed_gpu_ms) / 1000 AS executed_gpu_seconds,
                count(a.queue_wait_ms) AS waits,
                quantileExactInclusive(0.5)(a.queue_wait_ms / 1000) AS wait_p50,
                quantileExactInclusive(0.9)(a.queue_wait_ms / 1000) AS wait_p90,
                quantileExactInclusive(0.99)(a.queue_wait_ms / 1000) AS wait_p99,
                avg(a.queue_wait_ms / 1000) AS wait_mean,
                max(a.queue_wait_ms / 1000) AS wait_max
            FROM cohort AS a
            LEFT JOIN u ON a.cluster = u.cluster AND a.job_id = u.job_id AND a.attempt = u.attempt
            GROUP BY day, cluster, queue, tenant
        )"""


# --------------------------------------------------------------------------- closing
@dataclass
class CloseResult:
    bill_run_id: str | None
    closed: dict[str, list[dt.date]] = field(default_factory=dict)   # cluster -> days closed now
    horizons: dict[str, int] = field(default_factory=dict)
    closed_rows: int = 0
    adjustment_rows: int = 0
    energy_rows: int = 0                                             # closed_energy rows (sql/0023)
    cluster_idle_rows: int = 0                                       # closed_cluster_idle rows (sql/0039)
    idle_stretch_days: dict[str, list[dt.date]] = field(default_factory=dict)  # days worked out (sql/0028)
    exact_hours: int = 0                                             # open days' hours recorded (sql/0035)
    messages: list = field(default_factory=list)                     # BillRow, published or not
    skipped: str = ""                                                # why the run did nothing: another run held the lock
    left_out: list = field(default_factory=list)                     # clusters another run committed meanwhile

    def as_dict(self) -> dict:
        return {"bill_run_id": self.bill_run_id,
                "closed": {c: [d.isoformat() for d in days] for c, days in self.closed.items()},
                "horizons_ms": self.horizons, "closed_rows": self.closed_rows,
                "adjustment_rows": self.adjustment_rows, "energy_rows": self.energy_rows,
                "cluster_idle_rows": self.cluster_idle_rows,
                "idle_stretch_days": {c: [d.isoformat() for d in days] for c, days in self.idle_stretch_days.items()},
                "exact_hours": self.exact_hours, "messages": len(self.messages),
                **({"skipped": self.skipped} if self.skipped else {}),
                **({"left_out": self.left_out} if self.left_out else {})}


def _closed_state(client, db: str) -> dict[str, list[dt.date]]:
    out: dict[str, list[dt.date]] = {}
    # a day with committed closed rows is closed even if its closed_days row has expired first: it is
    # never closed twice
    for r in _q(client, f"SELECT DISTINCT toString(cluster) AS cluster, day FROM ({closed_days_sql(db)} UNION ALL "
                        f"SELECT cluster, day FROM {db}.closed_tenant_bill WHERE {committed(db)}) ORDER BY cluster, day"):
        out.setdefault(r["cluster"], []).append(r["day"])
    return out


def _booked(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date) -> dict[tuple, Amount]:
    """Closed attempt-day lines plus the adjustments booked for them, for closed days in the range."""
    params = {"cluster": cluster, "day_from": day_from, "day_to": day_to}
    sql = f"""
        SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(queue) AS queue, job_id, attempt,
               toString(definition_version) AS definition_version, toString(line) AS line,
               sum(g) AS gpu_ms, sum(e) AS effective_gpu_ms, sum(c) AS cost_micros
        FROM (
            SELECT day, cluster, tenant, queue, job_id, attempt, definition_version, line,
                   toInt64(gpu_ms) AS g, toInt64(effective_gpu_ms) AS e, toInt128(cost_micros) AS c
            FROM {db}.closed_job_cost
            WHERE cluster = {{cluster:String}} AND day BETWEEN {{day_from:Date}} AND {{day_to:Date}} AND {committed(db)}
            UNION ALL
            SELECT corrects_day AS day, cluster, tenant, queue, job_id, attempt, definition_version, line,
                   gpu_ms AS g, effective_gpu_ms AS e, cost_micros AS c
            FROM {db}.bill_adjustments
            WHERE cluster = {{cluster:String}} AND corrects_day BETWEEN {{day_from:Date}} AND {{day_to:Date}} AND {committed(db)}
        )
        GROUP BY day, cluster, tenant, queue, job_id, attempt, definition_version, line"""
    return {(r["day"], r["cluster"], r["tenant"], r["queue"], r["job_id"], int(r["attempt"]), r["definition_version"],
             r["line"]): [int(r["gpu_ms"]), int(r["effective_gpu_ms"]), int(r["cost_micros"])]
            for r in _q(client, sql, params)}


LOCKED = "another close run holds the lock"


def close_lock_path(settings, database: str) -> Path:
    """The lock file of the close runs of one warehouse on this host: beside an embedded warehouse's
    directory, else in DATA_DIR, named after a hash of the server's address and the database (the
    address may hold credentials)."""
    embedded = settings.embedded_warehouse_dir
    if embedded is not None:
        return embedded.with_name(f"{embedded.name}.bills-close-{database}.lock")
    key = hashlib.sha256(f"{settings.warehouse}\0{database}".encode()).hexdigest()[:16]
    return Path(settings.data_dir) / f"bills-close-{key}.lock"


@contextmanager
def close_lock(settings, database: str, wait_s: float | None = None):
    """Hold the close runs' lock (close_lock_path) while in the block; yields False, holding nothing, when
    another run still holds it after `wait_s` seconds (None: wait as long as it takes)."""
    path = close_lock_path(settings, database)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if wait_s is None:
            fcntl.flock(f, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def close_due(client, settings, ledger, now: dt.datetime | None = None, publisher=None,
              database: str | None = None, lock_wait_s: float | None = None) -> CloseResult:
    """Close every day that is due (see the module doc), book adjustments for closed days, commit the
    run, and publish its BillRows to `<prefix>bills` (key: tenant) when a publisher is given. Then
    record the open days' exact hours for the reports (record_exact_hours).
    Returns what was done; bill_run_id is None when there was nothing to close or adjust.
    One run at a time (close_lock): waits for a run that holds the lock, or, with `lock_wait_s`, gives up
    after that many seconds and returns a result with `skipped` set, having done nothing."""
    db_name = database or settings.database
    with close_lock(settings, db_name, lock_wait_s) as held:
        if not held:
            log.warning("bills close: %s (%s); this run does nothing", LOCKED, close_lock_path(settings, db_name))
            return CloseResult(None, skipped=LOCKED)
        return _close_and_note(client, settings, ledger, now, publisher, database)


def _close_and_note(client, settings, ledger, now, publisher, database) -> CloseResult:
    result = _close(client, settings, ledger, now, publisher, database)
    db_name = database or settings.database
    try:
        open_days = days_by_cluster(client, open_days_sql(quoted_database(db_name)))
        result.exact_hours = record_exact_hours(client, db_name, open_days, result.horizons)
    except Exception as exc:  # they only spare the reports a count: the run stands
        log.warning("the open days' exact hours were not recorded (reports count every hour): %s", exc)
    return result


def _committed_runs(client, db: str) -> dict[str, list[str]]:
    """bill_run_id -> clusters of the committed runs."""
    return {r["bill_run_id"]: list(r["clusters"]) for r in _q(client, f"SELECT bill_run_id, clusters FROM {db}.bill_runs")}


def _close(client, settings, ledger, now: dt.datetime | None, publisher, database: str | None) -> CloseResult:
    from gpuledger.warehouse import insert_rows, reports

    db_name = database or settings.database
    db = quoted_database(db_name)
    now = now or dt.datetime.now(dt.timezone.utc)
    run_id = f"br-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    grace = float(settings.bills_close_grace_s)
    lookback = int(settings.bills_adjust_lookback_days)
    # each row in the currency of its own definition version (a new currency is a new version): usage
    # priced under an older version keeps its currency when a run under a newer one closes it
    currencies = reports.definition_currencies(client, db, ledger.currency)
    # Counted from tomorrow (as usage_kept_from below): a month's closed rows expire at midnight of their TTL date in
    # the server's time zone, which may be ahead of UTC, and a day closed again after they expired would go out
    # again as new money (a new bill_run_id)
    tomorrow = (now + dt.timedelta(days=1)).date()
    kept_from = closed_rows_kept_from(settings.retention_bills_days, tomorrow)
    # The first day whose usage (usage_raw, usage_by_job_hourly, job_idle_segments: GPULEDGER_RETENTION_USAGE_DAYS)
    # is still wholly kept: those tables expire by month as the closed rows do (N days after the last day
    # of the month, whole parts only), so the same rule applies. A day before it may have lost its usage
    # (or part of it): recomputed from what is left, its closed bill would be booked back as negative
    # adjustments (and its closed energy and cluster idle wiped), so it is no longer adjusted. Counted
    # from tomorrow: a TTL date is midnight in the server's time zone, which may be ahead of UTC, and a
    # run may cross midnight; a month thus leaves the look-back a day before its TTL, never after.
    usage_kept_from = closed_rows_kept_from(settings.retention_usage_days, tomorrow)
    result = CloseResult(None)
    # the runs committed before this one read anything: a run committed later (another host's closer)
    # leaves its clusters out of this one (below)
    runs_before = set(_committed_runs(client, db))

    horizons = {str(r["cluster"]): r for r in _q(client, f"SELECT toString(cluster) AS cluster, max(end_ms) AS horizon_ms, "
                                                          f"min(day) AS first_day FROM {db}.usage_raw GROUP BY cluster")}
    closed = _closed_state(client, db)
    closed_job_rows: list[dict] = []
    closed_tenant_rows: list[dict] = []
    closed_queue_rows: list[dict] = []
    closed_day_rows: list[dict] = []
    adjustment_rows: list[dict] = []
    energy_rows: list[dict] = []     # closed_energy: closed days' energy, and late records' difference
    idle_rows: list[dict] = []       # closed_cluster_idle: closed days' cluster idle, and late records' difference
    for cluster in sorted(set(horizons) | set(closed)):
        h = horizons.get(cluster)
        horizon = int(h["horizon_ms"]) if h else 0
        result.horizons[cluster] = horizon
        already = closed.get(cluster, [])
        last_due = last_due_day(horizon, grace)
        # Days whose closed rows have already expired under the bills retention are not closed (again):
        # also when every closed day of the cluster has expired, which leaves nothing closed
        since = max(h["first_day"], kept_from) if h else None
        first = max(already[-1] + dt.timedelta(days=1), kept_from) if already else since
        new_days = days_between(first, last_due) if (first and last_due and first <= last_due) else []
        # Usage that arrived late for days before the cluster's first closed day (a spool drained after
        # the first close): those days were never closed, so no bill changes if they close now, like
        # any due day (§6a: every day from the first usage day on closes). An adjustment corrects a
        # closed bill; there is none to correct.
        earlier = days_between(since, already[0] - dt.timedelta(days=1)) if (already and since is not None and since < already[0]) else []
        stretches = [s for s in (earlier, new_days) if s]  # read apart: the closed days between are not read
        new_days = earlier + new_days
        outcomes = fetch_outcomes(client, db, cluster)
        if new_days:
            reads = [day_reads(client, db, cluster, s[0], s[-1]) for s in stretches]
            usage = [r for s, rd in zip(stretches, reads) for r in fetch_day_usage(client, db, cluster, s[0], s[-1], rd)]
            # the cluster idle the day shares (report bills --idle-redistribution), fixed with the bill
            for rd in reads:
                idle_rows.extend(dict(booked_day=day, corrects_day=day, cluster=cluster, definition_version=dv,
                                      gpu_ms=g, cost_micros=c, bill_run_id=run_id)
                                 for (day, dv), (g, c) in sorted(fetch_cluster_idle(client, db, rd).items(),
                                                                 key=lambda kv: tuple(map(str, kv[0]))))
            lines = job_lines(usage, outcomes)
            for key, (g, e, c) in sorted(lines.items(), key=lambda kv: tuple(map(str, kv[0]))):
                day, _, tenant, queue, job_id, attempt, dv, line = key
                closed_job_rows.append(dict(day=day, cluster=cluster, tenant=tenant, queue=queue, job_id=job_id,
                                            attempt=attempt, outcome=outcomes.get((cluster, job_id, attempt), ""),
                                            line=line, definition_version=dv, gpu_ms=g, effective_gpu_ms=e,
                                            cost_micros=c, currency=reports.currency_of(currencies, dv), bill_run_id=run_id))
            for (day, _, tenant, queue, line, dv), (g, e, c) in sorted(tenant_lines(lines).items(),
                                                                        key=lambda kv: tuple(map(str, kv[0]))):
                closed_tenant_rows.append(dict(day=day, cluster=cluster, tenant=tenant, queue=queue, line=line,
                                               definition_version=dv, gpu_ms=g, effective_gpu_ms=e, cost_micros=c,
                                               currency=reports.currency_of(currencies, dv), bill_run_id=run_id))
            for s in stretches:
                closed_queue_rows.extend(_queue_rows(client, db, cluster, s[0], s[-1], run_id, ledger.definition_version))
            energy_rows.extend(_energy_rows(sorted(day_energy(usage).items(), key=lambda kv: tuple(map(str, kv[0]))),
                                            run_id))
            closed_day_rows.extend(dict(day=d, cluster=cluster, bill_run_id=run_id, horizon_ms=horizon) for d in new_days)
            result.closed[cluster] = new_days
        # adjustments for days closed before this run, booked into the next open day; not for days whose
        # closed rows have expired (a month's part is dropped whole while its closed_days markers wait
        # for their own merge): recomputed against nothing booked, they would be booked again in full;
        # nor for days whose usage may have expired (usage_kept_from): the look-back counts back from the
        # last closed day, which stays put while a cluster is quiet or retired and its usage expires
        start = (max(already[0], already[-1] - dt.timedelta(days=lookback - 1), kept_from, usage_kept_from)
                 if already else None)
        window = days_between(start, already[-1]) if already else []
        if window:
            booked = _booked(client, db, cluster, start, already[-1])
            reads = day_reads(client, db, cluster, start, already[-1])
            usage = fetch_day_usage(client, db, cluster, start, already[-1], reads)
            now_lines = job_lines(usage, outcomes)
            booked_day = max([*new_days, already[-1]]) + dt.timedelta(days=1)  # after the last closed day
            for key, reason, (g, e, c) in diff_adjustments(booked, now_lines, outcomes):
                day, _, tenant, queue, job_id, attempt, dv, line = key
                adjustment_rows.append(dict(booked_day=booked_day, corrects_day=day, cluster=cluster, tenant=tenant,
                                            queue=queue, job_id=job_id, attempt=attempt, line=line,
                                            definition_version=dv, reason=reason, gpu_ms=g, effective_gpu_ms=e,
                                            cost_micros=c, currency=reports.currency_of(currencies, dv), bill_run_id=run_id))
            energy_rows.extend(_energy_rows(diff_amounts(_booked_energy(client, db, cluster, start, already[-1]),
                                                        day_energy(usage)), run_id))
            # late (or lost) unallocated records of a closed day: their difference is shared on the
            # booked day, as the jobs' adjustments are booked there; the closed day keeps its figure
            idle_rows.extend(dict(booked_day=booked_day, corrects_day=day, cluster=cluster, definition_version=dv,
                                  gpu_ms=g, cost_micros=c, bill_run_id=run_id)
                             for (day, dv), (g, c) in diff_amounts(
                                 _booked_cluster_idle(client, db, cluster, start, already[-1]),
                                 fetch_cluster_idle(client, db, reads)))
            # queue efficiency is not money: a closed cohort day's figures are revised in place of the
            # close's (readers take the latest run's rows), e.g. for an attempt allocated after the close
            closed_queue_rows.extend(_revised_queue_rows(
                client, db, cluster, window, run_id, ledger.definition_version,
                {(r["job_id"], r["attempt"]) for r in adjustment_rows if r["cluster"] == cluster}))
        # idle stretches of the days closed now and of those in the look-back whose idle records changed
        worked = idle_stretches.refresh(client, db, cluster, window + new_days)
        if worked:
            result.idle_stretch_days[cluster] = worked
    # A closer on another host (the lock is per host) may have committed for a cluster since this run read
    # it: its closed days and adjustments would be closed or booked twice. Such a cluster is left out of
    # this run, the next run does its work from the new state.
    taken = {c for run, clusters in _committed_runs(client, db).items() if run not in runs_before for c in clusters}
    if taken:
        left = sorted(taken & ({r["cluster"] for rows in (closed_day_rows, adjustment_rows, energy_rows, idle_rows,
                                                          closed_queue_rows) for r in rows} | set(result.closed)))
        if left:
            log.warning("bills close: another close run committed for %s while this one ran; left to the next run",
                        left)
            result.left_out = left
        closed_job_rows, closed_tenant_rows, closed_queue_rows, closed_day_rows, adjustment_rows, energy_rows, \
            idle_rows = ([r for r in rows if str(r["cluster"]) not in taken]
                         for rows in (closed_job_rows, closed_tenant_rows, closed_queue_rows, closed_day_rows,
                                      adjustment_rows, energy_rows, idle_rows))
        result.closed = {c: d for c, d in result.closed.items() if c not in taken}
    if not closed_day_rows and not adjustment_rows and not energy_rows and not idle_rows and not closed_queue_rows:
        return result
    # data first, the run's row last: it commits the run
    for table, rows in (("closed_job_cost", closed_job_rows), ("closed_tenant_bill", closed_tenant_rows),
                        ("closed_queue_efficiency", closed_queue_rows), ("bill_adjustments", adjustment_rows),
                        ("closed_energy", energy_rows), ("closed_cluster_idle", idle_rows),
                        ("closed_days", closed_day_rows)):
        if rows:
            insert_rows(client, table, rows, database=db_name)
    days = sorted({r["day"] for r in closed_day_rows} | {r["booked_day"] for r in adjustment_rows}
                  | {r["day"] for r in energy_rows} | {r["booked_day"] for r in idle_rows}
                  | {r["day"] for r in closed_queue_rows})
    insert_rows(client, "bill_runs", [dict(
        bill_run_id=run_id, created_at=now, days=days,
        clusters=sorted(set(result.closed) | {r["cluster"] for r in adjustment_rows} | {r["cluster"] for r in energy_rows}
                        | {r["cluster"] for r in idle_rows} | {r["cluster"] for r in closed_queue_rows}),
        definition_version=ledger.definition_version, grace_s=grace, horizons=result.horizons,
        closed_rows=len(closed_tenant_rows), adjustment_rows=len(adjustment_rows))], database=db_name)
    result.bill_run_id = run_id
    result.closed_rows = len(closed_tenant_rows)
    result.adjustment_rows = len(adjustment_rows)
    result.energy_rows = len(energy_rows)
    result.cluster_idle_rows = len(idle_rows)
    result.messages = bill_messages(run_id, closed_tenant_rows, adjustment_rows)
    log.info("bill run %s: closed %s, %d adjustment rows", run_id,
             {c: [d.isoformat() for d in ds] for c, ds in result.closed.items()}, len(adjustment_rows))
    if publisher is not None:
        publish(publisher, settings, result.messages)
    return result


#: closed_queue_efficiency's figures, per (day, cluster, queue, tenant)
QUEUE_FIGURES = ("attempts", "requested_gpu_seconds", "allocated_gpu_seconds", "executed_gpu_seconds", "waits",
                 "queue_wait_p50_s", "queue_wait_p90_s", "queue_wait_p99_s", "queue_wait_mean_s", "queue_wait_max_s")


def latest_queue_rows_sql(db: str) -> str:
    """closed_queue_efficiency as it stands (§6a): per cohort day and cluster, the rows of the latest
    committed run that wrote any (the close, or a later run that revised the day's figures), not the
    sum over runs."""
    return (f"SELECT * FROM {db}.closed_queue_efficiency WHERE {committed(db)} AND (day, cluster, bill_run_id) IN ("
            f"SELECT day, cluster, argMax(bill_run_id, (closed_at, bill_run_id)) FROM {db}.closed_queue_efficiency "
            f"WHERE {committed(db)} GROUP BY day, cluster)")


def _same_queue_figures(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    for k in QUEUE_FIGURES:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            if x is not y:
                return False
        elif abs(float(x) - float(y)) > 1e-6 + 1e-9 * abs(float(y)):
            return False
    return True


def _revised_queue_rows(client, db: str, cluster: str, days: Sequence[dt.date], run_id: str, dv: str,
                        adjusted: set[tuple[str, int]]) -> list[dict]:
    """The queue rows of the closed cohort days `days` (the look-back) whose figures differ from the rows
    that stand for them (latest_queue_rows_sql): all of such a day's rows anew, under this run. An
    attempt of a closed cohort day allocated (or running) after the close changes them; nothing new
    writes nothing. Only days that may have changed are worked out again (the figures come from a FINAL
    read of the days' usage: ~15 s for 7 days of 100 M records, too much for every run): a day some
    attempt of which was seen (job_attempts.last_seen_ms) after the horizon of the run whose rows stand
    for it, or that has attempts and no rows, and the cohort days of the attempts this run books
    adjustments for (`adjusted`: (job_id, attempt); late usage or a late outcome). A day with an attempt still open waits until every attempt
    of it has ended: its figures grow while one runs, and revising them at every run would write the
    day's rows again every 15 minutes for as long as the job lasts."""
    if not days:
        return []
    span = {"cluster": cluster, "day_from": min(days), "day_to": max(days)}
    wanted = {r["day"] for r in _q(client, f"""
        SELECT j.day AS day
        FROM (SELECT {COHORT_DAY} AS day, max(a.last_seen_ms) AS seen, countIf(a.ended_ms IS NULL) AS still_open,
                     max((a.job_id, a.attempt) IN {{adjusted:Array(Tuple(String, UInt32))}}) AS adjusted
              FROM {db}.job_attempts AS a WHERE a.cluster = {{cluster:String}}
              GROUP BY day HAVING day BETWEEN {{day_from:Date}} AND {{day_to:Date}}) AS j
        LEFT JOIN (SELECT q.day AS day, r.horizons[{{cluster:String}}] AS horizon
                   FROM (SELECT day, argMax(bill_run_id, (closed_at, bill_run_id)) AS run
                         FROM {db}.closed_queue_efficiency WHERE {committed(db)} AND cluster = {{cluster:String}}
                           AND day BETWEEN {{day_from:Date}} AND {{day_to:Date}} GROUP BY day) AS q
                   INNER JOIN {db}.bill_runs AS r ON r.bill_run_id = q.run) AS h ON h.day = j.day
        WHERE j.still_open = 0 AND (j.seen > h.horizon OR j.adjusted)""",  # no rows: horizon 0
        {**span, "adjusted": sorted(adjusted)})} & set(days)
    if not wanted:
        return []
    now: dict[dt.date, dict[tuple, dict]] = {}
    for row in _queue_rows(client, db, cluster, min(wanted), max(wanted), run_id, dv):
        if row["day"] in wanted:
            now.setdefault(row["day"], {})[(row["queue"], row["tenant"])] = row
    stored: dict[dt.date, dict[tuple, dict]] = {}
    sql = (f"SELECT day, toString(queue) AS queue, toString(tenant) AS tenant, {', '.join(QUEUE_FIGURES)} "
           f"FROM ({latest_queue_rows_sql(db)}) "
           "WHERE cluster = {cluster:String} AND day BETWEEN {day_from:Date} AND {day_to:Date}")
    for r in _q(client, sql, {"cluster": cluster, "day_from": min(days), "day_to": max(days)}):
        stored.setdefault(r["day"], {})[(r["queue"], r["tenant"])] = r
    out = []
    for day in sorted(now):
        fresh, old = now[day], stored.get(day, {})
        if fresh.keys() != old.keys() or not all(_same_queue_figures(fresh[k], old[k]) for k in fresh):
            out.extend(fresh[k] for k in sorted(fresh))
    return out


def _queue_rows(client, db: str, cluster: str, day_from: dt.date, day_to: dt.date, run_id: str, dv: str) -> list[dict]:
    keep = ("day", "cluster", "queue", "tenant", *QUEUE_FIGURES)
    rows = []
    for by_tenant in (False, True):
        sql = queue_efficiency_sql(db, ["cluster = {cluster:String}"], ["a.cluster = {cluster:String}"], by_tenant,
                                   ["day BETWEEN {day_from:Date} AND {day_to:Date}"])
        for r in _q(client, sql, {"cluster": cluster, "day_from": day_from, "day_to": day_to}):
            row = {k: r[k] for k in keep}
            row.update(cluster=str(row["cluster"]), queue=str(row["queue"]), definition_version=dv, bill_run_id=run_id)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- the bills topic
def bill_messages(run_id: str, tenant_rows: Sequence[Mapping], adjustment_rows: Sequence[Mapping]) -> list:
    """One BillRow per closed tenant line and per adjustment summed to (booked day, corrected day,
    cluster, tenant, queue, line, reason, definition version)."""
    from gpuledger.schemas.models import BillRow

    out = [BillRow(kind="closed", bill_run_id=run_id, day=r["day"].isoformat(), cluster=r["cluster"],
                   tenant=r["tenant"], queue=r["queue"], line=r["line"], definition_version=r["definition_version"],
                   gpu_ms=r["gpu_ms"], effective_gpu_ms=r["effective_gpu_ms"], cost_micros=r["cost_micros"],
                   currency=r["currency"]) for r in tenant_rows]
    summed: dict[tuple, list[int]] = {}
    currency: dict[tuple, str] = {}
    for r in adjustment_rows:
        key = (r["booked_day"], r["corrects_day"], r["cluster"], r["tenant"], r["queue"], r["line"], r["reason"],
               r["definition_version"])
        acc = summed.setdefault(key, [0, 0, 0])
        acc[0] += r["gpu_ms"]
        acc[1] += r["effective_gpu_ms"]
        acc[2] += r["cost_micros"]
        currency[key] = r["currency"]
    for key, (g, e, c) in sorted(summed.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if not (g or e or c):
            continue
        booked_day, corrects_day, cluster, tenant, queue, line, reason, dv = key
        out.append(BillRow(kind="adjustment", bill_run_id=run_id, day=booked_day.isoformat(), cluster=cluster,
                           tenant=tenant, queue=queue, line=line, definition_version=dv, gpu_ms=g,
                           effective_gpu_ms=e, cost_micros=c, currency=currency[key],
                           corrects_day=corrects_day.isoformat(), reason=reason))
    return out


def publish(publisher, settings, messages: Sequence) -> int:
    """Send BillRows to `<prefix>bills`, keyed by tenant; waits until the broker has them all."""
    from gpuledger.schemas.wire import encode

    for m in messages:
        publisher.publish(settings.topics.bills, m.tenant, encode(m))
    remaining = publisher.flush(30)
    if remaining:
        raise RuntimeError(f"{remaining} bill message(s) not acknowledged by the broker; run `gpuledger bills publish`")
    return len(messages)


def run_messages(client, database: str, run_id: str) -> list:
    """The BillRows of a committed run, rebuilt from the warehouse (to publish again)."""
    db = quoted_database(database)
    params = {"run": run_id}
    tenant_rows = _q(client, f"SELECT day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(queue) AS queue, "
                             f"toString(line) AS line, toString(definition_version) AS definition_version, gpu_ms, "
                             f"effective_gpu_ms, cost_micros, toString(currency) AS currency FROM {db}.closed_tenant_bill "
                             f"WHERE bill_run_id = {{run:String}} AND {committed(db)} "
                             "ORDER BY day, cluster, tenant, queue, line", params)
    adj_rows = _q(client, f"SELECT booked_day, corrects_day, toString(cluster) AS cluster, toString(tenant) AS tenant, "
                          f"toString(queue) AS queue, toString(line) AS line, toString(reason) AS reason, "
                          f"toString(definition_version) AS definition_version, gpu_ms, effective_gpu_ms, cost_micros, "
                          f"toString(currency) AS currency FROM {db}.bill_adjustments "
                          f"WHERE bill_run_id = {{run:String}} AND {committed(db)}", params)
    return bill_messages(run_id, tenant_rows, adj_rows)


# --------------------------------------------------------------------------- reading
def list_runs(client, database: str, limit: int | None = None) -> list[dict]:
    db = quoted_database(database)
    sql = (f"SELECT bill_run_id, created_at, days, clusters, definition_version, grace_s, closed_rows, adjustment_rows "
           f"FROM {db}.bill_runs ORDER BY created_at DESC, bill_run_id")
    params = {}
    if limit is not None:  # checked here: a negative one reached ClickHouse as a bad query parameter
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
        sql += " LIMIT {limit:UInt64}"
        params["limit"] = limit
    rows = _q(client, sql, params)
    for r in rows:  # one cell each in tables and CSV
        r["days"] = " ".join(d.isoformat() for d in r["days"])
        r["clusters"] = " ".join(r["clusters"])
    return rows


def show(client, database: str, day: dt.date, cluster: str | None = None) -> list[dict]:
    """A closed day's bill: its closed tenant lines, the adjustments booked on it, and the
    adjustments booked later that correct it. A day not closed yet shows only the adjustments booked on
    it so far (it is the next open day of their cluster); empty when there are none."""
    db = quoted_database(database)
    params: dict[str, Any] = {"day": day}
    ccond = ""
    if cluster is not None:
        ccond = " AND cluster = {cluster:String}"
        params["cluster"] = cluster
    sql = f"""
        SELECT 'closed' AS kind, day, toString(cluster) AS cluster, toString(tenant) AS tenant, toString(queue) AS queue,
               toString(line) AS line, toString(definition_version) AS definition_version,
               toInt64(gpu_ms) AS gpu_ms, toInt64(effective_gpu_ms) AS effective_gpu_ms, toInt128(cost_micros) AS cost_micros,
               toString(currency) AS currency, CAST(NULL AS Nullable(Date)) AS corrects_day, '' AS reason, bill_run_id
        FROM {db}.closed_tenant_bill WHERE day = {{day:Date}}{ccond} AND {committed(db)}
        UNION ALL
        SELECT if(booked_day = {{day:Date}}, 'adjustment booked', 'corrected later') AS kind, booked_day AS day,
               toString(cluster), toString(tenant), toString(queue), toString(line), toString(definition_version),
               sum(gpu_ms), sum(effective_gpu_ms), sum(cost_micros), toString(any(currency)),
               CAST(corrects_day AS Nullable(Date)), toString(reason), bill_run_id
        FROM {db}.bill_adjustments
        WHERE (booked_day = {{day:Date}} OR corrects_day = {{day:Date}}){ccond} AND {committed(db)}
        GROUP BY kind, booked_day, corrects_day, cluster, tenant, queue, line, definition_version, reason, bill_run_id"""
    rows = _q(client, f"SELECT * FROM ({sql}) ORDER BY kind, day, cluster, tenant, queue, line, reason", params)
    for r in rows:
        r["cost"] = r["cost_micros"] / 1e6
    return rows


# --------------------------------------------------------------------------- dedup audit
def audit(client, database: str, day_from: dt.date | None = None, day_to: dt.date | None = None,
          cluster: str | None = None) -> list[dict]:
    """Rows vs distinct (cluster, record_id) per UTC day and table: the query of the view usage_dedup_audit
    (sql/0014, kept for outside readers), each table it reads filtered for the days and `cluster` (the
    view has no cluster column, and a filter outside it would not reach the tables' sort keys)."""
    db = quoted_database(database)
    conds, params = [], {}
    if day_from is not None:
        conds.append("day >= {day_from:Date}")
        params["day_from"] = day_from
    if day_to is not None:
        conds.append("day <= {day_to:Date}")
        params["day_to"] = day_to
    if cluster is not None:
        conds.append("cluster = {cluster:String}")
        params["cluster"] = cluster
    where = " AND ".join(conds) or "1"
    return _q(client, f"""
        WITH ids AS (SELECT day, uniqExact(cluster, record_id) AS distinct_records FROM {db}.usage_raw
                     WHERE {where} GROUP BY day)
        SELECT t.day AS day, t.source_table AS source_table, t.rows AS rows, ids.distinct_records AS distinct_records,
               toInt64(t.rows) - toInt64(ids.distinct_records) AS duplicates
        FROM (
            SELECT day, 'usage_raw' AS source_table, count() AS rows FROM {db}.usage_raw WHERE {where} GROUP BY day
            UNION ALL
            SELECT day, 'usage_by_job_daily' AS source_table, sum(slices) AS rows FROM {db}.usage_by_job_daily
            WHERE {where} GROUP BY day
            UNION ALL
            SELECT day, 'usage_capacity_daily' AS source_table, sum(slices) AS rows FROM {db}.usage_capacity_daily
            WHERE {where} GROUP BY day
        ) AS t
        INNER JOIN ids ON ids.day = t.day
        ORDER BY day, source_table""", params)


def export_audit(rows: Sequence[Mapping]) -> dict[str, int]:
    """Set gpuledger_usage_duplicate_records{table} (summed over the audited days); returns it."""
    from gpuledger.metrics import USAGE_DUPLICATE_RECORDS, USAGE_RECORDS_AUDITED

    dup: dict[str, int] = {}
    seen: dict[str, int] = {}
    for r in rows:
        dup[r["source_table"]] = dup.get(r["source_table"], 0) + max(int(r["duplicates"]), 0)
        seen[r["source_table"]] = seen.get(r["source_table"], 0) + int(r["rows"])
    for table, value in dup.items():
        USAGE_DUPLICATE_RECORDS.labels(table=table).set(value)
        USAGE_RECORDS_AUDITED.labels(table=table).set(seen[table])
    return dup
