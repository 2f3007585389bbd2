"""The dcgm agent publishing to the real broker (Tansu): a real dcgm-exporter exposition served
over local HTTP, scraped, published, read back from gpu-samples."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from gpuledger.agents.dcgm_agent import DcgmBackend, fetch_text, main
from gpuledger.agents.gpu_agent import open_spooled_publisher, run_agent
from gpuledger.embedded.processes import read_topic, settings_env
from gpuledger.schemas.wire import decode_node_ticks
from gpuledger.topics import create_topics

pytestmark = pytest.mark.integration

EXPOSITION = (Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "h100_k8s_aicr.prom").read_bytes()


class _Exporter(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(EXPOSITION)

    def log_message(self, *args):
        pass


@pytest.fixture
def exporter_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def ticks_on_topic(settings, expect: int, timeout_s: float = 30.0) -> list:
    """The topic's ticks, read from the beginning until `expect` are there. Not read_topic: it reads up
    to the high watermark, and Tansu was seen reporting 1 for a partition holding 3 acknowledged
    messages (the spool's forwarder had sent them), so read_topic returned one tick."""
    topic = settings.topics.gpu_samples
    consumer = Consumer({**settings.kafka_client_config(), "group.id": "dcgm-test-reader", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        ticks: list = []
        deadline = time.monotonic() + timeout_s
        while len(ticks) < expect and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=100, timeout=0.5):
                if msg.error() is None:
                    ticks.extend(decode_node_ticks(msg.value()))
        return ticks
    finally:
        consumer.close()


def test_agent_once_publishes_the_node_tick(settings, exporter_url, monkeypatch):
    create_topics(settings)
    for name, value in settings_env(settings).items():
        if name.startswith("GPULEDGER_"):
            monkeypatch.setenv(name, value)
    assert main(["--url", exporter_url, "--once", "--cluster", "lab"]) == 0
    [(key, value)] = read_topic(settings, settings.topics.gpu_samples)
    [tick] = decode_node_ticks(value)
    assert key == b"gpu-node-1" == tick.node.encode()  # the node: the exposition's Hostname label
    assert tick.cluster == "lab" and len(tick.gpus) == 8
    assert tick.gpus[0].processes[0].container_id == "k8s://dynamo-workload/vllm-agg-0-vllmdecodeworker-s65j5/main"


def test_agent_loop_through_the_spool_skips_a_failed_scrape(settings, exporter_url):
    create_topics(settings)
    calls = 0

    def flaky_fetch(url: str, timeout_s: float) -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("connection reset by peer")
        return fetch_text(url, timeout_s)

    backend = DcgmBackend(exporter_url, node="gpu-node-1", fetch=flaky_fetch)
    publisher = open_spooled_publisher(settings, "gpu-node-1")
    try:
        published = run_agent(backend, publisher, settings.topics.gpu_samples, cluster="lab", node="gpu-node-1",
                              interval_s=0.2, max_ticks=3)
        assert publisher.forwarder.wait_idle(90)
    finally:
        publisher.close()
    assert published == 3 and backend.scrapes_failed == 1
    ticks = ticks_on_topic(settings, expect=3)
    assert len(ticks) == 3 and all(len(t.gpus) == 8 for t in ticks)
    times = sorted(t.ts_ms for t in ticks)
    assert all(b > a and (b - a) % 200 == 0 for a, b in zip(times, times[1:]))
    assert times[-1] - times[0] >= 600  # the failed scrape's grid point is missing, not filled in
    assert time.time() * 1000 >= times[-1]
