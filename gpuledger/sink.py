"""The warehouse sink: Kafka (usage, job-events, scheduler-snapshots) -> ClickHouse tables.

Three layers, each replaceable:
- pure conversion: `process_message(kind, raw, source)` turns one message into rows per table
  (or raises DecodeError) — no Kafka, no ClickHouse;
- `BatchingSink`: buffers rows per table with the source positions they came from, flushes on
  size, age or stop through a `Writer` backend, retrying with backoff when the backend fails,
  and only then reports the offsets that are safe to commit;
- `ClickHouseWriter`: the backend, one `insert_rows` per table.

Delivery is at-least-once: rows are inserted before offsets are committed, and every row keeps
its message's topic/partition/offset so duplicates can be found (and removed) later.
Undecodable messages go to the dead-letter topic with the reason and the original bytes; they
never stop the good data behind them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from gpuledger.config import Settings
from gpuledger.schemas.models import DeadLetter, JobEvent, LifecycleWatermark, SchedulerSnapshot, UsageBatch
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, encode

log = logging.getLogger(__name__)

USAGE, JOB_EVENTS, SNAPSHOTS = "usage", "job_events", "scheduler_snapshots"


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
        "gpu_uuids": [g.gpu_uuid for g in event.gpus],
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


def process_message(kind: str, raw: bytes | None, source: Source) -> dict[str, list[dict]]:
    """Rows per table for one message of the given line (USAGE, JOB_EVENTS, SNAPSHOTS).

    Watermarks give no rows (the warehouse does not need them). Raises DecodeError."""
    if raw is None:
        raise DecodeError("empty message (no value)")
    if kind == USAGE:
        return {"usage_raw": usage_rows(decode(UsageBatch, raw), source)}
    if kind == JOB_EVENTS:
        message = decode_lifecycle(raw)
        if isinstance(message, LifecycleWatermark):
            return {}
        return {"job_events": [job_event_row(message, source)]}
    if kind == SNAPSHOTS:
        return snapshot_rows(decode(SchedulerSnapshot, raw), source)
    raise ValueError(f"unknown line {kind!r}")


# --------------------------------------------------------------------------- sink abstraction
class Writer(Protocol):
    """A sink backend: writes one table's batch, or raises (the batch is then retried)."""

    def write(self, table: str, rows: list[dict]) -> None: ...


class ClickHouseWriter:
    def __init__(self, client, database: str):
        self.client = client
        self.database = database

    def write(self, table: str, rows: list[dict]) -> None:
        from gpuledger.warehouse import insert_rows

        insert_rows(self.client, table, rows, database=self.database)


@dataclass
class BatchingSink:
    """Rows buffered per table, plus the next offset per (topic, partition) they account for.

    `flush()` writes every table (retrying failures with backoff, then raising) and returns the
    offsets now safe to commit. A message with no rows (watermark, dead letter) still advances
    its partition's offset, so it is committed with the next flush."""

    writer: Writer
    batch_rows: int = 20_000
    batch_interval_s: float = 1.0
    retries: int = 3
    backoff_s: float = 0.5
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _rows: dict[str, list[dict]] = field(default_factory=dict, init=False)
    _offsets: dict[tuple[str, int], int] = field(default_factory=dict, init=False)
    _since: float | None = field(default=None, init=False)
    buffered: int = field(default=0, init=False)

    def add(self, rows_by_table: dict[str, list[dict]], source: Source) -> None:
        for table, rows in rows_by_table.items():
            if rows:
                self._rows.setdefault(table, []).extend(rows)
                self.buffered += len(rows)
        key = (source.topic, source.partition)
        self._offsets[key] = max(self._offsets.get(key, -1), source.offset + 1)
        if self._since is None:
            self._since = self.clock()

    def due(self) -> bool:
        if self._since is None:
            return False
        return self.buffered >= self.batch_rows or self.clock() - self._since >= self.batch_interval_s

    def flush(self) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
        """Write everything buffered; returns (rows written per table, offsets to commit)."""
        written: dict[str, int] = {}
        for table in list(self._rows):
            rows = self._rows[table]
            self._write_with_retry(table, rows)
            written[table] = len(rows)
            del self._rows[table]  # written: a later failure must not write it twice
            self.buffered -= len(rows)
        offsets, self._offsets, self._since = self._offsets, {}, None
        return written, offsets

    def _write_with_retry(self, table: str, rows: list[dict]) -> None:
        for attempt in range(self.retries + 1):
            try:
                self.writer.write(table, rows)
                return
            except Exception as exc:
                if attempt == self.retries:
                    raise
                delay = self.backoff_s * 2**attempt
                log.warning("writing %d rows to %s failed (%s); retrying in %.1fs", len(rows), table, exc, delay)
                self.sleep(delay)


# --------------------------------------------------------------------------- the Kafka loop
@dataclass
class SinkStats:
    messages: int = 0
    skipped: int = 0  # decoded, nothing to store (watermarks, empty batches)
    dead_letters: int = 0
    batches: int = 0
    rows: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "rows": dict(self.rows),
            "dead_letters": self.dead_letters,
            "skipped": self.skipped,
            "batches": self.batches,
        }


def _lines(settings: Settings) -> dict[str, str]:
    t = settings.topics
    return {t.usage: USAGE, t.job_events: JOB_EVENTS, t.scheduler_snapshots: SNAPSHOTS}


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
    """Consume the usage, job-events and scheduler-snapshots topics into the warehouse.

    Runs until `stop` is set, or with `until_caught_up=True` until every partition of those
    topics is committed up to its end offset and nothing arrived for `idle_s`. Without `client`
    it connects to the configured warehouse, applies pending migrations and closes the client
    at the end; a given client is used as is (already migrated) and left open.
    Returns {"messages", "rows": {table: n}, "dead_letters", "skipped", "batches"}."""
    from gpuledger.warehouse import connect, migrate

    stop = stop or threading.Event()
    lines = _lines(settings)
    own_client = client is None
    if own_client:
        client = connect(settings)
    kafka = settings.kafka_client_config()
    consumer = Consumer(
        {
            **kafka,
            "group.id": f"{settings.worker_app_id}-sink",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            **_group_timeouts(settings),
        }
    )
    producer = Producer({**kafka, "enable.idempotence": False, "linger.ms": 5})
    stats = SinkStats()
    delivery_errors: list[str] = []
    try:
        if own_client:
            migrate(client, settings.database)
        partitions = _partitions(consumer, list(lines))
        sink = BatchingSink(ClickHouseWriter(client, settings.database), batch_rows=batch_rows, batch_interval_s=batch_interval_s)
        consumer.subscribe(list(lines))

        def on_delivery(err, _msg):
            if err is not None:
                delivery_errors.append(str(err))

        def flush_and_commit() -> None:
            # dead letters must be durable before their offsets are committed
            if producer.flush(30) > 0 or delivery_errors:
                raise RuntimeError(f"could not deliver dead letters to {settings.topics.dead_letters}: {delivery_errors[:3]}")
            written, offsets = sink.flush()
            if written:
                stats.batches += 1
                for table, n in written.items():
                    stats.rows[table] = stats.rows.get(table, 0) + n
            if offsets:
                consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)

        last_message = time.monotonic()
        last_check = 0.0
        while not stop.is_set():
            messages = consumer.consume(num_messages=500, timeout=0.2)
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
                source = Source(msg.topic(), msg.partition(), msg.offset())
                try:
                    rows = process_message(lines[msg.topic()], msg.value(), source)
                except Exception as exc:  # any failure to turn the message into rows is its own fault
                    reason = str(exc) if isinstance(exc, DecodeError) else f"cannot convert: {type(exc).__name__}: {exc}"
                    _dead_letter(producer, settings, msg, reason, on_delivery)
                    stats.dead_letters += 1
                    rows = {}
                else:
                    if not any(rows.values()):
                        stats.skipped += 1
                sink.add(rows, source)
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
    finally:
        consumer.close()
        producer.flush(10)
        if own_client:
            client.close()
    return stats.as_dict()


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


def _dead_letter(producer: Producer, settings: Settings, msg, reason: str, on_delivery) -> None:
    raw = msg.value() or b""
    letter = DeadLetter(
        source_topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        reason=reason,
        original=raw.decode("utf-8", errors="replace"),
        seen_ms=int(time.time() * 1000),
    )
    log.warning("dead letter %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), reason)
    producer.produce(settings.topics.dead_letters, key=msg.key(), value=encode(letter), on_delivery=on_delivery)
