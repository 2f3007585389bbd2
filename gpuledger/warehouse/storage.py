"""`gpuledger report storage`: what the warehouse holds, per table, against what it is set to keep.

For an operator planning the warehouse of a large fleet: each table's retention (its
GPULEDGER_RETENTION_* setting, or why it is kept), whether the TTL on the table is the configured
one (a changed setting takes effect only at the next `gpuledger migrate`), its rows and compressed
bytes on disk, the span of event days it holds, and what it will weigh once it holds its whole
retention at today's rate (bytes per day of data × the most days it holds: its retention, plus up to
31 days where rows expire with their month, retention.days_held).

On a cluster (GPULEDGER_CLICKHOUSE_CLUSTER) the rows and bytes are those of one replica of every
shard (`cluster()` over system.parts, the `_local` tables); the day span is read through the
Distributed table. Only the single-node path runs in the tests here (docs/retention.md says what ran).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpuledger.warehouse.client import checked_identifier
from gpuledger.warehouse.cluster import LOCAL_SUFFIX
from gpuledger.warehouse.retention import (KEPT, RETENTION, days_held, lacks_drop_parts, ttl_in_engine,
                                           wanted_ttls)

#: the report's columns, in order
COLUMNS = ("table", "kept_for", "setting", "ttl", "rows", "bytes_on_disk", "first_day", "last_day",
           "daily_bytes", "bytes_at_retention", "why")

TOTAL = "(all tables)"


def _env_name(setting: str) -> str:
    return "GPULEDGER_" + setting.upper()


def parts_sql(cluster: str) -> str:
    """Rows, compressed bytes and event-day span (the partition key's minmax: 1970-01-01 where the
    table is not partitioned by a date) of each table's active parts; on a cluster, one replica of
    every shard."""
    source = f"cluster('{cluster}', system.parts)" if cluster else "system.parts"
    return (f"SELECT table, sum(rows), sum(bytes_on_disk), min(min_date), max(max_date) FROM {source} "
            "WHERE database = {d:String} AND active GROUP BY table")


def _stored(name: str, cluster: str) -> str | None:
    """The report's name of a stored table (on a cluster the `_local` tables hold the rows), else None."""
    if not cluster:
        return name
    return name.removesuffix(LOCAL_SUFFIX) if name.endswith(LOCAL_SUFFIX) else None


def _day_span(client, db: str, table: str, first: dt.date, last: dt.date, has_day: bool
              ) -> tuple[dt.date | None, dt.date | None]:
    """First and last event day a table holds: from its parts where it is partitioned by a date, else
    read from its `day` column (None, None without one)."""
    if first > _NO_DATE:
        return first, last
    if not has_day:
        return None, None
    first, last, n = client.query(f"SELECT min(day), max(day), count() FROM `{db}`.`{table}`").result_rows[0]
    return (first, last) if n else (None, None)


_NO_DATE = dt.date(1970, 1, 1)


def _normal_forms(client, expressions: set[str]) -> dict[str, str]:
    """Each TTL expression in ClickHouse's own formatting (one query for all), to compare them."""
    exprs = sorted(expressions)
    if not exprs:
        return {}
    formatted = client.query("SELECT arrayMap(q -> formatQuery(q), {qs:Array(String)})",
                             parameters={"qs": [f"SELECT {e}" for e in exprs]}).result_rows[0][0]
    return dict(zip(exprs, formatted))


def _ttl_state(current: str | None, wanted: str | None, normal: dict[str, str], parts_ok: bool = True) -> str:
    if wanted is None:
        return "none" if current is None else "set, not configured: run gpuledger migrate"
    if current is None:
        return "missing: run gpuledger migrate"
    return "applied" if normal[current] == normal[wanted] and parts_ok else "differs: run gpuledger migrate"


def storage_rows(client, database: str, settings) -> list[dict[str, Any]]:
    """One row per stored table, largest first, then a total. `settings` gives the retention days and
    the cluster (a `gpuledger.config.Settings`). A handful of queries over the system tables, whatever
    the number of tables; a table's own rows are read only for the day span of one not partitioned
    by a date."""
    db = checked_identifier(database, "database")
    cluster = settings.clickhouse_cluster or ""
    wanted = wanted_ttls(settings)
    parts = {}
    for table, n, size, first, last in client.query(parts_sql(cluster), parameters={"d": db}).result_rows:
        if (name := _stored(table, cluster)) is not None:
            parts[name] = (int(n), int(size), first, last)
    engines, engine_full = {}, {}
    for table, engine in client.query("SELECT name, engine_full FROM system.tables WHERE database = {d:String} "
                                      "AND engine LIKE '%MergeTree'", parameters={"d": db}).result_rows:
        if (name := _stored(table, cluster)) is not None:
            engines[name], engine_full[name] = ttl_in_engine(engine), engine
    with_day = {r[0] for r in client.query("SELECT table FROM system.columns WHERE database = {d:String} "
                                           "AND name = 'day'", parameters={"d": db}).result_rows}
    normal = _normal_forms(client, {e for e in (*engines.values(), *wanted.values()) if e})
    rows = []
    for table in sorted(engines):
        n, size, first, last = parts.get(table, (0, 0, _NO_DATE, _NO_DATE))
        if table in RETENTION:
            r = RETENTION[table]
            days = getattr(settings, r.setting)
            kept_for, setting, why = (f"{days} days" if days else "kept"), _env_name(r.setting), r.why
        else:
            days, kept_for, setting, why = 0, "kept", "", KEPT.get(table, "not classified (docs/retention.md)")
        first, last = _day_span(client, db, table, first, last, table in with_day) if n else (None, None)
        daily = round(size / ((last - first).days + 1)) if first is not None and size else None
        rows.append({
            "table": table, "kept_for": kept_for, "setting": setting,
            "ttl": _ttl_state(engines[table], wanted.get(table), normal,
                              parts_ok=not lacks_drop_parts(table, engine_full[table])),
            "rows": n, "bytes_on_disk": size, "first_day": first, "last_day": last,
            "daily_bytes": daily,
            "bytes_at_retention": daily * days_held(table, days) if daily is not None and days else None,
            "why": why,
        })
    rows.sort(key=lambda r: (-r["bytes_on_disk"], r["table"]))
    at_retention = [r["bytes_at_retention"] for r in rows if r["bytes_at_retention"] is not None]
    rows.append({"table": TOTAL, "kept_for": "", "setting": "", "ttl": "",
                 "rows": sum(r["rows"] for r in rows), "bytes_on_disk": sum(r["bytes_on_disk"] for r in rows),
                 "first_day": None, "last_day": None, "daily_bytes": None,
                 "bytes_at_retention": sum(at_retention) if at_retention else None,
                 "why": "the sums (bytes_at_retention: of the tables with a retention)"})
    return rows
