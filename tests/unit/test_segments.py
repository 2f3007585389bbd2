"""Segments, not ticks (docs/accounting.md, "Segments"): the node join adds consecutive ticks up into
one usage record per GPU, holder and state, cut at changes and at the aligned window. Bills from
segments equal bills from per-tick records (window 0) on random input; a GPU's segments tile its
time; open segments survive snapshots and crashes; a node that stops reporting is flushed by its
partition's samples clock."""

from __future__ import annotations

import random
import tomllib
from collections import Counter, defaultdict
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from unittest.mock import patch

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuledger.schemas.models import (
    AllocationChange,
    DeadLetter,
    GpuAssignment,
    GpuSample,
    NodeTick,
    NodeWatermark,
    ProcessSample,
    UsageBatch,
    UsageRecord,
)
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.segments import Segment
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults
DOC = tomllib.loads(UNIT_LEDGER.read_text())
PER_TICK = parse_ledger_config(DOC, str(UNIT_LEDGER))
S = 1000
MIN = 60 * S
DAY = 86_400 * S
MIDNIGHT = 1_793_577_600_000  # 2026-11-02T00:00:00Z


def windowed(window_s: int, flush_after_s: float = 60) -> object:
    return parse_ledger_config({**DOC, "segments": {"window_s": window_s, "flush_after_s": flush_after_s}},
                               "segments-test")


def sample(uuid="GPU-a", index=0, model="A100-80GB", **kw):
    return GpuSample(gpu_uuid=uuid, index=index, model=model, power_w=kw.pop("power_w", 200.0), **kw)


def node_tick(ts, interval, *gpus, node="n1"):
    return NodeTick(cluster="c", node=node, ts_ms=ts, interval_ms=interval, gpus=list(gpus) or [sample()])


def change(kind, ts, job, share=1000, uuid="GPU-a", container=None, attempt=0):
    return AllocationChange(ts_ms=ts, event_id=f"{job}/{attempt}/{kind}/{ts}", kind=kind, node="n1", job_id=job,
                            attempt=attempt, tenant=f"t-{job}", queue="q",
                            gpus=[GpuAssignment(node="n1", gpu_uuid=uuid, share_milli=share, container_id=container)])


def run_join(ticks, changes, ledger, closes=(), restore_at=None):
    """Feed a node join, close at the given watermarks and at the end (far enough to flush);
    optionally snapshot and restore (through JSON, as the worker does) after close number restore_at."""
    join = NodeJoin(node="n1")
    for c in changes:
        join.add_change(c)
    for t in ticks:
        assert join.add_tick(t).status == "accepted"
    end = max(t.ts_ms + t.interval_ms for t in ticks)
    records = []
    for i, mark in enumerate([*sorted(closes), end + DAY]):
        records += join.close_until(mark, ledger)
        if restore_at == i:
            join = NodeJoin.from_state(orjson.loads(orjson.dumps(join.to_state())))
    assert not join.segments
    return records


def bills(records):
    """What the bills and dashboards read: per UTC day of the record's start, GPU, state, job and
    tenant: GPU-ms, effective GPU-ms and cost (exact), energy and util x gpu_ms (to rounding)."""
    exact, approx = defaultdict(lambda: [0, 0, 0]), defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        UsageRecord.model_validate(r)  # every record is a valid wire record
        key = (r["start_ms"] // DAY, r["gpu_uuid"], r["state"], r["job_id"], r["attempt"], r["tenant"])
        e = exact[key]
        e[0] += r["gpu_ms"]
        e[1] += r["effective_gpu_ms"]
        e[2] += r["cost_micros"]
        a = approx[key]
        a[0] += r["energy_j"]
        if r.get("util_metric_pct") is not None:
            a[1] += r["util_metric_pct"] * r["gpu_ms"]
            a[2] += r["gpu_ms"]
    return dict(exact), dict(approx)


def assert_tiles(records):
    """A GPU's records: every segment's slots share start and end and their gpu_ms add up to its
    duration; segments do not overlap; record ids are unique."""
    assert len({r["record_id"] for r in records}) == len(records)
    by_gpu = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_gpu[r["gpu_uuid"]][r["start_ms"]].append(r)
    for segments in by_gpu.values():
        previous_end = None
        for start in sorted(segments):
            slots = segments[start]
            assert len({r["end_ms"] for r in slots}) == 1
            assert sum(r["gpu_ms"] for r in slots) == slots[0]["end_ms"] - start
            assert [int(r["record_id"].rsplit("/", 1)[1]) for r in slots] == list(range(len(slots)))
            assert previous_end is None or previous_end <= start
            previous_end = slots[0]["end_ms"]


# --------------------------------------------------------------------------- random input
@st.composite
def scenarios(draw):
    interval = draw(st.sampled_from([1 * S, 5 * S, 10 * S, 7 * S]))
    n = draw(st.integers(1, 60))
    # around a midnight: day buckets must split exactly as per-tick records split them
    first = MIDNIGHT - draw(st.integers(0, 40)) * interval + draw(st.sampled_from([0, 0, 0, 300]))
    missing = draw(st.sets(st.integers(0, n - 1), max_size=n // 4))      # the node skips these ticks
    b_missing = draw(st.sets(st.integers(0, n - 1), max_size=n // 4))    # GPU-b absent from these
    ticks, energy = [], 1e6
    for k in range(n):
        if k in missing:
            continue
        utils = draw(st.lists(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 30.0, 80.0, 100.0])), min_size=2,
                              max_size=2))
        energy += draw(st.sampled_from([0.0, 1000.0, 2000.0, -5.0]))
        procs = draw(st.sampled_from([(), (("c1", 40.0),), (("c1", 10.0), ("c2", 60.0)), (("c3", 5.0),)]))
        a = sample("GPU-a", 0, util_gpu_pct=utils[0], energy_j=max(0.0, energy),
                   health=draw(st.sampled_from(["ok", "ok", "ok", "down"])),
                   mem_used_bytes=draw(st.sampled_from([None, 1 << 30, 3 << 30])), mem_total_bytes=80 << 30,
                   processes=[ProcessSample(pid=100 + i, container_id=c, sm_util_pct=u, mem_used_bytes=1 << 29)
                              for i, (c, u) in enumerate(procs)])
        gpus = [a]
        if k not in b_missing:
            gpus.append(sample("GPU-b", 1, "T4", util_gpu_pct=utils[1], power_w=60.0))
        ticks.append(node_tick(first + k * interval, interval, *gpus))
    end = first + n * interval
    changes = []
    for i in range(draw(st.integers(0, 6))):
        job, uuid = f"j{i % 3}", draw(st.sampled_from(["GPU-a", "GPU-b"]))
        t0 = draw(st.integers(first - interval, end))
        share = draw(st.sampled_from([1000, 500, 300]))
        container = draw(st.sampled_from([None, "c1", "c2"]))
        changes.append(change("allocated", t0, job, share, uuid, container, attempt=i))
        t1 = t0 + draw(st.integers(0, 40 * interval))
        changes.append(change("started", t1, job, share, uuid, container, attempt=i))
        if draw(st.booleans()):
            changes.append(change(draw(st.sampled_from(["completed", "failed"])),
                                  t1 + draw(st.integers(1, 30 * interval)), job, share, uuid, container, attempt=i))
    closes = draw(st.lists(st.integers(first, end + interval), max_size=4))
    return ticks, changes, closes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([60, 10, 3600]), st.sampled_from(["measured", "allocation"]),
       st.sampled_from(["both", "events"]), st.integers(0, 4))
def test_bills_from_segments_equal_bills_from_per_tick_records(scenario, window_s, split, source, restore_at):
    ticks, changes, closes = scenario
    d = replace(PER_TICK.definitions, shared_split=split, execution_source=source, execution_min_idle_s=20.0)
    per_tick_ledger = replace(PER_TICK, definitions=d)
    segment_ledger = replace(windowed(window_s), definitions=d)
    per_tick = run_join(ticks, changes, per_tick_ledger, closes)
    segments = run_join(ticks, changes, segment_ledger, closes, restore_at=restore_at)
    assert all(r["sample_count"] == 1 for r in per_tick)
    assert_tiles(per_tick)
    assert_tiles(segments)
    exact_t, approx_t = bills(per_tick)
    exact_s, approx_s = bills(segments)
    assert exact_s == exact_t  # GPU-ms, effective GPU-ms and cost per day, GPU, state, job: to the unit
    assert approx_s.keys() == approx_t.keys()
    for key, (energy, util_w, util_ms) in approx_t.items():
        assert approx_s[key][0] == pytest.approx(energy, rel=1e-9, abs=1e-6)
        assert approx_s[key][1] == pytest.approx(util_w, rel=1e-9, abs=1e-6)
        assert approx_s[key][2] == util_ms  # the GPU time that has a utilization is the same
    # fewer (or as many) records, each no longer than a window plus the tick that crosses it
    assert len(segments) <= len(per_tick)
    longest = max(t.interval_ms for t in ticks)
    assert all(r["end_ms"] - r["start_ms"] < window_s * S + longest for r in segments)
    # a segment stays in the window it starts in, but for the tail of the tick that crosses its end
    w = window_s * S
    assert all(r["end_ms"] <= (r["start_ms"] // w + 1) * w + longest for r in segments)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([60, 10, 3600]), st.sampled_from(["measured", "allocation"]),
       st.sampled_from(["both", "events"]))
def test_the_hot_path_gives_the_records_of_the_general_path(scenario, window_s, split, source):
    """`Segment.extend` (a whole GPU continuing its segment: no pieces, no key built) adds exactly
    what `pieces`, `piece_key` and `add` would: the same records, field by field, floats included."""
    ticks, changes, closes = scenario
    d = replace(PER_TICK.definitions, shared_split=split, execution_source=source, execution_min_idle_s=20.0)
    ledger = replace(windowed(window_s), definitions=d)
    fast = run_join(ticks, changes, ledger, closes)
    with patch.object(Segment, "extend", lambda *args: False):
        general = run_join(ticks, changes, ledger, closes)
    assert fast == general


def test_a_steady_gpu_takes_the_hot_path():
    extended = []
    original = Segment.extend

    def spy(*args):
        extended.append(original(*args))
        return extended[-1]

    ticks = steady_ticks(10)
    with patch.object(Segment, "extend", spy):
        records = run_join(ticks, [], windowed(60))
    assert len(records) == 10
    assert extended.count(True) == len(ticks) - len(records)  # every tick but a window's first


# --------------------------------------------------------------------------- worked examples
def steady_ticks(minutes, interval=5 * S, start=MIDNIGHT, **kw):
    return [node_tick(start + k * interval, interval, sample(util_gpu_pct=kw.get("util", 50.0)))
            for k in range(minutes * MIN // interval)]


def test_one_record_a_minute_at_5_s_sampling_aligned_to_the_minute():
    records = run_join(steady_ticks(10), [], windowed(60))
    assert [(r["start_ms"] - MIDNIGHT, r["end_ms"] - MIDNIGHT) for r in records] == \
        [(k * MIN, (k + 1) * MIN) for k in range(10)]
    assert {r["sample_count"] for r in records} == {12}
    assert [r["record_id"] for r in records] == [f"GPU-a/{MIDNIGHT + k * MIN}/0" for k in range(10)]
    per_tick = run_join(steady_ticks(10), [], PER_TICK)
    assert len(per_tick) == 120
    assert sum(r["cost_micros"] for r in records) == sum(r["cost_micros"] for r in per_tick)


def test_a_segment_ends_at_a_holder_or_state_change_and_weights_utilization_by_time():
    ticks = [node_tick(MIDNIGHT + k * 10 * S, 10 * S, sample(util_gpu_pct=u))
             for k, u in enumerate([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])]
    changes = [change("allocated", MIDNIGHT + 25 * S, "j"), change("started", MIDNIGHT + 25 * S, "j")]
    records = run_join(ticks, changes, windowed(60))
    got = [(r["state"], r["start_ms"] - MIDNIGHT, r["end_ms"] - MIDNIGHT, r["sample_count"], r["util_pct"])
           for r in records]
    # [0,25) free: 10 s at 10 %, 10 s at 20 %, 5 s at 30 % -> 17 %; [25,60) executing: 5 s at 30 %, then 40-60 %
    assert got == [("unallocated", 0, 25 * S, 3, pytest.approx((10 * 10 + 10 * 20 + 5 * 30) / 25)),
                   ("executing", 25 * S, 60 * S, 4, pytest.approx((5 * 30 + 10 * 40 + 10 * 50 + 10 * 60) / 35))]


def test_a_gpu_missing_from_a_tick_closes_its_segment_and_the_next_opens_a_new_one():
    ticks = [node_tick(MIDNIGHT + k * 10 * S, 10 * S, sample(), *([sample("GPU-b", 1)] if k != 2 else []))
             for k in range(6)]
    b = [(r["start_ms"] - MIDNIGHT, r["end_ms"] - MIDNIGHT) for r in run_join(ticks, [], windowed(60))
         if r["gpu_uuid"] == "GPU-b"]
    assert b == [(0, 20 * S), (30 * S, 60 * S)]


def test_a_price_or_coefficient_change_ends_the_segment_and_prices_each_side_as_per_tick():
    # a new A100 price from 2026-11-02 and coefficient from 2026-11-03 (entries start on whole UTC days,
    # pricing.py): hour-long windows, a minute of ticks across each midnight
    doc = {**DOC, "segments": {"window_s": 3600},
           "prices": [*DOC["prices"], {"model": "A100-80GB", "valid_from": datetime(2026, 11, 2, tzinfo=timezone.utc),
                                       "depreciation_per_hour": 9.0, "maintenance_per_hour": 1.0}],
           "coefficients": [*DOC["coefficients"], {"model": "A100-80GB", "valid_from": "2026-11-03",
                                                   "coefficient": 3.0}]}
    ledger = parse_ledger_config(doc, "price-change")
    ticks = steady_ticks(1, start=MIDNIGHT - 30 * S) + steady_ticks(1, start=MIDNIGHT + DAY - 30 * S)
    segments = run_join(ticks, [], ledger)
    assert [(r["start_ms"] - MIDNIGHT, r["price_version"], r["coefficient_version"]) for r in segments] == [
        (-30 * S, "A100-80GB@2020-01-01", "A100-80GB@2020-01-01"),
        (0, "A100-80GB@2026-11-02", "A100-80GB@2020-01-01"),
        (DAY - 30 * S, "A100-80GB@2026-11-02", "A100-80GB@2020-01-01"),
        (DAY, "A100-80GB@2026-11-02", "A100-80GB@2026-11-03")]
    per_tick = run_join(ticks, [], replace(ledger, segment_window_ms=1))
    assert bills(segments)[0] == bills(per_tick)[0]


def test_a_gpu_whose_reported_model_changes_gets_it_on_its_next_records_as_a_fresh_worker_would():
    """Two models neither with a price of its own (both priced by `default`, one version): the record template
    was cached by GPU, price and coefficient version only, so the old model stayed on every later record (and
    its segment ran on), while a worker restarted after the change wrote the new one: a replay differed."""
    ticks = [node_tick(MIDNIGHT + k * 10 * S, 10 * S, sample(model="H999-OLD" if k < 3 else "H999-NEW"))
             for k in range(6)]
    records = run_join(ticks, [], windowed(60))
    assert [(r["start_ms"] - MIDNIGHT, r["end_ms"] - MIDNIGHT, r["gpu_model"]) for r in records] == [
        (0, 30 * S, "H999-OLD"), (30 * S, 60 * S, "H999-NEW")]
    fresh = run_join(ticks[3:], [], windowed(60))
    assert [r["gpu_model"] for r in fresh] == ["H999-NEW"] and fresh[0]["record_id"] == records[1]["record_id"]


def test_an_attempts_end_closes_its_segment_without_waiting_for_the_next_sample():
    # the node's samples end with the job (a trace replay, a node drained with its job): the
    # segment [0, 25 s) still goes out once the watermark has passed the completion
    join = NodeJoin(node="n1")
    for c in [change("allocated", MIDNIGHT, "j"), change("started", MIDNIGHT, "j"),
              change("completed", MIDNIGHT + 25 * S, "j")]:
        join.add_change(c)
    for k in range(5):
        join.add_tick(node_tick(MIDNIGHT + k * 5 * S, 5 * S, sample(util_gpu_pct=50.0)))
    assert join.close_until(MIDNIGHT + 24 * S, windowed(60)) == []  # the end is not final yet
    (record,) = join.close_until(MIDNIGHT + 25 * S, windowed(60))
    assert (record["state"], record["job_id"], record["end_ms"] - MIDNIGHT, record["sample_count"]) == \
        ("executing", "j", 25 * S, 5)
    assert not join.segments


def test_window_setting_is_checked():
    for bad in (7, -60, 7200, 1.5, "60"):
        with pytest.raises(LedgerConfigError, match="segments.window_s"):
            windowed(bad)
    with pytest.raises(LedgerConfigError, match="segments.flush_after_s"):
        windowed(60, -1)
    assert windowed(0).segment_window_ms == 1 and windowed(900).segment_window_ms == 900 * S
    # not a definition: the window changes how time is cut into records, not what it costs
    assert windowed(10).fingerprint == windowed(60).fingerprint == PER_TICK.fingerprint


# --------------------------------------------------------------------------- the worker core
from gpuledger.streams.core import JOIN, WorkerCore  # noqa: E402
from gpuledger.streams.topic_names import TopicNames  # noqa: E402

TOPICS = TopicNames.with_prefix("t.")


def usage_of(outs):
    return [r for o in outs if o.topic == TOPICS.usage for r in decode(UsageBatch, o.value).records]


def test_a_node_that_stops_is_flushed_by_the_samples_clock_and_its_late_ticks_rejected():
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=windowed(60, 30))
    offsets = Counter()

    def feed(topic, raw):
        outs = core.on_node(topic, 0, offsets[topic], raw)
        offsets[topic] += 1
        return outs

    feed(TOPICS.node_allocations, encode(NodeWatermark(ts_ms=MIDNIGHT + 10 * MIN, source_partition=0, source_partitions=1)))
    a_ticks = lambda k0, k1: [node_tick(MIDNIGHT + k * 10 * S, 10 * S, sample(), node="a") for k in range(k0, k1)]  # noqa: E731
    b_ticks = lambda k0, k1: [node_tick(MIDNIGHT + k * 10 * S, 10 * S, sample("GPU-b"), node="b")  # noqa: E731
                              for k in range(k0, k1)]
    out = usage_of(feed(TOPICS.gpu_samples, encode_node_ticks("b", b_ticks(0, 3))))  # b: [0, 30 s), then silent
    assert out == []  # its segment is open (window [0, 60 s))
    out = usage_of(feed(TOPICS.gpu_samples, encode_node_ticks("a", a_ticks(0, 9))))  # a's ticks start up to 80 s
    assert [(r.node, r.end_ms - MIDNIGHT) for r in out] == [("a", 60 * S)]
    # the samples clock is the latest tick *start*: 90 s = b's window end + 30 s
    out = usage_of(feed(TOPICS.gpu_samples, encode_node_ticks("a", a_ticks(9, 10))))
    assert [(r.node, r.start_ms - MIDNIGHT, r.end_ms - MIDNIGHT, r.sample_count) for r in out] == [("b", 0, 30 * S, 3)]
    assert core.joins[0].nodes[("c", "b")].closed_until_ms == MIDNIGHT + 60 * S
    # b comes back: a tick of the flushed window is late (its record is out); the next window is fine
    outs = feed(TOPICS.gpu_samples, encode_node_ticks("b", b_ticks(3, 7)))
    (letter,) = [decode(DeadLetter, o.value) for o in outs if o.topic == TOPICS.dead_letters]
    assert letter.reason.startswith("late tick: b ts_ms=") and "(3 of the batch's 4 ticks rejected" in letter.reason
    assert set(core.joins[0].nodes[("c", "b")].segments) == {"GPU-b"}  # [60, 70 s) is open


#: node -> (sampling interval, first tick, its job's start and end), seconds: like a trace's pods, the
#: 171-s node's ticks end far ahead of the others'
MIXED_NODES = {"b": (171, 57, 300, 2400), "a": (57, 0, 0, 1207), "c": (10, 3, 90, 1860)}


def mixed_interval_inputs(nodes=MIXED_NODES, until_s=2400):
    """One partition of nodes sampled at different intervals, a job on each, published in event-time
    order (at equal times in the order of `nodes`); and the allocation messages, with a watermark
    every 5 min. Returns (samples, allocations, GPU-ms of all ticks)."""
    ticks = sorted(((ts, k, node_tick(MIDNIGHT + ts * S, iv * S, sample(f"GPU-{name}"), node=name))
                    for k, (name, (iv, first, _, _)) in enumerate(nodes.items())
                    for ts in range(first, until_s, iv)), key=lambda t: t[:2])
    samples = [encode_node_ticks(t.node, [t]) for _, _, t in ticks]
    changes = []
    for name, (_, _, begin, end) in nodes.items():
        for kind, ts in (("allocated", begin), ("started", begin), ("completed", end)):
            changes.append((ts * S, AllocationChange(
                ts_ms=MIDNIGHT + ts * S, event_id=f"{name}/{kind}", kind=kind, node=name, job_id=f"job-{name}",
                tenant="t", queue="q", gpus=[GpuAssignment(node=name, gpu_uuid=f"GPU-{name}", share_milli=1000)])))
    allocations = []
    marks = iter(range(5 * MIN, until_s * S + 15 * MIN, 5 * MIN))
    mark = next(marks)
    for ts, c in sorted(changes, key=lambda c: c[0]):
        while ts >= mark:
            allocations.append(encode(NodeWatermark(ts_ms=MIDNIGHT + mark, source_partition=0, source_partitions=1)))
            mark = next(marks)
        allocations.append(encode(c))
    allocations += [encode(NodeWatermark(ts_ms=MIDNIGHT + m, source_partition=0, source_partitions=1))
                    for m in (mark, *marks)]
    return samples, allocations, sum(t.interval_ms for _, _, t in ticks)


def interleaved(samples, allocations, order: str):
    """The records (by id) and still-open segments of a core fed both topics of one partition, each in
    its own order, interleaved: "allocations first" (the watermark ahead: live), "samples first" (a
    catch-up) or "random <seed>"."""
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=windowed(60))
    rng = random.Random(order)
    i = j = 0
    outs = []
    while i < len(samples) or j < len(allocations):
        take_sample = j == len(allocations) or (i < len(samples) and (
            order == "samples first" or (order.startswith("random") and rng.random() < 0.5)))
        if take_sample:
            outs += core.on_node(TOPICS.gpu_samples, 0, i, samples[i])
            i += 1
        else:
            outs += core.on_node(TOPICS.node_allocations, 0, j, allocations[j])
            j += 1
    assert [o for o in outs if o.topic != TOPICS.usage] == []  # nothing late, nothing rejected
    still_open = {uuid: seg for join in core.joins[0].nodes.values() for uuid, seg in join.segments.items()}
    return sorted(usage_of(outs), key=lambda r: r.record_id), still_open  # no later sample flushes the last ones


def assert_order_free(samples, allocations, tick_ms, order):
    records, still_open = interleaved(samples, allocations, order)
    assert sum(r.gpu_ms for r in records) + sum(sl[3] for seg in still_open.values() for sl in seg.slots) == tick_ms
    assert (records, still_open) == interleaved(samples, allocations, "samples first")


@pytest.mark.parametrize("order", ["allocations first", "samples first", "random 1", "random 2", "random 3"])
def test_records_do_not_depend_on_how_samples_and_allocations_interleave(order):
    """Each input topic is read in its own order, but how the two interleave depends on timing: the
    watermark ahead of the samples (live), far behind them (a catch-up), or anything between. The
    records must be the same. (The samples clock used to count a tick's end: the 171-s node's tick
    then flushed its peers' windows before their ticks of the same time were read, and those were
    rejected as late.)"""
    assert_order_free(*mixed_interval_inputs(), order)


@st.composite
def mixed_nodes(draw):
    nodes = {}
    for name in "abcd"[:draw(st.integers(2, 4))]:
        interval = draw(st.sampled_from([1, 5, 10, 57, 114, 171, 300]))
        begin = draw(st.integers(0, 1800))
        nodes[name] = (interval, draw(st.integers(0, interval)), begin, draw(st.integers(begin + 1, 2400)))
    return nodes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=mixed_nodes(), order=st.sampled_from(["allocations first", "random 1", "random 2"]))
def test_records_do_not_depend_on_the_interleaving_for_any_sampling_intervals(nodes, order):
    assert_order_free(*mixed_interval_inputs(nodes, until_s=2400), order)


def test_open_segments_are_part_of_the_snapshot():
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=windowed(60))
    core.on_node(TOPICS.node_allocations, 0, 0,
                 encode(NodeWatermark(ts_ms=MIDNIGHT + 10 * MIN, source_partition=0, source_partitions=1)))
    ticks = steady_ticks(2)
    assert usage_of(core.on_node(TOPICS.gpu_samples, 0, 0, encode_node_ticks("n1", ticks[:18]))) != []
    blob = core.snapshot(JOIN, 0)
    twin = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=windowed(60))
    twin.restore(JOIN, 0, blob)
    assert twin.snapshot(JOIN, 0) == blob and twin.joins[0] == core.joins[0]
    rest = encode_node_ticks("n1", ticks[18:])
    assert usage_of(twin.on_node(TOPICS.gpu_samples, 0, 1, rest)) == usage_of(core.on_node(TOPICS.gpu_samples, 0, 1, rest))


def _redefined(pue: float = 3.0):
    """The unit ledger under a new definition (PUE changed, definition_version bumped), 60-s windows."""
    return parse_ledger_config({**DOC, "definition_version": "unit-2", "power": {**DOC["power"], "pue": pue},
                                "segments": {"window_s": 60, "flush_after_s": 60}}, "unit-2")


def _tick_cost(ledger, interval=5 * S, power_w=200.0):
    return ledger.interval_cost_micros("A100-80GB", interval, power_w * interval / 1000, MIDNIGHT)


def test_a_segment_restored_under_another_definition_takes_in_no_sample_of_the_new_one():
    # the documented change: bump definition_version, restart the worker. The open segment of the
    # minute comes back from the snapshot under unit-1; the samples after the restart are priced under
    # unit-2 and start a segment of their own (a record names one definition; the GPU's time still tiles)
    v1, v2 = windowed(60), _redefined()
    join = NodeJoin(node="n1")
    for t in steady_ticks(1):
        join.add_tick(t)
    assert join.close_until(MIDNIGHT + 30 * S, v1) == []
    join = NodeJoin.from_state(orjson.loads(orjson.dumps(join.to_state())))
    records = join.close_until(MIDNIGHT + DAY, v2)
    assert [(r["record_id"], r["end_ms"] - MIDNIGHT, r["definition_version"], r["cost_micros"], r["sample_count"])
            for r in records] == [
        (f"GPU-a/{MIDNIGHT}/0", 30 * S, "unit-1", 6 * _tick_cost(v1), 6),
        (f"GPU-a/{MIDNIGHT + 30 * S}/0", 60 * S, "unit-2", 6 * _tick_cost(v2), 6)]
    assert_tiles(records)


def test_a_worker_restarted_under_a_new_definition_keeps_the_versions_apart():
    v1, v2 = windowed(60), _redefined()
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=v1)
    ticks = steady_ticks(2)
    out = usage_of(core.on_node(TOPICS.gpu_samples, 0, 0, encode_node_ticks("n1", ticks[:6])))
    out += usage_of(core.on_node(TOPICS.node_allocations, 0, 0, encode(NodeWatermark(
        ts_ms=MIDNIGHT + 30 * S, source_partition=0, source_partitions=1))))
    assert out == []
    blob = core.snapshot(JOIN, 0)
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=v2)
    core.restore(JOIN, 0, blob)
    out += usage_of(core.on_node(TOPICS.gpu_samples, 0, 1, encode_node_ticks("n1", ticks[6:])))
    out += usage_of(core.on_node(TOPICS.node_allocations, 0, 1, encode(NodeWatermark(
        ts_ms=MIDNIGHT + 2 * MIN, source_partition=0, source_partitions=1))))
    records = [r.model_dump(mode="json") for r in out]
    assert [(r["start_ms"] - MIDNIGHT, r["end_ms"] - MIDNIGHT, r["definition_version"], r["cost_micros"])
            for r in records] == [
        (0, 30 * S, "unit-1", 6 * _tick_cost(v1)),
        (30 * S, 60 * S, "unit-2", 6 * _tick_cost(v2)),
        (60 * S, 120 * S, "unit-2", 12 * _tick_cost(v2))]
    assert_tiles(records)


# --------------------------------------------------------------------------- crashes, with segments
# tests/unit/test_worker_recovery.py drives the worker core through random crashes with one record per
# tick; the same harness here with 60-s segments (the simulator samples every 10 s).
import test_worker_recovery as recovery  # noqa: E402  (pytest puts tests/unit on the path)


class SegmentCluster(recovery.Cluster):
    @staticmethod
    def new_core(defer_watermarks: bool = False):
        return WorkerCore(recovery.TOPICS, partitions_gpu_samples=recovery.P_SAMPLES,
                          partitions_job_events=recovery.P_EVENTS, ledger=windowed(60),
                          defer_watermarks=defer_watermarks)


@pytest.fixture(scope="module")
def sim_inputs():
    return recovery.lay_out(recovery.simulate(recovery.SPEC))


@pytest.mark.parametrize("seed", [1, 2])
def test_crashes_at_random_points_give_the_same_segments(sim_inputs, seed):
    reference = SegmentCluster(*sim_inputs)
    reference.run(random.Random(100))
    expected = recovery.sink_records(reference.usage)
    per_tick = recovery.Cluster(*sim_inputs)
    per_tick.run(random.Random(100))
    ticks = recovery.sink_records(per_tick.usage)
    assert expected and not reference.dead
    assert len(expected) * 5 < len(ticks)  # 10-s samples: about 6 per record
    # the same GPU time and money in far fewer rows
    assert sum(r["cost_micros"] for r in expected.values()) == sum(r["cost_micros"] for r in ticks.values())
    assert sum(r["gpu_ms"] for r in expected.values()) == sum(r["gpu_ms"] for r in ticks.values())

    chaotic = SegmentCluster(*sim_inputs)
    chaotic.run(random.Random(seed), crash_every=100)
    assert chaotic.crashes >= 3
    assert recovery.sink_records(chaotic.usage) == expected
    assert not chaotic.dead
