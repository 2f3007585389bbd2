"""The pure join path without Kafka or Faust: where a worker's time goes, per stage.

Drives the public pieces the worker uses (wire decode, LifecycleRouter, WatermarkClock,
NodeJoin.close_until -> attribute, encode(UsageBatch)) over a simulated workload in
one process, on one partition, with the same message order as the topics would give.

    .venv/bin/python -m bench.core            # stage table + cProfile top functions
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict

import orjson

from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES
from gpuledger.agents.simcluster import SimSpec, batch_ticks, simulate
from gpuledger.schemas.models import LifecycleWatermark, NodeWatermark
from gpuledger.schemas.wire import decode_lifecycle, decode_metered_ticks, decode_node_allocation, encode
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.router import LifecycleRouter, WatermarkClock
from gpuledger.ledger_files import load_ledger_config

from bench.common import SIZES, say


def workload(nodes: int = 16, hours: float = 0.5, interval_ms: int | None = None,
             ticks_per_message: int | None = None) -> list[tuple[str, bytes]]:
    """(line, wire bytes) of a simulated cluster, event-time ordered (snapshots left out); by
    default at the join benchmark's sampling interval and ticks per message."""
    spec = SimSpec(nodes=nodes, hours=hours, sample_interval_ms=interval_ms or SIZES.join_interval_ms)
    emissions = batch_ticks(simulate(spec), ticks_per_message or SIZES.join_ticks_per_message)
    return [(e.line, encode(e.message)) for e in emissions if e.line in (LINE_SAMPLES, LINE_JOB_EVENTS)]


class _Stages:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, stage: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[stage] += time.perf_counter() - t0


def run_core(messages: list[tuple[str, bytes]], ledger, stages: _Stages | None = None) -> dict:
    """The worker's logic for one partition, message by message; returns counts."""
    st = stages or _Stages()
    router, clock, joins = LifecycleRouter(), WatermarkClock(), {}
    counts = {"ticks": 0, "samples": 0, "records": 0, "usage_messages": 0, "usage_bytes": 0}

    def join_for(node: str) -> NodeJoin:
        j = joins.get(node)
        if j is None:
            j = joins[node] = NodeJoin(node=node)
        return j

    def emit(join: NodeJoin, watermark: int) -> None:
        records = st.timed("join+attribution (close_until)", join.close_until, watermark, ledger)
        if records:
            raw = st.timed("encode UsageBatch",
                           lambda: orjson.dumps({"schema_version": 1, "node": join.node, "records": records}))
            counts["records"] += len(records)
            counts["usage_messages"] += 1
            counts["usage_bytes"] += len(raw)

    for line, raw in messages:
        if line == LINE_SAMPLES:
            ticks = st.timed("decode MeteredTick(s)", decode_metered_ticks, raw)
            join = join_for(ticks[0].node)
            for tick in ticks:
                st.timed("add_tick", join.add_tick, tick)
                counts["ticks"] += 1
                counts["samples"] += len(tick.gpus)
            emit(join, clock.value)
            continue
        message = st.timed("route lifecycle", decode_lifecycle, raw)
        if isinstance(message, LifecycleWatermark):
            # one job-events partition here, so the node watermark is the lifecycle watermark
            mark = encode(NodeWatermark(ts_ms=message.ts_ms, source_partition=0, source_partitions=1))
            watermark = clock.observe(st.timed("route lifecycle", decode_node_allocation, mark))
            for name in sorted(joins):
                emit(joins[name], watermark)
        else:
            for change in st.timed("route lifecycle", router.route, message):
                raw_change = encode(change)
                join_for(change.node).add_change(st.timed("route lifecycle", decode_node_allocation, raw_change))
    return counts


def _worker_core_class():
    """The worker's own message-in/messages-out core (streams/core.py), where this tree has it."""
    try:
        from gpuledger.streams.core import WorkerCore
    except ImportError:
        return None
    return WorkerCore


def run_worker_core(messages: list[tuple[str, bytes]], ledger) -> tuple[dict, object]:
    """The same messages through `WorkerCore` (one job-events and one node partition; its
    node-allocations outputs are fed straight back in). Returns counts and the core."""
    from gpuledger.streams.topic_names import TopicNames

    topics = TopicNames.with_prefix("")
    core = _worker_core_class()(topics, partitions_gpu_samples=1, partitions_job_events=1, ledger=ledger)
    counts = {"ticks": 0, "samples": 0, "usage_messages": 0, "usage_bytes": 0}
    offsets = {topics.gpu_samples: 0, topics.node_allocations: 0, topics.job_events: 0}

    def node(topic: str, raw: bytes) -> None:
        offset = offsets[topic]
        offsets[topic] += 1
        for out in core.on_node(topic, 0, offset, raw):
            if out.topic == topics.usage:
                counts["usage_messages"] += 1
                counts["usage_bytes"] += len(out.value)

    for line, raw in messages:
        if line == LINE_SAMPLES:
            counts["ticks"] += max(1, raw.count(b'"interval_ms"'))
            counts["samples"] += raw.count(b'"gpu_uuid"')
            node(topics.gpu_samples, raw)
        else:
            offset = offsets[topics.job_events]
            offsets[topics.job_events] += 1
            for out in core.on_lifecycle(0, offset, raw):
                if out.topic == topics.node_allocations:  # (lifecycle-accepted goes to the sink)
                    node(topics.node_allocations, out.value)
    return counts, core


def measure(messages=None, profile_top: int = 18) -> dict:
    """Pure-core samples/s (the worker's own core where present), a per-stage split (the public
    join functions, timed one by one), a state-snapshot cost, and the cProfile top functions."""
    if messages is None:
        say(f"core: simulating 16 nodes x {SIZES.core_ticks_hours} h ...")
        messages = workload(16, SIZES.core_ticks_hours)
    ledger = load_ledger_config(None)
    worker_core = _worker_core_class()
    run_core(messages[: len(messages) // 10], ledger)  # warm caches, imports
    stages = _Stages()
    t0, c0 = time.perf_counter(), time.process_time()
    counts = run_core(messages, ledger, stages)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    extra = {"core_driver": "public join functions (LifecycleRouter, NodeJoin, encode)"}
    snapshot = {}
    if worker_core is not None:
        c0 = time.process_time()
        wc_counts, core = run_worker_core(messages, ledger)
        cpu = time.process_time() - c0
        counts = {**counts, **{k: wc_counts[k] for k in ("ticks", "samples")}}
        extra["core_driver"] = "streams.core.WorkerCore"
        from gpuledger.streams.core import JOIN

        c0 = time.perf_counter()
        blob = core.snapshot(JOIN, 0)
        snapshot = {"core_snapshot_ms": 1000 * (time.perf_counter() - c0), "core_snapshot_bytes": len(blob),
                    "core_snapshot_nodes": 16}
    profiler = cProfile.Profile()
    profiler.enable()
    if worker_core is not None:
        run_worker_core(messages, ledger)
    else:
        run_core(messages, ledger)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile_top)
    total = sum(stages.seconds.values())
    return {
        "core_ticks": counts["ticks"],
        "core_samples": counts["samples"],
        "core_records": counts["records"],
        "core_samples_per_s": counts["samples"] / cpu,
        "core_us_per_tick": 1e6 * cpu / counts["ticks"],
        "core_cpu_s": cpu,
        "core_wall_s": wall,
        "core_usage_bytes_per_tick": counts["usage_bytes"] / counts["ticks"],
        "core_stage_share": {k: round(v / total, 4) for k, v in sorted(stages.seconds.items(), key=lambda kv: -kv[1])},
        "core_stage_us_per_tick": {k: round(1e6 * v / counts["ticks"], 1) for k, v in stages.seconds.items()},
        "core_profile_text": _trim_profile(out.getvalue()),
        **extra,
        **snapshot,
    }


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    return "\n".join(line.replace("/work/main/", "").rstrip() for line in lines[start:] if line.strip())


if __name__ == "__main__":
    result = measure()
    print(result.pop("core_profile_text"))
    for k, v in result.items():
        print(f"{k}: {v}")
