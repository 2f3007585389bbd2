"""Ticks an agent sends again (its spool delivers at least once: after an agent crash or a delivery-failure
rewind, ticks already delivered come again at new offsets) are stored once in gpu_health, so the hourly
view and the GPU cards count them once — also after the sink restarts. Older ticks never stored and other
GPUs or nodes at the same time are real samples and stay. On the real broker (Tansu) and engine (chDB)."""

from __future__ import annotations

import time

import pytest
from clickhouse_connect import get_client
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.schemas.models import GpuSample, NodeTick, NodeTickBatch
from gpuledger.schemas.wire import encode
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import ClickHouseProgress
from gpuledger.sink.rows import SAMPLES, Source, process_message
from gpuledger.sink.writer import ClickHouseWriter, StoredHealth
from gpuledger.topics import create_topics
from gpuledger.warehouse import migrations
from warehouse_helpers import run_until_caught_up

pytestmark = pytest.mark.integration

T = int(time.time()) // 3600 * 3600 * 1000 - 3600_000  # the start of the last full hour (inside retention)


def tick(node: str, ts_ms: int, gpu: str = "GPU-1", xid: list[int] | None = None) -> NodeTick:
    down = bool(xid)
    return NodeTick(cluster="c1", node=node, ts_ms=ts_ms, interval_ms=5000,
                    gpus=[GpuSample(gpu_uuid=gpu, index=0, model="A100-80GB", xid_errors=xid or [],
                                    health="down" if down else "ok",
                                    down_reason="xid 79: GPU fell off the bus" if down else None)])



def publish(settings, *messages) -> None:
    producer = Producer(settings.kafka_client_config())
    for node, value in messages:
        producer.produce(settings.topics.gpu_samples, value, key=node.encode())  # as the agents: keyed by node
    assert producer.flush(30) == 0


def health(settings) -> dict:
    client = warehouse.connect(settings)
    try:
        db = settings.database
        q = lambda sql: client.query(sql).result_rows  # noqa: E731
        return {"rows": q(f"SELECT node, gpu_uuid, ts_ms - {T} FROM {db}.gpu_health ORDER BY node, gpu_uuid, ts_ms"),
                "hourly": q(f"SELECT gpu_uuid, sum(samples), sum(sampled_ms), sum(unhealthy_samples), sum(xid_count) "
                            f"FROM {db}.gpu_health_hourly GROUP BY gpu_uuid ORDER BY gpu_uuid"),
                "card_xids": q(f"SELECT xid_errors FROM {db}.gpu_cards WHERE gpu_uuid = 'GPU-1'")}
    finally:
        client.close()


def test_a_tick_sent_again_is_stored_once_across_sink_restarts(settings):
    create_topics(settings)
    xid_tick = encode(tick("n1", T, xid=[79]))
    publish(settings,
            ("n1", xid_tick),
            ("n1", xid_tick),  # the spool sends it again (byte-identical, next offset)
            ("n1", encode(tick("n1", T + 5000))),
            # a rewind resends it inside a batch, after a tick that was never stored and is older than both
            ("n1", encode(NodeTickBatch(node="n1", ticks=[tick("n1", T - 5000), tick("n1", T, xid=[79])]))),
            ("n2", encode(tick("n2", T, gpu="GPU-2"))))  # another node's GPU at the same time: a real sample
    stats = run_until_caught_up(settings)
    assert stats["duplicate_rows"] == 2 and stats["dead_letters"] == 0
    got = health(settings)
    assert got["rows"] == [("n1", "GPU-1", -5000), ("n1", "GPU-1", 0), ("n1", "GPU-1", 5000), ("n2", "GPU-2", 0)]
    assert got["hourly"] == [("GPU-1", 3, 15000, 1, 1), ("GPU-2", 1, 5000, 0, 0)]
    assert got["card_xids"] == [(1,)]

    # the agent crashed and its spool sends the tick again after the sink restarted: gpu_health is the record
    publish(settings, ("n1", xid_tick), ("n1", encode(tick("n1", T + 10000))))
    again = run_until_caught_up(settings)
    assert again["messages"] == 2 and again["duplicate_rows"] == 1
    got = health(settings)
    assert got["rows"] == [("n1", "GPU-1", -5000), ("n1", "GPU-1", 0), ("n1", "GPU-1", 5000), ("n1", "GPU-1", 10000),
                           ("n2", "GPU-2", 0)]
    assert got["hourly"] == [("GPU-1", 4, 20000, 1, 1), ("GPU-2", 1, 5000, 0, 0)]
    assert got["card_xids"] == [(1,)]


class Crash(BaseException):
    """The process dies here."""


class CrashAfterHealth:
    """Records every gpu_health block it is given; dies right after the first one went in."""

    def __init__(self, inner, crash: bool):
        self.inner, self.crash, self.blocks = inner, crash, []

    def write(self, table, rows, token=None):
        self.inner.write(table, rows, token=token)
        if table == "gpu_health":
            self.blocks.append((token, [(r["gpu_uuid"], r["ts_ms"], r["kafka_offset"]) for r in rows]))
            if self.crash:
                raise Crash()


def test_a_pending_block_rebuilt_after_a_crash_keeps_its_rows(tmp_path):
    """The sink died after gpu_health took a block, before it was recorded done. Rebuilt, the block must
    hold the same rows for its token (its own rows in gpu_health are not "already stored"), so a view
    that missed the first insert still gets them, and nothing is counted twice."""
    db = "health_dedup_test"
    client = get_client(interface="chdb", path=str(tmp_path / "chdb"))
    try:
        migrations.migrate(client, db)
        previous = encode(tick("n1", T - 5000))
        messages = [encode(tick("n1", T, xid=[79])), encode(tick("n1", T, xid=[79])), previous]
        sources = [Source("p.gpu-samples", 0, 10 + i) for i in range(len(messages))]
        # an earlier block already holds the tick at T - 5000 (from offset 9)
        ClickHouseWriter(client, db).write("gpu_health", process_message(SAMPLES, previous, Source("p.gpu-samples", 0, 9))
                                           ["gpu_health"], token="p.gpu-samples/0/e0/9-10/gpu_health")
        blocks = []
        for crash in (True, False):
            writer = CrashAfterHealth(ClickHouseWriter(client, db), crash)
            sink = BatchingSink(writer, ClickHouseProgress(client, db, "sink"), stored_health=StoredHealth(client, db))
            sink.assign([("p.gpu-samples", 0)])
            try:
                for raw, src in zip(messages, sources):
                    sink.add(process_message(SAMPLES, raw, src), src)
                sink.flush()
            except Crash:
                pass
            blocks += writer.blocks
        (token, first), (token_again, rebuilt) = blocks
        assert token == token_again == "p.gpu-samples/0/e0/10-13/gpu_health"
        assert first == rebuilt == [("GPU-1", T, 10)]  # the copy at 11 and the stored tick at 12 dropped both times
        q = lambda sql: client.query(sql).result_rows  # noqa: E731
        assert q(f"SELECT ts_ms - {T}, kafka_offset FROM {db}.gpu_health ORDER BY ts_ms") == [(-5000, 9), (0, 10)]
        assert q(f"SELECT sum(samples), sum(xid_count) FROM {db}.gpu_health_hourly") == [(2, 1)]
    finally:
        client.close()


def test_the_lookup_asks_a_few_gpus_at_a_time_and_matches_exact_samples(tmp_path):
    """StoredHealth splits a block's GPUs over several small queries (a server takes the parameters in the
    URL) and answers only the exact (cluster, node, GPU, ts_ms) samples of the block that are stored."""
    db = "health_lookup_test"
    client = get_client(interface="chdb", path=str(tmp_path / "chdb"))
    try:
        migrations.migrate(client, db)
        stored = NodeTick(cluster="c1", node="n1", ts_ms=T, interval_ms=5000, gpus=[
            GpuSample(gpu_uuid=f"GPU-{i}", index=i, model="A100-80GB") for i in range(5)])
        between = NodeTick(cluster="c1", node="n1", ts_ms=T + 2500, interval_ms=5000, gpus=stored.gpus)  # not in the block
        for offset, t in ((1, stored), (2, between)):
            ClickHouseWriter(client, db).write("gpu_health", process_message(SAMPLES, encode(t), Source("p.gpu-samples", 0, offset))
                                               ["gpu_health"], token=f"t{offset}")
        block = [{"cluster": "c1", "node": "n1", "gpu_uuid": f"GPU-{i}", "ts_ms": T + dt} for i in range(5) for dt in (0, 5000)]
        block.append({"cluster": "c1", "node": "n9", "gpu_uuid": "GPU-0", "ts_ms": T})  # another node: not a copy
        lookup = StoredHealth(client, db, gpus_per_query=2)
        assert lookup(block, ("p.gpu-samples", 0), 5, 8) == {("c1", "n1", f"GPU-{i}", T) for i in range(5)}
        assert lookup(block, ("p.gpu-samples", 0), 1, 8) == set()  # its own range (1-7): not "already stored"
    finally:
        client.close()
