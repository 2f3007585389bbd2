"""A ledger TOML with a typo is refused with the file and the key, never billed with defaults:
unknown keys and tables (a misspelt electricity_price_per_kwh billed energy at 0), quoted booleans
(bool("false") is True) and quoted or boolean numbers. docs/configuration.md, "The ledger TOML"."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from gpuledger.ledger_files import BUNDLED_CONFIG, load_ledger_config
from gpuledger.streams.pricing import LedgerConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = BUNDLED_CONFIG.read_text()


def variant(tmp_path: Path, old: str, new: str, *, regex: bool = False) -> Path:
    text = re.sub(old, new, BASE, count=1, flags=re.M) if regex else BASE.replace(old, new, 1)
    assert text != BASE, old
    path = tmp_path / "ledger.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("old,new,message", [
    ("electricity_price_per_kwh = ", "electricity_price_kwh = ", r"\[power\]: unknown key\(s\) electricity_price_kwh"),
    ("[power]\n", "[powr]\n", r"top level: unknown key\(s\) powr"),
    ("include_cooling = true", "include_coolng = true", r"\[cost\]: unknown key\(s\) include_coolng"),
    ("util_floor_pct = 1.0", "util_floor = 1.0", r"\[execution\]: unknown key\(s\) util_floor"),
    ("currency = \"USD\"", "curency = \"USD\"", r"top level: unknown key\(s\) curency"),
    ("aggregation = \"mean\"", "agregation = \"mean\"", r"\[utilization\]: unknown key\(s\) agregation"),
    ("sm_weight = 0.5", "sm_wieght = 0.5", r"\[shared_gpu\]: unknown key\(s\) sm_wieght"),
    ("redistribution = \"none\"", "redistribute = \"none\"", r"\[idle\]: unknown key\(s\) redistribute"),
    ("\npolicy = \"default\"", "\npolcy = \"default\"", r"\[unpriced\]: unknown key\(s\) polcy"),
    ("flush_after_s = 60", "flush_after = 60", r"\[segments\]: unknown key\(s\) flush_after"),
    ("coefficient = 2.3", "coefficent = 2.3", r"coefficients\[1\]: unknown key\(s\) coefficent"),
    ("maintenance_per_hour = 0.08", "maintenance_hour = 0.08", r"prices\[1\]: unknown key\(s\) maintenance_hour"),
])
def test_unknown_keys_and_tables_are_refused_naming_them(tmp_path, old, new, message):
    with pytest.raises(LedgerConfigError, match=message) as exc:
        load_ledger_config(variant(tmp_path, old, new))
    assert str(tmp_path / "ledger.toml") in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("old,new,message", [
    ("include_power = true", 'include_power = "false"', "cost.include_power must be true or false"),
    ("include_depreciation = true", "include_depreciation = 0", "cost.include_depreciation must be true or false"),
    (r"^pue = .*$", "pue = true", "power.pue must be a number"),
    (r"^electricity_price_per_kwh = .*$", 'electricity_price_per_kwh = "0.12"', "power.electricity_price_per_kwh must be a number"),
    (r"^threshold_pct = .*$", 'threshold_pct = "20"', "utilization.threshold_pct must be a number"),
    (r"^min_idle_s = .*$", "min_idle_s = true", "execution.min_idle_s must be a number"),
    (r"^util_floor_pct = .*$", 'util_floor_pct = "1"', "execution.util_floor_pct must be a number"),
    (r"^memory_weight = .*$", 'memory_weight = "0.5"', "shared_gpu.memory_weight must be a number"),
    (r"^coefficient = 2.3$", 'coefficient = "2.3"', r"coefficients\[1\].coefficient must be a number"),
    (r"^depreciation_per_hour = 0.86$", 'depreciation_per_hour = "0.86"', r"prices\[1\].depreciation_per_hour must be a number"),
    (r"^\"T4\" = 70$", '"T4" = "70"', "power_limits.T4 must be a number"),
    (r"^source = \"both\"$", "source = 1", "execution.source must be a string"),
])
def test_quoted_booleans_and_numbers_are_refused(tmp_path, old, new, message):
    with pytest.raises(LedgerConfigError, match=message):
        load_ledger_config(variant(tmp_path, old, new, regex=True))


@pytest.mark.parametrize("table", ["power", "cost", "execution", "unpriced", "segments", "power_limits"])
def test_a_table_that_is_not_a_table_is_refused(table):
    from gpuledger.streams.pricing import parse_ledger_config

    with pytest.raises(LedgerConfigError, match=rf"ledger.toml: {table} must be a table"):
        parse_ledger_config({**tomllib.loads(BASE), table: 1.5}, "ledger.toml")


def test_real_toml_values_still_load(tmp_path):
    config = load_ledger_config(variant(tmp_path, "include_power = true", "include_power = false"))
    assert config.definitions.include_power is False
    assert load_ledger_config(None).electricity_price_per_kwh == 0.12


def _ledger_tomls() -> list[Path]:
    skip = {".venv", ".git", "build", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.toml") if not skip & set(p.relative_to(ROOT).parts)
                  and "definition_version" in p.read_text(errors="replace"))


def test_every_ledger_toml_in_the_repository_loads():
    files = _ledger_tomls()
    assert BUNDLED_CONFIG.resolve() in {f.resolve() for f in files} and len(files) >= 3
    for path in files:
        load_ledger_config(path)


def test_every_toml_example_in_the_docs_is_accepted():
    """Each ```toml block of the docs, put over the bundled defaults, is a ledger the loader takes."""
    from gpuledger.streams.pricing import parse_ledger_config

    base = tomllib.loads(BASE)
    blocks = 0
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", md.read_text(), re.S)):
            doc = tomllib.loads(block)
            if not set(doc) <= set(base) | {"prices"}:
                continue  # not a ledger example
            parse_ledger_config({**base, **doc}, f"{md.name} toml block {i}")
            blocks += 1
    assert blocks >= 5
