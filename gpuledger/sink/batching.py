"""Rows buffered per (topic, partition), written in blocks at recorded offset ranges with an insert-deduplication token each (docs/reliability.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable
from gpuledger.sink.progress import MemoryProgress, Progress, ProgressStore
from gpuledger.sink.rows import Source
from gpuledger.sink.writer import PermanentWriteError, Writer, is_permanent





log = logging.getLogger(__name__)


@dataclass
class _Buffer:
    """Rows of one partition not yet written: messages [first, next)."""

    first: int | None = None
    next: int = 0
    rows: dict[str, list[dict]] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)  # horizons including the buffered rows
    count: int = 0
    #: Kafka keys of the buffered messages (offset -> key; unkeyed ones absent): a message whose rows
    #: the warehouse refuses is dead-lettered under its key, like every other letter
    keys: dict[int, bytes] = field(default_factory=dict)
    #: messages of a pending range read again after a crash: written only once the range is complete
    #: (its token stands for all of it), so they are not counted in `buffered` nor start the batch timer
    rebuilding: bool = False


@dataclass
class BatchingSink:
    """Rows buffered per (topic, partition), written in blocks at recorded offset ranges.

    `add()` takes one message's rows (or none: watermark, dead letter) and returns False for a
    message the warehouse already holds (skipped). `flush()` writes every buffered partition —
    pending progress rows, one insert per table with the block's token, done progress rows,
    retrying each step until it succeeds — and returns (rows written per table, offsets to commit).
    A pending range read again after a crash is the exception: it is written by `add()` once all of
    it came back (or a later offset proved the rest a gap), never in part by `flush()`.
    Call `assign()` for partitions (re)gained: it loads their progress from the store."""

    writer: Writer
    progress: ProgressStore = field(default_factory=MemoryProgress)
    batch_rows: int = 20_000
    batch_interval_s: float = 1.0
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    usage_topic: str | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    should_stop: Callable[[], bool] = lambda: False
    #: called with (key, offset, table, rows, reason, message key) for a message whose rows a table
    #: can never take (found by splitting the failed block); the run loop dead-letters it under the
    #: message's Kafka key (None: unkeyed). Letters of what a message holds (undecodable, bad ticks of
    #: a batch) go through `add`'s `letter`.
    on_poison: Callable[[tuple[str, int], int, str, list[dict], str, bytes | None], None] | None = None
    #: called once a write succeeds after failures (the run loop resumes its paused partitions)
    on_recovered: Callable[[], None] | None = None
    #: raises while dead letters handed out are not yet delivered; called (retried like a failed write)
    #: before a block's done progress is saved, so a sink that dies first re-handles the block on
    #: restart and sends its letters again: a letter may go twice, never be lost
    confirm_letters: Callable[[], None] | None = None
    #: (rows, key, start, end) -> the (cluster, node, gpu_uuid, ts_ms) of those gpu_health rows the
    #: warehouse already holds from messages outside [start, end) of partition `key`; None: no check
    stored_health: Callable[[list[dict], tuple[str, int], int, int], set[tuple]] | None = None
    _state: dict[tuple[str, int], Progress] = field(default_factory=dict, init=False)
    _buffers: dict[tuple[str, int], _Buffer] = field(default_factory=dict, init=False)
    _since: float | None = field(default=None, init=False)
    _reported: dict[tuple[str, int], int] = field(default_factory=dict, init=False)
    buffered: int = field(default=0, init=False)
    skipped_duplicates: int = field(default=0, init=False)
    dropped_records: int = field(default=0, init=False)  # rows a restarted worker emitted again (horizons)
    retries: int = field(default=0, init=False)
    poisoned: int = field(default=0, init=False)
    splits: int = field(default=0, init=False)
    duplicate_health: int = field(default=0, init=False)  # gpu_health rows of ticks already stored (resent)

    # -- partitions
    def assign(self, partitions: list[tuple[str, int]]) -> None:
        """Load the progress of (re)gained partitions; buffered rows of theirs are dropped (the
        messages come again from the committed offset)."""
        if not partitions:
            return
        loaded = self._retry(lambda: self.progress.load(list(partitions)), "loading sink progress")
        for key in partitions:
            self._drop(key)
            self._state[key] = loaded.get(key, Progress())
            self._reported.pop(key, None)  # what the group has committed for it is not known any more

    def progress_of(self, key: tuple[str, int]) -> Progress:
        return self._state.get(key, Progress())

    def revoke(self, partitions: list[tuple[str, int]]) -> None:
        for key in partitions:
            self._drop(key)
            self._state.pop(key, None)
            self._reported.pop(key, None)

    def _drop(self, key) -> None:
        buf = self._buffers.pop(key, None)
        if buf and not buf.rebuilding:
            self.buffered -= buf.count

    def rebuilding(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Partitions holding part of a pending range read again: (the next offset, the range's end)."""
        return {key: (buf.next, self._state[key].pending[1]) for key, buf in self._buffers.items() if buf.rebuilding}

    # -- input
    def add(self, rows_by_table: dict[str, list[dict]], source: Source, origin: tuple[int, int] | None = None,
            letter: Callable[[], None] | None = None, message_key: bytes | None = None) -> bool:
        """`origin`: (partition, offset) of the job-events message a lifecycle-accepted message repeats;
        one at or below an origin already taken is a worker's re-emission and gives no rows.
        `letter`: sends the message's dead letters (the whole message's, or one per rejected part of it:
        rows.py `Rows`); called once the message is known to be new, before anything is written (a
        pending range's last message completes it here, and its done progress must come after the
        letter is handed out). `message_key`: its Kafka key, for a letter of rows the warehouse refuses."""
        key = (source.topic, source.partition)
        state = self._state.setdefault(key, Progress())
        buf = self._buffers.get(key)
        if source.offset < state.done_to or (buf is not None and source.offset < buf.next):
            self.skipped_duplicates += 1
            return False
        if letter is not None:
            letter()
        if buf is not None and buf.rebuilding and source.offset >= state.pending[1]:
            self.flush_partition(key, gap=True)  # the replayed range is complete (its end was a gap)
            if key not in self._state:
                return True  # revoked while the write waited: the message is the new owner's
            buf, state = None, self._state[key]  # the next block starts from the range's done progress
        if buf is None:
            rebuilding = state.pending is not None and source.offset < state.pending[1]
            # a pending range read again is the recorded range from its start, even when its first
            # messages are gone (retention): the same token, so a block already in is not stored twice
            first = state.pending[0] if rebuilding else source.offset
            buf = self._buffers[key] = _Buffer(first=first, next=source.offset, running=dict(state.horizons),
                                              rebuilding=rebuilding)
        if source.topic == self.usage_topic and "usage_raw" in rows_by_table:
            rows_by_table = {**rows_by_table, "usage_raw": self._new_usage(rows_by_table["usage_raw"], buf.running)}
        if origin is not None:
            mark = f"source:{origin[0]}"
            if origin[1] < buf.running.get(mark, 0):
                self.dropped_records += sum(len(r) for r in rows_by_table.values())
                rows_by_table = {}
            else:
                buf.running[mark] = origin[1] + 1
        if message_key is not None and any(rows_by_table.values()):
            buf.keys[source.offset] = message_key
        for table, rows in rows_by_table.items():
            if rows:
                buf.rows.setdefault(table, []).extend(rows)
                buf.count += len(rows)
                if not buf.rebuilding:
                    self.buffered += len(rows)
        buf.next = source.offset + 1
        if buf.rebuilding:
            if buf.next < state.pending[1]:
                return True  # the rest of the pending range is still to come
            self.flush_partition(key)  # a pending range is written again exactly as it was cut
        if self._since is None:
            self._since = self.clock()  # (a rebuilt range just written: its offset goes with the next flush)
        return True

    def _new_usage(self, rows: list[dict], running: dict[str, int]) -> list[dict]:
        """One message's usage rows minus those of GPUs already taken up to a later time; then
        advance the running horizons. A message holds whole ticks, so the check is per message."""
        horizon_before = {gpu: running.get(gpu, 0) for gpu in {r["gpu_uuid"] for r in rows}}
        kept = [r for r in rows if r["start_ms"] >= horizon_before[r["gpu_uuid"]]]
        self.dropped_records += len(rows) - len(kept)
        for r in kept:
            if r["end_ms"] > running.get(r["gpu_uuid"], 0):
                running[r["gpu_uuid"]] = r["end_ms"]
        return kept

    def _new_health(self, rows: list[dict], key, start: int, end: int) -> list[dict]:
        """The block's gpu_health rows minus copies of a tick already stored: an agent's spool delivers
        at least once, so a resent tick comes again at a new offset (another token). A copy is the same
        (cluster, node, GPU, ts_ms) — an older tick never stored, or another GPU or node at the same
        time, is kept. Rows of this block's own range do not count as stored: a pending range rebuilt
        after a crash must give the same rows (the same block for its token and for the views)."""
        stored = set(self._retry(lambda: self.stored_health(rows, key, start, end), "reading stored health samples"))
        kept = []
        for r in rows:
            sample = (r["cluster"], r["node"], r["gpu_uuid"], r["ts_ms"])
            if sample not in stored:
                stored.add(sample)  # a second copy inside the block goes too: the first (lowest offset) stays
                kept.append(r)
        if len(kept) < len(rows):
            self.duplicate_health += len(rows) - len(kept)
            log.info("%s[%d] %d-%d: %d gpu_health rows of ticks already stored dropped", key[0], key[1], start, end,
                     len(rows) - len(kept))
        return kept

    def due(self) -> bool:
        if self._since is None:
            return False
        return self.buffered >= self.batch_rows or self.clock() - self._since >= self.batch_interval_s

    # -- output
    def flush(self) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
        """Write every buffered partition but those still rebuilding a pending range (they stay
        buffered, their offsets uncommitted); returns (rows written per table, offsets to commit)."""
        written = self._write_blocks(sorted(self._buffers))
        self._since = None
        # every partition whose progress moved (also by skipping messages the warehouse already held)
        offsets = {key: st.done_to for key, st in self._state.items()
                   if st.done_to > 0 and self._reported.get(key) != st.done_to and key not in self._buffers}
        self._reported.update(offsets)
        return written, offsets

    def commit_failed(self, offsets: dict[tuple[str, int], int]) -> None:
        """The offsets `flush` returned could not be committed: report them again next time (else a
        partition with nothing new to read would show that lag for ever)."""
        for key, offset in offsets.items():
            if self._reported.get(key) == offset:
                del self._reported[key]

    def flush_partition(self, key, gap: bool = False) -> dict[str, int]:
        """`gap`: the rest of the partition's pending range is known to hold no messages (a later
        offset came, or the partition ends past it): write the range up to its recorded end."""
        return self._write_blocks([key], gap=gap)

    def _write_blocks(self, keys, gap: bool = False) -> dict[str, int]:
        written: dict[str, int] = {}
        plans = []
        for key in keys:
            buf = self._buffers.get(key)
            if buf is None:
                continue
            state = self._state[key]
            start, end = buf.first, buf.next
            if buf.rebuilding and end < state.pending[1]:
                if not gap:
                    # only part of the range is back: written now under the whole range's token and
                    # recorded done to its end, the rest would be skipped as stored and lost
                    continue
                end = state.pending[1]  # the rest of the pending range was a gap (no messages)
            plans.append((key, buf, state, start, end))
        if not plans:
            return written

        def owned(plans):
            # a partition revoked while a step waited (the run loop polls there; a rebalance may come) is
            # its new owner's: it loaded no range of this block, so none may be recorded or inserted now
            return [plan for plan in plans if self._buffers.get(plan[0]) is plan[1]]

        self._retry(lambda: self.progress.save([self._row(key, state.epoch, start, end, "pending", state.horizons)
                                                for key, buf, state, start, end in owned(plans)]),
                    "recording a pending block")
        plans = owned(plans)
        if not plans:
            return written
        for key, buf, state, start, end in plans:
            for table, rows in buf.rows.items():
                if table == "gpu_health" and self.stored_health is not None:
                    rows = self._new_health(rows, key, start, end)
                    if not rows:
                        continue
                token = f"{key[0]}/{key[1]}/e{state.epoch}/{start}-{end}/{table}"
                n = self._write_table(key, table, rows, token)
                written[table] = written.get(table, 0) + n
        if self.confirm_letters is not None:
            # the dead letters of this round (undecodable messages, rows the warehouse refused) are in
            # their topic before the range is recorded done: a crash now re-handles the range
            self._retry(self.confirm_letters, "delivering dead letters")
        done_rows = [self._row(key, state.epoch, start, end, "done", buf.running)
                     for key, buf, state, start, end in plans]
        self._retry(lambda: self.progress.save(done_rows), "recording a done block")
        # (a partition revoked after its pending row: its new owner rebuilds the same block, same token)
        for key, buf, state, start, end in owned(plans):
            self._state[key] = Progress(state.epoch, end, None, dict(buf.running))
            self._drop(key)
        return written

    def _write_table(self, key, table: str, rows: list[dict], token: str) -> int:
        """Insert one table's block; on an error that can never succeed, split it in halves by message
        (each half with its own token, derived from the block's: a block rebuilt after a crash fails
        and splits the same way, so the halves already in are dropped by ClickHouse) down to single
        messages, whose rows are handed to `on_poison`. Returns the rows written."""
        try:
            self._retry(lambda: self.writer.write(table, rows, token=token), f"writing {len(rows)} rows to {table}",
                        permanent=True)
            return len(rows)
        except PermanentWriteError as exc:
            offsets = sorted({r["kafka_offset"] for r in rows})
            if len(offsets) == 1:
                self.poisoned += 1
                reason = f"warehouse refused the rows for {table} (not retried): {exc}"
                log.error("%s[%d]@%d: %s", key[0], key[1], offsets[0], reason)
                if self.on_poison:
                    buf = self._buffers.get(key)
                    self.on_poison(key, offsets[0], table, rows, reason, buf.keys.get(offsets[0]) if buf else None)
                return 0
            self.splits += 1
            mid = offsets[len(offsets) // 2]
            log.warning("splitting %d rows of %s[%d] for %s after %s", len(rows), key[0], key[1], table, exc)
            n = 0
            for half in ([r for r in rows if r["kafka_offset"] < mid], [r for r in rows if r["kafka_offset"] >= mid]):
                lo, hi = half[0]["kafka_offset"], max(r["kafka_offset"] for r in half) + 1
                n += self._write_table(key, table, half, f"{token}/{lo}-{hi}")
            return n

    #: progress rows' `seq` (their version in the ReplacingMergeTree): from the epoch and offsets, not
    #: the wall clock; above every time_ns() value written by earlier versions
    SEQ_BASE = 1 << 62

    @classmethod
    def _row(cls, key, epoch, start, end, phase, horizons) -> dict:
        seq = cls.SEQ_BASE + (epoch << 44) + 2 * end + (1 if phase == "done" else 0)
        return {"topic": key[0], "partition": key[1], "epoch": epoch, "from_offset": start, "to_offset": end,
                "phase": phase, "horizons": dict(horizons), "seq": seq}

    def _retry(self, action, what: str, permanent: bool = False):
        """Run `action` until it succeeds, with capped exponential backoff (the warehouse may be down
        for a while; nothing is lost meanwhile: offsets are not committed). With `permanent`, an error
        that can never succeed is raised at once as PermanentWriteError. The wait goes through
        `sleep` (the run loop keeps polling Kafka there, its partitions paused)."""
        attempt = 0
        while True:
            try:
                result = action()
                if attempt and self.on_recovered:
                    self.on_recovered()
                return result
            except Exception as exc:
                if permanent and is_permanent(exc):
                    raise PermanentWriteError(exc) from exc
                if self.should_stop():
                    raise
                # the exponent is capped: 2**1024 does not fit a float (an outage of ~8.5 h at the 30 s
                # cap would raise OverflowError here and kill the sink)
                delay = min(self.backoff_max_s, self.backoff_s * 2**min(attempt, 30))
                attempt += 1
                self.retries += 1
                log.warning("%s failed (%s: %s); retry %d in %.1fs", what, type(exc).__name__, exc, attempt, delay)
                self.sleep(delay)
