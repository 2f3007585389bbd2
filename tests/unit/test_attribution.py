"""Attribution of one GPU stretch: conservation of time and cost, shares, states."""

from pathlib import Path

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gpuledger.schemas.models import GpuSample, ProcessSample, UsageRecord
from gpuledger.schemas.wire import encode
from gpuledger.streams.attribution import Holder, split_integer
from gpuledger.streams.attribution import attribute as attribute_dicts
from gpuledger.ledger_files import load_ledger_config

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults

LEDGER = load_ledger_config(UNIT_LEDGER)


def gpu(**kw) -> GpuSample:
    base = dict(gpu_uuid="GPU-1", index=0, model="A100-80GB", util_gpu_pct=50.0, power_w=200.0)
    base.update(kw)
    return GpuSample(**base)


def attribute(**kw) -> list[UsageRecord]:
    """The records as models: each wire dict must be a valid UsageRecord, and exactly its wire form."""
    records = []
    for d in attribute_dicts(**kw):
        record = UsageRecord.model_validate(d)
        assert orjson.loads(encode(record)) == d
        records.append(record)
    return records


T0 = 1_793_577_600_000  # 2026-11-02


def run(g, holders, start=T0, end=T0 + 10_000, energy=2000.0):
    return attribute(cluster="c", node="n", gpu=g, holders=holders, start_ms=start, end_ms=end, energy_j=energy, ledger=LEDGER)


def test_split_integer_sums_exactly():
    assert split_integer(10, [1, 1, 1]) == [4, 3, 3]
    assert split_integer(0, [1, 2]) == [0, 0]
    assert split_integer(7, [0, 0]) == [0, 0]


@given(total=st.integers(0, 10**9), weights=st.lists(st.integers(0, 1000), min_size=1, max_size=8))
def test_split_integer_property(total, weights):
    parts = split_integer(total, weights)
    assert sum(parts) == (total if sum(weights) else 0)
    assert all(p >= 0 for p in parts)


def test_free_gpu_is_unallocated():
    (r,) = run(gpu(), [])
    assert (r.state.value, r.gpu_ms, r.share_milli, r.job_id) == ("unallocated", 10_000, 1000, "")
    assert r.cost_micros == LEDGER.interval_cost_micros("A100-80GB", 10_000, 2000.0)


def test_down_gpu_is_down_even_when_held():
    (r,) = run(gpu(health="down", down_reason="xid 79"), [Holder("j", 0, "t", "q", 1000, True)])
    assert r.state.value == "down" and r.gpu_ms == 10_000 and r.job_id == ""


SHARED = [Holder("a", 0, "t1", "q", 333, True, "ca"), Holder("b", 0, "t2", "q", 333, False, "cb"),
          Holder("c", 1, "t3", "q", 333, True, "cc")]
SHARED_GPU = gpu(processes=[ProcessSample(pid=1, container_id="ca", sm_util_pct=40.0, mem_used_bytes=10),
                            ProcessSample(pid=2, container_id="cc", sm_util_pct=20.0)])


def test_shared_gpu_split_by_measured_use_conserves_time_and_cost():
    records = run(SHARED_GPU, SHARED, end=T0 + 10_001)
    assert sum(r.gpu_ms for r in records) == 10_001
    assert sum(r.cost_micros for r in records) == LEDGER.interval_cost_micros("A100-80GB", 10_001, 2000.0)
    # no memory total known -> SM only: a used 40 %, c 20 %; held 99.9 %, so 39.9 % unused,
    # split over the three holders by their equal shares (13.3 % each); 0.1 % unallocated
    got = [(r.job_id, r.state.value, r.share_milli, r.util_pct) for r in records]
    assert got == [("a", "executing", 400, 40.0), ("c", "executing", 200, 20.0), ("a", "allocated_idle", 133, None),
                   ("b", "allocated_idle", 133, None), ("c", "allocated_idle", 133, None), ("", "unallocated", 1, None)]
    assert [r.gpu_ms for r in records] == [4001, 2000, 1330, 1330, 1330, 10]  # largest remainder: 4000.4 -> 4001


def ledger_with(**definitions):
    from dataclasses import replace

    return replace(LEDGER, definitions=replace(LEDGER.definitions, **definitions))


def test_shared_gpu_split_by_allocation_when_configured():
    records = attribute(cluster="c", node="n", gpu=SHARED_GPU, holders=SHARED, start_ms=T0, end_ms=T0 + 10_000,
                        energy_j=0.0, ledger=ledger_with(shared_split="allocation"))
    assert [(r.job_id, r.state.value, r.gpu_ms) for r in records] == [
        ("a", "executing", 3330), ("b", "allocated_idle", 3330), ("c", "executing", 3330), ("", "unallocated", 10)]


def test_unused_part_of_shared_gpu_can_be_the_platforms():
    records = attribute(cluster="c", node="n", gpu=SHARED_GPU, holders=SHARED, start_ms=T0, end_ms=T0 + 10_000,
                        energy_j=0.0, ledger=ledger_with(shared_unused="platform"))
    assert [(r.state.value, r.gpu_ms) for r in records] == [("executing", 4000), ("executing", 2000), ("unallocated", 4000)]


def test_memory_weight_counts_when_memory_total_is_known():
    g = gpu(mem_total_bytes=1000, processes=[ProcessSample(pid=1, container_id="ca", sm_util_pct=40.0, mem_used_bytes=500)])
    holders = [Holder("a", 0, "t", "q", 500, True, "ca"), Holder("b", 0, "t", "q", 500, True, "cb")]
    records = run(g, holders)
    # a: 0.5 x 40 % + 0.5 x 50 % = 45 %; b unmeasured -> assumed to use its 50 % share; 5 % unused
    assert [(r.job_id, r.state.value, r.gpu_ms) for r in records] == [
        ("a", "executing", 4500), ("b", "executing", 5000), ("a", "allocated_idle", 250), ("b", "allocated_idle", 250)]


def test_utilization_metric_follows_the_definition():
    holders = [Holder("a", 0, "t", "q", 1000, True)]
    (mean,) = run(gpu(util_gpu_pct=15.0), holders)
    assert mean.util_metric_pct == 15.0
    ledger = ledger_with(utilization_aggregation="above_threshold", utilization_threshold_pct=10.0)
    (above,) = attribute(cluster="c", node="n", gpu=gpu(util_gpu_pct=15.0), holders=holders, start_ms=T0,
                         end_ms=T0 + 10_000, energy_j=0.0, ledger=ledger)
    assert (above.util_pct, above.util_metric_pct) == (15.0, 100.0)


def test_cost_components_are_a_definition():
    full = LEDGER.interval_cost_micros("A100-80GB", 3_600_000, 3_600_000.0)
    no_power = ledger_with(include_power=False).interval_cost_micros("A100-80GB", 3_600_000, 3_600_000.0)
    no_cooling = ledger_with(include_cooling=False).interval_cost_micros("A100-80GB", 3_600_000, 3_600_000.0)
    assert full - no_power == round(0.12 * 1.4 * 1e6)  # 1 kWh x price x PUE
    assert full - no_cooling == round(0.12 * 0.4 * 1e6)


def test_overcommitted_gpu_is_scaled_not_overcounted():
    holders = [Holder("a", 0, "t", "q", 1000, True), Holder("b", 0, "t", "q", 1000, True)]
    records = run(gpu(), holders)
    assert [r.share_milli for r in records] == [500, 500]
    assert sum(r.gpu_ms for r in records) == 10_000


def test_effective_gpu_ms_uses_coefficient_of_the_model():
    (r,) = run(gpu(model="T4"), [Holder("a", 0, "t", "q", 1000, True)])
    assert r.coefficient == 0.4 and r.effective_gpu_ms == 4_000 and r.coefficient_version == "T4@2020-01-01"
    assert r.util_pct == 50.0


def test_unknown_model_uses_default_price_and_coefficient():
    (r,) = run(gpu(model="Mystery-9000"), [])
    assert r.coefficient_version == "default@2020-01-01"
    assert r.cost_micros == LEDGER.interval_cost_micros("default", 10_000, 2000.0)


processes = st.lists(st.builds(ProcessSample, pid=st.integers(0, 99), container_id=st.sampled_from([None, "ca", "cb"]),
                               sm_util_pct=st.one_of(st.none(), st.floats(0, 100)),
                               mem_used_bytes=st.one_of(st.none(), st.integers(0, 10**9))), max_size=3)
holders = st.lists(st.builds(Holder, job_id=st.sampled_from(["a", "b", "c"]), attempt=st.integers(0, 1), tenant=st.just("t"),
                             queue=st.just("q"), share_milli=st.sampled_from([250, 500, 1000]), running=st.booleans(),
                             container_id=st.sampled_from([None, "ca", "cb"])), max_size=3, unique_by=lambda h: (h.job_id, h.attempt))


@given(util=st.one_of(st.none(), st.floats(0, 100)), sm=st.one_of(st.none(), st.floats(0, 100)), down=st.booleans(),
       mem_total=st.one_of(st.none(), st.integers(1, 10**10)), procs=processes, held=holders,
       energy=st.floats(0, 10**6), duration=st.integers(1, 60_000))
def test_the_workers_metered_view_attributes_exactly_like_the_whole_sample(util, sm, down, mem_total, procs, held,
                                                                           energy, duration):
    from gpuledger.schemas.models import MeteredGpu

    whole = gpu(util_gpu_pct=util, sm_active_pct=sm, health="down" if down else "ok", mem_total_bytes=mem_total,
                temperature_c=40.0, processes=procs)
    metered = MeteredGpu.model_validate_json(encode(whole))
    kw = dict(cluster="c", node="n", holders=held, start_ms=T0, end_ms=T0 + duration, energy_j=energy, ledger=LEDGER)
    records = attribute(gpu=whole, **kw)
    assert attribute(gpu=metered, **kw) == records
    assert sum(r.gpu_ms for r in records) == duration  # conservation, whatever the split
    assert sum(r.cost_micros for r in records) == LEDGER.interval_cost_micros("A100-80GB", duration, energy)


def test_the_memory_of_a_containers_processes_never_sums_past_what_a_record_holds():
    """Three processes of the holder's container each reporting 2**63 - 1 bytes (bogus, but within what a
    sample may carry): their sum made a record no encoder takes ("Integer exceeds 64-bit range"), and
    the worker failed on the watermark that closed the tick, again after every restart."""
    g = gpu(processes=[ProcessSample(pid=i, container_id="ca", sm_util_pct=10.0, mem_used_bytes=2**63 - 1)
                       for i in range(3)])
    (alone,) = run(g, [Holder("a", 0, "t", "q", 1000, True, "ca")])
    shared = run(g, [Holder("a", 0, "t", "q", 500, True, "ca"), Holder("b", 0, "t", "q", 500, True, "cb")])
    assert alone.mem_used_bytes == shared[0].mem_used_bytes == 2**63 - 1
