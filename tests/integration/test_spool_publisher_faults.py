"""The agents' delivery path against a real broker (Tansu), with the real confluent-kafka producer:

- a record larger than the producer's message limit (librdkafka's `message.max.bytes`, 1 MB) is
  dropped and counted, and the records after it are delivered in order (before: the forwarder
  resent it at every backoff for ever and delivered nothing after it);
- the real GPU agent process stopped with SIGTERM delivers the ticks it was holding for a
  `NodeTickBatch` before it exits, with the broker reachable (before: they stayed in the spool)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

import pytest
from metrics_scrape import sample, scrape
from test_agent_outage import keyed_values

from gpuledger.agents.gpu_agent import open_spooled_publisher, spool_dir
from gpuledger.agents.spool import Spool
from gpuledger.embedded.broker import free_port
from gpuledger.schemas.wire import decode_node_ticks
from gpuledger.topics import create_topics

pytestmark = pytest.mark.integration


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60,
               alive: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"the agent exited ({alive.returncode}) while waiting for {what}")
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


def test_a_record_over_the_producer_limit_is_dropped_and_the_ones_after_it_delivered(settings):
    create_topics(settings)
    publisher = open_spooled_publisher(settings, "big-node")
    small = [b'{"tick": %d}' % i for i in range(6)]
    try:
        for value in small[:3]:
            publisher.publish(settings.topics.gpu_samples, "big-node", value)
        publisher.publish(settings.topics.gpu_samples, "big-node", b'"' + b"x" * 1_200_000 + b'"')
        for value in small[3:]:
            publisher.publish(settings.topics.gpu_samples, "big-node", value)
        # before: delivered 3, then "delivery of seq 4 failed ... MSG_SIZE_TOO_LARGE" every backoff, for ever
        assert publisher.forwarder.wait_idle(60), (
            f"spool stuck behind the large record: depth {publisher.spool.depth}, "
            f"delivered {publisher.forwarder.delivered}, resends {publisher.forwarder.resends}")
        assert (publisher.spool.dropped, publisher.forwarder.unsendable, publisher.forwarder.delivered) == (1, 1, 6)
    finally:
        publisher.close()
    assert keyed_values(settings.kafka_bootstrap, settings.topics.gpu_samples, b"big-node", 6) == small
    with Spool(spool_dir(settings, "big-node")) as spool:  # counted for good, nothing to resend
        assert (spool.depth, spool.dropped) == (0, 1)


def test_sigterm_delivers_the_ticks_held_for_a_batch(settings, tmp_path):
    """The agent holds up to --ticks-per-message ticks before it spools them as one NodeTickBatch; on
    SIGTERM it spools what it holds, and a clean stop must then send it while the broker is there."""
    create_topics(settings)
    node = "sigterm-node"
    port = free_port()
    env = {**os.environ, "GPULEDGER_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
           "GPULEDGER_TOPIC_PREFIX": settings.topic_prefix, "GPULEDGER_DATA_DIR": str(settings.data_dir)}
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpuledger.agents.gpu_agent", "--backend", "sim", "--sim-gpus", "2xT4", "--node", node,
         "--interval", "0.05", "--ticks-per-message", "1000", "--metrics-port", str(port), "--log-level", "ERROR"],
        env=env, stderr=subprocess.DEVNULL)

    def sampled() -> float:
        try:
            return sample(scrape(port), "gpuledger_agent_ticks_sampled_total", node=node)
        except (OSError, KeyError):
            return 0

    try:
        wait_until(lambda: sampled() >= 20, "20 ticks sampled", alive=agent)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=10)
    with Spool(spool_dir(settings, node)) as spool:
        left = spool.depth
    # before: the batch of every tick it sampled (one record, 20 ticks or more) stayed in the spool
    assert left == 0, f"{left} record(s) left in the spool by a clean stop with the broker reachable"
    ticks = [t.ts_ms for value in keyed_values(settings.kafka_bootstrap, settings.topics.gpu_samples, node.encode(), 1)
             for t in decode_node_ticks(value)]
    assert len(ticks) >= 20 and ticks == sorted(set(ticks))
