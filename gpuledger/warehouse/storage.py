"""`gpuledger report storage`: what the warehouse holds, per table, against what it is set to keep.

For an operator planning the warehouse of a large fleet: each table's retention (its
GPULEDGER_RETENTION_* setting, or why it is kept), whether the TTL on the table is the configured
one (a changed setting takes effect only at the next `gpuledger migrate`), its rows and compressed
bytes on disk, the span of event days it holds, and what it will weigh once it holds its whole
retention at today's rate (bytes per day of data × days kept).

On a cluster (GPULEDGER_CLICKHOUSE_CLUSTER) the rows and bytes are those of one replica of every
shard (`cluster()` over system.parts, the `_local` tables); the day span is read through the
Distributed table. Only the single-node path runs in the tests here (docs/retention.md says what ran).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpuledger.warehouse.client import checked_identifier
from gpuledger.warehouse.cluster import LOCAL_SUFFIX
from gpuledger.warehouse.retention import KEPT, RETENTION, current_ttl, normal_expression, wanted_ttls

#: the report's columns, in order
COLUMNS = ("table", "kept_for", "setting", "ttl", "rows", "bytes_on_disk", "first_day", "last_day",
           "daily_bytes", "bytes_at_retention", "why")

TOTAL = "(all tables)"


def _env_name(setting: str) -> str:
    return "GPULEDGER_" + setting.upper()


def parts_sql(cluster: str) -> str:
    """Rows and compressed bytes of each table's active parts: on a cluster, one replica of every shard."""
    source = f"cluster('{cluster}', system.parts)" if cluster else "system.parts"
    return (f"SELECT table, sum(rows), sum(bytes_on_disk) FROM {source} "
            "WHERE database = {d:String} AND active GROUP BY table")


def _parts(client, db: str, cluster: str) -> dict[str, tuple[int, int]]:
    """table -> (rows, compressed bytes) of its active parts."""
    rows = client.query(parts_sql(cluster), parameters={"d": db}).result_rows
    out = {}
    for table, n, size in rows:
        name = table.removesuffix(LOCAL_SUFFIX) if cluster else table
        out[name] = (int(n), int(size))
    return out


def _tables(client, db: str, cluster: str) -> list[str]:
    """The ledger's stored tables (MergeTree family; on a cluster their `_local` tables), by name."""
    rows = client.query("SELECT name FROM system.tables WHERE database = {d:String} AND engine LIKE '%MergeTree'",
                        parameters={"d": db}).result_rows
    names = [r[0] for r in rows]
    if cluster:
        names = [n.removesuffix(LOCAL_SUFFIX) for n in names if n.endswith(LOCAL_SUFFIX)]
    return sorted(names)


def _day_span(client, db: str, table: str) -> tuple[dt.date | None, dt.date | None]:
    """First and last event day a table holds, where it has a `day` column (None, None otherwise)."""
    has_day = client.query("SELECT count() FROM system.columns WHERE database = {d:String} AND table = {t:String} "
                           "AND name = 'day'", parameters={"d": db, "t": table}).result_rows[0][0]
    if not has_day:
        return None, None
    first, last, n = client.query(f"SELECT min(day), max(day), count() FROM `{db}`.`{table}`").result_rows[0]
    return (first, last) if n else (None, None)


def _ttl_state(client, db: str, stored: str, wanted: str | None) -> str:
    current = current_ttl(client, db, stored)
    if wanted is None:
        return "none" if current is None else "set, not configured: run gpuledger migrate"
    if current is None:
        return "missing: run gpuledger migrate"
    if normal_expression(client, current) != normal_expression(client, wanted):
        return "differs: run gpuledger migrate"
    return "applied"


def storage_rows(client, database: str, settings) -> list[dict[str, Any]]:
    """One row per stored table, largest first, then a total. `settings` gives the retention days and
    the cluster (a `gpuledger.config.Settings`)."""
    db = checked_identifier(database, "database")
    cluster = settings.clickhouse_cluster or ""
    wanted = wanted_ttls(settings)
    parts = _parts(client, db, cluster)
    rows = []
    for table in _tables(client, db, cluster):
        n, size = parts.get(table, (0, 0))
        if table in RETENTION:
            r = RETENTION[table]
            days = getattr(settings, r.setting)
            kept_for, setting, why = (f"{days} days" if days else "kept"), _env_name(r.setting), r.why
        else:
            days, kept_for, setting, why = 0, "kept", "", KEPT.get(table, "not classified (docs/retention.md)")
        first, last = _day_span(client, db, table)
        per_day = round(size / ((last - first).days + 1)) if first is not None and size else None
        stored = table + LOCAL_SUFFIX if cluster else table
        rows.append({
            "table": table, "kept_for": kept_for, "setting": setting,
            "ttl": _ttl_state(client, db, stored, wanted.get(table)),
            "rows": n, "bytes_on_disk": size, "first_day": first, "last_day": last,
            "daily_bytes": per_day,
            "bytes_at_retention": per_day * days if per_day is not None and days else None,
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
