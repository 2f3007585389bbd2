"""`gpuledger watch` and `gpuledger tail alerts`: the watcher's Faust process and an example consumer.

The process moves messages through the pure watcher (streams/watch.py) and nothing more: a Faust
app (the worker's LedgerApp, streams/app.py) with one agent per input — the ledger's usage output,
the lifecycle events the worker accepted, the scheduler snapshots — feeding one `Watcher`, which
publishes alerts (`<prefix>alerts`, key: job id) and reclaim suggestions
(`<prefix>reclaim-suggestions`, key: queue).

Crash safety, as the worker's (docs/reliability.md "Worker state", docs/alerts.md "Process"): the
agents do not let Faust acknowledge their input. The watcher's state is one document (its rules need
a job's usage, keyed by node, and its lifecycle, keyed by job, together) holding the input offsets
it covers. Every `worker_snapshot_interval_s` (less often where the state has grown so large that
writing it would take over a tenth of the watcher's time: `SnapshotPacer`) a timer (1) waits until
every alert and suggestion sent so far is acknowledged by the broker, (2) writes the state to the compacted
`<prefix>watch-state` topic and waits for it, and only then (3) acknowledges the input it covers,
so Faust commits offsets that never run ahead of a durable snapshot. After a crash the state is
restored from the latest snapshot before the first message; input it covers is skipped, input
after it is read again and gives the same alerts with the same ids, which consumers keep one of
(latest per alert_id). Run one watch process per ledger: the state is one document.

Whatever would let the state run ahead of its outputs stops the watcher instead (status 75: an
alert or suggestion it could not send or confirm, a snapshot it could not read or write; 78: a
snapshot it cannot restore), so that it restarts from its last durable snapshot: an exception there
would only restart the agent, whose state is past the message, and the next snapshot would cover
alerts never sent. A usage record the watcher cannot read is left out of its batch (logged with the
reason, counted `bad_records`) before the batch is applied, so the batch's other records are
applied, each once. Before Faust starts, its topics are checked: 78 for a topic missing or with
another partition count than its setting, 75 for a broker it cannot reach.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import TextIO

import faust
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.app import exit_unless_topics_ready, new_ledger_app, read_last_snapshot
from gpuledger.streams.pricing import LedgerConfig
from gpuledger.streams.watch import Watcher
from gpuledger.topics import check_topics

log = logging.getLogger(__name__)

STATE_KEY = b"watch"
#: exit status when outputs or the snapshot could not be confirmed (the supervisor restarts it)
EXIT_RECOVER = 75
#: exit status when the last snapshot cannot be restored (another version's, or damaged)
EXIT_BAD_SNAPSHOT = 78


def stop(status: int, why: str) -> None:
    log.critical("watch: %s; exiting (status %d)", why, status)
    logging.shutdown()
    os._exit(status)


class SnapshotPacer:
    """When the watcher's timer may take a snapshot: every tick of the timer, unless the last snapshot
    took so long that one now would make snapshots more than `share` of the watcher's time. The state
    is one document that grows with the fleet (0.2 s to write at 10,000 GPUs, 3.2 s at 100,000:
    bench/watch.py) and the timer ticks every `worker_snapshot_interval_s` (2 s); meanwhile the
    watcher reads nothing. A longer gap only means more input read again after a crash."""

    def __init__(self, share: float = 0.1):
        self.share = share
        self.next_at = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def took(self, started: float, finished: float) -> None:
        self.next_at = started + (finished - started) / self.share


def watch_group(settings: Settings) -> str:
    """The watcher's Faust app id, hence its consumer group (its committed offsets show its lag)."""
    return f"{settings.worker_app_id}-watch"


def watch_inputs(settings: Settings) -> list[str]:
    t = settings.topics
    return [t.usage, t.lifecycle_accepted, t.scheduler_snapshots]


def make_watcher(settings: Settings, ledger: LedgerConfig) -> Watcher:
    t = settings.topics
    return Watcher(ledger.watch, currency=ledger.currency,
                   alerts_topic=t.alerts, suggestions_topic=t.reclaim_suggestions, usage_topic=t.usage,
                   lifecycle_topic=t.lifecycle_accepted, snapshots_topic=t.scheduler_snapshots)


def create_watch_app(settings: Settings, ledger: LedgerConfig | None = None) -> faust.App:
    ledger = ledger or load_ledger_config(settings.ledger_config)
    t = settings.topics
    # One message per batch: Tansu reports a partition's end as its last batch's start + 1, which
    # readers that stop at the end would take for the end of alerts sent together. Alerts are few.
    app = new_ledger_app(settings, watch_group(settings), str(settings.data_dir / "watch"), producer_max_batch_size=1)
    watcher = make_watcher(settings, ledger)
    app.watcher = watcher  # for tests
    raw = dict(value_serializer="raw", key_serializer="raw")
    partitions = settings.partitions()
    outputs = {name: app.topic(name, partitions=partitions[name], **raw)
               for name in (t.alerts, t.reclaim_suggestions, t.watch_state)}

    lock = asyncio.Lock()
    state = {"loaded": False, "dirty": False}
    pacer = SnapshotPacer()
    to_ack: list = []        # events a snapshot must cover before they are acknowledged
    in_flight: list = []     # delivery futures of outputs not yet confirmed

    async def handle(event) -> None:
        m = event.message
        async with lock:
            if not state["loaded"]:
                # without its state the watcher cannot go on, and an exception here would only restart
                # the agent, which then passed over this message: exit instead
                try:
                    blob = await asyncio.get_running_loop().run_in_executor(
                        None, lambda: read_last_snapshot(settings, 0, topic=t.watch_state))
                except Exception as exc:
                    stop(EXIT_RECOVER, f"cannot read its snapshot ({type(exc).__name__}: {exc})")
                try:
                    watcher.restore(blob)
                except Exception as exc:  # a restart reads it again: another status than a broker's hiccup
                    stop(EXIT_BAD_SNAPSHOT, f"cannot restore its snapshot ({type(exc).__name__}: {exc}); it was "
                                            "not written by this watcher version, or is damaged")
                state["loaded"] = True
                log.info("watch: restored from %s", "a snapshot" if blob else "nothing (fresh)")
            watcher.counters["messages"] += 1
            try:
                outs = watcher.on_message(m.topic, m.partition, m.offset, event.value, now_s=time.monotonic())
            except Exception:  # a bug must not stop the watcher: the message is skipped and counted
                log.exception("watch: cannot process %s[%d]@%d", m.topic, m.partition, m.offset)
                watcher.counters["errors"] += 1
                outs = []
            for out in outs:
                try:
                    fut = await outputs[out.topic].send(key=out.key, value=out.value)
                except Exception as exc:
                    # the state is past this message: going on, the next snapshot covered it without
                    # the alert, lost for good. Restart from the last snapshot, which reads it again
                    stop(EXIT_RECOVER, f"cannot send to {out.topic} ({type(exc).__name__}: {exc})")
                in_flight.append(fut)
            to_ack.append(event)
            state["dirty"] = True

    def reader(topic_name: str):
        async def read(stream):
            stream.enable_acks = False  # acknowledged by the snapshot timer
            async for event in stream.events():
                await handle(event)
        read.__name__ = f"watch_{topic_name.rsplit('.', 1)[-1].replace('-', '_')}"
        return read

    for name in watch_inputs(settings):  # one agent per input: they differ in partition count
        topic = app.topic(name, partitions=partitions[name], **raw)
        app.agent(topic, name=reader(name).__name__)(reader(name))

    @app.timer(settings.worker_snapshot_interval_s, name="watch_snapshot")
    async def snapshot_state() -> None:
        async with lock:
            started = time.monotonic()
            if not state["dirty"] or not pacer.due(started):
                return
            blob = watcher.snapshot()
            pacer.took(started, time.monotonic())
            covered = {topic: dict(ps) for topic, ps in watcher.next_offsets.items()}
            events, kept = [], []
            for event in to_ack:
                m = event.message
                (events if m.offset < covered.get(m.topic, {}).get(m.partition, 0) else kept).append(event)
            to_ack[:] = kept
            futures = list(in_flight)
            in_flight.clear()
            state["dirty"] = False
        try:
            await asyncio.gather(*futures)  # every alert the snapshot covers is in Kafka
            await (await outputs[t.watch_state].send(key=STATE_KEY, value=blob, partition=0))
        except BaseException as exc:
            # Outputs or the snapshot may be lost: never acknowledge the input they cover. Exit, and
            # let the supervisor restart the watcher from the last durable snapshot.
            stop(EXIT_RECOVER, f"could not confirm its outputs or snapshot ({exc})")
        for event in events:
            event.ack()
        watcher.counters["snapshots"] += 1

    @app.on_partitions_revoked.connect
    async def on_revoked(sender, revoked, **kwargs) -> None:
        # never acknowledge what was held; the state stays (it skips what it covers when read again)
        gone = {(tp.topic, tp.partition) for tp in revoked}
        to_ack[:] = [e for e in to_ack if (e.message.topic, e.message.partition) not in gone]

    return app


def watch_topics(settings: Settings) -> list[str]:
    """Every topic the watcher reads or writes (those of `create_watch_app`; it also reads its state)."""
    t = settings.topics
    return [*watch_inputs(settings), t.alerts, t.reclaim_suggestions, t.watch_state]


def check_watch_topics(settings: Settings, timeout_s: float = 30.0) -> None:
    """RuntimeError naming each of the watcher's topics that is missing or whose partition count is not
    its setting's; KafkaException when the broker cannot be reached within `timeout_s`."""
    check_topics(settings, watch_topics(settings), timeout_s)


def run_watch(settings: Settings, loglevel: str = "warn") -> None:
    """Run the watcher until SIGINT/SIGTERM (`gpuledger watch`), once its topics are the ledger's
    (status 78 when they are not, 75 when the broker cannot be reached: `exit_unless_topics_ready`)."""
    exit_unless_topics_ready(check_watch_topics, settings, "watch")
    (settings.data_dir / "watch").mkdir(parents=True, exist_ok=True)
    app = create_watch_app(settings)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()


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
            except (TypeError, ValueError):  # not JSON, or no value (a tombstone)
                continue
            try:
                line = json.dumps(doc, sort_keys=True) if as_json else _line(msg.topic(), doc)
            except (KeyError, TypeError, ValueError):  # JSON, but no alert or suggestion this can read
                line = f"{msg.topic()}: {json.dumps(doc, sort_keys=True)}"
            out.write(line + "\n")
            out.flush()
            printed += 1
            if max_messages is not None and printed >= max_messages:
                break
    finally:
        consumer.close()
    return printed
