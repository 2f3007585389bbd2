"""alibaba-genai (cluster-trace-v2026-GenAI): reading the duty-cycle and memory samples of 143 serving pods and the pure conversion into the ledger's data lines.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES, Emission
from gpuledger.agents.simspec import gpu_uuid
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuSample,
    JobEvent,
    JobEventKind,
    LifecycleWatermark,
    NodeTick,
)
from gpuledger.traces.readers import (CLUSTER_GENAI, EPOCH_BASE_MS, HOUR_MS, KIND_ORDER, ORDER_LIFECYCLE, ORDER_SNAPSHOT,
                                    ORDER_WATERMARK, TENANT, Emissions, TraceError, at_ms, csv_rows, say, watermark_times)



GENAI_GPU_MODEL = "undisclosed"



@dataclass(frozen=True)
class Sample:
    """One GenAI sample: trace time (s), pod (container_ip hash), value (NaN: the row has no usable
    value; it still marks its slot)."""

    ts_s: float
    pod: str
    value: float


def read_genai_samples(path: str | Path) -> list[Sample]:
    """pod_gpu_duty_cycle_anon / pod_gpu_memory_used_bytes_anon (.tar.gz or the CSV inside):
    columns value, timestamp_anon, container_ip in any order. A row with a NaN (or empty) value is kept
    with value NaN (its slot is known, its measurement is not); a row with a NaN (or empty) timestamp
    is skipped.
    Both are counted on stderr with their first line."""
    out = []
    nan_values: list[int] = []  # line numbers
    nan_times: list[int] = []
    for lineno, row in csv_rows(Path(path), ("value", "timestamp_anon", "container_ip")):
        where = f"{path}:{lineno}"
        pod = (row["container_ip"] or "").strip()
        if not pod:
            raise TraceError(f"{where}: container_ip is empty")
        try:  # an empty field is a missing number, as NaN is (pandas writes NaN as an empty field)
            ts, value = (float(row[c]) if row[c].strip() else math.nan for c in ("timestamp_anon", "value"))
        except (TypeError, ValueError):
            raise TraceError(f"{where}: timestamp_anon and value must be numbers, got {row['timestamp_anon']!r}, {row['value']!r}") from None
        if math.isinf(ts) or math.isinf(value):
            raise TraceError(f"{where}: timestamp_anon and value must be finite, got {row['timestamp_anon']!r}, {row['value']!r}")
        if math.isnan(ts):  # no slot to put it in
            nan_times.append(lineno)
            continue
        if math.isnan(value):
            nan_values.append(lineno)
        out.append(Sample(ts, pod, value))
    if nan_times:
        say(f"[replay-trace] {path}: skipped {len(nan_times)} row(s) with a NaN timestamp_anon (first at line {nan_times[0]})")
    if nan_values:
        say(f"[replay-trace] {path}: {len(nan_values)} row(s) with a NaN value (first at line {nan_values[0]}): "
            "kept as slots without a measurement")
    if not any(not math.isnan(s.value) for s in out):
        raise TraceError(f"{path}: no samples")
    return out



def check_genai_files(duty: Sequence[Sample], memory: Sequence[Sample], duty_path: str | Path, memory_path: str | Path) -> None:
    """Refuse the two files swapped (they have the same columns): a duty cycle is a percentage, GPU
    memory is bytes. Swapped, the replay would clamp the bytes to 100 % busy and find no memory in use.
    Other duty values outside 0-100 are clamped (genai_ticks), and counted on stderr here."""
    duty_values = [s.value for s in duty if not math.isnan(s.value)]
    above = sum(1 for v in duty_values if v > 100)
    if above * 2 > len(duty_values):
        raise TraceError(f"{duty_path}: {above} of {len(duty_values)} duty-cycle values are above 100 (up to "
                         f"{max(duty_values):g}): a duty cycle is a percentage; is this the memory file? (--duty takes "
                         "pod_gpu_duty_cycle_anon, --memory pod_gpu_memory_used_bytes_anon)")
    outside = [v for v in duty_values if not 0 <= v <= 100]
    if outside:
        say(f"[replay-trace] {duty_path}: {len(outside)} duty-cycle value(s) outside 0-100 clamped (first: {outside[0]:g})")
    memory_max = max((s.value for s in memory if not math.isnan(s.value)), default=0.0)
    if 0 < memory_max <= 100:
        raise TraceError(f"{memory_path}: no GPU memory value above 100 bytes (the largest is {memory_max:g}): GPU memory "
                         "is in bytes; is this the duty-cycle file? (--duty takes pod_gpu_duty_cycle_anon, --memory "
                         "pod_gpu_memory_used_bytes_anon)")


# =========================================================================== genai: conversion
@dataclass
class GenaiReplay:
    cluster: str
    base_ms: int
    end_ms: int
    emissions: Emissions
    inventory_ticks: list[NodeTick]  # the first tick of every pod
    pods: list[str]
    median_interval_ms: int
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GenaiTick:
    pod: str
    attempt: int
    ts_ms: int
    interval_ms: int
    duty_pct: float | None  # None: the row's value was NaN
    mem_bytes: int | None


def genai_ticks(duty: Sequence[Sample], memory: Sequence[Sample], *, base_ms: int = EPOCH_BASE_MS,
                gap_split_s: float = 600.0, max_pods: int | None = None) -> tuple[list[GenaiTick], int, list[str]]:
    """Per-pod ticks: each duty-cycle sample covers the time to the pod's next sample; the last
    sample of a stretch covers the median sampling interval. A gap longer than `gap_split_s`
    (no telemetry for > 10 intervals) ends the pod's holding (stretch = attempt); the next
    sample starts a new attempt. A row with a NaN value is a tick of its own with no duty cycle
    (held, unmeasured), so the sample before it is not stretched over its slot. Memory is joined
    by pod and the nearest timestamp within one median interval (NaN or negative: unknown; negatives
    counted on stderr). Trace time is mapped so that the first duty sample is at `base_ms`.
    `max_pods`: only the first N pods (N >= 1) in order of their earliest sample (ties in file
    order), so a re-sorted file replays the same pods.
    Samples of a pod at the same millisecond are one sample (the first is kept), so every tick
    covers at least 1 ms. Returns (ticks sorted by time, median interval in ms, pods)."""
    if not duty:
        raise TraceError("no duty-cycle samples")
    if max_pods is not None and max_pods < 1:
        raise TraceError(f"max_pods must be a whole number >= 1, got {max_pods}")
    by_pod: dict[str, list[Sample]] = {}
    for s in duty:
        by_pod.setdefault(s.pod, []).append(s)
    # sorted() is stable: pods whose first samples tie keep their order of appearance in the file
    order = sorted(by_pod, key=lambda pod: min(s.ts_s for s in by_pod[pod]))
    pods = order[:max_pods] if max_pods is not None else order
    origin = min(s.ts_s for s in duty)
    gaps = []
    for p in by_pod.values():
        p.sort(key=lambda s: s.ts_s)
        gaps.extend(b.ts_s - a.ts_s for a, b in zip(p, p[1:]) if b.ts_s > a.ts_s)
    median_s = statistics.median(gaps) if gaps else 60.0
    median_ms = max(1, round(median_s * 1000))

    negative_memory = sum(1 for s in memory if s.value < 0)  # NaN ones were reported when read
    if negative_memory:
        say(f"[replay-trace] {negative_memory} memory sample(s) are negative: memory unknown for their ticks")
    mem_by_pod: dict[str, tuple[list[float], list[float]]] = {}
    for s in sorted(memory, key=lambda s: (s.pod, s.ts_s)):
        ts_list, values = mem_by_pod.setdefault(s.pod, ([], []))
        ts_list.append(s.ts_s)
        values.append(s.value)

    def memory_at(pod: str, ts: float) -> int | None:
        found = mem_by_pod.get(pod)
        if not found:
            return None
        ts_list, values = found
        i = bisect.bisect_left(ts_list, ts)
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(ts_list) and abs(ts_list[j] - ts) <= median_s and (best is None or abs(ts_list[j] - ts) < abs(ts_list[best] - ts)):
                best = j
        return None if best is None or not values[best] >= 0 else int(values[best])

    ticks: list[GenaiTick] = []
    for pod in pods:
        # de-duplicated before the next timestamps are taken: a duplicate would give a 0 ms tick
        samples, times = [], []
        for s in by_pod[pod]:
            ts_ms = at_ms(base_ms, s.ts_s - origin)
            if not times or ts_ms != times[-1]:
                samples.append(s)
                times.append(ts_ms)
        attempt = 0
        for k, s in enumerate(samples):
            nxt = samples[k + 1].ts_s if k + 1 < len(samples) else None
            if nxt is None or nxt - s.ts_s > gap_split_s:
                interval = median_ms
            else:
                interval = times[k + 1] - times[k]  # >= 1: times are distinct and sorted
            interval = min(interval, HOUR_MS)
            duty_pct = None if math.isnan(s.value) else min(100.0, max(0.0, s.value))
            ticks.append(GenaiTick(pod, attempt, times[k], interval, duty_pct, memory_at(pod, s.ts_s)))
            if nxt is not None and nxt - s.ts_s > gap_split_s:
                attempt += 1
    ticks.sort(key=lambda t: (t.ts_ms, t.pod))
    return ticks, median_ms, pods


def convert_genai(
    duty: Sequence[Sample],
    memory: Sequence[Sample],
    *,
    cluster: str = CLUSTER_GENAI,
    base_ms: int = EPOCH_BASE_MS,
    gap_split_s: float = 600.0,
    watermark_every_ms: int = 300_000,
    max_pods: int | None = None,
) -> GenaiReplay:
    """The GenAI trace as the ledger's data lines: each pod (container_ip) is a node with one GPU
    that the pod holds; per stretch of samples (see `genai_ticks`) `allocated` + `started` at its
    first sample and `completed` at its last sample + interval; a NodeTick per sample with
    util_gpu_pct = duty cycle and mem_used_bytes from the memory file; LifecycleWatermarks every
    `watermark_every_ms` (5 min: a tick waits at most that long to be closed) and a final one."""
    ticks, median_ms, pods = genai_ticks(duty, memory, base_ms=base_ms, gap_split_s=gap_split_s, max_pods=max_pods)
    if not ticks:
        raise TraceError("no ticks")
    uuids = {pod: gpu_uuid(cluster, pod, 0) for pod in pods}
    items: list[tuple] = []  # (ts_ms, class, seq, kind, payload)
    stretches: dict[tuple[str, int], list[int]] = {}
    for t in ticks:
        span = stretches.setdefault((t.pod, t.attempt), [t.ts_ms, t.ts_ms + t.interval_ms])
        span[1] = t.ts_ms + t.interval_ms
    for (pod, attempt), (start, end) in sorted(stretches.items()):
        for kind, ts, with_gpus in ((JobEventKind.allocated, start, True), (JobEventKind.started, start, False),
                                    (JobEventKind.completed, end, False)):
            items.append((ts, ORDER_LIFECYCLE, KIND_ORDER[kind], (pod, attempt), ("event", pod, attempt, kind, with_gpus)))
    for i, t in enumerate(ticks):
        items.append((t.ts_ms, ORDER_SNAPSHOT, i, ("", 0), ("tick", t)))  # after the lifecycle at equal times
    end_ms = max(t.ts_ms + t.interval_ms for t in ticks)
    for ts in watermark_times(base_ms, end_ms, watermark_every_ms):
        items.append((ts, ORDER_WATERMARK, 0, ("", 0), ("watermark", ts)))
    items.sort(key=lambda it: it[:4])

    first_ticks: dict[str, NodeTick] = {}

    def make(item: tuple) -> Emission:
        what = item[4]
        if what[0] == "tick":
            t: GenaiTick = what[1]
            tick = NodeTick(cluster=cluster, node=t.pod, ts_ms=t.ts_ms, interval_ms=t.interval_ms, gpus=[
                GpuSample(gpu_uuid=uuids[t.pod], index=0, model=GENAI_GPU_MODEL, util_gpu_pct=t.duty_pct,
                          mem_used_bytes=t.mem_bytes)])
            return Emission(LINE_SAMPLES, t.pod, tick)
        if what[0] == "event":
            _, pod, attempt, kind, with_gpus = what
            gpus = [GpuAssignment(node=pod, gpu_uuid=uuids[pod], share_milli=1000, container_id=pod)] if with_gpus else []
            ev = JobEvent(event_id=f"{pod}/{attempt}/{kind.value}", ts_ms=item[0], kind=kind, cluster=cluster, job_id=pod,
                          attempt=attempt, tenant=TENANT, queue="serving", requested_gpus=1.0, gpus=gpus)
            return Emission(LINE_JOB_EVENTS, pod, ev)
        return Emission(LINE_JOB_EVENTS, None, LifecycleWatermark(cluster=cluster, ts_ms=what[1]))

    for t in ticks:
        if t.pod not in first_ticks:
            first_ticks[t.pod] = NodeTick(cluster=cluster, node=t.pod, ts_ms=t.ts_ms, interval_ms=t.interval_ms, gpus=[
                GpuSample(gpu_uuid=uuids[t.pod], index=0, model=GENAI_GPU_MODEL)])
    counts = {"pods": len(pods), "ticks": len(ticks), "attempts": len(stretches), "events": 3 * len(stretches),
              "watermarks": len(items) - len(ticks) - 3 * len(stretches)}
    return GenaiReplay(cluster=cluster, base_ms=base_ms, end_ms=end_ms, emissions=Emissions(items, make, base_ms, end_ms),
                       inventory_ticks=list(first_ticks.values()), pods=pods, median_interval_ms=median_ms, counts=counts)
