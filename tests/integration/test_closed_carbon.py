"""Carbon of closed days from closed_energy (sql/0023, docs/carbon.md "Closed days"), on the real engine
(chDB): the same figures before and after the close (open days: usage_raw summed per hour; closed days:
closed_energy, not usage_raw); a day whose zone's intensity changes within an hour is worked out record
by record, open or closed, while usage_raw holds its records, and from closed_energy per hour once they
have expired (sql/0041); late records correct a closed day's energy once; the migration back-fills days
closed before it.

The scenario, worked by hand (cluster and zone "cc", day D = 2026-11-10 UTC, PUE 1.5, default 500 g/kWh,
series: 200 g/kWh from D 00:00, 800 from D 02:00):
  j1 (t1) gpu-1 00:00-00:05 executing       36,000 J = 0.010 kWh x 1.5 x 200 =  3.0 g
  j1 (t1) gpu-1 00:05-00:10 allocated idle  18,000 J = 0.005 kWh x 1.5 x 200 =  1.5 g
  j1 (t1) gpu-1 02:00-02:05 executing       36,000 J = 0.010 kWh x 1.5 x 800 = 12.0 g   (j1: 16.5 g)
  j2 (t2) gpu-2 01:50-02:00 executing       72,000 J = 0.020 kWh x 1.5 x 200 =  6.0 g
  gpu-3 D+1 00:00-02:00 unallocated: the horizon is D+1 02:00, so D is due with a grace of 1 h.
  The j2 record is written twice (a replay): counted once.
A value of 400 from D 01:45 splits D's 01:00 hour: j2 (starting 01:50) is then 0.020 x 1.5 x 400 = 12 g,
which only the record-level read gets right (the hour's start is under the 200 value).
A late record for D after the close: j2 gpu-4 01:00-01:10, 36,000 J -> +3 g for t2 (200 g/kWh).
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import UsageRecord
from gpuledger.streams.carbondefs import CarbonDefinition
from gpuledger.warehouse import bills, carbon, migrations, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

DB = "carbon_closed"
MIN = 60_000
D = dt.date(2026, 11, 10)
T = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
NEXT = T + 86_400_000
DEFINITION = CarbonDefinition(version="c-test", pue=1.5, default_gco2e_per_kwh=500.0, default_source="test")
SERIES = [{"zone": "cc", "valid_from_ms": T, "gco2e_per_kwh": 200.0},
          {"zone": "cc", "valid_from_ms": T + 120 * MIN, "gco2e_per_kwh": 800.0}]
WITHIN_AN_HOUR = [{"zone": "cc", "valid_from_ms": T + 105 * MIN, "gco2e_per_kwh": 400.0}]


def rec(gpu: str, start: int, end: int, state: str, job: str = "", tenant: str = "", energy: float = 0.0) -> UsageRecord:
    return usage_record("cc", gpu, start, end, state, job, tenant, energy)


USAGE = [
    rec("gpu-1", T, T + 5 * MIN, "executing", "j1", "t1", 36_000.0),
    rec("gpu-1", T + 5 * MIN, T + 10 * MIN, "allocated_idle", "j1", "t1", 18_000.0),
    rec("gpu-1", T + 120 * MIN, T + 125 * MIN, "executing", "j1", "t1", 36_000.0),
    rec("gpu-2", T + 110 * MIN, T + 120 * MIN, "executing", "j2", "t2", 72_000.0),
    rec("gpu-3", NEXT, NEXT + 120 * MIN, "unallocated"),
]
LATE = [rec("gpu-4", T + 60 * MIN, T + 70 * MIN, "executing", "j2", "t2", 36_000.0)]
CLOSE_AT = dt.datetime(2026, 11, 11, 3, tzinfo=dt.timezone.utc)


def put(client, records, offset):
    put_usage(client, DB, records, offset)


def figures(client) -> dict:
    """kg CO2e of D by (source, tenant or job): the bills report, the jobs report, tenant_daily_carbon (and
    each job's row as the jobs report filtered to that job gives it, which must be the same row)."""
    out = {("bills", r["tenant"]): r["co2e_kg"] for r in reports.fetch(client, DB, "bills")
           if r["status"] != "adjustment" and r["day"] == D}
    jobs = reports.fetch(client, DB, "jobs")
    out.update({("jobs", r["job_id"]): r["co2e_kg"] for r in jobs})
    for row in jobs:  # one job's report reads only its money and carbon, and gives the same row
        assert reports.fetch(client, DB, "jobs", job_id=row["job_id"]) == [row]
    out.update({("view", r[0]): r[1] for r in client.query(
        f"SELECT tenant, co2e_kg FROM {DB}.tenant_daily_carbon WHERE day = '{D}'").result_rows})
    return out


def expected(t1_g: float, t2_g: float, j1_g: float, j2_g: float, sources=("bills", "jobs", "view")) -> dict:
    by = {"bills": {"t1": t1_g, "t2": t2_g}, "view": {"t1": t1_g, "t2": t2_g}, "jobs": {"j1": j1_g, "j2": j2_g}}
    return {(source, k): g / 1000 for source in sources for k, g in by[source].items()}


def record_days(client) -> set:
    return {(r[0], r[1]) for r in client.query(f"SELECT cluster, day FROM {DB}.carbon_record_days").result_rows}


@pytest.fixture
def ledger(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (client, settings):
        put(client, USAGE, 0)
        put(client, USAGE[3:4], 10)  # a replayed copy of j2's record
        carbon.record_definition(client, DB, DEFINITION)
        carbon.load_intensity(client, DB, SERIES, "series.csv", "ops")
        yield client, settings, load_ledger_config(None)


def close(client, settings, ledger_cfg, now=CLOSE_AT):
    return bills.close_due(client, settings, ledger_cfg, now=now)


def test_closed_days_read_their_energy_from_closed_energy(ledger):
    client, settings, ledger_cfg = ledger
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))  # open: usage_raw per hour
    assert ("cc", D) not in record_days(client)
    run = close(client, settings, ledger_cfg)
    assert run.closed == {"cc": [D]} and run.energy_rows == 4  # (hour, job, state): 00 j1 x2, 01 j2, 02 j1
    stored = client.query(f"SELECT hour - intDiv({T}, 3600000), job_id, state, energy_mj, records, bill_run_id "
                          f"FROM {DB}.closed_energy ORDER BY ALL").result_rows
    assert stored == [(0, "j1", "allocated_idle", 18_000_000, 1, run.bill_run_id),
                      (0, "j1", "executing", 36_000_000, 1, run.bill_run_id),
                      (1, "j2", "executing", 72_000_000, 1, run.bill_run_id),  # the replayed copy once
                      (2, "j1", "executing", 36_000_000, 1, run.bill_run_id)]
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
    # not from usage_raw: with D's records gone from it, the closed day's carbon stays
    client.command(f"ALTER TABLE {DB}.usage_raw DELETE WHERE day = '{D}' SETTINGS mutations_sync = 2")
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
    # a new definition applies to closed days too
    carbon.record_definition(client, DB, CarbonDefinition(version="c-2", pue=3.0, default_gco2e_per_kwh=500.0,
                                                          default_source="test"))
    assert figures(client) == pytest.approx(expected(33.0, 12.0, 33.0, 12.0))


def test_an_intensity_change_within_an_hour_reads_the_records(ledger):
    client, settings, ledger_cfg = ledger
    carbon.load_intensity(client, DB, WITHIN_AN_HOUR, "corrected.csv", "ops")
    assert ("cc", D) in record_days(client)
    # j2 starts at 01:50, after the 01:45 value: 12 g; the hour's start alone would say 6 g
    assert figures(client) == pytest.approx(expected(16.5, 12.0, 16.5, 12.0))  # open
    close(client, settings, ledger_cfg)
    assert figures(client) == pytest.approx(expected(16.5, 12.0, 16.5, 12.0))  # closed


def drop_records(client, keep: str = "0") -> None:
    """D's usage records gone from usage_raw, as usage retention drops them (except those `keep` selects)."""
    client.command(f"ALTER TABLE {DB}.usage_raw DELETE WHERE day = '{D}' AND NOT ({keep}) SETTINGS mutations_sync = 2")


def test_a_closed_record_days_carbon_outlives_its_records(ledger):
    """A closed day of a zone with a within-the-hour value is read record by record while usage_raw holds
    its records; once they have expired, from closed_energy per hour (the hour's start: j2's 01:00 hour at
    200 g/kWh, 6 g instead of 12), never empty."""
    client, settings, ledger_cfg = ledger
    carbon.load_intensity(client, DB, WITHIN_AN_HOUR, "15min.csv", "ops")
    close(client, settings, ledger_cfg)
    assert ("cc", D) in record_days(client)
    assert figures(client) == pytest.approx(expected(16.5, 12.0, 16.5, 12.0))
    drop_records(client)
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
    assert ("cc", D) not in record_days(client)


def test_a_within_hour_value_loaded_after_the_records_expired(ledger):
    """A finer series loaded for a closed day whose records have already gone: its carbon still comes from
    closed_energy per hour."""
    client, settings, ledger_cfg = ledger
    close(client, settings, ledger_cfg)
    drop_records(client)
    carbon.load_intensity(client, DB, WITHIN_AN_HOUR, "corrected.csv", "ops")
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
    assert ("cc", D) not in record_days(client)


def test_a_closed_record_day_with_only_its_late_records_left(ledger):
    """The day's records expired but a later-written one (its own part, waiting for its newer month) is
    still there: fewer records than closed_energy counted, so the day comes from closed_energy (with the
    late record's energy, booked by the second close), not from the one record left."""
    client, settings, ledger_cfg = ledger
    carbon.load_intensity(client, DB, WITHIN_AN_HOUR, "15min.csv", "ops")
    close(client, settings, ledger_cfg)
    put(client, LATE, 20)
    close(client, settings, ledger_cfg, CLOSE_AT + dt.timedelta(hours=1))
    assert figures(client) == pytest.approx(expected(16.5, 15.0, 16.5, 15.0))  # late: 01:00 < 01:45, 200 g/kWh
    drop_records(client, keep="gpu_uuid = 'gpu-4'")
    assert figures(client) == pytest.approx(expected(16.5, 9.0, 16.5, 9.0))
    assert ("cc", D) not in record_days(client)


def test_late_records_correct_a_closed_days_energy_once(ledger):
    client, settings, ledger_cfg = ledger
    first = close(client, settings, ledger_cfg)
    put(client, LATE, 20)
    second = close(client, settings, ledger_cfg, CLOSE_AT + dt.timedelta(hours=1))
    assert second.closed == {} and second.adjustment_rows == 1 and second.energy_rows == 1
    assert client.query(f"SELECT day, hour - intDiv({T}, 3600000), job_id, energy_mj, records FROM {DB}.closed_energy "
                        f"WHERE bill_run_id = '{second.bill_run_id}'").result_rows == [(D, 1, "j2", 36_000_000, 1)]
    assert figures(client) == pytest.approx(expected(16.5, 9.0, 16.5, 9.0))
    third = close(client, settings, ledger_cfg, CLOSE_AT + dt.timedelta(hours=2))
    assert third.bill_run_id is None  # nothing new: nothing written
    assert first.bill_run_id != second.bill_run_id


def test_the_migration_back_fills_days_closed_before_it():
    """A warehouse at 0022 with D closed (its rows as a close run of that version wrote them): 0023 writes
    D's energy under the run 'sql/0023' and commits it; running the file again writes nothing more."""
    client = warehouse_before("0023", DB, prefix="closed-energy-")
    try:
        put(client, USAGE, 0)
        put(client, USAGE[3:4], 10)
        warehouse.insert_rows(client, "closed_days", [dict(day=D, cluster="cc", bill_run_id="br-old", horizon_ms=0)],
                              database=DB)
        warehouse.insert_rows(client, "bill_runs", [dict(bill_run_id="br-old", days=[D], clusters=["cc"],
                                                         definition_version="d1", grace_s=3600.0, horizons={},
                                                         closed_rows=0, adjustment_rows=0)], database=DB)
        assert migrations.migrate(client, DB)[0] == "0023"
        carbon.record_definition(client, DB, DEFINITION)
        carbon.load_intensity(client, DB, SERIES, "series.csv", "ops")
        assert ("cc", D) not in record_days(client)
        filled = client.query(f"SELECT sum(energy_mj), sum(records), any(bill_run_id) FROM {DB}.closed_energy").result_rows
        assert filled == [(162_000_000, 4, "sql/0023")]
        view = {k: v for k, v in figures(client).items() if k[0] == "view"}
        assert view == pytest.approx(expected(16.5, 6.0, 16.5, 6.0, sources=("view",)))
        runs = client.query(f"SELECT days, clusters FROM {DB}.bill_runs WHERE bill_run_id = 'sql/0023'").result_rows
        assert runs == [([D], ["cc"])]
        # the file again (as if interrupted before its record): no second copy, no second run row
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0023'")
        assert migrations.migrate(client, DB) == ["0023"]
        assert client.query(f"SELECT sum(energy_mj), count() FROM {DB}.closed_energy").result_rows == [(162_000_000, 4)]
        assert client.query(f"SELECT count() FROM {DB}.bill_runs WHERE bill_run_id = 'sql/0023'").result_rows == [(1,)]
    finally:
        client.close()


def test_a_cluster_mapped_to_a_region_takes_the_regions_series(ledger):
    """[carbon.zones] maps cluster cc to region r1: the series loaded for r1 applies, open and closed (the
    definition's zones reach the reports' queries as parameters)."""
    client, settings, ledger_cfg = ledger
    mapped = CarbonDefinition(version="c-zones", pue=1.5, default_gco2e_per_kwh=500.0, default_source="test",
                              zones={"cc": "r1"})
    carbon.record_definition(client, DB, mapped)
    # no series for r1 yet: the default, 500 g/kWh, everywhere (j1 0.025 kWh, j2 0.02 kWh, x 1.5)
    assert figures(client) == pytest.approx(expected(18.75, 15.0, 18.75, 15.0))
    carbon.load_intensity(client, DB, [{**row, "zone": "r1"} for row in SERIES], "r1.csv", "ops")
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
    close(client, settings, ledger_cfg)
    assert figures(client) == pytest.approx(expected(16.5, 6.0, 16.5, 6.0))
