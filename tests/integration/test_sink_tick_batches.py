"""A NodeTickBatch with a bad tick, through the real sink (Tansu, run_sink, chDB): each tick is
judged on its own as the worker judges it (streams/core.py `_on_ticks`), so the good ticks keep
their health and inventory rows and each bad tick gets a dead letter of its own (the tick as original,
its own reason, the message's Kafka key, as every other letter); a batch the worker rejects whole is
still rejected whole."""

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


def hot_and_old(ticks: list) -> None:
    too_hot(ticks)
    ticks[4]["ts_ms"] = 631_152_000_000


def unmeterable(ticks: list) -> None:
    ticks[2]["gpus"][0]["util_gpu_pct"] = 500.0  # a metered field: the worker rejects the whole message


def test_a_bad_tick_in_a_batch_does_not_cost_the_good_ones_their_rows(settings) -> None:
    create_topics(settings)
    t = settings.topics
    messages = {"hot": batch("hot", too_hot), "old": batch("old", dated_1990), "whole": batch("whole", unmeterable),
                "good": batch("good"), "two": batch("two", hot_and_old)}
    # what the worker does with them (the rules the sink must follow)
    worker = {}
    for name, raw in messages.items():
        try:
            ticks = decode_metered_ticks(raw)
        except Exception:
            worker[name] = 0
            continue
        worker[name] = sum(check_tick(x, 0, now_ms=T0 + 60_000) is None for x in ticks)
    assert worker == {"hot": 5, "old": 4, "whole": 0, "good": 5, "two": 4}

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
    assert health == {"hot": 8, "old": 8, "good": 10, "two": 6}, \
        "the good ticks of a batch with a bad tick lost their rows"
    assert set(seen) == {"hot", "old", "good", "two"}

    # (offset, Kafka key, letter): every letter keyed by its message's key, as the worker's are
    letters = [(m.key(), decode(DeadLetter, m.value())) for m in read_topic(settings, t.dead_letters)]
    assert sorted((x.offset, key) for key, x in letters) == [(0, b"hot"), (1, b"old"), (2, b"whole"), (4, b"two"),
                                                             (4, b"two")], "a letter lost its message's key"
    assert stats["dead_letters"] == 5  # one per bad tick, one for the message rejected whole
    by = {}
    for _key, x in letters:
        by.setdefault(x.offset, []).append(x)
    [hot], [old], [whole] = by[0], by[1], by[2]
    assert hot.reason.startswith("NodeTickBatch: schema violation at ticks.2.gpus.0.temperature_c")
    assert hot.reason.endswith("(1 of the batch's 5 ticks rejected; the others stored)")
    # the letter's original is the bad tick itself (a NodeTick object), not an array of them
    assert {k: orjson.loads(hot.original)[k] for k in ("node", "ts_ms")} == {"node": "hot", "ts_ms": T0 + 2 * S}
    assert old.reason.startswith("absurd timestamp: tick of old ts_ms=631152000000")
    assert orjson.loads(old.original)["ts_ms"] == 631_152_000_000
    assert whole.reason.startswith("NodeTickBatch: schema violation at ticks.2.gpus.0.util_gpu_pct")
    assert orjson.loads(whole.original) == orjson.loads(messages["whole"])  # rejected whole, as the worker does
    two = sorted(by[4], key=lambda x: orjson.loads(x.original)["ts_ms"])  # one letter per bad tick, its own reason
    assert [orjson.loads(x.original)["ts_ms"] for x in two] == [631_152_000_000, T0 + 2 * S]
    assert two[0].reason.startswith("absurd timestamp: tick of two ts_ms=631152000000")
    assert two[1].reason.startswith("NodeTickBatch: schema violation at ticks.2.gpus.0.temperature_c")
    assert all(x.reason.endswith("(2 of the batch's 5 ticks rejected; the others stored)") for x in two)

    # caught up, run again: every letter was confirmed before its range was recorded done, none goes twice
    assert run_until_caught_up(settings)["dead_letters"] == 0
    assert len(read_topic(settings, t.dead_letters)) == 5


def test_a_tick_with_an_integer_beyond_64_bits_is_a_letter_and_the_sink_goes_on(settings) -> None:
    """pydantic's JSON parser takes an integer of any size, orjson writes none beyond 64 bits: a batch
    whose bad tick held one (an ECC count of 2**70) killed the sink while it wrote the tick's letter,
    and again on every restart (the message was never committed)."""
    import json

    create_topics(settings)
    t = settings.topics
    huge = 2**70

    def ecc_beyond_64_bits(ticks: list) -> None:
        ticks[2]["gpus"][0]["ecc_dbe_total"] = 123_456_789_123  # replaced by `huge` in the bytes below

    raw = batch("huge", ecc_beyond_64_bits).replace(b"123456789123", str(huge).encode())
    producer = Producer(settings.kafka_client_config())
    producer.produce(t.gpu_samples, raw, key=b"huge", partition=0)
    producer.produce(t.gpu_samples, batch("good"), key=b"good", partition=0)
    assert producer.flush(30) == 0
    stats = run_until_caught_up(settings)

    client = warehouse.connect(settings)
    try:
        health = dict(client.query(f"SELECT node, count() FROM {settings.database}.gpu_health GROUP BY node")
                      .result_rows)
    finally:
        client.close()
    assert health == {"huge": 8, "good": 10}  # the other four ticks of the batch, and the batch behind it
    assert stats["dead_letters"] == 1
    [(key, letter)] = [(m.key(), decode(DeadLetter, m.value())) for m in read_topic(settings, t.dead_letters)]
    assert key == b"huge" and letter.offset == 0
    assert letter.reason.startswith(f"value cannot be stored: gpu_health.ecc_dbe_total={huge} is outside")
    original = json.loads(letter.original)  # the tick, its integer exactly as sent
    assert original["ts_ms"] == T0 + 2 * S and original["gpus"][0]["ecc_dbe_total"] == huge
