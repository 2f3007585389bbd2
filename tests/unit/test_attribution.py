"""Attribution of one GPU stretch: conservation of time and cost, shares, states."""

from hypothesis import given
from hypothesis import strategies as st

from gpuledger.schemas.models import GpuSample, ProcessSample
from gpuledger.streams.attribution import Holder, attribute, split_integer
from gpuledger.streams.pricing import load_ledger_config

LEDGER = load_ledger_config()


def gpu(**kw) -> GpuSample:
    base = dict(gpu_uuid="GPU-1", index=0, model="A100-80GB", util_gpu_pct=50.0, power_w=200.0)
    base.update(kw)
    return GpuSample(**base)


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


def test_shared_gpu_conserves_time_and_cost():
    holders = [Holder("a", 0, "t1", "q", 333, True, "ca"), Holder("b", 0, "t2", "q", 333, False, "cb"),
               Holder("c", 1, "t3", "q", 333, True, "cc")]
    g = gpu(processes=[ProcessSample(pid=1, container_id="ca", sm_util_pct=40.0, mem_used_bytes=10),
                       ProcessSample(pid=2, container_id="cc", sm_util_pct=20.0)])
    records = run(g, holders, end=T0 + 10_001)
    assert sum(r.gpu_ms for r in records) == 10_001
    assert sum(r.cost_micros for r in records) == LEDGER.interval_cost_micros("A100-80GB", 10_001, 2000.0)
    states = [(r.job_id, r.state.value, r.util_pct) for r in records]
    assert states == [("a", "executing", 40.0), ("b", "allocated_idle", None), ("c", "executing", 20.0),
                      ("", "unallocated", None)]
    assert records[-1].share_milli == 1


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
