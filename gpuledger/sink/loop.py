"""The sink's Kafka loop: consume the ledger's output topics, convert, batch, write, commit.

Why one file: the loop's steps (pausing during an outage, dead letters, rebalances, closing a pending
range, the caught-up check, the recreated-topic check) all act on the one consumer and sink it holds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from gpuledger.config import Settings
from gpuledger.schemas.wire import DecodeError
from gpuledger.streams.checks import dead_letter
from gpuledger.streams.core import SOURCE_HEADER
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import ClickHouseProgress
from gpuledger.sink.rows import JOB_EVENTS, PROGRESS, SAMPLES, SNAPSHOTS, USAGE, Source, process_message
from gpuledger.sink.letters import DeadLetterOutbox
from gpuledger.sink.writer import ClickHouseWriter, StoredHealth, Writer
from gpuledger.sink.rows import ALERTS, SUGGESTIONS

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the Kafka loop
@dataclass
class SinkStats:
    messages: int = 0
    skipped: int = 0  # decoded, nothing to store (watermarks, empty batches)
    dead_letters: int = 0
    batches: int = 0
    duplicates: int = 0  # messages the warehouse already held (redelivered after a restart)
    duplicate_rows: int = 0  # gpu_health rows of ticks an agent sent again (already stored)
    reemitted_rows: int = 0  # usage records and accepted job events a restarted worker emitted again
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
            "duplicate_rows": self.duplicate_rows,
            "reemitted_rows": self.reemitted_rows,
            "assignments": self.assignments,
            "retries": self.retries,
        }


def _lines(settings: Settings) -> dict[str, str]:
    t = settings.topics
    # job events come from lifecycle-accepted: only what the worker's router accepted (one set of rules)
    return {t.usage: USAGE, t.lifecycle_accepted: JOB_EVENTS, t.scheduler_snapshots: SNAPSHOTS,
            t.gpu_samples: SAMPLES, t.job_progress: PROGRESS,
            t.alerts: ALERTS, t.reclaim_suggestions: SUGGESTIONS}


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
    wrap_writer: Callable[[Writer], Writer] | None = None,
) -> dict:
    """Consume the usage, job-events, scheduler-snapshots, gpu-samples and job-progress topics into the warehouse.

    Runs until `stop` is set, or with `until_caught_up=True` until every partition of those
    topics is committed up to its end offset and nothing arrived for `idle_s`. Without `client`
    it connects to the configured warehouse, applies pending migrations and closes the client
    at the end; a given client is used as is (already migrated) and left open. `wrap_writer` wraps
    the ClickHouse writer (the tests' fault injection: tests/sink_faults.py).
    Returns {"messages", "rows": {table: n}, "dead_letters", "skipped", "batches", "duplicates",
    "duplicate_rows", "reemitted_rows", "assignments", "retries"}."""
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
    letters = DeadLetterOutbox(producer, settings.topics.dead_letters)
    max_ahead_ms = int(settings.worker_max_ahead_s * 1000)  # the worker's window (one set of rules)
    clock_ahead_ms = int(settings.max_clock_ahead_s * 1000)
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
        if wrap_writer is not None:
            writer = wrap_writer(writer)
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
                if revoked:
                    # a rebalance during the wait: the block being written must leave those partitions
                    # to their new owner (BatchingSink skips a revoked partition's buffer); `rebalanced`
                    # sees them again and handles the assignment
                    sink.revoke(list(revoked))
                producer.poll(0)
                metrics.measure_lag(consumer, paused=True)  # the lag grows while the warehouse is down

        def recovered() -> None:
            if not paused:
                return
            try:
                consumer.resume(paused)
            except KafkaException as exc:  # a partition revoked meanwhile: the next assignment sorts it out
                log.warning("resuming the partitions: %s", exc)
            # each on its own: one revoked partition's refusal must not leave another's messages read
            # during the wait unread (its position is past them: they would be recorded done, unwritten)
            for (t, p), offset in reread.items():
                try:
                    consumer.seek(TopicPartition(t, p, offset))
                except KafkaException as exc:
                    log.warning("seeking %s[%d] back to %d: %s", t, p, offset, exc)
            log.warning("warehouse writes succeed again: %d partitions resumed", len(paused))
            paused.clear()
            reread.clear()

        def poisoned(key, offset, table, rows, reason, message_key) -> None:  # its rows as original, its key
            stats.dead_letters += 1
            metrics.dead_letter(key[0], reason, settings.topics.dead_letters)
            produce_letter(key[0], key[1], offset, message_key, _letter_original(rows), reason)

        sink = BatchingSink(writer, ClickHouseProgress(client, settings.database, group), batch_rows=batch_rows,
                            batch_interval_s=batch_interval_s, backoff_max_s=settings.sink_retry_max_s,
                            usage_topic=settings.topics.usage, should_stop=stop.is_set, sleep=wait_polling,
                            on_poison=poisoned, on_recovered=recovered, confirm_letters=letters.confirm,
                            stored_health=StoredHealth(client, settings.database))
        consumer.subscribe(list(lines), on_assign=on_assign, on_revoke=on_revoke)

        def produce_letter(topic, partition, offset, key, raw, reason) -> None:
            # delivered and confirmed before the block holding the message is recorded done (sink.confirm_letters)
            log.warning("dead letter %s[%d]@%d: %s", topic, partition, offset, reason[:500])
            letters.send(key, dead_letter(topic, partition, offset, raw, reason, seen_ms=int(time.time() * 1000),
                                          max_bytes=settings.dead_letter_max_bytes))

        def flush_and_commit() -> None:
            written, offsets = sink.flush()
            recovered()
            if sink.duplicate_health > stats.duplicate_rows:
                metrics.duplicate(sink.duplicate_health - stats.duplicate_rows)
                stats.duplicate_rows = sink.duplicate_health
            if sink.dropped_records > stats.reemitted_rows:  # second copies too, dropped by the horizons
                metrics.duplicate(sink.dropped_records - stats.reemitted_rows)
                stats.reemitted_rows = sink.dropped_records
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
        last_check = last_gap_check = 0.0
        short_ends: set[tuple[str, int]] = set()  # partitions ending inside a pending range (logged once)
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
                if (msg.topic(), msg.partition()) in revoked:
                    continue  # revoked during a write's wait, after this message was fetched: not ours
                last_message = time.monotonic()
                stats.messages += 1
                metrics.message_in(msg.topic())
                source = Source(msg.topic(), msg.partition(), msg.offset())
                try:
                    rows = process_message(lines[msg.topic()], msg.value(), source, now_ms=int(time.time() * 1000),
                                           max_ahead_ms=max_ahead_ms, clock_ahead_ms=clock_ahead_ms)
                except Exception as exc:  # any failure to turn the message into rows is its own fault
                    reason = str(exc) if isinstance(exc, DecodeError) else f"cannot convert: {type(exc).__name__}: {exc}"
                    rows = None
                else:
                    reason = None
                # (original, reason) of each letter: the whole message, or each rejected part of it (a
                # batch's bad ticks), every one under the message's key as the worker's letters are
                bad = [(msg.value(), reason)] if reason is not None else \
                    [(_letter_original(part), why) for why, part in getattr(rows, "rejected", None) or ()]
                letter = None
                if bad:
                    def letter(msg=msg, bad=bad) -> None:  # sent by the sink once it knows the message is new
                        for original, why in bad:
                            metrics.dead_letter(msg.topic(), why, settings.topics.dead_letters)
                            produce_letter(msg.topic(), msg.partition(), msg.offset(), msg.key(), original, why)
                            stats.dead_letters += 1
                if not sink.add(rows or {}, source, origin=_origin(msg) if lines[msg.topic()] == JOB_EVENTS else None,
                                letter=letter, message_key=msg.key()):
                    stats.duplicates += 1
                    metrics.duplicate()
                    continue
                if reason is None and not any(rows.values()):
                    stats.skipped += 1
                if sink.buffered >= batch_rows:
                    flush_and_commit()
            producer.poll(0)
            if sink.due():
                flush_and_commit()
            metrics.measure_lag(consumer, paused=bool(paused))  # every few seconds, not per message
            now = time.monotonic()
            if not until_caught_up and now - last_gap_check >= idle_s and sink.rebuilding():
                # a continuous sink too: on a quiet partition no later offset may ever come to prove the
                # rest of a pending range a gap, and the range's rows would wait for good
                last_gap_check = now
                _close_pending_past_end(consumer, sink, short_ends, timeout_s=1.0)
                flush_and_commit()
            if until_caught_up and now - last_message >= idle_s and now - last_check >= 0.5:
                last_check = now
                _close_pending_past_end(consumer, sink, short_ends)
                flush_and_commit()
                if _caught_up(consumer, partitions):
                    break
        flush_and_commit()
        stats.retries = sink.retries
    finally:
        close_consumer(consumer)
        producer.flush(10)
        if own_client:
            client.close()
    return stats.as_dict()


#: seconds the sink waits for its consumer to close (leave its group) before it goes on without it
CONSUMER_CLOSE_TIMEOUT_S = 30.0


def close_consumer(consumer, timeout_s: float = CONSUMER_CLOSE_TIMEOUT_S) -> bool:
    """`consumer.close()`, given at most `timeout_s`; False (and a warning) where it did not end by then.
    librdkafka's close leaves the group and waits for the rebalance that follows; a coordinator that never
    answers holds it for ever (seen once in CI against Tansu: a sink that had caught up hung over 10 minutes
    in close, its test with it). The close goes on in a daemon thread; the group drops the member after its
    session timeout, as it would a crashed one."""
    failed: list[BaseException] = []

    def close() -> None:
        try:
            consumer.close()
        except BaseException as exc:  # raised where the caller waits, as a close in its own thread would
            failed.append(exc)

    closing = threading.Thread(target=close, name="sink-consumer-close", daemon=True)
    closing.start()
    closing.join(timeout_s)
    if closing.is_alive():
        log.warning("the sink's Kafka consumer did not close within %.0f s (its group coordinator did not answer); "
                    "going on without it: the group drops it after its session timeout", timeout_s)
        return False
    if failed:
        raise failed[0]
    return True


def _letter_original(obj) -> bytes:
    """A dead letter's original given as a JSON value (a batch's rejected tick, rows the warehouse
    refused). orjson writes no integer beyond 64 bits, which pydantic's JSON parser reads: a tick
    holding one raised here and stopped the sink on every restart. The standard library writes it."""
    try:
        return orjson.dumps(obj, default=str)
    except TypeError:
        return json.dumps(obj, default=str, separators=(",", ":")).encode()


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


def _close_pending_past_end(consumer: Consumer, sink: BatchingSink, short_ends: set[tuple[str, int]],
                            timeout_s: float = 10.0) -> None:
    """A pending range read again waits for its last message (docs/reliability.md). When the consumer
    has had every message of the partition and its end offset is at or past the range's end, the rest
    of the range holds no messages any more (compacted, or offsets without messages): write it with
    the gap, as a later offset would have proved, rather than hold the partition for ever. A
    partition that ends inside the range (a broker reporting a short end, a truncated topic) proves
    nothing: the range stays pending and the sink is not caught up."""
    for (topic, partition), (next_offset, end) in sink.rebuilding().items():
        tp = TopicPartition(topic, partition)
        try:
            _low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
            position = consumer.position([tp])[0].offset
        except KafkaException as exc:
            log.debug("cannot tell whether %s[%d]'s pending range can still come: %s", topic, partition, exc)
            continue
        if position < high:
            continue  # messages still to come
        if high >= end:
            log.warning("%s[%d]: the pending range's messages from offset %d on never came, though the partition "
                        "ends at %d: written without them", topic, partition, next_offset, high)
            sink.flush_partition((topic, partition), gap=True)
        elif (topic, partition) not in short_ends:
            short_ends.add((topic, partition))
            log.error("%s[%d] ends at offset %d, inside the pending range that ends at %d: waiting for the rest "
                      "(a broker reporting a short end, or a truncated topic)", topic, partition, high, end)


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
