"""Bad input through the real worker (Faust on Tansu, a child process): random bytes and mutated
valid messages, drawn by hypothesis, mixed into a small scenario worked out by hand. The worker
must stay up, send exactly the bad messages to the dead-letter topic (reason + original bytes),
and still produce exactly the expected usage from the good ones."""

from __future__ import annotations

from collections import defaultdict

import orjson
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, Phase, given, settings as hsettings
from hypothesis import strategies as st

from gpuledger.embedded.processes import ChildProcess, wait_until_caught_up
from gpuledger.schemas.models import DeadLetter, GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick, UsageBatch
from gpuledger.schemas.wire import decode, encode
from gpuledger.topics import create_topics

pytestmark = pytest.mark.integration

T0 = 1_793_577_600_000  # 2026-11-02T00:00:00Z
S = 1000
HOUR = 3_600_000


@pytest.fixture(scope="module")
def running(broker, tmp_path_factory):
    import uuid

    from gpuledger.config import Settings

    root = tmp_path_factory.mktemp("bad-input")
    s = Settings(kafka_bootstrap=broker.bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:8]}.", data_dir=root / "data",
                 worker_app_id=f"b{uuid.uuid4().hex[:8]}", partitions_gpu_samples=2, partitions_job_events=2,
                 partitions_usage=2, worker_rebalance_timeout_s=4.0, worker_snapshot_interval_s=0.5)
    create_topics(s)
    worker = ChildProcess(s, "worker", log_path=root / "worker.log").start()
    state = {"round": 0, "letters": set()}
    try:
        yield s, worker, state
    finally:
        worker.stop()


def read_all(s, topic: str, quiet_s: float = 2.0) -> list[bytes]:
    """Every message of `topic`, read until nothing new came for `quiet_s` (not to the high
    watermark: Tansu's can lag behind the log)."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**s.kafka_client_config(), "group.id": "bad-input-reader", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out, last = [], time.monotonic()
        while time.monotonic() - last < quiet_s:
            for msg in consumer.consume(500, 0.2):
                if msg.error() is None:
                    out.append(msg.value())
                    last = time.monotonic()
        return out
    finally:
        consumer.close()


def good_messages(s, r: int) -> tuple[list, str]:
    """Round r: node n<r>, job j<r>, 6 ticks from T0 + r hours (the hand-worked scenario of test_worker)."""
    base = T0 + r * HOUR
    node, job = f"n{r}", f"j{r}"
    t = s.topics
    out = []
    for kind, at_s, n in [("submitted", 0, 0), ("allocated", 10, 1), ("started", 25, 2), ("completed", 50, 3)]:
        e = JobEvent(event_id=f"{job}-{n}", ts_ms=base + at_s * S, kind=kind, cluster="c", job_id=job, tenant="ta",
                     queue="q", gpus=[GpuAssignment(node=node, gpu_uuid=f"G{r}")] if kind == "allocated" else [])
        out.append((t.job_events, job.encode(), encode(e)))
    for k in range(6):
        tick = NodeTick(cluster="c", node=node, ts_ms=base + 10 * S * k, interval_ms=10 * S, gpus=[
            GpuSample(gpu_uuid=f"G{r}", index=0, model="A100-80GB", util_gpu_pct=90.0, power_w=300.0)])
        out.append((t.gpu_samples, node.encode(), encode(tick)))
    return out, node


def _drop(field):
    return lambda d: {k: v for k, v in d.items() if k != field}


def _set(field, value):
    return lambda d: {**d, field: value}


# Mutations that always make a valid message unusable (each for the line it applies to).
TICK_MUTATIONS = [
    _drop("node"), _drop("ts_ms"), _drop("gpus"), _set("ts_ms", -5), _set("ts_ms", 631_152_000_000),  # 1990
    _set("interval_ms", 0), _set("interval_ms", -10_000), _set("schema_version", 2),
    _set("gpus", "many"), _set("ts_ms", "yesterday"),
    lambda d: {**d, "gpus": [{**d["gpus"][0], "util_gpu_pct": 150.0}]},
    lambda d: {**d, "gpus": [{**d["gpus"][0], "power_w": -1.0}]},
    lambda d: {**d, "gpus": [d["gpus"][0], d["gpus"][0]]},  # the same GPU twice
]
EVENT_MUTATIONS = [
    _drop("event_id"), _drop("job_id"), _set("kind", "exploded"), _set("ts_ms", -1), _set("ts_ms", 10),
    _set("schema_version", 99), _set("attempt", -1), _set("requested_gpus", -2.0), _set("type", "other"),
    lambda d: {**d, "gpus": [{"node": "x", "gpu_uuid": "y", "share_milli": 0}]},
    lambda d: {**d, "gpus": [{"node": "x", "gpu_uuid": "y", "share_milli": 1001}]},
]

bad_message = st.one_of(
    st.tuples(st.sampled_from(["gpu-samples", "job-events"]), st.binary(max_size=200)).map(lambda x: ("raw",) + x),
    st.tuples(st.just("tick"), st.sampled_from(range(len(TICK_MUTATIONS))), st.integers(0, 5)),
    st.tuples(st.just("event"), st.sampled_from(range(len(EVENT_MUTATIONS))), st.integers(0, 3)),
    st.tuples(st.just("truncated"), st.integers(0, 9), st.integers(1, 40)),
)


def realise(s, bad, good) -> tuple[str, bytes]:
    t = s.topics
    ticks = [m for m in good if m[0] == t.gpu_samples]
    events = [m for m in good if m[0] == t.job_events]
    if bad[0] == "raw":
        return (t.gpu_samples if bad[1] == "gpu-samples" else t.job_events), bad[2]
    if bad[0] == "tick":
        return t.gpu_samples, orjson.dumps(TICK_MUTATIONS[bad[1]](orjson.loads(ticks[bad[2]][2])))
    if bad[0] == "event":
        return t.job_events, orjson.dumps(EVENT_MUTATIONS[bad[1]](orjson.loads(events[bad[2]][2])))
    topic, _, value = good[bad[1]]
    return topic, value[: max(1, len(value) - bad[2])]  # cut off: never valid JSON any more


@hsettings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
           phases=[Phase.explicit, Phase.reuse, Phase.generate])  # each example is a real round trip: no shrinking
@given(bads=st.lists(bad_message, min_size=1, max_size=8), positions=st.randoms(use_true_random=False))
def test_worker_dead_letters_exactly_the_bad_input_and_keeps_counting(running, bads, positions):
    s, worker, state = running
    r = state["round"] = state["round"] + 1
    good, node = good_messages(s, r)
    messages = list(good)
    bad_values = []
    for bad in bads:
        topic, value = realise(s, bad, good)
        bad_values.append(value)
        messages.insert(positions.randint(0, len(messages)), (topic, b"k" if topic.endswith("job-events") else node.encode(), value))
    producer = Producer({**s.kafka_client_config(), "partitioner": "murmur2_random", "enable.idempotence": True})
    ends = state.setdefault("ends", {})

    def delivered(err, msg):
        assert err is None, err
        ends[(msg.topic(), msg.partition())] = max(ends.get((msg.topic(), msg.partition()), 0), msg.offset() + 1)

    for topic, key, value in messages:
        producer.produce(topic, key=key, value=value, on_delivery=delivered)
    mark = encode(LifecycleWatermark(cluster="c", ts_ms=T0 + r * HOUR + 70 * S))
    for p in range(s.partitions_job_events):
        producer.produce(s.topics.job_events, value=mark, partition=p, on_delivery=delivered)
    assert producer.flush(30) == 0

    t = s.topics
    # judged against what was delivered: Tansu's high watermark can lag behind the log
    wait_until_caught_up(s, s.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                         timeout_s=120, alive=worker, stable_s=1.5, known_ends=ends)
    worker.check_alive()

    # Dead letters are at-least-once (a worker restarted from its last snapshot sends those after it
    # again): one per bad message, told apart by the bad message's source position.
    letters = {}
    for v in read_all(s, t.dead_letters):
        d = decode(DeadLetter, v)
        letters[(d.source_topic, d.partition, d.offset)] = d
    new = [d for pos, d in letters.items() if pos not in state["letters"]]
    state["letters"] = set(letters)
    assert len(new) == len(bads), [d.reason for d in new]
    assert all(d.reason for d in new)
    assert sorted(d.original for d in new) == sorted(v.decode("utf-8", "replace") for v in bad_values)

    by = defaultdict(int)
    for value in read_all(s, t.usage):
        for rec in decode(UsageBatch, value).records:
            if rec.node == node:
                by[(rec.state.value, rec.job_id)] += rec.gpu_ms
    assert dict(by) == {("unallocated", ""): 20_000, ("allocated_idle", f"j{r}"): 15_000,
                        ("executing", f"j{r}"): 25_000}


def test_one_set_of_rules_what_the_worker_rejects_never_reaches_the_warehouse(broker, tmp_path):
    """Issue #12: a far-future tick before any watermark, a 1970 `failed` for a completed job, events
    of an attempt never allocated, and a `completed` before its `allocated`, through the real worker
    and the real sink: each is a dead letter with its reason, the worker still commits every
    partition, the usage is the hand-worked one, and job_events holds exactly the accepted events."""
    import time
    import uuid

    from gpuledger import warehouse
    from gpuledger.config import Settings
    from warehouse_helpers import run_until_caught_up

    s = Settings(kafka_bootstrap=broker.bootstrap, topic_prefix=f"r{uuid.uuid4().hex[:8]}.", data_dir=tmp_path / "data",
                 warehouse=f"chdb:{tmp_path / 'chdb'}", worker_app_id=f"r{uuid.uuid4().hex[:8]}",
                 partitions_gpu_samples=1, partitions_job_events=1, partitions_usage=1,
                 worker_rebalance_timeout_s=4.0, worker_snapshot_interval_s=0.5)
    create_topics(s)
    t = s.topics
    good, node = good_messages(s, 0)
    ghost = [GpuAssignment(node=node, gpu_uuid="G0")]

    def ev(n, kind, at_s, job, gpus=()):
        return (t.job_events, job.encode(), encode(JobEvent(event_id=f"{job}-p{n}", ts_ms=T0 + at_s * S, kind=kind,
                                                            cluster="c", job_id=job, tenant="ta", queue="q",
                                                            gpus=list(gpus))))

    future = NodeTick(cluster="c", node=node, ts_ms=int(time.time() * 1000) + 400 * 86_400_000, interval_ms=10 * S,
                      gpus=[GpuSample(gpu_uuid="G0", index=0, model="A100-80GB", power_w=300.0)])
    poison = [
        (t.gpu_samples, node.encode(), encode(future)),  # first of all: no watermark yet
        ev(1, "started", 5, "ghost", ghost), ev(2, "completed", 40, "ghost"),  # never allocated
        ev(3, "completed", 5, "backwards"), ev(4, "allocated", 20, "backwards", ghost),  # end before start
    ]
    failed_1970 = (t.job_events, b"j0", orjson.dumps({**orjson.loads(good[3][2]), "event_id": "j0-late",
                                                        "kind": "failed", "ts_ms": 86_400_000}))
    messages = poison + good + [failed_1970]
    worker = ChildProcess(s, "worker", log_path=tmp_path / "worker.log").start()
    try:
        producer = Producer({**s.kafka_client_config(), "partitioner": "murmur2_random"})
        for topic, key, value in messages:
            producer.produce(topic, key=key, value=value)
        producer.produce(t.job_events, value=encode(LifecycleWatermark(cluster="c", ts_ms=T0 + 70 * S)), partition=0)
        assert producer.flush(30) == 0
        wait_until_caught_up(s, s.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=120, alive=worker, stable_s=1.5)
        worker.check_alive()
    finally:
        worker.stop()

    reasons = sorted(decode(DeadLetter, v).reason for v in read_all(s, t.dead_letters))
    assert len(reasons) == 6, reasons
    assert sum("clock at receipt" in r for r in reasons) == 1 and sum("before 2000" in r for r in reasons) == 1
    assert sum("never allocated" in r for r in reasons) == 3  # ghost started, ghost completed, backwards completed
    assert sum("at or after the attempt's end" in r for r in reasons) == 1
    by = defaultdict(int)
    for value in read_all(s, t.usage):
        for rec in decode(UsageBatch, value).records:
            by[(rec.state.value, rec.job_id)] += rec.gpu_ms
    assert dict(by) == {("unallocated", ""): 20_000, ("allocated_idle", "j0"): 15_000, ("executing", "j0"): 25_000}
    # what the worker accepted, on lifecycle-accepted, each with the job-events position it repeats
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**s.kafka_client_config(), "group.id": "accepted-reader", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(t.lifecycle_accepted, 0, 0)])
        forwarded, last = [], time.monotonic()
        while time.monotonic() - last < 2:
            for msg in consumer.consume(100, 0.2):
                if msg.error() is None:
                    forwarded.append((dict(msg.headers() or []), decode(JobEvent, msg.value()).kind.value))
                    last = time.monotonic()
    finally:
        consumer.close()
    assert [kind for _, kind in forwarded] == ["submitted", "allocated", "started", "completed"]
    assert [h["gpuledger-source"] for h, _ in forwarded] == [b"0:4", b"0:5", b"0:6", b"0:7"]  # after the 4 poison events

    stats = run_until_caught_up(s)
    client = warehouse.connect(s)
    try:
        rows = client.query(f"SELECT job_id, kind FROM {s.database}.job_events ORDER BY ts_ms").result_rows
        outcome = client.query(f"SELECT outcome FROM {s.database}.job_attempts WHERE job_id = 'j0'").result_rows
    finally:
        client.close()
    assert rows == [("j0", "submitted"), ("j0", "allocated"), ("j0", "started"), ("j0", "completed")]
    assert outcome == [("completed",)]
    assert stats["rows"]["job_events"] == 4
