"""The Faust worker: moves messages through the pure worker core (streams/core.py) and nothing more.

Two agents:
- `route_lifecycle` reads job-events (keyed by job), re-keys each event by node onto the
  internal node-allocations topic, and broadcasts lifecycle watermarks to all its partitions;
- `join_nodes` reads gpu-samples and node-allocations together (co-partitioned by node), so a
  node's ticks and allocation changes meet in one partition, and emits usage batches.
Bad messages go to the dead-letter topic with the reason; late ones that were still applied
to the late-events topic; the agents keep going.

Crash safety (docs/reliability.md, "Worker state"): the agents do not let Faust acknowledge
their input. Every `worker_snapshot_interval_s` a timer (1) waits until every output sent so far
is acknowledged by the broker, (2) writes a snapshot of each changed partition's state, with the
input offsets it covers, to the compacted worker-state topic and waits for it, and only then
(3) acknowledges the input messages it covers, so Faust commits input offsets that never run
ahead of a durable snapshot. (A snapshot leaves out ticks still waiting for their watermark, so
it covers gpu-samples only up to the first message holding one; later messages wait for a later
snapshot.) On (re)assignment a partition's state is restored from its latest
snapshot before its first message; input the snapshot already covers is skipped, input after it
is processed again and re-emits the same records (same ids), which the sink recognises. A message
Faust hands out after its partition was revoked is left alone (its new owner reads it). Whatever
would let the state run ahead of its outputs stops the worker instead (status 75: an output it
could not send or confirm, a snapshot it could not read; 78: a snapshot it cannot restore or one
larger than the worker-state topic takes), so that it restarts from its last durable snapshot.
Before Faust starts, its topics are checked (`exit_unless_topics_ready`): 78 for a topic missing or
with another partition count than its setting, 75 for a broker it cannot reach.

Why one file: the agents, the timers and the rebalance handler share one lock and the bookkeeping of
what a snapshot covers (partitions loaded and changed, events to acknowledge, outputs in flight),
closures of `create_app`; the Faust plumbing beside them is what they are configured with.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections import Counter, defaultdict

import faust
from faust.transport.drivers import aiokafka as aiokafka_driver
from aiokafka import TopicPartition as KafkaPartition
from confluent_kafka import Consumer, KafkaException, TopicPartition

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.metrics import LAG_EVERY_S, forget_consumer_lag
from gpuledger.streams.core import JOIN, ROUTER, Out, WorkerCore
from gpuledger.streams.pricing import LedgerConfig
from gpuledger.topics import STATE_MAX_MESSAGE_BYTES, check_topics

log = logging.getLogger(__name__)


def faust_broker_credentials(settings: Settings):
    """Faust's view of the Kafka security settings (None for PLAINTEXT)."""
    proto = settings.kafka_security_protocol.upper()
    if proto == "PLAINTEXT":
        return None
    ssl_context = None
    if "SSL" in proto:
        import ssl

        ssl_context = ssl.create_default_context(cafile=str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None)
    if proto.startswith("SASL"):
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password.get_secret_value() if settings.kafka_sasl_password else None,
            mechanism=settings.kafka_sasl_mechanism,
            ssl_context=ssl_context,
        )
    return faust.SSLCredentials(ssl_context)


def read_last_snapshot(settings: Settings, partition: int, timeout_s: float = 30.0,
                       topic: str | None = None) -> bytes | None:
    """The latest message of one worker-state partition (None when there is none); `topic`: another
    state topic read the same way (the watcher's, gpuledger/watch.py)."""
    topic = topic or settings.topics.worker_state
    consumer = Consumer({**settings.kafka_client_config(), "group.id": f"{settings.worker_app_id}-state-reader",
                         "enable.auto.commit": False})
    try:
        tp = TopicPartition(topic, partition)
        low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
        if high <= low:
            return None
        consumer.assign([TopicPartition(topic, partition, high - 1)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                log.warning("reading worker state: %s", msg.error())
                continue
            return msg.value()
        raise TimeoutError(f"could not read the last snapshot of {tp.topic}[{partition}] within {timeout_s:.0f}s")
    finally:
        consumer.close()


#: room under STATE_MAX_MESSAGE_BYTES for a snapshot record's key and Kafka's batch overhead
SNAPSHOT_OVERHEAD_BYTES = 1024


def oversized_snapshot(kind: str, partition: int, size: int, limit: int = STATE_MAX_MESSAGE_BYTES) -> str | None:
    """Why a snapshot of `size` bytes cannot be written to the worker-state topic, or None. The
    producer's refusal names a max_request_size the ledger has no setting for, and a restart makes the
    same snapshot again: say what grew and what makes it smaller."""
    if size + SNAPSHOT_OVERHEAD_BYTES <= limit:
        return None
    what = ("every job's event ids for GPULEDGER_WORKER_RETENTION_S" if kind == ROUTER else
            "its nodes' joins (change ids and tick ranges for GPULEDGER_WORKER_RETENTION_S)")
    return (f"the state snapshot of {kind} partition {partition} is {size} bytes, more than the worker-state topic "
            f"takes ({limit} bytes with {SNAPSHOT_OVERHEAD_BYTES} of overhead): it holds {what}; lower "
            "GPULEDGER_WORKER_RETENTION_S, or move to a topic set with more partitions")


def make_core(settings: Settings, ledger: LedgerConfig) -> WorkerCore:
    return WorkerCore(settings.topics, partitions_gpu_samples=settings.partitions_gpu_samples,
                      partitions_job_events=settings.partitions_job_events, ledger=ledger,
                      retention_ms=int(settings.worker_retention_s * 1000),
                      max_ahead_ms=int(settings.worker_max_ahead_s * 1000), defer_watermarks=True,
                      clock_ahead_ms=int(settings.max_clock_ahead_s * 1000),
                      dead_letter_max_bytes=settings.dead_letter_max_bytes)


#: how often the worker measures whether to pause a partition (pace_samples), seconds. A measure
#: visits every node of the partition (107 µs for 1,500 nodes with ticks waiting, against ~2 ms to
#: process a message), and a backlog gets minutes of event time ahead only over many such intervals
PACE_EVERY_S = 0.02


class _ShortPollConsumerThread(aiokafka_driver.AIOKafkaConsumerThread):
    """Faust's consumer, with the broker's long-poll wait bounded by `kafka_fetch_max_wait_ms`
    (Faust fixes it at 1.5 s). A broker that answers a waiting fetch only when the wait ends
    (Tansu does) otherwise adds up to 1.5 s to every hop through a topic — the router's
    allocation changes and watermarks make one on their way to the join."""

    def _create_worker_consumer(self, transport):
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = self.app.fetch_max_wait_ms  # read when the consumer starts its fetcher
        return consumer

    async def hold(self, tps: list[KafkaPartition], held: bool) -> None:
        """Stop (held) or restart fetching from the partitions, in the consumer's own thread."""
        consumer = self._ensure_consumer()
        await self.call_thread(consumer.pause if held else consumer.resume, *tps)


class _ShortPollConsumer(aiokafka_driver.Consumer):
    def _new_consumer_thread(self):
        return _ShortPollConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def hold_partitions(self, tps: list[KafkaPartition], held: bool) -> None:
        """Pause (held) or resume fetching from partitions without losing a record. Faust's own
        `pause_partitions` makes its fetcher pass over the records of a batch it has not delivered
        yet, whose position is already past them (faust/transport/consumer.py `getmany`): they would
        never be processed. aiokafka's pause keeps the position at the first record not handed out."""
        await self._thread.hold(tps, held)


class _LedgerTransport(aiokafka_driver.Transport):
    Consumer = _ShortPollConsumer


class LedgerApp(faust.App):
    """faust.App on the aiokafka driver with a bounded fetch wait (see _ShortPollConsumerThread)."""

    fetch_max_wait_ms = 100  # set from the settings in create_app

    def _new_transport(self):
        return _LedgerTransport(self.conf.broker_consumer, self)


def new_ledger_app(settings: Settings, app_id: str, datadir: str, **conf) -> LedgerApp:
    """A LedgerApp configured as the ledger's Faust processes share it (the worker, the watcher):
    raw bytes, topics from `gpuledger topics create`, input acknowledged by the caller, short
    rebalances; `conf` adds or overrides Faust settings."""
    app = LedgerApp(
        app_id,
        broker=[f"kafka://{host}" for host in settings.kafka_bootstrap.split(",")],
        broker_credentials=faust_broker_credentials(settings),
        store="memory://",
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=False,      # topics come from `gpuledger topics create`
        topic_disable_leader=True,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_max_request_size=STATE_MAX_MESSAGE_BYTES,  # state snapshots (the state topics take as much)
        # input is acknowledged only after a snapshot; a rebalance must not wait for it
        stream_wait_empty=False,
        # A group (re)join waits up to the rebalance timeout for members; Tansu holds the
        # JoinGroup for about half of it even for a lone member, so keep it short.
        broker_rebalance_timeout=settings.worker_rebalance_timeout_s,
        broker_session_timeout=max(10.0, settings.worker_rebalance_timeout_s),
        datadir=datadir,
        **conf,
    )
    app.fetch_max_wait_ms = settings.kafka_fetch_max_wait_ms
    return app


def create_app(settings: Settings, ledger: LedgerConfig | None = None) -> faust.App:
    ledger = ledger or load_ledger_config(settings.ledger_config)
    topics = settings.topics
    # a short stream buffer (Faust's default: 4,096 messages) so that a paused partition stops soon
    # (pace_samples); a message is up to 10 ticks of a node, and the worker needs ~2 ms for one
    app = new_ledger_app(settings, settings.worker_app_id, str(settings.data_dir / "worker"),
                         topic_partitions=settings.partitions_gpu_samples, stream_buffer_maxsize=256)
    core = make_core(settings, ledger)
    app.ledger_core = core  # for tests and metrics
    from gpuledger.metrics import worker_metrics

    metrics = worker_metrics()
    core.on_dead_letter = metrics.dead_letter
    core.on_duplicate = metrics.duplicate
    core.on_tick = metrics.sample_seen
    core.on_unmatched = metrics.unmatched
    # a node retired from its join (silent for the retention, holding nothing) leaves the age gauge,
    # as it would on a restore: a decommissioned node's "stopped" alert ends
    core.on_retired = lambda cluster, node: metrics.forget_nodes([(cluster, node)])

    raw = dict(value_serializer="raw", key_serializer="raw")
    job_events = app.topic(topics.job_events, partitions=settings.partitions_job_events, **raw)
    node_stream = app.topic(topics.gpu_samples, topics.node_allocations, partitions=settings.partitions_gpu_samples, **raw)
    outputs = {
        name: app.topic(name, partitions=n, **raw)
        for name, n in settings.partitions().items()
        if name in (topics.node_allocations, topics.usage, topics.dead_letters, topics.late_events, topics.worker_state,
                    topics.lifecycle_accepted)
    }

    lock = asyncio.Lock()
    loaded: set[tuple[str, int]] = set()          # partitions whose state is restored
    dirty: set[tuple[str, int]] = set()           # ... and changed since their last snapshot
    to_ack: dict[tuple[str, int], list] = defaultdict(list)  # events a snapshot must cover first
    in_flight: list = []                          # delivery futures of outputs not yet confirmed
    taken_away: set[tuple[str, int]] = set()      # partitions revoked and not assigned again
    revocations: Counter[tuple[str, int]] = Counter()  # how often each partition was revoked

    def part_of(topic: str, partition: int) -> tuple[str, int]:
        return (ROUTER, partition) if topic == topics.job_events else (JOIN, partition)

    async def ensure_loaded(key: tuple[str, int]) -> bool:
        """Restore the partition's state unless it is; False: the partition is not this worker's."""
        if key in loaded:
            return True
        kind, partition = key
        revoked_before = revocations[key]
        # Without its state the partition cannot be processed, and an exception here would only
        # restart the agent, which then passed over the partition's messages: exit instead
        try:
            blob = await asyncio.get_running_loop().run_in_executor(
                None, read_last_snapshot, settings, core.state_partition(kind, partition))
        except Exception as exc:
            stop(75, f"cannot read the snapshot of {kind} partition {partition} ({type(exc).__name__}: {exc})")
        if revocations[key] != revoked_before:  # revoked while its snapshot was read: restored when read again
            return False
        try:
            core.restore(kind, partition, blob)
        except Exception as exc:  # a restart reads it again: exit with another status than a broker's hiccup
            stop(78, f"cannot restore {kind} partition {partition} from its snapshot ({type(exc).__name__}: {exc}); "
                     "it was not written by this worker version, or is damaged")
        if kind == JOIN and partition in core.joins:
            # its nodes' last samples, so that one silent since before a rebalance still ages (and
            # alerts) here; one silent for longer than the retention is taken for retired
            jp = core.joins[partition]
            for join in jp.nodes.values():
                if join.closed_until_ms and join.closed_until_ms >= jp.data_ms - core.retention_ms:
                    metrics.sample_seen(join.node, join.closed_until_ms, join.cluster)
        to_ack.pop(key, None)
        loaded.add(key)
        log.info("restored %s partition %d from %s", kind, partition, "a snapshot" if blob else "nothing (fresh)")
        return True

    def stop(status: int, why: str) -> None:
        log.critical("%s; exiting (status %d)", why, status)
        logging.shutdown()
        os._exit(status)

    async def send(outs: list[Out]) -> None:
        for out in outs:
            metrics.message_out(out.topic)
            try:
                fut = await outputs[out.topic].send(key=out.key, value=out.value, partition=out.partition,
                                                    headers=list(out.headers) if out.headers else None)
            except Exception as exc:
                # the core's state is past what made this output (a message, a watermark): going on,
                # the next snapshot covered it without the output, lost for good. Restart from the last one
                stop(75, f"cannot send to {out.topic} ({type(exc).__name__}: {exc})")
            in_flight.append(fut)

    async def handle(event, process) -> bool:
        """Process one message; False: left alone, its partition was revoked while it waited."""
        message = event.message
        key = part_of(message.topic, message.partition)
        metrics.message_in(message.topic)
        revoked_before = revocations[key]
        async with lock:
            # Faust revokes without waiting for the agents: a message handed out before may come after,
            # also after its partition was assigned again and its position set back to the committed
            # offset. Processed, it went before the messages read again (which were then skipped as
            # seen), or its partition's state was snapshotted here over its new owner's
            if revocations[key] != revoked_before or not await ensure_loaded(key):
                return False
            core.source_key = message.key  # the worker's dead letters keep the input's key
            try:
                outs = process(message)
            except Exception as exc:  # a bug must not stop the ledger: the message is set aside
                log.exception("cannot process %s[%d]@%d", message.topic, message.partition, message.offset)
                outs = [core.dead_letter_out(message.topic, message.partition, message.offset, event.value,
                                   f"cannot process: {type(exc).__name__}: {exc}")]
            await send(outs)
            to_ack[key].append(event)
            dirty.add(key)
        return True

    @app.agent(job_events, name="route_lifecycle")
    async def route_lifecycle(stream):
        stream.enable_acks = False  # acknowledged by the snapshot timer
        async for event in stream.events():
            # the wall clock at receipt judges input from the future, also before the first watermark
            await handle(event, lambda m, e=event: core.on_lifecycle(m.partition, m.offset, e.value,
                                                                     int(time.time() * 1000)))

    paused: set[int] = set()                      # gpu-samples partitions paused by pace_samples
    ahead_limit_ms = round(settings.worker_samples_ahead_s * 1000)
    paced_at: dict[int, float] = {}               # partition -> when pace_samples last measured it

    async def pace_samples(partition: int) -> None:
        """Event-time flow control. A tick waits in memory until the lifecycle watermark passes it.
        In a backlog Faust reads the samples as fast as it can while the watermarks come later through
        the router: in bench/join.py 33,000 ticks waited, the worker held 0.9 GB and needed twice the
        CPU per tick (docs/performance.md §1). So a partition's samples are paused while more than
        `worker_samples_ahead_s` of them wait per node (`WorkerCore.samples_waiting_ms`), resumed at half
        of it; its allocation changes and watermarks keep flowing, and the backlog waits in Kafka."""
        if (JOIN, partition) in taken_away:
            return  # aiokafka refuses to pause a partition it is not assigned (IllegalStateError)
        now = time.monotonic()
        if partition not in paused and now - paced_at.get(partition, 0.0) < PACE_EVERY_S:
            return  # a pause may wait for the next sample; a resume never waits (no sample comes)
        paced_at[partition] = now
        waiting = core.samples_waiting_ms(partition)
        if partition not in paused and waiting > ahead_limit_ms:
            paused.add(partition)
            metrics.samples_paused(partition, True)
            await app.consumer.hold_partitions([KafkaPartition(topics.gpu_samples, partition)], True)
            log.info("gpu-samples[%d] paused: %d ms of samples wait for the lifecycle watermark", partition, waiting)
        elif partition in paused and waiting <= ahead_limit_ms // 2:
            paused.discard(partition)
            metrics.samples_paused(partition, False)
            await app.consumer.hold_partitions([KafkaPartition(topics.gpu_samples, partition)], False)
            log.info("gpu-samples[%d] resumed: %d ms of samples wait", partition, waiting)

    @app.agent(node_stream, name="join_nodes")
    async def join_nodes(stream):
        stream.enable_acks = False  # acknowledged by the snapshot timer
        async for event in stream.events():
            if await handle(event, lambda m, e=event: core.on_node(m.topic, m.partition, m.offset, e.value,
                                                                   int(time.time() * 1000))):
                await pace_samples(event.message.partition)

    @app.timer(settings.worker_watermark_flush_s, name="flush_watermarks")
    async def flush_watermarks() -> None:
        async with lock:
            await send(core.flush_watermarks())

    @app.timer(LAG_EVERY_S, name="measure_lag")
    async def measure_lag() -> None:
        """gpuledger_consumer_lag_messages of every assigned partition: its end offset (asked from the
        broker, also for a paused partition) minus the worker's position, the offset after the last
        message Faust handed to the agents (before the first: the consumer's fetch position). On a
        timer, never per message (the per-message path is the worker's bottleneck)."""
        consumer = app.consumer
        try:
            assigned = sorted(consumer.assignment())
            forget_consumer_lag(metrics.component, ((tp.topic, tp.partition) for tp in assigned))
            if not assigned:
                return
            ends = await consumer.highwaters(*assigned)
        except Exception as exc:  # not started yet, or a rebalance in progress: next time
            log.debug("cannot measure the consumer lag: %s", exc)
            return
        for tp in assigned:
            end, read = ends.get(tp), consumer._read_offset.get(tp)
            try:  # what the last fetch said, when more: a broker's end offsets can lag its log (Tansu)
                end = max(end if end is not None else -1, consumer.highwater(tp) or -1)
            except Exception:
                pass
            position = read + 1 if read is not None else None
            if position is None:
                try:
                    position = await asyncio.wait_for(consumer.position(tp), 2.0)
                except Exception:
                    continue
            if end is not None and position is not None:
                metrics.set_lag(tp.topic, tp.partition, end, position)

    @app.timer(settings.worker_snapshot_interval_s, name="snapshot_state")
    async def snapshot_state() -> None:
        async with lock:
            await send(core.flush_watermarks())  # a snapshot never holds a watermark back
            if not dirty:
                return
            keys = sorted(dirty & loaded)
            blobs = []
            for kind, p in keys:
                try:
                    blobs.append((core.state_partition(kind, p), core.snapshot(kind, p)))
                except Exception as exc:  # the timer died with it: no snapshot again, no offset committed
                    stop(75, f"cannot snapshot {kind} partition {p} ({type(exc).__name__}: {exc})")
            for (kind, p), (_, blob) in zip(keys, blobs):
                metrics.snapshot_written(kind, p, len(blob))
                problem = oversized_snapshot(kind, p, len(blob))
                if problem:
                    stop(78, problem)
            events = []
            for key in keys:  # acknowledge what the snapshot covers; keep the rest for a later one
                covered = core.covered_offsets(*key)
                kept = []
                for event in to_ack.pop(key, []):
                    (events if event.message.offset < covered.get(event.message.topic, 0) else kept).append(event)
                if kept:
                    to_ack[key] = kept
            futures = list(in_flight)
            in_flight.clear()
            dirty.clear()
        try:
            await asyncio.gather(*futures)  # every output the snapshot covers is in Kafka
            written = [await outputs[topics.worker_state].send(key=str(sp).encode(), value=blob, partition=sp)
                       for sp, blob in blobs]
            await asyncio.gather(*written)
        except BaseException as exc:
            # Outputs or the snapshot may be lost: never acknowledge the input they cover. Exit, and
            # let the supervisor restart the worker from the last durable snapshot.
            stop(75, f"worker could not confirm its outputs or snapshot ({exc})")
        for event in events:
            event.ack()
        core.counters["snapshots"] += len(blobs)

    @app.on_partitions_revoked.connect
    async def on_revoked(sender, revoked, **kwargs) -> None:
        # The partitions may go to another worker: forget them, so that if they come back their
        # state is restored from the (then) latest snapshot, and never acknowledge what we held.
        for tp in revoked:
            key = part_of(tp.topic, tp.partition)
            if tp.topic == topics.gpu_samples and tp.partition in paused:
                paused.discard(tp.partition)  # a new assignment starts unpaused
                metrics.samples_paused(tp.partition, False)
            if tp.topic == topics.gpu_samples and tp.partition in core.joins:
                metrics.forget_nodes((j.cluster, j.node) for j in core.joins[tp.partition].nodes.values())
            taken_away.add(key)
            revocations[key] += 1
            loaded.discard(key)
            dirty.discard(key)
            to_ack.pop(key, None)

    @app.on_partitions_assigned.connect
    async def on_assigned(sender, assigned, **kwargs) -> None:
        for tp in assigned:  # restored from its latest snapshot before its first message (ensure_loaded)
            taken_away.discard(part_of(tp.topic, tp.partition))

    return app


def worker_topics(settings: Settings) -> list[str]:
    """Every topic the worker reads or writes (those of `create_app`, and the worker-state topic it
    restores from). Faust makes no topic of its own here: no tables, no leader topic."""
    t = settings.topics
    return [t.gpu_samples, t.job_events, t.node_allocations, t.lifecycle_accepted, t.usage, t.dead_letters,
            t.late_events, t.worker_state]


def check_worker_topics(settings: Settings, timeout_s: float = 30.0) -> None:
    """RuntimeError naming each of the worker's topics that is missing or whose partition count is not
    its setting's; KafkaException when the broker cannot be reached within `timeout_s`."""
    check_topics(settings, worker_topics(settings), timeout_s)


def exit_unless_topics_ready(check, settings: Settings, process: str, timeout_s: float = 30.0) -> None:
    """Before Faust starts (the worker's, the watcher's): SystemExit unless `check(settings, timeout_s)`
    passes. Faust would subscribe anyway: a producer creates a missing topic with the broker's default
    partition count, and a count that disagrees bills ticks as unallocated or never closes them,
    silently. Status 78 (a restart does not help) for topics to fix, 75 (restart me) for a broker that
    cannot be reached."""
    try:
        check(settings, timeout_s=timeout_s)
    except KafkaException as exc:
        log.critical("%s: cannot list the topics on %s within %.0fs (%s): is the broker up and reachable? "
                     "exiting (status 75)", process, settings.kafka_bootstrap, timeout_s, exc)
        raise SystemExit(75) from exc
    except RuntimeError as exc:
        log.critical("%s: its topics are not the ledger's: %s. Fix: `gpuledger topics create` with the same "
                     "settings creates missing topics; for a partition count that disagrees, set the partition "
                     "settings to the topics' counts (Kafka cannot take partitions away); exiting (status 78)",
                     process, exc)
        raise SystemExit(78) from exc


def run_worker(settings: Settings, loglevel: str = "warn") -> None:
    """Run the worker until SIGINT/SIGTERM (`gpuledger worker`), once its topics are the ledger's."""
    import faulthandler
    import signal

    exit_unless_topics_ready(check_worker_topics, settings, "worker")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: print every stack
    from gpuledger.metrics import start_metrics_server

    start_metrics_server(settings.worker_metrics_port)
    (settings.data_dir / "worker").mkdir(parents=True, exist_ok=True)
    app = create_app(settings)
    # Everything loaded so far lives as long as the process: keep it out of the collector's
    # scans, and collect the young generation less often (the hot path allocates many short-lived
    # objects; measured ~5 % of the core's CPU in bench/core.py).
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
