"""A rolling upgrade, through the real broker, worker, sink and engine: a newer producer adds fields at
every level of its messages (tick, batch, GPU, process, job event, GPU assignment, watermark,
scheduler snapshot, queue, pending demand, preemption), and this ledger bills them as it bills the
fields it knows. A wrong value in a known field is still a dead letter: that node is not billed."""

import pytest
from newer_producer import newer

from gpuledger.config import Settings
from gpuledger.embedded.pipeline import run_embedded
from gpuledger.embedded.replay import DumpLine
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuSample,
    JobEvent,
    LifecycleWatermark,
    NodeTick,
    NodeTickBatch,
    PendingByPriority,
    PreemptionFired,
    ProcessSample,
    QueueState,
    SchedulerSnapshot,
)
from gpuledger.warehouse import connect

pytestmark = pytest.mark.integration

T = 1_767_225_600_000  # 2026-01-01 00:00 UTC
S = 1000
TICK_MS = 10 * S
TICKS = 12              # two minutes of GPU-A
JOB_MS = 60 * S         # j1 holds GPU-A for the first minute


def line(topic: str, key: str | None, value: dict) -> DumpLine:
    return DumpLine(topic, key, value)


def tick(node: str, gpu: str, k: int) -> NodeTick:
    return NodeTick(cluster="c1", node=node, ts_ms=T + k * TICK_MS, interval_ms=TICK_MS, gpus=[GpuSample(
        gpu_uuid=gpu, index=0, model="A100-80GB", util_gpu_pct=90.0, power_w=300.0, mem_used_bytes=1 << 30,
        mem_total_bytes=80 << 30, processes=[ProcessSample(pid=42, container_id="slurm-job-j1", sm_util_pct=85.0)])])


def event(kind: str, at_ms: int) -> JobEvent:
    return JobEvent(event_id=f"j1-{kind}", ts_ms=at_ms, kind=kind, cluster="c1", job_id="j1", tenant="t1",
                    queue="q1", requested_gpus=1, aliases={"container_id": "slurm-job-j1"},
                    gpus=[GpuAssignment(node="n1", gpu_uuid="GPU-A", container_id="slurm-job-j1")])


def dump() -> list[DumpLine]:
    lines = [line("job-events", "j1", newer(event("allocated", T))),
             line("job-events", "j1", newer(event("started", T))),
             line("job-events", "j1", newer(event("completed", T + JOB_MS)))]
    half = TICKS // 2
    lines += [line("gpu-samples", "n1", newer(tick("n1", "GPU-A", k))) for k in range(half)]
    lines.append(line("gpu-samples", "n1", {**newer(NodeTickBatch(
        node="n1", ticks=[tick("n1", "GPU-A", k) for k in range(half, TICKS)])), "ts_ms": T + half * TICK_MS}))
    # node n2's ticks are as new, but one known field has the wrong type: dead letters, never billed
    lines += [line("gpu-samples", "n2", {**newer(tick("n2", "GPU-B", k)), "interval_ms": "ten seconds"})
              for k in range(TICKS)]
    lines.append(line("scheduler-snapshots", "c1", newer(SchedulerSnapshot(
        cluster="c1", ts_ms=T + 30 * S, queues=[QueueState(
            queue="q1", quota_gpus=8, allocated_gpus=1, pending_jobs=1, pending_gpus=2,
            pending_by_priority=[PendingByPriority(priority=1, jobs=1, gpus=2)])],
        preemptions=[PreemptionFired(job_id="j0", by_job_id="j1", queue="q1", rule="priority")]))))
    lines += [line("job-events", None, newer(LifecycleWatermark(cluster="c1", ts_ms=T + k * TICK_MS)))
              for k in range(1, TICKS + 2)]
    return lines


def test_a_newer_producers_messages_are_billed_by_this_worker(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", worker_rebalance_timeout_s=4.0, partitions_gpu_samples=2,
                        partitions_job_events=2, partitions_usage=2)
    run = run_embedded(settings, dump(), timeout_s=300)

    client = connect(settings)
    try:
        def rows(sql: str) -> list[tuple]:
            return client.query(sql).result_rows

        usage = dict(rows("SELECT gpu_uuid, sum(gpu_ms) FROM usage_raw GROUP BY gpu_uuid"))
        by_job = dict(rows("SELECT job_id, sum(gpu_ms) FROM usage_raw GROUP BY job_id"))
        cost = rows("SELECT sum(cost_micros) FROM usage_raw WHERE job_id = 'j1'")[0][0]
        events = rows("SELECT kind FROM job_events WHERE job_id = 'j1' ORDER BY ts_ms, kind")
        snapshots = rows("SELECT queue, quota_gpus FROM scheduler_snapshots")
        health = rows("SELECT count() FROM gpu_health WHERE gpu_uuid = 'GPU-A'")[0][0]
    finally:
        client.close()
    assert usage == {"GPU-A": TICKS * TICK_MS}  # GPU-B's ticks were dead letters: not billed
    assert by_job["j1"] == JOB_MS and cost > 0
    assert sorted(k for (k,) in events) == ["allocated", "completed", "started"]
    assert snapshots == [("q1", 8.0)]
    assert health == TICKS  # the sink read the newer ticks whole for the health record
    assert run.sink["dead_letters"] == TICKS  # ... and set GPU-B's aside, with the reason
