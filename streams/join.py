"""The join, pure: lifecycle events -> per-node allocation changes (the router), and one
node's samples + allocation changes -> usage records (the node join).

Event time rules (docs/architecture.md):
- a tick at ts covers [ts, ts + interval); it is closed (turned into usage records) only when
  the lifecycle watermark has reached its end, so every allocation change that happened
  inside it is known — replays at any speed give the same records;
- allocation changes inside a tick split it at the change's timestamp;
- the energy of a tick is the NVML counter delta since the node's previous contiguous tick
  (the last interval's measurement), power x duration when there is none.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from gpuledger.schemas.models import (
    TERMINAL_KINDS,
    AllocationChange,
    GpuAssignment,
    JobEvent,
    JobEventKind,
    NodeTick,
    NodeWatermark,
    UsageRecord,
)
from gpuledger.streams.attribution import Holder, attribute
from gpuledger.streams.pricing import LedgerConfig

log = logging.getLogger(__name__)

RUNNING_KINDS = frozenset({JobEventKind.started, JobEventKind.checkpoint_begin, JobEventKind.checkpoint_end})
GPU_KINDS = RUNNING_KINDS | TERMINAL_KINDS | {JobEventKind.allocated, JobEventKind.interrupted}


# --------------------------------------------------------------------------- router
@dataclass
class AttemptRoute:
    attempt: int
    gpus: list[GpuAssignment]


@dataclass
class LifecycleRouter:
    """Keeps, per job, the GPUs its current attempt holds, so that events which do not repeat
    the allocation (started, failed, ...) still reach every node involved."""

    routes: dict[str, AttemptRoute] = field(default_factory=dict)
    seen_event_ids: dict[str, set[str]] = field(default_factory=dict)
    duplicates: int = 0

    def route(self, event: JobEvent) -> list[AllocationChange]:
        seen = self.seen_event_ids.setdefault(event.job_id, set())
        if event.event_id in seen:
            self.duplicates += 1
            return []
        seen.add(event.event_id)
        if event.kind not in GPU_KINDS:
            return []
        route = self.routes.get(event.job_id)
        if event.kind == JobEventKind.allocated or (event.gpus and (route is None or route.attempt != event.attempt)):
            route = AttemptRoute(event.attempt, list(event.gpus))
            self.routes[event.job_id] = route
        if route is None or route.attempt != event.attempt:
            log.warning("lifecycle %s for %s attempt %s without a known allocation: no GPU effect",
                        event.kind, event.job_id, event.attempt)
            return []
        if event.kind in TERMINAL_KINDS:
            del self.routes[event.job_id]
        by_node: dict[str, list[GpuAssignment]] = {}
        for gpu in route.gpus:
            by_node.setdefault(gpu.node, []).append(gpu)
        return [
            AllocationChange(ts_ms=event.ts_ms, event_id=event.event_id, kind=event.kind, node=node,
                             job_id=event.job_id, attempt=event.attempt, tenant=event.tenant,
                             queue=event.queue, gpus=gpus)
            for node, gpus in sorted(by_node.items())
        ]

    def forget(self, job_id: str) -> None:
        self.routes.pop(job_id, None)
        self.seen_event_ids.pop(job_id, None)


# --------------------------------------------------------------------------- watermarks
@dataclass
class WatermarkClock:
    """Lifecycle watermark seen by one node-allocations partition: the minimum over every
    job-events partition (each must have reported before anything closes)."""

    by_source: dict[int, int] = field(default_factory=dict)
    source_partitions: int = 0

    def observe(self, mark: NodeWatermark) -> int:
        self.source_partitions = max(self.source_partitions, mark.source_partitions)
        self.by_source[mark.source_partition] = max(self.by_source.get(mark.source_partition, 0), mark.ts_ms)
        return self.value

    @property
    def value(self) -> int:
        if not self.source_partitions or len(self.by_source) < self.source_partitions:
            return 0
        return min(self.by_source[p] for p in range(self.source_partitions))


# --------------------------------------------------------------------------- node join
@dataclass
class NodeJoin:
    """One node: who holds each of its GPUs, ticks waiting for the watermark, and the
    allocation changes not yet applied. Closing emits usage records in event-time order."""

    node: str
    cluster: str = ""
    holders: dict[str, dict[tuple[str, int], Holder]] = field(default_factory=dict)
    pending_ticks: list[NodeTick] = field(default_factory=list)
    pending_changes: list[AllocationChange] = field(default_factory=list)
    last_energy: dict[str, tuple[int, float]] = field(default_factory=dict)  # gpu -> (tick ts, energy_j)
    closed_until_ms: int = 0
    late_changes: int = 0

    # -- input
    def add_tick(self, tick: NodeTick) -> str | None:
        """Buffer a tick; returns the reason when it cannot be used (duplicate or too late)."""
        if tick.ts_ms < self.closed_until_ms:
            return f"late tick: {tick.node} ts_ms={tick.ts_ms} is before the closed horizon {self.closed_until_ms}"
        self.cluster = tick.cluster
        keys = [t.ts_ms for t in self.pending_ticks]
        i = bisect.bisect_left(keys, tick.ts_ms)
        if i < len(keys) and keys[i] == tick.ts_ms:
            return f"duplicate tick: {tick.node} ts_ms={tick.ts_ms}"
        self.pending_ticks.insert(i, tick)
        return None

    def add_change(self, change: AllocationChange) -> None:
        if change.ts_ms < self.closed_until_ms:
            # Too late to split a closed tick: it takes effect from the next tick on.
            self.late_changes += 1
            log.warning("late allocation change %s for %s (%d ms behind)", change.event_id, self.node,
                        self.closed_until_ms - change.ts_ms)
        keys = [c.ts_ms for c in self.pending_changes]
        self.pending_changes.insert(bisect.bisect_right(keys, change.ts_ms), change)

    # -- state
    def _apply(self, change: AllocationChange) -> None:
        key = (change.job_id, change.attempt)
        if change.kind in TERMINAL_KINDS:
            for held in self.holders.values():
                held.pop(key, None)
            return
        if change.kind == JobEventKind.allocated:
            for held in self.holders.values():
                held.pop(key, None)
        running = change.kind in RUNNING_KINDS
        for gpu in change.gpus:
            held = self.holders.setdefault(gpu.gpu_uuid, {})
            previous = held.get(key)
            held[key] = Holder(
                job_id=change.job_id, attempt=change.attempt, tenant=change.tenant, queue=change.queue,
                share_milli=gpu.share_milli, running=running if change.kind != JobEventKind.allocated else False,
                container_id=gpu.container_id or (previous.container_id if previous else None),
            )

    def _tick_energy(self, tick: NodeTick, gpu) -> float:
        previous = self.last_energy.get(gpu.gpu_uuid)
        if gpu.energy_j is not None:
            self.last_energy[gpu.gpu_uuid] = (tick.ts_ms, gpu.energy_j)
            if previous and previous[0] + tick.interval_ms == tick.ts_ms and gpu.energy_j >= previous[1]:
                return gpu.energy_j - previous[1]
        return (gpu.power_w or 0.0) * tick.interval_ms / 1000.0

    # -- output
    def close_until(self, watermark_ms: int, ledger: LedgerConfig) -> list[UsageRecord]:
        """Turn every tick that ends at or before the watermark into usage records."""
        records: list[UsageRecord] = []
        while self.pending_ticks and self.pending_ticks[0].ts_ms + self.pending_ticks[0].interval_ms <= watermark_ms:
            tick = self.pending_ticks.pop(0)
            start, end = tick.ts_ms, tick.ts_ms + tick.interval_ms
            while self.pending_changes and self.pending_changes[0].ts_ms <= start:
                self._apply(self.pending_changes.pop(0))
            cuts = [start]
            inside: list[AllocationChange] = []
            while self.pending_changes and self.pending_changes[0].ts_ms < end:
                change = self.pending_changes.pop(0)
                inside.append(change)
                if change.ts_ms != cuts[-1]:
                    cuts.append(change.ts_ms)
            cuts.append(end)
            energies = {gpu.gpu_uuid: self._tick_energy(tick, gpu) for gpu in tick.gpus}
            for seg_start, seg_end in zip(cuts, cuts[1:]):
                while inside and inside[0].ts_ms <= seg_start:
                    self._apply(inside.pop(0))
                share = (seg_end - seg_start) / tick.interval_ms
                for gpu in tick.gpus:
                    records.extend(attribute(
                        cluster=tick.cluster, node=tick.node, gpu=gpu,
                        holders=list(self.holders.get(gpu.gpu_uuid, {}).values()),
                        start_ms=seg_start, end_ms=seg_end,
                        energy_j=energies[gpu.gpu_uuid] * share, ledger=ledger,
                    ))
            self.closed_until_ms = end
        return records
