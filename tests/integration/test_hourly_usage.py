"""Usage per hour and attempt from usage_by_job_hourly (sql/0027), on the real engine (chDB): the reports,
the bill close and the carbon view (sql/0029) read a day from the hourly table only while it is exact (as many records counted as
usage_raw holds distinct ones), and from usage_raw with each record once otherwise; the migration
back-fills the table.

The scenario, worked by hand (cluster "hc", day D = 2026-11-20 UTC, open; cost 1 micro per GPU-s):
  j1 (t1) gpu-1 00:00-00:05 executing        300 s, 36,000 J
  j1 (t1) gpu-1 00:05-00:10 allocated idle   300 s, 18,000 J
  j1 (t1) gpu-1 01:00-01:01 executing         60 s,  7,200.4 J (rounded to 7,200,400 mJ)
  j2 (t2) gpu-2 00:50-01:00 executing        600 s, 72,000 J
  gpu-3 00:00-02:00 unallocated             7200 s (not billed; counted by the check)
So t1: compute 360 s = 360 micros, idle 300; t2: compute 600. A copy of j2's record written
again (a replay) makes the day inexact: the hourly table then counts it twice, the reports still once.
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import UsageRecord
from gpuledger.streams.carbondefs import CarbonDefinition
from gpuledger.warehouse import bills, carbon, migrations, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

DB = "hourly_usage"
MIN = 60_000
D = dt.date(2026, 11, 20)
T = int(dt.datetime(2026, 11, 20, tzinfo=dt.timezone.utc).timestamp() * 1000)
HOUR0 = T // 3_600_000


def rec(gpu: str, start: int, end: int, state: str, job: str = "", tenant: str = "", energy: float = 0.0) -> UsageRecord:
    return usage_record("hc", gpu, start, end, state, job, tenant, energy)


USAGE = [
    rec("gpu-1", T, T + 5 * MIN, "executing", "j1", "t1", 36_000.0),
    rec("gpu-1", T + 5 * MIN, T + 10 * MIN, "allocated_idle", "j1", "t1", 18_000.0),
    rec("gpu-1", T + 60 * MIN, T + 61 * MIN, "executing", "j1", "t1", 7_200.4),
    rec("gpu-2", T + 50 * MIN, T + 60 * MIN, "executing", "j2", "t2", 72_000.0),
    rec("gpu-3", T, T + 120 * MIN, "unallocated"),
]
#: (tenant, compute micros, idle micros) and (job, cost micros, executing GPU-ms) of D, by hand
BILLS = {("t1", 360, 300), ("t2", 600, 0)}
JOBS = {("j1", 660, 360_000), ("j2", 600, 600_000)}


def put(client, records, offset):
    put_usage(client, DB, records, offset)


def bill_figures(client) -> set:
    return {(r["tenant"], r["compute_cost_micros"], r["idle_cost_micros"])
            for r in reports.fetch(client, DB, "bills") if r["day"] == D}


def job_figures(client) -> set:
    return {(r["job_id"], r["cost_micros"], round(r["executing_gpu_hours"] * 3_600_000))
            for r in reports.fetch(client, DB, "jobs")}


def hourly(client) -> list[tuple]:
    return client.query(f"SELECT hour - {HOUR0}, job_id, state, sum(records), sum(gpu_ms), sum(cost_micros), "
                        f"sum(energy_mj) FROM {DB}.usage_by_job_hourly GROUP BY ALL ORDER BY ALL").result_rows


@pytest.fixture
def client(tmp_path):
    with migrated_warehouse(tmp_path, DB) as (client, _):
        put(client, USAGE, 0)
        yield client


def test_an_exact_day_is_read_from_the_hourly_table(client):
    assert hourly(client) == [(0, "", "unallocated", 1, 7_200_000, 7200, 0),  # an hour: the record's start
                              (0, "j1", "allocated_idle", 1, 300_000, 300, 18_000_000),
                              (0, "j1", "executing", 1, 300_000, 300, 36_000_000),
                              (0, "j2", "executing", 1, 600_000, 600, 72_000_000),
                              (1, "j1", "executing", 1, 60_000, 60, 7_200_400)]
    assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {"hc": [D]}
    assert bill_figures(client) == BILLS and job_figures(client) == JOBS
    # the reports read the hourly table for D: a row added to it alone (no record) shows in them
    client.insert("usage_by_job_hourly", [[D, "hc", HOUR0, "t2", "q", "j2", 0, "d1", "executing", 0, 0, 0, 1, 0.0, 0]],
                  column_names=["day", "cluster", "hour", "tenant", "queue", "job_id", "attempt", "definition_version",
                                "state", "records", "gpu_ms", "effective_gpu_ms", "cost_micros", "energy_j", "energy_mj"],
                  database=DB)
    assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {"hc": [D]}
    assert ("t2", 601, 0) in bill_figures(client) and ("j2", 601, 600_000) in job_figures(client)


def test_a_record_written_twice_sends_the_reports_to_usage_raw(client):
    put(client, USAGE[3:4], 10)  # a replayed copy of j2's record, in its own insert
    assert (0, "j2", "executing", 2, 1_200_000, 1200, 144_000_000) in hourly(client)  # the view counts both
    assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {}
    assert bill_figures(client) == BILLS and job_figures(client) == JOBS  # each record once


def test_a_day_missing_records_in_usage_raw_is_not_exact(client):
    client.command(f"DELETE FROM {DB}.usage_raw WHERE gpu_uuid = 'gpu-3'")  # e.g. expired or repaired
    assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {}
    assert bill_figures(client) == BILLS and job_figures(client) == JOBS


def test_the_migration_back_fills_the_hourly_table():
    """A warehouse at 0026 holding D's records (one written twice): 0027 fills the table from what
    usage_raw holds; running the file again adds nothing."""
    client = warehouse_before("0027", DB, prefix="hourly-usage-")
    try:
        put(client, USAGE, 0)
        put(client, USAGE[3:4], 10)
        client.command(f"OPTIMIZE TABLE {DB}.usage_raw FINAL")  # the copy merged away, as merges do
        assert migrations.migrate(client, DB)[0] == "0027"
        assert [row[:4] for row in hourly(client)] == [(0, "", "unallocated", 1), (0, "j1", "allocated_idle", 1),
                                                       (0, "j1", "executing", 1), (0, "j2", "executing", 1),
                                                       (1, "j1", "executing", 1)]
        assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {"hc": [D]}
        assert bill_figures(client) == BILLS and job_figures(client) == JOBS
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0027'")
        assert migrations.migrate(client, DB) == ["0027"]
        assert client.query(f"SELECT sum(records) FROM {DB}.usage_by_job_hourly").result_rows == [(5,)]
    finally:
        client.close()


@pytest.mark.parametrize("path", ["hourly table", "usage_raw"])
def test_a_close_run_books_the_same_rows_from_either_read(client, monkeypatch, path):
    """The close reads D once (bills.fetch_day_usage) for its bill and its energy: from the hourly table
    while D is exact, else from usage_raw; the closed rows are the hand-worked ones either way."""
    if path == "usage_raw":
        monkeypatch.setattr(bills, "exact_hourly_days", lambda *a, **k: {})
    put(client, [rec("gpu-3", T + 1440 * MIN, T + 1560 * MIN, "unallocated")], 20)  # the horizon: D+1 02:00
    run = bills.close_due(client, Settings(database=DB, bills_close_grace_s=3600), load_ledger_config(None),
                          now=dt.datetime(2026, 11, 21, 3, tzinfo=dt.timezone.utc))
    assert run.closed == {"hc": [D]}
    lines = client.query(f"SELECT job_id, line, gpu_ms, cost_micros FROM {DB}.closed_job_cost ORDER BY ALL").result_rows
    assert lines == [("j1", "compute", 360_000, 360), ("j1", "idle", 300_000, 300), ("j2", "compute", 600_000, 600)]
    energy = client.query(f"SELECT hour - {HOUR0}, job_id, state, energy_mj, records FROM {DB}.closed_energy "
                          "ORDER BY ALL").result_rows
    assert energy == [(0, "j1", "allocated_idle", 18_000_000, 1), (0, "j1", "executing", 36_000_000, 1),
                      (0, "j2", "executing", 72_000_000, 1), (1, "j1", "executing", 7_200_400, 1)]


def test_the_carbon_view_reads_exact_open_days_from_the_hourly_table(client):
    """tenant_daily_carbon (sql/0029): D exact -> from the hourly table (a row added to it alone shows), a
    copy of a record -> from usage_raw, the same kg either way as the bills report. 500 g/kWh, PUE 1:
    t1 61,200.4 J = 0.0170001 kWh -> 8.50005556 g; t2 72,000 J = 0.02 kWh -> 10 g."""
    carbon.record_definition(client, DB, CarbonDefinition(version="c1", pue=1.0, default_gco2e_per_kwh=500.0,
                                                          default_source="test"))

    def view() -> dict:
        return {t: kg for t, kg in client.query(f"SELECT tenant, co2e_kg FROM {DB}.tenant_daily_carbon").result_rows}

    def billed() -> dict:
        return {r["tenant"]: r["co2e_kg"] for r in reports.fetch(client, DB, "bills") if r["day"] == D}

    expected = {"t1": 61_200.4 / 3_600_000 * 500 / 1000, "t2": 72_000 / 3_600_000 * 500 / 1000}
    assert client.query(f"SELECT * FROM {DB}.usage_by_job_hourly_exact_days").result_rows == [("hc", D)]
    assert view() == pytest.approx(expected) and billed() == pytest.approx(expected)
    client.insert("usage_by_job_hourly", [[D, "hc", HOUR0, "t2", "q", "j2", 0, "d1", "executing", 0, 0, 0, 0, 3600.0, 0]],
                  column_names=["day", "cluster", "hour", "tenant", "queue", "job_id", "attempt", "definition_version",
                                "state", "records", "gpu_ms", "effective_gpu_ms", "cost_micros", "energy_j", "energy_mj"],
                  database=DB)
    assert view()["t2"] == pytest.approx(expected["t2"] + 0.0005)  # 3,600 J more: read from the hourly table
    put(client, USAGE[3:4], 10)  # a copy: D is no longer exact
    assert client.query(f"SELECT * FROM {DB}.usage_by_job_hourly_exact_days").result_rows == []
    assert view() == pytest.approx(expected) and billed() == pytest.approx(expected)


# ---------------------------------------------------------------- hours found exact (sql/0035)
def stored_hours(client) -> list[tuple]:
    return client.query(f"SELECT hour - {HOUR0}, max(records) FROM {DB}.usage_exact_hours GROUP BY hour "
                        "ORDER BY hour").result_rows


def trusted(client) -> dict:
    return bills.exact_hourly_days(client, DB, {"hc": [D]}, checked_hours=True)


@pytest.fixture
def counts(monkeypatch):
    """The SQL of every count exact_hourly_days makes, with its hours (None: every hour)."""
    made: list[tuple[str, list | None]] = []
    real = bills._q

    def spying(client, sql, params=None):
        made.append((sql, (params or {}).get("hours")))
        return real(client, sql, params)

    monkeypatch.setattr(bills, "_q", spying)
    return made


def final_counts(made) -> list:
    return [hours for sql, hours in made if " FINAL" in sql]


def test_a_close_run_records_the_open_days_exact_hours(client):
    """D is open (not due at 03:00 the same day): the run closes nothing and stores D's hours 0 and 1
    with their record counts. Hour 2 ends after the horizon (02:30, a record of 02:10-02:30), so it is
    still being written and not stored; a second run finds the others stored and counts nothing again."""
    put(client, [rec("gpu-2", T + 130 * MIN, T + 150 * MIN, "executing", "j2", "t2")], 10)
    run = bills.close_due(client, Settings(database=DB, bills_close_grace_s=3600), load_ledger_config(None),
                          now=dt.datetime(2026, 11, 20, 3, tzinfo=dt.timezone.utc))
    assert run.bill_run_id is None and run.exact_hours == 2
    assert stored_hours(client) == [(0, 4), (1, 1)]
    assert bills.record_exact_hours(client, DB, {"hc": [D]}, {"hc": T + 150 * MIN}) == 0
    assert bills.record_exact_hours(client, DB, {"hc": [D]}) == 1  # no horizon: hour 2 as well


def test_hours_found_exact_are_not_counted_again(client, counts):
    assert trusted(client) == {"hc": [D]} and final_counts(counts) == [None]  # nothing stored: every hour
    bills.record_exact_hours(client, DB, {"hc": [D]})
    counts.clear()
    assert trusted(client) == {"hc": [D]} and final_counts(counts) == []
    assert any("count() AS n FROM" in sql and " FINAL" not in sql for sql, _ in counts)  # the day's plain count
    assert bill_figures(client) == BILLS and job_figures(client) == JOBS
    counts.clear()
    assert bills.exact_hourly_days(client, DB, {"hc": [D]}) == {"hc": [D]} and final_counts(counts) == [None]


def test_an_hour_written_again_is_counted_again(client, counts):
    bills.record_exact_hours(client, DB, {"hc": [D]})
    put(client, [rec("gpu-2", T + 130 * MIN, T + 140 * MIN, "executing", "j2", "t2")], 10)  # hour 2, new
    counts.clear()
    assert trusted(client) == {"hc": [D]} and final_counts(counts) == [[HOUR0 + 2]]
    put(client, USAGE[3:4], 11)  # a copy of j2's record of hour 0
    counts.clear()
    assert trusted(client) == {} and final_counts(counts) == [[HOUR0, HOUR0 + 2]]
    assert bills.record_exact_hours(client, DB, {"hc": [D]}) == 1  # hour 2 only: hour 0 is not exact
    assert stored_hours(client) == [(0, 4), (1, 1), (2, 1)]
    assert bill_figures(client) == {("t1", 360, 300), ("t2", 1200, 0)}  # j2's copy once, its new record


def test_a_record_deleted_from_an_hour_found_exact_is_seen(client, counts):
    """No insert: the hourly counts still equal the stored ones, so no hour is counted again with FINAL.
    The day's plain count is one short of them: D is not exact, and the bills read usage_raw."""
    bills.record_exact_hours(client, DB, {"hc": [D]})
    client.command(f"DELETE FROM {DB}.usage_raw WHERE gpu_uuid = 'gpu-2'")
    counts.clear()
    assert trusted(client) == {} and final_counts(counts) == []
    assert bill_figures(client) == {("t1", 360, 300)}  # read from usage_raw: without j2's record


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_trusting_the_hours_found_exact_changes_no_answer(tmp_path, seed):
    """Random writes to one day (new records, copies of records, deletions, merges), a record run now and
    then: after each step the day is exact with the stored hours trusted exactly when it is with every
    hour counted."""
    import random

    rng = random.Random(seed)
    with migrated_warehouse(tmp_path, DB) as (client, _):
        written: list[UsageRecord] = []
        answers = set()
        for step in range(30):
            action = rng.choice(["new", "new", "copy", "delete", "merge", "record", "record"])
            if action == "new" or not written:
                start = T + rng.randrange(0, 6 * 60) * MIN
                gpu = f"gpu-{rng.randrange(4)}"
                if any(r.gpu_uuid == gpu and r.start_ms == start for r in written):
                    continue
                written.append(rec(gpu, start, start + MIN, "executing", "j1", "t1"))
                put(client, written[-1:], step)
            elif action == "copy":
                put(client, [rng.choice(written)], step)
            elif action == "delete":
                gone = written.pop(rng.randrange(len(written)))
                client.command(f"DELETE FROM {DB}.usage_raw WHERE record_id = '{gone.record_id}'")
            elif action == "merge":
                client.command(f"OPTIMIZE TABLE {DB}.usage_raw FINAL")
            else:
                bills.record_exact_hours(client, DB, {"hc": [D]})
            full = bills.exact_hourly_days(client, DB, {"hc": [D]})
            assert trusted(client) == full, f"step {step} ({action})"
            answers.add(bool(full))
        assert answers == {True, False}  # both answers were reached
