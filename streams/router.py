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
from gpuledger.streams.checks import event_values_problem

log = logging.getLogger(__name__)

RUNNING_KINDS = frozenset({JobEventKind.started, JobEventKind.checkpoint_begin, JobEventKind.checkpoint_end})
GPU_KINDS = RUNNING_KINDS | TERMINAL_KINDS | {JobEventKind.allocated, JobEventKind.interrupted}
#: kinds that only make sense for an attempt that holds GPUs (failed/cancelled may end one that never did)
NEEDS_ALLOCATION = RUNNING_KINDS | {JobEventKind.interrupted, JobEventKind.preempted, JobEventKind.completed}
#: the cluster of router state restored from a snapshot keyed by job id alone (no real cluster is "")
LEGACY = ""




# --------------------------------------------------------------------------- router
@dataclass
class AttemptRoute:
    attempt: int
    gpus: list[GpuAssignment]
    #: event time of the attempt's allocation (0: routed from an older snapshot, unknown)
    since_ms: int = 0
    #: the latest time a change of the attempt was sent at: its later changes never take effect
    #: before it (`route`)
    last_ms: int = 0


@dataclass
class LifecycleRouter:
    """Keeps, per job and attempt, the GPUs the attempt holds until it ends, so that events which do
    not repeat the allocation (started, failed, ...) still reach every node involved. Every attempt
    not ended yet keeps its route: an attempt's end read after the next attempt's `allocated` (a
    retry allocated quickly, two scheduler partitions) still releases the attempt's own GPUs.

    A job is (cluster, job id): Slurm numbers jobs per cluster, so two clusters' job "1001" are two
    jobs (they share a job-events partition, the Kafka key being the bare job id). Every map below is
    keyed by that pair. A router restored from a snapshot written before (keyed by job id alone, no
    cluster recorded) keeps those entries under cluster "" (`LEGACY`) until the first event of the job
    id, whose cluster then takes them over (`_key`)."""

    #: (cluster, job) -> attempt -> route; an attempt's route is dropped at its end (and a job's with its last)
    routes: dict[tuple[str, str], dict[int, AttemptRoute]] = field(default_factory=dict)
    seen_event_ids: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    #: (cluster, job) -> latest event time seen (for forgetting finished jobs, see `prune`)
    last_seen_ms: dict[tuple[str, str], int] = field(default_factory=dict)
    duplicates: int = 0
    #: (cluster, job) -> {attempt: event time of its end} for each attempt that ended (terminal event seen,
    #: accepted or not): an `allocated` of that attempt at or after it is an end before its start. Per attempt:
    #: a later attempt's end must not hide an earlier one's (its stale `allocated` held a GPU for ever)
    ended: dict[tuple[str, str], dict[int, int]] = field(default_factory=dict)
    #: job ids whose state came from an old snapshot, kept under cluster LEGACY until claimed (`_key`)
    legacy: set[str] = field(default_factory=set)

    def _key(self, event: JobEvent) -> tuple[str, str]:
        """The event's job, (cluster, job id). The first event of a job id held under LEGACY (an old
        snapshot's entry, its cluster unknown) moves that state to the event's cluster: the job was in
        flight in the one cluster that speaks of it first (exact for a single-cluster deployment)."""
        key = (event.cluster, event.job_id)
        if self.legacy and event.job_id in self.legacy:
            self.legacy.discard(event.job_id)
            old = (LEGACY, event.job_id)
            for table in (self.routes, self.seen_event_ids, self.last_seen_ms, self.ended):
                if old in table and key not in table:
                    table[key] = table.pop(old)
        return key

    def is_duplicate(self, event: JobEvent) -> bool:
        return event.event_id in self.seen_event_ids.get(self._key(event), ())

    def sequence_problem(self, event: JobEvent) -> str | None:
        """The reason an event is an impossible sequence (docs/reliability.md, "Bad input"), or None.
        Rejected first: a number its `job_events` column cannot hold (an attempt past UInt32, ...;
        `event_values_problem`), which the sink would refuse after it was billed. Then: an event that
        needs the attempt's GPUs (started, checkpoint, interrupted, preempted, completed) for an
        attempt never allocated, or after its end; an `allocated` at or after the attempt's end, or
        read after it, or before its current allocation (stale); a terminal event before the
        attempt's allocation. `failed`/`cancelled` of an attempt never allocated are legitimate
        (cancelled while queued, a rejected submit): no GPU effect. Call it before `route`, for an
        event that is not a duplicate; a rejected event still marks the end of its attempt (so its
        later `allocated` is rejected too)."""
        key, job, attempt, kind = self._key(event), event.job_id, event.attempt, event.kind
        unstorable = event_values_problem(event)
        if unstorable:  # judged first: such an event marks no end either
            return unstorable
        attempts = self.routes.get(key, {})
        route = attempts.get(attempt)
        end_ms = self.ended.get(key, {}).get(attempt)
        if kind == JobEventKind.allocated:
            if end_ms is not None and event.ts_ms >= end_ms:
                return (f"impossible sequence: allocated of {job} attempt {attempt} at ts_ms={event.ts_ms} is at or "
                        f"after the attempt's end at ts_ms={end_ms}")
            if end_ms is not None and route is None:
                # dated before the end, but the end was judged already (rejected, or accepted with no
                # GPU effect): no end would ever release what this allocation holds
                return (f"impossible sequence: allocated of {job} attempt {attempt} at ts_ms={event.ts_ms}, read after "
                        f"the attempt's end at ts_ms={end_ms}: its GPUs would be held for ever")
            if route is not None and event.ts_ms < route.since_ms:
                # taken as current it would stand for the newer set: a node only the older one names
                # would hear no release, and bill the attempt for ever
                return (f"impossible sequence: allocated of {job} attempt {attempt} at ts_ms={event.ts_ms} is before "
                        f"the attempt's current allocation at ts_ms={route.since_ms} (a stale allocation, read after "
                        "the newer one)")
            return None
        if kind in TERMINAL_KINDS and end_ms is not None and route is None:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt} at ts_ms={event.ts_ms}, which "
                    f"already ended at ts_ms={end_ms}")
        if kind not in NEEDS_ALLOCATION:
            return None
        if kind in TERMINAL_KINDS:
            self._mark_ended(key, attempt, event.ts_ms)
        if route is None and end_ms is not None and event.ts_ms >= end_ms:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt} at ts_ms={event.ts_ms}, after the "
                    f"attempt's end at ts_ms={end_ms}")
        if route is None:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt}, which was never allocated"
                    + (f" (the job's allocated attempts: {', '.join(map(str, sorted(attempts)))})"
                       if attempts else ""))
        if kind in TERMINAL_KINDS and event.ts_ms < route.since_ms:
            return (f"impossible sequence: {kind.value} of {job} attempt {attempt} at ts_ms={event.ts_ms} is before "
                    f"its allocation at ts_ms={route.since_ms}")
        return None

    def _mark_ended(self, key: tuple[str, str], attempt: int, ts_ms: int) -> None:
        ends = self.ended.setdefault(key, {})
        if attempt not in ends or ts_ms < ends[attempt]:
            ends[attempt] = ts_ms
        # seen, so that `prune` forgets it: the end of a rejected event is kept for a job the router
        # may know nothing else of (its `allocated` lost), and stayed for ever
        self.last_seen_ms[key] = max(self.last_seen_ms.get(key, 0), ts_ms)

    def route(self, event: JobEvent) -> list[AllocationChange]:
        key = self._key(event)
        seen = self.seen_event_ids.setdefault(key, set())
        if event.event_id in seen:
            self.duplicates += 1
            return []
        seen.add(event.event_id)
        if event.kind in TERMINAL_KINDS:
            self._mark_ended(key, event.attempt, event.ts_ms)
        self.last_seen_ms[key] = max(self.last_seen_ms.get(key, 0), event.ts_ms)
        if event.kind not in GPU_KINDS:
            return []
        job, attempt = event.job_id, event.attempt
        attempts = self.routes.setdefault(key, {})
        route = attempts.get(attempt)
        released: set[str] = set()
        # The node join applies an attempt's changes in time order: one dated before a change already
        # sent (an end before a `started` or `checkpoint_*`, a `started` before its `allocated`, read
        # in that order) would come before it there, and the attempt held the GPU for ever after its
        # end, or ran as idle. It takes effect at the later time.
        at_ms = max(event.ts_ms, route.last_ms) if route is not None else event.ts_ms
        if at_ms != event.ts_ms:
            log.warning("lifecycle %s of %s attempt %s at ts_ms=%d is dated before a change of the attempt already "
                        "routed: applied at ts_ms=%d", event.kind, job, attempt, event.ts_ms, at_ms)
        if event.kind == JobEventKind.allocated or (event.gpus and route is None):
            new = AttemptRoute(attempt, list(event.gpus), event.ts_ms)
            if route is not None:
                # The attempt moved (e.g. Kubernetes: one pod of the job ended, the rest kept their
                # GPUs): a node left out of the new set must hear it, or it bills the attempt for ever.
                released = {g.node for g in route.gpus} - {g.node for g in new.gpus}
            route = attempts[attempt] = new
        if route is None:
            if not attempts:
                del self.routes[key]
            log.warning("lifecycle %s for %s attempt %s without a known allocation: no GPU effect",
                        event.kind, job, attempt)
            return []
        route.last_ms = at_ms
        if event.kind in TERMINAL_KINDS:
            del attempts[attempt]  # ended: its route is not needed any more (keeps the state bounded)
            if not attempts:
                del self.routes[key]
        by_node: dict[str, list[GpuAssignment]] = {node: [] for node in released}  # no GPUs there: a release
        for gpu in route.gpus:
            by_node.setdefault(gpu.node, []).append(gpu)
        return [
            AllocationChange(ts_ms=at_ms, event_id=event.event_id, kind=event.kind, node=node,
                             job_id=job, attempt=attempt, tenant=event.tenant,
                             queue=event.queue, gpus=gpus, cluster=event.cluster)
            for node, gpus in sorted(by_node.items())
        ]

    def forget(self, key: tuple[str, str]) -> None:
        """Drop one job's state; `key` is (cluster, job id)."""
        self.routes.pop(key, None)
        self.seen_event_ids.pop(key, None)
        self.last_seen_ms.pop(key, None)
        self.ended.pop(key, None)
        if key[0] == LEGACY:
            self.legacy.discard(key[1])

    def prune(self, before_ms: int, cluster_before_ms: dict[str, int] | None = None) -> int:
        """Forget jobs that hold no GPUs and had no event since `before_ms` (event time), or since
        `cluster_before_ms[cluster]` for a cluster named there (its own watermark's horizon): keeps
        the duplicate filter bounded. Returns how many jobs were forgotten."""
        cut = cluster_before_ms or {}
        old = [key for key, ts in self.last_seen_ms.items()
               if ts < cut.get(key[0], before_ms) and key not in self.routes]
        for key in old:
            self.forget(key)
        return len(old)

    def to_state(self) -> dict:
        # cluster -> the job maps of that cluster, each keyed by job id as before (JSON keys are strings)
        by_cluster: dict[str, dict] = {}

        def of(key: tuple[str, str], table: str) -> dict:
            return by_cluster.setdefault(key[0], {"routes": {}, "ended": {}, "seen": {}, "last_seen_ms": {}})[table]

        for key, attempts in self.routes.items():  # job -> [route of each attempt not ended]
            of(key, "routes")[key[1]] = [{"attempt": r.attempt, "gpus": [g.model_dump(mode="json") for g in r.gpus],
                                          "since_ms": r.since_ms, "last_ms": r.last_ms}
                                         for _, r in sorted(attempts.items())]
        for key, ends in self.ended.items():  # job -> [[attempt, end], ...]
            of(key, "ended")[key[1]] = [[a, t] for a, t in sorted(ends.items())]
        for key, ids in self.seen_event_ids.items():
            of(key, "seen")[key[1]] = sorted(ids)
        for key, ts in self.last_seen_ms.items():
            of(key, "last_seen_ms")[key[1]] = ts
        return {"by_cluster": by_cluster, "duplicates": self.duplicates}

    @classmethod
    def from_state(cls, state: dict) -> "LifecycleRouter":
        """A router from `to_state`, or from an older snapshot keyed by job id alone (top-level
        "routes"/"seen"/...; its entries record no cluster: kept under LEGACY, see `_key`)."""
        by_cluster = state["by_cluster"] if "by_cluster" in state else {LEGACY: state}
        router = cls(duplicates=state.get("duplicates", 0))
        for cluster, tables in by_cluster.items():
            for job, rs in tables["routes"].items():
                for r in ([rs] if isinstance(rs, dict) else rs):  # a dict: an older snapshot, one route per job
                    router.routes.setdefault((cluster, job), {})[r["attempt"]] = AttemptRoute(
                        r["attempt"], [GpuAssignment.model_validate(g) for g in r["gpus"]], r.get("since_ms", 0),
                        r.get("last_ms", r.get("since_ms", 0)))
            for job, v in tables.get("ended", {}).items():  # [attempt, end]: an older snapshot, the latest end only
                router.ended[(cluster, job)] = {v[0]: v[1]} if v and isinstance(v[0], int) else {a: t for a, t in v}
            router.seen_event_ids.update({(cluster, job): set(ids) for job, ids in tables["seen"].items()})
            router.last_seen_ms.update({(cluster, job): ts for job, ts in tables.get("last_seen_ms", {}).items()})
        router.legacy = {job for table in (router.routes, router.seen_event_ids, router.last_seen_ms, router.ended)
                         for cluster, job in table if cluster == LEGACY}
        return router


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
