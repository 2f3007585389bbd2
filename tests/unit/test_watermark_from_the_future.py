"""A lifecycle watermark from the future (docs/reliability.md, "Bad input"): one scheduler agent's
clock a year ahead, or a producer writing any number, sent one watermark. Accepted, it closed every
tick of every node of every cluster on arrival, for good (a watermark never goes back), so every
allocation change that came after its tick was late, applied from the next open tick: a job ended
at 95 s, reported 28 s later, was billed to 120 s. It is a dead letter ("clock ahead") instead."""

from __future__ import annotations

import pytest

from gpuledger.schemas.models import DeadLetter, GpuAssignment, JobEvent, LifecycleWatermark, UsageBatch
from gpuledger.schemas.wire import decode, encode_node_ticks
from gpuledger.streams.checks import CLOCK_AHEAD_MS, DAY_MS, watermark_problem
from gpuledger.streams.core import WorkerCore
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, tick

LAG = 30 * S  # the scheduler agent publishes events up to 30 s after they happen (a Slurm poll) and promises as much


def live(rogue_at_ms: int | None, rogue_cluster: str = "rogue"):
    """Wall clock every 0.5 s for 4 minutes: node a's 10-s ticks are read 0.5 s after their end; job j
    holds a's GPU from T0+35 s to T0+95 s (60,000 GPU-ms), its start seen 5 s later, its end 28 s later;
    cluster c's watermark is the clock minus LAG. At T0+20 s one more watermark, of `rogue_cluster`,
    says `rogue_at_ms`. Returns (job j's GPU-ms per second of its records, every letter's reason)."""
    feed = Feeder(WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER))
    life, outs = feed.lifecycle, feed.outs

    gpus = [GpuAssignment(node="a", gpu_uuid="GPU-a")]
    events = [(T0 + 35 * S, 5 * S, "allocated", gpus), (T0 + 35 * S, 5 * S, "started", []),
              (T0 + 95 * S, 28 * S, "completed", [])]
    for w in range(T0, T0 + 4 * MIN, S // 2):
        if (w - T0) % (10 * S) == S // 2 and w - S // 2 - 10 * S >= T0:
            feed(T.gpu_samples, encode_node_ticks("a", [tick("a", w - S // 2 - 10 * S)]), w)
        for n, (ts, seen_after, kind, assigned) in enumerate(events):
            if ts + seen_after == w:
                life(JobEvent(event_id=f"e{n}", ts_ms=ts, kind=kind, cluster="c", job_id="j", tenant="t", queue="q",
                              gpus=assigned), w)
        if w % S == 0:
            life(LifecycleWatermark(cluster="c", ts_ms=w - LAG), w)
        if rogue_at_ms is not None and w == T0 + 20 * S:
            life(LifecycleWatermark(cluster=rogue_cluster, ts_ms=rogue_at_ms), w)
    records = [r for o in outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records if r.job_id == "j"]
    reasons = [decode(DeadLetter, o.value).reason for o in outs if o.topic in (T.dead_letters, T.late_events)]
    return records, reasons


def test_the_honest_run_bills_the_job_exactly():
    records, reasons = live(None)
    assert reasons == []
    assert sum(r.gpu_ms for r in records) == 60_000
    assert (min(r.start_ms for r in records), max(r.end_ms for r in records)) == (T0 + 35 * S, T0 + 95 * S)


@pytest.mark.parametrize("cluster", ["rogue", "c"])
@pytest.mark.parametrize("ahead_ms", [365 * DAY_MS, 2 * DAY_MS, CLOCK_AHEAD_MS + 60 * S])
def test_a_watermark_ahead_of_the_clock_is_a_dead_letter_and_bills_stay_exact(cluster, ahead_ms):
    now = T0 + 20 * S
    records, reasons = live(now + ahead_ms, cluster)
    # before the fix: 85,000 GPU-ms billed ([35 s, 120 s)), 3 late allocation changes, no dead letter
    assert sum(r.gpu_ms for r in records) == 60_000, (
        f"job j billed {sum(r.gpu_ms for r in records)} GPU-ms for 60,000; letters: {reasons}")
    assert len(reasons) == 1 and reasons[0].startswith(f"clock ahead: watermark of cluster {cluster} ts_ms=")


def test_the_rule_judges_by_the_clock_only():
    now = T0 + 10 * DAY_MS
    assert watermark_problem("c", now + CLOCK_AHEAD_MS, 7 * DAY_MS, now) is None  # a clock a little off
    assert watermark_problem("c", now + CLOCK_AHEAD_MS + 1, 7 * DAY_MS, now).startswith("clock ahead")
    assert watermark_problem("c", 5, 7 * DAY_MS, now).startswith("absurd timestamp")  # 1970
    # far behind the clock is no problem: a scheduler agent back after a long outage, a replay of old data
    assert watermark_problem("c", now - 30 * DAY_MS, 7 * DAY_MS, now) is None
    # no clock (tools): only the 2000 floor
    assert watermark_problem("c", now + 365 * DAY_MS, 7 * DAY_MS, None) is None
