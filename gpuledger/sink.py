"""The warehouse sink: Kafka (usage, job-events, scheduler-snapshots, gpu-samples) -> ClickHouse tables.

Three layers, each replaceable:
- pure conversion: `process_message(kind, raw, source)` turns one message into rows per table
  (or raises DecodeError) — no Kafka, no ClickHouse;
- `BatchingSink`: buffers rows per (topic, partition) and table, cuts each partition's rows into
  blocks at recorded Kafka offset ranges, and writes them through a `Writer` backend with an
  insert-deduplication token per block, retrying with backoff until the backend takes them;
  a `ProgressStore` records each block's range before ("pending") and after ("done") the insert;
- `ClickHouseWriter` / `ClickHouseProgress`: the backend (one insert per table and block) and the
  progress table (`sink_progress`, sql/0009).

Exactly-once effect (docs/reliability.md, "Exactly-once into ClickHouse"):
- a block is the rows of messages [from, to) of one partition; its token names that range, so a
  block written again after a crash is dropped by ClickHouse (usage_raw and, with
  `deduplicate_blocks_in_dependent_materialized_views`, each materialized view's target on its own);
- after a restart the sink resumes from the progress table: messages below a done range are
  skipped; a pending range is rebuilt exactly (same messages, same horizons, same token) and
  written again, so whatever part of it reached ClickHouse is not counted twice;
- usage records the worker emitted twice (after a worker crash, at new offsets) are dropped before
  the insert by a per-GPU horizon: the worker emits each GPU's records in time order, so a record
  starting before the end of the latest record already taken for its GPU is a re-emission.
Undecodable messages go to the dead-letter topic with the reason and the original bytes; they
never stop the good data behind them.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import orjson
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, LifecycleWatermark, NodeTick, SchedulerSnapshot, UsageBatch
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_node_ticks
from gpuledger.streams.checks import DAY_MS, dead_letter, rows_problem, time_problem
from gpuledger.streams.core import SOURCE_HEADER

log = logging.getLogger(__name__)

USAGE, JOB_EVENTS, SNAPSHOTS, SAMPLES = "usage", "job_events", "scheduler_snapshots", "gpu_samples"


# --------------------------------------------------------------------------- pure conversion
@dataclass(frozen=True)
class Source:
    """Where a message came from; stored with every row it produced."""

    topic: str
    partition: int
    offset: int

    def columns(self) -> dict:
        return {"kafka_topic": self.topic, "kafka_partition": self.partition, "kafka_offset": self.offset}


def usage_rows(batch: UsageBatch, source: Source) -> list[dict]:
    meta = source.columns()
    # mode="json" turns enums into their string values; every other field is already plain
    return [{**record.model_dump(mode="json"), **meta} for record in batch.records]


def job_event_row(event: JobEvent, source: Source) -> dict:
    return {
        "schema_version": event.schema_version,
        "event_id": event.event_id,
        "ts_ms": event.ts_ms,
        "kind": event.kind.value,
        "cluster": event.cluster,
        "job_id": event.job_id,
        "attempt": event.attempt,
        "tenant": event.tenant,
        "queue": event.queue,
        "priority": event.priority,
        "requested_gpus": event.requested_gpus,
        "gpu_nodes": [g.node for g in event.gpus],
        "gpu_uuids": [g.ref for g in event.gpus],  # a UUID, or node#index until resolved
        "gpu_share_milli": [g.share_milli for g in event.gpus],
        "gpu_container_ids": [g.container_id or "" for g in event.gpus],
        "aliases": dict(event.aliases),
        "reason": event.reason or "",
        **source.columns(),
    }


def snapshot_rows(snapshot: SchedulerSnapshot, source: Source) -> dict[str, list[dict]]:
    meta = source.columns()
    queues = [
        {
            "schema_version": snapshot.schema_version,
            "cluster": snapshot.cluster,
            "ts_ms": snapshot.ts_ms,
            "queue": q.queue,
            "queue_priority": q.priority,
            "quota_gpus": q.quota_gpus,
            "allocated_gpus": q.allocated_gpus,
            "pending_jobs": q.pending_jobs,
            "pending_gpus": q.pending_gpus,
            "pending_priorities": [p.priority for p in q.pending_by_priority],
            "pending_jobs_by_priority": [p.jobs for p in q.pending_by_priority],
            "pending_gpus_by_priority": [p.gpus for p in q.pending_by_priority],
            **meta,
        }
        for q in snapshot.queues
    ]
    preemptions = [
        {
            "cluster": snapshot.cluster,
            "ts_ms": snapshot.ts_ms,
            "queue": p.queue,
            "job_id": p.job_id,
            "by_job_id": p.by_job_id or "",
            "rule": p.rule,
            **meta,
        }
        for p in snapshot.preemptions
    ]
    out = {"scheduler_snapshots": queues}
    if preemptions:
        out["scheduler_preemptions"] = preemptions
    return out


def health_rows(tick: NodeTick, source: Source) -> list[dict]:
    """`gpu_health` rows of one tick (line 1), one per GPU: the health record of the operations view."""
    meta = source.columns()
    return [{
        "cluster": tick.cluster, "node": tick.node, "gpu_uuid": g.gpu_uuid, "gpu_model": g.model,
        "ts_ms": tick.ts_ms, "interval_ms": tick.interval_ms, "health": g.health.value,
        "down_reason": g.down_reason or "", "temperature_c": g.temperature_c, "power_w": g.power_w,
        "util_gpu_pct": g.util_gpu_pct, "mem_used_bytes": g.mem_used_bytes, "xid_errors": list(g.xid_errors),
        "ecc_dbe_total": g.ecc_dbe_total, **meta,
    } for g in tick.gpus]


def inventory_row(tick: NodeTick, source: Source) -> dict:
    """`node_inventory` row of one tick: the node and the GPUs (uuid, model) it reports."""
    return {
        "cluster": tick.cluster, "node": tick.node, "seen_ms": tick.ts_ms, "gpu_count": len(tick.gpus),
        "gpu_uuids": [g.gpu_uuid for g in tick.gpus], "gpu_models": [g.model for g in tick.gpus],
        "source": "gpu-samples", **source.columns(),
    }


def process_message(kind: str, raw: bytes | None, source: Source, *, now_ms: int | None = None,
                    max_ahead_ms: int = 7 * DAY_MS) -> dict[str, list[dict]]:
    """Rows per table for one message of the given line (USAGE, JOB_EVENTS, SNAPSHOTS, SAMPLES).

    Watermarks give no rows (the warehouse does not need them). Raises DecodeError — also for a
    message outside the time window (streams/checks.py, the worker's rules; `now_ms` is the sink's
    clock at receipt) and for values their column cannot hold, so no insert ever sees them."""
    if raw is None:
        raise DecodeError("empty message (no value)")
    if kind == USAGE:
        rows = {"usage_raw": usage_rows(decode(UsageBatch, raw), source)}
    elif kind == JOB_EVENTS:  # what the worker accepted (lifecycle-accepted): it judged time and sequence
        message = decode_lifecycle(raw)
        if isinstance(message, LifecycleWatermark):
            return {}
        rows = {"job_events": [job_event_row(message, source)]}
    elif kind == SNAPSHOTS:  # the worker never sees these: the same checks here
        snapshot = decode(SchedulerSnapshot, raw)
        problem = time_problem(f"snapshot of {snapshot.cluster}", snapshot.ts_ms, 0, max_ahead_ms, now_ms)
        if problem:
            raise DecodeError(problem)
        rows = snapshot_rows(snapshot, source)
    elif kind == SAMPLES:
        ticks = decode_node_ticks(raw)  # one NodeTick or a node's NodeTickBatch
        for tick in ticks:
            problem = time_problem(f"tick of {tick.node}", tick.ts_ms, 0, max_ahead_ms, now_ms)
            if problem:
                raise DecodeError(problem)
        rows = {"gpu_health": [row for tick in ticks for row in health_rows(tick, source)],
                "node_inventory": [inventory_row(tick, source) for tick in ticks]}
    else:
        raise ValueError(f"unknown line {kind!r}")
    problem = rows_problem(rows)
    if problem:
        raise DecodeError(problem)
    return rows


# --------------------------------------------------------------------------- error classes
#: ClickHouse error codes that the same block can never get past (retrying it is pointless):
#: CANNOT_PARSE_* (6, 26, 27, 38, 41, 72), BAD_ARGUMENTS (36), ILLEGAL_TYPE_OF_ARGUMENT (43),
#: ILLEGAL_COLUMN (44), TYPE_MISMATCH (53), ARGUMENT_OUT_OF_BOUND (69), CANNOT_CONVERT_TYPE (70),
#: TOO_LARGE_STRING_SIZE (131), TOO_MANY_PARTITIONS for one INSERT block (252),
#: VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE (321), CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN (349),
#: DECIMAL_OVERFLOW (407). Unknown tables/columns (a migration not applied yet) stay transient.
PERMANENT_CODES = frozenset({6, 26, 27, 36, 38, 41, 43, 44, 53, 69, 70, 72, 131, 252, 321, 349, 407})
_CODE = re.compile(r"Code:\s*(\d+)")


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code of an exception (clickhouse-connect's `code`, or "Code: NNN" in the
    text, as chDB's errors carry it), or None."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    m = _CODE.search(str(exc))
    return int(m.group(1)) if m else None


def is_permanent(exc: BaseException) -> bool:
    """An insert error the same rows can never get past: a data error by its ClickHouse code, or a
    value the client cannot even serialize. Anything else (the warehouse down, a timeout, a schema
    not migrated yet) is transient and retried."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return False
    code = error_code(exc)
    if code is not None:
        return code in PERMANENT_CODES
    return isinstance(exc, (OverflowError, struct.error, TypeError, UnicodeError))


class PermanentWriteError(Exception):
    """A block's insert failed with an error that can never succeed (see `is_permanent`)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


# --------------------------------------------------------------------------- sink abstraction
class Writer(Protocol):
    """A sink backend: writes one table's block, or raises (the block is then retried). `token`
    identifies the block: a backend that sees the same token again must not store it twice."""

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None: ...


class ClickHouseWriter:
    def __init__(self, client, database: str):
        self.client = client
        self.database = database

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        settings = None
        if token is not None:
            settings = {"insert_deduplication_token": token, "insert_deduplicate": 1,
                        "deduplicate_blocks_in_dependent_materialized_views": 1}
        _insert(self.client, table, rows, self.database, settings)


def _insert(client, table: str, rows: list[dict], database: str, settings: dict | None = None) -> None:
    """One INSERT of rows given as dicts with the same keys (one block: one dedup token)."""
    if not rows:
        return
    names = list(rows[0])
    client.insert(table, [[row[n] for n in names] for row in rows], column_names=names, database=database,
                  settings=settings)


@dataclass
class Progress:
    """What the warehouse holds of one (topic, partition): offsets below `done_to` are in; the range
    [pending[0], pending[1]) may be partly in (written with its token, not yet confirmed).
    `horizons` (usage only): per GPU, the end of the latest record taken — as of `done_to`, or, when
    a range is pending, as of its start."""

    epoch: int = 0
    done_to: int = 0
    pending: tuple[int, int] | None = None
    horizons: dict[str, int] = field(default_factory=dict)


class ProgressStore(Protocol):
    def load(self, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], Progress]: ...

    def save(self, rows: list[dict]) -> None: ...


class MemoryProgress:
    """A ProgressStore in memory (unit tests)."""

    def __init__(self):
        self.rows: list[dict] = []

    def save(self, rows: list[dict]) -> None:
        self.rows.extend(dict(r) for r in rows)

    def load(self, partitions):
        out = {}
        for r in sorted(self.rows, key=lambda r: r["seq"]):
            key = (r["topic"], r["partition"])
            if key in partitions:
                out[key] = _progress_from_row(r)
        return out


def _progress_from_row(r: dict) -> Progress:
    if r["phase"] == "pending":
        return Progress(r["epoch"], r["from_offset"], (r["from_offset"], r["to_offset"]), dict(r["horizons"]))
    return Progress(r["epoch"], r["to_offset"], None, dict(r["horizons"]))


class ClickHouseProgress:
    """The `sink_progress` table (sql/0009): the latest row per (consumer, topic, partition) wins."""

    TABLE = "sink_progress"

    def __init__(self, client, database: str, consumer: str):
        self.client, self.database, self.consumer = client, database, consumer

    def save(self, rows: list[dict]) -> None:
        _insert(self.client, self.TABLE, [{**r, "consumer": self.consumer} for r in rows], self.database)

    def load(self, partitions):
        wanted = set(partitions)
        result = self.client.query(
            f"SELECT topic, partition, argMax(epoch, seq) AS epoch, argMax(from_offset, seq) AS from_offset, "
            f"argMax(to_offset, seq) AS to_offset, argMax(phase, seq) AS phase, argMax(horizons, seq) AS horizons, "
            f"max(seq) AS last_seq FROM `{self.database}`.{self.TABLE} WHERE consumer = {{c:String}} "
            f"GROUP BY topic, partition", parameters={"c": self.consumer})
        return {(r["topic"], r["partition"]): _progress_from_row(r)
                for r in result.named_results() if (r["topic"], r["partition"]) in wanted}


class SimulatedOutage(ConnectionError):
    """Raised by `FaultInjectingWriter` while its control file says the warehouse is down."""


class FaultInjectingWriter:
    """Testing only (GPULEDGER_SINK_FAULT_FILE): reads its control file before every write.

    `down` — the write fails (the warehouse is unavailable); `pause-before-insert` /
    `pause-after-insert` — the sink writes `<file>.paused` and sleeps, before or after inserting
    into usage_raw, so that a test can kill it there. Anything else (or no file): pass through."""

    def __init__(self, inner: Writer, control: Path):
        self.inner, self.control = inner, Path(control)

    def _mode(self) -> str:
        try:
            return self.control.read_text().strip()
        except OSError:
            return ""

    def _pause(self, where: str) -> None:
        Path(f"{self.control}.paused").write_text(f"{where} pid {os.getpid()}\n")
        log.warning("fault injection: paused %s; waiting to be killed", where)
        while self._mode().startswith("pause"):
            time.sleep(0.1)

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        mode = self._mode()
        if mode == "down":
            raise SimulatedOutage("fault injection: the warehouse is unavailable")
        if table == "usage_raw" and mode == "pause-before-insert":
            self._pause("before inserting into usage_raw")
        self.inner.write(table, rows, token=token)
        if table == "usage_raw" and mode == "pause-after-insert":
            self._pause("after inserting into usage_raw")


@dataclass
class _Buffer:
    """Rows of one partition not yet written: messages [first, next)."""

    first: int | None = None
    next: int = 0
    rows: dict[str, list[dict]] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)  # horizons including the buffered rows
    count: int = 0


@dataclass
class BatchingSink:
    """Rows buffered per (topic, partition), written in blocks at recorded offset ranges.

    `add()` takes one message's rows (or none: watermark, dead letter) and returns False for a
    message the warehouse already holds (skipped). `flush()` writes every buffered partition —
    pending progress rows, one insert per table with the block's token, done progress rows,
    retrying each step until it succeeds — and returns (rows written per table, offsets to commit).
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
    #: called with (key, offset, table, rows, reason) for a message whose rows a table can never
    #: take (found by splitting the failed block); the run loop dead-letters it
    on_poison: Callable[[tuple[str, int], int, str, list[dict], str], None] | None = None
    #: called once a write succeeds after failures (the run loop resumes its paused partitions)
    on_recovered: Callable[[], None] | None = None
    _state: dict[tuple[str, int], Progress] = field(default_factory=dict, init=False)
    _buffers: dict[tuple[str, int], _Buffer] = field(default_factory=dict, init=False)
    _since: float | None = field(default=None, init=False)
    _reported: dict[tuple[str, int], int] = field(default_factory=dict, init=False)
    buffered: int = field(default=0, init=False)
    skipped_duplicates: int = field(default=0, init=False)
    dropped_records: int = field(default=0, init=False)
    retries: int = field(default=0, init=False)
    poisoned: int = field(default=0, init=False)
    splits: int = field(default=0, init=False)

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
        if buf:
            self.buffered -= buf.count

    # -- input
    def add(self, rows_by_table: dict[str, list[dict]], source: Source, origin: tuple[int, int] | None = None) -> bool:
        """`origin`: (partition, offset) of the job-events message a lifecycle-accepted message repeats;
        one at or below an origin already taken is a worker's re-emission and gives no rows."""
        key = (source.topic, source.partition)
        state = self._state.setdefault(key, Progress())
        buf = self._buffers.get(key)
        if source.offset < state.done_to or (buf is not None and source.offset < buf.next):
            self.skipped_duplicates += 1
            return False
        if state.pending and buf is not None and source.offset >= state.pending[1]:
            self.flush_partition(key)  # the replayed range is complete (its end was a gap)
            buf = None
        if buf is None:
            buf = self._buffers[key] = _Buffer(first=source.offset, next=source.offset,
                                              running=dict(state.horizons))
        if source.topic == self.usage_topic and "usage_raw" in rows_by_table:
            rows_by_table = {**rows_by_table, "usage_raw": self._new_usage(rows_by_table["usage_raw"], buf.running)}
        if origin is not None:
            mark = f"source:{origin[0]}"
            if origin[1] < buf.running.get(mark, 0):
                self.dropped_records += sum(len(r) for r in rows_by_table.values())
                rows_by_table = {}
            else:
                buf.running[mark] = origin[1] + 1
        for table, rows in rows_by_table.items():
            if rows:
                buf.rows.setdefault(table, []).extend(rows)
                buf.count += len(rows)
                self.buffered += len(rows)
        buf.next = source.offset + 1
        if self._since is None:
            self._since = self.clock()
        if state.pending and buf.next >= state.pending[1]:
            self.flush_partition(key)  # a pending range is written again exactly as it was cut
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

    def due(self) -> bool:
        if self._since is None:
            return False
        return self.buffered >= self.batch_rows or self.clock() - self._since >= self.batch_interval_s

    # -- output
    def flush(self) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
        """Write every buffered partition; returns (rows written per table, offsets to commit)."""
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

    def flush_partition(self, key) -> dict[str, int]:
        return self._write_blocks([key])

    def _write_blocks(self, keys) -> dict[str, int]:
        written: dict[str, int] = {}
        plans = []
        for key in keys:
            buf = self._buffers.get(key)
            if buf is None:
                continue
            state = self._state[key]
            start, end = buf.first, buf.next
            if state.pending and state.pending[0] == start and end < state.pending[1]:
                end = state.pending[1]  # the rest of a pending range was a gap (no messages)
            plans.append((key, buf, state, start, end))
        if not plans:
            return written
        pending_rows = [self._row(key, state.epoch, start, end, "pending", state.horizons)
                        for key, buf, state, start, end in plans]
        self._retry(lambda: self.progress.save(pending_rows), "recording a pending block")
        for key, buf, state, start, end in plans:
            for table, rows in buf.rows.items():
                token = f"{key[0]}/{key[1]}/e{state.epoch}/{start}-{end}/{table}"
                n = self._write_table(key, table, rows, token)
                written[table] = written.get(table, 0) + n
        done_rows = [self._row(key, state.epoch, start, end, "done", buf.running)
                     for key, buf, state, start, end in plans]
        self._retry(lambda: self.progress.save(done_rows), "recording a done block")
        for key, buf, state, start, end in plans:
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
                    self.on_poison(key, offsets[0], table, rows, reason)
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
                delay = min(self.backoff_max_s, self.backoff_s * 2**attempt)
                attempt += 1
                self.retries += 1
                log.warning("%s failed (%s: %s); retry %d in %.1fs", what, type(exc).__name__, exc, attempt, delay)
                self.sleep(delay)


# --------------------------------------------------------------------------- the Kafka loop
@dataclass
class SinkStats:
    messages: int = 0
    skipped: int = 0  # decoded, nothing to store (watermarks, empty batches)
    dead_letters: int = 0
    batches: int = 0
    duplicates: int = 0  # messages the warehouse already held (redelivered after a restart)
    rows: dict[str, int] = field(default_factory=dict)
    assignments: int = 0  # partition assignments received (1 when the sink never left its group)
    retries: int = 0  # warehouse steps retried (transient errors)

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "rows": dict(self.rows),
            "dead_letters": self.dead_letters,
            "skipped": self.skipped,
            "batches": self.batches,
            "duplicates": self.duplicates,
            "assignments": self.assignments,
            "retries": self.retries,
        }


def _lines(settings: Settings) -> dict[str, str]:
    t = settings.topics
    # job events come from lifecycle-accepted: only what the worker's router accepted (one set of rules)
    return {t.usage: USAGE, t.lifecycle_accepted: JOB_EVENTS, t.scheduler_snapshots: SNAPSHOTS,
            t.gpu_samples: SAMPLES}


def sink_topics(settings: Settings) -> list[str]:
    """The topics the sink consumes (what callers wait on to know the warehouse is complete)."""
    return list(_lines(settings))


def run_sink(
    settings: Settings,
    *,
    stop: threading.Event | None = None,
    until_caught_up: bool = False,
    idle_s: float = 2.0,
    batch_rows: int = 20000,
    batch_interval_s: float = 1.0,
    client=None,
) -> dict:
    """Consume the usage, job-events, scheduler-snapshots and gpu-samples topics into the warehouse.

    Runs until `stop` is set, or with `until_caught_up=True` until every partition of those
    topics is committed up to its end offset and nothing arrived for `idle_s`. Without `client`
    it connects to the configured warehouse, applies pending migrations and closes the client
    at the end; a given client is used as is (already migrated) and left open.
    Returns {"messages", "rows": {table: n}, "dead_letters", "skipped", "batches", "duplicates"}."""
    from gpuledger.metrics import InstrumentedWriter, sink_metrics
    from gpuledger.warehouse import connect, migrate

    _dump_stacks_on_sigusr1()
    metrics = sink_metrics()
    stop = stop or threading.Event()
    lines = _lines(settings)
    own_client = client is None
    if own_client:
        client = connect(settings)
    kafka = settings.kafka_client_config()
    group = f"{settings.worker_app_id}-sink"
    assigned: list[tuple[str, int]] = []
    revoked: list[tuple[str, int]] = []

    def on_assign(_consumer, partitions):
        assigned.extend((tp.topic, tp.partition) for tp in partitions)

    def on_revoke(_consumer, partitions):
        revoked.extend((tp.topic, tp.partition) for tp in partitions)

    consumer = Consumer(
        {
            **kafka,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": settings.kafka_fetch_max_wait_ms,  # see the setting: a hop's worst case
            **_group_timeouts(settings),
        }
    )
    producer = Producer({**kafka, "enable.idempotence": False, "linger.ms": 5})
    stats = SinkStats()
    delivery_errors: list[str] = []
    max_ahead_ms = int(settings.worker_max_ahead_s * 1000)  # the worker's window (one set of rules)
    try:
        if own_client:
            migrate(client, settings.database)
            # Reopen after migrating: on chDB 26.9 a materialized view created in this session
            # deduplicates a block by another token than the same view opened afresh, so a block
            # written again after a crash (same insert_deduplication_token) was counted twice by the
            # views though once by usage_raw (docs/reliability.md, "Fault injection").
            client.close()
            client = connect(settings)
        partitions = _partitions(consumer, list(lines))
        writer: Writer = ClickHouseWriter(client, settings.database)
        if settings.sink_fault_file:
            writer = FaultInjectingWriter(writer, settings.sink_fault_file)
        writer = InstrumentedWriter(writer)  # rows inserted, insert failures and time, per table
        paused: list[TopicPartition] = []
        reread: dict[tuple[str, int], int] = {}  # messages polled while paused: read them again

        def wait_polling(delay: float) -> None:
            """The backoff between retries of a failed warehouse write: the partitions are paused and
            the consumer keeps polling, so the group keeps the sink as a member however long the
            outage lasts (max.poll.interval.ms)."""
            if not paused:
                try:
                    paused.extend(consumer.assignment())
                    consumer.pause(paused)
                except KafkaException as exc:
                    log.warning("could not pause the partitions: %s", exc)
                log.warning("warehouse writes failing: %d partitions paused, polling on", len(paused))
            deadline = time.monotonic() + delay
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for msg in consumer.consume(num_messages=100, timeout=min(0.5, left)):
                    if msg.error() is None:
                        key = (msg.topic(), msg.partition())
                        reread[key] = min(reread.get(key, msg.offset()), msg.offset())
                producer.poll(0)

        def recovered() -> None:
            if not paused:
                return
            try:
                consumer.resume(paused)
                for (t, p), offset in reread.items():
                    consumer.seek(TopicPartition(t, p, offset))
            except KafkaException as exc:  # a partition revoked meanwhile: the next assignment sorts it out
                log.warning("resuming the partitions: %s", exc)
            log.warning("warehouse writes succeed again: %d partitions resumed", len(paused))
            paused.clear()
            reread.clear()

        def poisoned(key, offset, table, rows, reason) -> None:
            stats.dead_letters += 1
            metrics.dead_letter(key[0], reason)
            produce_letter(key[0], key[1], offset, None, orjson.dumps(rows, default=str), reason)

        sink = BatchingSink(writer, ClickHouseProgress(client, settings.database, group), batch_rows=batch_rows,
                            batch_interval_s=batch_interval_s, backoff_max_s=settings.sink_retry_max_s,
                            usage_topic=settings.topics.usage, should_stop=stop.is_set, sleep=wait_polling,
                            on_poison=poisoned, on_recovered=recovered)
        consumer.subscribe(list(lines), on_assign=on_assign, on_revoke=on_revoke)

        def on_delivery(err, _msg):
            if err is not None:
                delivery_errors.append(str(err))

        def produce_letter(topic, partition, offset, key, raw, reason) -> None:
            log.warning("dead letter %s[%d]@%d: %s", topic, partition, offset, reason[:500])
            value = dead_letter(topic, partition, offset, raw, reason, seen_ms=int(time.time() * 1000),
                                max_bytes=settings.dead_letter_max_bytes)
            while True:
                try:
                    producer.produce(settings.topics.dead_letters, key=key, value=value, on_delivery=on_delivery)
                    return
                except BufferError:
                    producer.poll(0.5)

        def confirm_letters() -> None:
            # dead letters must be durable before their offsets are committed
            if producer.flush(30) > 0 or delivery_errors:
                raise RuntimeError(f"could not deliver dead letters to {settings.topics.dead_letters}: {delivery_errors[:3]}")

        def flush_and_commit() -> None:
            confirm_letters()
            written, offsets = sink.flush()
            recovered()
            confirm_letters()  # those of rows the warehouse refused
            metrics.batch_flushed(written)
            if written:
                stats.batches += 1
                for table, n in written.items():
                    stats.rows[table] = stats.rows.get(table, 0) + n
            if offsets:
                try:
                    consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)
                except KafkaException as exc:
                    # harmless: the progress table, not the committed offset, says what the warehouse holds
                    log.warning("could not commit offsets (%s); the progress table covers them", exc)
                    sink.commit_failed(offsets)

        def rebalanced() -> None:
            if revoked:
                sink.revoke(list(revoked))
                revoked.clear()
            if assigned:
                gained = list(assigned)
                assigned.clear()
                stats.assignments += 1
                sink.assign(gained)
                recovered()
                refuse_recreated(consumer, sink, gained)

        last_message = time.monotonic()
        last_check = 0.0
        while not stop.is_set():
            messages = consumer.consume(num_messages=500, timeout=0.2)
            rebalanced()
            for msg in messages:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    if err.fatal():
                        raise RuntimeError(f"Kafka consumer failed: {err}")
                    log.warning("consumer error: %s", err)
                    continue
                last_message = time.monotonic()
                stats.messages += 1
                metrics.message_in(msg.topic())
                source = Source(msg.topic(), msg.partition(), msg.offset())
                try:
                    rows = process_message(lines[msg.topic()], msg.value(), source, now_ms=int(time.time() * 1000),
                                           max_ahead_ms=max_ahead_ms)
                except Exception as exc:  # any failure to turn the message into rows is its own fault
                    reason = str(exc) if isinstance(exc, DecodeError) else f"cannot convert: {type(exc).__name__}: {exc}"
                    rows = None
                else:
                    reason = None
                if not sink.add(rows or {}, source, origin=_origin(msg) if lines[msg.topic()] == JOB_EVENTS else None):
                    stats.duplicates += 1
                    metrics.duplicate()
                    continue
                if reason is not None:
                    metrics.dead_letter(msg.topic(), reason)
                    produce_letter(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), reason)
                    stats.dead_letters += 1
                elif not any(rows.values()):
                    stats.skipped += 1
                if sink.buffered >= batch_rows:
                    flush_and_commit()
            producer.poll(0)
            if sink.due():
                flush_and_commit()
            now = time.monotonic()
            if until_caught_up and now - last_message >= idle_s and now - last_check >= 0.5:
                last_check = now
                flush_and_commit()
                if _caught_up(consumer, partitions):
                    break
        flush_and_commit()
        stats.retries = sink.retries
    finally:
        consumer.close()
        producer.flush(10)
        if own_client:
            client.close()
    return stats.as_dict()


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr (diagnosing a stuck sink or worker)."""
    import faulthandler
    import signal

    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _group_timeouts(settings: Settings) -> dict:
    """A group join waits up to the rebalance timeout (librdkafka: max.poll.interval.ms) for
    members; Tansu holds it for a good part of that, so keep it short (worker_rebalance_timeout_s).
    librdkafka wants max.poll.interval.ms >= session.timeout.ms, and Kafka's minimum session is 6 s."""
    rebalance_ms = int(settings.worker_rebalance_timeout_s * 1000)
    session_ms = max(6000, min(rebalance_ms, 45000))
    return {"session.timeout.ms": session_ms, "max.poll.interval.ms": max(rebalance_ms, session_ms)}


def _partitions(consumer: Consumer, topics: list[str]) -> list[TopicPartition]:
    meta = consumer.list_topics(timeout=30)
    missing = [t for t in topics if t not in meta.topics or meta.topics[t].error is not None]
    if missing:
        raise RuntimeError(f"topics missing: {', '.join(missing)} (create them first: gpuledger topics create)")
    return [TopicPartition(t, p) for t in topics for p in sorted(meta.topics[t].partitions)]


def _caught_up(consumer: Consumer, partitions: list[TopicPartition]) -> bool:
    """Every partition's committed offset (for this group) is at its end offset."""
    try:
        committed = {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(partitions, timeout=10)}
        ends = [consumer.get_watermark_offsets(tp, timeout=10, cached=False) for tp in partitions]
    except KafkaException as exc:  # e.g. the coordinator is busy with a group join: ask again later
        log.debug("cannot tell whether the sink caught up yet: %s", exc)
        return False
    for tp, (low, high) in zip(partitions, ends):
        position = committed.get((tp.topic, tp.partition), OFFSET_INVALID)
        if position < 0:  # nothing committed yet: only an empty partition is caught up
            position = low
        if position < high:
            return False
    return True


def _origin(msg) -> tuple[int, int] | None:
    """(partition, offset) of the job-events message a lifecycle-accepted message repeats (its
    `gpuledger-source` header, set by the worker), or None."""
    for name, value in msg.headers() or ():
        if name == SOURCE_HEADER and value:
            try:
                partition, offset = value.decode().split(":")
                return int(partition), int(offset)
            except ValueError:
                return None
    return None


class RecreatedTopicError(RuntimeError):
    """A partition holds fewer messages than the warehouse already took from it."""


def refuse_recreated(consumer: Consumer, sink: "BatchingSink", partitions: list[tuple[str, int]],
                     confirm_s: float = 1.0) -> None:
    """Refuse to go on when a partition was recreated: the group has no committed offset for it (Kafka
    drops a deleted topic's offsets) AND it ends below the offset the progress table records as
    written; its new messages would otherwise be skipped silently as "already in the warehouse".
    Both signs are needed: a broker can report an end below its log's after a fault (Tansu does,
    for long), and committed offsets expire in a group idle for longer than the broker's offset
    retention, while the topic itself is intact. Asked twice, `confirm_s` apart."""
    suspects = {key: sink.progress_of(key).done_to for key in partitions if sink.progress_of(key).done_to > 0}
    if not suspects:
        return
    try:
        committed = consumer.committed([TopicPartition(t, p) for t, p in suspects], timeout=10)
    except KafkaException as exc:
        log.debug("cannot read committed offsets to check for recreated topics: %s", exc)
        return
    suspects = {(tp.topic, tp.partition): suspects[(tp.topic, tp.partition)] for tp in committed if tp.offset < 0}
    for attempt in range(2):
        still = {}
        for (topic, partition), done_to in suspects.items():
            try:
                _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
            except KafkaException as exc:
                log.debug("cannot check %s[%d]'s end offset: %s", topic, partition, exc)
                continue
            if high < done_to:
                still[(topic, partition)] = (high, done_to)
        if not still:
            return
        suspects = {key: done for key, (_high, done) in still.items()}
        if attempt == 0:
            time.sleep(confirm_s)
    (topic, partition), (high, done_to) = next(iter(still.items()))
    raise RecreatedTopicError(
        f"{topic}[{partition}] ends at offset {high}, but the warehouse already holds its messages up to offset "
        f"{done_to} (sink_progress): the topic was recreated or truncated, and its new messages would be skipped. "
        f"Either start a new epoch for it (insert a sink_progress row for this consumer, topic and partition with "
        f"a higher epoch and seq, from_offset = to_offset = 0, phase 'done') or empty sink_progress together with "
        f"the warehouse; see docs/reliability.md, 'Exactly-once into ClickHouse'.")
