"""The cluster idle that `report bills --idle-redistribution` shares counts each unallocated record once,
and a closed day's is fixed when it closes (closed_cluster_idle, sql/0039): a late unallocated record of a
closed day is booked, by the next close run, on the cluster's next open day and shared there, as the
jobs' late usage is (docs/accounting.md §6, §6a).

The scenario (cluster c1, grace 1 h, usage_record: 1 micro per GPU-second, definition d1):
  D = 2024-03-01  g1 01:00-01:10 executing j1 (alpha) 600;  g2 01:00-02:00 unallocated 3,600
  D1 = 2024-03-02 g3 00:00-00:10 executing j2 (beta)  600;  g4 00:00-01:00 unallocated 3,600 (the horizon)
Late, after D closed: g5 01:00-01:30 unallocated on D, 1,800."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, migrations, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

DB = "bills_cluster_idle"
MIN = 60_000
D, D1 = dt.date(2024, 3, 1), dt.date(2024, 3, 2)
B = 1709251200000 + 3_600_000   # 2024-03-01T01:00:00Z
NEXT = 1709337600000            # 2024-03-02T00:00:00Z
IDLE = usage_record("c1", "g2", B, B + 60 * MIN, "unallocated")
USAGE = [usage_record("c1", "g1", B, B + 10 * MIN, "executing", "j1", "alpha"), IDLE,
         usage_record("c1", "g3", NEXT, NEXT + 10 * MIN, "executing", "j2", "beta"),
         usage_record("c1", "g4", NEXT, NEXT + 60 * MIN, "unallocated")]
LATE_IDLE = usage_record("c1", "g5", B, B + 30 * MIN, "unallocated")


def at(hour: int) -> dt.datetime:
    return dt.datetime(2024, 3, 2, hour, tzinfo=dt.timezone.utc)


def shared(c) -> dict[tuple, tuple]:
    return {(r["day"], r["status"], r["tenant"]): (r["cluster_idle_cost_micros"], r["billed_total_cost_micros"])
            for r in reports.fetch(c, DB, "bills", idle_redistribution="even")}


@pytest.fixture
def ledger(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        c.command(f"SYSTEM STOP MERGES {DB}.usage_raw")  # copies stay apart, as before a merge
        put_usage(c, DB, USAGE, 0)
        yield c, s, load_ledger_config(None)


def test_an_unallocated_record_stored_twice_is_shared_once(ledger):
    c, s, led = ledger
    put_usage(c, DB, [IDLE], 1)  # a replay or back-fill stores the record again
    assert shared(c)[(D, "open", "alpha")] == (3600, 4200), "an open day's idle counts each record once"
    assert bills.close_due(c, s, led, now=at(2)).closed == {"c1": [D]}
    assert c.query(f"SELECT booked_day, corrects_day, cluster, definition_version, gpu_ms, cost_micros "
                   f"FROM {DB}.closed_cluster_idle").result_rows == [(D, D, "c1", "d1", 3_600_000, 3600)]
    put_usage(c, DB, [IDLE], 2)
    assert shared(c)[(D, "closed", "alpha")] == (3600, 4200), "a closed day's idle counts each record once"
    again = bills.close_due(c, s, led, now=at(3))
    assert again.bill_run_id is None and again.cluster_idle_rows == 0  # copies change nothing to book


def test_a_late_unallocated_record_is_booked_on_the_next_open_day(ledger):
    c, s, led = ledger
    bills.close_due(c, s, led, now=at(2))
    assert shared(c) == {(D, "closed", "alpha"): (3600, 4200), (D1, "open", "beta"): (3600, 4200)}
    put_usage(c, DB, [LATE_IDLE], 1)
    run = bills.close_due(c, s, led, now=at(3))
    assert run.bill_run_id and run.cluster_idle_rows == 1 and run.adjustment_rows == 0
    assert c.query(f"SELECT booked_day, corrects_day, gpu_ms, cost_micros, bill_run_id FROM {DB}.closed_cluster_idle "
                   "WHERE booked_day != corrects_day").result_rows == [(D1, D, 1_800_000, 1800, run.bill_run_id)]
    # the closed day keeps its figure; the booked day shares its own idle and the correction
    assert shared(c) == {(D, "closed", "alpha"): (3600, 4200), (D1, "open", "beta"): (5400, 6000)}
    assert bills.close_due(c, s, led, now=at(4)).bill_run_id is None  # booked once
    # D1 closes with both: its own idle, stored at its close, and the correction booked on it
    d2 = NEXT + 86_400_000
    put_usage(c, DB, [usage_record("c1", "g4", d2, d2 + 60 * MIN, "unallocated")], 2)
    assert bills.close_due(c, s, led, now=dt.datetime(2024, 3, 3, 2, tzinfo=dt.timezone.utc)).closed == {"c1": [D1]}
    assert shared(c) == {(D, "closed", "alpha"): (3600, 4200), (D1, "closed", "beta"): (5400, 6000)}


def test_the_migration_back_fills_days_closed_before_it():
    """A warehouse at 0038 with D closed: 0039 writes D's cluster idle, each record once, under the run
    'sql/0039' and commits it; running the file again writes nothing more."""
    client = warehouse_before("0039", DB, prefix="closed-cluster-idle-")
    try:
        put_usage(client, DB, USAGE, 0)
        put_usage(client, DB, [IDLE], 1)
        warehouse.insert_rows(client, "closed_days", [dict(day=D, cluster="c1", bill_run_id="br-old", horizon_ms=0)],
                              database=DB)
        warehouse.insert_rows(client, "bill_runs", [dict(bill_run_id="br-old", days=[D], clusters=["c1"],
                                                         definition_version="d1", grace_s=3600.0, horizons={},
                                                         closed_rows=0, adjustment_rows=0)], database=DB)
        assert migrations.migrate(client, DB)[0] == "0039"
        filled = f"SELECT booked_day, corrects_day, cluster, gpu_ms, cost_micros, bill_run_id FROM {DB}.closed_cluster_idle"
        assert client.query(filled).result_rows == [(D, D, "c1", 3_600_000, 3600, "sql/0039")]
        runs = client.query(f"SELECT days, clusters FROM {DB}.bill_runs WHERE bill_run_id = 'sql/0039'").result_rows
        assert runs == [([D], ["c1"])]
        # the file again (as if interrupted before its record): no second copy, no second run row
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0039'")
        assert migrations.migrate(client, DB) == ["0039"]
        assert client.query(f"SELECT count() FROM {DB}.closed_cluster_idle").result_rows == [(1,)]
        assert client.query(f"SELECT count() FROM {DB}.bill_runs WHERE bill_run_id = 'sql/0039'").result_rows == [(1,)]
    finally:
        client.close()
