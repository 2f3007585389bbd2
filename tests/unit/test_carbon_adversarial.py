"""Adversarial review of carbon's pure parts (docs/carbon.md): the intensity CSV and the [carbon] definition.
Each test failed before its fix; the warehouse side: tests/integration/test_carbon_adversarial_warehouse.py.

- a bad line after a blank line was reported under the wrong line number (the reader skips blank lines,
  the count did not);
- a file saved as "CSV UTF-8" by a spreadsheet starts with a byte order mark, and its header was refused as
  naming no zone column, in a message showing the header as it looks ("got region, valid_from, ...");
- a header naming two zone columns (cluster and region) loaded the series under the cluster names: with
  [carbon.zones] mapping those clusters to the regions, no figure ever read it (every record at the default);
- a series named by a cluster that [carbon.zones] maps to another zone was loaded, and never read: the
  cluster takes its zone's series (0.01 kWh x PUE 1.5 priced at the default 500 g/kWh, 7.5 g, not at the
  loaded 200 g/kWh, 3 g);
- a PUE below 1 (0.14 typed for 1.4) was accepted and divided every carbon figure by 10; PUE is the
  facility's energy over the IT equipment's and is never below 1.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config
from gpuledger.warehouse.carbon import CarbonInputError, parse_intensity_csv

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"
D = 1_794_268_800_000  # 2026-11-10T00:00Z
HEADER = "region,valid_from,gco2e_per_kwh\n"


def unit_doc() -> dict:
    return tomllib.loads(UNIT_LEDGER.read_text())


# --------------------------------------------------------------------------- the CSV
def test_a_bad_line_after_blank_lines_is_named_by_its_own_number():
    text = HEADER + "r,2026-11-10T00:00Z,200\n\n\nr,2026-11-10T01:00Z,lots\n"
    with pytest.raises(CarbonInputError, match=r"f\.csv, line 5: gco2e_per_kwh must be a number"):
        parse_intensity_csv(text, "f.csv")
    twice = HEADER + "r,2026-11-10,200\n\nr,2026-11-10T00:00Z,210\n"
    with pytest.raises(CarbonInputError, match=r"line 4: r from 2026-11-10T00:00Z is given twice \(first on line 2\)"):
        parse_intensity_csv(twice, "f.csv")


def test_a_byte_order_mark_before_the_header_is_read_past():
    assert parse_intensity_csv("\ufeff" + HEADER + "r,2026-11-10,200\n", "excel.csv") == [
        {"zone": "r", "valid_from_ms": D, "gco2e_per_kwh": 200.0}]


@pytest.mark.parametrize("header", ["cluster,region", "zone,cluster", "region,zone"])
def test_two_zone_columns_are_refused(header):
    text = f"{header},valid_from,gco2e_per_kwh\ngpu-east,US-NY,2026-11-10,200\n"
    with pytest.raises(CarbonInputError, match="name the zone in one column only"):
        parse_intensity_csv(text, "f.csv")


def test_a_series_named_by_a_cluster_mapped_to_another_zone_is_refused():
    zones = {"gpu-east": "US-NY", "gpu-west": "gpu-west"}
    text = "cluster,valid_from,gco2e_per_kwh\ngpu-west,2026-11-10,100\ngpu-east,2026-11-10,200\n"
    with pytest.raises(CarbonInputError, match=r"line 3: cluster gpu-east takes the intensity of zone US-NY"):
        parse_intensity_csv(text, "f.csv", zones)
    # the zone itself, a cluster mapped to itself, and no definition at hand: loaded
    ok = "zone,valid_from,gco2e_per_kwh\nUS-NY,2026-11-10,200\ngpu-west,2026-11-10,100\n"
    assert [r["zone"] for r in parse_intensity_csv(ok, "f.csv", zones)] == ["US-NY", "gpu-west"]
    assert [r["zone"] for r in parse_intensity_csv(text, "f.csv")] == ["gpu-west", "gpu-east"]


# --------------------------------------------------------------------------- PUE
@pytest.mark.parametrize("carbon, power_pue, message", [
    ({"pue": 0.14}, 1.4, r"carbon\.pue must be at least 1 .*got 0\.14"),
    ({"pue": 0.999}, 1.4, r"carbon\.pue must be at least 1"),
    ({}, 0.9, r"power\.pue must be a number >= 1 .*got 0\.9"),  # the money side's energy cost too
])
def test_a_pue_below_one_is_refused(carbon, power_pue, message):
    doc = unit_doc()
    doc["power"]["pue"] = power_pue
    with pytest.raises(LedgerConfigError, match=message):
        parse_ledger_config({**doc, "carbon": {**doc["carbon"], **carbon}} if carbon else
                            {**doc, "carbon": {k: v for k, v in doc["carbon"].items() if k != "pue"}}, "unit.toml")


def test_a_pue_of_one_and_above_is_kept():
    doc = unit_doc()
    assert parse_ledger_config({**doc, "carbon": {**doc["carbon"], "pue": 1}}, "u").carbon.pue == 1.0
    assert parse_ledger_config({**doc, "carbon": {**doc["carbon"], "pue": 1.2}}, "u").carbon.pue == 1.2
    doc["power"]["pue"] = 1.0
    assert parse_ledger_config(doc, "u").pue == 1.0
