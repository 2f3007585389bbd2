"""Footprint: what the ledger writes and spends per GPU, and how that changes from 100 to 10,000
simulated GPUs (issue #13, point 6; docs/performance.md "Footprint").

For each size, a simulated cluster (8-GPU nodes, jobs coming and going, sampled every 5 s, ten
ticks to a message as the agent batches them) goes through the worker's own core
(`streams.core.WorkerCore`, one partition, no Kafka) under the bundled ledger (60-s segments):
worker CPU per GPU sample. Its usage records and the samples' `gpu_health` rows (the sink's own
row builders) go into a fresh chDB with the real migrations; after OPTIMIZE FINAL the compressed
bytes of the active parts, per GPU-day of event time. The smallest size also runs with one
record per tick (window 0), for the rows-per-GPU-hour comparison.

    .venv/bin/python -m bench.footprint
"""

from __future__ import annotations

import shutil
import time
from collections import Counter, defaultdict
from dataclasses import replace

import orjson

from gpuledger.agents.simcluster import SimSpec, batch_ticks, simulate
from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES
from gpuledger.schemas.models import UsageBatch
from gpuledger.schemas.wire import decode, decode_node_ticks, encode
from gpuledger.sink.rows import Source, health_rows, usage_rows
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.topic_names import TopicNames
from gpuledger.warehouse import connect, insert_rows, migrate

from bench.common import QUICK, knob, say, workdir

INTERVAL_MS = 5_000
TICKS_PER_MESSAGE = 10
DAY_H = 24.0
#: (GPUs, hours of event time): the larger the fleet, the shorter the stretch (the simulator and
#: chDB on 2 shared cores); rows and bytes are per GPU-hour / GPU-day, so sizes compare
SIZES_FULL = ((100, 2.0), (1_000, 0.5), (10_000, 0.1))
SIZES_QUICK = ((100, 1.0), (1_000, 0.25), (10_000, 0.05))


def _nodes(gpus: int) -> int:
    return max(1, round(gpus / 8))


def _messages(gpus: int, hours: float) -> list[tuple[str, bytes]]:
    spec = SimSpec(nodes=_nodes(gpus), gpus_per_node=8, hours=hours, sample_interval_ms=INTERVAL_MS)
    return [(e.line, encode(e.message)) for e in batch_ticks(simulate(spec), TICKS_PER_MESSAGE)
            if e.line in (LINE_SAMPLES, LINE_JOB_EVENTS)]


def core_pass(messages, ledger) -> tuple[float, int, list[bytes], list[bytes]]:
    """CPU seconds of the worker core over (line, raw) messages in event-time order, GPU samples, and
    its usage and lifecycle-accepted messages (what the sink writes to usage_raw and job_events)."""
    topics = TopicNames.with_prefix("")
    core = WorkerCore(topics, partitions_gpu_samples=1, partitions_job_events=1, ledger=ledger)
    offsets = {topics.gpu_samples: 0, topics.node_allocations: 0, topics.job_events: 0}
    usage, accepted, samples = [], [], 0

    def node(topic, raw):
        offset = offsets[topic]
        offsets[topic] += 1
        usage.extend(o.value for o in core.on_node(topic, 0, offset, raw) if o.topic == topics.usage)

    c0 = time.process_time()
    for line, raw in messages:
        if line == LINE_SAMPLES:
            samples += raw.count(b'"gpu_uuid"')
            node(topics.gpu_samples, raw)
        elif line == LINE_JOB_EVENTS:
            offset = offsets[topics.job_events]
            offsets[topics.job_events] += 1
            for out in core.on_lifecycle(0, offset, raw):
                if out.topic == topics.node_allocations:
                    node(topics.node_allocations, out.value)
                elif out.topic == topics.lifecycle_accepted:
                    accepted.append(out.value)
    return time.process_time() - c0, samples, usage, accepted


def _warehouse_bytes(name: str, usage: list[bytes], messages) -> dict[str, dict]:
    """Rows and compressed bytes on disk of usage_raw and gpu_health after OPTIMIZE FINAL."""
    path = workdir() / f"footprint-{name}"
    if path.exists():
        shutil.rmtree(path)
    settings = Settings(warehouse=f"chdb:{path}", database="bench_footprint")
    client = connect(settings)
    try:
        migrate(client, settings.database)
        rows = [r for i, raw in enumerate(usage) for r in usage_rows(decode(UsageBatch, raw), Source("usage", 0, i))]
        for i in range(0, len(rows), 50_000):
            insert_rows(client, "usage_raw", rows[i:i + 50_000], database=settings.database)
        health = []
        for i, (line, raw) in enumerate(messages):
            if line == LINE_SAMPLES:
                for tick in decode_node_ticks(raw):
                    health.extend(health_rows(tick, Source("gpu-samples", 0, i)))
            if len(health) >= 50_000:
                insert_rows(client, "gpu_health", health, database=settings.database)
                health = []
        if health:
            insert_rows(client, "gpu_health", health, database=settings.database)
        out = {}
        for table in ("usage_raw", "gpu_health"):
            client.command(f"OPTIMIZE TABLE {settings.database}.{table} FINAL")
            (count, compressed, uncompressed), = client.query(
                "SELECT sum(rows), sum(data_compressed_bytes), sum(data_uncompressed_bytes) FROM system.parts "
                "WHERE active AND database = {db:String} AND table = {t:String}",
                parameters={"db": settings.database, "t": table}).result_rows
            out[table] = {"rows": int(count), "compressed_bytes": int(compressed),
                          "uncompressed_bytes": int(uncompressed)}
        return out
    finally:
        client.close()
        shutil.rmtree(path, ignore_errors=True)


def _held(records: list[dict], by: str) -> set[tuple]:
    """The slots of a segment's records: (job, attempt), or (state, job) with `by="state"`."""
    return {(r.get("job_id"), r.get("attempt")) if by == "holder" else (r["state"], r.get("job_id")) for r in records}


def _segments_by_window(records: list[dict], window_ms: int) -> dict[tuple, dict[int, list[dict]]]:
    """(GPU, window) -> a segment's start -> its records."""
    windows: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        windows[(r["gpu_uuid"], r["start_ms"] // window_ms)][r["start_ms"]].append(r)
    return windows


def rows_breakdown(records: list[dict], gpu_hours: float, window_ms: int) -> dict:
    """Usage records per GPU-hour split by cause: one per GPU and window, one more per cut inside a
    window (a holder change, an executing/idle change, or else: utilization or memory becoming
    measured or not, a missed sample), and the extra slots of shared GPUs (a record per attempt and
    state of a segment)."""
    windows = _segments_by_window(records, window_ms)
    cuts: Counter[str] = Counter()
    slots = 0
    for segments in windows.values():
        starts = sorted(segments)
        slots += sum(len(segments[s]) - 1 for s in starts)
        for a, b in zip(starts, starts[1:]):
            before, after = segments[a], segments[b]
            if _held(before, "holder") != _held(after, "holder"):
                cuts["holder"] += 1
            elif _held(before, "state") != _held(after, "state"):
                cuts["state"] += 1
            else:
                cuts["other"] += 1
    return {"windows": len(windows) / gpu_hours, "cuts": sum(cuts.values()) / gpu_hours,
            "cuts_by_kind": {k: v / gpu_hours for k, v in sorted(cuts.items())}, "shared_slots": slots / gpu_hours}


def rows_one_per_holder(records: list[dict], gpu_hours: float, window_ms: int) -> float:
    """Usage records per GPU-hour if a record were one per holder of a stretch, its executing and idle
    parts as columns (docs/performance.md, "The three targets still missed"): the same records regrouped,
    within a window consecutive segments with the same holders merged, one row per holder (the
    unallocated and down parts count as one holder, None). An estimate from today's records, not a
    ledger built that way."""
    rows = 0
    for segments in _segments_by_window(records, window_ms).values():
        before = None
        for start in sorted(segments):
            now = _held(segments[start], "holder")
            if now != before:
                rows += len(now)
            before = now
    return rows / gpu_hours


def measure_size(gpus: int, hours: float, ledger, *, warehouse: bool = True, label: str = "") -> dict:
    say(f"footprint: {gpus:,} GPUs x {hours} h at {INTERVAL_MS // 1000} s sampling{label} ...")
    messages = _messages(gpus, hours)
    cpu, samples, usage, _ = core_pass(messages, ledger)
    records = [r for raw in usage for r in orjson.loads(raw)["records"]]
    gpus = 8 * _nodes(gpus)  # whole 8-GPU nodes
    gpu_hours = gpus * hours
    row = {"gpus": gpus, "hours": hours, "samples": samples, "usage_records": len(records),
           "worker_cpu_us_per_sample": 1e6 * cpu / samples, "usage_rows_per_gpu_hour": len(records) / gpu_hours,
           "usage_messages": len(usage)}
    if ledger.segment_window_ms > 1:
        row["usage_rows_breakdown"] = rows_breakdown(records, gpu_hours, ledger.segment_window_ms)
        row["usage_rows_per_gpu_hour_one_per_holder"] = rows_one_per_holder(records, gpu_hours,
                                                                            ledger.segment_window_ms)
    if warehouse:
        tables = _warehouse_bytes(f"{gpus}", usage, messages)
        gpu_days = gpu_hours / DAY_H
        row["usage_raw_bytes_per_gpu_day"] = tables["usage_raw"]["compressed_bytes"] / gpu_days
        row["gpu_health_bytes_per_gpu_day"] = tables["gpu_health"]["compressed_bytes"] / gpu_days
        row["tables"] = tables
    say(f"footprint: {gpus:,} GPUs: {row['worker_cpu_us_per_sample']:.2f} us CPU/sample, "
        f"{row['usage_rows_per_gpu_hour']:.1f} usage rows/GPU-hour"
        + (f", usage_raw {row['usage_raw_bytes_per_gpu_day']:,.0f} B/GPU-day, gpu_health "
           f"{row['gpu_health_bytes_per_gpu_day']:,.0f} B/GPU-day" if warehouse else ""))
    return row


def run() -> dict:
    ledger = load_ledger_config(None)  # the shipped defaults: 60-s segments
    sizes = SIZES_QUICK if QUICK else SIZES_FULL
    largest = knob("footprint_max_gpus", sizes[-1][0], sizes[-1][0])
    rows = [measure_size(g, h, ledger) for g, h in sizes if g <= largest]
    small_gpus, small_hours = sizes[0]
    per_tick = measure_size(small_gpus, small_hours, replace(ledger, segment_window_ms=1), warehouse=False,
                            label=", one record per tick")
    first = rows[0]
    return {
        "usage_rows_per_gpu_hour_5s": first["usage_rows_per_gpu_hour"],
        "usage_rows_per_gpu_hour_5s_per_tick": per_tick["usage_rows_per_gpu_hour"],
        "usage_rows_breakdown_5s": first["usage_rows_breakdown"],
        "usage_rows_per_gpu_hour_5s_one_per_holder": first["usage_rows_per_gpu_hour_one_per_holder"],
        "usage_raw_bytes_per_gpu_day": first["usage_raw_bytes_per_gpu_day"],
        "gpu_health_bytes_per_gpu_day": first["gpu_health_bytes_per_gpu_day"],
        "footprint_scaling": rows,
        "footprint_per_tick": per_tick,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
