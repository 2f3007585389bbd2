"""Rows the warehouse refuses, through the real sink (Tansu, run_sink, chDB): the block is split down to
the message holding them, and that message's dead letter carries its Kafka key (the node), as every
other letter does; before, the letter of refused rows went unkeyed, so a node's letters could not be
found by its key. The message's other rows, and the other messages, are stored."""

from __future__ import annotations

import time

import orjson
import pytest
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.schemas.models import DeadLetter, GpuSample, NodeTick
from gpuledger.schemas.wire import decode, encode
from gpuledger.topics import create_topics
from test_sink import read_topic
from warehouse_helpers import run_until_caught_up

pytestmark = pytest.mark.integration

S = 5000


class SpoilOffset:
    """Passes every block to the real writer, with an Xid of -1 (which Array(UInt32) cannot hold) put into
    the gpu_health rows of one offset: a value past the sink's checks, refused by the real insert."""

    def __init__(self, inner, offset: int):
        self.inner, self.offset = inner, offset

    def write(self, table, rows, token=None):
        if table == "gpu_health":
            rows = [{**r, "xid_errors": [-1]} if r["kafka_offset"] == self.offset else r for r in rows]
        self.inner.write(table, rows, token=token)


def test_rows_the_warehouse_refuses_are_dead_lettered_under_the_message_key(settings) -> None:
    create_topics(settings)
    t = settings.topics
    t0 = int(time.time()) // 3600 * 3600 * 1000 - 3_600_000
    producer = Producer(settings.kafka_client_config())
    for k, node in enumerate(("n1", "n2", "n3")):
        tick = NodeTick(cluster="c1", node=node, ts_ms=t0 + k * S, interval_ms=S,
                        gpus=[GpuSample(gpu_uuid=f"{node}-G0", index=0, model="A100-80GB", util_gpu_pct=50.0)])
        producer.produce(t.gpu_samples, encode(tick), key=node.encode(), partition=0)
    assert producer.flush(30) == 0

    stats = run_until_caught_up(settings, wrap_writer=lambda inner: SpoilOffset(inner, 1))
    assert stats["dead_letters"] == 1
    client = warehouse.connect(settings)
    try:
        db = settings.database
        health = sorted(r[0] for r in client.query(f"SELECT node FROM {db}.gpu_health").result_rows)
        seen = sorted(r[0] for r in client.query(f"SELECT node FROM {db}.node_inventory").result_rows)
    finally:
        client.close()
    assert health == ["n1", "n3"] and seen == ["n1", "n2", "n3"]  # only the refused rows are missing

    [msg] = read_topic(settings, t.dead_letters)
    letter = decode(DeadLetter, msg.value())
    assert (letter.source_topic, letter.partition, letter.offset) == (t.gpu_samples, 0, 1)
    assert msg.key() == b"n2", f"the letter of refused rows is not keyed by its message's key: {msg.key()!r}"
    assert "warehouse refused the rows for gpu_health" in letter.reason
    assert [r["node"] for r in orjson.loads(letter.original)] == ["n2"]  # the message's refused rows
    # caught up, run again: the letter was confirmed before the range was recorded done, it does not go twice
    assert run_until_caught_up(settings, wrap_writer=lambda inner: SpoilOffset(inner, 1))["dead_letters"] == 0
    assert len(read_topic(settings, t.dead_letters)) == 1
