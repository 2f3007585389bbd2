"""Loading intensity on the real engine (chDB; docs/carbon.md "Loading intensity"): which load wins, and
what a wrongly dated point did to the figures. Each test but the last failed before its fix.

The figures, by hand: job j1 of tenant t1 on cluster (and zone) `golden`, 10 Nov 2026 00:00-00:05,
36,000 J = 0.01 kWh, under PUE 1.5 (default 500 g/kWh):
  at 200 g/kWh  0.01 x 1.5 x 200 = 3.0 g
  at 300 g/kWh  0.01 x 1.5 x 300 = 4.5 g
  at 600 g/kWh  0.01 x 1.5 x 600 = 9.0 g

- The latest load of a zone and time wins by its `loaded_at` (carbon_intensity_current: argMax), which
  was the server's clock at the insert. A load stored while the clock read an hour later (a clock stepped
  back since, or another replica's clock ahead) beat every correction loaded within that hour: j1 stayed
  at 9.0 g after 300 g/kWh was loaded over 600, and two loads stamped in one millisecond left the winner
  to the engine. Now a load is stamped after every load stored: 4.5 g.
- A valid_from with the year mistyped (2206 for 2026) was loaded: the value never applied and the one it
  stood for was missing, so j1 on 1 Jan 2027 stayed at the earlier 200 g/kWh (3.0 g) with nothing said.
  A valid_from before 1970 was loaded too. Both are now refused with the line named, nothing loaded.
"""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.cli import main
from gpuledger.config import Settings
from gpuledger.streams.carbondefs import CarbonDefinition
from gpuledger.warehouse import carbon, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"
DB = "carbon_load_ties"
T = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
DEFINITION = CarbonDefinition(version="c-1", pue=1.5, default_gco2e_per_kwh=500.0, default_source="t")


def job_grams(client, database: str) -> dict[str, float]:
    return {r["job_id"]: r["co2e_kg"] * 1000 for r in reports.fetch(client, database, "jobs")}


def test_a_correction_wins_over_a_load_stamped_ahead_of_the_clock(tmp_path):
    with migrated_warehouse(tmp_path, DB) as (client, _):
        put_usage(client, DB, [usage_record("golden", "gpu-1", T, T + 300_000, "executing", "j1", "t1", 36_000.0)], 0)
        carbon.record_definition(client, DB, DEFINITION)
        # the first load, as a server whose clock read an hour later stored it
        ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
        warehouse.insert_rows(client, "carbon_intensity", [
            {"zone": "golden", "valid_from_ms": T, "gco2e_per_kwh": 600.0, "source": "first.csv", "loaded_by": "ops",
             "loaded_at": ahead}], database=DB)
        assert job_grams(client, DB) == pytest.approx({"j1": 9.0})

        carbon.load_intensity(client, DB, [{"zone": "golden", "valid_from_ms": T, "gco2e_per_kwh": 300.0}], "fix.csv", "ops")
        assert job_grams(client, DB) == pytest.approx({"j1": 4.5})  # was 9.0: the correction lost
        carbon.load_intensity(client, DB, [{"zone": "golden", "valid_from_ms": T, "gco2e_per_kwh": 200.0}], "fix2.csv", "ops")
        assert job_grams(client, DB) == pytest.approx({"j1": 3.0})
        stamps = [r["ms"] for r in client.query(
            f"SELECT toUnixTimestamp64Milli(loaded_at) AS ms FROM {DB}.carbon_intensity ORDER BY ms").named_results()]
        assert len(set(stamps)) == 3  # each load after the one before: no tie left to the engine
        # every load kept (docs: the earlier value stays stored)
        assert client.query(f"SELECT count() FROM {DB}.carbon_intensity").result_rows == [(3,)]


def _cli(tmp_path: Path, monkeypatch) -> tuple[list[str], Settings]:
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(GOLDEN_LEDGER))
    wh = ["--warehouse", f"chdb:{tmp_path / 'chdb'}", "--data-dir", str(tmp_path)]
    assert main(["migrate", *wh]) == 0
    return wh, Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", data_dir=tmp_path)


def test_a_mistyped_year_is_refused_with_its_line(tmp_path, monkeypatch, capsys):
    wh, settings = _cli(tmp_path, monkeypatch)
    jan1 = int(dt.datetime(2027, 1, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)
    client = warehouse.connect(settings)
    try:
        put_usage(client, settings.database, [
            usage_record("golden", "gpu-1", jan1, jan1 + 300_000, "executing", "j1", "t1", 36_000.0)], 0)
        base = tmp_path / "base.csv"
        base.write_text("zone,valid_from,gco2e_per_kwh\ngolden,2026-11-10T00:00Z,200\n")
        assert main(["carbon", "load", str(base), *wh]) == 0
        assert job_grams(client, settings.database) == pytest.approx({"j1": 3.0})
        capsys.readouterr()

        typo = tmp_path / "typo.csv"  # 2206 typed for 2027: j1 would stay at 200 g/kWh, 3.0 g, not 300's 4.5 g
        typo.write_text("zone,valid_from,gco2e_per_kwh\ngolden,2206-01-01T00:00Z,300\n")
        assert main(["carbon", "load", str(typo), *wh]) == 2  # was 0, and j1 stayed at 3.0 g
        err = capsys.readouterr().err
        assert "typo.csv, line 2: valid_from must be within 1970-01-01 and a year after now" in err
        assert "'2206-01-01T00:00Z' (2206-01-01 UTC)" in err
        early = tmp_path / "early.csv"
        early.write_text("zone,valid_from,gco2e_per_kwh\ngolden,2026-11-11T00:00Z,250\ngolden,1926-01-01,300\n")
        assert main(["carbon", "load", str(early), *wh]) == 2
        assert "early.csv, line 3: valid_from must be within 1970-01-01" in capsys.readouterr().err
        # nothing of either file was loaded
        assert client.query(f"SELECT count() FROM {settings.database}.carbon_intensity").result_rows == [(1,)]

        fixed = tmp_path / "fixed.csv"
        fixed.write_text("zone,valid_from,gco2e_per_kwh\ngolden,2027-01-01T00:00Z,300\n")
        assert main(["carbon", "load", str(fixed), *wh]) == 0
        assert job_grams(client, settings.database) == pytest.approx({"j1": 4.5})
    finally:
        client.close()


def test_a_series_out_of_time_order_prices_as_in_order(tmp_path):
    """Not a defect (review): file order does not matter, the ASOF JOIN orders the points by valid_from."""
    hours = [T + h * 3_600_000 for h in range(6)]
    records = [usage_record("golden", "gpu-1", t + 600_000, t + 900_000, "executing", f"j{i}", "t1", 36_000.0)
               for i, t in enumerate(hours)]
    series = [{"zone": "golden", "valid_from_ms": t, "gco2e_per_kwh": 100.0 * (i + 1)} for i, t in enumerate(hours)]
    shuffled = series[:]
    random.Random(7).shuffle(shuffled)
    assert shuffled != series
    grams = []
    for name, rows in (("sorted", series), ("shuffled", shuffled)):
        with migrated_warehouse(tmp_path / name, DB) as (client, _):
            put_usage(client, DB, records, 0)
            carbon.record_definition(client, DB, DEFINITION)
            carbon.load_intensity(client, DB, rows, f"{name}.csv", "ops")
            grams.append(job_grams(client, DB))
    assert grams[0] == pytest.approx({f"j{i}": 1.5 * (i + 1) for i in range(6)})
    assert grams[1] == grams[0]
