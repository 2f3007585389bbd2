"""The real pipeline on a small scenario worked out by hand: Faust worker on Tansu, then the
sink into chDB, then the bill views."""

from __future__ import annotations

from collections import defaultdict

import pytest
from confluent_kafka import Producer

from gpuledger.embedded.broker import free_port
from gpuledger.embedded.processes import ChildProcess, read_topic, wait_until_caught_up
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuSample,
    JobEvent,
    LifecycleWatermark,
    NodeTick,
    UsageBatch,
)
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.warehouse.reports import fetch
from gpuledger.sink.loop import run_sink
from gpuledger.topics import create_topics
from gpuledger.warehouse import connect, migrate
from usage_reader import usage_until

pytestmark = pytest.mark.integration

T0 = 1_793_577_600_000  # 2026-11-02T00:00:00Z
S = 1000


def tick(k: int, g1_down: bool) -> NodeTick:
    ts = T0 + 10 * S * k
    return NodeTick(cluster="c", node="n1", ts_ms=ts, interval_ms=10 * S, gpus=[
        # 300 W and +3000 J every 10 s: 3000 J per tick either way (counter or fallback)
        GpuSample(gpu_uuid="GPU-a", index=0, model="A100-80GB", util_gpu_pct=90.0, power_w=300.0, energy_j=1e6 + 3000.0 * k),
        GpuSample(gpu_uuid="GPU-t", index=1, model="T4", util_gpu_pct=0.0, power_w=30.0,
                  health="down" if g1_down else "ok", down_reason="xid 79" if g1_down else None),
    ])


def job(kind: str, at_s: int, n: int) -> JobEvent:
    return JobEvent(event_id=f"j1-{n}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id="j1", tenant="ta",
                    queue="q", requested_gpus=1,
                    gpus=[GpuAssignment(node="n1", gpu_uuid="GPU-a")] if kind == "allocated" else [])


def publish(settings, messages) -> None:
    producer = Producer({**settings.kafka_client_config(), "partitioner": "murmur2_random"})
    for topic, key, value, partition in messages:
        kwargs = {"partition": partition} if partition is not None else {}
        producer.produce(topic, key=key, value=value, **kwargs)
    assert producer.flush(30) == 0


def read_usage(settings) -> list:
    return [r for _, value in read_topic(settings, settings.topics.usage) for r in decode(UsageBatch, value).records]


@pytest.mark.parametrize("ticks_per_message", [1, 4])
def test_pipeline_attributes_every_gpu_second_and_bills_it(settings, tmp_path, ticks_per_message):
    """The same bill whether the agent sends each tick or batches of them (NodeTickBatch: 4 + 2)."""
    create_topics(settings)
    t = settings.topics
    events = [job("submitted", 0, 0), job("allocated", 10, 1), job("started", 25, 2), job("completed", 50, 3),
              job("completed", 50, 3)]  # the duplicate must be ignored
    messages = [(t.job_events, b"j1", encode(e), None) for e in events]
    ticks = [tick(k, g1_down=k >= 3) for k in range(6)]
    messages += [(t.gpu_samples, b"n1", encode_node_ticks("n1", ticks[i:i + ticks_per_message]), None)
                 for i in range(0, len(ticks), ticks_per_message)]
    messages.append((t.gpu_samples, b"n1", b"{not json", None))  # goes to dead letters
    mark = encode(LifecycleWatermark(cluster="c", ts_ms=T0 + 70 * S))
    messages += [(t.job_events, None, mark, p) for p in range(settings.partitions_job_events)]

    with ChildProcess(settings, "worker", log_path=tmp_path / "worker.log") as worker:
        publish(settings, messages)
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=120, alive=worker)
    records = read_usage(settings)

    by = defaultdict(int)
    cost = defaultdict(int)
    for r in records:
        by[(r.gpu_uuid, r.state.value, r.job_id)] += r.gpu_ms
        cost[(r.gpu_uuid, r.state.value, r.job_id)] += r.cost_micros
    # GPU-a: [0,10) free; allocated at 10, started at 25 (splits tick [20,30)), completed at 50
    assert by[("GPU-a", "unallocated", "")] == 10_000 + 10_000
    assert by[("GPU-a", "allocated_idle", "j1")] == 15_000
    assert by[("GPU-a", "executing", "j1")] == 25_000
    # GPU-t: ok for ticks 0..2, down from tick 3 on
    assert by[("GPU-t", "unallocated", "")] == 30_000
    assert by[("GPU-t", "down", "")] == 30_000
    assert sum(r.gpu_ms for r in records) == 2 * 60_000  # conservation: 2 GPUs x 60 s
    # A100 cost per 10 s tick: fixed 0.48/h x 10 s = 1333.33 micros; energy 3000 J =
    # 0.000833 kWh x 0.12 x 1.4 = 140 micros -> 1473. A 5 s half tick: 666.67 + 70 -> 737.
    assert cost[("GPU-a", "executing", "j1")] == 737 + 1473 + 1473
    assert cost[("GPU-a", "allocated_idle", "j1")] == 1473 + 737
    exec_records = [r for r in records if r.state.value == "executing"]
    assert {r.coefficient_version for r in exec_records} == {"A100-80GB@2020-01-01"}
    assert sum(r.effective_gpu_ms for r in exec_records) == round(5_000 * 2.3) + 2 * round(10_000 * 2.3)
    assert all(r.util_pct == 90.0 for r in exec_records)

    letters = [value for _, value in read_topic(settings, t.dead_letters)]
    assert letters and b"malformed JSON" in letters[0]

    # --- the sink into chDB, then the bills from the views
    client = connect(settings)
    migrate(client, settings.database)
    client.close()
    stats = run_sink(settings, until_caught_up=True)
    assert stats["rows"]["usage_raw"] == len(records)
    assert stats["rows"]["gpu_health"] == 2 * 6  # every GPU of every tick, batched or not
    client = connect(settings)
    try:
        (bill,) = fetch(client, settings.database, "bills")
        capacity = {r["gpu_model"]: r for r in fetch(client, settings.database, "capacity")}
        (job_row,) = fetch(client, settings.database, "jobs", reference_cost_per_gpu_hour=1.0)
    finally:
        client.close()
    assert (str(bill["day"]), bill["tenant"]) == ("2026-11-02", "ta")
    assert bill["compute_cost_micros"] == 737 + 1473 + 1473
    assert bill["idle_cost_micros"] == 1473 + 737
    assert bill["failed_retry_cost_micros"] == 0
    assert bill["compute_gpu_hours"] == pytest.approx(25 / 3600, abs=1e-4)
    assert bill["idle_gpu_hours"] == pytest.approx(15 / 3600, abs=1e-4)
    a100, t4 = capacity["A100-80GB"], capacity["T4"]
    assert (a100["capacity_gpu_seconds"], a100["unallocated_gpu_seconds"], a100["allocated_idle_gpu_seconds"],
            a100["executing_gpu_seconds"], a100["down_gpu_seconds"]) == (60, 20, 15, 25, 0)
    assert (t4["capacity_gpu_seconds"], t4["unallocated_gpu_seconds"], t4["down_gpu_seconds"]) == (60, 30, 30)
    # queued at 0 s, allocated at 10 s: 10 s x 1 GPU waiting
    assert job_row["job_id"] == "j1" and job_row["queue_wait_seconds"] == 10
    assert job_row["cost_micros"] == 3683 + 2210
    assert job_row["opportunity_cost"] == pytest.approx(10 / 3600)


def _worker_messages_in(port: int, topic: str) -> float:
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'gpuledger_messages_in_total\{component="worker",topic="%s"\} (\S+)' % re.escape(topic), text)
    return float(found.group(1)) if found else 0.0


def test_samples_far_ahead_of_the_lifecycle_wait_in_kafka_and_none_is_lost(broker, make_settings, tmp_path):
    """Event-time flow control (streams/app.py `pace_samples`): once more than
    worker_samples_ahead_s of a node's samples wait for the watermark, the worker stops reading their
    partition, so what comes next stays in Kafka instead of its memory; the watermark lets it read
    on, and every GPU-second is billed once."""
    import time

    port = free_port()
    settings = make_settings(kafka_bootstrap=broker.bootstrap, worker_samples_ahead_s=30.0, worker_metrics_port=port)
    create_topics(settings)
    t = settings.topics

    def marks(at_s):
        mark = encode(LifecycleWatermark(cluster="c", ts_ms=T0 + at_s * S))
        return [(t.job_events, None, mark, p) for p in range(settings.partitions_job_events)]

    ticks = [tick(k, g1_down=False) for k in range(60)]  # 600 s of a 2-GPU node, 2 ticks (20 s) a message
    samples = [(t.gpu_samples, b"n1", encode_node_ticks("n1", ticks[i:i + 2]), None) for i in range(0, 60, 2)]
    log = tmp_path / "worker.log"
    with ChildProcess(settings, "worker", "--loglevel", "info", log_path=log) as worker:
        publish(settings, marks(0) + samples[:15])
        deadline = time.monotonic() + 120
        while "gpu-samples[0] paused" not in log.read_text(errors="replace"):
            assert worker.proc.poll() is None and time.monotonic() < deadline, "the partition was never paused"
            time.sleep(0.2)
        publish(settings, samples[15:])
        time.sleep(3.0)
        assert _worker_messages_in(port, t.gpu_samples) == 15  # the second half waits in Kafka
        publish(settings, marks(600))
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=120, alive=worker)
        assert _worker_messages_in(port, t.gpu_samples) == 30
        records = usage_until(settings, 2 * 600_000)
    assert "gpu-samples[0] resumed" in log.read_text(errors="replace")
    assert sum(r.gpu_ms for r in records) == 2 * 600_000  # every GPU-second of both GPUs
    assert len({r.record_id for r in records}) == len(records)  # once
