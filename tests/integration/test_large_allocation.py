"""A job on 20,000 GPUs through the real parts: the Slurm agent's spool and producer, Tansu, the worker, the
sink and chDB. Its `allocated` names every GPU (~1.8 MB of JSON), more than Kafka's default 1 MB message;
before, the agent's producer refused it for its size and dropped it, so the largest jobs of a fleet were
billed as unallocated time (docs/reliability.md, "A message no broker takes")."""

from __future__ import annotations

from collections import defaultdict

import pytest
from confluent_kafka import Producer

from gpuledger.agents.slurm_agent import LINE_EVENTS, SpoolSink
from gpuledger.embedded.processes import ChildProcess, read_topic, wait_until_caught_up
from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick, UsageBatch
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.sink.loop import run_sink
from gpuledger.topics import EVENT_MAX_MESSAGE_BYTES, create_topics
from gpuledger.warehouse import connect, migrate

pytestmark = pytest.mark.integration

T0 = 1_793_577_600_000  # 2026-11-02T00:00:00Z
S = 1000
NODES, GPUS_PER_NODE = 2_500, 8
#: the nodes that send samples: the first and the last of the job's (the others' ticks change nothing)
MEASURED = ("n00000", f"n{NODES - 1:05d}")


def event(kind: str, at_s: int) -> JobEvent:
    gpus = [GpuAssignment(node=f"n{i // GPUS_PER_NODE:05d}", gpu_index=i % GPUS_PER_NODE, container_id="slurm-job-7")
            for i in range(NODES * GPUS_PER_NODE)] if kind == "allocated" else []
    return JobEvent(event_id=f"slurm:c:7:0:{kind}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id="7",
                    tenant="big", queue="batch", requested_gpus=NODES * GPUS_PER_NODE, gpus=gpus)


def tick(node: str, k: int) -> NodeTick:
    return NodeTick(cluster="c", node=node, ts_ms=T0 + 10 * S * k, interval_ms=10 * S, gpus=[
        GpuSample(gpu_uuid=f"GPU-{node}-{i}", index=i, model="H100-SXM", util_gpu_pct=80.0, power_w=500.0)
        for i in range(GPUS_PER_NODE)])


def test_the_allocation_of_a_job_on_20000_gpus_is_delivered_and_billed(settings, tmp_path):
    create_topics(settings)
    t = settings.topics
    events = [event("submitted", 0), event("allocated", 10), event("started", 10), event("completed", 50)]
    allocated = encode(events[1])
    assert 1_000_000 < len(allocated) < EVENT_MAX_MESSAGE_BYTES, len(allocated)

    # the Slurm agent's own path: its disk spool, drained by a forwarder through its producer
    sink = SpoolSink(settings, "c")
    try:
        for e in events:
            sink.put(LINE_EVENTS, e.job_id, encode(e))
        mark = encode(LifecycleWatermark(cluster="c", ts_ms=T0 + 70 * S))
        for p in range(settings.partitions_job_events):
            sink.put(LINE_EVENTS, None, mark, partition=p)
        assert sink.forwarder.wait_idle(60), f"spool depth {sink.spool.depth}"
        assert (sink.forwarder.unsendable, sink.spool.dropped) == (0, 0)
    finally:
        assert sink.close() == 0
    delivered = [value for _, value in read_topic(settings, t.job_events)]
    assert allocated in delivered

    producer = Producer({**settings.kafka_client_config(), "partitioner": "murmur2_random"})
    for node in MEASURED:
        producer.produce(t.gpu_samples, key=node.encode(), value=encode_node_ticks(node, [tick(node, k) for k in range(6)]))
    assert producer.flush(30) == 0

    with ChildProcess(settings, "worker", log_path=tmp_path / "worker.log") as worker:
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=180, alive=worker)
    records = [r for _, value in read_topic(settings, t.usage) for r in decode(UsageBatch, value).records]
    gpu_ms = defaultdict(int)
    for r in records:
        gpu_ms[(r.node, r.state.value, r.job_id)] += r.gpu_ms
    for node in MEASURED:  # [0,10) free, [10,50) the job's (executing at 80 %), [50,60) free again
        assert gpu_ms[(node, "executing", "7")] == GPUS_PER_NODE * 40 * S, dict(gpu_ms)
        assert gpu_ms[(node, "unallocated", "")] == GPUS_PER_NODE * 20 * S, dict(gpu_ms)
    assert sum(gpu_ms.values()) == len(MEASURED) * GPUS_PER_NODE * 60 * S

    client = connect(settings)
    migrate(client, settings.database)
    client.close()
    run_sink(settings, until_caught_up=True)
    client = connect(settings)
    try:
        rows = client.query(f"SELECT kind, length(gpu_uuids), uniqExact(arrayJoin(gpu_nodes)) FROM "
                            f"{settings.database}.job_events WHERE job_id = '7' AND kind = 'allocated' "
                            "GROUP BY kind, gpu_uuids").result_rows
    finally:
        client.close()
    assert rows == [("allocated", NODES * GPUS_PER_NODE, NODES)]
