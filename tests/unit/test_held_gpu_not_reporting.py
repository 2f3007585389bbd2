"""WorkerCore, pure: a GPU an attempt holds that its node stops reporting (fallen off the bus, the agent
cannot read it) is billed to no one for that time, to the job or as capacity. It was not counted
anywhere; now `held_gpu_not_reporting_seconds` counts it (gpuledger_unmatched_total) and a warning
names the GPU and its holders once, when it starts missing."""

from __future__ import annotations

import logging

import pytest

from gpuledger.schemas.models import AllocationChange, GpuAssignment, GpuSample, NodeTick, UsageBatch
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.streams.core import WorkerCore
from worker_feeder import LEDGER, S, T, T0, Feeder, watermark


def two_gpu_tick(ts: int, gpus=(0, 1), util: tuple[float, ...] = (90.0, 90.0)) -> NodeTick:
    return NodeTick(cluster="c", node="n", ts_ms=ts, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid=f"GPU-{i}", index=i, model="A100-80GB", power_w=200.0,
                                    util_gpu_pct=util[i]) for i in gpus])


#: the job holds both GPUs of the node, or only the one that goes missing (fewer held than reported: the check once
#: ran only when a node held more GPUs than its tick reported, so a lone held GPU dropping out went unseen)
HELD = pytest.mark.parametrize("held", [(0, 1), (1,)], ids=["both", "one-of-two"])


@HELD
def test_a_held_gpu_that_drops_out_of_the_ticks_is_counted_and_named_once(caplog, held) -> None:
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    feed(T.node_allocations, encode(AllocationChange(
        ts_ms=T0, event_id="j/allocated", kind="allocated", node="n", job_id="j", tenant="t", queue="q",
        gpus=[GpuAssignment(node="n", gpu_uuid=f"GPU-{i}", share_milli=1000) for i in held])))
    unmatched: dict[str, float] = {}
    core.on_unmatched = lambda kind, amount: unmatched.__setitem__(kind, unmatched.get(kind, 0) + amount)
    with caplog.at_level(logging.WARNING):
        for k in range(18):  # 1 min with both GPUs, 1 min with GPU-1 gone, 1 min with both again
            gpus = (0,) if 6 <= k < 12 else (0, 1)
            feed(T.gpu_samples, encode_node_ticks("n", [two_gpu_tick(T0 + k * 10 * S, gpus)]))
            watermark(feed, T0 + (k + 1) * 10 * S)
    assert unmatched.get("held_gpu_not_reporting_seconds") == 60
    named = [r.getMessage() for r in caplog.records if "does not report GPU GPU-1" in r.getMessage()]
    assert len(named) == 1 and "held by j/0" in named[0], named


@HELD
def test_a_quiet_stretch_ends_while_its_gpu_is_missing(held) -> None:
    """GPU-1 of a running job is quiet for 4 minutes, missing from the node's ticks for 10, back quiet
    for 3. Its stretch went on across the absence: back, it was idle at once (14 min > min_idle_s 300 s
    of the unit ledger). The absence is the platform's time, as a down GPU's: the stretch starts anew,
    so its first 3 minutes back stay executing, with the grace."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    feed(T.node_allocations, encode(AllocationChange(
        ts_ms=T0, event_id="j/started", kind="started", node="n", job_id="j", tenant="t", queue="q",
        gpus=[GpuAssignment(node="n", gpu_uuid=f"GPU-{i}", share_milli=1000) for i in held])))
    back = T0 + 84 * 10 * S
    for k in range(102):
        t = two_gpu_tick(T0 + k * 10 * S, (0,) if 24 <= k < 84 else (0, 1), util=(90.0, 0.0))
        feed(T.gpu_samples, encode_node_ticks("n", [t]))
        watermark(feed, T0 + (k + 1) * 10 * S)
    watermark(feed, T0 + 200 * 10 * S)
    after = [r for o in feed.outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records
             if r.gpu_uuid == "GPU-1" and r.start_ms >= back]
    assert sum(r.gpu_ms for r in after) == 18 * 10 * S
    assert {r.state for r in after} == {"executing"}, [(r.start_ms - back, r.state) for r in after]
