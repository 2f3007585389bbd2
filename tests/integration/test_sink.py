"""The sink on the real broker (Tansu) into the real embedded engine (chDB)."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from gpuledger import warehouse
from sink_faults import fault_injecting
from warehouse_helpers import run_until_caught_up
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
from gpuledger.sink.loop import run_sink
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
    # job events reach the sink through lifecycle-accepted (what the worker accepted; here written directly)
    producer.produce(t.lifecycle_accepted, b'{"schema_version": 99, "type": "job_event"}', partition=0)  # unknown version
    for n, (kind, minute) in enumerate([("submitted", -5), ("allocated", 0), ("started", 0)], start=1):
        producer.produce(t.lifecycle_accepted, encode(job_event(n, kind, minute)), key=b"job-1", partition=0)
    producer.produce(t.lifecycle_accepted, encode(LifecycleWatermark(cluster="c1", ts_ms=T)), partition=1)
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
    assert set(by_origin) == {(t.usage, 0, 0), (t.usage, 1, 1), (t.lifecycle_accepted, 0, 0)}
    assert "malformed JSON" in by_origin[(t.usage, 0, 0)].reason
    assert by_origin[(t.usage, 0, 0)].original.endswith(" not json")
    assert "schema violation" in by_origin[(t.usage, 1, 1)].reason
    assert "schema_version" in by_origin[(t.lifecycle_accepted, 0, 0)].reason

    # offsets were committed after the inserts: a second run finds nothing new
    again = run_until_caught_up(settings)
    assert again["messages"] == 0 and again["rows"] == {}


def test_sink_refuses_missing_topics(settings):
    with pytest.raises(RuntimeError, match="topics missing"):
        run_sink(settings, until_caught_up=True, idle_s=0.1)


# ------------------------------------------------------------------ the sink never stalls on data (issue #12)
DAY = 86_400_000


def sample_tick(node: str, ts_ms: int):
    from gpuledger.schemas.models import GpuSample, NodeTick

    return NodeTick(cluster="c1", node=node, ts_ms=ts_ms, interval_ms=10_000,
                    gpus=[GpuSample(gpu_uuid=f"{node}-gpu", index=0, model="A100-80GB", power_w=100.0)])


def queue_snapshot(ts_ms: int, **queue) -> SchedulerSnapshot:
    values = dict(queue="train", quota_gpus=8, allocated_gpus=1, pending_jobs=0, pending_gpus=0)
    return SchedulerSnapshot(cluster="c1", ts_ms=ts_ms, queues=[QueueState(**{**values, **queue})])


def test_poison_of_every_kind_is_dead_lettered_before_any_insert_and_the_sink_moves_on(settings):
    create_topics(settings)
    t = settings.topics
    producer = Producer({**settings.kafka_client_config(), "message.max.bytes": 8_000_000})
    # 150 schema-valid snapshots dated 1970, one month apart (one INSERT of them: ClickHouse Code 252)
    for k in range(150):
        producer.produce(t.scheduler_snapshots, encode(queue_snapshot(k * 31 * DAY)))
    producer.produce(t.scheduler_snapshots, encode(queue_snapshot(int(time.time() * 1000) + 400 * DAY)))  # far ahead
    producer.produce(t.scheduler_snapshots, encode(queue_snapshot(T, pending_jobs=2**40)))  # UInt32 overflow
    producer.produce(t.scheduler_snapshots, encode(queue_snapshot(T, pending_jobs=3)))  # the good one
    # a 5 MB malformed message on gpu-samples: its dead letter must fit the topic
    producer.produce(t.gpu_samples, b'{"node": "' + b"x" * 5_000_000, partition=0)
    # 150 VALID ticks one month apart from 2001: one block of them spans 150 partitions -> Code 252 for real;
    # the sink splits the block and every row lands
    start = 978_307_200_000  # 2001-01-01
    for k in range(150):
        producer.produce(t.gpu_samples, encode(sample_tick("n1", start + k * 31 * DAY)), partition=1)
    assert producer.flush(60) == 0

    stats = run_until_caught_up(settings, batch_rows=100_000, batch_interval_s=5.0)

    assert stats["dead_letters"] == 150 + 2 + 1
    letters = [(m, decode(DeadLetter, m.value())) for m in read_topic(settings, t.dead_letters)]
    assert len(letters) == 153
    assert all(len(m.value()) <= settings.dead_letter_max_bytes for m, _ in letters)
    reasons = [d.reason for _, d in letters]
    assert sum("before 2000" in r for r in reasons) == 150
    assert sum("clock at receipt" in r for r in reasons) == 1 and sum("pending_jobs" in r for r in reasons) == 1
    (big,) = [d for _, d in letters if d.source_topic == t.gpu_samples]
    assert big.original_size == 5_000_010 and len(big.original_sha256) == 64 and len(big.original) < 1_000_000
    client = warehouse.connect(settings)
    try:
        db = settings.database
        assert client.query(f"SELECT ts_ms, pending_jobs FROM {db}.scheduler_snapshots").result_rows == [(T, 3)]
        (n, months), = client.query(f"SELECT count(), uniqExact(toYYYYMM(day)) FROM {db}.gpu_health").result_rows
        assert (n, months) == (150, 150)
    finally:
        client.close()


def test_an_outage_longer_than_the_poll_interval_keeps_the_sink_in_its_group(make_settings, broker, tmp_path):
    control = tmp_path / "fault"
    control.write_text("down")
    # max.poll.interval.ms = 6 s (the minimum session): the outage below lasts 15 s
    settings = make_settings(kafka_bootstrap=broker.bootstrap, worker_rebalance_timeout_s=4.0,
                             sink_retry_max_s=2.0)
    create_topics(settings)
    producer = Producer(settings.kafka_client_config())
    producer.produce(settings.topics.usage, encode(UsageBatch(node="n1", records=[record("gpu-A", 0, "executing", "job-1")])),
                     partition=0)
    assert producer.flush(30) == 0
    threading.Timer(15.0, lambda: control.write_text("")).start()
    started = time.monotonic()
    stats = run_until_caught_up(settings, wrap_writer=fault_injecting(control))
    assert time.monotonic() - started >= 15
    assert stats["rows"] == {"usage_raw": 1}
    assert stats["assignments"] == 1, "the sink left its group during the outage (max.poll.interval exceeded)"
    assert stats["retries"] >= 3


def test_a_recreated_topic_is_refused_with_a_clear_error(settings):
    from gpuledger.sink.loop import RecreatedTopicError

    create_topics(settings)
    t = settings.topics
    run_until_caught_up(settings)  # migrates; nothing to read, nothing committed
    # the warehouse says 1000 messages of scheduler-snapshots[0] are in; the topic holds 1 and the group
    # has no committed offset for it: it was deleted and created again
    producer = Producer(settings.kafka_client_config())
    producer.produce(t.scheduler_snapshots, encode(queue_snapshot(T, pending_jobs=1)))
    assert producer.flush(30) == 0
    client = warehouse.connect(settings)
    try:
        client.insert("sink_progress", [[f"{settings.worker_app_id}-sink", t.scheduler_snapshots, 0, 0, 0, 1000, "done",
                                         {}, (1 << 62) + 2001]],
                      column_names=["consumer", "topic", "partition", "epoch", "from_offset", "to_offset", "phase",
                                    "horizons", "seq"], database=settings.database)
    finally:
        client.close()
    stop = threading.Event()
    guard = threading.Timer(60, stop.set)
    guard.start()
    try:
        with pytest.raises(RecreatedTopicError, match=r"scheduler-snapshots\[0\] ends at offset 1, but the warehouse"):
            run_sink(settings, stop=stop)  # runs until it is assigned the partition, then refuses
    finally:
        guard.cancel()
    assert not stop.is_set()


def test_a_block_written_again_after_a_restart_counts_once_in_the_views(settings):
    """The sink's crash recovery writes a pending block again with the same token. The views must
    drop it like usage_raw does — also when the first write came from the process that created the
    tables (on chDB a view created in the session deduplicated by another token: the chaos suite's
    kill right after the first usage insert doubled that block in the bills)."""
    from gpuledger.sink.writer import ClickHouseWriter
    from gpuledger.sink.rows import Source, usage_rows

    create_topics(settings)
    t = settings.topics
    batch = UsageBatch(node="n1", records=[record("gpu-A", 0, "executing", "job-1"), record("gpu-A", 1, "executing", "job-1")])
    producer = Producer(settings.kafka_client_config())
    producer.produce(t.usage, encode(batch), partition=0)
    assert producer.flush(30) == 0
    run_until_caught_up(settings)  # the first run migrates (creates the views) and writes the block
    client = warehouse.connect(settings)  # a restarted sink
    try:
        db = settings.database
        counts = lambda: (client.query(f"SELECT count() FROM {db}.usage_raw").result_rows[0][0],  # noqa: E731
                          client.query(f"SELECT sum(slices) FROM {db}.usage_by_job_daily").result_rows[0][0])
        assert counts() == (2, 2)
        ClickHouseWriter(client, db).write("usage_raw", usage_rows(batch, Source(t.usage, 0, 0)),
                                           token=f"{t.usage}/0/e0/0-1/usage_raw")
        assert counts() == (2, 2)
    finally:
        client.close()


def test_usage_records_a_restarted_worker_emits_again_are_counted_as_duplicates(settings):
    """The per-GPU horizon drops the records a restarted worker emits again (at new offsets); they are
    second copies dropped silently, so gpuledger_duplicates_total{component="sink",kind="row"} counts
    them, as it counts health rows sent again. They were dropped and counted nowhere: after a worker
    crash the metric and the run's stats said no copy had come."""
    from prometheus_client import REGISTRY

    def duplicates() -> float:
        return REGISTRY.get_sample_value("gpuledger_duplicates_total", {"component": "sink", "kind": "row"}) or 0.0

    create_topics(settings)
    t = settings.topics
    producer = Producer(settings.kafka_client_config())
    batches = [[0, 1], [1], [1, 2]]  # gpu-A's minutes: minute 1 emitted again twice (a worker restarted)
    for minutes in batches:
        producer.produce(t.usage, encode(UsageBatch(node="n1", records=[record("gpu-A", m, "unallocated") for m in minutes])),
                         key=b"n1", partition=0)
    assert producer.flush(30) == 0
    before = duplicates()
    stats = run_until_caught_up(settings)
    assert stats["rows"] == {"usage_raw": 3}
    assert stats["reemitted_rows"] == 2 and duplicates() - before == 2
