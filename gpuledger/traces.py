"""Replaying public production GPU traces through the real pipeline (`gpuledger replay-trace`).

Two traces from alibaba/clusterdata (docs/traces.md: where to get them, what the results show):

- **alibaba-v2023** (cluster-trace-gpu-v2023, "openb"): a pod list (creation / scheduled /
  deletion times, GPUs asked for, fractional GPU shares, allowed GPU models, QoS, final phase)
  and a node list (GPUs and their models). No utilization samples.
- **alibaba-genai** (cluster-trace-v2026-GenAI): GPU duty cycle and GPU memory of 143 serving
  pods, one sample about every 57 s over 22.8 h.

Each replay turns the trace into the ledger's three data lines (`Emission`s in event-time
order, as the simulator emits them), pushes them through Tansu, the Faust worker and the sink
into chDB (`gpuledger.pipeline.run_embedded`), then prints a JSON summary computed **from the
ClickHouse tables** (job_attempts, job_events, usage_raw, scheduler_snapshots, node_inventory).

Layers: reading (CSV / tar.gz -> small records), pure conversion (records -> emissions; unit
tested without Kafka or ClickHouse), summary SQL, and the CLI edge (`register_cli`, `main`).

Time: trace timestamps are seconds relative to the trace's own origin (the GenAI ones are
anonymized); they are mapped onto EPOCH_BASE_MS (2023-01-01T00:00:00Z) so that every ts_ms is a
valid epoch time. Replays run on event time only: as fast as the pipeline goes.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import io
import json
import statistics
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuledger.agents.simcluster import LINE_JOB_EVENTS, LINE_SAMPLES, LINE_SNAPSHOTS, Emission, gpu_uuid
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuSample,
    JobEvent,
    JobEventKind,
    LifecycleWatermark,
    NodeTick,
    PendingByPriority,
    QueueState,
    SchedulerSnapshot,
)
from gpuledger.sink import sink_topics

#: Trace time 0 is mapped onto this instant (2023-01-01T00:00:00Z, epoch milliseconds).
EPOCH_BASE_MS = 1_672_531_200_000
_HOUR_MS = 3_600_000

TRACES = ("alibaba-v2023", "alibaba-genai")
CLUSTER_V2023 = "alibaba-v2023"
CLUSTER_GENAI = "alibaba-genai"
#: Neither trace names tenants: every job is billed to this one.
TENANT = "default"
#: Queue priorities for the v2023 QoS classes (the trace gives none; used in events and snapshots).
QOS_PRIORITY = {"Guaranteed": 30, "LS": 20, "Burstable": 10, "BE": 0}
#: The phase of a v2023 pod as the warehouse tells it (see `V2023_SUMMARY_SQL`).
PHASES = ("Running", "Succeeded", "Failed", "Pending")
#: What ends a scheduled v2023 pod at its deletion time, by its final phase.
PHASE_TERMINAL = {
    "Succeeded": JobEventKind.completed,
    "Failed": JobEventKind.failed,
    # deleted while running (a service scaled in, a user deleting it): its GPUs are released then
    "Running": JobEventKind.cancelled,
}
#: The GenAI trace does not name the GPU model.
GENAI_GPU_MODEL = "undisclosed"


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file (and line)."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# =========================================================================== reading
def _open_text(path: Path) -> str:
    """The text of a CSV file, or of the single CSV inside a .tar.gz/.tgz (read in memory)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    name = path.name.lower()
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        try:
            with tarfile.open(path) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and m.name.lower().endswith(".csv")]
                if len(members) != 1:
                    raise TraceError(f"{path}: expected exactly one .csv inside, found {[m.name for m in members]}")
                fh = tar.extractfile(members[0])
                assert fh is not None
                return fh.read().decode("utf-8")
        except tarfile.TarError as exc:
            raise TraceError(f"{path}: not a readable tar archive: {exc}") from None
    return path.read_text(encoding="utf-8")


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with a header that has at least `required` columns."""
    reader = csv.DictReader(io.StringIO(_open_text(path), newline=""))
    missing = [c for c in required if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; header is {reader.fieldnames}")
    for lineno, row in enumerate(reader, start=2):
        yield lineno, row


def _int(value: str, what: str, where: str, *, optional: bool = False) -> int | None:
    text = (value or "").strip()
    if text == "" or text.lower() == "nan":
        if optional:
            return None
        raise TraceError(f"{where}: {what} is empty")
    try:
        number = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} must be a number, got {value!r}") from None
    if number != int(number) or number < 0:
        raise TraceError(f"{where}: {what} must be a whole number >= 0, got {value!r}")
    return int(number)


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # "" for CPU-only nodes


@dataclass(frozen=True)
class TracePod:
    name: str
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...]  # allowed GPU models; () = any
    qos: str
    phase: str
    creation_s: int
    deletion_s: int
    scheduled_s: int | None  # None: never scheduled
    cpu_milli: int = 0
    memory_mib: int = 0

    @property
    def held_milli(self) -> int:
        """GPUs held while scheduled, in thousandths: num_gpu x gpu_milli."""
        return self.num_gpu * self.gpu_milli

    @property
    def is_gpu(self) -> bool:
        return self.held_milli > 0


NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
               "creation_time", "deletion_time", "scheduled_time")


def read_nodes(path: str | Path) -> list[TraceNode]:
    """The v2023 node list (openb_node_list_*.csv): sn, cpu_milli, memory_mib, gpu, model."""
    nodes, seen = [], set()
    for lineno, row in _rows(Path(path), NODE_COLUMNS):
        where = f"{path}:{lineno}"
        name = (row["sn"] or "").strip()
        if not name:
            raise TraceError(f"{where}: sn (node name) is empty")
        if name in seen:
            raise TraceError(f"{where}: node {name!r} listed twice")
        seen.add(name)
        gpus = _int(row["gpu"], "gpu", where)
        model = (row["model"] or "").strip()
        if model.lower() == "nan":
            model = ""
        if gpus and not model:
            raise TraceError(f"{where}: node {name} has {gpus} GPU(s) but no model")
        nodes.append(TraceNode(name, _int(row["cpu_milli"], "cpu_milli", where), _int(row["memory_mib"], "memory_mib", where),
                               gpus, model if gpus else ""))
    if not nodes:
        raise TraceError(f"{path}: no nodes")
    return nodes


def parse_gpu_spec(text: str) -> tuple[str, ...]:
    """'V100M16|V100M32' -> ('V100M16', 'V100M32'); '' or 'nan' -> () (any model)."""
    text = (text or "").strip()
    if not text or text.lower() == "nan":
        return ()
    return tuple(sorted({part.strip() for part in text.split("|") if part.strip()}))


def read_pods(path: str | Path) -> list[TracePod]:
    """A v2023 pod list (openb_pod_list_*.csv; every list the repository publishes has this format)."""
    pods, seen = [], set()
    for lineno, row in _rows(Path(path), POD_COLUMNS):
        where = f"{path}:{lineno}"
        name = (row["name"] or "").strip()
        if not name:
            raise TraceError(f"{where}: name is empty")
        if name in seen:
            raise TraceError(f"{where}: pod {name!r} listed twice")
        seen.add(name)
        phase = (row["pod_phase"] or "").strip()
        if phase not in PHASES:
            raise TraceError(f"{where}: pod_phase must be one of {', '.join(PHASES)}, got {phase!r}")
        qos = (row["qos"] or "").strip()
        if not qos:
            raise TraceError(f"{where}: qos is empty")
        num_gpu = _int(row["num_gpu"], "num_gpu", where)
        gpu_milli = _int(row["gpu_milli"], "gpu_milli", where)
        if gpu_milli > 1000:
            raise TraceError(f"{where}: gpu_milli is the share of one GPU (0..1000), got {gpu_milli}")
        creation = _int(row["creation_time"], "creation_time", where)
        deletion = _int(row["deletion_time"], "deletion_time", where)
        scheduled = _int(row["scheduled_time"], "scheduled_time", where, optional=True)
        if scheduled is not None and not creation <= scheduled <= deletion:
            raise TraceError(f"{where}: expected creation <= scheduled <= deletion, got {creation}, {scheduled}, {deletion}")
        if deletion < creation:
            raise TraceError(f"{where}: deletion_time {deletion} is before creation_time {creation}")
        pods.append(TracePod(
            name=name, num_gpu=num_gpu, gpu_milli=gpu_milli, gpu_spec=parse_gpu_spec(row["gpu_spec"]), qos=qos,
            phase=phase, creation_s=creation, deletion_s=deletion, scheduled_s=scheduled,
            cpu_milli=_int(row["cpu_milli"], "cpu_milli", where), memory_mib=_int(row["memory_mib"], "memory_mib", where),
        ))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods


@dataclass(frozen=True)
class Sample:
    """One GenAI sample: trace time (s), pod (container_ip hash), value."""

    ts_s: float
    pod: str
    value: float


def read_genai_samples(path: str | Path) -> list[Sample]:
    """pod_gpu_duty_cycle_anon / pod_gpu_memory_used_bytes_anon (.tar.gz or the CSV inside):
    columns value, timestamp_anon, container_ip in any order."""
    out = []
    for lineno, row in _rows(Path(path), ("value", "timestamp_anon", "container_ip")):
        where = f"{path}:{lineno}"
        pod = (row["container_ip"] or "").strip()
        if not pod:
            raise TraceError(f"{where}: container_ip is empty")
        try:
            ts, value = float(row["timestamp_anon"]), float(row["value"])
        except (TypeError, ValueError):
            raise TraceError(f"{where}: timestamp_anon and value must be numbers, got {row['timestamp_anon']!r}, {row['value']!r}") from None
        if value != value or ts != ts:  # NaN
            continue
        out.append(Sample(ts, pod, value))
    if not out:
        raise TraceError(f"{path}: no samples")
    return out


# =========================================================================== emission plumbing
class Emissions:
    """A Sized, lazily built, event-time-ordered iterable of Emissions (so `publish` knows the
    total for progress), remembering the event time of the last one handed out."""

    def __init__(self, items: Sequence[Any], make: Callable[[Any], Emission], start_ms: int, end_ms: int):
        self._items = items
        self._make = make
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.last_ts_ms = start_ms

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Emission]:
        for item in self._items:
            emission = self._make(item)
            self.last_ts_ms = getattr(emission.message, "ts_ms", self.last_ts_ms)
            yield emission


def _ms(base_ms: int, seconds: float) -> int:
    return base_ms + round(seconds * 1000)


def _watermark_times(start_ms: int, end_ms: int, every_ms: int) -> list[int]:
    """Every `every_ms` after start, below end, then end (the final watermark)."""
    times = list(range(start_ms + every_ms, end_ms, every_ms))
    times.append(end_ms)
    return times


# =========================================================================== v2023: placement
@dataclass
class _NodeGpus:
    name: str
    model: str
    uuids: list[str]
    free: list[int]  # free milli per GPU

    def fit(self, count: int, milli: int) -> list[int] | None:
        """Indices of the first `count` GPUs with at least `milli` free, or None."""
        chosen = [i for i, f in enumerate(self.free) if f >= milli]
        return chosen[:count] if len(chosen) >= count else None


class FirstFitPlacer:
    """Places pods onto the node inventory's GPUs: the first node (in node-list order) with an
    allowed model and `num_gpu` GPUs that each have `gpu_milli` free; on it the first such GPUs.
    The trace has no placement, so this is the ledger's stand-in; what it cannot place (the
    cluster's real scheduler had other constraints, e.g. CPU) gets synthetic GPUs."""

    UNPLACED_NODE = "unplaced"

    def __init__(self, cluster: str, nodes: Sequence[TraceNode]):
        self.cluster = cluster
        self.nodes = [
            _NodeGpus(n.name, n.model, [gpu_uuid(cluster, n.name, i) for i in range(n.gpus)], [1000] * n.gpus)
            for n in nodes if n.gpus > 0
        ]
        self.by_model: dict[str, list[_NodeGpus]] = {}
        for node in self.nodes:
            self.by_model.setdefault(node.model, []).append(node)
        self.holding: dict[str, list[tuple[_NodeGpus | None, int, int]]] = {}
        self.unplaced: list[str] = []

    def _candidates(self, spec: tuple[str, ...]) -> Iterable[_NodeGpus]:
        if not spec:
            return self.nodes
        allowed = set(spec)
        return [n for n in self.nodes if n.model in allowed]

    def place(self, pod: TracePod) -> list[GpuAssignment]:
        for node in self._candidates(pod.gpu_spec):
            chosen = node.fit(pod.num_gpu, pod.gpu_milli)
            if chosen is not None:
                for i in chosen:
                    node.free[i] -= pod.gpu_milli
                self.holding[pod.name] = [(node, i, pod.gpu_milli) for i in chosen]
                return [GpuAssignment(node=node.name, gpu_uuid=node.uuids[i], share_milli=pod.gpu_milli, container_id=pod.name)
                        for i in chosen]
        # No room on an allowed model: synthetic GPUs of its own (no samples, so no usage rows).
        self.unplaced.append(pod.name)
        self.holding[pod.name] = []
        return [GpuAssignment(node=self.UNPLACED_NODE, gpu_uuid=f"unplaced/{pod.name}/{i}", share_milli=pod.gpu_milli,
                              container_id=pod.name) for i in range(pod.num_gpu)]

    def release(self, pod_name: str) -> None:
        for node, i, milli in self.holding.pop(pod_name, []):
            if node is not None:
                node.free[i] += milli


# =========================================================================== v2023: conversion
@dataclass
class V2023Replay:
    cluster: str
    base_ms: int
    trace_end_ms: int
    emissions: Emissions
    inventory_ticks: list[NodeTick]
    queues: list[str]
    unplaced_pods: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


# equal-timestamp order: inventory ticks, lifecycle, snapshots, watermarks (as the simulator does)
_C_TICK, _C_LIFECYCLE, _C_SNAPSHOT, _C_WATERMARK = range(4)
_KIND_ORDER = {k: i for i, k in enumerate((JobEventKind.submitted, JobEventKind.queued, JobEventKind.allocated,
                                           JobEventKind.started, JobEventKind.completed, JobEventKind.failed,
                                           JobEventKind.cancelled))}


def trace_end_s(pods: Sequence[TracePod]) -> int:
    """The end of the observation: the last time the pod list mentions."""
    return max(max(p.deletion_s, p.creation_s, p.scheduled_s or 0) for p in pods)


def still_running_at_end(pod: TracePod, end_s: int) -> bool:
    """Running pods whose deletion time is the trace's end were still running when it was cut."""
    return pod.phase == "Running" and pod.scheduled_s is not None and pod.deletion_s >= end_s


def node_tick_for(cluster: str, node: TraceNode, ts_ms: int, interval_ms: int) -> NodeTick:
    return NodeTick(cluster=cluster, node=node.name, ts_ms=ts_ms, interval_ms=interval_ms, gpus=[
        GpuSample(gpu_uuid=gpu_uuid(cluster, node.name, i), index=i, model=node.model) for i in range(node.gpus)
    ])


def convert_v2023(
    pods: Sequence[TracePod],
    nodes: Sequence[TraceNode],
    *,
    cluster: str = CLUSTER_V2023,
    base_ms: int = EPOCH_BASE_MS,
    inventory_interval_ms: int = 60_000,
    snapshot_every_ms: int = _HOUR_MS,
    watermark_every_ms: int = 24 * _HOUR_MS,
) -> V2023Replay:
    """The v2023 trace as the ledger's three data lines, in event-time order.

    - line 1: one NodeTick per node at trace time 0 (its GPUs and models; CPU-only nodes with
      an empty GPU list) — the inventory. The trace has no utilization samples.
    - line 2: per pod `submitted` + `queued` at creation (the submitted event's reason carries
      `gpu_spec=...` when the pod restricts GPU models); `allocated` (first-fit placement, each
      GPU with share_milli = gpu_milli) + `started` at scheduled; at deletion the final phase's
      terminal event (Succeeded: completed, Failed: failed, Running: cancelled = deleted while
      running), except Running pods still running when the trace ends (no terminal event) and
      never-scheduled pods (no GPU events). Queue = qos.
    - line 3: a snapshot of every queue (qos) each `snapshot_every_ms` and at the trace end.
    - LifecycleWatermarks every `watermark_every_ms` and a final one at the trace end.
    """
    if not pods:
        raise TraceError("no pods")
    end_s = trace_end_s(pods)
    end_ms = max(_ms(base_ms, end_s), base_ms + inventory_interval_ms)
    items: list[tuple] = []  # (ts_ms, class, a, b, payload)

    inventory = [node_tick_for(cluster, n, base_ms, inventory_interval_ms) for n in nodes]
    for i, tick in enumerate(inventory):
        items.append((base_ms, _C_TICK, i, 0, Emission(LINE_SAMPLES, tick.node, tick)))

    # Placement runs on trace time: releases before allocations at equal times ([scheduled, deletion)).
    placer = FirstFitPlacer(cluster, nodes)
    sweep: list[tuple[int, int, int]] = []  # (time, 0 release / 1 place, pod index)
    for i, pod in enumerate(pods):
        if pod.scheduled_s is not None and pod.is_gpu:
            sweep.append((pod.scheduled_s, 1, i))
            if not still_running_at_end(pod, end_s):
                sweep.append((pod.deletion_s, 0, i))
    sweep.sort()
    assignments: dict[int, list[GpuAssignment]] = {}
    for _, action, i in sweep:
        if action:
            assignments[i] = placer.place(pods[i])
        else:
            placer.release(pods[i].name)

    counts = {"pods": len(pods), "events": 0}
    for i, pod in enumerate(pods):
        priority = QOS_PRIORITY.get(pod.qos, 0)
        requested = pod.held_milli / 1000

        def event(kind: JobEventKind, ts_ms: int, gpus: list[GpuAssignment] | None = None, reason: str | None = None) -> None:
            ev = JobEvent(event_id=f"{pod.name}/0/{kind.value}", ts_ms=ts_ms, kind=kind, cluster=cluster, job_id=pod.name,
                          attempt=0, tenant=TENANT, queue=pod.qos, priority=priority, requested_gpus=requested,
                          gpus=gpus or [], reason=reason)
            # a release at a time when other pods take GPUs goes first; a pod's own events keep their order
            release_first = 0 if kind in PHASE_TERMINAL.values() and (pod.scheduled_s is None or pod.scheduled_s < pod.deletion_s) else 1
            items.append((ts_ms, _C_LIFECYCLE, release_first, (i, _KIND_ORDER[kind]), Emission(LINE_JOB_EVENTS, pod.name, ev)))
            counts["events"] += 1

        created = _ms(base_ms, pod.creation_s)
        event(JobEventKind.submitted, created, reason="gpu_spec=" + "|".join(pod.gpu_spec) if pod.gpu_spec and pod.is_gpu else None)
        event(JobEventKind.queued, created)
        if pod.scheduled_s is not None:
            scheduled = _ms(base_ms, pod.scheduled_s)
            event(JobEventKind.allocated, scheduled, gpus=assignments.get(i, []))
            event(JobEventKind.started, scheduled)
            if not still_running_at_end(pod, end_s):
                reason = "deleted while Running" if pod.phase == "Running" else f"pod_phase={pod.phase}"
                event(PHASE_TERMINAL[pod.phase], _ms(base_ms, pod.deletion_s), reason=reason)
        elif pod.phase in ("Succeeded", "Failed"):  # not in the published lists, but keep the outcome
            event(PHASE_TERMINAL[pod.phase], _ms(base_ms, pod.deletion_s), reason=f"pod_phase={pod.phase} (never scheduled)")

    queues = sorted({p.qos for p in pods}, key=lambda q: (-QOS_PRIORITY.get(q, 0), q))
    quota = sum(n.gpus for n in nodes)
    snapshot_times = list(range(base_ms, end_ms, snapshot_every_ms)) + [end_ms]
    for j, snap in enumerate(queue_snapshots(pods, queues, snapshot_times, base_ms=base_ms, end_s=end_s, cluster=cluster,
                                             quota_gpus=quota)):
        items.append((snap.ts_ms, _C_SNAPSHOT, 0, j, Emission(LINE_SNAPSHOTS, cluster, snap)))
    for j, ts in enumerate(_watermark_times(base_ms, end_ms, watermark_every_ms)):
        items.append((ts, _C_WATERMARK, 0, j, Emission(LINE_JOB_EVENTS, None, LifecycleWatermark(cluster=cluster, ts_ms=ts))))

    items.sort(key=lambda it: it[:4])
    counts.update(ticks=len(inventory), snapshots=len(snapshot_times), watermarks=len(items) - len(inventory)
                  - counts["events"] - len(snapshot_times), unplaced=len(placer.unplaced))
    return V2023Replay(cluster=cluster, base_ms=base_ms, trace_end_ms=end_ms,
                       emissions=Emissions(items, lambda it: it[4], base_ms, end_ms),
                       inventory_ticks=inventory, queues=queues, unplaced_pods=placer.unplaced, counts=counts)


def queue_snapshots(pods: Sequence[TracePod], queues: Sequence[str], times_ms: Sequence[int], *, base_ms: int, end_s: int,
                    cluster: str, quota_gpus: float) -> list[SchedulerSnapshot]:
    """Per queue at each time T: GPUs held by pods with scheduled <= T < deletion (pods still
    running at the trace end hold theirs to the end), and pods waiting (creation <= T < scheduled,
    or < deletion for pods never scheduled) with the GPUs they ask for."""
    changes: list[tuple[int, str, int, int, int]] = []  # (ts_ms, queue, d_alloc_milli, d_pending_jobs, d_pending_milli)
    for p in pods:
        created = _ms(base_ms, p.creation_s)
        left_queue = _ms(base_ms, p.scheduled_s if p.scheduled_s is not None else p.deletion_s)
        changes.append((created, p.qos, 0, 1, p.held_milli))
        changes.append((left_queue, p.qos, 0, -1, -p.held_milli))
        if p.scheduled_s is not None and p.is_gpu:
            changes.append((_ms(base_ms, p.scheduled_s), p.qos, p.held_milli, 0, 0))
            if not still_running_at_end(p, end_s):
                changes.append((_ms(base_ms, p.deletion_s), p.qos, -p.held_milli, 0, 0))
    changes.sort(key=lambda c: c[0])
    state = {q: [0, 0, 0] for q in queues}
    out, k = [], 0
    for t in times_ms:
        while k < len(changes) and changes[k][0] <= t:
            _, q, d_alloc, d_jobs, d_milli = changes[k]
            s = state[q]
            s[0] += d_alloc
            s[1] += d_jobs
            s[2] += d_milli
            k += 1
        states = []
        for q in queues:
            alloc, jobs, milli = state[q]
            prio = QOS_PRIORITY.get(q, 0)
            states.append(QueueState(
                queue=q, priority=prio, quota_gpus=quota_gpus, allocated_gpus=alloc / 1000, pending_jobs=jobs,
                pending_gpus=milli / 1000,
                pending_by_priority=[PendingByPriority(priority=prio, jobs=jobs, gpus=milli / 1000)] if jobs else [],
            ))
        out.append(SchedulerSnapshot(cluster=cluster, ts_ms=t, queues=states))
    return out


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
    duty_pct: float
    mem_bytes: int | None


def genai_ticks(duty: Sequence[Sample], memory: Sequence[Sample], *, base_ms: int = EPOCH_BASE_MS,
                gap_split_s: float = 600.0, max_pods: int | None = None) -> tuple[list[GenaiTick], int, list[str]]:
    """Per-pod ticks: each duty-cycle sample covers the time to the pod's next sample; the last
    sample of a stretch covers the median sampling interval. A gap longer than `gap_split_s`
    (no telemetry for > 10 intervals) ends the pod's holding (stretch = attempt); the next
    sample starts a new attempt. Memory is joined by pod and the nearest timestamp within one
    median interval. Trace time is mapped so that the first duty sample is at `base_ms`.
    `max_pods`: only the first N pods in order of first appearance in the duty file.
    Returns (ticks sorted by time, median interval in ms, pods)."""
    if not duty:
        raise TraceError("no duty-cycle samples")
    order: dict[str, None] = {}
    by_pod: dict[str, list[Sample]] = {}
    for s in duty:
        order.setdefault(s.pod)
        by_pod.setdefault(s.pod, []).append(s)
    pods = list(order)[:max_pods] if max_pods else list(order)
    origin = min(s.ts_s for s in duty)
    gaps = []
    for p in by_pod.values():
        p.sort(key=lambda s: s.ts_s)
        gaps.extend(b.ts_s - a.ts_s for a, b in zip(p, p[1:]) if b.ts_s > a.ts_s)
    median_s = statistics.median(gaps) if gaps else 60.0
    median_ms = max(1, round(median_s * 1000))

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
        return None if best is None or values[best] < 0 else int(values[best])

    ticks: list[GenaiTick] = []
    for pod in pods:
        samples = by_pod[pod]
        attempt = 0
        for k, s in enumerate(samples):
            if k and samples[k - 1].ts_s == s.ts_s:
                continue  # duplicate timestamp: keep the first
            nxt = samples[k + 1].ts_s if k + 1 < len(samples) else None
            if nxt is not None and nxt - s.ts_s > gap_split_s:
                interval = median_ms
            elif nxt is not None:
                interval = round((nxt - s.ts_s) * 1000)
            else:
                interval = median_ms
            interval = min(interval, _HOUR_MS)
            ticks.append(GenaiTick(pod, attempt, _ms(base_ms, s.ts_s - origin), interval,
                                   min(100.0, max(0.0, s.value)), memory_at(pod, s.ts_s)))
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
        raise TraceError("no ticks (max_pods=0?)")
    uuids = {pod: gpu_uuid(cluster, pod, 0) for pod in pods}
    items: list[tuple] = []  # (ts_ms, class, seq, kind, payload)
    stretches: dict[tuple[str, int], list[int]] = {}
    for t in ticks:
        span = stretches.setdefault((t.pod, t.attempt), [t.ts_ms, t.ts_ms + t.interval_ms])
        span[1] = t.ts_ms + t.interval_ms
    for (pod, attempt), (start, end) in sorted(stretches.items()):
        gpus = [GpuAssignment(node=pod, gpu_uuid=uuids[pod], share_milli=1000, container_id=pod)]
        for kind, ts, with_gpus in ((JobEventKind.allocated, start, True), (JobEventKind.started, start, False),
                                    (JobEventKind.completed, end, False)):
            items.append((ts, _C_LIFECYCLE, _KIND_ORDER[kind], (pod, attempt), ("event", pod, attempt, kind, with_gpus)))
    for i, t in enumerate(ticks):
        items.append((t.ts_ms, _C_SNAPSHOT, i, ("", 0), ("tick", t)))  # after the lifecycle at equal times
    end_ms = max(t.ts_ms + t.interval_ms for t in ticks)
    for ts in _watermark_times(base_ms, end_ms, watermark_every_ms):
        items.append((ts, _C_WATERMARK, 0, ("", 0), ("watermark", ts)))
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


# =========================================================================== summaries (SQL)
def _scalar_rows(client, sql: str, params: dict) -> list[dict]:
    return list(client.query(sql, parameters=params).named_results())


# A v2023 pod's phase as the warehouse tells it: the terminal event decides; no terminal and
# no allocation = never scheduled (Pending); allocated without a terminal = still running.
_V2023_PODS = """
    SELECT job_id, queue, requested_gpus, allocated_gpus, queued_ms, allocated_ms, ended_ms,
           multiIf(outcome = 'completed', 'Succeeded', outcome = 'failed', 'Failed',
                   allocated_ms IS NULL, 'Pending', 'Running') AS phase
    FROM job_attempts
    WHERE cluster = {cluster:String} AND attempt = 0
"""
# GPU-hours held by each scheduled GPU pod: [allocated, terminal) or to the end of the observation
# (the last scheduler snapshot) for pods still running then.
_V2023_HELD = """
    SELECT queue, phase, allocated_gpus,
           allocated_gpus * (coalesce(ended_ms, (SELECT max(ts_ms) FROM scheduler_snapshots WHERE cluster = {cluster:String}))
                             - allocated_ms) / 3600000 AS gpu_hours
    FROM (""" + _V2023_PODS + """)
    WHERE allocated_ms IS NOT NULL AND allocated_gpus > 0
"""


def v2023_summary(client, cluster: str = CLUSTER_V2023) -> dict[str, Any]:
    """The v2023 summary, every figure computed by ClickHouse from the ledger's tables."""
    p = {"cluster": cluster}
    pods = _scalar_rows(client, f"""
        SELECT count() AS pods, countIf(requested_gpus > 0) AS gpu_pods, countIf(allocated_ms IS NULL) AS never_scheduled
        FROM ({_V2023_PODS})""", p)[0]
    phases = {r["phase"]: r["n"] for r in _scalar_rows(client, f"SELECT phase, count() AS n FROM ({_V2023_PODS}) GROUP BY phase", p)}
    delay = _scalar_rows(client, f"""
        SELECT count() AS n, quantilesExactInclusive(0.5, 0.9, 0.99)(d) AS q, avg(d) AS mean
        FROM (SELECT (allocated_ms - queued_ms) / 1000 AS d FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL)""", p)[0]
    held = _scalar_rows(client, f"SELECT sum(gpu_hours) AS h FROM ({_V2023_HELD})", p)[0]
    by_qos = _scalar_rows(client, f"SELECT queue, sum(gpu_hours) AS h FROM ({_V2023_HELD}) GROUP BY queue ORDER BY queue", p)
    by_phase = _scalar_rows(client, f"SELECT phase, sum(gpu_hours) AS h FROM ({_V2023_HELD}) GROUP BY phase ORDER BY phase", p)
    # Peak: +share at allocation, -share at the terminal event; sum per instant, then a running sum.
    peak = _scalar_rows(client, f"""
        SELECT max(held) AS peak_milli FROM (
            SELECT sum(d) OVER (ORDER BY t ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS held
            FROM (
                SELECT t, sum(d) AS d FROM (
                    SELECT allocated_ms AS t, toInt64(round(allocated_gpus * 1000)) AS d
                    FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL
                    UNION ALL
                    SELECT assumeNotNull(ended_ms) AS t, -toInt64(round(allocated_gpus * 1000)) AS d
                    FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL AND ended_ms IS NOT NULL
                ) GROUP BY t
            )
        )""", p)[0]
    spec = _scalar_rows(client, """
        SELECT count() AS gpu_pods, countIf(startsWith(reason, 'gpu_spec=')) AS with_spec
        FROM (SELECT job_id, reason FROM job_events
              WHERE cluster = {cluster:String} AND kind = 'submitted' AND requested_gpus > 0
              ORDER BY job_id, ts_ms LIMIT 1 BY job_id)""", p)[0]
    inventory = _scalar_rows(client, """
        SELECT count() AS nodes, countIf(gpu_count > 0) AS gpu_nodes, sum(gpu_count) AS gpus
        FROM node_inventory FINAL WHERE cluster = {cluster:String}""", p)[0]
    gpus = _scalar_rows(client, """
        SELECT uniqExact(node) AS gpu_nodes, uniqExact(gpu_uuid) AS gpus FROM usage_raw WHERE cluster = {cluster:String}""", p)[0]
    by_model = _scalar_rows(client, """
        SELECT gpu_model, uniqExact(gpu_uuid) AS gpus FROM usage_raw WHERE cluster = {cluster:String}
        GROUP BY gpu_model ORDER BY gpu_model""", p)
    if (inventory["gpu_nodes"], inventory["gpus"]) != (gpus["gpu_nodes"], gpus["gpus"]):
        say(f"[replay-trace] warning: node_inventory has {inventory['gpu_nodes']} GPU nodes / {inventory['gpus']} GPUs "
            f"but usage_raw {gpus['gpu_nodes']} / {gpus['gpus']}")
    total = float(held["h"] or 0.0)
    hours_by_phase = {r["phase"]: round(float(r["h"]), 3) for r in by_phase}
    failed = sum(float(r["h"]) for r in by_phase if r["phase"] == "Failed")
    q = list(delay["q"]) if delay["n"] else [None, None, None]
    return {
        "pods": int(pods["pods"]),
        "gpu_pods": int(pods["gpu_pods"]),
        "nodes": int(inventory["nodes"]),
        "gpu_nodes": int(gpus["gpu_nodes"]),
        "gpus_total": int(gpus["gpus"]),
        "gpus_by_model": {r["gpu_model"]: int(r["gpus"]) for r in by_model},
        "phases": {phase: int(phases.get(phase, 0)) for phase in PHASES},
        "never_scheduled": int(pods["never_scheduled"]),
        "sched_delay_s": {
            "n": int(delay["n"]),
            "p50": _round(q[0], 3), "p90": _round(q[1], 3), "p99": _round(q[2], 3),
            "mean": _round(delay["mean"] if delay["n"] else None, 3),
        },
        "allocated_gpu_hours": round(total, 3),
        "allocated_gpu_hours_by_qos": {r["queue"]: round(float(r["h"]), 3) for r in by_qos},
        "allocated_gpu_hours_by_phase": {phase: hours_by_phase.get(phase, 0.0) for phase in PHASES},
        "failed_share_of_gpu_hours": round(failed / total, 4) if total else 0.0,
        "peak_allocated_gpus": int(peak["peak_milli"] or 0) / 1000,
        "gpu_spec_share_of_gpu_pods": round(spec["with_spec"] / spec["gpu_pods"], 4) if spec["gpu_pods"] else 0.0,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def genai_summary(client, cluster: str = CLUSTER_GENAI) -> dict[str, Any]:
    """The GenAI summary from usage_raw (every slice a pod's GPU was held, with its duty cycle)
    and job_attempts. Rows are de-duplicated by record_id (the sink delivers at least once)."""
    p = {"cluster": cluster}
    usage = "(SELECT * FROM usage_raw WHERE cluster = {cluster:String} ORDER BY record_id LIMIT 1 BY record_id)"
    held = "state IN ('executing', 'allocated_idle')"
    totals = _scalar_rows(client, f"""
        SELECT uniqExactIf(job_id, {held}) AS pods, uniqExact(gpu_uuid) AS gpus,
               (max(end_ms) - min(start_ms)) / 3600000 AS span_hours,
               sumIf(gpu_ms, {held}) AS held_ms,
               sumIf(gpu_ms, state = 'allocated_idle') AS ledger_idle_ms,
               sumIf(gpu_ms, {held} AND util_pct IS NOT NULL) AS measured_ms,
               sumIf(assumeNotNull(util_pct) * gpu_ms, {held} AND util_pct IS NOT NULL) AS util_weighted,
               sumIf(gpu_ms, {held} AND util_pct = 0) AS zero_ms,
               sumIf(gpu_ms, {held} AND mem_used_bytes IS NOT NULL) AS mem_ms,
               sumIf(toFloat64(assumeNotNull(mem_used_bytes)) * gpu_ms, {held} AND mem_used_bytes IS NOT NULL) AS mem_weighted
        FROM {usage}""", p)[0]
    per_pod = _scalar_rows(client, f"""
        SELECT count() AS pods, quantilesExactInclusive(0.1, 0.5, 0.9)(u) AS q, countIf(u < 20) AS under_20
        FROM (SELECT job_id, sum(assumeNotNull(util_pct) * gpu_ms) / sum(gpu_ms) AS u
              FROM {usage} WHERE {held} AND util_pct IS NOT NULL GROUP BY job_id HAVING sum(gpu_ms) > 0)""", p)[0]
    attempts = _scalar_rows(client, """
        SELECT count() AS attempts, countIf(outcome = 'completed') AS completed FROM job_attempts WHERE cluster = {cluster:String}""", p)[0]
    held_ms = int(totals["held_ms"] or 0)
    measured = int(totals["measured_ms"] or 0)
    q = list(per_pod["q"]) if per_pod["pods"] else [None, None, None]
    return {
        "pods": int(totals["pods"]),
        "gpus": int(totals["gpus"]),
        "attempts": int(attempts["attempts"]),
        "span_hours": _round(totals["span_hours"], 3),
        "allocated_gpu_hours": round(held_ms / _HOUR_MS, 3),
        "hardware_utilization_pct": _round(totals["util_weighted"] / measured, 3) if measured else None,
        "zero_duty_share_of_allocated": round(int(totals["zero_ms"]) / held_ms, 4) if held_ms else None,
        "idle_allocation_gpu_hours": round(int(totals["zero_ms"]) / _HOUR_MS, 3),
        "ledger_allocated_idle_gpu_hours": round(int(totals["ledger_idle_ms"]) / _HOUR_MS, 3),
        "per_pod_utilization_pct": {"p10": _round(q[0], 3), "p50": _round(q[1], 3), "p90": _round(q[2], 3)},
        "pods_under_20pct_utilization": int(per_pod["under_20"]),
        "mem_used_gib_mean": _round(totals["mem_weighted"] / totals["mem_ms"] / 2**30, 3) if totals["mem_ms"] else None,
    }


# =========================================================================== running a replay
def _progress(emissions: Emissions, label: str, log: Callable[[str], None]) -> Callable[[int, int], None]:
    started = time.monotonic()
    span = max(1, emissions.end_ms - emissions.start_ms)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - last[0] < 2.0:
            return
        last[0] = now
        position = (emissions.last_ts_ms - emissions.start_ms) / 86_400_000
        rate = done / max(1e-6, now - started)
        log(f"[replay-trace] {label}: published {done}/{total} messages ({100 * done / max(1, total):.0f}%), "
            f"event time day {position:.2f} of {span / 86_400_000:.2f}, {rate:.0f} msg/s")

    return progress


class _DrainReporter:
    """Progress while the worker and the sink drain what was published: `run_embedded` logs the
    broker's address and its phases; this log wrapper then reports the consumer groups' lag every
    few seconds from a thread (run_embedded itself reports nothing while it waits)."""

    def __init__(self, settings, log: Callable[[str], None], every_s: float = 5.0):
        self.settings = settings
        self.log = log
        self.every_s = every_s
        self.bootstrap: str | None = None
        self.stage: tuple[str, str, list[str]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, text: str) -> None:
        self.log(text)
        if text.startswith("[pipeline] broker (Tansu) on "):
            self.bootstrap = text[len("[pipeline] broker (Tansu) on "):].split(";")[0].strip()
        t = self.settings.topics
        if "waiting for the worker" in text:
            self._start(("worker", self.settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations]))
        elif "waiting for the sink" in text:
            self._start(("sink", f"{self.settings.worker_app_id}-sink", sink_topics(self.settings)))
        elif text.startswith("[pipeline] sink wrote"):
            self.stop()

    def _start(self, stage) -> None:
        self.stage = stage
        if self._thread is None and self.bootstrap:
            self._thread = threading.Thread(target=self._run, name="replay-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        from gpuledger.processes import group_lag

        settings = self.settings.model_copy(update={"kafka_bootstrap": self.bootstrap})
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            name, group, topics = self.stage
            try:
                lag = group_lag(settings, group, topics)
            except Exception:  # the broker is going away, or the group is rebalancing: ask later
                continue
            if not self._stop.is_set():
                self.log(f"[replay-trace] {name}: {lag} message(s) still to process ({time.monotonic() - started:.0f}s)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _summarize(settings, fn: Callable[[Any, str], dict], cluster: str) -> dict:
    from gpuledger.warehouse import connect

    client = connect(settings)
    try:
        return fn(client, cluster)
    finally:
        client.close()


def replay_v2023(settings, pods_path: str | Path, nodes_path: str | Path, *, log: Callable[[str], None] = say) -> dict:
    """Convert, push through the embedded pipeline (the sink stores the node inventory), summarize."""
    from gpuledger.pipeline import run_embedded

    t0 = time.monotonic()
    pods, nodes = read_pods(pods_path), read_nodes(nodes_path)
    replay = convert_v2023(pods, nodes)
    log(f"[replay-trace] alibaba-v2023: {len(pods)} pods, {len(nodes)} nodes -> {len(replay.emissions)} messages "
        f"{replay.counts} in {time.monotonic() - t0:.1f}s; {len(replay.unplaced_pods)} pod(s) found no room in first-fit "
        "placement (synthetic GPUs)")
    drain = _DrainReporter(settings, log)
    try:
        run = run_embedded(settings, replay.emissions, progress=_progress(replay.emissions, "alibaba-v2023", log), log=drain)
    finally:
        drain.stop()
    summary = _summarize(settings, v2023_summary, replay.cluster)
    log(f"[replay-trace] alibaba-v2023: pipeline {run.seconds:.0f}s, total {time.monotonic() - t0:.0f}s")
    return summary


#: The definition under which the ledger's idle line counts what the summary's
#: `idle_allocation_gpu_hours` counts: held time at zero duty cycle, no minimum quiet stretch.
GENAI_EXECUTION = {"source": "both", "util_floor_pct": 0.0, "min_idle_s": 0.0}
#: Where the replay under the default definition keeps its figure (inside the data directory).
GENAI_DEFAULT_RESULT = "genai-default-definition.json"


def replay_genai(settings, duty_path: str | Path, memory_path: str | Path, *, max_pods: int | None = None,
                 log: Callable[[str], None] = say) -> dict:
    """Replay the GenAI trace twice through the real pipeline: first under the ledger's default
    execution definition (into DATA_DIR/default-definition, keeping only its idle figure), then under
    GENAI_EXECUTION into DATA_DIR, whose warehouse the summary reads."""
    from gpuledger.pipeline import run_embedded
    from gpuledger.streams.pricing import load_ledger_config, write_ledger_variant

    t0 = time.monotonic()
    duty, memory = read_genai_samples(duty_path), read_genai_samples(memory_path)
    replay = convert_genai(duty, memory, max_pods=max_pods)
    log(f"[replay-trace] alibaba-genai: {len(duty)} duty / {len(memory)} memory samples -> {len(replay.emissions)} "
        f"messages {replay.counts} in {time.monotonic() - t0:.1f}s")
    default_settings = settings.model_copy(update={"data_dir": Path(settings.data_dir) / "default-definition"})
    zero_duty_config = write_ledger_variant(settings.ledger_config, Path(settings.data_dir) / "ledger-zero-duty.toml",
                                            suffix="zero-duty", execution=GENAI_EXECUTION)
    default = load_ledger_config(settings.ledger_config).definitions
    for label, run_settings in (("default definition", default_settings),
                                ("zero-duty definition", settings.model_copy(update={"ledger_config": zero_duty_config}))):
        log(f"[replay-trace] alibaba-genai: replay under the {label}")
        drain = _DrainReporter(run_settings, log)
        try:
            run = run_embedded(run_settings, replay.emissions, progress=_progress(replay.emissions, "alibaba-genai", log),
                               log=drain)
        finally:
            drain.stop()
        log(f"[replay-trace] alibaba-genai: pipeline {run.seconds:.0f}s")
        if run_settings is default_settings:
            idle = _summarize(default_settings, genai_summary, replay.cluster)["ledger_allocated_idle_gpu_hours"]
            (Path(settings.data_dir) / GENAI_DEFAULT_RESULT).write_text(json.dumps({
                "ledger_allocated_idle_gpu_hours": idle,
                "execution": {"source": default.execution_source, "util_floor_pct": default.execution_util_floor_pct,
                              "min_idle_s": default.execution_min_idle_s}}))
    summary = genai_summary_with_default(settings)
    log(f"[replay-trace] alibaba-genai: total {time.monotonic() - t0:.0f}s")
    return summary


def genai_summary_with_default(settings) -> dict:
    """The GenAI summary (under GENAI_EXECUTION) with the idle figure of the default definition beside it."""
    summary = _summarize(settings, genai_summary, CLUSTER_GENAI)
    summary["execution"] = GENAI_EXECUTION
    path = Path(settings.data_dir) / GENAI_DEFAULT_RESULT
    if path.exists():
        default = json.loads(path.read_text())
        summary["ledger_allocated_idle_gpu_hours_default_definition"] = default["ledger_allocated_idle_gpu_hours"]
        summary["default_execution"] = default["execution"]
    return summary


# =========================================================================== CLI
def _settings(args):
    from gpuledger.config import Settings

    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = Path(args.data_dir)
    return Settings(**overrides)


def cmd_replay_trace(args) -> int:
    settings = _settings(args)
    try:
        if args.trace == "alibaba-v2023":
            missing = [f for f in ("pods", "nodes") if not getattr(args, f)]
            if missing and not args.summary_only:
                raise TraceError("alibaba-v2023 needs --pods PODS.csv and --nodes NODES.csv")
            summary = (_summarize(settings, v2023_summary, CLUSTER_V2023) if args.summary_only
                       else replay_v2023(settings, args.pods, args.nodes))
        else:
            missing = [f for f in ("duty", "memory") if not getattr(args, f)]
            if missing and not args.summary_only:
                raise TraceError("alibaba-genai needs --duty DUTY.tar.gz|csv and --memory MEM.tar.gz|csv")
            summary = (genai_summary_with_default(settings) if args.summary_only
                       else replay_genai(settings, args.duty, args.memory, max_pods=args.max_pods))
    except TraceError as exc:
        print(f"replay-trace: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add `replay-trace` to the gpuledger CLI (called from gpuledger/cli.py's build_parser)."""
    help_text = "replay a public GPU trace (alibaba-v2023, alibaba-genai) through the embedded pipeline and print a JSON summary"
    p = subparsers.add_parser("replay-trace", help=help_text, description=help_text + ". Traces: docs/traces.md.")
    p.set_defaults(func=cmd_replay_trace)
    p.add_argument("trace", choices=TRACES)
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--pods", help="alibaba-v2023: pod list CSV (openb_pod_list_*.csv)")
    p.add_argument("--nodes", help="alibaba-v2023: node list CSV (openb_node_list_all_node.csv)")
    p.add_argument("--duty", help="alibaba-genai: pod_gpu_duty_cycle_anon.tar.gz (or the CSV inside)")
    p.add_argument("--memory", help="alibaba-genai: pod_gpu_memory_used_bytes_anon.tar.gz (or the CSV inside)")
    p.add_argument("--max-pods", type=int, help="alibaba-genai: replay only the first N pods (in order of first sample)")
    p.add_argument("--summary-only", action="store_true",
                   help="do not replay: print the summary of the replay already in the data directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuledger.traces replay-trace ...` (the same as `gpuledger replay-trace ...`)."""
    parser = argparse.ArgumentParser(prog="gpuledger")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
