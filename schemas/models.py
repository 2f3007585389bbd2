"""Wire models of GPU Ledger: the three input lines and every record the ledger emits.

Why one file: every wire model in one place, as the JSON Schemas (schemas/json/) and the docs list
them; the conventions below hold for all of them.

Conventions (they hold for every model here):
- times are integer Unix epoch **milliseconds**, UTC (`*_ms`), event time from the source;
- durations are integer milliseconds; GPU-time is integer "GPU-milliseconds" (`gpu_ms`):
  one whole GPU for one millisecond = 1, a half share for 10 ms = 5;
- a GPU share is an integer in thousandths of one GPU (`share_milli`, 1000 = whole GPU);
- money is integer micro-units of the configured currency (`*_micros`), so that parts
  add up exactly to wholes;
- bytes are bytes, percentages are 0–100, power in watts, energy in joules.
Every message carries `schema_version`; a reader rejects versions it does not know, and ignores
fields it does not know in a version it knows (schemas/wire.py); a model built in code forbids them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

SCHEMA_VERSION = 1

Percent = Annotated[float, Field(ge=0.0, le=100.0)]
EpochMs = Annotated[int, Field(ge=0, description="Unix epoch time in milliseconds (UTC)")]
ShareMilli = Annotated[int, Field(ge=1, le=1000, description="share of one GPU in thousandths (1000 = whole GPU)")]


# Identifiers (docs/accounting.md, "Sane values or none"): printable text (Python's str.isprintable:
# no control, format or line-separator characters; a space is fine) without leading or trailing
# whitespace, and bounded in length. A message breaking the rule is a dead letter with the reason.
# The JSON Schema pattern states the control-character and whitespace part of the rule.
IDENTIFIER_PATTERN = r"^[^\s\x00-\x1f\x7f-\x9f](?:[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f])?$"
#: longest identifiers, characters: Kubernetes names are up to 253 (nodes, queues) and a job id
#: '<namespace>/<kind>/<name>' up to ~380
MAX_TENANT_LEN = MAX_CLUSTER_LEN = 128
MAX_QUEUE_LEN = MAX_NODE_LEN = 256
MAX_JOB_ID_LEN = 512
#: longest device names and ids, characters: NVML UUIDs are 40, a containerd container id with its
#: scheme 77. Bounded so that one message's names cannot outgrow the messages the worker makes of them
#: (every usage record repeats its GPU's UUID and model)
MAX_DEVICE_ID_LEN = 256
#: the most bytes a memory figure can say: ClickHouse's Int64, what the tables store
MAX_BYTES = 2**63 - 1


def _identifier(value: str) -> str:
    if not value.isprintable() or value != value.strip():
        raise PydanticCustomError(
            "identifier", "an identifier must be printable text without control characters or leading/trailing "
            "whitespace; got {shown}", {"shown": repr(value[:80])})
    return value


def _ident(max_length: int):
    return Annotated[str, Field(min_length=1, max_length=max_length, json_schema_extra={"pattern": IDENTIFIER_PATTERN}),
                     AfterValidator(_identifier)]


TenantId = _ident(MAX_TENANT_LEN)
ClusterId = _ident(MAX_CLUSTER_LEN)
QueueId = _ident(MAX_QUEUE_LEN)
NodeId = _ident(MAX_NODE_LEN)
JobId = _ident(MAX_JOB_ID_LEN)


class _Wire(BaseModel):
    # inf and NaN are not numbers a meter can report (JSON has neither; 1e999 parses to inf)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- line 1
class ProcessSample(_Wire):
    """One process (or container) seen on a GPU during the tick."""

    pid: int = Field(ge=0, description="OS process id on the node")
    container_id: str | None = Field(None, max_length=MAX_DEVICE_ID_LEN,
                                     description="container the process runs in, if known; links it to a job")
    sm_util_pct: Percent | None = Field(None, description="this process's share of SM activity over the tick, percent of the GPU")
    mem_used_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="GPU memory held by the process, bytes")


class GpuHealth(StrEnum):
    ok = "ok"
    down = "down"


class MigDevice(_Wire):
    """A MIG (Multi-Instance GPU) instance carved out of a GPU. Schedulers hand out MIG UUIDs; the
    ledger meters the parent GPU, so an allocation naming a MIG UUID holds `share_milli` of it."""

    uuid: _ident(MAX_DEVICE_ID_LEN) = Field(description="MIG device UUID (MIG-...), as schedulers and device plugins name it")
    profile: str = Field(min_length=1, max_length=MAX_DEVICE_ID_LEN, description="MIG profile, e.g. 3g.40gb")
    share_milli: ShareMilli = Field(description="share of the parent GPU: the profile's compute slices / the GPU's (7 on A100/H100), thousandths")


class GpuSample(_Wire):
    """One GPU's measurements at one tick."""

    gpu_uuid: _ident(MAX_DEVICE_ID_LEN) = Field(description="NVML UUID of the GPU; the GPU's identity in the ledger")
    index: int = Field(ge=0, description="NVML device index on the node")
    model: str = Field(min_length=1, max_length=MAX_DEVICE_ID_LEN, description="GPU model name as the ledger's coefficient library knows it (e.g. A100-80GB)")
    health: GpuHealth = Field(GpuHealth.ok, description="'down' when out of service (fatal Xid, fallen off the bus, drained)")
    down_reason: str | None = Field(None, description="why the GPU is down, e.g. 'xid 79'")
    util_gpu_pct: Percent | None = Field(None, description="GPU busy: percent of the tick a kernel was running")
    sm_active_pct: Percent | None = Field(None, description="SM activity, percent (DCGM-style profiling field where available)")
    mem_used_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="GPU memory used, bytes")
    mem_total_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="GPU memory total, bytes")
    temperature_c: float | None = Field(None, ge=-50, le=200, description="GPU temperature, degrees Celsius")
    power_w: float | None = Field(None, ge=0, le=5000, description="power draw, watts")
    power_limit_w: float | None = Field(None, gt=0, le=5000, description="enforced power limit, watts (NVML "
                                        "nvmlDeviceGetEnforcedPowerLimit); bounds the energy believed per tick")
    energy_j: float | None = Field(None, ge=0, description="cumulative energy since driver load, joules (NVML counter)")
    pcie_tx_bytes_per_s: float | None = Field(None, ge=0, description="PCIe transmit throughput, bytes per second")
    pcie_rx_bytes_per_s: float | None = Field(None, ge=0, description="PCIe receive throughput, bytes per second")
    nvlink_tx_bytes_per_s: float | None = Field(None, ge=0, description="NVLink transmit throughput, bytes per second")
    nvlink_rx_bytes_per_s: float | None = Field(None, ge=0, description="NVLink receive throughput, bytes per second")
    sm_clock_mhz: float | None = Field(None, ge=0, description="SM clock, MHz")
    mem_clock_mhz: float | None = Field(None, ge=0, description="memory clock, MHz")
    throttle_reasons: int | None = Field(None, ge=0, description="NVML clocks-event (throttle) reasons bitmask")
    ecc_sbe_total: int | None = Field(None, ge=0, description="corrected (single-bit) ECC errors, volatile count")
    ecc_dbe_total: int | None = Field(None, ge=0, description="uncorrected (double-bit) ECC errors, volatile count")
    xid_errors: list[int] = Field(default_factory=list, description="Xid error codes seen since the previous tick")
    processes: list[ProcessSample] = Field(default_factory=list, description="processes/containers using the GPU")
    mig_devices: list[MigDevice] = Field(default_factory=list, description="MIG instances of this GPU (empty when MIG is off)")
    # Identity for the GPU's ID card (docs/gpu-cards.md): read once per GPU at agent start; None where
    # the GPU or driver cannot tell (NOT_SUPPORTED) and from agents that predate these fields.
    serial: str | None = Field(None, max_length=128, description="board serial number (NVML nvmlDeviceGetSerial)")
    board_part_number: str | None = Field(None, max_length=128, description="board part number (NVML "
                                          "nvmlDeviceGetBoardPartNumber); with the serial prefix, the vendor batch")
    vbios_version: str | None = Field(None, max_length=128, description="VBIOS version (NVML nvmlDeviceGetVbiosVersion)")


class NodeTick(_Wire):
    """Line 1 — one node's whole tick: every GPU on it, each with its processes.

    Kafka key: the node name. Topic: `<prefix>gpu-samples`."""

    schema_version: Literal[1] = SCHEMA_VERSION
    cluster: ClusterId = Field(description="cluster name")
    node: NodeId = Field(description="node (host) name")
    ts_ms: EpochMs = Field(description="sample time, Unix epoch milliseconds; the tick covers [ts_ms, ts_ms + interval_ms)")
    interval_ms: int = Field(gt=0, le=3_600_000, description="sampling interval, milliseconds (default 5000)")
    gpus: list[GpuSample] = Field(description="every GPU on the node")


class NodeTickBatch(_Wire):
    """Line 1, batched — several consecutive ticks of one node in one message.

    Same topic and key as `NodeTick` (the node name); a reader accepts either. An agent sending
    one message every N ticks (`GPULEDGER_AGENT_TICKS_PER_MESSAGE`) costs the brokers and workers
    one message instead of N: per-message overhead, not bytes, limits a stream worker."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["tick_batch"] = "tick_batch"
    node: NodeId = Field(description="node (host) name; every tick must be of this node")
    ticks: list[NodeTick] = Field(min_length=1, max_length=10_000, description="the node's ticks, oldest first")


# --------------------------------------------------------------------------- line 1, as metered
# The worker's view of line 1: the fields the accounting uses, with exactly the constraints of
# the full models above (taken from them, not restated), other per-GPU and per-process fields
# ignored. The worker validates what it meters; the sink validates whole NodeTicks for the
# health record (gpu_health) and sets aside the ones that break the schema there.
def _same_fields(model: type[BaseModel], *names: str) -> dict:
    return {name: (model.model_fields[name].annotation, model.model_fields[name]) for name in names}


_METERED = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

MeteredProcess = create_model(
    "MeteredProcess", __config__=_METERED, __module__=__name__,
    __doc__="A process of line 1 as the worker reads it: its container and measured use.",
    **_same_fields(ProcessSample, "container_id", "sm_util_pct", "mem_used_bytes"))

MeteredGpu = create_model(
    "MeteredGpu", __config__=_METERED, __module__=__name__,
    __doc__="A GpuSample as the worker reads it: identity, health, utilization, memory, power, energy.",
    **_same_fields(GpuSample, "gpu_uuid", "model", "health", "util_gpu_pct", "sm_active_pct", "mem_used_bytes",
                   "mem_total_bytes", "power_w", "energy_j", "mig_devices", "power_limit_w"),
    # the index maps a scheduler's device index to the UUID; optional only for worker snapshots
    # written before it was metered
    index=(int | None, Field(None, ge=0)),
    processes=(list[MeteredProcess], Field(default_factory=list)))

MeteredTick = create_model(
    "MeteredTick", __config__=ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False), __module__=__name__,
    __doc__="A NodeTick as the worker reads it (every tick-level field; GPUs as MeteredGpu).",
    **_same_fields(NodeTick, "schema_version", "cluster", "node", "ts_ms", "interval_ms"),
    gpus=(list[MeteredGpu], NodeTick.model_fields["gpus"]))

MeteredTickBatch = create_model(
    "MeteredTickBatch", __config__=ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False), __module__=__name__,
    __doc__="A NodeTickBatch as the worker reads it.",
    **_same_fields(NodeTickBatch, "schema_version", "type", "node"),
    ticks=(list[MeteredTick], NodeTickBatch.model_fields["ticks"]))


# --------------------------------------------------------------------------- line 2
class JobEventKind(StrEnum):
    submitted = "submitted"
    queued = "queued"
    allocated = "allocated"          # GPUs now held by the attempt (not yet running)
    started = "started"              # running on its GPUs
    checkpoint_begin = "checkpoint_begin"
    checkpoint_end = "checkpoint_end"
    interrupted = "interrupted"      # stopped running but still holds its GPUs (hung, waiting for peers)
    preempted = "preempted"          # GPUs taken away by the scheduler; attempt ends
    failed = "failed"                # attempt ends in failure
    retried = "retried"              # a new attempt is queued (attempt = the new attempt number)
    completed = "completed"
    cancelled = "cancelled"


#: Event kinds that end an attempt and release its GPUs.
TERMINAL_KINDS = frozenset({JobEventKind.preempted, JobEventKind.failed, JobEventKind.completed, JobEventKind.cancelled})


class GpuAssignment(_Wire):
    """One GPU (or a share of it) given to an attempt. Name it by UUID (a GPU's, or a MIG instance's),
    or by its device index on the node when the scheduler knows only that (Slurm's `IDX:0-3`): the
    worker maps an index to the UUID the node's GPU agent reports at that index."""

    node: NodeId = Field(description="node holding the GPU")
    gpu_uuid: _ident(MAX_DEVICE_ID_LEN) | None = Field(None, description="GPU UUID, or a MIG instance's UUID (then the share is at most the instance's)")
    gpu_index: int | None = Field(None, ge=0, description="device index on the node (NVML index), when the UUID is not known to the scheduler")
    share_milli: ShareMilli = 1000
    container_id: str | None = Field(None, max_length=MAX_DEVICE_ID_LEN, description="the job's container on this GPU, to match per-process samples "
                                                        "(Slurm jobs: 'slurm-job-<id>', as the GPU agent reads it from the cgroup path)")

    @model_validator(mode="after")
    def _named(self) -> "GpuAssignment":
        if self.gpu_uuid is None and self.gpu_index is None:
            raise ValueError("a GPU assignment needs gpu_uuid or gpu_index")
        return self

    @property
    def ref(self) -> str:
        """How the assignment names its GPU before the worker resolves it: the UUID, or '<node>#<index>'."""
        return self.gpu_uuid if self.gpu_uuid is not None else f"{self.node}#{self.gpu_index}"


class JobEvent(_Wire):
    """Line 2 — one job lifecycle event. Kafka key: the canonical job id. Topic: `<prefix>job-events`."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["job_event"] = "job_event"
    event_id: str = Field(min_length=1, max_length=1024, description="unique id of this event; duplicates are dropped")
    ts_ms: EpochMs = Field(description="when it happened, Unix epoch milliseconds")
    kind: JobEventKind
    cluster: ClusterId
    job_id: JobId = Field(description="canonical job id (the scheduler's)")
    attempt: int = Field(0, ge=0, description="attempt number, 0 for the first run")
    tenant: TenantId
    queue: QueueId
    priority: int = Field(0, description="scheduling priority; higher runs first")
    requested_gpus: float = Field(0.0, ge=0, description="GPUs the job asked for (fractions for shared GPUs)")
    gpus: list[GpuAssignment] = Field(default_factory=list, description="GPUs involved (for 'allocated': the allocation)")
    aliases: dict[str, str] = Field(default_factory=dict, description="other ids of the job: container_id, task_name, ...")
    reason: str | None = Field(None, description="free text: failure reason, preempting job, ...")


class LifecycleWatermark(_Wire):
    """Promise from the scheduler adapter: every lifecycle event with ts_ms < this ts_ms has been
    published to this partition. Emitted periodically (default every 10 s of event time) to every
    partition of the job-events topic; lets workers close intervals deterministically."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["watermark"] = "watermark"
    cluster: ClusterId
    ts_ms: EpochMs


LifecycleMessage = Annotated[Union[JobEvent, LifecycleWatermark], Field(discriminator="type")]


# --------------------------------------------------------------------------- line 3
class PendingByPriority(_Wire):
    priority: int
    jobs: int = Field(ge=0)
    gpus: float = Field(ge=0, description="GPUs requested by the waiting jobs")


class QueueState(_Wire):
    queue: QueueId
    priority: int = Field(0, description="queue priority; higher is served first")
    quota_gpus: float = Field(ge=0, description="GPU quota of the queue")
    allocated_gpus: float = Field(ge=0, description="GPUs allocated to the queue's jobs now")
    pending_jobs: int = Field(ge=0)
    pending_gpus: float = Field(ge=0, description="GPUs requested by waiting jobs")
    pending_by_priority: list[PendingByPriority] = Field(default_factory=list)


class PreemptionFired(_Wire):
    job_id: JobId
    by_job_id: JobId | None = None
    queue: QueueId
    rule: str = Field(description="the preemption rule that fired")


class SchedulerSnapshot(_Wire):
    """Line 3 — periodic snapshot of the scheduler's queues. Kafka key: cluster. Topic: `<prefix>scheduler-snapshots`."""

    schema_version: Literal[1] = SCHEMA_VERSION
    cluster: ClusterId
    ts_ms: EpochMs
    queues: list[QueueState]
    preemptions: list[PreemptionFired] = Field(default_factory=list, description="preemptions fired since the last snapshot")


# --------------------------------------------------------------------------- ledger output
class UsageState(StrEnum):
    down = "down"
    unallocated = "unallocated"
    allocated_idle = "allocated_idle"   # held by a job that is not running on it
    executing = "executing"


class UsageRecord(_Wire):
    """One slice of one GPU's time: [start_ms, end_ms) × share, in one state, for at most one job.

    A record is a *segment*: the stretch of consecutive samples in which the GPU's holders and
    states stayed the same, cut at the ledger's aligned window (`[segments]`, default 60 s;
    docs/accounting.md "Segments"). A GPU's segments tile its reported time: for every GPU and
    segment the records' gpu_ms add up to the segment's duration (conservation), and their
    cost_micros to the GPU's cost for it (the sum of its samples' costs, to the micro-unit)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    record_id: str = Field(description="deterministic id: gpu_uuid/start_ms/slot; replays produce the same ids")
    cluster: str
    node: str
    gpu_uuid: str
    gpu_model: str
    start_ms: EpochMs
    end_ms: EpochMs
    state: UsageState
    job_id: str = Field("", description="canonical job id; empty for down/unallocated")
    attempt: int = 0
    tenant: str = ""
    queue: str = ""
    share_milli: int = Field(ge=0, le=1000, description="share of the GPU this slice covers, thousandths")
    gpu_ms: int = Field(ge=0, description="GPU-milliseconds: duration × share")
    util_pct: float | None = Field(None, description="measured hardware utilization of this slice, percent: the holder's SM share if measured, else SM activity or GPU busy")
    util_metric_pct: float | None = Field(None, description="utilization under the agreed definition, percent: util_pct for 'mean'; 100 or 0 (at/above the threshold or not) for 'above_threshold'; reports average it over gpu_ms")
    mem_used_bytes: int | None = Field(None, ge=0, description="GPU memory the holder used (or the whole GPU for unattributed slices)")
    energy_j: float = Field(0.0, ge=0, description="this slice's part of the GPU's energy over the interval, joules")
    coefficient: float = Field(gt=0, description="throughput coefficient of the GPU model against the baseline card")
    coefficient_version: str = Field(description="id of the coefficient-library entry used")
    effective_gpu_ms: int = Field(ge=0, description="gpu_ms × coefficient, rounded")
    cost_micros: int = Field(ge=0, description="this slice's cost, micro-units of currency")
    definition_version: str = Field(description="version of the accounting definitions used")
    price_version: str = Field("", description="id of the price-history entry used, MODEL@valid_from ('default@...' "
                                               "for a model without a price of its own); empty in records made before")
    priced_by_default: bool = Field(False, description="the GPU model has no price or no coefficient of its own: "
                                                       "priced under the ledger's [unpriced] policy (docs/accounting.md)")
    sample_count: int = Field(1, ge=1, description="samples (ticks) the segment covers; utilization and memory are "
                                                   "their gpu_ms-weighted means, energy and cost their sums (1 in "
                                                   "records made before segments)")


class UsageBatch(_Wire):
    """What the worker emits for one node when it closes ticks (one or more). Kafka key: node. Topic: `<prefix>usage`."""

    schema_version: Literal[1] = SCHEMA_VERSION
    node: str
    records: list[UsageRecord]


class DeadLetter(_Wire):
    """A message the ledger could not use. Topic: `<prefix>dead-letters`."""

    schema_version: Literal[1] = SCHEMA_VERSION
    source_topic: str
    partition: int
    offset: int
    reason: str
    original: str = Field(description="original message bytes, decoded as UTF-8 with replacement (bytes that are "
                                      "not UTF-8: exactly in original_hex); cut when the whole would not fit "
                                      "the dead-letter topic (then original_size is set)")
    seen_ms: EpochMs = Field(description="when the ledger rejected it (wall clock)")
    original_size: int | None = Field(None, ge=0, description="size in bytes of the original message, set only "
                                      "when `original` holds a cut prefix of it")
    original_sha256: str | None = Field(None, description="SHA-256 (hex) of the whole original message, set with "
                                        "original_size or original_hex")
    original_hex: str | None = Field(None, description="the original message bytes exactly, in hex, set only when "
                                     "they are not valid UTF-8 (`original` then holds them with replacement "
                                     "characters); a cut prefix when original_size is set")


# --------------------------------------------------------------------------- internal
class AllocationChange(_Wire):
    """Internal (topic `<prefix>node-allocations`, key: node): a lifecycle event re-keyed by node,
    carrying the attempt's GPUs on that node, so a node's samples and allocations meet in one partition."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["alloc"] = "alloc"
    ts_ms: EpochMs
    event_id: str
    kind: JobEventKind
    node: str
    job_id: str
    attempt: int = 0
    tenant: str
    queue: str
    gpus: list[GpuAssignment] = Field(description="the attempt's GPUs on this node")
    #: two clusters may both have a node001: the node is (cluster, node). "": written by a worker from
    #: before changes carried it (its node join is found by name, streams/core.py `_change_node`)
    cluster: str = Field("", description="the job's cluster (empty: written before changes carried it)")


class NodeWatermark(_Wire):
    """Internal (topic `<prefix>node-allocations`, sent to every partition): job-events partition
    `source_partition` (of `source_partitions`) is complete below ts_ms."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["watermark"] = "watermark"
    ts_ms: EpochMs
    source_partition: int = Field(ge=0)
    source_partitions: int = Field(ge=1)


NodeAllocationMessage = Annotated[Union[AllocationChange, NodeWatermark], Field(discriminator="type")]


# --------------------------------------------------------------------------- closed bills
class BillRow(_Wire):
    """One line of a closed bill, or one adjustment, as a close run wrote it (docs/accounting.md §6a).
    Topic: `<prefix>bills`, key: tenant. A run's rows share `bill_run_id`; a consumer that sees a
    run twice (the run was published again) can drop rows by (bill_run_id, kind, day, corrects_day,
    cluster, tenant, queue, line, reason, definition_version). Closed rows never change; corrections
    come as `adjustment` rows booked on a later open day."""

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: Literal["closed", "adjustment"] = Field(description="closed: a line of a closed day's bill; adjustment: a correction of a closed day booked on `day`")
    bill_run_id: str = Field(min_length=1, description="the close run that wrote the row")
    day: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$", description="UTC day (YYYY-MM-DD): the closed day, or the open day an adjustment is booked on")
    cluster: str
    tenant: str
    queue: str
    line: Literal["compute", "idle", "failed_retry"] = Field(description="bill line (docs/accounting.md §6)")
    definition_version: str
    gpu_ms: int = Field(description="GPU-milliseconds (negative only in adjustments)")
    effective_gpu_ms: int = Field(description="effective GPU-milliseconds (negative only in adjustments)")
    cost_micros: int = Field(description="cost in micro-units of `currency` (negative only in adjustments)")
    currency: str = Field(min_length=1, description="ISO 4217 currency of cost_micros (the ledger config's `currency`)")
    corrects_day: str | None = Field(None, pattern=r"^\d{4}-\d{2}-\d{2}$", description="adjustment: the closed UTC day it corrects")
    reason: Literal["late_lifecycle_outcome", "late_samples"] | None = Field(None, description="adjustment: why (an outcome known after the close moved time between compute and failed_retry; usage arrived after the close)")


#: Every model exported as a JSON Schema file (schemas/json/<name>.json).
EXPORTED_MODELS: dict[str, type[BaseModel]] = {
    "node_tick": NodeTick,
    "node_tick_batch": NodeTickBatch,
    "job_event": JobEvent,
    "lifecycle_watermark": LifecycleWatermark,
    "scheduler_snapshot": SchedulerSnapshot,
    "usage_record": UsageRecord,
    "usage_batch": UsageBatch,
    "dead_letter": DeadLetter,
    "allocation_change": AllocationChange,
    "node_watermark": NodeWatermark,
    "bill_row": BillRow,
}


# --------------------------------------------------------------------------- alerts and reclaim suggestions
class Alert(_Wire):
    """A behaviour alert on one job attempt (docs/alerts.md). Topic: `<prefix>alerts`, key: job_id.
    Published when it opens and again, with the same alert_id, when it closes; a consumer keeps the
    latest message per alert_id. At most one alert per (job attempt, rule) is open at a time."""

    schema_version: Literal[1] = SCHEMA_VERSION
    alert_id: str = Field(min_length=1, description="deterministic id: hash of cluster/job_id/attempt/rule/opened_at_ms")
    rule: Literal["util_drop", "low_util", "straggler", "hung", "gpu_down"]
    definition_version: str = Field(description="'<[alerts] version>/<rule>.v<n>': the rule's parameters and logic")
    cluster: str
    job_id: str
    attempt: int = Field(ge=0)
    tenant: str
    queue: str
    gpus: list[str] = Field(description="GPU UUIDs concerned (straggler: the lagging GPU; gpu_down: the GPU that went down)")
    status: Literal["open", "closed"]
    opened_at_ms: EpochMs = Field(description="event time at which the shape was seen")
    closed_at_ms: EpochMs | None = Field(None, description="event time it recovered or the job ended; null while open")
    window_start_ms: EpochMs = Field(description="start of the usage window the rule looked at")
    window_end_ms: EpochMs = Field(description="end of that window (for a closed alert: of the window that closed it)")
    message: str = Field(description="a short human sentence")


class SuggestedJob(_Wire):
    """A job a reclaim suggestion names, least productive first."""

    job_id: str
    attempt: int = Field(ge=0)
    tenant: str
    gpus: list[str] = Field(description="GPU UUIDs the job holds")
    gpus_freed: float = Field(ge=0, description="GPUs its release frees (shares of GPUs add up)")
    execution_rate: float = Field(ge=0, le=1, description="its executing / allocated GPU-time over the window")
    idle_cost_micros: int = Field(ge=0, description="cost of its allocated-but-not-executing time so far, micros")


class WaitingDemand(_Wire):
    """Higher-priority work waiting in the scheduler (its latest snapshot)."""

    gpus: float = Field(ge=0, description="GPUs the waiting jobs request")
    jobs: int = Field(ge=0)
    priority: int = Field(description="the highest priority among them")
    queues: list[str] = Field(description="queues they wait in")
    snapshot_ms: EpochMs = Field(description="time of the scheduler snapshot it comes from")


class ReclaimSuggestion(_Wire):
    """A reclaim suggestion for one queue (docs/alerts.md, "Reclaim"). Topic: `<prefix>reclaim-suggestions`,
    key: queue. Published when it opens and again, with the same suggestion_id, when it is withdrawn."""

    schema_version: Literal[1] = SCHEMA_VERSION
    suggestion_id: str = Field(min_length=1, description="deterministic id: hash of cluster/queue/opened_at_ms")
    definition_version: str = Field(description="'<[reclaim] version>/reclaim.v<n>': its parameters and logic")
    cluster: str
    queue: str
    status: Literal["open", "withdrawn"]
    opened_at_ms: EpochMs
    withdrawn_at_ms: EpochMs | None = Field(None, description="event time the condition cleared; null while open")
    execution_rate: float = Field(ge=0, le=1, description="the queue's executing / allocated GPU-time over the window, at opening")
    window_ms: int = Field(gt=0, description="length of the rolling window")
    jobs: list[SuggestedJob] = Field(description="jobs to reclaim, least productive first (none in its first minutes)")
    gpus_freed: float = Field(ge=0)
    waiting_demand: WaitingDemand
    idle_cost_micros: int = Field(ge=0, description="idle cost of the named jobs so far, micros")
    currency: str
    message: str


EXPORTED_MODELS["alert"] = Alert
EXPORTED_MODELS["reclaim_suggestion"] = ReclaimSuggestion


# --------------------------------------------------------------------------- line 4 (optional): training signals
#: largest step, sample or token count a job may report (an Int64 column holds it with room for sums)
MAX_PROGRESS_COUNT = 2**62


class RankProgress(_Wire):
    """One rank's share of a progress report (distributed jobs): its own step time."""

    rank: int = Field(ge=0, le=1_000_000)
    step_time_ms: float = Field(gt=0, le=86_400_000, description="this rank's mean step time since the last report, ms")


class JobProgress(_Wire):
    """Line 4 (optional): a training job's own progress (docs/planning.md, "Training signals"). Topic:
    `<prefix>job-progress`, key: the canonical job id. Counts are cumulative for the attempt; rates and
    step time are the job's own measurement since its previous report (gpuledger/progress.py computes
    them from the counts when the loop gives none)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["job_progress"] = "job_progress"
    ts_ms: EpochMs = Field(description="when the step was reached, Unix epoch milliseconds")
    cluster: ClusterId | None = Field(None, description="the job's cluster, where the loop knows it")
    job_id: JobId = Field(description="canonical job id (the scheduler's), as in the lifecycle events")
    attempt: int = Field(0, ge=0)
    step: int = Field(ge=0, le=MAX_PROGRESS_COUNT, description="optimizer steps done in this attempt")
    samples: int | None = Field(None, ge=0, le=MAX_PROGRESS_COUNT, description="samples processed so far")
    tokens: int | None = Field(None, ge=0, le=MAX_PROGRESS_COUNT, description="tokens processed so far")
    epoch: float | None = Field(None, ge=0, le=1e9, description="epochs done so far, fractional (step 500 of 1000 per epoch: 0.5)")
    samples_per_s: float | None = Field(None, ge=0, le=1e12)
    tokens_per_s: float | None = Field(None, ge=0, le=1e15)
    step_time_ms: float | None = Field(None, gt=0, le=86_400_000, description="mean step time since the last report, ms")
    loss: float | None = Field(None, ge=-1e12, le=1e12)
    ranks: list[RankProgress] = Field(default_factory=list, max_length=100_000,
                                      description="per-rank step times, where the job reports them")


class ApprovalDecision(_Wire):
    """A pilot-run estimate awaiting approval, or the decision on it (docs/planning.md, "Approvals").
    Topic: `<prefix>approvals`, key: "<cluster>/<job id>" (job ids are per cluster); one message per status
    change, so a scheduler admission hook of cluster C can admit job J once the latest message under key
    "C/J" says `approved` (and its `cluster` is C). A message without a cluster (older ones) admits no job."""

    schema_version: Literal[1] = SCHEMA_VERSION
    type: Literal["approval"] = "approval"
    approval_id: str = Field(min_length=1, max_length=128)
    cluster: str = Field("", max_length=MAX_CLUSTER_LEN,
                         description="the job's cluster ('' in messages sent before approvals named one)")
    job_id: JobId
    attempt: int = Field(0, ge=0, description="the pilot attempt the estimate was priced from (not the run to admit)")
    status: Literal["pending", "approved", "rejected"]
    ts_ms: EpochMs = Field(description="when this status was recorded")
    by: str = Field("", max_length=256, description="who decided ('' while pending)")
    note: str = Field("", max_length=4096)
    target: str = Field(description="the full run asked for, e.g. 'steps=100000'")
    cost_micros: int = Field(ge=0, description="the estimate's central cost, micros of the currency")
    cost_high_micros: int = Field(ge=0, description="the upper end of its interval, micros")
    threshold_micros: int = Field(ge=0, description="the approval threshold it was above")
    currency: str
    gpu_hours: float = Field(ge=0)
    wall_hours: float = Field(ge=0)


EXPORTED_MODELS["job_progress"] = JobProgress
EXPORTED_MODELS["approval_decision"] = ApprovalDecision
