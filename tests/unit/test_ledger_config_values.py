"""Values of the ledger TOML the loader must refuse or keep apart (docs/configuration.md, "The ledger
TOML"): non-finite numbers in the definitions, an empty definition_version, a reference_model with no
price, a baseline_model whose coefficient is not 1.0; what the fingerprint covers ([alerts], [reclaim]
and [approvals] are not definitions; old warehouses recorded a fingerprint that held [alerts] and
[reclaim]); and which prices are history (dated [[prices]], 1970-01-01 too) and which belong to the
definition version (undated [prices.MODEL] tables); the key path of a bad [[prices]] or
[[coefficients]] entry, names records can carry, integers no float holds, [carbon] text and zones."""

from __future__ import annotations

import copy
import hashlib
import json
import tomllib

import pytest

from gpuledger.ledger_files import BUNDLED_CONFIG
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config

BASE = tomllib.loads(BUNDLED_CONFIG.read_text())


def load(**changes):
    """The bundled document with top-level values replaced, or tables updated (a dict value)."""
    doc = copy.deepcopy(BASE)
    for key, value in changes.items():
        doc[key] = dict(doc[key], **value) if isinstance(value, dict) and isinstance(doc.get(key), dict) else value
    return parse_ledger_config(doc, "ledger.toml")


@pytest.mark.parametrize("table,key,value", [
    ("execution", "min_idle_s", float("inf")),
    ("execution", "min_idle_s", float("nan")),
    ("execution", "min_idle_s", -1.0),
    ("execution", "min_idle_s", 8 * 86400),
    ("execution", "util_floor_pct", float("nan")),
    ("execution", "util_floor_pct", 100),
    ("shared_gpu", "sm_weight", float("nan")),
    ("shared_gpu", "sm_weight", float("inf")),
    ("shared_gpu", "memory_weight", float("inf")),
    ("shared_gpu", "memory_weight", -0.5),
    ("utilization", "threshold_pct", float("nan")),
    ("utilization", "threshold_pct", float("inf")),
])
def test_non_finite_or_out_of_range_definitions_are_refused(table, key, value):
    with pytest.raises(LedgerConfigError, match=rf"ledger.toml: {table}\.{key} must be"):
        load(**{table: {key: value}})


def test_finite_definitions_within_bounds_still_load():
    cfg = load(execution={"min_idle_s": 7 * 86400, "util_floor_pct": 0}, shared_gpu={"sm_weight": 1, "memory_weight": 0})
    d = cfg.definitions
    assert (d.execution_min_idle_s, d.execution_util_floor_pct, d.shared_sm_weight, d.shared_memory_weight) == \
        (604800.0, 0.0, 1.0, 0.0)
    with pytest.raises(LedgerConfigError, match="not both 0"):
        load(shared_gpu={"sm_weight": 0, "memory_weight": 0})


@pytest.mark.parametrize("value", ["", "  ", 3])
def test_definition_version_must_be_a_non_empty_string(value):
    with pytest.raises(LedgerConfigError, match="ledger.toml: definition_version must be a non-empty string"):
        load(definition_version=value)


def test_reference_model_must_name_a_priced_model():
    with pytest.raises(LedgerConfigError, match="reference_model 'A100-80G' has no price"):
        load(reference_model="A100-80G")
    assert load(reference_model="default").reference_model == "default"
    assert load().reference_cost_per_gpu_hour() == pytest.approx(0.48)  # A100-80GB: 0.43 + 0.05


def test_baseline_model_must_have_coefficient_one():
    with pytest.raises(LedgerConfigError, match="baseline_model 'A100-80GB' must have coefficient 1.0"):
        load(baseline_model="A100-80GB")
    assert load().baseline_model == "V100-32GB"  # its own entry is 1.0
    assert load(baseline_model="B200").baseline_model == "B200"  # no entry of its own: the default's 1.0
    doc = copy.deepcopy(BASE)
    del doc["baseline_model"]
    assert parse_ledger_config(doc).baseline_model == ""


def test_approvals_threshold_is_read_by_the_loader():
    assert load().approval_threshold is None
    assert load(approvals={"threshold": 2500}).approval_threshold == 2500.0
    with pytest.raises(LedgerConfigError, match=r"\[approvals\]: unknown key\(s\) treshold"):
        load(approvals={"treshold": 2500})
    for bad in (float("nan"), float("inf"), -1, "2500", True):
        with pytest.raises(LedgerConfigError, match="approvals.threshold must be"):
            load(approvals={"threshold": bad})


def test_alerts_reclaim_and_approvals_are_left_out_of_the_fingerprint():
    base = load()
    alerts = {**BASE["alerts"], "version": "alerts-2"}
    reclaim = {**BASE["reclaim"], "version": "reclaim-2", "execution_rate_below": 0.3}
    changed = load(alerts=alerts, reclaim=reclaim, approvals={"threshold": 100})
    assert changed.watch != base.watch and changed.fingerprint == base.fingerprint
    assert load(power={"pue": 1.2}).fingerprint != base.fingerprint  # a definition still counts
    # the fingerprint older warehouses recorded held [alerts] and [reclaim]: kept to match them
    before = hashlib.sha256(json.dumps({k: v for k, v in BASE.items() if k not in {"coefficients", "segments",
                                                                                   "carbon", "prices"}},
                                       sort_keys=True, default=str).encode()).hexdigest()
    assert base.legacy_fingerprint == before
    assert changed.legacy_fingerprint != before


def test_only_undated_price_tables_belong_to_the_definition_version():
    assert not load().prices_undated
    dated_1970 = [dict(p, valid_from="1970-01-01") for p in BASE["prices"]]
    assert not load(prices=dated_1970).prices_undated
    undated = {p["model"]: {"depreciation_per_hour": p["depreciation_per_hour"],
                            "maintenance_per_hour": p["maintenance_per_hour"]} for p in BASE["prices"]}
    assert load(prices=undated).prices_undated


def _entries(name: str, i: int, **changes) -> list:
    """The bundled [[prices]] or [[coefficients]] list with entry i changed (a value None: the key removed)."""
    entries = copy.deepcopy(BASE[name])
    for key, value in changes.items():
        if value is None:
            del entries[i][key]
        else:
            entries[i][key] = value
    return entries


@pytest.mark.parametrize("changes,message", [
    # before: "'int' object is not subscriptable", no key path
    (dict(prices=[1]), r"ledger.toml: prices\[0\] must be a table, got 1"),
    # before: accepted; a number or "" names no model a record has, so its cards were priced by default
    (dict(prices=_entries("prices", 1, model=5)), r"ledger.toml: prices\[1\]\.model must be a non-empty string"),
    (dict(prices=_entries("prices", 1, model="")), r"ledger.toml: prices\[1\]\.model must be a non-empty string"),
    (dict(prices=_entries("prices", 1, model=" H100-80GB")), r"prices\[1\]\.model must be .*without leading"),
    (dict(coefficients=_entries("coefficients", 1, model=5)), r"coefficients\[1\]\.model must be a non-empty string"),
    (dict(coefficients=_entries("coefficients", 1, model="")), r"coefficients\[1\]\.model must be a non-empty string"),
    (dict(prices={"": {"depreciation_per_hour": 1, "maintenance_per_hour": 0}}), r"the model name of \[prices\.\] must be a non-empty"),
    # before: "missing key 'model'" without saying which entry
    (dict(prices=_entries("prices", 1, model=None)), r"ledger.toml: prices\[1\]: missing key 'model'"),
    (dict(prices=_entries("prices", 1, valid_from=None)), r"ledger.toml: prices\[1\]: missing key 'valid_from'"),
    (dict(prices=_entries("prices", 1, maintenance_per_hour=None)),
     r"ledger.toml: prices\[1\]: missing key 'maintenance_per_hour'"),
    (dict(prices={"default": {"depreciation_per_hour": 1}}), r"prices\.default: missing key 'maintenance_per_hour'"),
    (dict(coefficients=_entries("coefficients", 1, model=None)), r"ledger.toml: coefficients\[1\]: missing key 'model'"),
    (dict(coefficients=_entries("coefficients", 1, coefficient=None)),
     r"ledger.toml: coefficients\[1\]: missing key 'coefficient'"),
    (dict(coefficients=_entries("coefficients", 1, valid_from=None)),
     r"ledger.toml: coefficients\[1\]: missing key 'valid_from'"),
])
def test_price_and_coefficient_entries_name_their_path(changes, message):
    with pytest.raises(LedgerConfigError, match=message):
        load(**changes)


BIG = 10 ** 400  # `pue = 1` and 400 zeros: tomllib reads an int no float can hold


@pytest.mark.parametrize("changes,message", [
    (dict(power={"pue": BIG}), r"ledger.toml: power.pue must be a finite number"),
    (dict(power={"electricity_price_per_kwh": BIG}), r"power.electricity_price_per_kwh must be a finite number"),
    (dict(coefficients=_entries("coefficients", 1, coefficient=BIG)), r"coefficients\[1\].coefficient must be a finite"),
    (dict(prices=_entries("prices", 1, depreciation_per_hour=BIG)), r"prices\[1\].depreciation_per_hour must be a finite"),
    (dict(segments={"flush_after_s": BIG}), r"segments.flush_after_s must be a finite number"),
    (dict(execution={"min_idle_s": -BIG}), r"execution.min_idle_s must be a finite number"),
    (dict(carbon={"pue": BIG}), r"ledger.toml: carbon.pue must be a finite number"),
    (dict(carbon={"default_gco2e_per_kwh": BIG}), r"carbon.default_gco2e_per_kwh must be a finite number"),
])
def test_an_integer_too_large_for_a_float_is_refused_by_name(changes, message):
    # before: OverflowError "int too large to convert to float", a traceback naming no key
    with pytest.raises(LedgerConfigError, match=message):
        load(**changes)


def test_a_coefficient_is_bounded():
    # before: 1e300 loaded; one GPU-hour is then 3.6e306 effective GPU-ms, which no UInt64 column holds
    with pytest.raises(LedgerConfigError, match=r"coefficients\[1\].coefficient must be a number > 0 and <= 1000"):
        load(coefficients=_entries("coefficients", 1, coefficient=1e300))
    assert load(coefficients=_entries("coefficients", 1, coefficient=1000)).coefficients["A100-80GB"][0].coefficient == 1000


@pytest.mark.parametrize("key,value", [("default_source", 1), ("version", 1), ("version", 2.5), ("default_source", True)])
def test_carbon_text_values_must_be_strings(key, value):
    # before: accepted and turned into "1": a number is not guessed at (as definition_version = 3 is not)
    with pytest.raises(LedgerConfigError, match=rf"ledger.toml: carbon.{key} must be"):
        load(carbon={key: value})


@pytest.mark.parametrize("zones", [{" gpu-east": "US-NY"}, {"": "US-NY"}, {"gpu-east": " "}])
def test_carbon_zones_name_clusters_as_records_do(zones):
    # before, " gpu-east" loaded: no record's cluster has a leading space, so gpu-east's carbon took the
    # default intensity in silence instead of US-NY's series
    with pytest.raises(LedgerConfigError, match="carbon.zones must map cluster names to zone names"):
        load(carbon={"zones": zones})
    assert load(carbon={"zones": {"gpu-east": " US-NY"}}).carbon.zone_of("gpu-east") == "US-NY"


@pytest.mark.parametrize("key,value", [("definition_version", " v7"), ("definition_version", "v7\n"),
                                       ("currency", "USD "), ("baseline_model", "V100-32GB "),
                                       ("reference_model", "A100-80GB\t")])
def test_names_are_printable_without_surrounding_whitespace(key, value):
    # before, each loaded: "v7\n" was a definition version apart from "v7" on every record, "USD " a
    # currency of its own on the bills, and "V100-32GB " a baseline no card is (checked against the default)
    with pytest.raises(LedgerConfigError, match=rf"ledger.toml: {key} must be printable text without leading or "
                                                "trailing whitespace"):
        load(**{key: value})


def test_power_limits_name_models_as_records_do():
    # before, "T4 " = 70 loaded: no card is "T4 ", so T4s were capped at the default 1500 W in silence
    with pytest.raises(LedgerConfigError, match=r"ledger.toml: power_limits key must be printable text without"):
        load(power_limits={"T4 ": 70})
