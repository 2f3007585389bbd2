"""`gpuledger watch` and `gpuledger tail alerts`: the watcher's process and an example consumer.

The process moves messages through the pure watcher (streams/watch.py) and nothing more. It reads
every partition of the ledger's usage output, of the lifecycle events the worker accepted and of
the scheduler snapshots, and publishes alerts (`<prefix>alerts`, key: job id) and reclaim
suggestions (`<prefix>reclaim-suggestions`, key: queue).

Crash safety, as the worker's (docs/reliability.md "Worker state", docs/alerts.md "Process"): the
watcher's state is one document (its rules need a job's usage, which is keyed by node, and its
lifecycle, keyed by job, together), holding the input offsets it covers. Every
`worker_snapshot_interval_s` the process (1) waits until every alert and suggestion sent so far is
acknowledged by the broker, (2) writes the state to the compacted `<prefix>watch-state` topic and
waits for it, and only then (3) commits those offsets to its consumer group (for lag and for "done";
the snapshot's own offsets are what a restart resumes from). After a crash the state is restored
from the latest snapshot and the input after it is read again: the same alerts come out with the
same ids, which consumers keep one of (latest per alert_id). Run one watch process per ledger.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import TextIO

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, Producer, TopicPartition

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.app import read_last_snapshot
from gpuledger.streams.pricing import LedgerConfig
from gpuledger.streams.watch import Watcher

log = logging.getLogger(__name__)

STATE_KEY = b"watch"
#: exit status when outputs or the snapshot could not be confirmed (the supervisor restarts it)
EXIT_RECOVER = 75
#: --until-caught-up: the input is consumed when nothing came for this long and no partition's end
#: is beyond what was read (a broker may report an end below its log's: Tansu, for batches)
CAUGHT_UP_IDLE_S = 2.0


class WatchError(RuntimeError):
    """The watcher could not confirm its outputs or its snapshot; restart it from the last snapshot."""


def watch_group(settings: Settings) -> str:
    """The watcher's consumer group (its committed offsets show its lag)."""
    return f"{settings.worker_app_id}-watch"


def watch_inputs(settings: Settings) -> list[str]:
    t = settings.topics
    return [t.usage, t.lifecycle_accepted, t.scheduler_snapshots]


def make_watcher(settings: Settings, ledger: LedgerConfig) -> Watcher:
    t = settings.topics
    return Watcher(ledger.watch, currency=ledger.currency,
                   alerts_topic=t.alerts, suggestions_topic=t.reclaim_suggestions, usage_topic=t.usage,
                   lifecycle_topic=t.lifecycle_accepted, snapshots_topic=t.scheduler_snapshots)


class _Deliveries:
    """Counts outputs not yet acknowledged by the broker and remembers the first failure."""

    def __init__(self):
        self.error: str | None = None

    def __call__(self, err, msg) -> None:
        if err is not None and self.error is None:
            self.error = f"{msg.topic()}: {err}"


def run_watch(settings: Settings, *, ledger: LedgerConfig | None = None, stop: threading.Event | None = None,
              until_caught_up: bool = False) -> dict:
    """Run the watcher until `stop` is set (`gpuledger watch`: on SIGTERM/SIGINT) or, with
    until_caught_up, every input partition is consumed to its end. Returns its counters."""
    ledger = ledger or load_ledger_config(settings.ledger_config)
    stop = stop or threading.Event()
    watcher = make_watcher(settings, ledger)
    t = settings.topics
    watcher.restore(read_last_snapshot(settings, 0, topic=t.watch_state))
    client = settings.kafka_client_config()
    consumer = Consumer({**client, "group.id": watch_group(settings), "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", "fetch.wait.max.ms": settings.kafka_fetch_max_wait_ms})
    # One message per batch: Tansu reports a partition's end as the last batch's start + 1, which
    # readers that stop at the end (read_topic, lag) would take for the end of alerts sent together.
    # Alerts are few; the batches cost nothing that matters.
    producer = Producer({**client, "acks": "all", "linger.ms": 0, "batch.num.messages": 1,
                         "message.max.bytes": 16 * 1024 * 1024})
    deliveries = _Deliveries()
    try:
        metadata = consumer.list_topics(timeout=30)
        parts = []
        for topic in watch_inputs(settings):
            if topic not in metadata.topics:
                raise RuntimeError(f"topic {topic} does not exist: run `gpuledger topics create`")
            for p in sorted(metadata.topics[topic].partitions):
                parts.append(TopicPartition(topic, p, watcher.next_offsets.get(topic, {}).get(p, OFFSET_BEGINNING)))
        consumer.assign(parts)
        log.info("watch: %d input partitions, restored from %s", len(parts),
                 "a snapshot" if watcher.next_offsets else "nothing (fresh)")
        dirty = False
        last_snapshot = last_message = time.monotonic()
        while not stop.is_set():
            msg = consumer.poll(0.2)
            if msg is not None:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("watch: %s", msg.error())
                else:
                    watcher.counters["messages"] += 1
                    try:
                        outs = watcher.on_message(msg.topic(), msg.partition(), msg.offset(), msg.value())
                    except Exception:  # a bug must not stop the watcher: the message is skipped and counted
                        log.exception("watch: cannot process %s[%d]@%d", msg.topic(), msg.partition(), msg.offset())
                        watcher.counters["errors"] += 1
                        outs = []
                    for out in outs:
                        producer.produce(out.topic, out.value, key=out.key, on_delivery=deliveries)
                    dirty = True
                producer.poll(0)
            if dirty and time.monotonic() - last_snapshot >= settings.worker_snapshot_interval_s:
                _snapshot(settings, watcher, consumer, producer, deliveries)
                dirty, last_snapshot = False, time.monotonic()
            if msg is not None:
                last_message = time.monotonic()
            elif until_caught_up and time.monotonic() - last_message > CAUGHT_UP_IDLE_S and \
                    _caught_up(consumer, watcher, parts):
                break
        if dirty:
            _snapshot(settings, watcher, consumer, producer, deliveries)
    finally:
        consumer.close()
    return dict(watcher.counters)


def _snapshot(settings: Settings, watcher: Watcher, consumer: Consumer, producer: Producer,
              deliveries: _Deliveries) -> None:
    """Outputs confirmed, then the state, then the offsets it covers committed."""
    if producer.flush(60) or deliveries.error:
        raise WatchError(f"could not confirm the watcher's outputs: {deliveries.error or 'flush timed out'}")
    producer.produce(settings.topics.watch_state, watcher.snapshot(), key=STATE_KEY, partition=0,
                     on_delivery=deliveries)
    if producer.flush(60) or deliveries.error:
        raise WatchError(f"could not write the watcher's snapshot: {deliveries.error or 'flush timed out'}")
    watcher.counters["snapshots"] += 1
    offsets = [TopicPartition(topic, p, o) for topic, ps in watcher.next_offsets.items() for p, o in ps.items()]
    if offsets:
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
        except Exception as exc:  # only lag reporting depends on it; the snapshot holds the offsets
            log.warning("watch: committing offsets failed: %s", exc)


def _caught_up(consumer: Consumer, watcher: Watcher, parts: list[TopicPartition]) -> bool:
    for tp in parts:
        _, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10, cached=False)
        if watcher.next_offsets.get(tp.topic, {}).get(tp.partition, 0) < high and high > 0:
            return False
    return True


# ---------------------------------------------------------------------------- tail
def _line(topic: str, doc: dict) -> str:
    when = lambda ms: time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) if ms else "-"  # noqa: E731
    if "alert_id" in doc:
        at = doc["closed_at_ms"] if doc["status"] == "closed" else doc["opened_at_ms"]
        return (f"{when(at)} ALERT {doc['status'].upper():6} {doc['rule']:9} {doc['cluster']}/{doc['job_id']}"
                f"#{doc['attempt']} tenant={doc['tenant']} gpus={','.join(doc['gpus'])}: {doc['message']}")
    if "suggestion_id" in doc:
        at = doc["withdrawn_at_ms"] if doc["status"] == "withdrawn" else doc["opened_at_ms"]
        jobs = ",".join(j["job_id"] for j in doc["jobs"])
        return (f"{when(at)} RECLAIM {doc['status'].upper():9} {doc['cluster']}/{doc['queue']} "
                f"rate={doc['execution_rate']:.0%} jobs={jobs} frees={doc['gpus_freed']:g}: {doc['message']}")
    return f"{topic}: {json.dumps(doc)}"


def tail_alerts(settings: Settings, *, out: TextIO = sys.stdout, as_json: bool = False, from_beginning: bool = False,
                max_messages: int | None = None, idle_timeout_s: float | None = None,
                stop: threading.Event | None = None) -> int:
    """Print alerts and reclaim suggestions as they arrive (a downstream consumer of the ledger's
    output topics, on confluent-kafka). Returns how many it printed."""
    t = settings.topics
    consumer = Consumer({**settings.kafka_client_config(), "group.id": f"{settings.worker_app_id}-tail-{time.time_ns()}",
                         "enable.auto.commit": False})
    printed, last = 0, time.monotonic()
    try:
        # assigned, not subscribed: a printer needs no group (and waits for no group join)
        metadata = consumer.list_topics(timeout=30)
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for topic in (t.alerts, t.reclaim_suggestions)
                         if topic in metadata.topics for p in sorted(metadata.topics[topic].partitions)])
        while not (stop and stop.is_set()):
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                if idle_timeout_s is not None and time.monotonic() - last > idle_timeout_s:
                    break
                continue
            last = time.monotonic()
            try:
                doc = json.loads(msg.value())
            except ValueError:
                continue
            out.write((json.dumps(doc, sort_keys=True) if as_json else _line(msg.topic(), doc)) + "\n")
            out.flush()
            printed += 1
            if max_messages is not None and printed >= max_messages:
                break
    finally:
        consumer.close()
    return printed
