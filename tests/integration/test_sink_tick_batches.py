"""A NodeTickBatch with a bad tick, through the real sink (Tansu, run_sink, chDB): each tick is
judged on its own as the worker judges it (streams/core.py `_on_ticks`), so the good ticks keep
their health and inventory rows and the message gets one dead letter naming the bad ticks; a batch
the worker rejects whole is still rejected whole."""

from __future__ import annotations

import orjson
import pytest
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.schemas.models import DeadLetter, GpuSample, NodeTick, NodeTickBatch
from gpuledger.schemas.wire import decode, decode_metered_ticks, encode
from gpuledger.streams.join import check_tick
from gpuledger.topics import create_topics
from test_sink import read_topic
from warehouse_helpers import run_until_caught_up

pytestmark = pytest.mark.integration

T0 = 1_764_000_000_000  # 2025-11-24T16:00:00Z
S = 5000


def tick(node: str, k: int) -> NodeTick:
    return NodeTick(cluster="c1", node=node, ts_ms=T0 + k * S, interval_ms=S,
                    gpus=[GpuSample(gpu_uuid=f"{node}-G{i}", index=i, model="A100-80GB", util_gpu_pct=50.0,
                                    temperature_c=60.0) for i in range(2)])


def batch(node: str, spoil=None) -> bytes:
    """Five ticks of `node`; `spoil(ticks)` damages the third (and more) in the JSON."""
    obj = orjson.loads(encode(NodeTickBatch(node=node, ticks=[tick(node, k) for k in range(5)])))
    if spoil is not None:
        spoil(obj["ticks"])
    return orjson.dumps(obj)


def too_hot(ticks: list) -> None:
    ticks[2]["gpus"][0]["temperature_c"] = 999.0  # a health field: the worker meters the tick anyway


def dated_1990(ticks: list) -> None:
    ticks[2]["ts_ms"] = 631_152_000_000


def unmeterable(ticks: list) -> None:
    ticks[2]["gpus"][0]["util_gpu_pct"] = 500.0  # a metered field: the worker rejects the whole message


def test_a_bad_tick_in_a_batch_does_not_cost_the_good_ones_their_rows(settings) -> None:
    create_topics(settings)
    t = settings.topics
    messages = {"hot": batch("hot", too_hot), "old": batch("old", dated_1990), "whole": batch("whole", unmeterable),
                "good": batch("good")}
    # what the worker does with them (the rules the sink must follow)
    worker = {}
    for name, raw in messages.items():
        try:
            ticks = decode_metered_ticks(raw)
        except Exception:
            worker[name] = 0
            continue
        worker[name] = sum(check_tick(x, 0, now_ms=T0 + 60_000) is None for x in ticks)
    assert worker == {"hot": 5, "old": 4, "whole": 0, "good": 5}

    producer = Producer(settings.kafka_client_config())
    for name, raw in messages.items():
        producer.produce(t.gpu_samples, raw, key=name.encode(), partition=0)
    assert producer.flush(30) == 0
    stats = run_until_caught_up(settings)

    client = warehouse.connect(settings)
    try:
        db = settings.database
        health = dict(client.query(f"SELECT node, count() FROM {db}.gpu_health GROUP BY node").result_rows)
        seen = dict(client.query(f"SELECT node, count() FROM {db}.node_inventory GROUP BY node").result_rows)
    finally:
        client.close()
    # two GPUs a tick: the hot batch keeps 4 ticks (its hot tick fails the sink's full schema), the old one 4
    assert health == {"hot": 8, "old": 8, "good": 10}, "the good ticks of a batch with a bad tick lost their rows"
    assert set(seen) == {"hot", "old", "good"}
    assert stats["dead_letters"] == 3

    letters = {decode(DeadLetter, m.value()).offset: decode(DeadLetter, m.value())
               for m in read_topic(settings, t.dead_letters)}
    assert sorted(letters) == [0, 1, 2]
    hot, old, whole = letters[0], letters[1], letters[2]
    assert hot.reason.startswith("NodeTickBatch: schema violation at ticks.2.gpus.0.temperature_c")
    assert hot.reason.endswith("(1 of the batch's 5 ticks rejected; the others stored)")
    assert [x["ts_ms"] for x in orjson.loads(hot.original)] == [T0 + 2 * S]  # the letter holds the bad tick
    assert old.reason.startswith("absurd timestamp: tick of old ts_ms=631152000000")
    assert [x["ts_ms"] for x in orjson.loads(old.original)] == [631_152_000_000]
    assert whole.reason.startswith("NodeTickBatch: schema violation at ticks.2.gpus.0.util_gpu_pct")
    assert orjson.loads(whole.original) == orjson.loads(messages["whole"])  # rejected whole, as the worker does
