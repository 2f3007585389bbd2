"""Kubernetes -> the ledger's lifecycle line and scheduler snapshots, pure (no I/O, no clock).

Why one file: one pure state machine (KubernetesLedger) and the mapping rules it applies; every rule
reads and writes the same per-job state, and docs/kubernetes.md follows this file's order.

`KubernetesLedger` is fed API objects as plain dicts (exactly what the API server sends: pods,
Kueue Workloads, ClusterQueues, LocalQueues) and returns `JobEvent`s, `SchedulerSnapshot`s and
`LifecycleWatermark`s. The agent (agents/kubernetes_agent.py) owns the watches, the kubelet
PodResources lookups, the clock and the publisher; docs/kubernetes.md has the mapping tables.

The model, in short:
- a *job* is the pod's controlling owner (Job, JobSet, Kueue pod group, ...) or the pod itself (also
  when Kueue admits the pod alone); a Kueue Workload belongs to the same job as its pods;
- an *attempt* is the set of the job's pods that live together. The ledger keeps one GPU set per
  (job, attempt), so every change of that set (a pod gets its devices, a pod ends while others run)
  is sent as a new `allocated` with the whole set (then `started` again if the attempt runs);
- a pod of a job whose previous attempt ended starts the next attempt (`retried` first when the
  previous one failed or was preempted);
- event times are Kubernetes' own (creationTimestamp, conditions' lastTransitionTime, containers'
  startedAt / finishedAt), never earlier than the job's previous event or the watermark already
  promised, so a watermark is never broken and a job's events stay in order;
- event ids are `k8s/<cluster>/<job>/<attempt>/<n>/<kind>.<digest>`, n counting the job's events and
  the digest chaining each event's content to the job's events before it: an agent that re-derives
  the same events from the same saved state gives the same ids (the worker drops the copies), and one
  that re-derives fewer or other events gives new ids, so no later event reuses an id.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Callable, Iterable, Iterator

import orjson

from gpuledger.schemas.models import (
    GpuAssignment,
    JobEvent,
    JobEventKind,
    LifecycleWatermark,
    PendingByPriority,
    PreemptionFired,
    QueueState,
    SchedulerSnapshot,
)

log = logging.getLogger(__name__)

K = JobEventKind
STATE_VERSION = 1
#: The device plugin marks time-slicing replicas of one GPU as '<uuid>::<replica>'.
REPLICA_SEPARATOR = "::"
#: Compute slices of a MIG-capable GPU (A100, H100): a 'mig-3g.40gb' resource is 3/7 of one GPU.
MIG_SLICES = 7
#: An ended job with no pod left is forgotten this long (event time) after its last event.
JOB_RETENTION_MS = 7 * 24 * 3_600_000
#: Worst outcome of an attempt's pods wins: one failed pod fails the attempt.
OUTCOME_RANK = {K.completed: 0, K.cancelled: 1, K.preempted: 2, K.failed: 3}
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
#: Kueue's pod integration (pkg/controller/jobs/pod/constants): the group's name is a pod label, or
#: (feature gate WorkloadIdentifierAnnotations) an annotation with the same key.
POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
#: Set by Kueue's pod webhook on a pod it admits itself (no Kueue-managed owner): its own Workload.
KUEUE_MANAGED_LABEL = "kueue.x-k8s.io/managed"
#: Set on the pods of a Deployment (or StatefulSet, LeaderWorkerSet) that Kueue admits pod by pod.
SUSPENDING_PARENT_ANNOTATION = "kueue.x-k8s.io/pod-suspending-parent"
#: Marks the Workload of a pod group; Kueue names it after the group.
GROUP_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/is-group-workload"

#: devices_for(node, namespace, pod_name, host_ip) -> {container name: [device id, ...]} for the
#: pod's GPU resources, or None when the node has not (yet) reported the pod (no device ids at all
#: counts the same: the kubelet lists a pod before its devices are allocated).
DeviceLookup = Callable[[str, str, str, "str | None"], "dict[str, list[str]] | None"]


class MalformedObject(ValueError):
    """An API object the agent cannot use; the message says why. The agent logs it and skips it."""


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class KubernetesMapping:
    """How Kubernetes objects become ledger jobs, tenants and queues (docs/kubernetes.md)."""

    cluster: str
    tenant_label: str = "gpuledger.io/tenant"        # tenant = this label of the pod, else its namespace
    queue_label: str = "kueue.x-k8s.io/queue-name"    # LocalQueue name; resolved to its ClusterQueue
    default_queue: str = "default"                    # queue of pods without the label
    gpu_resource: str = "nvidia.com/gpu"              # also '<it>.shared' and '<vendor>/mig-*'
    time_slicing_replicas: int = 1                    # the device plugin's timeSlicing replicas
    allowed_lateness_ms: int = 30_000                 # watermark = observed time - this
    device_wait_ms: int = 120_000                     # how long a scheduled pod waits for its device ids
    devices_expected: bool = True                     # False: no PodResources; allocations carry no GPUs
    #: how a GPU holder's container is named, to match the GPU samples' processes: "runtime" = the
    #: runtime's container id (what the NVML agent reads from cgroups), "name" =
    #: k8s://<namespace>/<pod>/<container> (what the dcgm agent reads from dcgm-exporter's labels)
    container_ids: str = "runtime"

    def container_ref(self, namespace: str, pod: str, container: str | None, runtime_id: str | None) -> str | None:
        if self.container_ids == "name":
            return f"k8s://{namespace}/{pod}/{container or ''}"
        return strip_runtime(runtime_id)

    def is_gpu_resource(self, name: str) -> bool:
        vendor = self.gpu_resource.split("/", 1)[0]
        return (name == self.gpu_resource or name.startswith(self.gpu_resource + ".")
                or name.startswith(f"{vendor}/mig-"))

    def gpus_per_unit(self, name: str) -> float:
        """GPUs one unit of an extended resource stands for (requested_gpus). With time-slicing each
        unit is one replica, 1/replicas of the device (a GPU or a MIG instance), as parse_device_id
        shares a '<id>::<n>' device."""
        vendor = self.gpu_resource.split("/", 1)[0]
        per_replica = 1.0 / max(1, self.time_slicing_replicas)
        if name.startswith(f"{vendor}/mig-"):
            profile = name[len(vendor) + 5:]          # e.g. '3g.40gb' or '3g.40gb.shared'
            slices = profile.split("g", 1)[0]
            return (int(slices) / MIG_SLICES if slices.isdigit() else 1.0) * per_replica
        return per_replica


# --------------------------------------------------------------------------- small readers
def parse_time_ms(value: Any) -> int | None:
    """RFC 3339 (Kubernetes Time / MicroTime) -> epoch ms; None when absent."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise MalformedObject(f"timestamp {value!r} is not a string")
    try:
        return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        raise MalformedObject(f"timestamp {value!r} is not RFC 3339") from None


def quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ('2', 2, '500m', '36Gi')."""
    from kubernetes.utils.quantity import parse_quantity  # a pure parser

    try:
        return parse_quantity(value)
    except (ValueError, TypeError):
        raise MalformedObject(f"bad resource quantity {value!r}") from None


def _dict(obj: Any, where: str) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise MalformedObject(f"{where} is a {type(obj).__name__}, not an object")
    return obj


def _list(obj: Any, where: str) -> list:
    if obj is None:
        return []
    if not isinstance(obj, list):
        raise MalformedObject(f"{where} is a {type(obj).__name__}, not a list")
    return obj


def metadata(obj: Any) -> tuple[dict, str, str, str]:
    """(metadata, uid, namespace, name) of an API object; MalformedObject when one is missing."""
    if not isinstance(obj, dict):
        raise MalformedObject(f"object is a {type(obj).__name__}, not a JSON object")
    meta = _dict(obj.get("metadata"), "metadata")
    name, uid = meta.get("name"), meta.get("uid")
    if not isinstance(name, str) or not name:
        raise MalformedObject("metadata.name is missing")
    if not isinstance(uid, str) or not uid:
        raise MalformedObject(f"{name}: metadata.uid is missing")
    namespace = meta.get("namespace") or ""
    return meta, uid, namespace, name


def conditions(status: dict) -> dict[str, dict]:
    return {c.get("type"): c for c in _list(status.get("conditions"), "status.conditions") if isinstance(c, dict)}


def scheduled_ms(status: dict, created_ms: int | None) -> int | None:
    """When the pod was placed on its node: PodScheduled's change to True, else status.startTime, else its
    creation."""
    scheduled = conditions(status).get("PodScheduled", {})
    return (parse_time_ms(scheduled.get("lastTransitionTime")) if scheduled.get("status") == "True" else None) \
        or parse_time_ms(status.get("startTime")) or created_ms


def finished_times(statuses: list[dict]) -> list[int]:
    """The `finishedAt` of each of these container statuses that has terminated."""
    return [t for t in (parse_time_ms(_dict(_dict(s.get("state"), "state").get("terminated"), "terminated")
                                      .get("finishedAt")) for s in statuses) if t is not None]


def relist_steps(pods: list) -> list[Any]:
    """A relist's pods in the order their changes happened, as the translation must see them: it takes one job's
    changes in time order (a change dated before the job's last is moved up to it). The API lists pods by name,
    and a relist (a start, a restart, a 410) can hold several changes of one job's pods: one ended at 50 s listed
    after a sibling that ended at 100 s was billed until 100 s, and a pod scheduled at 50 s listed after it
    allocated from 100 s. Each pod comes at its scheduling time; an ended one (Succeeded, Failed) first as still
    running there, then as it is at its end. A pod that cannot be read comes first, once (it is skipped and logged)."""
    steps: list[tuple[float, int, Any]] = []
    for n, pod in enumerate(pods):
        try:
            if not isinstance(pod, dict):
                raise MalformedObject("not an object")
            status = _dict(pod.get("status"), "status")
            at = scheduled_ms(status, parse_time_ms(_dict(pod.get("metadata"), "metadata").get("creationTimestamp"))) or 0
            if status.get("phase") not in ("Succeeded", "Failed"):
                steps.append((at, n, pod))
                continue
            ended = max(finished_times([c for c in _list(status.get("containerStatuses"), "status.containerStatuses")
                                        if isinstance(c, dict)]), default=math.inf)
        except MalformedObject:
            steps.append((-math.inf, n, pod))
            continue
        steps.append((at, n, {**pod, "status": {**status, "phase": "Running"}}))
        steps.append((max(at, ended), n, pod))
    return [pod for _, _, pod in sorted(steps, key=lambda step: step[:2])]


def sidecars(pod_spec: dict) -> list[dict]:
    """The pod's sidecars: init containers with `restartPolicy: Always`, which run beside its
    containers for the pod's whole life (their GPUs are held as long; the kubelet's PodResources
    lists them). Plain init containers run before, and are not counted."""
    return [c for c in _list(pod_spec.get("initContainers"), "spec.initContainers")
            if isinstance(c, dict) and c.get("restartPolicy") == "Always"]


def requested_gpus(pod_spec: dict, mapping: KubernetesMapping) -> float:
    """GPUs the pod asks for: its containers' and sidecars' GPU limits (requests when no limit;
    extended resources must have equal requests and limits anyway)."""
    total = 0.0
    for c in _list(pod_spec.get("containers"), "spec.containers") + sidecars(pod_spec):
        res = _dict(_dict(c, "container").get("resources"), "resources")
        asked = {**_dict(res.get("requests"), "requests"), **_dict(res.get("limits"), "limits")}
        for name, value in asked.items():
            if mapping.is_gpu_resource(name):
                total += float(quantity(value)) * mapping.gpus_per_unit(name)
    return round(total, 6)


def asks_for_gpus(pod: Any, mapping: KubernetesMapping) -> bool:
    """Whether the ledger has anything to do with this pod object: it asks for GPUs (a GPU request
    cannot change in a pod's life). A pod it cannot read counts as asking, so that the core logs why."""
    try:
        return requested_gpus(_dict(pod.get("spec"), "spec"), mapping) > 0
    except Exception:
        return True


def strip_runtime(container_id: str | None) -> str | None:
    """'containerd://abc' -> 'abc' (the id the GPU agent reads from the process's cgroup)."""
    if not container_id:
        return None
    return container_id.split("://", 1)[1] if "://" in container_id else container_id


def job_identity(obj: dict, namespace: str, name: str) -> str:
    """Canonical job id of a pod: the JobSet / Kueue pod group, else the pod itself when Kueue
    admits it alone, else the controlling owner (Job, ...), else the pod itself;
    '<namespace>/<kind>/<name>' or '<namespace>/<name>'. `workload_job_identity` gives a Workload
    the same id as its pods."""
    meta = _dict(obj.get("metadata"), "metadata")
    labels = _dict(meta.get("labels"), "metadata.labels")
    annotations = _dict(meta.get("annotations"), "metadata.annotations")
    if labels.get(JOBSET_LABEL):
        return f"{namespace}/jobset/{labels[JOBSET_LABEL]}"
    group = labels.get(POD_GROUP_LABEL) or annotations.get(POD_GROUP_LABEL)
    if group:
        return f"{namespace}/podgroup/{group}"
    if labels.get(KUEUE_MANAGED_LABEL) == "true" or annotations.get(SUSPENDING_PARENT_ANNOTATION):
        return f"{namespace}/{name}"   # its Workload is the pod's own, whatever owns the pod
    return _owner_identity(meta, namespace, name)


def workload_job_identity(workload: dict, namespace: str, name: str) -> str:
    """Job id of a Kueue Workload, the same as its pods': a pod group's Workload is named after the
    group, its pods are owners but none the controller (a prebuilt one lacks the annotation); a
    single pod's Workload is controlled by the pod; any other Workload by its job (Job, JobSet, ...)."""
    meta = _dict(workload.get("metadata"), "metadata")
    owners = [o for o in _list(meta.get("ownerReferences"), "ownerReferences") if isinstance(o, dict)]
    controller = next((o for o in owners if o.get("controller")), None)
    if (_dict(meta.get("annotations"), "metadata.annotations").get(GROUP_WORKLOAD_ANNOTATION) == "true"
            or (owners and controller is None and all(o.get("kind") == "Pod" for o in owners))):
        return f"{namespace}/podgroup/{name}"
    if controller and controller.get("kind") == "Pod" and controller.get("name"):
        return f"{namespace}/{controller['name']}"
    return _owner_identity(meta, namespace, name)


def _owner_identity(meta: dict, namespace: str, name: str) -> str:
    owners = [o for o in _list(meta.get("ownerReferences"), "ownerReferences") if isinstance(o, dict)]
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    if owner and owner.get("kind") and owner.get("name"):
        return f"{namespace}/{str(owner['kind']).lower()}/{owner['name']}"
    return f"{namespace}/{name}"


def parse_device_id(device_id: str, mapping: KubernetesMapping) -> tuple[str | None, int | None, int]:
    """(gpu_uuid, gpu_index, share_milli) of one device id from the NVIDIA device plugin:
    'GPU-<uuid>' (whole GPU), 'MIG-<uuid>' (a MIG instance: the worker finds its parent and share),
    '<uuid>::<n>' (time-slicing replica n: 1/replicas of the GPU), or a bare index ('0') when the
    plugin runs with DEVICE_ID_STRATEGY=index.

    Replica n (0..R-1) gets (n+1)*1000//R - n*1000//R: the R replicas of a device add up to exactly
    1000 (3 replicas: 333, 333, 334), so a device fully held is fully billed to its holders."""
    base, share = device_id, 1000
    if REPLICA_SEPARATOR in device_id:
        base, n = device_id.split(REPLICA_SEPARATOR, 1)
        replicas = max(1, mapping.time_slicing_replicas)
        share = ((int(n) + 1) * 1000 // replicas - int(n) * 1000 // replicas if n.isdigit()
                 else 1000 // replicas)  # a replica without a number: the floor, as before
    if base.isdigit():
        return None, int(base), share
    return base, None, share


# --------------------------------------------------------------------------- state
@dataclass
class PodTrack:
    uid: str
    namespace: str
    name: str
    job_id: str
    attempt: int
    node: str | None = None
    scheduled_ms: int | None = None
    allocated: bool = False
    started: bool = False
    ended: bool = False
    waiting_since_ms: int | None = None      # agent time when it started waiting for device ids
    gpus: list[list] = field(default_factory=list)  # [node, uuid, index, share, container name, container id]


@dataclass
class JobTrack:
    job_id: str
    tenant: str
    queue: str
    priority: int = 0
    requested_gpus: float = 0.0
    attempt: int = 0
    attempt_ended: bool = False
    last_outcome: str | None = None
    outcome: list | None = None                # [kind, reason] worst so far of the open attempt
    live: list[str] = field(default_factory=list)   # pod uids of the open attempt
    running: bool = False
    emitted_gpus: list | None = None           # the GPU set last sent for the open attempt
    queued_attempt: int = -1
    evicted: list | None = None                # [attempt, reason]: Kueue evicted that attempt
    #: lastTransitionTime of the Evicted=True condition already counted (0: its time unknown); Kueue
    #: keeps the condition while the requeued Workload waits, so each eviction is counted once
    eviction_seen_ms: int | None = None
    last_ts: int = 0
    seq: int = 0
    #: digest of the job's events so far (each event's content chained to the one before), in its
    #: event ids: a crash's re-derivation reuses an id only for the same event after the same history
    history: str = ""


@dataclass
class WorkloadInfo:
    job_id: str
    local_queue: str
    cluster_queue: str | None
    admitted: bool
    finished: bool
    gpus: float
    priority: int
    #: [lastTransitionTime, reason] of its QuotaReserved=False (waiting for quota), else None: the
    #: re-queue an evicted attempt takes up when its last pod goes (Kueue sends no update then)
    pending: list | None = None


@dataclass
class ClusterQueueInfo:
    quota_gpus: float
    usage_gpus: float | None
    pending_workloads: int


def _gpu_key(g: list) -> tuple:
    return tuple("" if v is None else v for v in g)


def _put_back(entries: dict, key: str, saved: Any) -> None:
    if saved is None:
        entries.pop(key, None)
    else:
        entries[key] = saved


def _merge_by_gpu(rows: list[list]) -> list[list]:
    """One row per GPU (node, uuid or index) of sorted [node, uuid, index, share, container, id]
    rows: the worker refuses an event that lists a GPU twice, and time-sliced replicas of one GPU
    (or MIG instance) can sit in two containers or two pods of one attempt. The shares add up (at
    most the whole device); the first row's container with an id stands for the GPU (an event
    carries one)."""
    merged: dict[tuple, list] = {}
    for g in rows:
        got = merged.get((g[0], g[1], g[2]))
        if got is None:
            merged[(g[0], g[1], g[2])] = list(g)
        else:
            got[3] = min(1000, got[3] + g[3])
            if got[5] is None and g[5] is not None:
                got[4], got[5] = g[4], g[5]
    return list(merged.values())


# --------------------------------------------------------------------------- the core
class KubernetesLedger:
    """Pure translation of Kubernetes objects into ledger messages, with its state (`to_state`)."""

    def __init__(self, mapping: KubernetesMapping, state: dict | None = None):
        self.mapping = mapping
        self.pods: dict[str, PodTrack] = {}
        self.jobs: dict[str, JobTrack] = {}
        self.workloads: dict[str, WorkloadInfo] = {}
        self._workloads_of: dict[str, set[str]] = {}    # job id -> '<ns>/<name>' of its Workloads (checked on use)
        self.cluster_queues: dict[str, ClusterQueueInfo] = {}
        self.local_queues: dict[str, str] = {}          # '<ns>/<name>' -> ClusterQueue
        self.watermark_ms = 0
        self.preemptions: list[PreemptionFired] = []
        self.clamped = 0                                 # events moved later to keep order / the watermark
        self._waiting: dict[str, dict] = {}              # uid -> latest object of a pod waiting for devices
        if state:
            self._load(state)

    # ------------------------------------------------------------------ state
    def state_sections(self) -> dict[str, dict]:
        """What the state holds besides the watermark, by section: key -> entry (a dataclass or a
        string), each written by orjson as it is (the agent's state file compares them one by one)."""
        return {"pods": self.pods, "jobs": self.jobs, "local_queues": self.local_queues}

    def state_bytes(self) -> bytes:
        """The state as JSON, written by orjson straight from the dataclasses: 0.04 s for 15,625 pods
        and jobs (a 100,000-GPU cluster) against 2.7 s through dataclasses.asdict."""
        return orjson.dumps({"version": STATE_VERSION, "watermark_ms": self.watermark_ms, **self.state_sections()})

    def to_state(self) -> dict:
        return orjson.loads(self.state_bytes())

    def _load(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown state version {state.get('version')!r}")
        self.watermark_ms = int(state["watermark_ms"])
        self.pods = {uid: PodTrack(**p) for uid, p in state["pods"].items()}
        # a state from before eviction_seen_ms: the eviction it holds is the one a Workload still shows
        self.jobs = {jid: JobTrack(**{"eviction_seen_ms": 0 if j.get("evicted") else None, **j})
                     for jid, j in state["jobs"].items()}
        self.local_queues = dict(state.get("local_queues", {}))

    # ------------------------------------------------------------------ events
    def _emit(self, out: list[JobEvent], job: JobTrack, kind: K, ts_ms: int, *, gpus: list | None = None,
              reason: str | None = None, aliases: dict[str, str] | None = None) -> None:
        ts = max(ts_ms, job.last_ts, self.watermark_ms)
        if ts != ts_ms:
            self.clamped += 1
        job.last_ts = ts
        job.seq += 1
        # The id is the event's place in its job (n), its kind and, but for the job's first event (its
        # `submitted`, with no history), a digest of its content chained to the job's events before
        # it: a restart that re-derives the same events after the same history sends the same ids (the
        # worker drops the copies), and one that re-derives fewer or other events (a pod that ended
        # meanwhile, listed without devices) sends new ids, so no later event takes an id already used
        # with other content (docs/kubernetes.md, "Exactly once").
        job.history = hashlib.blake2b(orjson.dumps(
            [job.history, job.attempt, job.seq, kind.value, ts, job.tenant, job.queue, job.priority,
             job.requested_gpus, [[g[0], g[1], g[2], g[3], g[5]] for g in gpus or []], aliases or {}, reason],
            option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
        suffix = "" if job.seq == 1 else f".{job.history}"
        out.append(JobEvent(
            event_id=f"k8s/{self.mapping.cluster}/{job.job_id}/{job.attempt}/{job.seq}/{kind.value}{suffix}",
            ts_ms=ts, kind=kind, cluster=self.mapping.cluster, job_id=job.job_id, attempt=job.attempt,
            tenant=job.tenant, queue=job.queue, priority=job.priority, requested_gpus=job.requested_gpus,
            gpus=[GpuAssignment(node=g[0], gpu_uuid=g[1], gpu_index=g[2], share_milli=g[3], container_id=g[5])
                  for g in gpus or []],
            aliases=aliases or {}, reason=reason))

    def _queue_of(self, namespace: str, local_queue: str | None) -> str:
        if not local_queue:
            return self.mapping.default_queue
        return self.local_queues.get(f"{namespace}/{local_queue}", local_queue)

    def _job(self, out: list[JobEvent], job_id: str, *, tenant: str, queue: str, priority: int, requested: float,
             created_ms: int, aliases: dict[str, str]) -> JobTrack:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobTrack(job_id=job_id, tenant=tenant, queue=queue, priority=priority,
                                               requested_gpus=requested)
            self._emit(out, job, K.submitted, created_ms, aliases=aliases)
        return job

    def _open_next_attempt(self, out: list[JobEvent], job: JobTrack, ts_ms: int) -> None:
        """The previous attempt ended: the job is being run again."""
        if not job.attempt_ended:
            return
        job.attempt += 1
        job.attempt_ended = False
        job.outcome, job.running, job.emitted_gpus, job.live = None, False, None, []
        if job.last_outcome in (K.failed.value, K.preempted.value):
            self._emit(out, job, K.retried, ts_ms)

    # ------------------------------------------------------------------ pods
    def observe_pod(self, pod: dict, now_ms: int, devices_for: DeviceLookup) -> list[JobEvent]:
        """A pod as listed or watched (ADDED / MODIFIED). Pods asking for no GPU are ignored."""
        return self._pod_all_or_nothing(pod, now_ms, devices_for, deleted=False)

    def pod_deleted(self, pod: dict, now_ms: int, devices_for: DeviceLookup) -> list[JobEvent]:
        """A pod is gone (DELETED, or missing from a relist): its attempt ends if it had not."""
        out = self._pod_all_or_nothing(pod, now_ms, devices_for, deleted=True)
        _, uid, _, _ = metadata(pod)
        self.pods.pop(uid, None)
        self._waiting.pop(uid, None)
        return out

    def waiting_pods(self) -> list[dict]:
        """Latest objects of the pods held back for their device ids (retry them every cycle)."""
        return list(self._waiting.values())

    def waiting_count(self) -> int:
        return len(self._waiting)

    def _pod_all_or_nothing(self, pod: dict, now_ms: int, devices_for: DeviceLookup, *,
                            deleted: bool) -> list[JobEvent]:
        _, uid, namespace, name = metadata(pod)
        track = self.pods.get(uid)
        with self._all_or_nothing(track.job_id if track else job_identity(pod, namespace, name), uid):
            return self._pod(pod, now_ms, devices_for, deleted=deleted)

    def _pod(self, pod: dict, now_ms: int, devices_for: DeviceLookup, *, deleted: bool) -> list[JobEvent]:
        meta, uid, namespace, name = metadata(pod)
        spec = _dict(pod.get("spec"), "spec")
        status = _dict(pod.get("status"), "status")
        created = parse_time_ms(meta.get("creationTimestamp"))
        if created is None:
            raise MalformedObject(f"pod {namespace}/{name}: metadata.creationTimestamp is missing")
        out: list[JobEvent] = []
        track = self.pods.get(uid)
        if track is None:
            requested = requested_gpus(spec, self.mapping)
            if requested <= 0 or deleted:
                return out
            labels = _dict(meta.get("labels"), "metadata.labels")
            job_id = job_identity(pod, namespace, name)
            aliases = {"k8s_pod": f"{namespace}/{name}", "k8s_pod_uid": uid}
            job = self._job(out, job_id, tenant=labels.get(self.mapping.tenant_label) or namespace,
                            queue=self._queue_of(namespace, labels.get(self.mapping.queue_label)),
                            priority=int(spec.get("priority") or 0), requested=requested,
                            created_ms=created, aliases=aliases)
            if not job.live:
                self._open_next_attempt(out, job, created)
            track = self.pods[uid] = PodTrack(uid=uid, namespace=namespace, name=name, job_id=job_id,
                                              attempt=job.attempt)
            job.live.append(uid)
        if track.ended:
            return out
        job = self.jobs[track.job_id]
        self._advance(out, track, job, pod, meta, spec, status, created, now_ms, devices_for, deleted)
        return out

    @contextmanager
    def _all_or_nothing(self, job_id: str, uid: str | None = None, workload: str | None = None) -> Iterator[None]:
        """Fields are read as the translation goes, so an object found malformed part-way would leave
        its first changes without their events, and its next good version would not derive them
        again. One object changes one job, its pod (or Workload) and the waiting list: those are
        copied (cheap, unlike the whole state) and put back when it fails, so it is truly skipped."""
        job, track = self.jobs.get(job_id), self.pods.get(uid) if uid else None
        saved_job = (copy.copy(job), list(job.live)) if job else None
        saved_track = copy.copy(track) if track else None
        waiting = self._waiting.get(uid) if uid else None
        info = self.workloads.get(workload) if workload else None
        clamped, preemptions = self.clamped, len(self.preemptions)
        try:
            yield
        except Exception:
            if saved_job:
                self.jobs[job_id] = saved_job[0]
                saved_job[0].live = saved_job[1]
            else:
                self.jobs.pop(job_id, None)
            if uid:
                _put_back(self.pods, uid, saved_track)
                _put_back(self._waiting, uid, waiting)
            if workload:
                _put_back(self.workloads, workload, info)
            self.clamped = clamped
            del self.preemptions[preemptions:]
            raise

    def _advance(self, out, track: PodTrack, job: JobTrack, pod: dict, meta: dict, spec: dict, status: dict,
                 created: int, now_ms: int, devices_for: DeviceLookup, deleted: bool) -> None:
        conds = conditions(status)
        scheduled = conds.get("PodScheduled", {})
        phase = status.get("phase")
        terminal = deleted or phase in ("Succeeded", "Failed")
        # queued: the scheduler could not place it (once per attempt)
        if (not track.allocated and scheduled.get("status") == "False" and job.queued_attempt != track.attempt):
            job.queued_attempt = track.attempt
            why = ": ".join(str(x) for x in (scheduled.get("reason"), scheduled.get("message")) if x)
            self._emit(out, job, K.queued, parse_time_ms(scheduled.get("lastTransitionTime")) or created,
                       reason=why or None)
        node = spec.get("nodeName")
        # a sidecar's status is among the init containers': after the containers', so that a failure
        # reason is the containers' own (a sidecar is stopped, exit code 143, when they are done)
        sidecar_names = {c.get("name") for c in sidecars(spec)}
        statuses = [s for s in _list(status.get("containerStatuses"), "status.containerStatuses")
                    if isinstance(s, dict)] + [
                    s for s in _list(status.get("initContainerStatuses"), "status.initContainerStatuses")
                    if isinstance(s, dict) and s.get("name") in sidecar_names]
        if not track.allocated and node:
            track.node = node
            track.scheduled_ms = scheduled_ms(status, created)
            gpus: list[list] | None = []
            if self.mapping.devices_expected:
                devices = devices_for(node, track.namespace, track.name, status.get("hostIP"))
                # the kubelet lists a pod before admission has run the device plugin's Allocate: a
                # pod that asks for GPUs and shows none of them is not known yet, not GPU-less
                if devices is None or not any(devices.values()):
                    waited = now_ms - (track.waiting_since_ms if track.waiting_since_ms is not None else now_ms)
                    if not terminal and waited < self.mapping.device_wait_ms:
                        if track.waiting_since_ms is None:
                            track.waiting_since_ms = now_ms
                        self._waiting[track.uid] = pod
                        return  # held: the watermark stays at scheduled_ms until it resolves
                    log.warning("no device ids for pod %s/%s on %s%s: its allocation cannot be billed to GPUs",
                                track.namespace, track.name, node,
                                " (it ended first)" if terminal else f" after {waited / 1000:.0f} s")
                    gpus = []
                else:
                    gpus = self._assignments(track, node, devices, statuses)
            track.allocated, track.waiting_since_ms, track.gpus = True, None, gpus
            self._waiting.pop(track.uid, None)
            self._reallocate(out, job, track.scheduled_ms)
        elif track.allocated and not track.gpus and track.node and self.mapping.devices_expected and not terminal:
            # sent without GPUs when the wait ran out (the node's reporter away): each later update
            # looks again, and the GPUs found are billed from the earliest time the ledger still takes
            devices = devices_for(track.node, track.namespace, track.name, status.get("hostIP"))
            if devices is not None and any(devices.values()):
                track.gpus = self._assignments(track, track.node, devices, statuses)
                log.warning("device ids for pod %s/%s on %s found after the wait: its GPUs are billed from now on",
                            track.namespace, track.name, track.node)
                self._reallocate(out, job, track.scheduled_ms or created)
        if not track.allocated:
            if terminal:
                self._end_pod(out, track, job, pod, meta, status, conds, statuses, now_ms, deleted)
            return
        # container ids appear once the runtime has created the containers, and change when a
        # container restarts: the GPU set is sent again from that container's start
        # a container the runtime could not start (StartError: `exec: "x": executable file not found`) ends
        # `terminated` with startedAt at the runtime's zero time, 1970-01-01T00:00:00Z (kubernetes#120331): no start
        started = {s.get("name"): t for s in statuses for k in ("running", "terminated")
                   for t in [parse_time_ms(_dict(_dict(s.get("state"), "state").get(k), k).get("startedAt"))]
                   if t is not None and t > 0}
        started_at = list(started.values())
        ids = self._container_refs(track, statuses)
        refreshed = [g[:5] + [ids.get(g[4]) or g[5]] for g in track.gpus]
        if refreshed != track.gpus:
            changed = [started[g[4]] for g, old in zip(refreshed, track.gpus) if g != old and g[4] in started]
            track.gpus = refreshed
            self._reallocate(out, job, max(changed) if changed else track.scheduled_ms or created)
        if not track.started and started_at:
            track.started = True
            if not job.running:
                job.running = True
                self._emit(out, job, K.started, min(started_at))
        if terminal:
            self._end_pod(out, track, job, pod, meta, status, conds, statuses, now_ms, deleted)

    def _container_refs(self, track: Any, statuses: list[dict]) -> dict[str, str | None]:
        """container name -> the id its GPU processes are matched by (KubernetesMapping.container_ids)."""
        return {s.get("name"): self.mapping.container_ref(track.namespace, track.name, s.get("name"), s.get("containerID"))
                for s in statuses}

    def _assignments(self, track: Any, node: str, devices: dict[str, list[str]], statuses: list[dict]) -> list[list]:
        ids = self._container_refs(track, statuses)
        merged: dict[tuple, int] = {}
        for container, device_ids in sorted(devices.items()):
            for device_id in device_ids:
                uuid, index, share = parse_device_id(device_id, self.mapping)
                key = (uuid, index, container)
                merged[key] = min(1000, merged.get(key, 0) + share)  # two replicas of one GPU: twice the share
        return [[node, uuid, index, share, container, ids.get(container)]
                for (uuid, index, container), share in sorted(merged.items(), key=lambda kv: _gpu_key(list(kv[0])))]

    def _reallocate(self, out: list[JobEvent], job: JobTrack, ts_ms: int) -> None:
        """Send the attempt's GPU set again when it changed (and `started` again if it runs)."""
        held = sorted((g for uid in job.live for p in [self.pods.get(uid)] if p and p.allocated and not p.ended
                       for g in p.gpus), key=_gpu_key)
        gpus = _merge_by_gpu(held)
        if gpus == job.emitted_gpus:
            return
        job.emitted_gpus = gpus
        pods = [self.pods[uid] for uid in job.live if uid in self.pods and self.pods[uid].allocated]
        aliases = {"k8s_pods": ",".join(f"{p.namespace}/{p.name}" for p in pods),
                   "k8s_pod_uids": ",".join(p.uid for p in pods)} if pods else {}
        self._emit(out, job, K.allocated, ts_ms, gpus=gpus, aliases=aliases)
        if job.running:
            self._emit(out, job, K.started, ts_ms)

    def _end_pod(self, out, track: PodTrack, job: JobTrack, pod: dict, meta: dict, status: dict, conds: dict,
                 statuses: list[dict], now_ms: int, deleted: bool) -> None:
        kind, ts, reason = self._outcome(track, job, meta, status, conds, statuses, now_ms, deleted)
        track.ended = True
        self._waiting.pop(track.uid, None)
        if track.uid in job.live:
            job.live.remove(track.uid)
        if job.outcome is None or OUTCOME_RANK[kind] > OUTCOME_RANK[K(job.outcome[0])]:
            job.outcome = [kind.value, reason]
        if job.live:
            self._reallocate(out, job, ts)   # the others run on: only this pod's GPUs are released
            return
        final, why = K(job.outcome[0]), job.outcome[1]
        self._emit(out, job, final, ts, reason=why)
        job.attempt_ended, job.last_outcome, job.running, job.emitted_gpus = True, final.value, False, None
        if job.evicted and job.evicted[0] == job.attempt:
            # Kueue evicted this attempt and unsets its quota as soon as no pod is active (terminating
            # pods do not count), so the re-queue usually came while this pod was going, and no
            # Workload update follows until it is admitted again: the next attempt waits from then
            for _, info in self._workloads_of_job(job.job_id):
                if info.pending:
                    self._requeue(out, job, info.pending)
                    break

    def _outcome(self, track: PodTrack, job: JobTrack, meta: dict, status: dict, conds: dict,
                 statuses: list[dict], now_ms: int, deleted: bool) -> tuple[K, int, str | None]:
        finished = finished_times(statuses)
        deletion = parse_time_ms(meta.get("deletionTimestamp"))
        if deletion is not None:  # deletionTimestamp is the deadline: the request came a grace period before
            deletion -= int(meta.get("deletionGracePeriodSeconds") or 0) * 1000
        disruption = conds.get("DisruptionTarget", {})
        end = max(finished) if finished else (deletion or parse_time_ms(disruption.get("lastTransitionTime"))
                                             or now_ms)
        phase, pod_reason, message = status.get("phase"), status.get("reason"), status.get("message")
        if disruption.get("status") == "True":
            return K.preempted, end, ": ".join(x for x in (disruption.get("reason"), disruption.get("message")) if x)
        if pod_reason in ("Preempting", "Evicted"):
            return K.preempted, end, ": ".join(x for x in (pod_reason, message) if x)
        if job.evicted and job.evicted[0] == track.attempt:
            return K.preempted, end, job.evicted[1]
        ended_first = phase in ("Succeeded", "Failed") and finished and (deletion is None or max(finished) <= deletion)
        if (deletion is not None or deleted) and not ended_first:
            # the GPUs are held until the containers stop, not only until the delete request; never
            # before the request (a container that stopped earlier does not end the others)
            known = [*finished, *([deletion] if deletion is not None else [])]
            stopped = max(known) if known else now_ms
            return K.cancelled, stopped, "deleted"
        if phase == "Succeeded":
            return K.completed, end, None
        if phase == "Failed":
            return K.failed, end, self._failure_reason(pod_reason, message, statuses)
        return K.cancelled, end, "deleted"

    @staticmethod
    def _failure_reason(pod_reason: str | None, message: str | None, statuses: list[dict]) -> str:
        for s in statuses:
            term = _dict(_dict(s.get("state"), "state").get("terminated"), "terminated")
            if term and term.get("exitCode") not in (0, None):
                return f"{term.get('reason') or 'Error'} (exit code {term['exitCode']}, container {s.get('name')})"
        return ": ".join(x for x in (pod_reason, message) if x) or "Failed"

    # ------------------------------------------------------------------ Kueue
    def observe_workload(self, workload: dict, now_ms: int) -> list[JobEvent]:
        """A Kueue Workload: submitted / queued events, evictions, and what snapshots count."""
        _, _, namespace, name = metadata(workload)
        job_id = workload_job_identity(workload, namespace, name)
        with self._all_or_nothing(job_id, workload=f"{namespace}/{name}"):
            return self._workload(workload)

    def _workload(self, workload: dict) -> list[JobEvent]:
        meta, uid, namespace, name = metadata(workload)
        spec = _dict(workload.get("spec"), "spec")
        status = _dict(workload.get("status"), "status")
        created = parse_time_ms(meta.get("creationTimestamp"))
        if created is None:
            raise MalformedObject(f"workload {namespace}/{name}: metadata.creationTimestamp is missing")
        conds = conditions(status)
        gpus, labels = 0.0, dict(_dict(meta.get("labels"), "metadata.labels"))
        for ps in _list(spec.get("podSets"), "spec.podSets"):
            ps = _dict(ps, "podSet")
            template = _dict(ps.get("template"), "podSet.template")
            labels = {**_dict(_dict(template.get("metadata"), "template.metadata").get("labels"), "labels"), **labels}
            gpus += requested_gpus(_dict(template.get("spec"), "template.spec"), self.mapping) * int(ps.get("count") or 1)
        local_queue = spec.get("queueName") or labels.get(self.mapping.queue_label) or ""
        admission = _dict(status.get("admission"), "status.admission")
        cluster_queue = admission.get("clusterQueue") or self.local_queues.get(f"{namespace}/{local_queue}")
        reserved = conds.get("QuotaReserved", {}).get("status") == "True"
        finished = conds.get("Finished", {}).get("status") == "True"
        quota = conds.get("QuotaReserved", {})
        waiting = ([parse_time_ms(quota.get("lastTransitionTime")) or created,
                    ": ".join(x for x in (quota.get("reason"), quota.get("message")) if x) or None]
                   if not reserved and not finished and quota.get("status") == "False" else None)
        job_id = workload_job_identity(workload, namespace, name)
        self.workloads[f"{namespace}/{name}"] = WorkloadInfo(
            job_id=job_id, local_queue=local_queue, cluster_queue=cluster_queue, admitted=reserved,
            finished=finished, gpus=gpus, priority=int(spec.get("priority") or 0), pending=waiting)
        self._workloads_of.setdefault(job_id, set()).add(f"{namespace}/{name}")
        out: list[JobEvent] = []
        if gpus <= 0:
            return out
        job = self._job(out, job_id, tenant=labels.get(self.mapping.tenant_label) or namespace,
                        queue=cluster_queue or self._queue_of(namespace, local_queue),
                        priority=int(spec.get("priority") or 0), requested=gpus, created_ms=created,
                        aliases={"kueue_workload": f"{namespace}/{name}", "kueue_workload_uid": uid})
        evicted = conds.get("Evicted", {})
        if evicted.get("status") == "True":
            if not finished:
                self._eviction(job, evicted, cluster_queue or job.queue)
        else:  # never evicted, or quota reserved again (Kueue then sets Evicted=False)
            job.eviction_seen_ms = None
            if job.evicted and not (job.evicted[0] == job.attempt and job.live):
                job.evicted = None  # kept only for the evicted pods whose end the agent has yet to see
        if waiting and not job.live:
            self._requeue(out, job, waiting)
        return out

    def _requeue(self, out: list[JobEvent], job: JobTrack, waiting: list) -> None:
        """A Workload of the job waits for quota (`waiting`: its QuotaReserved=False time and reason)
        and no pod of the job lives: the next attempt (`retried` first after an eviction) is `queued`."""
        self._open_next_attempt(out, job, waiting[0])
        if job.queued_attempt != job.attempt:
            job.queued_attempt = job.attempt
            self._emit(out, job, K.queued, waiting[0], reason=waiting[1])

    def _workloads_of_job(self, job_id: str) -> list[tuple[str, WorkloadInfo]]:
        """The known Workloads of a job ('<ns>/<name>', info); the index may keep a key a skipped
        object put back, so each is checked."""
        keys = self._workloads_of.get(job_id, ())
        return [(k, w) for k in sorted(keys) for w in [self.workloads.get(k)] if w is not None and w.job_id == job_id]

    def _eviction(self, job: JobTrack, evicted: dict, queue: str) -> None:
        """An Evicted=True condition: counted once, and it ends as `preempted` only the pods of the
        attempt running when it came (not the next attempt's, while the requeued Workload shows it)."""
        since = parse_time_ms(evicted.get("lastTransitionTime")) or 0
        seen = job.eviction_seen_ms
        if seen is not None and (seen == since or not seen or not since):
            return
        job.eviction_seen_ms = since
        if job.live:
            job.evicted = [job.attempt, "Kueue " + ": ".join(x for x in (evicted.get("reason"), evicted.get("message"))
                                                             if x)]
        if evicted.get("reason") == "Preempted":
            self.preemptions.append(PreemptionFired(job_id=job.job_id, queue=queue,
                                                    rule=str(evicted.get("message") or "Preempted")))

    def workload_deleted(self, workload: dict, now_ms: int) -> list[JobEvent]:
        """A Workload is gone. One deleted before it finished, while its job has no pod (cancelled in
        the queue, or after an eviction requeued it), ends the open attempt as `cancelled`: no pod
        will end it, and an attempt never ended would keep the job for ever. Not while another
        unfinished Workload of the job is known: Kueue replaced it (the job still waits)."""
        meta, _, namespace, name = metadata(workload)
        status = _dict(workload.get("status"), "status")
        finished = conditions(status).get("Finished", {}).get("status") == "True"
        deletion = parse_time_ms(meta.get("deletionTimestamp"))
        job_id = workload_job_identity(workload, namespace, name)
        job = self.jobs.get(job_id)
        self.workloads.pop(f"{namespace}/{name}", None)
        keys = self._workloads_of.get(job_id)
        if keys is not None:
            keys.discard(f"{namespace}/{name}")
            if not keys:
                del self._workloads_of[job_id]
        out: list[JobEvent] = []
        if finished or job is None or job.attempt_ended or job.live:
            return out
        if any(not w.finished for _, w in self._workloads_of_job(job_id)):
            return out
        self._cancel_in_queue(out, job, deletion or now_ms)
        return out

    def _cancel_in_queue(self, out: list[JobEvent], job: JobTrack, ts_ms: int) -> None:
        self._emit(out, job, K.cancelled, ts_ms, reason="deleted")
        job.attempt_ended, job.last_outcome, job.running, job.emitted_gpus = True, K.cancelled.value, False, None

    def workloads_listed_after_start(self, listed_jobs: set[str], now_ms: int) -> list[JobEvent]:
        """The first Workload list after a start (the saved state holds no Workloads): a saved job
        whose attempt is open with no pod has it open only through a Workload (pods open theirs
        with themselves); if no listed Workload is the job's, it was deleted while the agent was
        away, so the attempt ends `cancelled` at the agent's clock (no Kubernetes time exists)."""
        out: list[JobEvent] = []
        for job in list(self.jobs.values()):
            if (not job.attempt_ended and not job.live and job.job_id not in listed_jobs
                    and not any(not w.finished for _, w in self._workloads_of_job(job.job_id))):
                self._cancel_in_queue(out, job, now_ms)
        return out

    def observe_cluster_queue(self, cq: dict) -> None:
        _, _, _, name = metadata(cq)
        spec, status = _dict(cq.get("spec"), "spec"), _dict(cq.get("status"), "status")
        quota = Decimal(0)
        for group in _list(spec.get("resourceGroups"), "spec.resourceGroups"):
            for flavor in _list(_dict(group, "resourceGroup").get("flavors"), "flavors"):
                for res in _list(_dict(flavor, "flavor").get("resources"), "resources"):
                    res = _dict(res, "resource")
                    if self.mapping.is_gpu_resource(str(res.get("name"))):
                        quota += quantity(res.get("nominalQuota", 0)) * Decimal(self.mapping.gpus_per_unit(res["name"]))
        usage: Decimal | None = None
        for key in ("flavorsReservation", "flavorsUsage"):  # Kueue's own accounting of admitted workloads
            if key in status:
                usage = Decimal(0)
                for flavor in _list(status[key], key):
                    for res in _list(_dict(flavor, "flavor").get("resources"), "resources"):
                        res = _dict(res, "resource")
                        if self.mapping.is_gpu_resource(str(res.get("name"))):
                            usage += quantity(res.get("total", 0)) * Decimal(self.mapping.gpus_per_unit(res["name"]))
                break
        self.cluster_queues[name] = ClusterQueueInfo(quota_gpus=float(quota),
                                                     usage_gpus=None if usage is None else float(usage),
                                                     pending_workloads=int(status.get("pendingWorkloads") or 0))

    def cluster_queue_deleted(self, cq: dict) -> None:
        self.cluster_queues.pop(metadata(cq)[3], None)

    def observe_local_queue(self, lq: dict) -> None:
        _, _, namespace, name = metadata(lq)
        target = _dict(lq.get("spec"), "spec").get("clusterQueue")
        if not isinstance(target, str) or not target:
            raise MalformedObject(f"localqueue {namespace}/{name}: spec.clusterQueue is missing")
        self.local_queues[f"{namespace}/{name}"] = target

    def local_queue_deleted(self, lq: dict) -> None:
        _, _, namespace, name = metadata(lq)
        self.local_queues.pop(f"{namespace}/{name}", None)

    # ------------------------------------------------------------------ snapshots and watermarks
    def snapshot(self, now_ms: int) -> SchedulerSnapshot:
        """Queues = the ClusterQueues (Kueue), or, without Kueue, the queues the pods name."""
        queues: list[QueueState] = []
        if self.cluster_queues:
            for name, cq in sorted(self.cluster_queues.items()):
                mine = [w for w in self.workloads.values() if w.cluster_queue == name and not w.finished]
                pending = [w for w in mine if not w.admitted]
                allocated = cq.usage_gpus if cq.usage_gpus is not None else sum(w.gpus for w in mine if w.admitted)
                queues.append(QueueState(queue=name, quota_gpus=cq.quota_gpus, allocated_gpus=allocated,
                                         pending_jobs=max(len(pending), cq.pending_workloads),
                                         pending_gpus=sum(w.gpus for w in pending),
                                         pending_by_priority=_by_priority((w.priority, w.gpus) for w in pending)))
        else:
            by_queue: dict[str, list[JobTrack]] = {}
            for job in self.jobs.values():
                by_queue.setdefault(job.queue, []).append(job)
            for name, jobs in sorted(by_queue.items()):
                live = [j for j in jobs if j.live]
                pending = [j for j in live if not j.emitted_gpus and not j.running]
                allocated = sum(g[3] for j in live for g in (j.emitted_gpus or [])) / 1000
                queues.append(QueueState(queue=name, quota_gpus=0.0, allocated_gpus=allocated, pending_jobs=len(pending),
                                         pending_gpus=sum(j.requested_gpus for j in pending),
                                         pending_by_priority=_by_priority((j.priority, j.requested_gpus) for j in pending)))
        preemptions, self.preemptions = self.preemptions, []
        return SchedulerSnapshot(cluster=self.mapping.cluster, ts_ms=now_ms, queues=queues, preemptions=preemptions)

    def watermark(self, observed_ms: int) -> LifecycleWatermark | None:
        """The promise for time up to which every watch has been seen (`observed_ms`, agent clock):
        less the allowed lateness, and never past a pod still waiting for its device ids. None when
        it has not advanced."""
        candidate = observed_ms - self.mapping.allowed_lateness_ms
        held = [self.pods[uid].scheduled_ms for uid in self._waiting if uid in self.pods
                and self.pods[uid].scheduled_ms is not None]
        if held:
            candidate = min(candidate, min(held))
        if candidate <= self.watermark_ms:
            return None
        self.watermark_ms = candidate
        self._prune()
        return LifecycleWatermark(cluster=self.mapping.cluster, ts_ms=candidate)

    def _prune(self) -> None:
        horizon = self.watermark_ms - JOB_RETENTION_MS
        held = {p.job_id for p in self.pods.values()}
        for job_id in [j.job_id for j in self.jobs.values()
                       if j.attempt_ended and j.last_ts < horizon and j.job_id not in held]:
            del self.jobs[job_id]

    def known_pod_uids(self) -> set[str]:
        return set(self.pods)

    def vanished_pod_object(self, uid: str) -> dict:
        """A stand-in object for a pod the state knows but no list shows any more (deleted while
        the agent was away, its last object unknown): `pod_deleted` then ends it as cancelled at
        the agent's time, the only time known."""
        track = self.pods[uid]
        job = self.jobs.get(track.job_id)
        created = datetime.fromtimestamp((job.last_ts if job else 0) / 1000, tz=timezone.utc)
        return {"metadata": {"uid": uid, "name": track.name, "namespace": track.namespace,
                             "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")},
                "spec": {"nodeName": track.node} if track.node else {}, "status": {}}


def _by_priority(items: Iterable[tuple[int, float]]) -> list[PendingByPriority]:
    groups: dict[int, list[float]] = {}
    for priority, gpus in items:
        groups.setdefault(priority, []).append(gpus)
    return [PendingByPriority(priority=p, jobs=len(g), gpus=sum(g)) for p, g in sorted(groups.items(), reverse=True)]
