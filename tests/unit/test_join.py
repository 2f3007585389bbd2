"""The join without Kafka: router fan-out, watermark clock, node join in event time."""

import random
import tomllib
from pathlib import Path

import orjson

from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, NodeTick, NodeWatermark
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.pricing import parse_ledger_config
from gpuledger.streams.router import LifecycleRouter, WatermarkClock
from gpuledger.ledger_files import load_ledger_config

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults
LEDGER = load_ledger_config(UNIT_LEDGER)
T0 = 1_793_577_600_000
S = 1000


def event(kind, at_s, n, job="j1", attempt=0, gpus=()):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id=job, attempt=attempt,
                    tenant="t", queue="q", gpus=list(gpus))


TWO_NODES = [GpuAssignment(node="n1", gpu_uuid="A"), GpuAssignment(node="n2", gpu_uuid="B", share_milli=500)]


def tick(k, node="n1", uuid="A"):
    return NodeTick(cluster="c", node=node, ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid=uuid, index=0, model="A100-80GB", power_w=100.0)])


def test_router_fans_out_by_node_and_remembers_the_allocation():
    router = LifecycleRouter()
    assert router.route(event("submitted", 0, 0)) == []
    changes = router.route(event("allocated", 1, 1, gpus=TWO_NODES))
    assert [(c.node, [g.gpu_uuid for g in c.gpus]) for c in changes] == [("n1", ["A"]), ("n2", ["B"])]
    started = router.route(event("started", 2, 2))  # carries no GPUs: the router knows them
    assert [c.node for c in started] == ["n1", "n2"] and started[1].gpus[0].share_milli == 500
    assert router.route(event("started", 2, 2)) == [] and router.duplicates == 1
    assert len(router.route(event("failed", 3, 3))) == 2
    assert router.route(event("started", 4, 4)) == []  # attempt ended: no GPUs any more


def test_watermark_clock_waits_for_every_source_partition():
    clock = WatermarkClock()
    assert clock.observe(NodeWatermark(ts_ms=50, source_partition=0, source_partitions=2)) == 0
    assert clock.observe(NodeWatermark(ts_ms=40, source_partition=1, source_partitions=2)) == 40
    assert clock.observe(NodeWatermark(ts_ms=30, source_partition=1, source_partitions=2)) == 40  # never goes back


def changes_for(router_events):
    router = LifecycleRouter()
    return [c for e in router_events for c in router.route(e) if c.node == "n1"]


SCENARIO = [event("allocated", 10, 1, gpus=TWO_NODES), event("started", 25, 2), event("completed", 50, 3)]


def summarise(records):
    out = {}
    for r in records:
        key = (r["state"], r["job_id"])
        out[key] = out.get(key, 0) + r["gpu_ms"]
    return out


def test_node_join_splits_ticks_at_changes_and_waits_for_watermark():
    join = NodeJoin(node="n1")
    for c in changes_for(SCENARIO):
        join.add_change(c)
    for k in range(6):
        assert join.add_tick(tick(k)).status == "accepted"
    assert join.close_until(T0 + 25 * S, LEDGER) and join.closed_until_ms == T0 + 20 * S
    rest = join.close_until(T0 + 60 * S, LEDGER)
    assert join.pending_ticks == [] and join.closed_until_ms == T0 + 60 * S
    assert rest[-1]["end_ms"] == T0 + 60 * S
    assert join.add_tick(tick(3)).status == "duplicate"  # closed already: a silent duplicate


def test_records_do_not_depend_on_arrival_order():
    expected = None
    for seed in range(5):
        items = [("c", c) for c in changes_for(SCENARIO)] + [("t", tick(k)) for k in range(6)]
        random.Random(seed).shuffle(items)
        join = NodeJoin(node="n1")
        records = []
        for kind, item in items:
            if kind == "c":
                join.add_change(item)
            else:
                join.add_tick(item)
        records += join.close_until(T0 + 60 * S, LEDGER)
        got = summarise(records)
        assert got == {("unallocated", ""): 20_000, ("allocated_idle", "j1"): 15_000, ("executing", "j1"): 25_000}
        expected = expected or records
        assert records == expected


def test_duplicate_tick_is_rejected():
    join = NodeJoin(node="n1")
    assert join.add_tick(tick(0)).status == "accepted"
    assert join.add_tick(tick(0)).status == "duplicate"


def test_energy_from_counter_deltas_with_power_fallback():
    join = NodeJoin(node="n1")
    for k, energy in enumerate([1000.0, 1600.0, 2500.0]):
        t = tick(k)
        t = t.model_copy(update={"gpus": [t.gpus[0].model_copy(update={"energy_j": energy})]})
        join.add_tick(t)
    energies = [r["energy_j"] for r in join.close_until(T0 + 30 * S, LEDGER)]
    assert energies == [100.0 * 10, 600.0, 900.0]  # first: power x 10 s; then counter deltas


# --------------------------------------------------------------------------- late, duplicate, out of order
# The rules of docs/reliability.md, "Late, duplicate and out-of-order data", one test each.
from gpuledger.streams.topic_names import TopicNames  # noqa: E402
from gpuledger.schemas.models import DeadLetter, LifecycleWatermark, UsageBatch  # noqa: E402
from gpuledger.schemas.wire import decode, encode  # noqa: E402
from gpuledger.streams.core import WorkerCore  # noqa: E402
from gpuledger.streams.join import check_event, check_tick  # noqa: E402

TOPICS = TopicNames.with_prefix("t.")


def core():
    return WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER, retention_ms=600 * S)


class Feed:
    """One-partition worker core with offsets handed out in arrival order."""

    def __init__(self):
        self.core = core()
        self.offsets = {TOPICS.job_events: 0, TOPICS.gpu_samples: 0, TOPICS.node_allocations: 0}
        self.out = []

    def _take(self, topic):
        o = self.offsets[topic]
        self.offsets[topic] += 1
        return o

    def event(self, e):
        for out in self.core.on_lifecycle(0, self._take(TOPICS.job_events), encode(e)):
            if out.topic == TOPICS.node_allocations:
                self.node(TOPICS.node_allocations, out.value)
            else:
                self.out.append(out)

    def mark(self, at_s):
        self.event(LifecycleWatermark(cluster="c", ts_ms=T0 + at_s * S))

    def tick(self, t):
        self.node(TOPICS.gpu_samples, encode(t))

    def node(self, topic, raw):
        self.out.extend(self.core.on_node(topic, 0, self._take(topic), raw))

    def records(self):
        return [r.model_dump(mode="json") for o in self.out if o.topic == TOPICS.usage
                for r in decode(UsageBatch, o.value).records]

    def letters(self, topic):
        return [decode(DeadLetter, o.value) for o in self.out if o.topic == topic]


def one_node(kind, at_s, n, job="j1"):
    gpus = [GpuAssignment(node="n1", gpu_uuid="A")] if kind == "allocated" else []
    return event(kind, at_s, n, job=job, gpus=gpus)


def test_samples_before_their_allocation_event_wait_for_the_watermark():
    f = Feed()
    for k in range(6):
        f.tick(tick(k))  # every sample first
    assert f.records() == []  # nothing closes without a watermark
    for e in [one_node("allocated", 10, 1), one_node("started", 25, 2), one_node("completed", 50, 3)]:
        f.event(e)
    f.mark(60)
    assert summarise(f.records()) == {("unallocated", ""): 20_000, ("allocated_idle", "j1"): 15_000,
                                      ("executing", "j1"): 25_000}


def test_events_minutes_late_but_before_the_watermark_are_exact():
    f = Feed()
    f.event(one_node("allocated", 10, 1))
    for k in range(30):
        f.tick(tick(k))
    f.mark(5)  # the adapter holds its watermark back while events are late
    f.event(one_node("started", 25, 2))  # arrives minutes after the samples of its time
    f.event(one_node("completed", 250, 3))
    f.mark(300)
    got = summarise(f.records())
    assert got == {("unallocated", ""): 10_000 + 50_000, ("allocated_idle", "j1"): 15_000, ("executing", "j1"): 225_000}
    assert f.letters(TOPICS.late_events) == []


def test_event_behind_the_closed_horizon_applies_from_the_next_tick_and_is_reported():
    f = Feed()
    f.event(one_node("allocated", 10, 1))
    for k in range(6):
        f.tick(tick(k))
    f.mark(40)  # promise: nothing before 40 s is missing ...
    f.event(one_node("completed", 25, 3))  # ... broken: completed at 25 s arrives now
    f.mark(60)
    got = summarise(f.records())
    # [10, 40) stays allocated (already closed); completed takes effect at 40 s, the next open tick
    assert got == {("unallocated", ""): 10_000 + 20_000, ("allocated_idle", "j1"): 30_000}
    assert sum(r["gpu_ms"] for r in f.records()) == 60_000  # conservation holds
    (late,) = f.letters(TOPICS.late_events)
    assert "late allocation change" in late.reason and "15000 ms behind" in late.reason
    assert f.core.counters["late_events"] == 1


def test_event_beyond_the_retention_is_rejected():
    f = Feed()
    for k in range(90):  # 900 s of ticks, retention 600 s
        f.tick(tick(k))
    f.mark(900)
    f.event(one_node("allocated", 100, 1))
    (dead,) = f.letters(TOPICS.dead_letters)
    assert dead.reason.startswith("too late")


def test_duplicated_events_and_ticks_count_once_even_after_closing():
    f = Feed()
    events = [one_node("allocated", 10, 1), one_node("started", 25, 2), one_node("completed", 50, 3)]
    for e in events:
        f.event(e)
    for k in range(6):
        f.tick(tick(k))
    f.mark(60)
    for e in events:  # redelivered by the adapter
        f.event(e)
    for k in range(6):  # redelivered by an agent
        f.tick(tick(k))
    f.mark(70)
    # re-emitted allocation changes (as after a router restart) reach the join again
    router = LifecycleRouter()
    for e in events:
        for c in router.route(e):
            f.node(TOPICS.node_allocations, encode(c))
    f.tick(tick(6))
    f.mark(80)
    assert summarise(f.records()) == {("unallocated", ""): 20_000 + 10_000, ("allocated_idle", "j1"): 15_000,
                                      ("executing", "j1"): 25_000}
    assert f.letters(TOPICS.dead_letters) == [] and f.letters(TOPICS.late_events) == []
    assert f.core.counters["duplicate_ticks"] == 6 and f.core.counters["duplicate_events"] == 3
    assert f.core.counters["duplicate_changes"] == 3


def test_node_clock_skew_shifts_boundaries_within_the_tick_and_conserves_time():
    """Ticks are stamped by the node's clock, lifecycle events by the scheduler's. A node clock
    3.2 s ahead moves each change 3.2 s within the node's ticks; no GPU-time is lost or doubled."""
    for skew_ms in (-3200, 0, 3200):
        f = Feed()
        for e in [one_node("allocated", 10, 1), one_node("started", 25, 2), one_node("completed", 50, 3)]:
            f.event(e)
        for k in range(6):
            t = tick(k)
            f.tick(t.model_copy(update={"ts_ms": t.ts_ms + skew_ms}))
        f.mark(70)
        records = f.records()
        assert sum(r["gpu_ms"] for r in records) == 60_000  # six 10 s ticks, whatever the skew
        got = summarise(records)
        assert got[("allocated_idle", "j1")] == 15_000 and got[("executing", "j1")] == 25_000
        starts = sorted({r["start_ms"] for r in records})
        assert all(s_ - T0 - skew_ms in (0, 10_000, 20_000, 30_000, 40_000, 50_000) or (s_ - T0) in (10_000, 25_000, 50_000)
                   for s_ in starts)


def test_absurd_timestamps_are_dead_letters_with_reasons():
    f = Feed()
    f.mark(0)
    f.tick(tick(0).model_copy(update={"ts_ms": 631_152_000_000}))  # 1990
    f.mark(60)
    f.tick(tick(0).model_copy(update={"ts_ms": T0 + 3 * 365 * 86_400_000}))  # three years ahead
    reasons = [d.reason for d in f.letters(TOPICS.dead_letters)]
    assert len(reasons) == 2 and "before 2000" in reasons[0] and "days ahead" in reasons[1]
    assert check_event(event("started", 0, 9).model_copy(update={"ts_ms": 5}), 0).startswith("absurd timestamp")
    assert check_tick(tick(0), T0) is None


def test_utilization_over_100_and_negative_durations_are_schema_violations():
    from gpuledger.schemas.wire import DecodeError
    import pytest as _pytest

    raw = tick(0).model_dump(mode="json")
    for bad in ({**raw, "interval_ms": -5000}, {**raw, "gpus": [{**raw["gpus"][0], "util_gpu_pct": 101.0}]},
                {**raw, "gpus": [{**raw["gpus"][0], "sm_active_pct": -1.0}]}):
        with _pytest.raises(DecodeError, match="schema violation"):
            decode(NodeTick, __import__("orjson").dumps(bad))


def test_an_open_segment_of_a_huge_memory_reading_still_snapshots():
    """A GPU reporting 16 TiB used (a bogus reading the input checks let through: no total to compare it
    with), 10-s ticks, 1-hour segments: after 18 minutes the segment's memory x time sum passed 64 bits
    and every snapshot of the worker failed ("Integer exceeds 64-bit range"). The records stay those of
    an uninterrupted run."""
    ledger = parse_ledger_config({**tomllib.loads(UNIT_LEDGER.read_text()), "segments": {"window_s": 3600}}, "hour")
    ticks = [NodeTick(cluster="c", node="n1", ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                      gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=100.0, util_gpu_pct=5.0,
                                      mem_used_bytes=1 << 44)]) for k in range(120)]

    def run(restore: bool):
        join = NodeJoin(node="n1")
        for t in ticks:
            join.add_tick(t)
        records = join.close_until(T0 + 1200 * S, ledger)
        if restore:
            join = NodeJoin.from_state(orjson.loads(orjson.dumps(join.to_state())))
        return records + join.close_until(T0 + 3 * 3600 * S, ledger)

    assert run(restore=True) == run(restore=False)
    (record,) = run(restore=False)
    assert (record["gpu_ms"], record["mem_used_bytes"]) == (1_200_000, 1 << 44)


def test_a_segments_mean_memory_stays_within_what_each_sample_said():
    """Two 10-s ticks of a GPU reporting 2**63 - 1 bytes used (accepted, and storable in a per-tick
    record): the segment's mean, a float division, came out as 2**63, which usage_raw cannot store (the
    sink refuses the record)."""
    ledger = parse_ledger_config({**tomllib.loads(UNIT_LEDGER.read_text()), "segments": {"window_s": 60}}, "minute")
    join = NodeJoin(node="n1")
    for k in range(2):
        join.add_tick(NodeTick(cluster="c", node="n1", ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                               gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=100.0,
                                               mem_used_bytes=2**63 - 1)]))
    (record,) = join.close_until(T0 + 3600 * S, ledger)
    assert (record["sample_count"], record["mem_used_bytes"]) == (2, 2**63 - 1)
