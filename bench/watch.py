"""The watcher (alerts and reclaim suggestions) at fleet scale, pure (streams/watch.py, no Kafka): a
cluster of N GPUs in 8-GPU nodes, each node running one job on its 8 GPUs; every minute a scheduler
snapshot and one usage message per node (eight 60-s segment records, as the worker's UsageBatch of a
closed window). CPU per usage message over the steady minutes (the first builds the state), its
share of a core at that rate (N / 8 messages a minute), and the state snapshot's time and size
(taken every `worker_snapshot_interval_s`).

    .venv/bin/python -m bench.watch
"""

from __future__ import annotations

import json
import statistics
import time

import orjson

from bench.common import QUICK, say

GPUS = (1_000, 10_000) if QUICK else (1_000, 10_000, 100_000)
MINUTES = 4
T0 = 1_796_000_000_000 // 60_000 * 60_000


def _record(node: int, gpu: int, minute: int) -> dict:
    start = T0 + minute * 60_000
    return {"schema_version": 1, "record_id": f"n{node}-g{gpu}/{start}/0", "cluster": "bench", "node": f"n{node}",
            "gpu_uuid": f"n{node}-g{gpu}", "gpu_model": "A100-80GB", "start_ms": start, "end_ms": start + 60_000,
            "state": "executing", "job_id": f"job-{node}", "attempt": 0, "tenant": "t", "queue": "q",
            "share_milli": 1000, "gpu_ms": 60_000, "util_pct": 80.0, "util_metric_pct": 80.0, "mem_used_bytes": 1 << 34,
            "energy_j": 18_000.0, "coefficient": 1.0, "coefficient_version": "A100-80GB@2020-01-01",
            "effective_gpu_ms": 60_000, "cost_micros": 40_000, "definition_version": "bench", "sample_count": 12}


def measure(gpus: int) -> dict:
    from gpuledger.config import Settings
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.schemas.models import GpuAssignment, JobEvent, QueueState, SchedulerSnapshot
    from gpuledger.schemas.wire import encode
    from gpuledger.watch import make_watcher

    settings = Settings()
    t = settings.topics
    watcher = make_watcher(settings, load_ledger_config(None))
    nodes = gpus // 8
    offsets = {"life": 0, "snap": 0, "usage": 0}
    for n in range(nodes):
        for kind in ("allocated", "started"):
            event = JobEvent(event_id=f"job-{n}:{kind}", ts_ms=T0, kind=kind, cluster="bench", job_id=f"job-{n}",
                             tenant="t", queue="q", requested_gpus=8,
                             gpus=[GpuAssignment(node=f"n{n}", gpu_uuid=f"n{n}-g{i}") for i in range(8)])
            watcher.on_message(t.lifecycle_accepted, 0, offsets["life"], encode(event))
            offsets["life"] += 1
    per_message = []
    for minute in range(MINUTES):
        snap = SchedulerSnapshot(cluster="bench", ts_ms=T0 + (minute + 1) * 60_000, queues=[
            QueueState(queue="q", priority=1, quota_gpus=gpus, allocated_gpus=gpus, pending_jobs=0, pending_gpus=0)])
        watcher.on_message(t.scheduler_snapshots, 0, offsets["snap"], encode(snap))
        offsets["snap"] += 1
        messages = [orjson.dumps({"schema_version": 1, "node": f"n{n}", "records": [_record(n, g, minute) for g in range(8)]})
                    for n in range(nodes)]
        t0 = time.process_time()
        for k, raw in enumerate(messages):
            watcher.on_message(t.usage, k % 8, offsets["usage"], raw, now_s=time.monotonic())
            offsets["usage"] += 1
        per_message.append((time.process_time() - t0) / len(messages))
    t0 = time.process_time()
    blob = watcher.snapshot()
    snapshot_s = time.process_time() - t0
    us = 1e6 * statistics.median(per_message[1:])
    out = {"gpus": gpus, "usage_messages_per_minute": nodes, "us_per_usage_message": round(us, 1),
           "core_share": round(us * nodes / 60e6, 5), "snapshot_s": round(snapshot_s, 3),
           "snapshot_bytes": len(blob)}
    say(f"watch, {gpus:,} GPUs: {us:,.0f} us per usage message ({nodes:,} a minute: "
        f"{100 * out['core_share']:.2f} % of a core); state snapshot {snapshot_s:.2f} s, {len(blob):,} bytes")
    return out


def run() -> dict:
    rows = [measure(g) for g in GPUS]
    return {"watch_core_share": rows[-1]["core_share"], "watch_detail": {"sizes": rows}}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
