"""The Faust worker: moves messages through the pure join (streams/join.py) and nothing more.

Two agents:
- `route_lifecycle` reads job-events (keyed by job), re-keys each event by node onto the
  internal node-allocations topic, and broadcasts lifecycle watermarks to all its partitions;
- `join_nodes` reads gpu-samples and node-allocations together (co-partitioned by node), so a
  node's ticks and allocation changes meet in one partition, and emits usage batches.
Bad messages go to the dead-letter topic with the reason; the agents keep going.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import faust

from gpuledger.config import Settings
from gpuledger.schemas.models import DeadLetter, JobEvent, LifecycleWatermark, NodeTick, NodeWatermark, UsageBatch
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_node_allocation, encode
from gpuledger.streams.join import LifecycleRouter, NodeJoin, WatermarkClock
from gpuledger.streams.pricing import LedgerConfig, load_ledger_config

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


class WorkerState:
    """The worker's in-memory state, one object so tests and metrics can look at it."""

    def __init__(self, ledger: LedgerConfig):
        self.ledger = ledger
        self.router = LifecycleRouter()
        self.nodes: dict[str, NodeJoin] = {}
        self.nodes_by_partition: dict[int, set[str]] = {}
        self.clocks: dict[int, WatermarkClock] = {}
        self.counters: Counter[str] = Counter()

    def node(self, name: str, partition: int) -> NodeJoin:
        join = self.nodes.get(name)
        if join is None:
            join = self.nodes[name] = NodeJoin(node=name)
            self.nodes_by_partition.setdefault(partition, set()).add(name)
        return join

    def clock(self, partition: int) -> WatermarkClock:
        return self.clocks.setdefault(partition, WatermarkClock())


def create_app(settings: Settings, ledger: LedgerConfig | None = None) -> faust.App:
    ledger = ledger or load_ledger_config(settings.ledger_config)
    topics = settings.topics
    app = faust.App(
        settings.worker_app_id,
        broker=[f"kafka://{host}" for host in settings.kafka_bootstrap.split(",")],
        broker_credentials=faust_broker_credentials(settings),
        store="memory://",
        topic_partitions=settings.partitions_gpu_samples,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=False,      # topics come from `gpuledger topics create`
        topic_disable_leader=True,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        # A group (re)join waits up to the rebalance timeout for members; Tansu holds the
        # JoinGroup for about half of it even for a lone member, so keep it short.
        broker_rebalance_timeout=settings.worker_rebalance_timeout_s,
        broker_session_timeout=max(10.0, settings.worker_rebalance_timeout_s),
        datadir=str(settings.data_dir / "worker"),
    )
    state = WorkerState(ledger)
    app.ledger_state = state  # for tests and metrics

    raw = dict(value_serializer="raw", key_serializer="raw")
    job_events = app.topic(topics.job_events, partitions=settings.partitions_job_events, **raw)
    node_stream = app.topic(topics.gpu_samples, topics.node_allocations, partitions=settings.partitions_gpu_samples, **raw)
    node_allocations = app.topic(topics.node_allocations, partitions=settings.partitions_gpu_samples, **raw)
    usage = app.topic(topics.usage, partitions=settings.partitions_usage, **raw)
    dead_letters = app.topic(topics.dead_letters, partitions=settings.partitions_dead_letters, **raw)

    async def reject(event, reason: str) -> None:
        message = event.message
        state.counters["dead_letters"] += 1
        log.warning("dead letter from %s[%d]@%d: %s", message.topic, message.partition, message.offset, reason)
        letter = DeadLetter(source_topic=message.topic, partition=message.partition, offset=message.offset,
                            reason=reason, original=(event.value or b"").decode("utf-8", "replace"),
                            seen_ms=int(time.time() * 1000))
        await dead_letters.send(value=encode(letter))

    @app.agent(job_events, name="route_lifecycle")
    async def route_lifecycle(stream):
        async for event in stream.events():
            try:
                message = decode_lifecycle(event.value)
            except DecodeError as exc:
                await reject(event, str(exc))
                continue
            if isinstance(message, LifecycleWatermark):
                mark = NodeWatermark(ts_ms=message.ts_ms, source_partition=event.message.partition,
                                     source_partitions=settings.partitions_job_events)
                for partition in range(settings.partitions_gpu_samples):
                    await node_allocations.send(value=encode(mark), partition=partition)
                continue
            assert isinstance(message, JobEvent)
            state.counters["job_events"] += 1
            for change in state.router.route(message):
                await node_allocations.send(key=change.node.encode(), value=encode(change))

    async def emit(join: NodeJoin, watermark_ms: int) -> None:
        records = join.close_until(watermark_ms, state.ledger)
        if records:
            state.counters["usage_records"] += len(records)
            await usage.send(key=join.node.encode(), value=encode(UsageBatch(node=join.node, records=records)))

    @app.agent(node_stream, name="join_nodes")
    async def join_nodes(stream):
        async for event in stream.events():
            partition = event.message.partition
            try:
                if event.message.topic == topics.gpu_samples:
                    tick = decode(NodeTick, event.value)
                    join = state.node(tick.node, partition)
                    problem = join.add_tick(tick)
                    if problem:
                        await reject(event, problem)
                        continue
                    state.counters["ticks"] += 1
                    await emit(join, state.clock(partition).value)
                    continue
                message = decode_node_allocation(event.value)
            except DecodeError as exc:
                await reject(event, str(exc))
                continue
            if isinstance(message, NodeWatermark):
                watermark = state.clock(partition).observe(message)
                for name in sorted(state.nodes_by_partition.get(partition, ())):
                    await emit(state.nodes[name], watermark)
            else:
                state.node(message.node, partition).add_change(message)

    return app


def run_worker(settings: Settings, loglevel: str = "warn") -> None:
    """Run the worker until SIGINT/SIGTERM (`gpuledger worker`)."""
    (settings.data_dir / "worker").mkdir(parents=True, exist_ok=True)
    app = create_app(settings)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
