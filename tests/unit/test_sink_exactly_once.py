"""The sink's exactly-once effect without Kafka or ClickHouse: BatchingSink over a fake warehouse
that deduplicates blocks by token (as ClickHouse does with insert_deduplication_token), crashed at
every possible point and restarted from its progress store and the last committed offsets.

Why one file: every test here runs on the same crash harness (FakeWarehouse, CrashingProgress, the
re-emitting streams, a sink crashed with a pending range)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import MemoryProgress
from gpuledger.sink.rows import Source

USAGE = "p.usage"
EVENTS = "p.job-events"


class Crash(BaseException):
    """The process dies here (not an Exception: nothing in the sink may catch it)."""


class FakeWarehouse:
    """Tables of rows; a block whose token was seen is dropped. `crash_at` = (call number, before|after)."""

    def __init__(self):
        self.tables: dict[str, list[dict]] = {}
        self.tokens: set[str] = set()
        self.calls = 0
        self.crash_at: tuple[int, str] | None = None
        self.fail_next = 0

    def write(self, table, rows, token=None):
        self.calls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("warehouse down")
        if self.crash_at == (self.calls, "before"):
            raise Crash()
        if token not in self.tokens:
            self.tokens.add(token)
            self.tables.setdefault(table, []).extend(rows)
        if self.crash_at == (self.calls, "after"):
            raise Crash()


class CrashingProgress(MemoryProgress):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.crash_at: int | None = None

    def save(self, rows):
        self.calls += 1
        if self.crash_at == self.calls:
            raise Crash()
        super().save(rows)


def usage_message(gpu: str, ticks: list[int]) -> dict:
    """One worker message: whole 10 s ticks of one GPU, each split into two shares."""
    rows = []
    for k in ticks:
        start = 10_000 * k
        for slot, share in enumerate((600, 400)):
            rows.append({"record_id": f"{gpu}/{start}/{slot}", "gpu_uuid": gpu, "start_ms": start,
                         "end_ms": start + 10_000, "gpu_ms": 10 * share})
    return {"usage_raw": rows}


def stream_with_reemissions(seed: int) -> list[tuple[int, dict]]:
    """Usage messages for 2 partitions (GPU a on 0, b on 1); after some messages the 'worker' crashes
    and re-emits the last ticks again at new offsets, batched differently."""
    rng = random.Random(seed)
    out = []
    for part, gpu in ((0, "a"), (1, "b")):
        k = 0
        while k < 30:
            n = rng.randint(1, 4)
            out.append((part, usage_message(gpu, list(range(k, k + n)))))
            if rng.random() < 0.25 and k > 2:  # re-emission of up to 5 earlier ticks plus new ones
                back = rng.randint(1, min(5, k))
                out.append((part, usage_message(gpu, list(range(k + n - back, k + n + 1)))))
                k += 1
            k += n
    # interleave the partitions at random, keeping each partition's order
    queues = {p: [m for m in out if m[0] == p] for p in (0, 1)}
    mixed = []
    while any(queues.values()):
        p = rng.choice([p for p, q in queues.items() if q])
        mixed.append(queues[p].pop(0))
    return mixed


def offsets_of(messages):
    counters: dict[int, int] = {}
    result = []
    for part, rows in messages:
        off = counters.get(part, 0)
        counters[part] = off + 1
        result.append((Source(USAGE, part, off), rows))
    return result


def expected_rows(messages) -> list[tuple]:
    seen = {}
    for _, rows in messages:
        for r in rows["usage_raw"]:
            seen[r["record_id"]] = r
    return sorted(seen)


def reinterleave(sourced, rng):
    """The same messages in another order of partitions (a restarted consumer's fetches come back in
    any order), each partition's own order kept."""
    queues: dict[tuple[str, int], list] = {}
    for source, rows in sourced:
        queues.setdefault((source.topic, source.partition), []).append((source, rows))
    mixed = []
    while any(queues.values()):
        key = rng.choice(sorted(k for k, q in queues.items() if q))
        mixed.append(queues[key].pop(0))
    return mixed


def run(messages, warehouse, progress, *, interleave_seed=0, batch_rows=7, timer_every=None, crash=None) -> None:
    """Feed all messages (from the committed offsets on), restarting after every crash; after each
    restart the partitions come interleaved anew (from `interleave_seed`). `timer_every`: flush after
    that many messages whatever is buffered, as the batch interval's timer does."""
    committed: dict[tuple[str, int], int] = {}
    sourced = offsets_of(messages)
    rng = random.Random(interleave_seed)
    for attempt in range(200):
        sink = BatchingSink(warehouse, progress, batch_rows=batch_rows, usage_topic=USAGE, sleep=lambda s: None)
        sink.assign([(USAGE, 0), (USAGE, 1)])
        try:
            for n, (source, rows) in enumerate(sourced if attempt == 0 else reinterleave(sourced, rng), 1):
                if source.offset < committed.get((source.topic, source.partition), 0):
                    continue  # the consumer starts at the committed offset
                sink.add(rows, source)
                if sink.buffered >= batch_rows or (timer_every and n % timer_every == 0):
                    committed.update(sink.flush()[1])
            committed.update(sink.flush()[1])
            return
        except Crash:
            warehouse.crash_at = None
            progress.crash_at = None
            if crash:
                crash()
    raise AssertionError("never finished")


def records(warehouse) -> list[str]:
    return sorted(r["record_id"] for r in warehouse.tables.get("usage_raw", []))


def test_reemitted_records_are_dropped_before_the_insert():
    messages = stream_with_reemissions(1)
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    run(messages, warehouse, progress)
    assert records(warehouse) == expected_rows(messages)  # each record exactly once
    # shares of one tick (same start) are all kept: the horizon check is per message
    assert sum(1 for r in warehouse.tables["usage_raw"] if r["start_ms"] == 0) == 4


@pytest.mark.parametrize("timer_every", [None, 3])
@pytest.mark.parametrize("when", ["before", "after"])
def test_crash_at_any_insert_counts_every_record_once(when, timer_every):
    messages = stream_with_reemissions(2)
    reference = FakeWarehouse()
    run(messages, reference, MemoryProgress(), timer_every=timer_every)
    total_calls = reference.calls
    for interleave_seed in range(3):
        for n in range(1, total_calls + 1):
            warehouse, progress = FakeWarehouse(), MemoryProgress()
            warehouse.crash_at = (n, when)
            run(messages, warehouse, progress, interleave_seed=interleave_seed, timer_every=timer_every)
            assert records(warehouse) == records(reference), f"crash {when} insert #{n}, interleaving {interleave_seed}"


@pytest.mark.parametrize("timer_every", [None, 3])
def test_crash_while_recording_progress_counts_every_record_once(timer_every):
    messages = stream_with_reemissions(3)
    reference = FakeWarehouse()
    probe = CrashingProgress()
    run(messages, reference, probe, timer_every=timer_every)
    for interleave_seed in range(3):
        for n in range(1, probe.calls + 1):
            warehouse, progress = FakeWarehouse(), CrashingProgress()
            progress.crash_at = n
            run(messages, warehouse, progress, interleave_seed=interleave_seed, timer_every=timer_every)
            assert records(warehouse) == records(reference), f"crash at progress write #{n}, interleaving {interleave_seed}"


def test_an_unavailable_warehouse_is_retried_until_it_is_back():
    messages = stream_with_reemissions(4)
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    warehouse.fail_next = 25  # 25 failed attempts in a row
    sleeps = []
    sink = BatchingSink(warehouse, progress, usage_topic=USAGE, sleep=sleeps.append, backoff_s=0.5, backoff_max_s=30)
    sink.assign([(USAGE, 0), (USAGE, 1)])
    for source, rows in offsets_of(messages):
        sink.add(rows, source)
    written, offsets = sink.flush()
    assert records(warehouse) == expected_rows(messages)
    assert len(sleeps) == 25 and max(sleeps) == 30 and sleeps[:3] == [0.5, 1.0, 2.0]
    assert offsets == {(USAGE, 0): sum(1 for p, _ in messages if p == 0), (USAGE, 1): sum(1 for p, _ in messages if p == 1)}


def test_redelivered_messages_are_skipped_after_a_restart():
    messages = stream_with_reemissions(5)
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    run(messages, warehouse, progress)
    before = records(warehouse)
    # nothing committed in Kafka (e.g. every commit failed): everything comes again
    sink = BatchingSink(warehouse, progress, usage_topic=USAGE)
    sink.assign([(USAGE, 0), (USAGE, 1)])
    assert not any(sink.add(rows, source) for source, rows in offsets_of(messages))
    assert sink.flush()[0] == {}
    assert records(warehouse) == before


def test_other_lines_are_written_once_per_offset_range():
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    events = [(Source(EVENTS, 0, i), {"job_events": [{"event_id": f"e{i}"}]}) for i in range(10)]
    for crash_call in range(1, 8):
        warehouse, progress = FakeWarehouse(), MemoryProgress()
        warehouse.crash_at = (crash_call, "after")
        committed = 0
        for _ in range(20):
            sink = BatchingSink(warehouse, progress, batch_rows=3, usage_topic=USAGE)
            sink.assign([(EVENTS, 0)])
            try:
                for source, rows in events[committed:]:
                    sink.add(rows, source)
                    if sink.buffered >= 3:
                        committed = sink.flush()[1].get((EVENTS, 0), committed)
                sink.flush()
                break
            except Crash:
                warehouse.crash_at = None
        assert sorted(r["event_id"] for r in warehouse.tables["job_events"]) == sorted(f"e{i}" for i in range(10))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), crash_call=st.integers(1, 40), when=st.sampled_from(["before", "after"]),
       batch_rows=st.integers(1, 30))
def test_property_any_crash_any_batching_same_records(seed, crash_call, when, batch_rows):
    messages = stream_with_reemissions(seed)
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    warehouse.crash_at = (crash_call, when)
    run(messages, warehouse, progress, batch_rows=batch_rows)
    assert records(warehouse) == expected_rows(messages)


def test_a_batch_of_ticks_gives_health_and_inventory_rows_for_each_tick():
    from gpuledger.schemas.models import GpuSample, NodeTick
    from gpuledger.schemas.wire import DecodeError, encode_node_ticks
    from gpuledger.sink.rows import SAMPLES
    from gpuledger.sink.rows import process_message

    ticks = [NodeTick(cluster="c", node="n", ts_ms=1_793_577_600_000 + 1000 * i, interval_ms=1000,
                      gpus=[GpuSample(gpu_uuid=f"G{g}", index=g, model="T4", temperature_c=40.0 + i) for g in range(2)])
             for i in range(3)]
    rows = process_message(SAMPLES, encode_node_ticks("n", ticks), Source("gpu-samples", 0, 9))
    assert [(r["ts_ms"], r["gpu_uuid"], r["temperature_c"]) for r in rows["gpu_health"]] == [
        (t.ts_ms, g.gpu_uuid, g.temperature_c) for t in ticks for g in t.gpus]
    assert [r["seen_ms"] for r in rows["node_inventory"]] == [t.ts_ms for t in ticks]
    # the health record checks every field: a tick the worker could meter may still be set aside here
    hot = ticks[0].model_copy(update={"gpus": [ticks[0].gpus[0].model_copy(update={"temperature_c": 999.0})]})
    with pytest.raises(DecodeError, match="temperature_c"):
        process_message(SAMPLES, encode_node_ticks("n", [hot]), Source("gpu-samples", 0, 10))


def test_offsets_whose_commit_failed_are_reported_again():
    """The chaos suite saw a sink whose commit failed while it was out of its group (the warehouse
    was down longer than max.poll.interval): with nothing new to read, it never committed again
    and showed a lag for ever. A failed commit, or a partition (re)assigned, is reported again."""
    messages = stream_with_reemissions(3)
    warehouse, progress = FakeWarehouse(), MemoryProgress()
    sink = BatchingSink(warehouse, progress, usage_topic=USAGE)
    sink.assign([(USAGE, 0), (USAGE, 1)])
    for source, rows in offsets_of(messages):
        sink.add(rows, source)
    _, offsets = sink.flush()
    assert offsets and sink.flush()[1] == {}  # reported once
    sink.commit_failed(offsets)
    assert sink.flush()[1] == offsets  # the commit failed: again
    sink.assign([(USAGE, 0)])  # rejoined the group: what it committed is not known
    assert sink.flush()[1] == {(USAGE, 0): offsets[(USAGE, 0)]}


def events_message(partition: int, offset: int) -> tuple[Source, dict]:
    return Source(EVENTS, partition, offset), {"job_events": [{"event_id": f"e{partition}-{offset}"}]}


def crashed_with_pending_range(progress, partitions, n: int) -> FakeWarehouse:
    """A sink that cut a block of messages [0, n) of each partition and died after its pending rows,
    before any insert."""
    warehouse = FakeWarehouse()
    warehouse.crash_at = (1, "before")
    sink = BatchingSink(warehouse, progress, batch_rows=10 * n)
    sink.assign(partitions)
    for p in partitions:
        for i in range(n):
            sink.add(*reversed(events_message(p[1], i)))
    with pytest.raises(Crash):
        sink.flush()
    warehouse.crash_at = None
    assert all(progress.load(partitions)[p].pending == (0, n) for p in partitions)
    return warehouse


def test_a_pending_range_is_not_written_in_part_when_other_partitions_fill_the_batch():
    """The reviewer's case: after the restart partition 0's pending range comes in two parts with all of
    partition 1 between them; the row-count flush partition 1 triggers must not write partition 0's
    first part under the whole range's token (the rest would be skipped as stored, and lost)."""
    progress = MemoryProgress()
    warehouse = crashed_with_pending_range(progress, [(EVENTS, 0)], 5)
    sink = BatchingSink(warehouse, progress, batch_rows=10)
    sink.assign([(EVENTS, 0), (EVENTS, 1)])
    committed = {}
    stream = [events_message(0, i) for i in range(2)] + [events_message(1, i) for i in range(35)] + \
             [events_message(0, i) for i in range(2, 5)]
    for source, rows in stream:
        assert sink.add(rows, source), f"{source} skipped as stored"
        if sink.buffered >= 10:
            committed.update(sink.flush()[1])
    committed.update(sink.flush()[1])
    assert sorted(r["event_id"] for r in warehouse.tables["job_events"]) == sorted(
        f"e0-{i}" for i in range(5)) + sorted(f"e1-{i}" for i in range(35))
    assert committed == {(EVENTS, 0): 5, (EVENTS, 1): 35}


def test_a_pending_range_read_again_in_two_polls_survives_the_timer():
    """One partition: a 600-message pending range comes back in polls of 500; the batch interval's
    timer fires between them. The first 500 stay buffered (not counted as due), the range is written
    whole when its last message arrives."""
    clock = [0.0]
    progress = MemoryProgress()
    warehouse = crashed_with_pending_range(progress, [(EVENTS, 0)], 600)
    sink = BatchingSink(warehouse, progress, batch_rows=100, clock=lambda: clock[0])
    sink.assign([(EVENTS, 0)])
    for source, rows in (events_message(0, i) for i in range(500)):
        sink.add(rows, source)
    clock[0] += 1.5
    # the held rows neither fill the batch nor start the timer: no flush loop spinning on them
    assert sink.buffered == 0 and not sink.due() and sink.rebuilding() == {(EVENTS, 0): (500, 600)}
    assert sink.flush() == ({}, {})  # a flush anyway (the timer, a stop) leaves the range pending
    assert "job_events" not in warehouse.tables and progress.load([(EVENTS, 0)])[(EVENTS, 0)].pending == (0, 600)
    for source, rows in (events_message(0, i) for i in range(500, 600)):
        sink.add(rows, source)
    assert len(warehouse.tables["job_events"]) == 600 and sink.rebuilding() == {}
    assert warehouse.tokens == {f"{EVENTS}/0/e0/0-600/job_events"}
    assert sink.flush()[1] == {(EVENTS, 0): 600}


def test_a_later_offset_proves_the_rest_of_a_pending_range_a_gap():
    progress = MemoryProgress()
    warehouse = crashed_with_pending_range(progress, [(EVENTS, 0)], 5)
    sink = BatchingSink(warehouse, progress, batch_rows=100)
    sink.assign([(EVENTS, 0)])
    for i in (0, 1, 2, 7):  # offsets 3-6 are gone (never delivered again)
        sink.add(*reversed(events_message(0, i)))
    assert f"{EVENTS}/0/e0/0-5/job_events" in warehouse.tokens  # the range, written with its own token
    assert sink.rebuilding() == {} and sink.buffered == 1  # offset 7 starts an ordinary block
    assert sink.flush()[1] == {(EVENTS, 0): 8}
    assert sorted(r["event_id"] for r in warehouse.tables["job_events"]) == ["e0-0", "e0-1", "e0-2", "e0-7"]


def test_until_caught_up_writes_a_pending_range_whose_rest_is_past_the_partitions_end(caplog):
    """loop.py: a consumer that had every message of a partition whose end is past the pending range
    writes the range with the gap (logged); a partition ending inside the range keeps it pending."""
    from confluent_kafka import TopicPartition

    from gpuledger.sink.loop import _close_pending_past_end

    class Consumer:
        ends = {0: 9, 1: 3}

        def get_watermark_offsets(self, tp, timeout=None, cached=False):
            return 0, self.ends[tp.partition]

        def position(self, tps):
            return [TopicPartition(tp.topic, tp.partition, self.ends[tp.partition]) for tp in tps]

    progress = MemoryProgress()
    warehouse = crashed_with_pending_range(progress, [(EVENTS, 0), (EVENTS, 1)], 5)
    sink = BatchingSink(warehouse, progress, batch_rows=100)
    sink.assign([(EVENTS, 0), (EVENTS, 1)])
    for p in (0, 1):
        for i in range(3):
            sink.add(*reversed(events_message(p, i)))
    short_ends = set()
    _close_pending_past_end(Consumer(), sink, short_ends)
    _close_pending_past_end(Consumer(), sink, short_ends)
    assert warehouse.tokens == {f"{EVENTS}/0/e0/0-5/job_events"}
    assert sink.rebuilding() == {(EVENTS, 1): (3, 5)} and short_ends == {(EVENTS, 1)}
    assert sink.flush()[1] == {(EVENTS, 0): 5}
    assert "written without them" in caplog.text and caplog.text.count("inside the pending range") == 1


def test_a_pending_range_whose_first_messages_are_gone_is_written_under_its_own_token():
    """The sink died after its insert of [0, 5), before the done row; while it was down the topic's
    retention removed offsets 0-1. The range read again starts at offset 2, but it is still the range
    [0, 5): written under that token, ClickHouse drops it (the block is in). Under a token of its own
    (2-5) offsets 2-4 were stored twice."""
    progress = MemoryProgress()
    warehouse = FakeWarehouse()
    warehouse.crash_at = (1, "after")  # the insert went in, the process died before `done`
    sink = BatchingSink(warehouse, progress, batch_rows=100)
    sink.assign([(EVENTS, 0)])
    for i in range(5):
        sink.add(*reversed(events_message(0, i)))
    with pytest.raises(Crash):
        sink.flush()
    warehouse.crash_at = None
    sink = BatchingSink(warehouse, progress, batch_rows=100)
    sink.assign([(EVENTS, 0)])
    for i in range(2, 5):  # offsets 0-1 are gone (retention)
        sink.add(*reversed(events_message(0, i)))
    assert sink.flush()[1] == {(EVENTS, 0): 5}
    assert warehouse.tokens == {f"{EVENTS}/0/e0/0-5/job_events"}
    assert sorted(r["event_id"] for r in warehouse.tables["job_events"]) == [f"e0-{i}" for i in range(5)]
