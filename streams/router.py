"""The lifecycle router, pure: lifecycle events -> per-node allocation changes, with the checks of an
attempt's sequence (docs/reliability.md, "Late, duplicate and out-of-order data"), and the
watermark clock each node partition keeps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpuledger.schemas.models import (
    TERMINAL_KINDS,
    AllocationChange,
    GpuAssignment,
    JobEvent,
    JobEventKind,
    NodeWatermark,
)

log = logging.getLogger(__name__)

RUNNING_KINDS = frozenset({JobEventKind.started, JobEventKind.checkpoint_begin, JobEventKind.checkpoint_end})
GPU_KINDS = RUNNING_KINDS | TERMINAL_KINDS | {JobEventKind.allocated, JobEventKind.interrupted}
#: kinds that only make sense for an attempt that holds GPUs (failed/cancelled may end one that never did)
NEEDS_ALLOCATION = RUNNING_KINDS | {JobEventKind.interrupted, JobEventKind.preempted, JobEventKind.completed}




# --------------------------------------------------------------------------- router
@dataclass
class AttemptRoute:
    attempt: int
    gpus: list[GpuAssignment]
    #: event time of the attempt's allocation (0: routed from an older snapshot, unknown)
    since_ms: int = 0


@dataclass
class LifecycleRouter:
    """Keeps, per job and attempt, the GPUs the attempt holds until it ends, so that events which do
    not repeat the allocation (started, failed, ...) still reach every node involved. Every attempt
    not ended yet keeps its route: an attempt's end read after the next attempt's `allocated` (a
    retry allocated quickly, two scheduler partitions) still releases the attempt's own GPUs."""

    #: job -> attempt -> route; an attempt's route is dropped at its end (and a job's with its last)
    routes: dict[str, dict[int, AttemptRoute]] = field(default_factory=dict)
    seen_event_ids: dict[str, set[str]] = field(default_factory=dict)
    #: job -> latest event time seen (for forgetting finished jobs, see `prune`)
    last_seen_ms: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    #: job -> [attempt, event time] of the latest attempt that ended (terminal event seen, accepted
    #: or not): an `allocated` of that attempt at or after it is an end before its start
    ended: dict[str, list[int]] = field(default_factory=dict)

    def is_duplicate(self, event: JobEvent) -> bool:
        return event.event_id in self.seen_event_ids.get(event.job_id, ())

    def sequence_problem(self, event: JobEvent) -> str | None:
        """The reason an event is an impossible sequence (docs/reliability.md, "Bad input"), or None.
        Rejected: an event that needs the attempt's GPUs (started, checkpoint, interrupted, preempted,
        completed) for an attempt never allocated; an `allocated` at or after the attempt's end; a
        terminal event before the attempt's allocation. `failed`/`cancelled` of an attempt never
        allocated are legitimate (cancelled while queued, a rejected submit): no GPU effect. Call it
        before `route`, for an event that is not a duplicate; a rejected event still marks the end of
        its attempt (so its later `allocated` is rejected too)."""
        job, attempt, kind = event.job_id, event.attempt, event.kind
        attempts = self.routes.get(job, {})
        route = attempts.get(attempt)
        if kind == JobEventKind.allocated:
            end = self.ended.get(job)
            if end and end[0] == attempt and event.ts_ms >= end[1]:
                return (f"impossible sequence: allocated of {job} attempt {attempt} at ts_ms={event.ts_ms} is at or "
                        f"after the attempt's end at ts_ms={end[1]}")
            return None
        end = self.ended.get(job)
        if kind in TERMINAL_KINDS and end and end[0] == attempt and route is None:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt} at ts_ms={event.ts_ms}, which "
                    f"already ended at ts_ms={end[1]}")
        if kind not in NEEDS_ALLOCATION:
            return None
        if kind in TERMINAL_KINDS:
            self._mark_ended(job, attempt, event.ts_ms)
        if route is None:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt}, which was never allocated"
                    + (f" (the job's allocated attempts: {', '.join(map(str, sorted(attempts)))})"
                       if attempts else ""))
        if kind in TERMINAL_KINDS and event.ts_ms < route.since_ms:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt} at ts_ms={event.ts_ms} is before "
                    f"its allocation at ts_ms={route.since_ms}")
        return None

    def _mark_ended(self, job: str, attempt: int, ts_ms: int) -> None:
        end = self.ended.get(job)
        if end is None or end[0] != attempt or ts_ms < end[1]:
            self.ended[job] = [attempt, ts_ms]

    def route(self, event: JobEvent) -> list[AllocationChange]:
        seen = self.seen_event_ids.setdefault(event.job_id, set())
        if event.event_id in seen:
            self.duplicates += 1
            return []
        seen.add(event.event_id)
        if event.kind in TERMINAL_KINDS:
            self._mark_ended(event.job_id, event.attempt, event.ts_ms)
        self.last_seen_ms[event.job_id] = max(self.last_seen_ms.get(event.job_id, 0), event.ts_ms)
        if event.kind not in GPU_KINDS:
            return []
        job, attempt = event.job_id, event.attempt
        attempts = self.routes.setdefault(job, {})
        route = attempts.get(attempt)
        released: set[str] = set()
        if event.kind == JobEventKind.allocated or (event.gpus and route is None):
            new = AttemptRoute(attempt, list(event.gpus), event.ts_ms)
            if route is not None:
                # The attempt moved (e.g. Kubernetes: one pod of the job ended, the rest kept their
                # GPUs): a node left out of the new set must hear it, or it bills the attempt for ever.
                released = {g.node for g in route.gpus} - {g.node for g in new.gpus}
            route = attempts[attempt] = new
        if route is None:
            if not attempts:
                del self.routes[job]
            log.warning("lifecycle %s for %s attempt %s without a known allocation: no GPU effect",
                        event.kind, job, attempt)
            return []
        if event.kind in TERMINAL_KINDS:
            del attempts[attempt]  # ended: its route is not needed any more (keeps the state bounded)
            if not attempts:
                del self.routes[job]
        by_node: dict[str, list[GpuAssignment]] = {node: [] for node in released}  # no GPUs there: a release
        for gpu in route.gpus:
            by_node.setdefault(gpu.node, []).append(gpu)
        return [
            AllocationChange(ts_ms=event.ts_ms, event_id=event.event_id, kind=event.kind, node=node,
                             job_id=job, attempt=attempt, tenant=event.tenant,
                             queue=event.queue, gpus=gpus)
            for node, gpus in sorted(by_node.items())
        ]

    def forget(self, job_id: str) -> None:
        self.routes.pop(job_id, None)
        self.seen_event_ids.pop(job_id, None)
        self.last_seen_ms.pop(job_id, None)
        self.ended.pop(job_id, None)

    def prune(self, before_ms: int) -> int:
        """Forget jobs that hold no GPUs and had no event since `before_ms` (event time): keeps
        the duplicate filter bounded. Returns how many jobs were forgotten."""
        old = [job for job, ts in self.last_seen_ms.items() if ts < before_ms and job not in self.routes]
        for job in old:
            self.forget(job)
        return len(old)

    def to_state(self) -> dict:
        return {
            # job -> [route of each attempt not ended]
            "routes": {job: [{"attempt": r.attempt, "gpus": [g.model_dump(mode="json") for g in r.gpus],
                              "since_ms": r.since_ms} for _, r in sorted(attempts.items())]
                       for job, attempts in self.routes.items()},
            "ended": {job: list(v) for job, v in self.ended.items()},
            "seen": {job: sorted(ids) for job, ids in self.seen_event_ids.items()},
            "last_seen_ms": dict(self.last_seen_ms),
            "duplicates": self.duplicates,
        }

    @classmethod
    def from_state(cls, state: dict) -> "LifecycleRouter":
        routes: dict[str, dict[int, AttemptRoute]] = {}
        for job, rs in state["routes"].items():
            for r in ([rs] if isinstance(rs, dict) else rs):  # a dict: an older snapshot, one route per job
                routes.setdefault(job, {})[r["attempt"]] = AttemptRoute(
                    r["attempt"], [GpuAssignment.model_validate(g) for g in r["gpus"]], r.get("since_ms", 0))
        return cls(
            routes=routes,
            ended={job: list(v) for job, v in state.get("ended", {}).items()},
            seen_event_ids={job: set(ids) for job, ids in state["seen"].items()},
            last_seen_ms=dict(state.get("last_seen_ms", {})),
            duplicates=state.get("duplicates", 0),
        )


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

    def to_state(self) -> dict:
        return {"by_source": {str(p): ts for p, ts in self.by_source.items()}, "source_partitions": self.source_partitions}

    @classmethod
    def from_state(cls, state: dict) -> "WatermarkClock":
        return cls(by_source={int(p): ts for p, ts in state["by_source"].items()},
                   source_partitions=state["source_partitions"])
