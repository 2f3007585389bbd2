"""Adversarial review of carbon on the real engine (chDB; docs/carbon.md). Each test failed before its fix.

The figures, by hand: cluster `golden` (tests/golden/ledger.toml: PUE 1.5 from [power], default 500 g/kWh),
job j1 of tenant t1 on 10 Nov 2026 00:00-00:05, 36,000 J = 0.01 kWh:
  at the default     0.01 x 1.5 x 500 = 7.5 g
  at 200 g/kWh       0.01 x 1.5 x 200 = 3.0 g
  with PUE 3.0       0.01 x 3.0 x 200 = 6.0 g

- `gpuledger carbon load` of a series named by the cluster (header `cluster`) while [carbon.zones] maps the
  cluster to a region loaded it, said "loaded 1 intensity value(s) for golden", and no figure ever read it:
  j1 stayed at 7.5 g. Now the file is refused (the line and the zone to name); a zone no cluster with usage
  takes (a misspelt region) is loaded with a warning.
- A carbon definition recorded again under the same version with another PUE re-labelled every figure: j1
  went from 3.0 g to 6.0 g, both as `carbon_version` c-1, so a figure reported last month could no longer be
  told from today's. Now recording it is refused (as a changed definition_version is: sync_library), and
  `gpuledger migrate` says which figure changed.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.cli import main
from gpuledger.config import Settings
from gpuledger.streams.carbondefs import CarbonConfigError, CarbonDefinition
from gpuledger.warehouse import carbon, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"
DB = "carbon_adversarial"
T = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
J1 = usage_record("golden", "gpu-1", T, T + 300_000, "executing", "j1", "t1", 36_000.0)


def job_carbon(client, database: str) -> tuple[float, str]:
    (row,) = reports.fetch(client, database, "jobs")
    return row["co2e_kg"] * 1000, row["carbon_version"]


def test_a_series_named_by_a_mapped_cluster_is_refused_and_an_unread_zone_warned(tmp_path, monkeypatch, capsys):
    ledger = tmp_path / "ledger.toml"
    ledger.write_text(GOLDEN_LEDGER.read_text() + '\n[carbon.zones]\ngolden = "grid-g"\n')
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(ledger))
    wh = ["--warehouse", f"chdb:{tmp_path / 'chdb'}", "--data-dir", str(tmp_path)]
    assert main(["migrate", *wh]) == 0
    settings = Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", data_dir=tmp_path)
    client = warehouse.connect(settings)
    try:
        put_usage(client, settings.database, [J1], 0)
        assert job_carbon(client, settings.database) == pytest.approx((7.5, "carbon-golden"))  # the default
        capsys.readouterr()

        by_cluster = tmp_path / "by-cluster.csv"
        by_cluster.write_text("cluster,valid_from,gco2e_per_kwh\ngolden,2026-11-10T00:00Z,200\n")
        assert main(["carbon", "load", str(by_cluster), *wh]) == 2
        err = capsys.readouterr().err
        assert "by-cluster.csv, line 2: cluster golden takes the intensity of zone grid-g" in err
        assert job_carbon(client, settings.database) == pytest.approx((7.5, "carbon-golden"))  # nothing loaded

        misspelt = tmp_path / "misspelt.csv"
        misspelt.write_text("region,valid_from,gco2e_per_kwh\ngrid-q,2026-11-10T00:00Z,200\n")
        assert main(["carbon", "load", str(misspelt), *wh]) == 0
        out, err = capsys.readouterr()
        assert "loaded 1 intensity value(s) for grid-q" in out
        assert "no cluster with usage takes its intensity from grid-q" in err

        region = tmp_path / "region.csv"
        region.write_text("\ufeffregion,valid_from,gco2e_per_kwh\ngrid-g,2026-11-10T00:00Z,200\n")  # a spreadsheet's BOM
        assert main(["carbon", "load", str(region), *wh]) == 0
        out, err = capsys.readouterr()
        assert "loaded 1 intensity value(s) for grid-g" in out and "warning" not in err
        assert job_carbon(client, settings.database) == pytest.approx((3.0, "carbon-golden"))
    finally:
        client.close()


def test_a_version_recorded_again_with_other_figures_is_refused(tmp_path):
    with migrated_warehouse(tmp_path, DB) as (client, _):
        put_usage(client, DB, [J1], 0)
        first = CarbonDefinition(version="c-1", pue=1.5, default_gco2e_per_kwh=500.0, default_source="t")
        assert carbon.record_definition(client, DB, first)
        carbon.load_intensity(client, DB, [{"zone": "golden", "valid_from_ms": T, "gco2e_per_kwh": 200.0}], "s.csv", "ops")
        assert job_carbon(client, DB) == pytest.approx((3.0, "c-1"))

        changed = CarbonDefinition(version="c-1", pue=3.0, default_gco2e_per_kwh=500.0, default_source="t")
        with pytest.raises(CarbonConfigError, match=r"'c-1' is already recorded with other figures \(pue 1.5 -> 3.0\)"):
            carbon.record_definition(client, DB, changed)
        assert job_carbon(client, DB) == pytest.approx((3.0, "c-1"))  # the figure under c-1 keeps its meaning

        # under a new version it is recorded, and the figure names it; going back to c-1's figures is allowed
        assert carbon.record_definition(client, DB, CarbonDefinition(version="c-2", pue=3.0, default_gco2e_per_kwh=500.0,
                                                                      default_source="t"))
        assert job_carbon(client, DB) == pytest.approx((6.0, "c-2"))
        assert carbon.record_definition(client, DB, first)
        assert not carbon.record_definition(client, DB, first)
        assert job_carbon(client, DB) == pytest.approx((3.0, "c-1"))


def test_migrate_names_the_changed_carbon_figure(tmp_path, monkeypatch, capsys):
    wh = ["--warehouse", f"chdb:{tmp_path / 'chdb'}", "--data-dir", str(tmp_path)]
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(GOLDEN_LEDGER))
    assert main(["migrate", *wh]) == 0
    changed = tmp_path / "ledger.toml"
    changed.write_text(GOLDEN_LEDGER.read_text().replace("default_gco2e_per_kwh = 500.0", "default_gco2e_per_kwh = 450.0"))
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(changed))
    capsys.readouterr()
    assert main(["migrate", *wh]) == 2
    err = capsys.readouterr().err
    assert "'carbon-golden' is already recorded with other figures (default_gco2e_per_kwh 500.0 -> 450.0)" in err
