"""A value the client cannot serialize, through real chDB (and Tansu with run_sink): an Xid code of -1
in gpu_health.xid_errors (Array(UInt32)) once reached the insert, where clickhouse-connect's DataError
was taken for a transient error: the block was retried for ever, every partition paused, and good
messages of other topics were never written. Now the shared checks reject it before any insert
(streams/checks.py INT_RANGES), and any such value that still reaches an insert is permanent: the
block is split and the message dead-lettered (gpuledger/sink/writer.py `is_permanent`)."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.schemas.models import DeadLetter, GpuSample, NodeTick, UsageBatch
from gpuledger.schemas.wire import decode, encode
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.loop import run_sink
from gpuledger.sink.progress import ClickHouseProgress
from gpuledger.sink.rows import Source, health_rows
from gpuledger.sink.writer import ClickHouseWriter
from gpuledger.topics import create_topics
from test_sink import read_topic
from warehouse_helpers import migrated_warehouse, usage_record

pytestmark = pytest.mark.integration

DB = "poison_values"
S = 5000


def tick(t0: int, k: int, xid: list[int]) -> NodeTick:
    return NodeTick(cluster="c1", node="n1", ts_ms=t0 + k * S, interval_ms=S,
                    gpus=[GpuSample(gpu_uuid="GPU-1", index=0, model="A100-80GB", xid_errors=xid)])


def test_a_block_the_client_cannot_serialize_is_split_and_dead_lettered(tmp_path) -> None:
    """Rows past the checks (as a value they do not foresee would be): the insert's DataError is
    permanent, so the block is split and only the message holding the value is dead-lettered."""
    t0 = int(time.time()) // 3600 * 3600 * 1000 - 3_600_000
    topic = "p.gpu-samples"
    with migrated_warehouse(tmp_path, DB) as (client, _):
        letters, retries = [], []

        def sleep(seconds: float) -> None:
            retries.append(seconds)
            if len(retries) > 5:
                raise AssertionError(f"the block was retried {len(retries)} times instead of split and dead-lettered")

        sink = BatchingSink(ClickHouseWriter(client, DB), ClickHouseProgress(client, DB, "g"), sleep=sleep,
                            on_poison=lambda key, offset, table, rows, why, _key: letters.append((offset, table, why)))
        sink.assign([(topic, 0)])
        for k, xid in enumerate(([], [-1], [79])):
            source = Source(topic, 0, k)
            sink.add({"gpu_health": health_rows(tick(t0, k, xid), source)}, source)
        sink.flush()
        stored = client.query(f"SELECT kafka_offset, xid_errors FROM {DB}.gpu_health ORDER BY kafka_offset").result_rows
        assert [(o, list(x)) for o, x in stored] == [(0, []), (2, [79])]
        assert [(o, t) for o, t, _ in letters] == [(1, "gpu_health")]
        assert "DataError" in letters[0][2] and "xid_errors" in letters[0][2]
        assert retries == []


def test_a_bad_xid_code_does_not_stall_the_sink(settings) -> None:
    """End to end: a tick with an Xid of -1 beside a good usage message on another topic: the usage
    is written, the tick is one dead letter naming the column, and the sink catches up."""
    create_topics(settings)
    t = settings.topics
    t0 = int(time.time()) // 3600 * 3600 * 1000 - 3_600_000
    producer = Producer(settings.kafka_client_config())
    good = usage_record("c1", "gpu-A", t0, t0 + 60_000, "executing", job="j", tenant="t")
    producer.produce(t.usage, encode(UsageBatch(node="n1", records=[good])), partition=0)
    producer.produce(t.gpu_samples, encode(tick(t0, 0, [-1])), partition=0, key=b"n1")
    assert producer.flush(30) == 0

    stop = threading.Event()
    guard = threading.Timer(45, stop.set)
    guard.start()
    try:
        stats = run_sink(settings, until_caught_up=True, idle_s=1.0, stop=stop)
    finally:
        guard.cancel()
    assert not stop.is_set(), "the sink did not catch up within 45 s"

    client = warehouse.connect(settings)
    try:
        db = settings.database
        assert client.query(f"SELECT count() FROM {db}.usage_raw").result_rows[0][0] == 1
        assert client.query(f"SELECT count() FROM {db}.gpu_health").result_rows[0][0] == 0
    finally:
        client.close()
    assert stats["dead_letters"] == 1
    letters = [decode(DeadLetter, m.value()) for m in read_topic(settings, t.dead_letters)]
    assert [(x.source_topic, x.offset) for x in letters] == [(t.gpu_samples, 0)]
    assert "gpu_health.xid_errors=-1" in letters[0].reason
