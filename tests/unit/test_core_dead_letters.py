"""WorkerCore, pure: a tick from the future does not flush the live nodes of its partition (the
samples clock, docs/accounting.md "Segments"); dead-letter kinds (gpuledger_dead_letters_total):
a batch counts each rejected tick by its own kind, "too late" is late; the worker's dead letters
keep the input's key and an original that is not UTF-8 exactly (docs/reliability.md)."""

from __future__ import annotations

import hashlib
from collections import Counter

import orjson
import pytest

from gpuledger.metrics import dead_letter_kind
from gpuledger.schemas.models import DeadLetter, GpuAssignment, JobEvent, NodeTick, NodeWatermark, UsageBatch
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.streams.checks import dead_letter
from gpuledger.streams.core import WorkerCore
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, allocate, tick


def allocate_and_start(feed: Feeder, node: str, now_ms: int | None) -> None:
    allocate(feed, node, now_ms, kinds=("allocated", "started"))


# --------------------------------------------------------------------------- defect: a tick from the future
@pytest.mark.parametrize("clock", ["live", "backlog", "none"])
@pytest.mark.parametrize("skew", ["once", "always"])
def test_a_tick_from_the_future_does_not_flush_live_nodes(clock: str, skew: str) -> None:
    """Node b sends 10 minutes of 10-s ticks; node a's clock is 1 hour ahead (one tick, or every
    tick). b's GPU time is all billed and none of b's ticks is a dead letter: live (the worker's
    clock just after each tick), in a backlog (the worker's clock 30 min after the data) and with
    no wall clock (pure tools)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    now = {"live": lambda ts: ts + 10 * S + 500, "backlog": lambda ts: T0 + 30 * MIN, "none": lambda ts: None}[clock]
    allocate_and_start(feed, "a", now(T0))
    allocate_and_start(feed, "b", now(T0))
    for k in range(60):
        ts = T0 + k * 10 * S
        feed(T.gpu_samples, encode_node_ticks("b", [tick("b", ts)]), now(ts))
        if (skew == "once" and k == 6) or (skew == "always" and k >= 6):
            feed(T.gpu_samples, encode_node_ticks("a", [tick("a", ts + 60 * MIN)]), now(ts))
        feed(T.node_allocations, encode(NodeWatermark(ts_ms=ts + 10 * S, source_partition=0, source_partitions=1)),
             now(ts))
    records = [r for o in feed.outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records]
    late = [letter.reason for letter in feed.letters() if letter.reason.startswith("late tick: b")]
    assert not late, f"{len(late)} of node b's ticks dead-lettered as late: {late[0]}"
    assert sum(r.gpu_ms for r in records if r.node == "b") == 600_000, "node b's GPU time was not all billed"
    assert sum(r.cost_micros for r in records if r.node == "b") == 85_620


def test_the_samples_clock_still_flushes_a_node_that_stopped() -> None:
    """The samples clock moves one interval per tick at most: a node that stopped is still flushed
    once its peers' samples are flush_after past its window (the flush is not lost to the cap)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    allocate_and_start(feed, "a", None)
    allocate_and_start(feed, "b", None)
    for k in range(30):  # a stops after 1 minute, b goes on for 5
        ts = T0 + k * 10 * S
        if k < 6:
            feed(T.gpu_samples, encode_node_ticks("a", [tick("a", ts)]), ts + 10 * S)
        feed(T.gpu_samples, encode_node_ticks("b", [tick("b", ts)]), ts + 10 * S)
        feed(T.node_allocations, encode(NodeWatermark(ts_ms=ts + 10 * S, source_partition=0, source_partitions=1)),
             ts + 10 * S)
    records = [r for o in feed.outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records]
    assert sum(r.gpu_ms for r in records if r.node == "a") == 60_000 and not core.joins[0].nodes[("c", "a")].segments


# --------------------------------------------------------------------------- defect: dead-letter kinds
def test_a_batch_counts_each_rejected_tick_by_its_own_kind() -> None:
    """A late tick then a malformed tick in one message: one letter, counted once as late and
    once as invalid (the malformed-input alert sees it)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    kinds: Counter[str] = Counter()
    core.on_dead_letter = lambda topic, reason: kinds.update([dead_letter_kind(reason)])
    feed = Feeder(core)

    def t(k: int, used: int = 10) -> NodeTick:
        return tick("n1", T0 + 10 * S * k, mem_used_bytes=used, mem_total_bytes=100)

    feed(T.gpu_samples, encode_node_ticks("n1", [t(0), t(1), t(3)]))  # tick 2 lost in transit
    feed(T.node_allocations, encode(NodeWatermark(ts_ms=T0 + 40 * S, source_partition=0, source_partitions=1)))
    feed(T.gpu_samples, encode_node_ticks("n1", [t(2), t(4, used=500), t(5)]))  # late, malformed, good
    letters = feed.letters()
    assert len(letters) == 1 and core.counters["dead_letters"] == 1
    assert letters[0].reason.startswith("late tick: n1") and "inconsistent tick: n1" in letters[0].reason
    assert kinds == {"late": 1, "invalid": 1}, f"dead letters by kind {dict(kinds)}: the malformed tick is not invalid"


def test_a_too_late_allocation_change_is_late_not_invalid() -> None:
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER, retention_ms=60 * S)
    kinds: Counter[str] = Counter()
    core.on_dead_letter = lambda topic, reason: kinds.update([dead_letter_kind(reason)])
    feed = Feeder(core)
    feed(T.gpu_samples, encode_node_ticks("n1", [tick("n1", T0 + 10 * S * k) for k in range(60)]))
    feed(T.node_allocations, encode(NodeWatermark(ts_ms=T0 + 600 * S, source_partition=0, source_partitions=1)))
    allocate_and_start(feed, "n1", None)  # at T0: 10 minutes behind the closed horizon, retention 1 minute
    reasons = [letter.reason for letter in feed.letters()]
    assert reasons and all(r.startswith("too late: allocation change") for r in reasons), reasons
    assert kinds == {"late": len(reasons)}, f"dead letters by kind {dict(kinds)}: 'too late' is not late"
    assert dead_letter_kind("late tick: n ts_ms=1") == "late" and dead_letter_kind("overlapping tick: n") == "invalid"


# --------------------------------------------------------------------------- defect: what a letter keeps
def test_the_workers_dead_letter_keeps_the_inputs_key() -> None:
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    core.source_key = b"n1"  # what the Faust shell sets before each message (streams/app.py `handle`)
    (out,) = core.on_node(T.gpu_samples, 0, 0, b"{not json", now_ms=T0)
    assert out.topic == T.dead_letters
    assert out.key == b"n1", f"the dead letter's key is {out.key!r}, not the input's b'n1'"
    core.source_key = b"j1"
    (out,) = core.on_lifecycle(0, 0, b"\xff\xfe{not json", now_ms=T0)
    assert out.key == b"j1"


def test_an_original_that_is_not_utf8_is_kept_exactly() -> None:
    raw = b"\xff\xfe{not json \x80\x00"
    letter = decode(DeadLetter, dead_letter("t.gpu-samples", 0, 7, raw, "invalid JSON", seen_ms=T0, max_bytes=900_000))
    assert letter.original_hex is not None, "the letter cannot give back the original bytes"
    assert bytes.fromhex(letter.original_hex) == raw and letter.original_sha256 == hashlib.sha256(raw).hexdigest()
    assert letter.original == raw.decode("utf-8", "replace") and letter.original_size is None
    # UTF-8 originals: as before (no new field, no hash unless cut)
    ok = orjson.loads(dead_letter("t.gpu-samples", 0, 8, b'{"a": "\xc3\xa9"}', "x", seen_ms=T0, max_bytes=900_000))
    assert ok["original"] == '{"a": "\u00e9"}' and "original_hex" not in ok and "original_sha256" not in ok


def test_a_large_original_that_is_not_utf8_is_cut_to_fit() -> None:
    raw = (b"\xff" + bytes(range(256))) * 4000  # ~1 MB, not UTF-8
    blob = dead_letter("t.gpu-samples", 0, 9, raw, "invalid JSON", seen_ms=T0, max_bytes=100_000)
    letter = decode(DeadLetter, blob)
    assert len(blob) <= 100_000 and letter.original_size == len(raw)
    assert letter.original_sha256 == hashlib.sha256(raw).hexdigest()
    assert raw.startswith(bytes.fromhex(letter.original_hex)) and len(letter.original_hex) > 10_000


# --------------------------------------------------------------------------- defect: a node watermark of no partition
@pytest.mark.parametrize("source, sources", [(5, 2), (2, 2), (1, 9)])
def test_a_node_watermark_of_no_job_events_partition_is_a_dead_letter(source: int, sources: int) -> None:
    """A schema-valid NodeWatermark naming a job-events partition the worker does not have (5 of 2;
    or of 9 partitions where the topic has 2) would raise KeyError in the watermark clock on every
    later tick of the partition (dead-lettering good ticks), or hold its clock at 0 for good. It is
    a dead letter saying why; the partition's good watermarks and ticks go on."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=2, ledger=LEDGER)
    feed = Feeder(core)
    allocate_and_start(feed, "n1", None)
    feed(T.node_allocations, encode(NodeWatermark(ts_ms=T0 + 10 * S, source_partition=source,
                                                  source_partitions=sources)))
    for k in range(12):
        feed(T.gpu_samples, encode_node_ticks("n1", [tick("n1", T0 + 10 * S * k)]))
    for p in (0, 1):
        feed(T.node_allocations, encode(NodeWatermark(ts_ms=T0 + 120 * S, source_partition=p, source_partitions=2)))
    reasons = [letter.reason for letter in feed.letters()]
    assert len(reasons) == 1, reasons
    assert reasons[0].startswith(f"inconsistent watermark: job-events partition {source} of {sources}"), reasons[0]
    assert feed.billed("n1") == 120_000 and core.joins[0].clock.value == T0 + 120 * S


# --------------------------------------------------------------------------- defect: a counter's name
def test_an_unstorable_event_is_not_counted_as_an_impossible_sequence() -> None:
    """An event whose attempt its column cannot hold (2**32) is refused before its sequence is judged
    (streams/checks.py `event_values_problem`): counted as unstorable, not as an impossible sequence."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    gpus = [GpuAssignment(node="n1", gpu_uuid="GPU-n1", share_milli=1000)]
    for offset, (job, attempt, kind) in enumerate([("j1", 2**32, "allocated"), ("j2", 0, "started")]):
        event = JobEvent(event_id=f"{job}/{kind}", ts_ms=T0, kind=kind, cluster="c", job_id=job, attempt=attempt,
                         tenant="t", queue="q", gpus=gpus)
        (out,) = core.on_lifecycle(0, offset, encode(event), now_ms=T0)
        assert out.topic == T.dead_letters
    assert core.counters["unstorable_events"] == 1 and core.counters["impossible_sequences"] == 1, core.counters


def test_a_snapshot_holding_a_watermark_of_no_partition_is_repaired_on_restore() -> None:
    """A snapshot taken before such watermarks were refused keeps them: restored as they were, the
    partition's clock waited for 9 job-events partitions of 2 for ever (no GPU time billed again)."""
    before = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=2, ledger=LEDGER)
    before.join_partition(0).clock.by_source.update({0: T0, 1: T0, 5: T0})
    before.join_partition(0).clock.source_partitions = 9
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=2, ledger=LEDGER)
    core.restore("join", 0, before.snapshot("join", 0))
    clock = core.joins[0].clock
    assert (clock.source_partitions, sorted(clock.by_source), clock.value) == (2, [0, 1], T0)
