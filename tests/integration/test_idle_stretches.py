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
Copies (sql/0037): j3's two records delivered twice, and j5 idle on gpu-5 and gpu-6 at once, still
give one stretch per attempt and GPU.
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import UsageRecord
from gpuledger.warehouse import bills, idle_stretches, migrations
from gpuledger.warehouse.periodic import commands as periodic

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


# ----------------------------------------------------------------- a record delivered twice (sql/0037)
# The sink delivers at least once and job_idle_segments keeps every copy: a copy of j3's first idle record
# made a stretch 10:00-10:05 beside 10:00-10:10, a copy of its second one a stretch 10:05-10:10 (and a
# "mid-run stalls" hint). j5 is idle on two GPUs over the same ten minutes: two records alike but for
# the GPU, which stay a stretch each.
COPIES = [USAGE[6], USAGE[7]]
TWO_GPUS = [rec(gpu, T1 + start * MIN, T1 + (start + 5) * MIN, "allocated_idle", "j5")
            for gpu in ("gpu-5", "gpu-6") for start in (700, 705)]
#: (job, GPU, stretch start ms, minutes, idle GPU-seconds, offset minutes), one per stretch
LISTED = sorted([("j1", "gpu-1", T2 - 10 * MIN, 20, 1200, 0), ("j1", "gpu-1", T2 + 20 * MIN, 10, 600, 30),
                 ("j2", "gpu-2", T3 - 5 * MIN, 10, 600, 0), ("j3", "gpu-3", T1 + 600 * MIN, 10, 600, 0),
                 ("j5", "gpu-5", T1 + 700 * MIN, 10, 600, 0), ("j5", "gpu-6", T1 + 700 * MIN, 10, 600, 0)])


def listed(client) -> list:
    """Every stretch of the view, copies and all (stretches() is a set)."""
    return sorted((job, gpu, int(start.timestamp() * 1000), round(seconds / 60), round(gpu_s), offset // MIN)
                  for job, gpu, start, seconds, gpu_s, offset in client.query(
                      f"SELECT job_id, gpu_uuid, stretch_start, duration_seconds, idle_gpu_seconds, offset_ms "
                      f"FROM {DB}.job_idle_stretches").result_rows)


def kept_d1(client) -> list:
    return client.query(f"SELECT job_id, gpu_uuid, start_ms, end_ms, gpu_ms FROM {DB}.idle_stretches_daily FINAL "
                        f"WHERE day = '{D1}' ORDER BY ALL").result_rows


KEPT_D1 = [("j1", "gpu-1", T2 - 10 * MIN, T2, 600_000), ("j3", "gpu-3", T1 + 600 * MIN, T1 + 610 * MIN, 600_000),
           ("j5", "gpu-5", T1 + 700 * MIN, T1 + 710 * MIN, 600_000),
           ("j5", "gpu-6", T1 + 700 * MIN, T1 + 710 * MIN, 600_000)]


def test_a_record_delivered_twice_counts_once(ledger):
    client, settings, ledger_cfg = ledger
    put_usage(client, DB, TWO_GPUS, 1)
    for n, record in enumerate(COPIES + TWO_GPUS[:1]):  # each again, in a message of its own
        put_usage(client, DB, [record], 20 + n)
    assert client.query(f"SELECT count() FROM {DB}.job_idle_segments WHERE job_id IN ('j3', 'j5')"
                        ).result_rows == [(9,)]  # the copies are stored
    assert listed(client) == LISTED  # open days: from the idle records
    hints = periodic.build_report(client, DB, "job", job_id="j3").section("Hints").rows
    assert [h["hint"] for h in hints] == ["loading stall"]  # no "mid-run stalls"
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    assert run.idle_stretch_days == {"ic": [D1, D2]}
    assert kept_d1(client) == KEPT_D1
    assert listed(client) == LISTED  # closed days: from idle_stretches_daily
    # a copy delivered after the close: D1 is worked out again (its record count changed), to the same
    put_usage(client, DB, [USAGE[7], TWO_GPUS[3]], 30)
    again = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT + dt.timedelta(hours=1))
    assert again.idle_stretch_days == {"ic": [D1]}
    assert kept_d1(client) == KEPT_D1 and listed(client) == LISTED


def test_two_gpus_of_a_job_idle_at_once_keep_a_stretch_each(ledger):
    client, settings, ledger_cfg = ledger
    put_usage(client, DB, TWO_GPUS, 1)
    assert listed(client) == LISTED
    bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    assert kept_d1(client) == KEPT_D1 and listed(client) == LISTED


def test_the_migration_works_out_again_the_closed_days_with_copies():
    """A warehouse before 0037 whose D1 and D2 were worked out with copies among their idle records (the
    stretches of 0028's views, phantoms included), and a late record of D1 since: 0037 works D1 out
    again (its copies once, the late record in, its record count), leaves D2 as it is, and adds nothing
    when run again."""
    client = warehouse_before("0037", DB, prefix="idle-stretches-once-")
    try:
        put_usage(client, DB, USAGE + TWO_GPUS, 0)
        for n, record in enumerate(COPIES + TWO_GPUS[:1]):
            put_usage(client, DB, [record], 20 + n)
        assert idle_stretches.refresh(client, DB, "ic", [D1, D2], version=7) == [D1, D2]
        assert listed(client) != LISTED and kept_d1(client) != KEPT_D1  # the phantoms, as 0028 kept them
        put_usage(client, DB, LATE, 10)
        d2 = client.query(f"SELECT * FROM {DB}.idle_stretches_daily WHERE day = '{D2}' ORDER BY ALL").result_rows
        assert migrations.migrate(client, DB)[0] == "0037"  # and any later file
        j3 = ("j3", "gpu-3", T1 + 600 * MIN, 10, 600, 0)
        late = sorted([s for s in LISTED if s != j3] + [("j3", "gpu-3", T1 + 600 * MIN, 20, 1200, 0)])
        late_d1 = sorted([k for k in KEPT_D1 if k[0] != "j3"] + [("j3", "gpu-3", T1 + 600 * MIN, T1 + 620 * MIN,
                                                                  1_200_000)])
        assert listed(client) == late and kept_d1(client) == late_d1
        assert client.query(f"SELECT * FROM {DB}.idle_stretches_daily WHERE day = '{D2}' ORDER BY ALL"
                            ).result_rows == d2  # no copy among D2's records: not written
        # D1's record count as idle_stretches.refresh counts them (rows): the next close run leaves D1 be
        assert client.query(f"SELECT day, argMax(segments, version) FROM {DB}.idle_stretch_days GROUP BY day "
                            "ORDER BY day").result_rows == [(D1, 11), (D2, 3)]
        assert idle_stretches.refresh(client, DB, "ic", [D1, D2]) == []
        assert not client.query(f"EXISTS TABLE {DB}.idle_stretch_rework_days").result_rows[0][0]
        counts = f"SELECT (SELECT count() FROM {DB}.idle_stretches_daily), (SELECT count() FROM {DB}.idle_stretch_days)"
        before = client.query(counts).result_rows
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0037'")
        assert migrations.migrate(client, DB) == ["0037"]
        assert client.query(counts).result_rows == before
        assert listed(client) == late and kept_d1(client) == late_d1
    finally:
        client.close()


# ------------------------------------------------------- a record that crosses midnight (sql/0040)
# A tick goes whole to the window it starts in (streams/join.py) and agents stamp ticks with the wall
# clock, so a day's last idle record may end a few seconds after midnight. The close split such a
# stretch in two: D1's piece ended at 00:00:03, not at midnight, and D2's started there, not at midnight.
#   j1 gpu-1 idle D1 23:50:03-D2 00:00:03 (a record of D1), D2 00:00:03-00:10:03  -> 20 min, closed/closed
#   j2 gpu-2 idle D2 23:55:02-D3 00:00:02 (a record of D2), D3 00:00:02-00:05:02  -> 10 min, closed/open
#   j3 gpu-3 idle D1 23:55:01 to D3 00:08:01, records crossing both midnights      -> one stretch of 1,453 min
#   j4 gpu-4 idle D1 23:58:00-D2 00:00:04, then D2 00:00:10-00:05:10 (a gap)       -> two stretches
S = 1000
ACROSS = [
    rec("gpu-1", T2 - 10 * MIN + 3 * S, T2 + 3 * S, "allocated_idle", "j1"),
    rec("gpu-1", T2 + 3 * S, T2 + 10 * MIN + 3 * S, "allocated_idle", "j1"),
    rec("gpu-2", T3 - 5 * MIN + 2 * S, T3 + 2 * S, "allocated_idle", "j2"),
    rec("gpu-2", T3 + 2 * S, T3 + 5 * MIN + 2 * S, "allocated_idle", "j2"),
    rec("gpu-3", T2 - 5 * MIN + S, T2 + S, "allocated_idle", "j3"),
    rec("gpu-3", T2 + S, T3 - 2 * MIN + S, "allocated_idle", "j3"),
    rec("gpu-3", T3 - 2 * MIN + S, T3 + 3 * MIN + S, "allocated_idle", "j3"),
    rec("gpu-3", T3 + 3 * MIN + S, T3 + 8 * MIN + S, "allocated_idle", "j3"),
    rec("gpu-4", T2 - 2 * MIN, T2 + 4 * S, "allocated_idle", "j4"),
    rec("gpu-4", T2 + 10 * S, T2 + 5 * MIN + 10 * S, "allocated_idle", "j4"),
    rec("gpu-5", T3, T3 + 240 * MIN, "unallocated"),
]
#: (job, stretch start ms, stretch end ms), one per stretch
ACROSS_STRETCHES = sorted([("j1", T2 - 10 * MIN + 3 * S, T2 + 10 * MIN + 3 * S),
                           ("j2", T3 - 5 * MIN + 2 * S, T3 + 5 * MIN + 2 * S),
                           ("j3", T2 - 5 * MIN + S, T3 + 8 * MIN + S),
                           ("j4", T2 - 2 * MIN, T2 + 4 * S), ("j4", T2 + 10 * S, T2 + 5 * MIN + 10 * S)])


def spans(client) -> list:
    return sorted((job, int(start.timestamp() * 1000), int(end.timestamp() * 1000)) for job, start, end in
                  client.query(f"SELECT job_id, stretch_start, stretch_end FROM {DB}.job_idle_stretches").result_rows)


@pytest.fixture
def empty(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (client, settings):
        yield client, settings, load_ledger_config(None)


def test_a_stretch_whose_record_crosses_midnight_stays_one_after_the_close(empty):
    client, settings, ledger_cfg = empty
    put_usage(client, DB, ACROSS, 0)
    assert spans(client) == ACROSS_STRETCHES  # every day open
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    assert run.idle_stretch_days == {"ic": [D1, D2]}
    # D1's pieces end after midnight, as their last records do
    assert client.query(f"SELECT job_id, end_ms FROM {DB}.idle_stretches_daily FINAL WHERE day = '{D1}' "
                        "ORDER BY job_id").result_rows == [("j1", T2 + 3 * S), ("j3", T2 + S), ("j4", T2 + 4 * S)]
    assert spans(client) == ACROSS_STRETCHES  # D1/D2 closed, D3 open
    hints = periodic.build_report(client, DB, "job", job_id="j1").section("Hints").rows
    assert "mid-run stalls" not in [h["hint"] for h in hints]


def test_a_closed_days_stretch_crossing_midnight_joins_the_open_day(empty):
    """D1 closed, D2 still open (the records reach D2 23:58:01): D2's idle records that start where D1's
    last record ended join its stretch; then D2 closed and D3 open, likewise."""
    client, settings, ledger_cfg = empty
    until_d2 = [r for r in ACROSS if r.end_ms < T3]
    put_usage(client, DB, until_d2, 0)
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT)
    assert run.idle_stretch_days == {"ic": [D1]}
    assert spans(client) == sorted([("j1", T2 - 10 * MIN + 3 * S, T2 + 10 * MIN + 3 * S),
                                    ("j3", T2 - 5 * MIN + S, T3 - 2 * MIN + S),
                                    ("j4", T2 - 2 * MIN, T2 + 4 * S), ("j4", T2 + 10 * S, T2 + 5 * MIN + 10 * S)])
    put_usage(client, DB, [r for r in ACROSS if r not in until_d2], 1)
    run = bills.close_due(client, settings, ledger_cfg, now=CLOSE_AT + dt.timedelta(hours=1))
    assert run.idle_stretch_days == {"ic": [D2]}
    assert spans(client) == ACROSS_STRETCHES
