"""A lifecycle event dated ahead of the clock at receipt is held to the same clock rule as a GPU sample
and a watermark ("clock ahead", docs/reliability.md "Bad input"): an `allocated` dated 30 minutes
ahead (the 7-day window allowed it) was accepted, and from its date on its attempt shared the GPU with
the job really running there: billed 3,150,000 of its 3,600,000 GPU-ms, the ghost 450,000. Its real end,
sent when it happened, was refused as before its allocation, so the attempt held the GPU for ever."""

from __future__ import annotations

from gpuledger.schemas.models import DeadLetter, GpuAssignment, JobEvent, LifecycleWatermark, UsageBatch
from gpuledger.schemas.wire import decode, encode_node_ticks
from gpuledger.streams.checks import CLOCK_AHEAD_MS
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.join import check_event
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, tick

GPUS = [GpuAssignment(node="a", gpu_uuid="GPU-a")]


def event(n: int, kind: str, ts: int, job: str, gpus=()) -> JobEvent:
    return JobEvent(event_id=f"{job}-{n}", ts_ms=ts, kind=kind, cluster="c", job_id=job, tenant="t", queue="q",
                    gpus=list(gpus))


def test_an_allocation_dated_ahead_of_the_clock_is_refused_and_the_running_job_is_billed_whole():
    feed = Feeder(WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER))
    life, outs = feed.lifecycle, feed.outs

    life(event(1, "allocated", T0, "j", GPUS), T0)
    life(event(2, "started", T0, "j"), T0)
    life(event(1, "allocated", T0 + 30 * MIN, "ghost", GPUS), T0 + 10 * S)  # dated half an hour ahead
    for k in range(360):  # an hour of node a's 10-s ticks, each read 0.5 s after its end
        ts = T0 + k * 10 * S
        feed(T.gpu_samples, encode_node_ticks("a", [tick("a", ts)]), ts + 10 * S + 500)
        life(LifecycleWatermark(cluster="c", ts_ms=ts + 10 * S), ts + 10 * S + 500)
    life(event(3, "completed", T0 + 60 * MIN, "j"), T0 + 60 * MIN + S)
    life(LifecycleWatermark(cluster="c", ts_ms=T0 + 70 * MIN), T0 + 70 * MIN)
    records = [r for o in outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records]
    billed = {job: sum(r.gpu_ms for r in records if r.job_id == job) for job in ("j", "ghost")}
    assert billed == {"j": 3_600_000, "ghost": 0}, billed  # before the fix: {'j': 3150000, 'ghost': 450000}
    reasons = [decode(DeadLetter, o.value).reason for o in outs if o.topic == T.dead_letters]
    assert len(reasons) == 1 and reasons[0].startswith("clock ahead: event ghost-1 ts_ms=")


def test_the_event_clock_bound_is_that_of_samples():
    now = T0
    assert check_event(event(1, "completed", now + CLOCK_AHEAD_MS, "j"), 0, now_ms=now) is None
    assert check_event(event(1, "completed", now + CLOCK_AHEAD_MS + 1, "j"), 0, now_ms=now).startswith("clock ahead")
    assert check_event(event(1, "completed", now + 365 * 86_400_000, "j"), 0) is None  # no clock: tools
