"""alibaba-v2023 (cluster-trace-gpu-v2023, "openb"): reading the pod and node lists, a first-fit placer onto the trace's GPUs, and the pure conversion into the ledger's data lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES, LINE_SNAPSHOTS, Emission
from gpuledger.agents.simspec import gpu_uuid
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
from gpuledger.traces.readers import (CLUSTER_V2023, EPOCH_BASE_MS, HOUR_MS, KIND_ORDER, ORDER_LIFECYCLE, ORDER_SNAPSHOT,
                                    ORDER_TICK, ORDER_WATERMARK, TENANT, Emissions, TraceError, at_ms, csv_rows,
                                    parse_int, watermark_times)



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
    for lineno, row in csv_rows(Path(path), NODE_COLUMNS):
        where = f"{path}:{lineno}"
        name = (row["sn"] or "").strip()
        if not name:
            raise TraceError(f"{where}: sn (node name) is empty")
        if name in seen:
            raise TraceError(f"{where}: node {name!r} listed twice")
        seen.add(name)
        gpus = parse_int(row["gpu"], "gpu", where)
        model = (row["model"] or "").strip()
        if model.lower() == "nan":
            model = ""
        if gpus and not model:
            raise TraceError(f"{where}: node {name} has {gpus} GPU(s) but no model")
        nodes.append(TraceNode(name, parse_int(row["cpu_milli"], "cpu_milli", where), parse_int(row["memory_mib"], "memory_mib", where),
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
    """A v2023 pod list (openb_pod_list_*.csv with the time and phase columns: default, gpuspec*,
    gpushare*, cpu*; the multigpu* lists lack them and are refused with the missing columns named)."""
    pods, seen = [], set()
    for lineno, row in csv_rows(Path(path), POD_COLUMNS):
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
        num_gpu = parse_int(row["num_gpu"], "num_gpu", where)
        gpu_milli = parse_int(row["gpu_milli"], "gpu_milli", where)
        if gpu_milli > 1000:
            raise TraceError(f"{where}: gpu_milli is the share of one GPU (0..1000), got {gpu_milli}")
        creation = parse_int(row["creation_time"], "creation_time", where)
        deletion = parse_int(row["deletion_time"], "deletion_time", where)
        scheduled = parse_int(row["scheduled_time"], "scheduled_time", where, optional=True)
        if phase == "Pending" and scheduled is not None:  # the published lists have none; no event would end it
            raise TraceError(f"{where}: pod {name!r} is Pending but has a scheduled_time ({scheduled}): a Pending pod "
                             "must never have been scheduled (leave scheduled_time empty)")
        if phase == "Running" and scheduled is None:  # nothing would allocate it: the ledger would call it Pending
            raise TraceError(f"{where}: pod {name!r} is Running but has no scheduled_time: a Running pod must have been "
                             "scheduled (give its scheduled_time, or its phase Pending)")
        if scheduled is not None and not creation <= scheduled <= deletion:
            raise TraceError(f"{where}: expected creation <= scheduled <= deletion, got {creation}, {scheduled}, {deletion}")
        if deletion < creation:
            raise TraceError(f"{where}: deletion_time {deletion} is before creation_time {creation}")
        pods.append(TracePod(
            name=name, num_gpu=num_gpu, gpu_milli=gpu_milli, gpu_spec=parse_gpu_spec(row["gpu_spec"]), qos=qos,
            phase=phase, creation_s=creation, deletion_s=deletion, scheduled_s=scheduled,
            cpu_milli=parse_int(row["cpu_milli"], "cpu_milli", where), memory_mib=parse_int(row["memory_mib"], "memory_mib", where),
        ))
    if not pods:
        raise TraceError(f"{path}: no pods")
    return pods



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
    snapshot_every_ms: int = HOUR_MS,
    watermark_every_ms: int = 24 * HOUR_MS,
) -> V2023Replay:
    """The v2023 trace as the ledger's three data lines, in event-time order.

    - line 1: one NodeTick per node at trace time 0 (its GPUs and models; CPU-only nodes with
      an empty GPU list) — the inventory. The trace has no utilization samples.
    - line 2: per pod `submitted` + `queued` at creation (the submitted event's reason carries
      `gpu_spec=...` when the pod restricts GPU models); `allocated` (first-fit placement, each
      GPU with share_milli = gpu_milli) + `started` at scheduled; at deletion the final phase's
      terminal event (Succeeded: completed, Failed: failed, Running: cancelled = deleted while
      running), except Running pods still running when the trace ends (no terminal event); a
      never-scheduled pod gets no GPU events, only `cancelled` ("deleted while Pending") at its
      deletion before the trace end, which ends its wait. Queue = qos.
    - line 3: a snapshot of every queue (qos) each `snapshot_every_ms` and at the trace end.
    - LifecycleWatermarks every `watermark_every_ms` and a final one at the trace end.
    """
    if not pods:
        raise TraceError("no pods")
    end_s = trace_end_s(pods)
    end_ms = max(at_ms(base_ms, end_s), base_ms + inventory_interval_ms)
    items: list[tuple] = []  # (ts_ms, class, a, b, payload)

    inventory = [node_tick_for(cluster, n, base_ms, inventory_interval_ms) for n in nodes]
    for i, tick in enumerate(inventory):
        items.append((base_ms, ORDER_TICK, i, 0, Emission(LINE_SAMPLES, tick.node, tick)))

    # Placement runs on trace time: releases before allocations at equal times ([scheduled, deletion)).
    # A pod scheduled and deleted in the same second is released right after its own placement:
    # sorted with the other releases it would find nothing to free and keep its GPUs for ever.
    placer = FirstFitPlacer(cluster, nodes)
    sweep: list[tuple[int, int, int, int]] = []  # (time, 0 release / 1 place, pod index, 0 place / 1 own release)
    for i, pod in enumerate(pods):
        if pod.scheduled_s is not None and pod.is_gpu:
            sweep.append((pod.scheduled_s, 1, i, 0))
            if still_running_at_end(pod, end_s):
                continue
            if pod.deletion_s == pod.scheduled_s:
                sweep.append((pod.deletion_s, 1, i, 1))
            else:
                sweep.append((pod.deletion_s, 0, i, 0))
    sweep.sort()
    assignments: dict[int, list[GpuAssignment]] = {}
    for _, action, i, own_release in sweep:
        if action and not own_release:
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
            last_start_s = pod.scheduled_s if pod.scheduled_s is not None else pod.creation_s
            release_first = 0 if kind in PHASE_TERMINAL.values() and last_start_s < pod.deletion_s else 1
            items.append((ts_ms, ORDER_LIFECYCLE, release_first, (i, KIND_ORDER[kind]), Emission(LINE_JOB_EVENTS, pod.name, ev)))
            counts["events"] += 1

        created = at_ms(base_ms, pod.creation_s)
        event(JobEventKind.submitted, created, reason="gpu_spec=" + "|".join(pod.gpu_spec) if pod.gpu_spec and pod.is_gpu else None)
        event(JobEventKind.queued, created)
        if pod.scheduled_s is not None:
            scheduled = at_ms(base_ms, pod.scheduled_s)
            event(JobEventKind.allocated, scheduled, gpus=assignments.get(i, []))
            event(JobEventKind.started, scheduled)
            if not still_running_at_end(pod, end_s):
                reason = "deleted while Running" if pod.phase == "Running" else f"pod_phase={pod.phase}"
                event(PHASE_TERMINAL[pod.phase], at_ms(base_ms, pod.deletion_s), reason=reason)
        elif pod.phase in ("Succeeded", "Failed"):  # not in the published lists, but keep the outcome
            event(PHASE_TERMINAL[pod.phase], at_ms(base_ms, pod.deletion_s), reason=f"pod_phase={pod.phase} (never scheduled)")
        elif pod.deletion_s < end_s:  # Pending, deleted: that ends its wait (else its waiting demand is lost);
            # one still pending when the trace was cut keeps waiting, as a Running pod then keeps running
            event(JobEventKind.cancelled, at_ms(base_ms, pod.deletion_s), reason="deleted while Pending")

    queues = sorted({p.qos for p in pods}, key=lambda q: (-QOS_PRIORITY.get(q, 0), q))
    quota = sum(n.gpus for n in nodes)
    snapshot_times = list(range(base_ms, end_ms, snapshot_every_ms)) + [end_ms]
    for j, snap in enumerate(queue_snapshots(pods, queues, snapshot_times, base_ms=base_ms, end_s=end_s, cluster=cluster,
                                             quota_gpus=quota)):
        items.append((snap.ts_ms, ORDER_SNAPSHOT, 0, j, Emission(LINE_SNAPSHOTS, cluster, snap)))
    for j, ts in enumerate(watermark_times(base_ms, end_ms, watermark_every_ms)):
        items.append((ts, ORDER_WATERMARK, 0, j, Emission(LINE_JOB_EVENTS, None, LifecycleWatermark(cluster=cluster, ts_ms=ts))))

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
        created = at_ms(base_ms, p.creation_s)
        left_queue = at_ms(base_ms, p.scheduled_s if p.scheduled_s is not None else p.deletion_s)
        changes.append((created, p.qos, 0, 1, p.held_milli))
        changes.append((left_queue, p.qos, 0, -1, -p.held_milli))
        if p.scheduled_s is not None and p.is_gpu:
            changes.append((at_ms(base_ms, p.scheduled_s), p.qos, p.held_milli, 0, 0))
            if not still_running_at_end(p, end_s):
                changes.append((at_ms(base_ms, p.deletion_s), p.qos, -p.held_milli, 0, 0))
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
