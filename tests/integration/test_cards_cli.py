"""The card and carbon commands end to end through `gpuledger` (gpuledger/cli.py -> cards.py, carbon.py)
on a real chDB: migrate records the [carbon] definition, `carbon load` stores a series, `gpu repair`
appends a repair, `report gpu` prints the card as JSON and HTML, `report bills` carries co2e_kg, and
bad input is a one-line error, not a traceback. The figures themselves: test_golden_cards.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuledger.cli import main

pytestmark = pytest.mark.integration

GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"


def test_card_and_carbon_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(GOLDEN_LEDGER))
    wh = ["--warehouse", f"chdb:{tmp_path / 'chdb'}", "--data-dir", str(tmp_path)]
    assert main(["migrate", *wh]) == 0
    csv = tmp_path / "grid.csv"
    csv.write_text("cluster,valid_from,gco2e_per_kwh\ngolden,2026-11-10T00:00Z,200\n")
    assert main(["carbon", "load", str(csv), *wh]) == 0
    assert "loaded 1 intensity value(s) for golden; carbon definition carbon-golden" in capsys.readouterr().out
    assert main(["carbon", "show", *wh, "--format", "json"]) == 0
    assert "carbon-golden" in capsys.readouterr().out

    # nothing seen yet: a repair of an unknown GPU is refused unless forced
    assert main(["gpu", "repair", "GPU-x", "--note", "fan", "--at", "2026-11-10", *wh]) == 2
    assert "never seen" in capsys.readouterr().err
    assert main(["gpu", "repair", "GPU-x", "--note", "fan", "--at", "2026-11-10", "--by", "ops", "--force", *wh]) == 0
    assert "recorded repair" in capsys.readouterr().out
    assert main(["report", "gpu", "GPU-x", "--format", "json", *wh]) == 2  # no sighting: no card
    assert "no GPU GPU-x" in capsys.readouterr().err

    assert main(["report", "gpu-fleet", "--format", "json", *wh]) == 0
    fleet = json.loads(capsys.readouterr().out)
    assert fleet["summary"]["gpus"] == 0 and [s["title"] for s in fleet["sections"]][:3] == [
        "By model", "By vendor batch", "By age"]
    assert main(["report", "bills", "--format", "json", *wh]) == 0
    capsys.readouterr()

    bad = tmp_path / "bad.csv"
    bad.write_text("cluster,valid_from,gco2e_per_kwh\ngolden,soon,200\n")
    assert main(["carbon", "load", str(bad), *wh]) == 2
    assert "bad.csv, line 2: valid_from" in capsys.readouterr().err
    assert main(["report", "gpu", *wh]) == 2
    assert "usage: gpuledger report gpu GPU_UUID" in capsys.readouterr().err
    assert main(["report", "gpu-fleet", "--tenant", "t1", *wh]) == 2
    assert "report gpu-fleet takes no --tenant" in capsys.readouterr().err


def test_a_repair_time_that_is_not_one_is_refused_in_the_repair_commands_words(monkeypatch, capsys):
    # it said "--at: valid_from must be an ISO date or time" (the carbon CSV's column), after opening
    # the warehouse; now it names --at alone, before the warehouse is opened
    from gpuledger import warehouse

    monkeypatch.setattr(warehouse, "connect", lambda settings: pytest.fail("the warehouse was opened"))
    assert main(["gpu", "repair", "GPU-x", "--note", "fan", "--at", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "--at must be an ISO date or time (e.g. 2026-11-10T12:00Z, UTC unless an offset is given), " \
           "got 'yesterday'" in err and "valid_from" not in err, err
