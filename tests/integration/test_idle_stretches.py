"""Idle stretches of closed days kept by the bill close (sql/0028, gpuledger/warehouse/idle_stretches.py),
on the real engine (chDB): the view gives the same stretches before and after the close, joins those
across midnight (closed/closed and closed/open), reads closed days from idle_stretches_daily, picks up a
late record at the next close run, and the migration works out the days closed before it.

The scenario, worked by hand (cluster "ic"; D1 = 2026-11-10, D2 = 2026-11-11 close, D3 stays open):
  j1 gpu-1 idle D1 23:50-24:00 and D2 00:00-00:10  -> one stretch of 20 min across midnight
  j1 gpu-1 executing D2 00:10-00:20, idle 00:20-00:30 -> a stretch of 10 min, offset 30 min
  j2 gpu-2 idle D2 23:55-24:00 and D3 00:00-00:05  -> one stretch of 10 min, closed day into open day
  j3 gpu-3 idle D1 10:00-10:05 and 10:05-10:10      -> one stretch of 10 min
  gpu-4 unallocated D3 00:00-04:00: the horizon; with 1 h of grace D1 and D2 are due.
Late: j3 gpu-3 idle D1 10:10-10:20 -> j3's stretch becomes 20 min once the next close has run.
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import UsageRecord
from gpuledger.warehouse import bills, migrations

from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

DB = "idle_stretch"
MIN = 60_000
D1, D2, D3 = dt.date(2026, 11, 10), dt.date(2026, 11, 11), dt.date(2026, 11, 12)
T1 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
T2, T3 = T1 + 1440 * MIN, T1 + 2880 * MIN


def rec(gpu: str, start: int, end: int, state: str, job: str = "") -> UsageRecord:
    return usage_record("ic", gpu, start, end, state, job, "t1" if job else "")


USAGE = [
    rec("gpu-1", T2 - 10 * MIN, T2, "allocated_idle", "j1"),
    rec("gpu-1", T2, T2 + 10 * MIN, "allocated_idle", "j1"),
    rec("gpu-1", T2 + 10 * MIN, T2 + 20 * MIN, "executing", "j1"),
    rec("gpu-1", T2 + 20 * MIN, T2 + 30 * MIN, "allocated_idle", "j1"),
    rec("gpu-2", T3 - 5 * MIN, T3, "allocated_idle", "j2"),
    rec("gpu-2", T3, T3 + 5 * MIN, "allocated_idle", "j2"),
    rec("gpu-3", T1 + 600 * MIN, T1 + 605 * MIN, "allocated_idle", "j3"),
    rec("gpu-3", T1 + 605 * MIN, T1 + 610 * MIN, "allocated_idle", "j3"),
    rec("gpu-4", T3, T3 + 240 * MIN, "unallocated"),
]
LATE = [rec("gpu-3", T1 + 610 * MIN, T1 + 620 * MIN, "allocated_idle", "j3")]
#: (job, stretch start ms, minutes, idle GPU-seconds, offset from the attempt's first record, minutes)
STRETCHES = {("j1", T2 - 10 * MIN, 20, 1200, 0), ("j1", T2 + 20 * MIN, 10, 600, 30),
             ("j2", T3 - 5 * MIN, 10, 600, 0), ("j3", T1 + 600 * MIN, 10, 600, 0)}
CLOSE_AT = dt.datetime(2026, 11, 12, 6, tzinfo=dt.timezone.utc)


def stretches(client) -> set:
    return {(job, int(start.timestamp() * 1000), round(seconds / 60), round(gpu_s), offset // MIN)
            for job, start, seconds, gpu_s, offset in client.query(
                f"SELECT job_id, stretch_start, duration_seconds, idle_gpu_seconds, offset_ms "
                f"FROM {DB}.job_idle_stretches").result_rows}


@pytest.fixture
def ledger(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (client, settings):
        put_usage(client, DB, USAGE, 0)
        yield client, settings, load_ledger_config(None)


def test_closed_days_keep_their_stretches(ledger):
    client, settings, ledger_cfg = ledger
    assert stretches(client) == STRETCHES  # every day from the idle records
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    assert run.closed == {"ic": [D1, D2]} and run.idle_stretch_days == {"ic": [D1, D2]}
    kept = client.query(f"SELECT day, job_id, start_ms, end_ms FROM {DB}.idle_stretches_daily FINAL ORDER BY ALL")
    assert kept.result_rows == [(D1, "j1", T2 - 10 * MIN, T2), (D1, "j3", T1 + 600 * MIN, T1 + 610 * MIN),
                                (D2, "j1", T2, T2 + 10 * MIN), (D2, "j1", T2 + 20 * MIN, T2 + 30 * MIN),
                                (D2, "j2", T3 - 5 * MIN, T3)]
    assert stretches(client) == STRETCHES  # the pieces across midnight joined again
    # the closed days come from idle_stretches_daily: their idle records are no longer read
    client.command(f"DELETE FROM {DB}.job_idle_segments WHERE day IN ('{D1}', '{D2}')")
    assert stretches(client) == STRETCHES


def test_a_late_record_changes_a_closed_days_stretches_at_the_next_close(ledger):
    client, settings, ledger_cfg = ledger
    bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    put_usage(client, DB, LATE, 10)
    assert stretches(client) == STRETCHES  # until the next close works D1 out again
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT + dt.timedelta(hours=1))
    assert run.idle_stretch_days == {"ic": [D1]}
    late = STRETCHES - {("j3", T1 + 600 * MIN, 10, 600, 0)} | {("j3", T1 + 600 * MIN, 20, 1200, 0)}
    assert stretches(client) == late
    again = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT + dt.timedelta(hours=2))
    assert again.idle_stretch_days == {} and stretches(client) == late


def test_a_stretch_that_is_gone_is_deleted(ledger):
    """A record removed from the idle records (a repair) splits nothing but ends j1's second stretch: the
    day worked out again keeps no row of the old stretch."""
    client, settings, ledger_cfg = ledger
    bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    client.command(f"DELETE FROM {DB}.job_idle_segments WHERE job_id = 'j1' AND start_ms = {T2 + 20 * MIN}")
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT + dt.timedelta(hours=1))
    assert run.idle_stretch_days == {"ic": [D2]}
    assert stretches(client) == STRETCHES - {("j1", T2 + 20 * MIN, 10, 600, 30)}


def test_the_migration_works_out_the_days_closed_before_it():
    """A warehouse at 0027 with D1 and D2 closed: 0028 keeps their stretches and the view's stretches are
    the same; running the file again adds nothing."""
    client = warehouse_before("0028", DB, prefix="idle-stretches-")
    try:
        put_usage(client, DB, USAGE, 0)
        warehouse.insert_rows(client, "closed_days", [dict(day=d, cluster="ic", bill_run_id="br-old", horizon_ms=0)
                                                      for d in (D1, D2)], database=DB)
        warehouse.insert_rows(client, "bill_runs", [dict(bill_run_id="br-old", days=[D1, D2], clusters=["ic"],
                                                         definition_version="d1", grace_s=3600.0, horizons={},
                                                         closed_rows=0, adjustment_rows=0)], database=DB)
        assert migrations.migrate(client, DB)[0] == "0028"
        days = client.query(f"SELECT day, segments FROM {DB}.idle_stretch_days ORDER BY day").result_rows
        assert days == [(D1, 3), (D2, 3)]
        assert stretches(client) == STRETCHES
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0028'")
        assert migrations.migrate(client, DB) == ["0028"]
        assert client.query(f"SELECT count() FROM {DB}.idle_stretches_daily").result_rows == [(5,)]
        assert client.query(f"SELECT count() FROM {DB}.idle_stretch_days").result_rows == [(2,)]
        assert stretches(client) == STRETCHES
    finally:
        client.close()
