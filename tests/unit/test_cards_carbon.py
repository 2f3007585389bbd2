"""Pure parts of GPU ID cards and carbon (docs/gpu-cards.md, docs/carbon.md): the [carbon] definition,
the intensity CSV, the card's figures (down episodes, decay trend, vendor batch, age, flag, failure
rates), and the identity the sink carries. The warehouse side: tests/integration/test_golden_cards.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gpuledger.agents.sim_backend import SimBackend, sim_identity
from gpuledger.schemas.models import GpuSample, NodeTick
from gpuledger.sink.rows import Source, inventory_row
from gpuledger.streams.carbondefs import WORLD_AVERAGE_GCO2E_PER_KWH, CarbonDefinition
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config
from gpuledger.warehouse import cards
from gpuledger.warehouse.carbon import CarbonInputError, parse_intensity_csv

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults
HOUR = 3_600_000


def unit_doc() -> dict:
    return tomllib.loads(UNIT_LEDGER.read_text())


# --------------------------------------------------------------------------- [carbon]
def test_carbon_definition_from_the_ledger():
    c = parse_ledger_config(unit_doc(), "unit").carbon
    assert (c.version, c.pue, c.default_gco2e_per_kwh) == ("carbon-unit", 1.4, 300.0)  # pue: [power].pue
    assert c.zone_of("gpu-east") == "east-grid" and c.zone_of("elsewhere") == "elsewhere"
    # 1 kWh at the GPU x PUE 1.4 x 300 g/kWh = 420 g
    assert c.co2e_g(3_600_000, 300.0) == pytest.approx(420.0)


def test_carbon_defaults_when_the_table_is_absent():
    doc = unit_doc()
    del doc["carbon"]
    c = parse_ledger_config(doc, "unit").carbon
    assert c.default_gco2e_per_kwh == WORLD_AVERAGE_GCO2E_PER_KWH and "Ember" in c.default_source
    assert c.pue == doc["power"]["pue"] and c.version == CarbonDefinition().version


def test_carbon_is_versioned_on_its_own():
    doc = unit_doc()
    changed = {**doc, "carbon": {**doc["carbon"], "default_gco2e_per_kwh": 999.0}}
    # a changed carbon figure does not split the cost definitions (their fingerprint)
    assert parse_ledger_config(doc, "a").fingerprint == parse_ledger_config(changed, "b").fingerprint


@pytest.mark.parametrize("carbon, message", [
    ({"pue": 0}, "carbon.pue"),
    ({"default_gco2e_per_kwh": -1}, "default_gco2e_per_kwh"),
    ({"default_gco2e_per_kwh": "lots"}, "default_gco2e_per_kwh must be a number"),
    ({"surprise": 1}, "unknown key"),
    ({"zones": {"c": 3}}, "carbon.zones"),
    ({"version": ""}, "carbon.version"),
])
def test_bad_carbon_tables_are_clear_errors(carbon, message):
    with pytest.raises(LedgerConfigError, match=message):
        parse_ledger_config({**unit_doc(), "carbon": carbon}, "unit.toml")


# --------------------------------------------------------------------------- intensity CSV
def test_intensity_csv_any_zone_header_and_time_forms():
    rows = parse_intensity_csv("region,valid_from,gco2e_per_kwh,comment\n"
                               "east-grid,2026-11-10,200,\n"
                               "east-grid,2026-11-10T06:00+01:00,250.5,x\n"
                               "\n"
                               "west,2026-11-10T06:00Z,0,hydro\n", "f.csv")
    d = 1_794_268_800_000  # 2026-11-10T00:00Z
    assert rows == [{"zone": "east-grid", "valid_from_ms": d, "gco2e_per_kwh": 200.0},
                    {"zone": "east-grid", "valid_from_ms": d + 5 * HOUR, "gco2e_per_kwh": 250.5},
                    {"zone": "west", "valid_from_ms": d + 6 * HOUR, "gco2e_per_kwh": 0.0}]


@pytest.mark.parametrize("text, message", [
    ("valid_from,gco2e_per_kwh\n2026-11-10,1\n", "zone, cluster or region"),
    ("cluster,valid_from,gco2e_per_kwh\nc,yesterday,1\n", "line 2: valid_from"),
    ("cluster,valid_from,gco2e_per_kwh\nc,2026-11-10,much\n", "line 2: gco2e_per_kwh must be a number"),
    ("cluster,valid_from,gco2e_per_kwh\nc,2026-11-10,-3\n", "within 0..5000"),
    ("cluster,valid_from,gco2e_per_kwh\nc,2026-11-10,nan\n", "within 0..5000"),
    ("cluster,valid_from,gco2e_per_kwh\nc,2026-11-10,1\nc,2026-11-10T00:00Z,2\n", "line 3: .* given twice"),
    ("cluster,valid_from,gco2e_per_kwh\n,2026-11-10,1\n", "cluster must be a name"),
    ("cluster,valid_from,gco2e_per_kwh\n", "no rows"),
])
def test_bad_intensity_files_name_the_line(text, message):
    with pytest.raises(CarbonInputError, match=message):
        parse_intensity_csv(text, "f.csv")


# --------------------------------------------------------------------------- card figures
def test_down_episodes_join_touching_records():
    assert cards.down_episodes([]) == 0
    assert cards.down_episodes([(0, 60), (60, 120), (30, 90)]) == 1  # cut at a window, and overlapping copies
    assert cards.down_episodes([(200, 260), (0, 60), (61, 100)]) == 3


def test_decay_trend_is_the_slope_over_the_mean():
    assert cards.trend_pct_per_month([2.0]) is None
    assert cards.trend_pct_per_month([None, 2.0, None]) is None
    # 3.0, 2.5, 2.0: slope -0.5 per month over a mean of 2.5 -> -20 % per month
    assert cards.trend_pct_per_month([3.0, 2.5, 2.0]) == pytest.approx(-20.0)
    # a month without data keeps its place: 2.0 then 3.0 two months later -> slope 0.5, mean 2.5
    assert cards.trend_pct_per_month([2.0, None, 3.0]) == pytest.approx(20.0)


def test_batch_age_and_flag():
    assert cards.vendor_batch("692-2G506-0210-002", "1321020012345") == "692-2G506-0210-002 / 1321020"
    assert cards.vendor_batch("", "1321020012345") == "1321020"
    assert cards.vendor_batch("", "") == "unknown"
    year = cards.YEAR_MS
    assert [cards.age_bucket(int(y * year)) for y in (0, 0.99, 1, 2.5, 7)] == [
        "under 1 year", "under 1 year", "1-2 years", "2-3 years", "3 years or more"]
    assert [cards.flag_of(n) for n in (0, 1, 2, 3)] == ["", "", "suggest lower-priority work", "suggest lower-priority work"]


def test_failure_rates_by_hand():
    year = int(cards.YEAR_MS)
    gpus = [
        {"gpu_model": "A", "down_episodes": 2, "repairs": 1, "xid_errors": 3, "observed_ms": year},
        {"gpu_model": "A", "down_episodes": 0, "repairs": 0, "xid_errors": 0, "observed_ms": year},
        {"gpu_model": "B", "down_episodes": 0, "repairs": 2, "xid_errors": 0, "observed_ms": 0},
    ]
    rows = {r["gpu_model"]: r for r in cards.failure_rates(gpus, "gpu_model")}
    # A: 1 of 2 failed; 2 episodes in 2 GPU-years -> 1 per GPU-year
    assert (rows["A"]["failed_gpu_share"], rows["A"]["failures_per_gpu_year"]) == (0.5, pytest.approx(1.0))
    # B: repaired twice (failed, flagged), never seen for any time: no rate rather than a division by zero
    assert (rows["B"]["failed_gpus"], rows["B"]["flagged_gpus"], rows["B"]["failures_per_gpu_year"]) == (1, 1, None)
    assert [r["gpu_model"] for r in cards.failure_rates(gpus, "gpu_model")] == ["B", "A"]  # worst first


# --------------------------------------------------------------------------- identity on the way in
def test_inventory_row_carries_identity_and_old_agents_leave_it_empty():
    tick = NodeTick(cluster="c", node="n", ts_ms=1, interval_ms=5000, gpus=[
        GpuSample(gpu_uuid="GPU-a", index=0, model="A100-80GB", serial="1321020012345",
                  board_part_number="692-2G506-0210-002", vbios_version="92.00.45.00.05"),
        GpuSample(gpu_uuid="GPU-b", index=1, model="T4"),
    ])
    row = inventory_row(tick, Source("t", 0, 0))
    assert row["gpu_serials"] == ["1321020012345", ""]
    assert row["gpu_board_part_numbers"] == ["692-2G506-0210-002", ""]
    assert row["gpu_vbios_versions"] == ["92.00.45.00.05", ""]


def test_simulated_cards_have_stable_plausible_identity():
    backend = SimBackend(["A100-80GB", "T4"], seed=3, node="n1")
    first = [(g.serial, g.board_part_number, g.vbios_version) for g in backend.sample(1_000)]
    again = [(g.serial, g.board_part_number, g.vbios_version) for g in backend.sample(6_000)]
    assert first == again  # read once, the same every tick
    assert all(len(s) == 13 and s.isdigit() for s, _, _ in first)
    assert first[0][1] != first[1][1]  # a part number per model
    uuid = backend.uuids[0]
    assert sim_identity(uuid, "A100-80GB") == sim_identity(uuid, "A100-80GB")
