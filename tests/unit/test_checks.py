"""One set of rules (streams/checks.py and the router's sequence rules), pure: the time window with
the caller's clock, values that cannot be stored, dead letters that fit their topic, impossible
lifecycle sequences, and what the worker core forwards to lifecycle-accepted."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from gpuledger.streams.topic_names import TopicNames
from gpuledger.schemas.models import DeadLetter, GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick
from gpuledger.schemas.wire import DecodeError, decode, encode
from gpuledger.sink.rows import Source, sample_rows
from gpuledger.streams.checks import CLOCK_AHEAD_MS, DAY_MS, MIN_EVENT_MS, dead_letter, rows_problem, time_problem
from gpuledger.streams.core import SOURCE_HEADER, WorkerCore
from gpuledger.streams.router import LifecycleRouter
from gpuledger.ledger_files import load_ledger_config
from worker_feeder import LEDGER, T, Feeder, tick, watermark

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults

T0 = 1_793_577_600_000  # 2026-11-02
S = 1000
TOPICS = TopicNames.with_prefix("t.")
GPU = [GpuAssignment(node="n1", gpu_uuid="A")]


def event(kind, at_s, n, job="j1", attempt=0, gpus=()):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id=job, attempt=attempt,
                    tenant="t", queue="q", gpus=list(gpus))


# ------------------------------------------------------------------ the time window
def test_time_window_old_ahead_of_watermark_and_ahead_of_the_clock_before_any_watermark():
    assert time_problem("x", MIN_EVENT_MS - 1, 0, 7 * DAY_MS).startswith("absurd timestamp")
    assert time_problem("x", 0, 0, 7 * DAY_MS, now_ms=T0)  # 1970
    assert time_problem("x", T0 + 8 * DAY_MS, T0, 7 * DAY_MS) and "watermark" in time_problem(
        "x", T0 + 8 * DAY_MS, T0, 7 * DAY_MS)
    # no watermark yet: only the clock at receipt can judge the future
    assert time_problem("x", T0 + 400 * DAY_MS, 0, 7 * DAY_MS) is None
    far = time_problem("x", T0 + 400 * DAY_MS, 0, 7 * DAY_MS, now_ms=T0)
    assert far and "clock at receipt" in far
    assert time_problem("x", T0 + 6 * DAY_MS, 0, 7 * DAY_MS, now_ms=T0) is None
    assert time_problem("x", T0 - 300 * DAY_MS, 0, 7 * DAY_MS, now_ms=T0) is None  # old data replayed: fine


# ------------------------------------------------------------------ values that cannot be stored
def test_values_outside_their_column_are_named():
    assert rows_problem({"scheduler_snapshots": [{"pending_jobs": 2**32, "queue": "q"}]}).startswith(
        "value cannot be stored: scheduler_snapshots.pending_jobs")
    assert "queue_priority" in rows_problem({"scheduler_snapshots": [{"queue_priority": -(2**31) - 1}]})
    assert "pending_jobs_by_priority" in rows_problem({"scheduler_snapshots": [{"pending_jobs_by_priority": [1, 2**33]}]})
    assert "quota_gpus" in rows_problem({"scheduler_snapshots": [{"quota_gpus": float("inf")}]})
    assert "quota_gpus" in rows_problem({"scheduler_snapshots": [{"quota_gpus": float("nan")}]})
    assert "ts_ms" in rows_problem({"job_events": [{"ts_ms": 2**64}]})
    assert "attempt" in rows_problem({"job_events": [{"attempt": 2**32}]})
    assert rows_problem({"job_events": [{"attempt": 3, "aliases": {"a": "b"}, "gpu_share_milli": [1000]}]}) is None


# ------------------------------------------------------------------ dead letters fit their topic
def test_a_dead_letter_of_a_huge_message_is_cut_with_size_and_hash():
    raw = b'{"broken": "' + b"x" * 5_000_000
    value = dead_letter("t.gpu-samples", 0, 7, raw, "malformed JSON: " + "y" * 100_000, seen_ms=T0,
                        max_bytes=900_000)
    assert len(value) <= 900_000
    letter = decode(DeadLetter, value)
    assert letter.original_size == len(raw) and letter.original_sha256 == hashlib.sha256(raw).hexdigest()
    assert raw.decode().startswith(letter.original) and len(letter.original) > 100_000
    assert len(letter.reason) < 5000
    # escaping-heavy content (control characters grow sixfold in JSON) still fits
    value = dead_letter("t", 0, 0, b"\x01" * 2_000_000, "bad", seen_ms=T0, max_bytes=900_000)
    assert len(value) <= 900_000 and decode(DeadLetter, value).original_size == 2_000_000
    # a small one is whole, without the extra fields
    small = orjson.loads(dead_letter("t", 0, 0, b"abc", "bad", seen_ms=T0, max_bytes=900_000))
    assert small["original"] == "abc" and "original_size" not in small


# ------------------------------------------------------------------ impossible sequences
def test_events_of_an_attempt_never_allocated_are_rejected_but_failed_and_cancelled_end_it():
    router = LifecycleRouter()
    for kind in ("started", "checkpoint_begin", "interrupted", "preempted", "completed"):
        assert "never allocated" in router.sequence_problem(event(kind, 5, 1, job=f"j-{kind}"))
    assert router.sequence_problem(event("cancelled", 5, 1, job="queued")) is None
    router.route(event("cancelled", 5, 1, job="queued"))
    assert router.routes == {}
    # a later allocation of the cancelled attempt is an end before its start
    assert "at or after the attempt's end" in router.sequence_problem(event("allocated", 6, 2, job="queued", gpus=GPU))
    # another attempt of the same job is fine
    assert router.sequence_problem(event("allocated", 6, 3, job="queued", attempt=1, gpus=GPU)) is None


def test_completed_before_allocated_is_rejected_both_ways():
    router = LifecycleRouter()
    assert "never allocated" in router.sequence_problem(event("completed", 10, 1))  # remembered as the end
    assert "at or after" in router.sequence_problem(event("allocated", 20, 2, gpus=GPU))
    # the other arrival order: an end before its allocation's time
    router = LifecycleRouter()
    assert router.sequence_problem(event("allocated", 20, 1, gpus=GPU)) is None
    router.route(event("allocated", 20, 1, gpus=GPU))
    assert "before its allocation" in router.sequence_problem(event("completed", 10, 2))
    assert router.sequence_problem(event("completed", 30, 3)) is None


def test_a_second_end_of_an_ended_attempt_is_rejected():
    router = LifecycleRouter()
    for e in (event("allocated", 0, 1, gpus=GPU), event("started", 1, 2), event("completed", 10, 3)):
        assert router.sequence_problem(e) is None
        router.route(e)
    assert "already ended" in router.sequence_problem(event("failed", 20, 4))


def test_router_sequence_state_survives_a_snapshot():
    router = LifecycleRouter()
    router.route(event("allocated", 20, 1, gpus=GPU))
    router.sequence_problem(event("completed", 5, 9, job="j2"))
    restored = LifecycleRouter.from_state(orjson.loads(orjson.dumps(router.to_state())))
    assert restored.routes[("c", "j1")][0].since_ms == T0 + 20 * S and restored.ended == router.ended
    assert "before its allocation" in restored.sequence_problem(event("completed", 10, 2))


# ------------------------------------------------------------------ the worker core: one judge
def core():
    return WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=load_ledger_config(UNIT_LEDGER),
                      dead_letter_max_bytes=100_000)


def test_the_core_forwards_accepted_events_only_with_their_source():
    c = core()
    outs = c.on_lifecycle(0, 0, encode(event("allocated", 0, 1, gpus=GPU)), now_ms=T0)
    accepted = [o for o in outs if o.topic == TOPICS.lifecycle_accepted]
    assert len(accepted) == 1 and accepted[0].partition == 0 and accepted[0].headers == ((SOURCE_HEADER, b"0:0"),)
    assert decode(JobEvent, accepted[0].value).event_id == "j1-1"
    rejected = [
        event("failed", 0, 2).model_copy(update={"ts_ms": 5}),            # 1970
        event("started", 1, 3, job="ghost", gpus=GPU),                    # never allocated
        event("completed", 1, 4, job="ghost2"),                          # never allocated
        event("allocated", 2, 5, job="ghost2", gpus=GPU),                # after its end
        event("started", T0 // S, 6, gpus=GPU),                           # years ahead of the clock
    ]
    for offset, e in enumerate(rejected, start=1):
        outs = c.on_lifecycle(0, offset, encode(e), now_ms=T0)
        assert [o.topic for o in outs] == [TOPICS.dead_letters], e
    assert c.counters["impossible_sequences"] == 3 and c.counters["dead_letters"] == 5
    outs = c.on_lifecycle(0, 6, encode(event("allocated", 0, 1, gpus=GPU)), now_ms=T0)  # a duplicate
    assert outs == []


def test_a_far_future_tick_before_any_watermark_is_rejected_by_the_clock():
    c = core()
    tick = NodeTick(cluster="c", node="n1", ts_ms=T0 + 400 * DAY_MS, interval_ms=10_000,
                    gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=100.0)])
    outs = c.on_node(TOPICS.gpu_samples, 0, 0, encode(tick), now_ms=T0)
    assert [o.topic for o in outs] == [TOPICS.dead_letters]
    assert "clock at receipt" in decode(DeadLetter, outs[0].value).reason
    assert c.joins[0].nodes == {}  # nothing buffered: the partition can still commit
    # without a clock (tools, older callers) the old rule holds: accepted until a watermark says otherwise
    assert core().on_node(TOPICS.gpu_samples, 0, 0, encode(tick)) == []


def test_a_node_whose_clock_runs_ahead_is_refused_and_does_not_stall_its_partition():
    """One node of eight a day ahead, 30 minutes at 10 s: its ticks waited in memory for the watermark
    to reach them, so the partition's waiting samples passed the pause threshold (120 s per node on
    average) after 16 minutes, would stay there for the day (the others' bills with it), and the
    acknowledged offset stayed at its first tick. Refused as "clock ahead", none of that happens; the
    sink refuses the same ticks (one set of rules)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    most_waiting = 0
    for k in range(180):
        now = T0 + k * 10 * S + 5 * S  # the worker's clock: each tick read 5 s after its start
        for n in range(8):
            feed(T.gpu_samples, encode(tick(f"n{n}", T0 + k * 10 * S + (DAY_MS if n == 7 else 0))), now)
        watermark(feed, T0 + (k + 1) * 10 * S, now)
        most_waiting = max(most_waiting, core.samples_waiting_ms(0))
    assert most_waiting <= 10 * S  # at most the one tick per node waiting for its watermark
    assert core.covered_offsets("join", 0)[T.gpu_samples] == 8 * 180
    reasons = [d.reason for d in feed.letters()]
    assert len(reasons) == 180 and all(r.startswith("clock ahead: tick of n7") for r in reasons)
    assert "86395 s ahead of the clock at receipt" in reasons[0] and "(at most 300 s allowed)" in reasons[0]
    assert ("c", "n7") not in core.joins[0].nodes
    # the bound: up to CLOCK_AHEAD_MS ahead is a clock a little off, accepted; beyond it, refused
    edge = T0 + 10 * DAY_MS
    assert time_problem("x", edge + CLOCK_AHEAD_MS, 0, 7 * DAY_MS, edge, CLOCK_AHEAD_MS) is None
    assert time_problem("x", edge + CLOCK_AHEAD_MS + 1, 0, 7 * DAY_MS, edge, CLOCK_AHEAD_MS).startswith("clock ahead")
    # the sink, at the same clock, stores no health row of a tick the worker refused
    raw = encode(tick("n7", T0 + DAY_MS))
    with pytest.raises(DecodeError, match="clock ahead: tick of n7"):
        sample_rows(raw, Source("t.gpu-samples", 0, 0), now_ms=T0 + 5 * S)
    assert sample_rows(raw, Source("t.gpu-samples", 0, 0), now_ms=T0 + DAY_MS)["gpu_health"]


def test_the_cores_dead_letters_fit_their_topic():
    c = core()
    outs = c.on_node(TOPICS.gpu_samples, 0, 0, b"{" + b"x" * 3_000_000, now_ms=T0)
    assert len(outs) == 1 and len(outs[0].value) <= 100_000
    letter = decode(DeadLetter, outs[0].value)
    assert letter.original_size == 3_000_001 and letter.seen_ms == T0


@pytest.mark.parametrize("watermark_first", [True, False])
def test_the_core_is_deterministic_with_the_same_clock(watermark_first):
    def run():
        c = core()
        outs = []
        msgs = [encode(LifecycleWatermark(cluster="c", ts_ms=T0))] if watermark_first else []
        msgs += [encode(event("allocated", 0, 1, gpus=GPU)), encode(event("completed", 5, 2)),
                 encode(event("completed", 6, 3, job="x"))]
        for offset, raw in enumerate(msgs):
            outs += c.on_lifecycle(0, offset, raw, now_ms=T0)
        return [(o.topic, o.value, o.key, o.partition, o.headers) for o in outs]
    assert run() == run()


@pytest.mark.parametrize("crash_at", range(1, 9))
def test_a_restored_router_judges_and_forwards_the_same(crash_at):
    """Crash after `crash_at` messages with a snapshot taken somewhere before: the restored core reads
    again from the snapshot's offset; what reaches lifecycle-accepted, after the sink's filter by
    source offset, and the verdicts are those of the crash-free run."""
    msgs = [encode(e) for e in (
        event("allocated", 0, 1, gpus=GPU), event("completed", 1, 2, job="never"), event("started", 2, 3),
        event("allocated", 3, 4, job="never", gpus=GPU), event("completed", 4, 5, job="j1", attempt=3),
        event("completed", 9, 6), event("failed", 10, 7), event("cancelled", 11, 8, job="queued"),
        event("allocated", 12, 9, job="queued", gpus=GPU))]

    def accepted(outs):
        return {o.headers[0][1]: o.value for o in outs if o.topic == TOPICS.lifecycle_accepted}

    def verdicts(outs):
        return sorted(decode(DeadLetter, o.value).reason for o in outs if o.topic == TOPICS.dead_letters)

    c = core()
    clean = [o for offset, raw in enumerate(msgs) for o in c.on_lifecycle(0, offset, raw, now_ms=T0)]

    c = core()
    outs, snap_at, blob = [], 0, c.snapshot("router", 0)
    for offset, raw in enumerate(msgs[:crash_at]):
        outs += c.on_lifecycle(0, offset, raw, now_ms=T0)
        if offset == crash_at // 2:
            snap_at, blob = offset + 1, c.snapshot("router", 0)
    restored = core()
    restored.restore("router", 0, blob)
    outs += [o for offset in range(snap_at, len(msgs)) for o in restored.on_lifecycle(0, offset, msgs[offset], now_ms=T0)]
    assert accepted(outs) == accepted(clean)
    assert set(verdicts(outs)) == set(verdicts(clean))  # a dead letter may come twice (at least once)
    assert len(accepted(clean)) == 4 and len(set(verdicts(clean))) == 5


def test_an_event_with_a_value_its_column_cannot_hold_is_a_dead_letter_not_billed():
    """An attempt past UInt32 (or a priority past Int32) passed the worker: it was billed, and the sink
    refused the node's whole usage batch for it (the other jobs' GPU time of that window lost with
    it) and the event itself. The worker judges by the sink's column ranges too (one set of rules)."""
    c = core()
    bad = [event("allocated", 0, 1, job="a", attempt=2**32, gpus=GPU),
           event("allocated", 0, 1, job="p", gpus=GPU).model_copy(update={"priority": 2**31}),
           event("allocated", 0, 1, job="r", gpus=GPU).model_copy(update={"requested_gpus": 1e300})]
    for offset, e in enumerate(bad):
        outs = c.on_lifecycle(0, offset, encode(e), now_ms=T0)
        assert [o.topic for o in outs] == [TOPICS.dead_letters], e
    reasons = [decode(DeadLetter, o.value).reason for o in c.on_lifecycle(0, 3, encode(bad[0]), now_ms=T0)]
    assert reasons == ["value cannot be stored: job_events.attempt=4294967296 is outside [0, 4294967295]"]
    assert c.routers[0].router.routes == {}
    # the edges of the columns are fine
    ok = event("allocated", 0, 1, job="edge", attempt=2**32 - 1, gpus=GPU).model_copy(update={"priority": -(2**31)})
    assert TOPICS.lifecycle_accepted in [o.topic for o in c.on_lifecycle(0, 4, encode(ok), now_ms=T0)]


def test_an_event_after_its_attempts_end_says_so():
    # the attempt was allocated: "never allocated" sent the operator looking for a lost allocation
    router = LifecycleRouter()
    for e in (event("allocated", 0, 1, gpus=GPU), event("started", 1, 2), event("completed", 10, 3)):
        router.route(e)
    problem = router.sequence_problem(event("checkpoint_end", 12, 4))
    assert problem == (f"impossible sequence: checkpoint_end of j1 attempt 0 at ts_ms={T0 + 12 * S}, after the "
                       f"attempt's end at ts_ms={T0 + 10 * S}")
    assert "never allocated" in router.sequence_problem(event("started", 12, 5, attempt=1))


def test_the_end_remembered_from_a_rejected_event_is_forgotten_with_its_job():
    # a `completed` of a job never allocated (its `allocated` dead-lettered, lost upstream): the end
    # kept to judge a later `allocated` stayed in the router, and in every snapshot, for ever
    router = LifecycleRouter()
    assert "never allocated" in router.sequence_problem(event("completed", 10, 1, job="ghost"))
    assert ("c", "ghost") in router.ended
    assert router.prune(T0 + 5 * S) == 0  # still within the retention: kept to judge its `allocated`
    assert router.prune(T0 + 11 * S) == 1
    assert router.ended == {} and router.to_state()["by_cluster"] == {}


def judged_in_order(events) -> tuple[LifecycleRouter, list[str | None]]:
    """Each event judged (`sequence_problem`), and routed when it passes, as the worker does."""
    router, outcomes = LifecycleRouter(), []
    for e in events:
        outcomes.append(router.sequence_problem(e))
        if outcomes[-1] is None:
            router.route(e)
    return router, outcomes


@pytest.mark.parametrize("end", ["completed", "cancelled"])
def test_an_allocation_read_after_its_attempts_end_is_rejected_whatever_its_time(end):
    # `completed` at 30 s read before `allocated` at 20 s: the end was judged (rejected: never
    # allocated; a `cancelled` accepted with no GPU effect), so the allocation, accepted, held its
    # GPUs from 20 s for ever: no end would ever come for it
    events = [event(end, 30, 1), event("allocated", 20, 2, gpus=GPU)]
    router, outcomes = judged_in_order(events)
    assert outcomes[1] == (f"impossible sequence: allocated of j1 attempt 0 at ts_ms={T0 + 20 * S}, read after the "
                           f"attempt's end at ts_ms={T0 + 30 * S}: its GPUs would be held for ever")
    assert router.routes == {}


def test_a_later_attempts_end_does_not_hide_an_earlier_ones():
    """As above, with attempt 1 allocated, run and ended before attempt 0's stale `allocated` is read: only the
    latest ended attempt was remembered, so that `allocated` was accepted and held its GPU for ever (and beside
    attempt 1 on it). Each attempt's end is kept, and in the snapshot; one of an older snapshot reads as before."""
    events = [event("completed", 30, 1), event("allocated", 40, 2, attempt=1, gpus=GPU),
              event("started", 40, 3, attempt=1), event("completed", 60, 4, attempt=1),
              event("allocated", 20, 5, gpus=GPU)]
    router, outcomes = judged_in_order(events)
    assert outcomes[4] == (f"impossible sequence: allocated of j1 attempt 0 at ts_ms={T0 + 20 * S}, read after the "
                           f"attempt's end at ts_ms={T0 + 30 * S}: its GPUs would be held for ever")
    assert router.routes == {} and router.ended == {("c", "j1"): {0: T0 + 30 * S, 1: T0 + 60 * S}}
    restored = LifecycleRouter.from_state(orjson.loads(orjson.dumps(router.to_state())))
    assert restored.ended == router.ended
    old = {"by_cluster": {"c": {"routes": {}, "ended": {"j1": [1, T0 + 60 * S]}, "seen": {}, "last_seen_ms": {}}}}
    assert LifecycleRouter.from_state(old).ended == {("c", "j1"): {1: T0 + 60 * S}}
