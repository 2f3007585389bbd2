"""Values of the ledger TOML the loader must refuse or keep apart (docs/configuration.md, "The ledger
TOML"): non-finite numbers in the definitions, an empty definition_version, a reference_model with no
price, a baseline_model whose coefficient is not 1.0; what the fingerprint covers ([alerts], [reclaim]
and [approvals] are not definitions; old warehouses recorded a fingerprint that held [alerts] and
[reclaim]); and which prices are history (dated [[prices]], 1970-01-01 too) and which belong to the
definition version (undated [prices.MODEL] tables)."""

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
