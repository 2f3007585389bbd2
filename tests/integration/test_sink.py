"""The sink on the real broker (Tansu) into the real embedded engine (chDB)."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from gpuledger import warehouse
from gpuledger.schemas.models import (
    DeadLetter,
    GpuAssignment,
    JobEvent,
    LifecycleWatermark,
    PendingByPriority,
    PreemptionFired,
    QueueState,
    SchedulerSnapshot,
    UsageBatch,
    UsageRecord,
)
from gpuledger.schemas.wire import decode, encode
from gpuledger.sink import run_sink
from gpuledger.topics import create_topics

pytestmark = pytest.mark.integration

T = 1709254800000  # 2024-03-01T01:00:00Z


def record(gpu: str, start_min: int, state: str, job: str = "") -> UsageRecord:
    return UsageRecord(
        record_id=f"{gpu}/{T + start_min * 60_000}/0", cluster="c1", node="n1", gpu_uuid=gpu, gpu_model="A100",
        start_ms=T + start_min * 60_000, end_ms=T + (start_min + 1) * 60_000, state=state,
        job_id=job, tenant="alpha" if job else "", queue="train" if job else "",
        share_milli=1000, gpu_ms=60_000, util_pct=55.0 if state == "executing" else None, energy_j=1000.0,
        coefficient=2.0, coefficient_version="A100-v1", effective_gpu_ms=120_000, cost_micros=60_000,
        definition_version="def-v1",
    )


def job_event(n: int, kind: str, minute: int) -> JobEvent:
    return JobEvent(
        event_id=f"e{n}", ts_ms=T + minute * 60_000, kind=kind, cluster="c1", job_id="job-1", tenant="alpha",
        queue="train", requested_gpus=1, gpus=[GpuAssignment(node="n1", gpu_uuid="gpu-A")] if kind != "submitted" else [],
    )


def run_until_caught_up(settings, **kw) -> dict:
    stop = threading.Event()
    guard = threading.Timer(90, stop.set)  # a hung sink fails the test instead of hanging it
    guard.start()
    try:
        stats = run_sink(settings, until_caught_up=True, idle_s=1.0, stop=stop, **kw)
    finally:
        guard.cancel()
    assert not stop.is_set(), "the sink did not catch up within 90 s"
    return stats


def read_topic(settings, topic: str) -> list:
    """Every message of `topic` up to its current end, by assignment (no group join to wait for)."""
    consumer = Consumer({**settings.kafka_client_config(), "group.id": f"{settings.worker_app_id}-reader",
                         "enable.auto.commit": False})
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in meta.partitions}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends if ends[p] > 0])
        got, pending = [], {p for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + 30
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=100, timeout=0.5):
                if msg.error() is None:
                    got.append(msg)
                    if msg.offset() + 1 >= ends[msg.partition()]:
                        pending.discard(msg.partition())
        return got
    finally:
        consumer.close()


def test_sink_lands_rows_and_dead_letters_garbage(settings):
    create_topics(settings)
    t = settings.topics
    producer = Producer(settings.kafka_client_config())
    # garbage first on the same partitions as good data: it must not block what follows
    producer.produce(t.usage, b"\x00\x01 not json", partition=0)
    producer.produce(t.usage, encode(UsageBatch(node="n1", records=[record("gpu-A", 0, "executing", "job-1")])), partition=0)
    producer.produce(t.usage, encode(UsageBatch(node="n2", records=[record("gpu-B", 0, "unallocated"), record("gpu-B", 1, "down")])), partition=1)
    producer.produce(t.usage, b'{"node": "n3", "records": [{"record_id": "x"}]}', partition=1)  # schema violation
    producer.produce(t.job_events, b'{"schema_version": 99, "type": "job_event"}', partition=0)  # unknown version
    for n, (kind, minute) in enumerate([("submitted", -5), ("allocated", 0), ("started", 0)], start=1):
        producer.produce(t.job_events, encode(job_event(n, kind, minute)), key=b"job-1", partition=0)
    producer.produce(t.job_events, encode(LifecycleWatermark(cluster="c1", ts_ms=T)), partition=1)
    snapshot = SchedulerSnapshot(
        cluster="c1", ts_ms=T,
        queues=[
            QueueState(queue="train", priority=2, quota_gpus=8, allocated_gpus=1, pending_jobs=3, pending_gpus=5,
                       pending_by_priority=[PendingByPriority(priority=5, jobs=1, gpus=4), PendingByPriority(priority=1, jobs=2, gpus=1)]),
            QueueState(queue="infer", quota_gpus=4, allocated_gpus=0, pending_jobs=0, pending_gpus=0),
        ],
        preemptions=[PreemptionFired(job_id="job-9", by_job_id="job-1", queue="infer", rule="priority")],
    )
    producer.produce(t.scheduler_snapshots, encode(snapshot))
    assert producer.flush(30) == 0

    stats = run_until_caught_up(settings, batch_rows=2)  # small batches: several flushes

    assert stats["messages"] == 10  # 4 usage + 5 job-events + 1 snapshot
    assert stats["dead_letters"] == 3
    assert stats["skipped"] == 1  # the watermark
    assert stats["rows"] == {"usage_raw": 3, "job_events": 3, "scheduler_snapshots": 2, "scheduler_preemptions": 1}
    assert stats["batches"] >= 2

    client = warehouse.connect(settings)  # the sink closed its own; the directory is free again
    try:
        db = settings.database
        usage = list(client.query(
            f"SELECT gpu_uuid, state, job_id, day, kafka_topic, kafka_partition, kafka_offset, util_pct "
            f"FROM {db}.usage_raw ORDER BY gpu_uuid, start_ms").named_results())
        assert [(r["gpu_uuid"], r["state"], r["job_id"]) for r in usage] == [
            ("gpu-A", "executing", "job-1"), ("gpu-B", "unallocated", ""), ("gpu-B", "down", "")]
        assert str(usage[0]["day"]) == "2024-03-01" and usage[0]["util_pct"] == 55.0 and usage[1]["util_pct"] is None
        # source coordinates: gpu-A's batch was the 2nd message of partition 0, gpu-B's the 1st of partition 1
        assert [(r["kafka_topic"], r["kafka_partition"], r["kafka_offset"]) for r in usage] == [
            (t.usage, 0, 1), (t.usage, 1, 0), (t.usage, 1, 0)]

        events = client.query(f"SELECT kind, gpu_uuids, kafka_offset FROM {db}.job_events ORDER BY ts_ms, kafka_offset").result_rows
        assert events == [("submitted", [], 1), ("allocated", ["gpu-A"], 2), ("started", ["gpu-A"], 3)]
        (attempt,) = client.query(f"SELECT queued_ms, allocated_ms, outcome FROM {db}.job_attempts").result_rows
        assert attempt == (T - 5 * 60_000, T, "")

        queues = client.query(
            f"SELECT queue, quota_gpus, pending_jobs, pending_priorities, pending_gpus_by_priority "
            f"FROM {db}.scheduler_snapshots ORDER BY queue").result_rows
        assert queues == [("infer", 4.0, 0, [], []), ("train", 8.0, 3, [5, 1], [4.0, 1.0])]
        assert client.query(f"SELECT job_id, by_job_id, rule FROM {db}.scheduler_preemptions").result_rows == [
            ("job-9", "job-1", "priority")]
        # the usage landed in the aggregates too (materialized views fire on the sink's inserts)
        (cap,) = client.query(f"SELECT capacity_gpu_seconds, executing_gpu_seconds FROM {db}.capacity_daily").result_rows
        assert cap == (180.0, 60.0)
    finally:
        client.close()

    letters = [decode(DeadLetter, m.value()) for m in read_topic(settings, t.dead_letters)]
    assert len(letters) == 3
    by_origin = {(d.source_topic, d.partition, d.offset): d for d in letters}
    assert set(by_origin) == {(t.usage, 0, 0), (t.usage, 1, 1), (t.job_events, 0, 0)}
    assert "malformed JSON" in by_origin[(t.usage, 0, 0)].reason
    assert by_origin[(t.usage, 0, 0)].original.endswith(" not json")
    assert "schema violation" in by_origin[(t.usage, 1, 1)].reason
    assert "schema_version" in by_origin[(t.job_events, 0, 0)].reason

    # offsets were committed after the inserts: a second run finds nothing new
    again = run_until_caught_up(settings)
    assert again["messages"] == 0 and again["rows"] == {}


def test_sink_refuses_missing_topics(settings):
    with pytest.raises(RuntimeError, match="topics missing"):
        run_sink(settings, until_caught_up=True, idle_s=0.1)
