"""Retention of every warehouse table (docs/retention.md), applied by `gpuledger migrate` as TTLs.

Migrations are checksummed and never change, while retention is configuration: so no migration holds
a TTL; after the migrations, `apply_retention` sets (ALTER TABLE ... MODIFY TTL) or removes each
table's TTL from the GPULEDGER_RETENTION_* settings, and does nothing where it is already so.

Raw tables (rows as the sink wrote them, with inserted_at) expire N days after the later of their
event day and the day they were written: a replay or back-fill of old input is kept for the whole
window, not dropped by the next merge. Aggregates expire N days after their event day. 0 = kept.

Rows expire with their partition, so that ClickHouse drops whole parts instead of rewriting them: in
a table partitioned by month a row's N days count from the last day of its month, in one partitioned
by day (gpu_health, sql/0034) from its day; such tables get ttl_only_drop_parts = 1 (an expired part
is dropped, a partly expired one waits). A day-precise TTL on a monthly partition made every TTL merge
(every few hours) rewrite what was left of the oldest month to drop one day of it. Tables without a
partition key are small and expire row by row.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Callable

from gpuledger.config import MAX_RETENTION_DAYS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    setting: str  # Settings field holding the days (0: kept for ever)
    expiry: str  # date expression the TTL counts from
    why: str
    #: the table's partitions, which its TTL follows: "month" (toYYYYMM of the expiry's day), "day",
    #: or "" (no partition key: rows expire one by one). tests/integration/test_retention_cluster.py
    #: checks each against the table's partition key.
    partition: str = "month"
    #: count from the last day of the expiry's month although the table has no monthly partition: the
    #: markers that commit closed bills (closed_days, bill_runs) or kept idle stretches (idle_stretch_days)
    #: must not expire before the rows they commit, which expire with their month; else a closed day
    #: would read as open (docs/retention.md)
    month_end: bool = False


#: The MergeTree setting that drops expired parts whole instead of rewriting them without their rows.
DROP_PARTS = "ttl_only_drop_parts"
#: Days a partitioned table holds beyond its retention, at most: a month's rows wait for its last day.
EXTRA_DAYS_HELD = {"month": 31, "day": 1, "": 0}


_RAW = "greatest(day, toDate(inserted_at))"

#: table -> its retention. Tables not listed are kept for ever on purpose (KEPT says why).
RETENTION: dict[str, Retention] = {
    "gpu_health": Retention("retention_health_days", _RAW, "per-sample health detail", partition="day"),
    "gpu_health_hourly": Retention("retention_hourly_days", "day", "hourly health history per GPU"),
    "usage_gpu_hourly": Retention("retention_hourly_days", "day", "hourly load per GPU (utilization, health record)"),
    "usage_gpu_5m": Retention("retention_load_5m_days", "day", "5-minute load history per GPU"),
    "usage_node_5m": Retention("retention_load_5m_days", "day", "5-minute load history per node (sql/0024)"),
    "busy_unallocated_daily": Retention("retention_usage_days", "day", "busy unallocated GPU time per day (sql/0025)"),
    "unallocated_util_daily": Retention("retention_usage_days", "day", "unallocated GPU time per day and utilization step (sql/0033)"),
    "gpu_down_records": Retention("retention_usage_days", "day", "down records behind the cards' down time (sql/0026)"),
    "usage_gpu_daily": Retention("retention_usage_days", "day", "usage per GPU, day, queue and state: the periodic reports (sql/0030)"),
    "usage_raw": Retention("retention_usage_days", _RAW, "usage records: bills, adjustments and re-bills are computed from them"),
    "job_events": Retention("retention_usage_days", _RAW, "job lifecycle: attempt outcomes decide the bill lines"),
    "job_idle_segments": Retention("retention_usage_days", "day", "idle records behind the idle-stretch views"),
    "idle_stretches_daily": Retention("retention_usage_days", "day", "idle stretches of closed days (sql/0028)"),
    # month_end: the marker must outlive the stretches it marks (they expire with their month); else
    # job_idle_stretches would read the day's kept stretches and its raw idle records again
    "idle_stretch_days": Retention("retention_usage_days", "day", "the days whose idle stretches are kept (sql/0028)",
                                   partition="", month_end=True),
    "scheduler_snapshots": Retention("retention_ops_days", _RAW, "queue snapshots"),
    "scheduler_preemptions": Retention("retention_ops_days", _RAW, "preemptions"),
    # as long as the allocations (job_events) it is checked against: a retired node gone from it would
    # make report unmatched call each of its allocations an unknown node (one row per node: small)
    "node_inventory": Retention("retention_usage_days", _RAW, "nodes that sent samples: the allocations' unmatched check",
                                partition=""),
    "usage_by_job_daily": Retention("retention_bills_days", "day", "bill grain of the live bills"),
    "usage_by_job_hourly": Retention("retention_usage_days", "day", "usage per hour and attempt: reports, closes (sql/0027)"),
    "usage_exact_hours": Retention("retention_usage_days", "day", "open days' hours found exact: the reports' reads (sql/0035)"),
    "usage_capacity_daily": Retention("retention_bills_days", "day", "capacity grain"),
    "closed_tenant_bill": Retention("retention_bills_days", "day", "closed bills"),
    "closed_job_cost": Retention("retention_bills_days", "day", "closed bills"),
    "closed_queue_efficiency": Retention("retention_bills_days", "day", "closed bills"),
    "closed_days": Retention("retention_bills_days", "day", "closed bills", partition="", month_end=True),
    "closed_energy": Retention("retention_bills_days", "day", "closed days' energy: their carbon (sql/0023)"),
    "closed_cluster_idle": Retention("retention_bills_days", "booked_day", "closed days' cluster idle (sql/0039)"),
    "bill_adjustments": Retention("retention_bills_days", "booked_day", "adjustments"),
    "bill_runs": Retention("retention_bills_days", "toDate(created_at)", "close runs", partition="", month_end=True),
    "rebilled_usage": Retention("retention_bills_days", "day", "re-bills", partition=""),
    "rebill_runs": Retention("retention_bills_days", "toDate(created_at)", "re-bills", partition=""),
    "alerts": Retention("retention_ops_days", _RAW, "behaviour alerts"),
    "reclaim_suggestions": Retention("retention_ops_days", _RAW, "reclaim suggestions"),
    "job_progress": Retention("retention_usage_days", _RAW, "training progress reports (line 4), joined to usage"),
}

KEPT: dict[str, str] = {
    "gpu_latest": "one row per GPU",
    "job_attempts_state": "one row per job attempt; outcomes of old attempts decide re-bills",
    "job_gpu_usage": "one row per job attempt, GPU and state",
    "job_util_buckets": "one row per job attempt, GPU model and utilization bucket",
    "coefficients": "accounting library: its whole history re-bills any period",
    "prices": "accounting library",
    "definitions": "accounting library",
    "sink_progress": "exactly-once bookkeeping of the sink, one row per partition",
    "tenant_access": "grants",
    "schema_migrations": "migration records",
    "approvals": "pilot-run approval decisions: who approved what, and when",
    "capacity_forecast": "forecast runs: each is compared with what happened later",
    "gpu_sightings": "one row per GPU, placement and identity: the card's history",
    "gpu_repairs": "append-only repair records of the cards",
    "carbon_intensity": "carbon intensity history: carbon figures of any period",
    "carbon_definitions": "carbon definitions as recorded",
}


def counts_from_month_end(table: str) -> bool:
    r = RETENTION[table]
    return r.partition == "month" or r.month_end


def ttl_expression(table: str, days: int) -> str | None:
    r = RETENTION[table]
    if days <= 0:
        return None
    if days > MAX_RETENTION_DAYS:  # the settings refuse it: the TTL's Date would wrap round to 1970
        raise ValueError(f"a retention of {days} days is over {MAX_RETENTION_DAYS}: use 0 to keep {table} for ever")
    counted_from = f"toLastDayOfMonth({r.expiry})" if counts_from_month_end(table) else r.expiry
    return f"{counted_from} + toIntervalDay({int(days)})"


def closed_rows_kept_from(days: int, today: dt.date) -> dt.date:
    """The first day whose closed bill rows are still kept today with a bills retention of `days`
    (0: kept for ever): they expire N days after the last day of their month (ttl_expression), so a
    close run does not close again a day whose closed rows have expired (bills.py)."""
    if days <= 0:
        return dt.date.min
    return (today - dt.timedelta(days=days - 1)).replace(day=1)


def lacks_drop_parts(table: str, engine_full: str | None) -> bool:
    """Whether a table whose TTL should drop whole parts (it has partitions for them to follow) is
    without DROP_PARTS, judged from its `engine_full` (system.tables)."""
    return table in RETENTION and RETENTION[table].partition != "" and not drop_parts_in_engine(engine_full)


def days_held(table: str, days: int) -> int:
    """The most days of rows the table holds with a retention of `days`."""
    return days + (EXTRA_DAYS_HELD["month"] if counts_from_month_end(table) else EXTRA_DAYS_HELD[RETENTION[table].partition])


def wanted_ttls(settings) -> dict[str, str | None]:
    """table -> TTL expression (None: no TTL), from the settings."""
    return {table: ttl_expression(table, getattr(settings, r.setting)) for table, r in RETENTION.items()}


def _engine_full(client, database: str, table: str) -> str | None:
    rows = client.query("SELECT engine_full FROM system.tables WHERE database = {d:String} AND name = {t:String}",
                        parameters={"d": database, "t": table}).result_rows
    return rows[0][0] if rows else None


def drop_parts_in_engine(engine_full: str | None) -> bool:
    """Whether a table's `engine_full` (system.tables) sets DROP_PARTS."""
    settings = (engine_full or "").rpartition(" SETTINGS ")[2]
    return f"{DROP_PARTS} = 1" in settings


def ttl_in_engine(engine_full: str | None) -> str | None:
    """The TTL expression of a table's `engine_full` (system.tables), None without one."""
    engine = engine_full or ""
    if " TTL " not in engine:
        return None
    ttl = engine.split(" TTL ", 1)[1]
    return ttl.split(" SETTINGS ", 1)[0].strip()


def _normal(client, expr: str) -> str:
    return client.query("SELECT formatQuery({q:String})", parameters={"q": f"SELECT {expr}"}).result_rows[0][0]


def apply_retention(client, database: str, ttls: dict[str, str | None], *,
                    local: Callable[[str], str] = lambda t: t, on_cluster: str = "") -> list[str]:
    """Set or remove each table's TTL where it differs, with DROP_PARTS first where the table drops
    whole parts; returns the statements run. `local` names the table that stores the rows (t_local on
    a cluster), `on_cluster` is the ON CLUSTER clause there."""
    ran: list[str] = []
    existing = {r[0] for r in client.query("SELECT name FROM system.tables WHERE database = {d:String}",
                                           parameters={"d": database}).result_rows}
    for table, expr in ttls.items():
        name = local(table)
        if name not in existing:  # a table of a later migration than this warehouse has
            continue
        engine = _engine_full(client, database, name)
        current = ttl_in_engine(engine)
        actions = []
        if expr is not None and lacks_drop_parts(table, engine):
            actions.append(f"MODIFY SETTING {DROP_PARTS} = 1")
        if expr is None and current is not None:
            actions.append("REMOVE TTL")
        elif expr is not None and (current is None or _normal(client, current) != _normal(client, expr)):
            actions.append(f"MODIFY TTL {expr}")
        for action in actions:
            sql = f"ALTER TABLE `{database}`.`{name}` {on_cluster} {action}".replace("  ", " ")
            log.info("retention: %s", sql)
            client.command(sql)
            ran.append(sql)
    return ran
