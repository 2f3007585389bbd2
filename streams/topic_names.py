"""The ledger's topic names as plain data, for the pure core.

`WorkerCore` (streams/core.py) needs only the names, not the settings they come from: the edge
(gpuledger/config.py `Settings.topics`, read by the Faust shell streams/app.py) builds them from
GPULEDGER_TOPIC_PREFIX; unit tests build them from any prefix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopicNames:
    """Topic names, all under one prefix (`with_prefix`)."""

    gpu_samples: str
    job_events: str
    scheduler_snapshots: str
    node_allocations: str  # internal: lifecycle re-keyed by node
    usage: str
    dead_letters: str
    late_events: str  # late input that was still applied, with the reason
    worker_state: str  # internal: worker state snapshots (compacted)
    bills: str  # closed bill rows and adjustments (gpuledger bills close), key: tenant
    #: internal: every lifecycle event the worker's router accepted (what the sink stores as job events)
    lifecycle_accepted: str
    #: behaviour alerts, key: job id; reclaim suggestions, key: queue (gpuledger watch; docs/alerts.md)
    alerts: str
    reclaim_suggestions: str
    #: internal: the watcher's state snapshots (compacted)
    watch_state: str
    #: line 4 (optional): training progress a job reports, key: job id (gpuledger/progress.py)
    job_progress: str
    #: pilot-run estimates awaiting approval and the decisions on them, key: job id (docs/planning.md)
    approvals: str

    @classmethod
    def with_prefix(cls, prefix: str) -> TopicNames:
        return cls(
            gpu_samples=f"{prefix}gpu-samples",
            job_events=f"{prefix}job-events",
            scheduler_snapshots=f"{prefix}scheduler-snapshots",
            node_allocations=f"{prefix}node-allocations",
            usage=f"{prefix}usage",
            dead_letters=f"{prefix}dead-letters",
            late_events=f"{prefix}late-events",
            worker_state=f"{prefix}worker-state",
            bills=f"{prefix}bills",
            lifecycle_accepted=f"{prefix}lifecycle-accepted",
            alerts=f"{prefix}alerts",
            reclaim_suggestions=f"{prefix}reclaim-suggestions",
            watch_state=f"{prefix}watch-state",
            job_progress=f"{prefix}job-progress",
            approvals=f"{prefix}approvals",
        )
