"""Sane values or none; no silent defaults in money (docs/accounting.md §4a–§4c): the energy cap, the
cost bound, identifier limits, the [unpriced] policy and flag, price history."""

from dataclasses import replace
import hashlib
import json
import tomllib
from pathlib import Path

import orjson
import pytest

from gpuledger.streams.topic_names import TopicNames
from gpuledger.schemas.models import (
    DeadLetter,
    GpuSample,
    JobEvent,
    NodeTick,
    SchedulerSnapshot,
    UsageRecord,
)
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_node_ticks
from gpuledger.streams.attribution import Holder, attribute
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.join import NodeJoin, tick_from_state, tick_state
from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.pricing import (
    MAX_RECORD_COST_MICROS,
    LedgerConfigError,
    parse_ledger_config,
)

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults

LEDGER = load_ledger_config(UNIT_LEDGER)
T0 = 1_793_577_600_000  # 2026-11-02
S = 1000
DAY = 86_400_000


def tick(k, energy_j, power_w=300.0, power_limit_w=400.0, model="A100-80GB", interval_s=5):
    return NodeTick(cluster="c", node="n1", ts_ms=T0 + k * interval_s * S, interval_ms=interval_s * S,
                    gpus=[GpuSample(gpu_uuid="G", index=0, model=model, power_w=power_w, energy_j=energy_j,
                                    power_limit_w=power_limit_w)])


def close(ticks, ledger=LEDGER):
    join = NodeJoin(node="n1")
    for t in ticks:
        join.add_tick(t)
    records = join.close_until(ticks[-1].ts_ms + ticks[-1].interval_ms, ledger)
    return join, records


# --------------------------------------------------------------------------- energy cap
def test_an_energy_spike_is_not_believed_power_times_time_is_used_and_counted():
    # 300 W for 5 s = 1,500 J per tick; the third reading jumped by 1e12 J, then counts on from there
    ticks = [tick(0, 1_000_000.0), tick(1, 1_001_500.0), tick(2, 1e12), tick(3, 1e12 + 1_500.0)]
    join, records = close(ticks)
    energy = [r["energy_j"] for r in records]
    assert energy == [1500.0, 1500.0, 1500.0, 1500.0]  # the first tick: power x time; the spike: power x time
    assert join.take_unmatched() == {"fallback_energy_over_power_limit": 1}
    # A100 at 0.43 + 0.05 per hour for 5 s = 666.67 micros + 1,500 J = 0.0004167 kWh x 0.12 x 1.4 = 70 micros
    assert [r["cost_micros"] for r in records] == [737] * 4
    # the review's case: a jump of 1e20 J (4.67e12 currency before) costs one ordinary tick
    join, records = close([tick(0, 1_000.0), tick(1, 1e20)])
    assert [r["cost_micros"] for r in records] == [737, 737]


def test_a_delta_within_the_limit_and_tolerance_is_believed():
    # 400 W limit x 1.2 x 5 s = 2,400 J: a 2,399 J rise is measured energy, a 2,401 J one is not
    join, records = close([tick(0, 0.0), tick(1, 2_399.0), tick(2, 4_800.0)])
    assert [r["energy_j"] for r in records] == [1500.0, 2399.0, 1500.0]
    assert join.take_unmatched() == {"fallback_energy_over_power_limit": 1}


def test_without_a_sample_limit_the_configured_model_limit_applies():
    # no power_limit_w in the sample: [power_limits] A100-80GB = 400 W, so 2,401 J in 5 s is too much;
    # an unknown model gets `default` = 1500 W: 8,999 J in 5 s is believed
    _, records = close([tick(0, 0.0, power_limit_w=None), tick(1, 2_401.0, power_limit_w=None)])
    assert records[1]["energy_j"] == 1500.0
    _, records = close([tick(0, 0.0, power_limit_w=None, model="X9"), tick(1, 8_999.0, power_limit_w=None, model="X9")])
    assert records[1]["energy_j"] == 8999.0


def test_a_power_reading_above_the_limit_is_capped_at_it():
    join, records = close([tick(0, None, power_w=4_000.0)])
    assert records[0]["energy_j"] == 400.0 * 5
    assert join.take_unmatched() == {"fallback_power_over_power_limit": 1}


def test_a_counter_that_goes_back_is_counted():
    join, records = close([tick(0, 10_000.0), tick(1, 5.0)])
    assert records[1]["energy_j"] == 1500.0
    assert join.take_unmatched() == {"fallback_energy_counter_reset": 1}


def test_snapshots_keep_the_power_limit_and_read_older_ones():
    t = tick(0, 1.0)
    metered = NodeJoin(node="n1")
    metered.add_tick(t)
    state = tick_state(metered.pending_ticks[0])
    assert tick_from_state(state) == metered.pending_ticks[0]
    assert tick_from_state(state).gpus[0].power_limit_w == 400.0
    older = [*state[:4], [[*g[:-2], g[-1]] for g in state[4]]]  # a snapshot written before power_limit_w
    assert tick_from_state(older).gpus[0].power_limit_w is None


# --------------------------------------------------------------------------- cost bound
def extreme_config(**extra):
    doc = {"definition_version": "x", "prices": {"default": {"depreciation_per_hour": 1e6, "maintenance_per_hour": 1e6}},
           "power": {"electricity_price_per_kwh": 1e6, "pue": 10.0},
           "coefficients": [{"model": "default", "coefficient": 1.0, "valid_from": "2020-01-01"}]}
    doc.update(extra)
    return parse_ledger_config(doc)


def test_no_record_costs_more_than_a_gpu_hour_at_the_largest_power_and_prices():
    cfg = extreme_config()
    assert MAX_RECORD_COST_MICROS == 52_000_000_000_000 < 2**63
    assert cfg.interval_cost_micros("A", 3_600_000, 1e300) == MAX_RECORD_COST_MICROS
    assert cfg.interval_cost_micros("A", 3_600_000, float("nan")) == 2_000_000_000_000  # no energy believed
    # and through attribution: one record, even with an absurd energy for the interval
    (r,) = attribute(cluster="c", node="n", gpu=GpuSample(gpu_uuid="G", index=0, model="A"), holders=[],
                     start_ms=T0, end_ms=T0 + 3_600_000, energy_j=1e308, ledger=cfg)
    assert r["cost_micros"] == MAX_RECORD_COST_MICROS
    UsageRecord.model_validate(r)


@pytest.mark.parametrize("change, message", [
    ({"prices": {"default": {"depreciation_per_hour": 1e7, "maintenance_per_hour": 0}}}, "depreciation_per_hour"),
    ({"prices": {"default": {"depreciation_per_hour": float("nan"), "maintenance_per_hour": 0}}}, "depreciation"),
    ({"prices": {"default": {"depreciation_per_hour": 1, "maintenance_per_hour": -1}}}, "maintenance_per_hour"),
    ({"power": {"electricity_price_per_kwh": float("inf")}}, "electricity_price_per_kwh"),
    ({"power": {"pue": 0}}, "pue"),
    ({"power": {"limit_tolerance": 0.5}}, "limit_tolerance"),
    ({"power_limits": {"A": 6000}}, "power_limits.A"),
    ({"unpriced": {"policy": "reject"}}, "unpriced.policy"),
])
def test_money_values_out_of_bounds_are_refused(change, message):
    with pytest.raises(LedgerConfigError, match=message):
        extreme_config(**change)


# --------------------------------------------------------------------------- identifiers
TOPICS = TopicNames.with_prefix("t.")


def event_doc(**kw):
    doc = {"type": "job_event", "event_id": "e1", "ts_ms": T0, "kind": "submitted", "cluster": "c", "job_id": "j",
           "tenant": "t", "queue": "q"}
    doc.update(kw)
    return orjson.dumps(doc)


@pytest.mark.parametrize("field, value, reason", [
    ("tenant", "t" * 129, "job_event.tenant: String should have at most 128 characters"),
    ("cluster", "c" * 129, "job_event.cluster: String should have at most 128 characters"),
    ("queue", "q" * 257, "job_event.queue: String should have at most 256 characters"),
    ("job_id", "j" * 513, "job_event.job_id: String should have at most 512 characters"),
    ("job_id", "job\n1", "job_event.job_id: an identifier must be printable text"),
    ("tenant", "acme\x00", "job_event.tenant: an identifier must be printable text"),
    ("tenant", " acme", "job_event.tenant: an identifier must be printable text"),
    ("queue", "batch\u2028", "job_event.queue: an identifier must be printable text"),
    ("event_id", "e" * 1025, "job_event.event_id: String should have at most 1024 characters"),
])
def test_identifiers_out_of_bounds_are_dead_letters_with_the_reason(field, value, reason):
    with pytest.raises(DecodeError, match="schema violation"):
        decode_lifecycle(event_doc(**{field: value}))
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    (out,) = core.on_lifecycle(0, 0, event_doc(**{field: value}))
    assert out.topic == TOPICS.dead_letters
    assert reason in decode(DeadLetter, out.value).reason


def test_identifiers_within_bounds_pass():
    ok = decode_lifecycle(event_doc(job_id="ns/jobset/" + "x" * 253, tenant="Team A ü", queue="q" * 256))
    assert isinstance(ok, JobEvent)
    # node and cluster of a tick, a node in a GPU assignment, queues of a snapshot
    raw = orjson.dumps({"cluster": "c", "node": "n\t1", "ts_ms": T0, "interval_ms": 5000, "gpus": []})
    with pytest.raises(DecodeError, match=r"node: an identifier must be printable"):
        decode_node_ticks(raw)
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    (out,) = core.on_node(TOPICS.gpu_samples, 0, 0, raw)
    assert out.topic == TOPICS.dead_letters and "node: an identifier must be printable" in decode(DeadLetter, out.value).reason
    with pytest.raises(DecodeError, match="gpus.0.node"):
        decode_lifecycle(event_doc(kind="allocated", gpus=[{"node": "n" * 257, "gpu_uuid": "G"}]))
    with pytest.raises(DecodeError, match="queues.0.queue"):
        decode(SchedulerSnapshot, orjson.dumps({"cluster": "c", "ts_ms": T0, "queues": [
            {"queue": "", "quota_gpus": 1, "allocated_gpus": 0, "pending_jobs": 0, "pending_gpus": 0}]}))


def test_the_simulated_cluster_stays_within_the_limits():
    from gpuledger.agents.simcluster import SimSpec, simulate

    n = 0
    for item in simulate(SimSpec(nodes=2, gpus_per_node=4, hours=0.5, node_models=("A100-80GB", "T4"), seed=3)):
        type(item.message).model_validate(item.message.model_dump())  # re-validated: within every limit
        n += 1
    assert n > 10


# --------------------------------------------------------------------------- unpriced models
def one_record(model, ledger=LEDGER, start=T0):
    (r,) = attribute(cluster="c", node="n", gpu=GpuSample(gpu_uuid="G", index=0, model=model), holders=[
        Holder("j", 0, "t", "q", 1000, True)], start_ms=start, end_ms=start + 3_600_000, energy_j=0.0, ledger=ledger)
    UsageRecord.model_validate(r)
    return r


def with_policy(policy):
    doc = tomllib.loads(UNIT_LEDGER.read_text())
    doc["unpriced"] = {"policy": policy}
    return parse_ledger_config(doc)


def test_a_model_without_a_price_is_flagged_and_billed_under_the_policy():
    a100, h200 = one_record("A100-80GB"), one_record("H200-141GB")
    assert (a100["priced_by_default"], a100["price_version"], a100["cost_micros"]) == (False, "A100-80GB@2020-01-01", 480_000)
    # no price, no coefficient: the default price (0.50 + 0.05 per hour) and coefficient (1.0), flagged
    assert (h200["priced_by_default"], h200["price_version"], h200["cost_micros"]) == (True, "default@2020-01-01", 550_000)
    assert (h200["coefficient"], h200["coefficient_version"]) == (1.0, "default@2020-01-01")
    zero = with_policy("zero")
    assert one_record("H200-141GB", zero)["cost_micros"] == 0 and one_record("H200-141GB", zero)["priced_by_default"]
    assert one_record("A100-80GB", zero)["cost_micros"] == 480_000
    # a price of its own but no coefficient: priced as itself, still flagged (effective hours by default)
    doc = tomllib.loads(UNIT_LEDGER.read_text())
    doc["prices"].append({"model": "H200-141GB", "valid_from": "2020-01-01", "depreciation_per_hour": 1.0,
                          "maintenance_per_hour": 0.1})
    r = one_record("H200-141GB", parse_ledger_config(doc))
    assert (r["priced_by_default"], r["price_version"], r["cost_micros"]) == (True, "H200-141GB@2020-01-01", 1_100_000)


def test_the_join_counts_gpu_time_priced_by_default():
    join, _ = close([tick(0, None, model="H200-141GB"), tick(1, None, model="H200-141GB")])
    assert join.take_unmatched() == {"priced_by_default:H200-141GB": 10.0}


def test_metrics_go_to_their_own_counters():
    from gpuledger.metrics import PRICED_BY_DEFAULT, UNMATCHED, VALUE_FALLBACKS, worker_metrics

    m = worker_metrics()
    before = VALUE_FALLBACKS.labels("worker", "energy_over_power_limit")._value.get()
    m.unmatched("fallback_energy_over_power_limit", 1)
    m.unmatched("priced_by_default:H200-141GB", 5.0)
    assert VALUE_FALLBACKS.labels("worker", "energy_over_power_limit")._value.get() == before + 1
    assert PRICED_BY_DEFAULT.labels("worker", "H200-141GB")._value.get() >= 5.0
    assert ("worker", "fallback_energy_over_power_limit") not in {k for k in UNMATCHED._metrics}


def test_the_table_report_footnotes_rows_priced_by_default():
    from gpuledger.warehouse.report_text import render

    rows = [{"tenant": "a", "total_cost": 1.0, "priced_by_default_gpu_hours": 0.0},
            {"tenant": "b", "total_cost": 2.0, "priced_by_default_gpu_hours": 1.5}]
    assert "1.5000 GPU-hours in these rows were priced by default" in render(rows, "table")
    assert "priced by default" not in render(rows[:1], "table")
    assert "priced by default" not in render(rows, "csv")


# --------------------------------------------------------------------------- price history
def history_config(prices, **extra):
    doc = {"definition_version": "v1", "prices": prices, "power": {"electricity_price_per_kwh": 0.1, "pue": 1.5},
           "coefficients": [{"model": "default", "coefficient": 1.0, "valid_from": "2020-01-01"}]}
    doc.update(extra)
    return parse_ledger_config(doc)


HISTORY = [
    {"model": "default", "valid_from": "2020-01-01", "depreciation_per_hour": 1.0, "maintenance_per_hour": 0.0},
    {"model": "A", "valid_from": "2026-01-01", "depreciation_per_hour": 2.0, "maintenance_per_hour": 0.4},
    {"model": "A", "valid_from": "2026-11-16", "depreciation_per_hour": 3.0, "maintenance_per_hour": 0.6},
]


def test_price_history_picks_the_entry_valid_at_the_slice_start():
    cfg = history_config(HISTORY)
    nov15, nov16 = T0 + 13 * DAY, T0 + 14 * DAY
    assert cfg.price_at("A", nov15).version == "A@2026-01-01"
    assert cfg.price_at("A", nov16).version == "A@2026-11-16"
    assert cfg.price_at("A", 1_700_000_000_000).version == "default@2020-01-01"  # before A had a price
    r15, r16 = one_record("A", cfg, nov15 - 3_600_000), one_record("A", cfg, nov16)
    assert (r15["price_version"], r15["cost_micros"]) == ("A@2026-01-01", 2_400_000)
    assert (r16["price_version"], r16["cost_micros"]) == ("A@2026-11-16", 3_600_000)
    assert cfg.prices["A"].fixed_per_hour == pytest.approx(3.6)  # the latest, for opportunity cost
    with pytest.raises(LedgerConfigError, match="listed twice"):
        history_config([*HISTORY, HISTORY[1]])
    with pytest.raises(LedgerConfigError, match="default"):
        history_config(HISTORY[1:])


def test_old_price_tables_still_read_and_keep_their_fingerprint():
    old = {"default": {"depreciation_per_hour": 1.0, "maintenance_per_hour": 0.0},
           "A": {"depreciation_per_hour": 2.0, "maintenance_per_hour": 0.4}}
    cfg = history_config(old)
    assert cfg.price_at("A", 0).version == "A@1970-01-01"
    doc = {"definition_version": "v1", "prices": old, "power": {"electricity_price_per_kwh": 0.1, "pue": 1.5},
           "coefficients": [{"model": "default", "coefficient": 1.0, "valid_from": "2020-01-01"}]}
    # the fingerprint of an old-form config is what it always was: a recorded version still matches
    before = hashlib.sha256(json.dumps({k: v for k, v in doc.items() if k != "coefficients"}, sort_keys=True,
                                       default=str).encode()).hexdigest()
    assert cfg.fingerprint == before
    # dated prices are history, like coefficients: a new entry needs no new definition version
    assert history_config(HISTORY).fingerprint == history_config(HISTORY[:2]).fingerprint
    assert history_config(HISTORY).fingerprint != history_config(HISTORY, power={"pue": 1.2}).fingerprint


def test_history_older_than_every_entry_is_priced_by_default_not_an_error():
    from gpuledger.ledger_files import load_ledger_config
    from pathlib import Path

    ledger = load_ledger_config(Path(__file__).parents[1] / "golden" / "ledger.toml")
    early = 946_684_800_000  # 2000-01-01, before every entry (2020-01-01)
    assert ledger.coefficient_at("A100-80GB", early).model == "default"
    assert ledger.coefficient_at("MI300X", early).version == "default@2020-01-01"
    assert ledger.interval_cost_micros("A100-80GB", 60_000, 0.0, early) > 0
    bare = replace(ledger, coefficients={})  # no library at all: the baseline's 1.0, flagged by its model
    assert (bare.coefficient_at("T4", early).coefficient, bare.coefficient_at("T4", early).model) == (1.0, "default")
