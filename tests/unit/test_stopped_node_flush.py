"""WorkerCore, pure: when is a node "stopped" (its open segments flushed, docs/accounting.md
"Segments")? When the partition's samples clock has moved on, since the node's latest message, by
that message's span plus `flush_after_s` — not by how far the clock is from the node's tick times.
A node that batches its ticks is waited for one batch; a peer's clock ahead from the partition's
first tick flushes no one; a node that really stops is still flushed; the new state is in the
snapshot, and an older snapshot restores."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from gpuledger.schemas.models import NodeTick
from gpuledger.schemas.wire import encode_node_ticks
from gpuledger.streams.core import JOIN, WorkerCore
from gpuledger.streams.join import NodeJoin
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, allocate, tick, watermark


def still_held(core: WorkerCore, node: str) -> int:
    """GPU-ms of the node not billed yet: its open segments and its ticks waiting for the watermark."""
    join = core.joins[0].nodes[("c", node)]
    return sum(sl[3] for seg in join.segments.values() for sl in seg.slots) + \
        sum(t.interval_ms for t in join.pending_ticks)


def run(per_message: dict[str, int], minutes: int, *, skew_s: dict[str, int] | None = None, lag_s: int = 30,
        now=lambda r: None, stop: dict[str, int] | None = None) -> tuple[WorkerCore, Feeder]:
    """Nodes a and b, 10-s ticks, each sending `per_message[node]` ticks a message (a's batch read
    first when both go out together); every 10 s the watermark reaches real time - lag_s. A node's
    ticks are stamped `skew_s[node]` ahead; it stops after `stop[node]` s of real time (default:
    the end)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    skew_s, stop = skew_s or {}, stop or {}
    for n in per_message:
        allocate(feed, n, now(0))
    held: dict[str, list[NodeTick]] = {n: [] for n in per_message}
    for r in range(10, minutes * 60 + 1, 10):
        watermark(feed, T0 + (r - lag_s) * S, now(r))
        for n, count in per_message.items():
            if r > stop.get(n, minutes * 60):
                continue
            held[n].append(tick(n, T0 + (r - 10 + skew_s.get(n, 0)) * S))
            if len(held[n]) == count or r == stop.get(n, minutes * 60):  # an agent stopping sends what it holds
                feed(T.gpu_samples, encode_node_ticks(n, held[n]), now(r))
                held[n] = []
    return core, feed


# --------------------------------------------------------------------------- defect 1: batched ticks
@pytest.mark.parametrize("a_per_message", [10, 1])
def test_a_node_that_batches_its_ticks_is_waited_for_one_batch(a_per_message: int) -> None:
    """b's agent sends 10 ticks a message (docs/performance.md recommends it). A peer's message
    moves the samples clock a whole batch at once while b's batch of that time is not read yet: b
    is not stopped, its segment must not be flushed mid-window (its batch was dead-lettered late)."""
    core, feed = run({"a": a_per_message, "b": 10}, 30)
    late = feed.late("b")
    assert not late, f"{len(late)} of b's batches dead-lettered as late: {late[0][:80]}"
    assert feed.billed("b") + still_held(core, "b") == 1_800_000


# --------------------------------------------------------------------------- defect 2: a clock ahead from the start
@pytest.mark.parametrize("skew", [150, 600, 3600])
@pytest.mark.parametrize("clock", ["backlog", "none"])
def test_a_peer_clock_ahead_from_the_first_tick_flushes_no_one(skew: int, clock: str) -> None:
    """A partition with no snapshot (a fresh consumer group, a rebuild replay, a first deploy over
    a backlog) whose first tick read is node a's, its clock `skew` s ahead: the samples clock starts
    there. Correct node b keeps sending; none of its ticks may be flushed or rejected."""
    now = {"backlog": lambda r: T0 + 30 * 24 * 60 * MIN, "none": lambda r: None}[clock]
    core, feed = run({"a": 1, "b": 1}, 10, skew_s={"a": skew}, lag_s=0, now=now)
    late = feed.late("b")
    assert not late, f"{len(late)} of b's ticks dead-lettered as late: {late[0][:80]}"
    assert feed.billed("b") + still_held(core, "b") == 600_000


# --------------------------------------------------------------------------- a node that stops is still flushed
@pytest.mark.parametrize("b_per_message", [1, 10])
def test_a_node_that_stops_is_still_flushed(b_per_message: int) -> None:
    """b stops after 250 s, mid-window (its agent sends what it holds as it stops); a goes on. b's
    last records come out (never lost), and nothing is late."""
    core, feed = run({"a": 1, "b": b_per_message}, 10, stop={"b": 250}, lag_s=0)
    assert feed.billed("b") == 250_000 and not core.joins[0].nodes[("c", "b")].segments
    assert not feed.late("a") and not feed.late("b") and feed.billed("a") + still_held(core, "a") == 600_000


def test_a_stopped_node_is_flushed_once_the_clock_moved_its_span_and_flush_after() -> None:
    """The exact moment. b sends 10 ticks a message and stops after [150, 250 s), read at clock
    240 s (a's ticks move the clock 10 s each). b's open segment [240, 250 s) stays open while the
    clock is below 240 + 100 (b's message span) + 60 (flush_after) = 400 s, and is flushed at 400 s.
    A watermark after each of a's ticks looks at every node (a scan that misses nothing)."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    allocate(feed, "a")
    allocate(feed, "b")
    watermark(feed, T0 + 10 * S)
    for k in range(41):
        feed(T.gpu_samples, encode_node_ticks("a", [tick("a", T0 + k * 10 * S)]))
        if k in (4, 14, 24):
            batch = [tick("b", T0 + j * 10 * S) for j in range(max(0, k - 9), k + 1)]
            feed(T.gpu_samples, encode_node_ticks("b", batch))
        watermark(feed, T0 + (k + 1) * 10 * S)
        if k == 24:
            assert feed.billed("b") == 240_000 and core.joins[0].data_ms == T0 + 240 * S
        if k == 39:  # the clock at 390 s: b's segment of the window [240, 300 s) is still open
            assert feed.billed("b") == 240_000 and set(core.joins[0].nodes[("c", "b")].segments) == {"GPU-b"}, \
                f"b's segment flushed at clock {(core.joins[0].data_ms - T0) // S} s, before 400 s"
    assert feed.billed("b") == 250_000 and not core.joins[0].nodes[("c", "b")].segments
    assert core.joins[0].nodes[("c", "b")].closed_until_ms == T0 + 300 * S


# --------------------------------------------------------------------------- snapshots
def test_when_the_node_last_spoke_is_in_the_snapshot_and_an_older_snapshot_restores() -> None:
    # no tick waits for the watermark (those are left out and read again); b's last message is [200, 250 s)
    core, feed = run({"a": 1, "b": 10}, 5, lag_s=0, stop={"b": 250})
    join = core.joins[0].nodes[("c", "b")]
    assert join.clock_at_last_message == T0 + 240 * S and join.message_span_ms == 50 * S and join.segments
    blob = core.snapshot(JOIN, 0)
    twin = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    twin.restore(JOIN, 0, blob)
    assert twin.joins[0] == core.joins[0] and twin.snapshot(JOIN, 0) == blob
    # a snapshot taken before these fields existed: it restores, and the node is not flushed at once
    state = join.to_state()
    for key in ("clock_at_last_message", "message_span_ms"):
        del state[key]
    old = NodeJoin.from_state(orjson.loads(orjson.dumps(state)))
    assert old.message_span_ms == 0
    assert old.close_until(T0 + 270 * S, LEDGER, T0 + 300 * S) == []  # grace: flush_after from the first look
    assert old.segments and old.clock_at_last_message == T0 + 300 * S


def test_ticks_read_again_after_a_restore_move_neither_the_clock_nor_when_their_node_spoke() -> None:
    """A snapshot leaves the ticks waiting for the watermark out; the restored worker reads them
    again (docs/reliability.md, "Worker state"). Their clock and their node's message are in the
    snapshot already: reading them again must give the state the worker had. (A tick from the future
    read again moved the capped clock one more interval; a node's message read again counted as the
    node speaking at the restored clock, later than it did.)"""
    core, feed = run({"a": 1, "b": 10}, 6, lag_s=120, stop={"b": 300})  # b's last message: [200, 300 s)
    feed(T.gpu_samples, encode_node_ticks("a", [tick("a", T0 + 3600 * S)]))  # a's clock jumps an hour ahead, once
    assert core.joins[0].data_ms == T0 + 360 * S and core.joins[0].nodes[("c", "b")].clock_at_last_message == T0 + 290 * S
    assert core.joins[0].nodes[("c", "b")].pending_ticks  # b's last message is read again after the restore
    twin = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    twin.restore(JOIN, 0, core.snapshot(JOIN, 0))
    for topic, sent in feed.sent.items():
        for offset in range(twin.joins[0].next_offsets.get(topic, 0), len(sent)):
            twin.on_node(topic, 0, offset, sent[offset])
    assert twin.joins[0].data_ms == core.joins[0].data_ms, "reading ticks again moved the samples clock"
    assert twin.joins[0].nodes[("c", "b")].clock_at_last_message == T0 + 290 * S
    same = lambda part: replace(part, nodes={n: replace(j, duplicates=0) for n, j in part.nodes.items()})  # noqa: E731
    assert same(twin.joins[0]) == same(core.joins[0])  # (ticks closed meanwhile are counted as duplicates)
