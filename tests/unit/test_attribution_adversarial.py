"""Attribution of one GPU stretch under odd but schema-valid input: conservation to the micro-unit,
whatever the holders, shares, containers, measurements and definitions (docs/accounting.md §1, §4, §5).

tests/unit/test_attribution.py checks the formulas on worked examples and a narrower property; this
one widens the input: shares of 1 to 1000 thousandths, up to seven holders (over-committed), two
holders claiming one container, processes of containers nobody holds or of none, utilization and
memory at their bounds, memory totals of 0, energy far beyond any card, one-millisecond stretches,
both splits, both homes of the unused part, any SM/memory weights."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.schemas.models import GpuHealth, GpuSample, ProcessSample
from gpuledger.streams.attribution import Holder, attribute, normalise_shares
from test_attribution import LEDGER, T0

CONTAINERS = [None, "ca", "cb", "cc", "nobodys"]

processes = st.lists(st.builds(
    ProcessSample, pid=st.integers(0, 9), container_id=st.sampled_from(CONTAINERS),
    sm_util_pct=st.one_of(st.none(), st.sampled_from([0.0, 100.0]), st.floats(0, 100)),
    mem_used_bytes=st.one_of(st.none(), st.sampled_from([0, 10**12]), st.integers(0, 10**11))), max_size=6)
holders = st.lists(st.builds(
    Holder, job_id=st.sampled_from("abcdefgh"), attempt=st.integers(0, 2), tenant=st.sampled_from(["t1", "t2"]),
    queue=st.just("q"), share_milli=st.one_of(st.integers(1, 1000), st.sampled_from([1, 999, 1000])),
    running=st.booleans(), container_id=st.sampled_from(CONTAINERS)),
    max_size=7, unique_by=lambda h: (h.job_id, h.attempt))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(util=st.one_of(st.none(), st.floats(0, 100)), sm=st.one_of(st.none(), st.floats(0, 100)),
       mem_total=st.one_of(st.none(), st.sampled_from([0, 1]), st.integers(0, 10**11)), procs=processes,
       held=holders, down=st.booleans(),
       energy=st.one_of(st.floats(0, 10**7), st.sampled_from([0.0, 1e300])),
       duration=st.one_of(st.sampled_from([1, 2, 7]), st.integers(1, 3_600_000)),
       split=st.sampled_from(["measured", "allocation"]), unused=st.sampled_from(["holders", "platform"]),
       weights=st.sampled_from([(1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (3.0, 1.0)]))
def test_any_stretch_splits_its_time_and_cost_exactly(util, sm, mem_total, procs, held, down, energy, duration, split,
                                                      unused, weights):
    ledger = replace(LEDGER, definitions=replace(LEDGER.definitions, shared_split=split, shared_unused=unused,
                                                 shared_sm_weight=weights[0], shared_memory_weight=weights[1]))
    g = GpuSample(gpu_uuid="GPU-1", index=0, model="A100-80GB", util_gpu_pct=util, sm_active_pct=sm,
                  mem_total_bytes=mem_total, power_w=100.0, processes=procs,
                  health=GpuHealth.down if down else GpuHealth.ok)
    kw = dict(cluster="c", node="n", gpu=g, start_ms=T0, end_ms=T0 + duration, energy_j=energy, ledger=ledger)
    records = attribute(holders=held, **kw)
    (free,) = attribute(holders=[], **kw)  # the same stretch with nobody on it: the GPU's whole cost

    # conservation: the GPU's time and its cost, to the millisecond and the micro-unit
    assert sum(r["gpu_ms"] for r in records) == duration
    assert sum(r["cost_micros"] for r in records) == free["cost_micros"]
    assert sum(r["energy_j"] for r in records) <= free["energy_j"] * (1 + 1e-9) + 1e-9
    assert all(r["gpu_ms"] >= 0 and r["cost_micros"] >= 0 and 0 <= r["share_milli"] <= 1000 for r in records)
    assert len({r["record_id"] for r in records}) == len(records)
    # one record per state and holder (what a segment's slot is keyed by)
    assert len({(r["state"], r["job_id"], r["attempt"]) for r in records}) == len(records)

    if down:
        assert [(r["state"], r["job_id"]) for r in records] == [("down", "")]  # a down GPU bills no holder
        return
    for h in held:  # an attempt the events and the judge call idle is never billed executing
        if not h.running:
            assert not [r for r in records if (r["job_id"], r["attempt"], r["state"]) ==
                        (h.job_id, h.attempt, "executing")]
    if held:
        # the part nobody holds is the platform's, exactly (up to one ms of rounding per record); under
        # `unused = platform` the held but unused part joins it
        free_ms = sum(r["gpu_ms"] for r in records if r["state"] == "unallocated")
        exact = (1000 - sum(normalise_shares(sorted(held)))) * duration / 1000
        if split == "allocation" or unused == "holders":
            assert abs(free_ms - exact) <= len(records)
        else:
            assert free_ms >= exact - len(records)


def test_two_holders_claiming_one_container_keep_the_gpu_whole():
    # an attempt's end read late leaves two attempts of one Slurm job (one container name) on the GPU;
    # each is measured with the container's whole use, so their uses add up past what the GPU did: they
    # are scaled to what they hold, and the GPU's time and cost still add up
    g = GpuSample(gpu_uuid="GPU-1", index=0, model="A100-80GB", util_gpu_pct=90.0, power_w=100.0,
                  processes=[ProcessSample(pid=1, container_id="slurm-job-7", sm_util_pct=90.0)])
    held = [Holder("7", 0, "t", "q", 1000, True, "slurm-job-7"), Holder("7", 1, "t", "q", 1000, True, "slurm-job-7")]
    records = attribute(cluster="c", node="n", gpu=g, holders=held, start_ms=T0, end_ms=T0 + 10_000, energy_j=0.0,
                        ledger=LEDGER)
    assert [(r["attempt"], r["state"], r["gpu_ms"]) for r in records] == [(0, "executing", 5000), (1, "executing", 5000)]
