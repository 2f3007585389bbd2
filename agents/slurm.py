"""Slurm → ledger: the pure core of the Slurm agent (no subprocess, no Kafka, no clock reads).

Why one file: one pure state machine from squeue/sinfo/sacct to events; the rules below share the
per-job state and are read together with docs/slurm.md.

Input: the parsed output of `squeue --json --states=all` and `sinfo --json` (Slurm 22.05,
openapi v0.0.38; the number objects of 23.02's v0.0.39 are read too, and the list-valued job_state of 23.11 on,
with `scontrol show nodes --json` for the nodes: recorded fixtures of 23.02, 23.11, 24.11, 25.05, 25.11 and 26.05,
`*_v2302_*` … `*_v2605_*`), optionally `sacct -P` rows
for jobs that left squeue and a lookup of the allocations PrologSlurmctld recorded (the agent reads the
files), and the agent's state from the previous poll. Output: `JobEvent`s, one `LifecycleWatermark`, a `SchedulerSnapshot`
and the next state. `agents/slurm_agent.py` does the I/O around it.

Rules (docs/slurm.md explains each):
- Event time is Slurm's own (submit_time, start_time, end_time; epoch seconds → ms), never the
  poll time, so the ledger's allocated GPU-seconds equal sacct's `gres/gpu × (Elapsed + Suspended)`.
- Canonical job id: the Slurm job id, or `<array_job_id>_<array_task_id>` for an array task.
- Attempt: Slurm's restart count. A requeue (by an admin or by preemption) ends the attempt at the
  requeue time (Slurm resets submit_time to it) with `preempted`, then `retried` opens the next
  (only `retried` for a job requeued after it finished: its attempt has its outcome). Requeued more
  than once between two polls, or first seen at a restart count above 0 after an earlier poll: the
  attempts in between come from sacct (`PollResult.needs_sacct`).
- Suspend (`scontrol suspend`): `interrupted`, and `started` at the resume; a suspend and resume both
  between two polls from Slurm's pre_sus_time (`_unseen_suspension`). The GPUs stay allocated. A job
  killed while suspended ends, for Slurm, at the suspend: once a poll has seen it suspended, its end is
  the watermark instead (`_end_not_below`).
- A resize (`scontrol update NumNodes=`; sacct's RESIZING row) is no new attempt: a second
  `allocated` of the same attempt with the GPUs it keeps, at the resize time.
- GPU indices not seen (a job that ran between polls, or while the agent was down): the attempt
  gets the GPUs recorded at its allocation by deploy/slurm/gpuledger-prolog-slurmctld where that
  runs (`RecordedAllocation`, for this attempt, on these nodes, allocated at its start), else every
  GPU of its nodes only when its GPU count equals their GPU count in sinfo (it held whole nodes);
  part of a node gets none, never a guess at which indices (`whole_node_detail`).
- Event ids are deterministic (`slurm:<cluster>:<job>:<attempt>:<kind>`): a restarted agent that
  emits an event again produces a duplicate the ledger drops.
- Watermark: the second the poll started (Slurm stamps events with the controller's clock when it
  handles them, so anything not yet visible will carry a later time), less a clock-skew margin,
  and never past the end_time of a job still COMPLETING (its outcome, stamped end_time, comes later),
  nor past the previous watermark while a job that left squeue waits for sacct.
- A job whose squeue record cannot be read is skipped with a warning, never taken for gone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

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

STATE_VERSION = 1
#: The ledger stores priority as Int32; Slurm's is uint32 (priority/basic hands out ~4.29e9).
PRIORITY_MAX = 2**31 - 1
#: Slurm's "no array task" marker (NO_VAL) where a number is given instead of null.
NO_VAL = 4294967294

PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
#: Holding GPUs: RUNNING, and the flag-states Slurm reports instead of RUNNING while a job is
#: being set up, suspended, or stopping (COMPLETING: ended, outcome not known yet).
HOLDING_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING",
                            "COMPLETING"})
#: Holding states in which gres_detail may not list the GPUs yet (or any more): the allocation waits.
TRANSITIONAL_STATES = frozenset({"CONFIGURING", "COMPLETING"})
#: Final states: the ledger's kind and reason for each (reason None: taken from the exit code).
FINAL_STATES: dict[str, tuple[JobEventKind, str | None]] = {
    "COMPLETED": (JobEventKind.completed, None),
    "FAILED": (JobEventKind.failed, None),
    "CANCELLED": (JobEventKind.cancelled, None),
    "TIMEOUT": (JobEventKind.failed, "timeout"),
    "NODE_FAIL": (JobEventKind.failed, "node_fail"),
    "BOOT_FAIL": (JobEventKind.failed, "boot_fail"),
    "OUT_OF_MEMORY": (JobEventKind.failed, "out_of_memory"),
    "DEADLINE": (JobEventKind.failed, "deadline"),
    "PREEMPTED": (JobEventKind.preempted, "preempted"),  # PreemptMode=CANCEL: the job ends here
}


class SlurmInputError(ValueError):
    """squeue/sinfo/sacct output the agent cannot use; the message says what and where."""


# --------------------------------------------------------------------------- small parsers
def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist → names, as `scontrol show hostnames`: 'gpu[01-03,07],cpu1' →
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu1']; zero padding kept; several bracket groups
    ('r[1-2]n[01-02]') give the cross product."""
    expr = (expr or "").strip()
    if not expr or expr in ("(null)", "None"):
        return []
    names: list[str] = []
    for part in _split_top_level(expr):
        names.extend(_expand_one(part))
    return names


def _split_top_level(expr: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmInputError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SlurmInputError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if m is None:
        return [part]
    head, tail = part[:m.start()], part[m.end():]
    out: list[str] = []
    for item in m.group(1).split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise SlurmInputError(f"bad range {item!r} in hostlist {part!r}")
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif item:
            values = [item]
        else:
            raise SlurmInputError(f"empty item in hostlist {part!r}")
        for v in values:
            out.extend(_expand_one(head + v + tail))
    return out


def expand_index_list(text: str) -> list[int]:
    """'0-2,5' → [0, 1, 2, 5] (GPU indices in Slurm's IDX notation)."""
    out: list[int] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmInputError(f"bad GPU index {item!r} in {text!r}")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


_GRES_DETAIL = re.compile(r"gpu(?::[^:(]+)?:(\d+)\(IDX:([^)]*)\)")


def gpu_indices(gres_detail_entry: str) -> list[int]:
    """GPU indices in one node's gres_detail entry: 'gpu:a100:3(IDX:0-2)' → [0, 1, 2];
    several GRES on a node ('gpu:a100:1(IDX:0),gpu:v100:1(IDX:4)') are all read; non-GPU GRES
    and 'IDX:N/A' are ignored."""
    out: list[int] = []
    for m in _GRES_DETAIL.finditer(gres_detail_entry or ""):
        if m.group(2) and m.group(2) != "N/A":
            out.extend(expand_index_list(m.group(2)))
    return out


#: GRES that give a job a part of a GPU: Slurm's shards (--gres=shard:K) and CUDA MPS (--gres=mps:K)
GPU_PART_GRES = ("shard", "mps")
_PART_DETAIL = re.compile(r"\b(shard|mps)(?::[^:(]+)?:(\d+)\(([^)]*)\)")


def gpu_parts(gres_detail_entry: str, parts_per_gpu: Mapping[str, int] | None = None) -> list[tuple[int, int]]:
    """(GPU index, share in thousandths) of the parts of GPUs (shards, MPS) in one node's gres_detail entry.
    23.11 on write every GPU's parts as used/total in index order: 'shard:2(2/4,0/4,…)' → [(0, 500)],
    'mps:50(50/100,…)' → [(0, 500)]. 22.05 writes the GPU's index only, 'shard:2(IDX:0)': its total is
    `parts_per_gpu[kind]` (the node's over its GPUs, `NodeGpus.parts_per_gpu`), and without it the share
    is not known (none). Shares are rounded down, so a GPU's holders never add up to more than all of it."""
    out: list[tuple[int, int]] = []
    for m in _PART_DETAIL.finditer(gres_detail_entry or ""):
        kind, count, inner = m.group(1), int(m.group(2)), m.group(3)
        if inner.startswith("IDX:"):
            indices = [] if inner[4:] == "N/A" else expand_index_list(inner[4:])
            per_gpu = (parts_per_gpu or {}).get(kind)
            if indices and per_gpu:  # several GPUs: the job's parts taken as spread evenly
                share = min(1000, 1000 * count // (len(indices) * per_gpu))
                out.extend((i, share) for i in indices if share > 0)
            continue
        for index, part in enumerate(inner.split(",")):
            used, _, total = part.partition("/")
            if used.isdigit() and total.isdigit() and int(used) > 0 and int(total) > 0:
                out.append((index, min(1000, 1000 * int(used) // int(total))))
    return out


def _has_gpu_parts(gres_detail_entry: str) -> bool:
    return "shard" in gres_detail_entry or "mps" in gres_detail_entry


def _gres_fields(gres: str) -> list[list[str]]:
    """A node's `gres` string as fields per GRES: 'gpu:a100:8(S:0,2),shard:32' → [['gpu', 'a100', '8'],
    ['shard', '32']]. Socket lists hold commas of their own: every (...) is dropped before splitting."""
    return [item.split(":") for item in _split_top_level(re.sub(r"\([^)]*\)", "", gres or ""))]


def gpu_count(gres: str) -> int:
    """GPUs in a node's `gres` string: 'gpu:a100:8' → 8; 'gpu:4,gpu:t4:2(S:0)' → 6; 'gpu' → 1;
    'gpu:a100:8(S:0,2)' → 8."""
    return sum(int(f[-1]) if len(f) > 1 and f[-1].isdigit() else 1 for f in _gres_fields(gres) if f[0] == "gpu")


def tres_gpus(tres: str, name: str = "gpu") -> float:
    """GPUs in a TRES string: 'cpu=4,node=2,gres/gpu=4' → 4.0 (typed 'gres/gpu:a100=4' counted
    only when no untyped total is given). `name`: another GRES counted the same way ('shard', 'mps')."""
    total, typed = None, 0.0
    for item in (tres or "").split(","):
        key, _, value = item.partition("=")
        try:
            n = float(value)
        except ValueError:
            continue
        if key == f"gres/{name}":
            total = n
        elif key.startswith(f"gres/{name}:"):
            typed += n
    return total if total is not None else typed


def task_request_gpus(tres_per_task: str, name: str = "gpu") -> float:
    """GPUs each task asked for (`--gpus-per-task`): 'gres:gpu:2' (22.05) and 'gres/gpu:2', 'cpu:2,gres/gpu:1',
    'gres/gpu:a100:1' (23.11) as `gres_request_gpus`; 'gres/gpu=2', 'cpu=2,gres/gpu=1' or 'gres/gpu:a100=1' (24.11
    on write it as a TRES string) as `tres_gpus`."""
    return tres_gpus(tres_per_task, name) if "=" in tres_per_task else gres_request_gpus(tres_per_task, name)


def gres_request_gpus(gres: str, name: str = "gpu") -> float:
    """GPUs in a job's tres_per_node / tres_per_job: 'gres:gpu:2' (22.05), 'gres/gpu:2' (24.11),
    'gres/gpu:a100:2'; a type or nothing without a count is one ('gres/gpu:a100', 'gres/gpu'); other
    GRES ('gres/shard:4') and counts it cannot read ('gres/gpu:1K') count none. `name`: another GRES
    counted the same way ('gres:shard:2' → 2 with name='shard')."""
    total = 0.0
    for item in (gres or "").split(","):
        fields = item.strip().replace("gres/", "gres:", 1).split(":")
        if fields[:2] != ["gres", name]:
            continue
        if len(fields) == 2 or (len(fields) == 3 and not fields[2][:1].isdigit()):
            total += 1.0
        elif fields[-1].isdigit():
            total += float(fields[-1])
    return total


def decode_exit_code(raw: int | None) -> tuple[int | None, int | None]:
    """squeue's exit_code is a raw wait status: (exit status, signal). 768 → (3, None); 15 → (None, 15)."""
    if raw is None or raw < 0:
        return None, None
    signal = raw & 0x7F
    if signal:
        return None, signal
    return (raw >> 8) & 0xFF, None


def describe_exit(raw: int | None) -> str | None:
    code, signal = decode_exit_code(raw)
    if signal is not None:
        return f"signal {signal}"
    if code is not None:
        return f"exit {code}"
    return None


def parse_partition_lines(text: str) -> dict[str, dict[str, str]]:
    """`scontrol show partition --oneliner` → {partition: {key: value}} (PriorityTier, Nodes, ...)."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        pairs = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" in pairs:
            out[pairs["PartitionName"]] = pairs
    return out


def partition_tiers(text: str) -> dict[str, int]:
    """`scontrol show partition --oneliner` → {partition: PriorityTier}."""
    tiers = {}
    for name, kv in parse_partition_lines(text).items():
        try:
            tiers[name] = int(kv.get("PriorityTier", "0"))
        except ValueError:
            tiers[name] = 0
    return tiers


@dataclass(frozen=True)
class SacctRow:
    """One allocation line of `sacct -P --duplicates -X -o JobID,JobIDRaw,State,Start,End,ExitCode,...`
    (epoch seconds already converted by the caller; None: Unknown)."""

    job_id: str          # canonical (sacct prints array tasks as 3_1, like the ledger)
    raw_id: str
    state: str           # first word: 'CANCELLED by 0' → 'CANCELLED'
    start_s: int | None
    end_s: int | None
    exit_code: str       # 'code:signal'
    account: str = ""
    partition: str = ""
    nodes: str = ""      # NodeList (a hostlist); "" not asked or none
    alloc_tres: str = ""  # AllocTRES ('billing=8,cpu=8,gres/gpu=8,node=1'); "" not asked or none
    submit_s: int | None = None  # Submit (asked for jobs never seen: `recover_unseen`); None not asked or Unknown
    req_tres: str = ""   # ReqTRES, likewise


# --------------------------------------------------------------------------- state
#: polls a requeue waits for squeue's submit_time to move to the requeue time (see _translate_job)
REQUEUE_WAIT_POLLS = 10


@dataclass
class JobState:
    """What the agent has already published about one job (by canonical id)."""

    raw_id: int
    submitted: bool = False
    attempt: int = 0                 # the attempt the events below refer to
    allocated: bool = False          # allocated + started emitted for `attempt`
    alloc_start_ms: int = 0          # the time of the attempt's latest `allocated` (a resize moves it)
    nodes: list[str] = field(default_factory=list)   # of the allocated attempt
    #: squeue's gres_detail of that allocation (one entry per node of `nodes`): its GPUs, to see a resize;
    #: None: not known (a state file from before it was kept)
    gres_detail: tuple[str, ...] | None = None
    allocations: int = 0             # `allocated` events of `attempt` (a resize adds one)
    ended: bool = False              # the attempt's end emitted
    finished: bool = False           # the job's final outcome emitted
    queue: str = ""
    tenant: str = ""
    queued_events: int = 0           # queued events of `attempt` (the reason changed in between)
    queued_reason: str = ""          # the pending reason of the last one
    requeue_wait_polls: int = 0      # polls a requeue has waited for Slurm's new submit_time
    requeue_seen_ms: int = 0         # the poll that first saw the restart count of a requeue not told yet
    #: sacct's rows submitted before this are another job's that had the same id (`_own_rows`); 0: not known
    first_submit_ms: int = 0
    suspended: bool = False          # `interrupted` emitted for a suspend of `attempt`, not resumed yet
    suspensions: int = 0             # suspends of `attempt` seen (event ids …:interrupted:N, …:started:N+1)
    #: the attempt's suspended time, as Slurm counts it, that events have covered (`_slurm_suspended_ms`); None:
    #: not known (a state file from before it was kept, with suspends seen): no unseen suspend is inferred then
    suspended_ms: int | None = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobState:
        js = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        if "suspended_ms" not in d and js.suspensions:
            js.suspended_ms = None
        if js.gres_detail is not None:
            js.gres_detail = tuple(str(g) for g in js.gres_detail)
        return js


def _job_state_copy(js: JobState) -> JobState:
    out = JobState.__new__(JobState)
    out.__dict__.update(js.__dict__)
    out.nodes = list(js.nodes)
    return out


@dataclass
class AgentState:
    """Persisted between polls (and agent restarts): per-job progress, the last watermark, and
    preemptions seen since the last snapshot."""

    jobs: dict[str, JobState] = field(default_factory=dict)
    watermark_ms: int = 0
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    polled_ms: int = 0        # when the last poll that was published started (0: none yet)
    #: polls stopped from this time (agent down or failing) long enough for jobs to come and go unseen: the ones
    #: sacct has since then are still to recover (`recover_unseen`); 0: none
    recover_from_ms: int = 0
    recover_polls: int = 0    # polls that found jobs to recover unfinished in sacct (`recover_unseen`), in a row
    recover_waiting: list[str] = field(default_factory=list)  # those jobs: the only ones the next poll recovers

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "watermark_ms": self.watermark_ms, "preemptions": self.preemptions,
                "polled_ms": self.polled_ms, "recover_from_ms": self.recover_from_ms,
                "recover_polls": self.recover_polls, "recover_waiting": self.recover_waiting,
                "jobs": {k: v.to_json() for k, v in sorted(self.jobs.items())}}

    def copy(self) -> AgentState:
        """A copy a poll can change while this one stays as it was (a poll that fails publishes
        nothing and leaves the state alone). The same as `copy.deepcopy`: a JobState's fields are
        immutable but its node list (tests/unit/test_slurm.py checks it), a preemption is a dict of
        plain values. deepcopy took 0.3 s a poll at 15,600 tracked jobs (a 100,000-GPU cluster)."""
        return AgentState(jobs={k: _job_state_copy(v) for k, v in self.jobs.items()}, watermark_ms=self.watermark_ms,
                          preemptions=[dict(p) for p in self.preemptions], polled_ms=self.polled_ms,
                          recover_from_ms=self.recover_from_ms, recover_polls=self.recover_polls,
                          recover_waiting=list(self.recover_waiting))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AgentState:
        if d.get("version") != STATE_VERSION:
            raise SlurmInputError(f"state file version {d.get('version')!r}, expected {STATE_VERSION}")
        return cls(jobs={k: JobState.from_json(v) for k, v in d.get("jobs", {}).items()},
                   watermark_ms=int(d.get("watermark_ms", 0)), preemptions=list(d.get("preemptions", [])),
                   polled_ms=int(d.get("polled_ms", 0)), recover_from_ms=int(d.get("recover_from_ms", 0)),
                   recover_polls=int(d.get("recover_polls", 0)),
                   recover_waiting=[str(j) for j in d.get("recover_waiting", [])])


@dataclass
class PollResult:
    events: list[JobEvent]
    watermark: LifecycleWatermark
    state: AgentState
    #: canonical ids of unfinished jobs that left squeue: ask sacct and call `close_vanished`
    vanished: list[str]
    warnings: list[str]
    #: the watermark published before this poll (`close_vanished` holds it there for jobs left open)
    promised_ms: int = 0
    #: canonical ids of jobs requeued more than once since the last poll, translated without sacct
    #: (their attempts in between only `retried`): ask sacct and translate again with `accounting`
    needs_sacct: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the job view
@dataclass(frozen=True)
class SlurmJob:
    """The fields of one squeue job record the agent uses, validated."""

    job_id: str
    raw_id: int
    array_job_id: int | None
    array_task_id: int | None
    state: str
    reason: str
    tenant: str
    queue: str
    priority: int
    requested_gpus: float
    attempt: int
    submit_ms: int
    start_ms: int
    end_ms: int
    nodes: list[str]
    gres_detail: list[str]
    exit_code: int | None
    raw_priority: int = 0
    sched_ms: int = 0                # last_sched_evaluation: when the pending reason was set
    resize_ms: int = 0               # resize_time: the last change of a running job's nodes
    suspend_ms: int = 0              # suspend_time: the last suspend or resume (`scontrol suspend/resume`)
    pre_sus_ms: int | None = None    # pre_sus_time: its run time before the last suspend (None: not in the record)
    alloc_gpus: float = 0.0          # the GPUs it was given: tres_alloc_str's, else its request's (0: not shown)
    asks_gpu_parts: bool = False     # it asked for parts of GPUs (--gres=shard:K, mps:K): no GPU count of its own
    #: the parts of GPUs it asked for in all, per kind ({'shard': 6.0}); `part_request_gpus` makes GPUs of them
    requested_parts: Mapping[str, float] = field(default_factory=dict)

    @property
    def aliases(self) -> dict[str, str]:
        a = {"slurm_job_id": str(self.raw_id), "container_id": f"slurm-job-{self.raw_id}"}
        if self.raw_priority != self.priority:
            a["slurm_priority"] = str(self.raw_priority)
        if self.array_task_id is not None:
            a["slurm_array_job_id"] = str(self.array_job_id)
            a["slurm_array_task_id"] = str(self.array_task_id)
        return a


def _number(v: Any, default: int | None, what: str) -> int | None:
    """A number as squeue writes it: plain (Slurm 22.05, openapi v0.0.38) or, from Slurm 23.02
    (v0.0.39) on, an object {"set": true, "infinite": false, "number": 1700000000}; unset or
    infinite → `default` (no time, no task)."""
    if isinstance(v, Mapping) and "number" in v:
        if v.get("set") is False or v.get("infinite") is True:
            return default
        v = v["number"]
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SlurmInputError(f"{what} is {v!r}, expected a number")
    return int(v)


def _int(job: Mapping[str, Any], key: str, default: int | None = 0) -> int | None:
    return _number(job.get(key, default), default, f"job {job.get('job_id')!r}: {key}")


def _exit_code(job: Mapping[str, Any]) -> int | None:
    """squeue's exit_code as a raw wait status: a number (v0.0.38/39) or, from v0.0.40 on, an object
    {"status": [...], "return_code": N, "signal": {"id": N, ...}} (N plain or a number object)."""
    v = job.get("exit_code")
    if not isinstance(v, Mapping) or "number" in v:
        return _int(job, "exit_code", None)
    what = f"job {job.get('job_id')!r}: exit_code"
    signal_info = v.get("signal")
    signal = _number(signal_info.get("id") if isinstance(signal_info, Mapping) else None, None, what + ".signal")
    if signal:
        return signal & 0x7F
    code = _number(v.get("return_code"), None, what + ".return_code")
    return None if code is None else (code & 0xFF) << 8


#: The flags that name a job's state over its base state, first match wins: Slurm's own order
#: (job_state_string, src/common/slurm_protocol_defs.c), which gave 22.05-23.02's one `job_state` string.
_NAMING_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                 "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING")


def _job_state(raw: int, v: Any) -> str:
    """squeue's job_state as one name: a string (Slurm 22.05-23.02), or from 23.11 (openapi v0.0.40) on
    a list of the base state and its flags (['RUNNING', 'CONFIGURING']), named as Slurm named it before:
    the first of `_NAMING_FLAGS` present, else the base state (other flags, e.g. UPDATE_DB, name nothing)."""
    if v is None or isinstance(v, str):
        return (v or "").upper()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SlurmInputError(f"job {raw}: job_state is {v!r}, expected a string or a list of strings")
    names = [x.upper() for x in v]
    named = [f for f in _NAMING_FLAGS if f in names]
    if named:
        return named[0]
    base = [n for n in names if n in PENDING_STATES | HOLDING_STATES | set(FINAL_STATES)]
    return base[0] if base else (names[0] if names else "")


def parse_job(job: Mapping[str, Any]) -> SlurmJob | None:
    """One squeue job record → SlurmJob; None for the pending remainder of an array
    ('3_[2-9]', not a task yet). Raises SlurmInputError for a record it cannot read."""
    if not isinstance(job, Mapping):
        raise SlurmInputError(f"a job record is {type(job).__name__}, expected an object")
    raw = _int(job, "job_id", None)
    if raw is None:
        raise SlurmInputError("a job record has no job_id")
    array_job = _int(job, "array_job_id", 0) or None
    array_task = _int(job, "array_task_id", None)
    if array_task == NO_VAL:
        array_task = None
    if array_task is None and array_job and job.get("array_task_string"):
        return None
    state = _job_state(raw, job.get("job_state"))
    if not state:
        raise SlurmInputError(f"job {raw}: no job_state")
    gres_detail = job.get("gres_detail") or []
    if not isinstance(gres_detail, list):
        raise SlurmInputError(f"job {raw}: gres_detail is {gres_detail!r}, expected a list")
    priority = _int(job, "priority", 0) or 0
    nodes = expand_hostlist(str(job.get("nodes") or ""))
    alloc, requested = _asked(job, nodes, "gpu")
    asks_parts = any(_has_gpu_parts(str(job.get(k) or "")) for k in ("tres_per_node", "tres_per_job", "tres_per_task"))
    # A job submitted to several partitions is listed with all of them while it waits ('prod,batch'),
    # with the one it runs in once it runs: a queue is one partition, so it waits in the first listed.
    queue = str(job.get("partition") or "").split(",")[0].strip() or "unknown"
    return SlurmJob(
        job_id=f"{array_job}_{array_task}" if array_task is not None and array_job else str(raw),
        raw_id=raw, array_job_id=array_job, array_task_id=array_task, state=state,
        reason=str(job.get("state_reason") or "None"),
        tenant=str(job.get("account") or "") or "unknown",
        queue=queue,
        priority=min(priority, PRIORITY_MAX), raw_priority=priority,
        requested_gpus=requested,
        attempt=_int(job, "restart_cnt", 0) or 0,
        submit_ms=(_int(job, "submit_time") or 0) * 1000,
        start_ms=(_int(job, "start_time") or 0) * 1000,
        end_ms=(_int(job, "end_time") or 0) * 1000,
        nodes=nodes,
        gres_detail=[str(g) for g in gres_detail],
        exit_code=_exit_code(job),
        sched_ms=(_int(job, "last_sched_evaluation") or 0) * 1000,
        resize_ms=(_int(job, "resize_time") or 0) * 1000,
        suspend_ms=(_int(job, "suspend_time") or 0) * 1000,
        pre_sus_ms=None if (pre_sus := _int(job, "pre_sus_time", None)) is None else pre_sus * 1000,
        alloc_gpus=alloc,
        asks_gpu_parts=asks_parts,
        requested_parts={kind: n for kind in GPU_PART_GRES if (n := _asked(job, nodes, kind)[1])} if asks_parts else {},
    )


def _asked(job: Mapping[str, Any], nodes: list[str], name: str) -> tuple[float, float]:
    """(given, asked for) of one GRES of a squeue job record ('gpu', 'shard', 'mps'): TRES strings carry it
    only where accounting tracks it (AccountingStorageTRES=gres/gpu); else the request, which a job that
    runs gets exactly: --gpus per job, --gres per node (× the job's nodes), --gpus-per-task (× its tasks,
    the total however they were asked: -n, --ntasks-per-node)."""
    per_node = gres_request_gpus(str(job.get("tres_per_node") or ""), name)
    per_job = gres_request_gpus(str(job.get("tres_per_job") or ""), name)
    per_task = task_request_gpus(str(job.get("tres_per_task") or ""), name)
    tasks = (_int(job, "tasks", 1) or 1) if per_task else 0  # tasks read only where they count
    per_tasks = per_task * tasks if tasks < NO_VAL else 0.0
    given = tres_gpus(str(job.get("tres_alloc_str") or ""), name) or per_job or per_node * len(nodes) or per_tasks
    asked = (tres_gpus(str(job.get("tres_req_str") or ""), name) or given
             or per_node * (_int(job, "node_count", 1) or 1) or per_tasks)
    return given, asked


@dataclass
class SqueueJobs:
    """What parse_jobs read: the jobs, a warning per record skipped, and who those records were."""

    jobs: list[SlurmJob]
    warnings: list[str]
    #: raw job ids of the records that could not be read: those jobs are still there, not gone
    unreadable_ids: set[int] = field(default_factory=set)
    #: a skipped record whose job id could not be read either: any tracked job may be that one
    unreadable_unknown: bool = False


def parse_jobs(squeue: Any) -> SqueueJobs:
    """squeue JSON → jobs, and a warning for each record skipped (a bad record never stops the rest).
    Raises SlurmInputError when there are records and none of them can be read (a squeue format
    this parser does not know: skipping them all would make every job look gone)."""
    if not isinstance(squeue, Mapping) or not isinstance(squeue.get("jobs"), list):
        raise SlurmInputError("squeue output has no 'jobs' list (is this `squeue --json` of Slurm 22.05+?)")
    if squeue.get("errors"):
        raise SlurmInputError(f"squeue reported errors: {squeue['errors']!r}")
    out = SqueueJobs([], [])
    records = squeue["jobs"]
    for record in records:
        try:
            job = parse_job(record)
        except SlurmInputError as exc:
            out.warnings.append(f"skipped a job record: {exc}")
            raw_id = _record_raw_id(record)
            if raw_id is None:
                out.unreadable_unknown = True
            else:
                out.unreadable_ids.add(raw_id)
            continue
        if job is not None:
            out.jobs.append(job)
    if out.warnings and not out.jobs:
        raise SlurmInputError(f"none of the {len(out.warnings)} job records in squeue's output could be read, "
                              f"e.g. {out.warnings[0].removeprefix('skipped a job record: ')}")
    return out


def _record_raw_id(record: Any) -> int | None:
    """The job id of a record parse_job rejected, if at least that can be read."""
    try:
        return _number(record.get("job_id"), None, "job_id") if isinstance(record, Mapping) else None
    except SlurmInputError:
        return None


def _holdings(job: SlurmJob, node_gpus: Mapping[str, int] | None) -> Iterator[tuple[str, list[int], list[tuple[int, int]]]]:
    """Per node of a running job (gres_detail has one entry per node of the node list, in order): the
    GPUs it holds whole, and the (index, share in thousandths) of those it holds parts of (`gpu_parts`;
    `node_gpus`' parts per GPU for 22.05's)."""
    per_gpu = getattr(node_gpus, "parts_per_gpu", {})
    for node, detail in zip(job.nodes, job.gres_detail):
        yield node, gpu_indices(detail), gpu_parts(detail, per_gpu.get(node)) if _has_gpu_parts(detail) else []


def job_gpus(job: SlurmJob, node_gpus: Mapping[str, int] | None = None) -> list[GpuAssignment]:
    """The GPUs a running job holds (`_holdings`), as its allocation names them."""
    container = f"slurm-job-{job.raw_id}"
    out = []
    for node, whole, parts in _holdings(job, node_gpus):
        out += [GpuAssignment(node=node, gpu_index=i, share_milli=1000, container_id=container) for i in whole]
        out += [GpuAssignment(node=node, gpu_index=i, share_milli=share, container_id=container) for i, share in parts]
    return out


class NodeGpus(dict[str, int]):
    """GPUs per node name (sinfo's `gres`), and per node since when that count holds (`since_ms`: the
    later of its boot and its slurmd's start, when slurmd reads gres.conf; 0 if not shown), the
    parts (shards, MPS) of each of its GPUs where they divide evenly among them (`parts_per_gpu`), and
    the partitions it is in (`partitions`)."""

    def __init__(self, counts: Mapping[str, int] | None = None, since_ms: Mapping[str, int] | None = None,
                 parts_per_gpu: Mapping[str, Mapping[str, int]] | None = None,
                 partitions: Mapping[str, Iterable[str]] | None = None):
        super().__init__(counts or {})
        self.since_ms: dict[str, int] = dict(since_ms or {})
        self.parts_per_gpu: dict[str, dict[str, int]] = {n: dict(v) for n, v in (parts_per_gpu or {}).items()}
        self.partitions: dict[str, tuple[str, ...]] = {n: tuple(v) for n, v in (partitions or {}).items()}


def part_request_gpus(job: SlurmJob, node_gpus: Mapping[str, int] | None) -> float:
    """The GPUs a request for parts of GPUs (`SlurmJob.requested_parts`: --gres=shard:K, mps:K) amounts to:
    K over the parts per GPU of the nodes it runs on, or while it waits (no nodes yet) of its partition's
    nodes, as their GPUs over their parts of that kind (exact where every such node has as many per GPU;
    a mean where they differ). 0 for a kind no such node is known to have (a node whose parts do not
    divide evenly among its GPUs has none known: `node_gpu_counts`)."""
    per_gpu = getattr(node_gpus, "parts_per_gpu", {})
    if not job.requested_parts or not per_gpu:
        return 0.0
    partitions = getattr(node_gpus, "partitions", {})
    nodes = dict.fromkeys(job.nodes or [n for n, names in partitions.items() if job.queue in names])
    total = 0.0
    for kind, count in job.requested_parts.items():
        having = [n for n in nodes if per_gpu.get(n, {}).get(kind) and node_gpus.get(n)]
        parts = sum(node_gpus[n] * per_gpu[n][kind] for n in having)
        if parts:
            total += count * sum(node_gpus[n] for n in having) / parts
    return round(total, 6)


def _part_counts(gres: str) -> dict[str, int]:
    """Parts of GPUs in a node's `gres`: 'gpu:a100:8,shard:a100:32' → {'shard': 32}; 'mps:800' → {'mps': 800}."""
    out: dict[str, int] = {}
    for f in _gres_fields(gres):
        if f[0] in GPU_PART_GRES and len(f) > 1 and f[-1].isdigit():
            out[f[0]] = out.get(f[0], 0) + int(f[-1])
    return out


def _whole_gpu_count(gres: str) -> int | None:
    """GPUs in a node's `gres` when they can be told exactly for whole-node inference: 'gpu:a100:8(S:0-1)'
    → 8, 'gpu:a100:4,gpu:v100:2' → 6, 'gpu:a100:8,shard:32' → 8, '(null)' → 0. None when a GPU entry has
    no plain count ('gpu', 'gpu:a100', '1K') or is no_consume (shared by every job on the node)."""
    total = 0
    for fields in _gres_fields(gres):
        if fields[0] != "gpu":
            continue
        if len(fields) < 2 or not fields[-1].isdigit() or "no_consume" in fields:
            return None
        total += int(fields[-1])
    return total


def node_gpu_counts(sinfo: Any) -> NodeGpus:
    """`sinfo --json` → GPUs per node name (its `gres`: 'gpu:a100:8' → 8) and since when (`NodeGpus`);
    empty when not given. A node whose GPUs cannot be told exactly (`_whole_gpu_count`), whose times
    cannot be read, or that is listed twice with different GPUs is left out: not known, never inferred."""
    out = NodeGpus()
    if sinfo is None:
        return out
    if not isinstance(sinfo, Mapping) or not isinstance(sinfo.get("nodes"), list):
        raise SlurmInputError("sinfo output has no 'nodes' list (is this `sinfo --json` of Slurm 22.05+?)")
    doubtful: set[str] = set()
    for node in sinfo["nodes"]:
        if not isinstance(node, Mapping) or not node.get("name"):
            continue
        name = str(node["name"])
        count = _whole_gpu_count(str(node.get("gres") or ""))
        try:
            since_s = max(_number(node.get(k), 0, f"sinfo node {name!r}: {k}") or 0
                          for k in ("boot_time", "slurmd_start_time"))
        except SlurmInputError:
            count = None
        if count is None or out.get(name, count) != count:
            doubtful.add(name)
            continue
        out[name] = count
        out.since_ms[name] = max(out.since_ms.get(name, 0), since_s * 1000)
        listed = node.get("partitions")
        if isinstance(listed, list):  # a node listed twice (once per partition, as sinfo may): all of them
            out.partitions[name] = tuple(dict.fromkeys([*out.partitions.get(name, ()), *map(str, listed)]))
        parts = {kind: n // count for kind, n in _part_counts(str(node.get("gres") or "")).items()
                 if count and n and n % count == 0}
        if parts:
            out.parts_per_gpu[name] = parts
    for name in doubtful:
        out.pop(name, None)
        out.since_ms.pop(name, None)
        out.parts_per_gpu.pop(name, None)
        out.partitions.pop(name, None)
    return out


# --------------------------------------------------------------------------- allocations recorded by PrologSlurmctld
#: how far a recorded allocation's time may lie from the attempt's start_time and still be its own: the record is
#: written as the job is allocated (before its start_time is final: PrologSlurmctld runs while it is CONFIGURING);
#: one farther off is another job's that had the same id (a controller whose state was reset counts from 1 again)
RECORDED_ALLOCATION_SLACK_MS = 60_000

_RECORD_NODE_LINE = re.compile(r"^[ \t]*Nodes=(\S+)[ \t](.*)$", re.M)


@dataclass(frozen=True)
class RecordedAllocation:
    """The GPUs of one attempt as deploy/slurm/gpuledger-prolog-slurmctld recorded them when Slurm allocated it
    (`allocated_at=` then `scontrol show job -d`): for an attempt whose GPU indices no poll saw."""

    raw_id: int
    attempt: int          # Slurm's restart count (`Restarts=`)
    allocated_ms: int
    nodes: list[str]
    gres_detail: list[str]  # one per node of `nodes`, as squeue's gres_detail (`gpu:a100:3(IDX:2-4)`)


#: looks up the record of (raw job id, attempt); None: none
AllocationLookup = Callable[[int, int], RecordedAllocation | None]


def parse_recorded_allocation(text: str, raw_id: int | None = None) -> RecordedAllocation:
    """A record written by deploy/slurm/gpuledger-prolog-slurmctld: `allocated_at=<epoch s>`, then `scontrol
    show job -d` (its StartTime the allocation's time when in epoch seconds), whose per-node lines (`Nodes=gpu01 CPU_IDs=1 Mem=0 GRES=gpu:a100:3(IDX:2-4)`; nodes alike
    grouped as `Nodes=gpu[01-02]`) give the GPUs. For an array task whose job id is its array's (`3_1` is job
    3), scontrol lists every task of the array: the block of `raw_id` is read (default: the first). Raises
    SlurmInputError for anything else."""
    at = re.search(r"^allocated_at=(\d+)[ \t]*$", text, re.M)
    blocks = re.split(r"^(?=JobId=)", text, flags=re.M)[1:]
    if raw_id is not None:
        blocks = [b for b in blocks if re.match(rf"JobId={raw_id}\b", b)]
    block = blocks[0] if blocks else ""
    job = re.match(r"JobId=(\d+)\b", block)
    restarts = re.search(r"\bRestarts=(\d+)\b", block)
    if not (at and job and restarts):
        raise SlurmInputError("not a PrologSlurmctld record" + (f" of job {raw_id}" if raw_id is not None else "")
                              + ": allocated_at=, JobId= and Restarts= expected")
    nodes: list[str] = []
    detail: list[str] = []
    for hosts, rest in _RECORD_NODE_LINE.findall(block):
        gres = re.search(r"\bGRES=(\S*)", rest)
        for node in expand_hostlist(hosts):
            nodes.append(node)
            detail.append(gres[1] if gres else "")
    # the script asks with SLURM_TIME_FORMAT=%s: StartTime is Slurm's start_time in epoch seconds, the time its
    # events carry (allocated_at, the script's clock, is a second off at times); a local time: allocated_at
    start = re.search(r"\bStartTime=(\d+)(?=\s)", block)
    return RecordedAllocation(int(job[1]), int(restarts[1]), int((start or at)[1]) * 1000, nodes, detail)


def whole_node_detail(nodes: list[str], gpus: float, node_gpus: Mapping[str, int],
                      started_ms: int | None = None) -> list[str] | None:
    """gres_detail entries (one per node, as squeue writes them) for an attempt whose GPU indices were
    never seen, when its GPU count shows that it held every GPU of each of its nodes: a job holds at
    most a node's GPUs on it, so a count equal to the sum of its nodes' GPUs (sinfo) is all of them,
    indices 0..N-1 of each. None when it held part of a node or a node is not known: which indices
    it had is then not known, and never guessed. With `started_ms` (the attempt's start), None too
    when a node booted or restarted its slurmd after it (`NodeGpus.since_ms`): its GPUs then may not
    be today's (gres.conf changed)."""
    if not nodes or gpus <= 0 or len(set(nodes)) != len(nodes) or any(n not in node_gpus for n in nodes):
        return None
    since = getattr(node_gpus, "since_ms", {})
    if started_ms is not None and any(since.get(n, 0) > started_ms for n in nodes):
        return None
    if gpus != sum(node_gpus[n] for n in nodes):
        return None
    return [f"gpu:{node_gpus[n]}(IDX:0-{node_gpus[n] - 1})" if node_gpus[n] > 0 else "" for n in nodes]


def _unseen_gpus(job: SlurmJob, nodes: list[str], gpus: float, source: str, out: _Emitter,
                 note: str, *, resized_ms: int = 0) -> tuple[SlurmJob, str]:
    """The job as an attempt whose GPU indices were not seen is allocated: on `nodes`, with every GPU
    of them when `gpus` (read from `source`) shows it held whole nodes (`whole_node_detail`), else
    with none; and the `allocated` reason that says which. `resized_ms` after its start: `nodes` and
    `gpus` are those after a resize (an expand adds another job's nodes), not those it started on."""
    if resized_ms > job.start_ms:
        return _with(job, nodes=nodes, gres_detail=[]), f"GPU indices not seen ({note}; resized since its start)"
    recorded = out.recorded_allocation(job, nodes)
    if recorded is not None:
        return (_with(job, nodes=recorded.nodes, gres_detail=recorded.gres_detail),
                f"GPU indices not seen ({note}); recorded at its allocation by PrologSlurmctld")
    detail = whole_node_detail(nodes, gpus, out.node_gpus, job.start_ms)
    if detail is None:
        return _with(job, nodes=nodes, gres_detail=[]), f"GPU indices not seen ({note})"
    held = len(_gpu_set(nodes, detail))
    return (_with(job, nodes=nodes, gres_detail=detail),
            f"GPU indices not seen ({note}); the job held all {held} GPUs of {', '.join(nodes)} "
            f"(whole nodes: {source} gres/gpu={held}, their GPUs in sinfo)")


# --------------------------------------------------------------------------- translation
class _Emitter:
    def __init__(self, cluster: str, state: AgentState, node_gpus: Mapping[str, int] | None = None,
                 recorded: AllocationLookup | None = None):
        self.cluster = cluster
        self.state = state
        #: GPUs per node (sinfo): what an attempt whose GPU indices were not seen may be given whole
        self.node_gpus: Mapping[str, int] = node_gpus or {}
        self.recorded = recorded
        self.events: list[JobEvent] = []
        self.warnings: list[str] = []
        self.needs_sacct: list[str] = []

    def recorded_allocation(self, job: SlurmJob, nodes: list[str]) -> RecordedAllocation | None:
        """The GPUs recorded at the allocation of `job`'s attempt on `nodes` (PrologSlurmctld), if a record is
        there and is this attempt's: same job id and restart count, the same nodes, allocated at its start (to
        within RECORDED_ALLOCATION_SLACK_MS) and naming GPUs. One that is not is left, with a warning."""
        rec = self.recorded(job.raw_id, job.attempt) if self.recorded is not None else None
        if rec is None:
            return None
        if (rec.raw_id, rec.attempt) != (job.raw_id, job.attempt) or sorted(rec.nodes) != sorted(nodes) \
                or abs(rec.allocated_ms - job.start_ms) > RECORDED_ALLOCATION_SLACK_MS:
            self.warnings.append(
                f"job {job.job_id}: the PrologSlurmctld record of job {rec.raw_id} restart {rec.attempt} (nodes "
                f"{','.join(rec.nodes) or '-'}, allocated at {rec.allocated_ms // 1000}) is not its attempt {job.attempt} "
                f"on {','.join(nodes) or '-'} started at {job.start_ms // 1000}: not used")
            return None
        if not job_gpus(_with(job, nodes=rec.nodes, gres_detail=rec.gres_detail), self.node_gpus):
            return None  # no GPU in it (a job that asked for none on that node): nothing to add
        return rec

    def emit(self, job: SlurmJob, kind: JobEventKind, ts_ms: int, *, attempt: int | None = None,
             gpus: list[GpuAssignment] | None = None, reason: str | None = None, suffix: str = "") -> None:
        attempt = job.attempt if attempt is None else attempt
        self.events.append(JobEvent(
            event_id=f"slurm:{self.cluster}:{job.job_id}:{attempt}:{kind.value}{suffix}",
            ts_ms=max(0, ts_ms), kind=kind, cluster=self.cluster, job_id=job.job_id, attempt=attempt,
            tenant=job.tenant, queue=job.queue, priority=job.priority,
            requested_gpus=job.requested_gpus or part_request_gpus(job, self.node_gpus),
            gpus=gpus or [], aliases=job.aliases, reason=reason))


#: how long after a requeue the job that preempted it may start: Slurm requeues the victim at once, and its GPUs
#: are free for the preemptor only once its processes have ended (KillWait, 30 s by default) and its node is
#: clean. Seen: the same second on 23.02, 24.11, 25.05, 25.11 and 26.05, 2 s later on 23.11 (tests/fixtures/slurm/*_preempted.json)
PREEMPTOR_START_WINDOW_MS = 40_000


def _preemptor(job: SlurmJob, js: JobState, at_ms: int, jobs: list[SlurmJob], tiers: Mapping[str, int]) -> SlurmJob | None:
    """The job that took `job`'s GPUs when it was requeued at `at_ms`: in a partition of higher PriorityTier
    (partition_prio preemption), on one of its nodes, submitted by then (to within a second) and started from a
    second before it to PREEMPTOR_START_WINDOW_MS after; the one that started closest to it. None: an admin
    requeue, or unknown (the preemptor had not started by this poll: see _preemptor_may_start)."""
    best: SlurmJob | None = None
    for other in _may_preempt(js, job, at_ms, jobs, tiers):
        if not other.nodes or not at_ms - 1000 <= other.start_ms <= at_ms + PREEMPTOR_START_WINDOW_MS:
            continue
        if set(other.nodes) & set(js.nodes):
            if best is None or abs(other.start_ms - at_ms) < abs(best.start_ms - at_ms):
                best = other
    return best


def _may_preempt(js: JobState, job: SlurmJob, at_ms: int, jobs: list[SlurmJob], tiers: Mapping[str, int]):
    """The other jobs that may have preempted `job` at `at_ms`: of a partition of higher PriorityTier, submitted
    by then (to within a second)."""
    tier = tiers.get(js.queue or job.queue, 0)
    return (other for other in jobs if other.job_id != job.job_id and other.submit_ms <= at_ms + 1000
            and tiers.get(other.queue, 0) > tier)


def _preemptor_may_start(js: JobState, job: SlurmJob, at_ms: int, jobs: list[SlurmJob], tiers: Mapping[str, int],
                         poll_ms: int) -> bool:
    """Whether `job`'s preemptor may not have started yet at this poll: within PREEMPTOR_START_WINDOW_MS of its
    requeue at `at_ms`, a job of a higher PriorityTier submitted by then is still pending."""
    return poll_ms < at_ms + PREEMPTOR_START_WINDOW_MS and any(
        other.state in PENDING_STATES for other in _may_preempt(js, job, at_ms, jobs, tiers))


def translate(
    squeue: Any,
    state: AgentState,
    *,
    cluster: str,
    poll_started_ms: int,
    tiers: Mapping[str, int] | None = None,
    margin_ms: int = 1000,
    accounting: Mapping[str, list[SacctRow]] | None = None,
    node_gpus: Mapping[str, int] | None = None,
    recorded: AllocationLookup | None = None,
) -> PollResult:
    """One poll: squeue JSON + the previous state → events, the watermark, the next state.

    `poll_started_ms`: agent clock when squeue was started. `tiers`: PriorityTier by partition
    (to name the preempting job). `accounting`: sacct's rows (`--duplicates`) of the jobs in a
    previous result's `needs_sacct`, or None (not asked). `node_gpus`: GPUs per node
    (`node_gpu_counts` of sinfo), to give an attempt whose GPU indices were not seen the whole nodes
    it held. `recorded`: the allocations PrologSlurmctld recorded, looked up for such an attempt
    first (`RecordedAllocation`). Raises SlurmInputError only when the whole output is unusable; a bad job record is
    skipped with a warning."""
    tiers = tiers or {}
    state = state.copy()
    promised_ms = state.watermark_ms
    parsed = parse_jobs(squeue)
    jobs = parsed.jobs
    out = _Emitter(cluster, state, node_gpus, recorded)
    out.warnings.extend(parsed.warnings)
    seen: set[str] = set()
    hold_ms: list[int] = []   # end times of jobs still completing: the watermark stays below them
    for job in sorted(jobs, key=lambda j: (j.submit_ms, j.raw_id)):
        seen.add(job.job_id)
        try:
            _translate_job(job, state, out, jobs, tiers, hold_ms, promised_ms, accounting, poll_started_ms)
        except SlurmInputError as exc:
            out.warnings.append(f"job {job.job_id}: {exc}")
    # A job whose record could not be read this poll is still in squeue: not gone, not forgotten.
    if parsed.unreadable_unknown:
        gone = []
        if any(k not in seen for k in state.jobs):
            out.warnings.append("a skipped job record has no readable job_id: no job counts as gone this poll")
    else:
        gone = [k for k, js in state.jobs.items() if k not in seen and js.raw_id not in parsed.unreadable_ids]
    vanished = sorted(k for k in gone if not state.jobs[k].finished)
    # finished jobs that left squeue are forgotten: re-emitting one would only give duplicates
    for k in [k for k in gone if state.jobs[k].finished]:
        del state.jobs[k]
    mark = (poll_started_ms // 1000) * 1000 - margin_ms
    if hold_ms:
        mark = min(mark, min(hold_ms))
    if mark < state.watermark_ms:
        mark = state.watermark_ms  # a watermark never goes back
    state.watermark_ms = max(0, mark)
    late = [e for e in out.events if e.ts_ms < promised_ms]
    if late:
        out.warnings.append(f"{len(late)} event(s) older than the watermark (agent restart or a slow poll): "
                            "the worker applies them as late events")
    return PollResult(out.events, LifecycleWatermark(cluster=cluster, ts_ms=state.watermark_ms), state,
                      vanished, out.warnings, promised_ms, out.needs_sacct)


def _own_rows(js: JobState, rows: list[SacctRow] | None) -> list[SacctRow] | None:
    """sacct's rows of this job: `sacct -j N --duplicates` lists every job that ever had id N, so a row
    submitted well before the job's first submission is another job's (the id reused: MaxJobId wraps,
    67,043,328 by default; a controller whose state was reset counts from 1 again). Its attempts were
    taken for this job's: a finished job closed from sacct was billed no GPU time, with a phantom requeue."""
    if not rows or not js.first_submit_ms:
        return rows
    floor = js.first_submit_ms - RECORDED_ALLOCATION_SLACK_MS
    return [r for r in rows if r.submit_s is None or r.submit_s * 1000 >= floor]


def _requeue_end_ms(rows: list[SacctRow] | None, js: JobState) -> int | None:
    """When sacct's row of attempt `js.attempt` says it was requeued (its End), or None: not in the rows."""
    groups = _attempt_groups(rows) if rows else []
    if js.attempt < len(groups):
        row = groups[js.attempt][-1]
        if row.state in ("REQUEUED", "PREEMPTED") and row.end_s:
            return row.end_s * 1000
    return None


def _first_submit_ms(job: SlurmJob, rows: list[SacctRow] | None, out: _Emitter) -> int:
    """When a job first seen at a restart count above 0 was submitted: sacct's Submit of its first attempt (a
    requeue moves the job's submit_time, not that row's); else by its first attempt's recorded allocation
    (PrologSlurmctld), so that `submitted` comes before it; else squeue's submit_time (the last requeue)."""
    if rows and rows[0].submit_s:
        return rows[0].submit_s * 1000
    rec = out.recorded(job.raw_id, 0) if out.recorded is not None else None
    if rec is not None and (rec.raw_id, rec.attempt) == (job.raw_id, 0):
        return min(job.submit_ms, rec.allocated_ms)
    return job.submit_ms


def _pending_reason(job: SlurmJob) -> str | None:
    """squeue's state_reason; None while the scheduler has not looked at the job yet ('None')."""
    return None if job.reason in ("None", "") else job.reason


def _translate_job(job: SlurmJob, state: AgentState, out: _Emitter, jobs: list[SlurmJob],
                   tiers: Mapping[str, int], hold_ms: list[int], promised_ms: int,
                   accounting: Mapping[str, list[SacctRow]] | None, poll_ms: int) -> None:
    js = state.jobs.get(job.job_id)
    if js is None:
        # First seen at a restart count above 0 after an earlier poll: submitted since then, its earlier attempts
        # ran and were requeued between the two polls (the agent down, or a requeue right after the start). They
        # come from sacct's rows (and PrologSlurmctld records), as for a job requeued more than once. At the
        # agent's first poll ever they are from before the ledger, and are not replayed.
        first = 0 if job.attempt and state.polled_ms else job.attempt
        # its first submission: squeue's submit_time at attempt 0; submitted after the last poll when first
        # seen requeued then (at the first poll ever, attempts before are not replayed: not needed)
        first_submit_ms = job.submit_ms if job.attempt == 0 else state.polled_ms if first == 0 else 0
        js = state.jobs[job.job_id] = JobState(raw_id=job.raw_id, attempt=first, queue=job.queue,
                                               tenant=job.tenant, first_submit_ms=first_submit_ms)
    if js.finished and job.attempt <= js.attempt:
        return
    rows = _own_rows(js, accounting.get(job.job_id)) if accounting is not None else None
    unseen_attempts = not js.submitted and job.attempt > js.attempt
    if not js.submitted:
        if unseen_attempts:  # submitted for attempt 0, at its submission (squeue's submit_time is the last requeue's)
            out.emit(job, JobEventKind.submitted, _first_submit_ms(job, rows, out), attempt=js.attempt)
        else:
            out.emit(job, JobEventKind.submitted, job.submit_ms)
            if job.state in PENDING_STATES:
                out.emit(job, JobEventKind.queued, job.submit_ms, reason=_pending_reason(job))
                js.queued_events, js.queued_reason = 1, _pending_reason(job) or ""
        js.submitted = True

    if job.attempt > js.attempt + 1 or unseen_attempts:
        # Requeued more than once since the last poll (the agent was down), or attempts no poll saw: submit_time
        # is the last requeue's, so the attempts in between come from sacct's rows, as close_vanished reads them.
        if rows:
            _replay_requeues(job, js, state, out, _attempt_groups(rows), job.attempt,
                             "from sacct: submitted and requeued between two polls" if unseen_attempts
                             else "from sacct: requeued more than once between two polls")
        if accounting is None:
            out.needs_sacct.append(job.job_id)
        sacct = 'was not asked or failed' if accounting is None else 'has not all of its attempts'
        if job.attempt > js.attempt + 1:
            out.warnings.append(f"job {job.job_id} was requeued {job.attempt - js.attempt} times since the last poll "
                                f"and sacct {sacct}: the attempts in between only `retried`, attempt {js.attempt} "
                                "ends at the last requeue")
        elif unseen_attempts and job.attempt > js.attempt:
            out.warnings.append(f"job {job.job_id} was submitted, started and requeued since the last poll and sacct "
                                f"{sacct}: its attempt {js.attempt} only from a PrologSlurmctld record, else only `retried`")
    if job.attempt > js.attempt:
        # Requeued since the last poll (Slurm sets submit_time to the requeue time). squeue can show the
        # new restart count a moment before the new submit_time (seen: the old one, 4 s before the
        # requeue): then the requeue time is not known yet, so the job waits for the next poll and holds
        # the watermark; after REQUEUE_WAIT_POLLS the latest time already promised stands in for it.
        # A finished job can be requeued too (`scontrol requeue` of a COMPLETED/FAILED batch job,
        # RequeueExit): it reopens; its old attempt has its outcome already, so no `preempted`.
        if not js.allocated and job.attempt == js.attempt + 1:
            _allocate_recorded_attempt(job, js, out, promised_ms)
        # The requeue happened by the poll that first saw its restart count. squeue's new submit_time is
        # later still: Slurm sets it when the job's processes are gone (the COMPLETING phase: KillWait, 30 s
        # by default, for a job that traps SIGTERM to checkpoint, and the epilog; seen on 22.05). sacct's
        # row of the attempt ends at the requeue itself: asked once the job is seen requeued.
        js.requeue_seen_ms = js.requeue_seen_ms or poll_ms
        sacct_end_ms = _requeue_end_ms(rows, js)
        if sacct_end_ms is None and accounting is None and js.allocated and job.job_id not in out.needs_sacct:
            out.needs_sacct.append(job.job_id)
        old_submit = js.allocated and job.submit_ms <= js.alloc_start_ms
        stale = old_submit and sacct_end_ms is None
        if stale and js.requeue_wait_polls < REQUEUE_WAIT_POLLS:
            js.requeue_wait_polls += 1
            hold_ms.append(promised_ms)
            return
        bounds = (sacct_end_ms, None if old_submit else job.submit_ms, js.requeue_seen_ms)
        requeued_ms = max(min(t for t in bounds if t is not None), js.alloc_start_ms, promised_ms if stale else 0)
        js.requeue_wait_polls = 0
        by = None
        if js.allocated and not js.ended:
            by = _preemptor(job, js, requeued_ms, jobs, tiers)
            if by is None and _preemptor_may_start(js, job, requeued_ms, jobs, tiers, poll_ms):
                # a job of a higher tier waits: it may be the preemptor, still waiting for the victim's processes
                # to end. The requeue is told at a later poll (by PREEMPTOR_START_WINDOW_MS after it at most);
                # meanwhile the watermark stays at its time, so its events are not late.
                hold_ms.append(requeued_ms)
                return
        js.requeue_seen_ms = 0
        _requeue(job, js, state, out, requeued_ms=requeued_ms, retried_ms=max(job.submit_ms, requeued_ms),
                 new_attempt=job.attempt,
                 reason=f"requeued to reclaim resources for job {by.job_id}" if by else "requeued",
                 by_job_id=by.job_id if by else None, rule="partition_prio/requeue" if by else "requeue")

    reason = _pending_reason(job)
    if job.state in PENDING_STATES and reason and reason != js.queued_reason:
        # Why it waits changed (None → Resources → Priority, BeginTime after a requeue): at the
        # scheduler's evaluation that set it, never before what the last watermark promised.
        js.queued_events += 1
        out.emit(job, JobEventKind.queued, max(job.sched_ms, job.submit_ms, promised_ms), reason=reason,
                 suffix="" if js.queued_events == 1 else f":{js.queued_events}")
        js.queued_reason = reason

    ran = bool(job.nodes) and job.start_ms > 0
    if job.state in HOLDING_STATES and not js.allocated:
        gpus = job_gpus(job, out.node_gpus)
        asks = job.requested_gpus or job.asks_gpu_parts
        if not gpus and asks and job.state in TRANSITIONAL_STATES:
            # GPU indices not shown in this state: wait for RUNNING (or the end), and keep the
            # watermark below the start the allocation will carry
            hold_ms.append(job.start_ms)
        else:
            reason = None
            if not gpus and asks:
                recorded = out.recorded_allocation(job, job.nodes)
                if recorded is not None:  # the GPUs PrologSlurmctld recorded at its allocation
                    job = _with(job, nodes=recorded.nodes, gres_detail=recorded.gres_detail)
                    gpus = job_gpus(job, out.node_gpus)
                    reason = "GPU indices not in gres_detail; recorded at its allocation by PrologSlurmctld"
                else:
                    out.warnings.append(f"job {job.job_id} is {job.state} without GPU indices in gres_detail")
                    reason = "GPU indices not in gres_detail"
            _allocate(job, js, out, gpus, reason)
    elif job.state in HOLDING_STATES and job.state not in TRANSITIONAL_STATES and not js.ended:
        _resized(job, js, out, promised_ms)
    if job.state in HOLDING_STATES and js.allocated and not js.ended:
        _suspend_or_resume(job, js, out, promised_ms)
    if (job.state == "COMPLETING" or job.state in FINAL_STATES) and js.allocated and not js.ended \
            and job.nodes and job.resize_ms > js.alloc_start_ms:
        # shrunk and ended between two polls: squeue lists an ended job's nodes, no GPUs any more
        _keep_nodes(job, js, out, set(job.nodes), job.resize_ms, f"resized to {','.join(job.nodes)} (seen ended)")
    if job.state == "COMPLETING":
        hold_ms.append(job.end_ms)
        return
    if job.state in FINAL_STATES:
        if ran and not js.allocated:
            if job.requested_gpus or job.asks_gpu_parts:
                # squeue shows an ended job's nodes and GPU count, no indices: a PrologSlurmctld record or whole
                # nodes can still tell them (parts of GPUs only from a record)
                seen, note = _unseen_gpus(job, job.nodes, job.alloc_gpus or job.requested_gpus, "squeue's", out,
                                          "the job ran between polls", resized_ms=job.resize_ms)
                _allocate(seen, js, out, job_gpus(seen, out.node_gpus), note)
            else:
                _allocate(job, js, out, [], None)
        if ran and js.allocated and not js.ended and not js.suspended:
            _unseen_suspension(job, js, out, promised_ms)  # suspended and resumed since the last poll, then ended
        kind, reason = FINAL_STATES[job.state]
        exit_text = describe_exit(job.exit_code)
        if reason is None:
            reason = exit_text if job.state != "COMPLETED" else None
        elif exit_text and job.state != "PREEMPTED":
            reason = f"{reason} ({exit_text})"
        if ran:
            end_ms, reason = _end_not_below(js, max(job.end_ms, js.alloc_start_ms), reason, promised_ms,
                                            "a poll saw it suspended")
        else:
            end_ms = job.end_ms
        out.emit(job, kind, end_ms, reason=reason)
        if kind == JobEventKind.preempted:
            state.preemptions.append(PreemptionFired(job_id=job.job_id, queue=job.queue,
                                                     rule="partition_prio/cancel").model_dump(mode="json"))
        js.ended = js.finished = True


def _requeue(job: SlurmJob, js: JobState, state: AgentState, out: _Emitter, *, requeued_ms: int, retried_ms: int,
             new_attempt: int, reason: str, by_job_id: str | None, rule: str) -> None:
    """A requeue of `js.attempt` (seen live, or in sacct after the agent was down): `preempted` for it
    at `requeued_ms` if it held GPUs, `retried` for each attempt up to `new_attempt` at `retried_ms`
    (Slurm's requeue time), and js moved to the new attempt, not allocated yet."""
    if js.allocated and not js.ended:
        out.emit(job, JobEventKind.preempted, requeued_ms, attempt=js.attempt, reason=reason)
        state.preemptions.append(PreemptionFired(job_id=job.job_id, by_job_id=by_job_id, queue=js.queue or job.queue,
                                                 rule=rule).model_dump(mode="json"))
    for attempt in range(js.attempt + 1, new_attempt + 1):
        out.emit(job, JobEventKind.retried, retried_ms, attempt=attempt, reason="requeued by Slurm")
    js.attempt, js.allocated, js.ended, js.nodes, js.alloc_start_ms = new_attempt, False, False, [], 0
    js.gres_detail, js.allocations = (), 0
    js.finished = False  # a finished job requeued runs again
    js.queued_events, js.queued_reason = 0, ""  # `retried` queued it; reasons follow


def _end_not_below(js: JobState, end_ms: int, reason: str | None, promised_ms: int,
                   seen: str) -> tuple[int, str | None]:
    """The end (time, reason) of an allocated attempt. slurmctld dates the end of a job killed while suspended at
    the suspend (end_time = suspend_time; sacct's End too) although it kept its GPUs allocated until then
    (GresUsed); once `seen` suspended, the watermark has passed that time. The ledger then ends it at the
    watermark, the latest time it is known to have held them: never an event below a watermark already published
    (the worker would apply it late, or reject it once the suspend is more than its retention back)."""
    if not (js.suspended and js.allocated and end_ms < promised_ms):
        return end_ms, reason
    note = f"ended while suspended: Slurm dates the end at the suspend; held until {seen}"
    return promised_ms, f"{reason}; {note}" if reason else note


def _suspend_or_resume(job: SlurmJob, js: JobState, out: _Emitter, promised_ms: int) -> None:
    """`scontrol suspend` stops the job's processes and keeps its GPUs allocated (SUSPENDED, suspend_time
    set); `scontrol resume` makes it RUNNING again (suspend_time moved to the resume). The attempt still
    holds its GPUs; `interrupted` at the suspend and `started` at the resume bill that time as allocated
    but idle, not as executing until the samples show it idle. A suspend and resume both between two polls
    (squeue shows RUNNING with the resume's time) are told by Slurm's count of the time: `_unseen_suspension`."""
    at_ms = max(job.suspend_ms, js.alloc_start_ms, promised_ms)
    if job.state == "SUSPENDED" and not js.suspended:
        js.suspended, js.suspensions = True, js.suspensions + 1
        out.emit(_with(job, attempt=js.attempt), JobEventKind.interrupted, at_ms, reason="suspended (scontrol suspend)",
                 suffix=f":{js.suspensions}")
    elif job.state != "SUSPENDED" and js.suspended:
        js.suspended = False
        out.emit(_with(job, attempt=js.attempt), JobEventKind.started, at_ms, reason="resumed (scontrol resume)",
                 suffix=f":{js.suspensions + 1}")
        js.suspended_ms = _slurm_suspended_ms(job)
    elif job.state != "SUSPENDED":
        _unseen_suspension(job, js, out, promised_ms)


def _slurm_suspended_ms(job: SlurmJob) -> int | None:
    """The attempt's suspended time up to its last resume, from Slurm's own counts: slurmctld adds the run time to
    pre_sus_time at each suspend and sets suspend_time at each suspend and resume, so a running job has been
    suspended (suspend_time − start_time) − pre_sus_time. 0 when never resumed since its start (suspend_time
    before it: a requeued job keeps its last attempt's); None when the record has no pre_sus_time."""
    if job.pre_sus_ms is None:
        return None
    if job.suspend_ms <= job.start_ms:
        return 0
    return max(0, job.suspend_ms - job.start_ms - job.pre_sus_ms)


def _unseen_suspension(job: SlurmJob, js: JobState, out: _Emitter, promised_ms: int) -> None:
    """A running attempt suspended and resumed since the last poll (no poll saw it SUSPENDED): Slurm's suspended
    time grew by what no event covers. `interrupted` that long before the resume (suspend_time), `started` at it:
    one stretch, the sum when it was suspended more than once meanwhile, never before the last poll's promise."""
    total = _slurm_suspended_ms(job)
    if total is None or js.suspended_ms is None or total - js.suspended_ms < 1000:
        return
    resumed_ms = max(job.suspend_ms, js.alloc_start_ms, promised_ms)
    since_ms = max(job.suspend_ms - (total - js.suspended_ms), js.alloc_start_ms, promised_ms)
    js.suspended_ms = total
    if since_ms >= resumed_ms:
        return
    js.suspensions += 1
    reason = f"suspended and resumed between two polls ({(resumed_ms - since_ms) // 1000} s: Slurm's pre_sus_time)"
    at = _with(job, attempt=js.attempt)
    out.emit(at, JobEventKind.interrupted, since_ms, reason=reason, suffix=f":{js.suspensions}")
    out.emit(at, JobEventKind.started, resumed_ms, reason=reason, suffix=f":{js.suspensions + 1}")


def _allocate(job: SlurmJob, js: JobState, out: _Emitter, gpus: list[GpuAssignment], note: str | None) -> None:
    """allocated + started at start_time: Slurm has one RUNNING state for both."""
    out.emit(job, JobEventKind.allocated, job.start_ms, gpus=gpus, reason=note)
    out.emit(job, JobEventKind.started, job.start_ms)
    js.allocated, js.alloc_start_ms, js.nodes, js.queue = True, job.start_ms, job.nodes, job.queue
    js.gres_detail, js.allocations = tuple(job.gres_detail), 1
    js.suspended, js.suspensions, js.suspended_ms = False, 0, 0


def _allocate_recorded_attempt(job: SlurmJob, js: JobState, out: _Emitter, promised_ms: int) -> None:
    """The attempt `js.attempt` started and was requeued between two polls (squeue shows the restart count one
    up, and no poll saw it run): allocated, from its allocation, with the GPUs its PrologSlurmctld record names
    if there is one of it allocated after the last poll (to within RECORDED_ALLOCATION_SLACK_MS) and by the
    requeue (`job.submit_ms`); else, as before, it gets no `allocated`, only its `retried`."""
    rec = out.recorded(job.raw_id, js.attempt) if out.recorded is not None else None
    if rec is None or (rec.raw_id, rec.attempt) != (job.raw_id, js.attempt) \
            or not promised_ms - RECORDED_ALLOCATION_SLACK_MS <= rec.allocated_ms <= job.submit_ms:
        return
    attempt = _with(job, attempt=js.attempt, nodes=rec.nodes, gres_detail=rec.gres_detail, start_ms=rec.allocated_ms)
    gpus = job_gpus(attempt, out.node_gpus)
    if gpus:
        _allocate(attempt, js, out, gpus, "started and requeued between two polls; its GPUs recorded at its "
                                          "allocation by PrologSlurmctld")


def _gpu_set(nodes: Iterable[str], gres_detail: Iterable[str]) -> set[tuple[str, int]]:
    """The (node, index) of every GPU held whole or in part (which GPUs, whatever their shares: 1 part per
    GPU makes 22.05's 'shard:K(IDX:i)' name its GPU without the node's part count)."""
    return {(node, i) for node, detail in zip(nodes, gres_detail)
            for i in [*gpu_indices(detail), *(g for g, _ in gpu_parts(detail, _ONE_PART))]}


_ONE_PART = {kind: 1 for kind in GPU_PART_GRES}


def _resized(job: SlurmJob, js: JobState, out: _Emitter, promised_ms: int) -> None:
    """A running job whose nodes or GPUs changed since its `allocated` (`scontrol update NumNodes=`:
    Slurm releases nodes and shows the job's new node list, gres_detail and resize_time): a second
    `allocated` of the same attempt with the GPUs it holds now, at resize_time (the worker replaces
    the attempt's GPUs then; a node left out stops billing it)."""
    if js.gres_detail is not None and job.nodes == js.nodes and tuple(job.gres_detail) == js.gres_detail:
        return  # nothing changed (every poll of every running job: kept cheap)
    now = _gpu_set(job.nodes, job.gres_detail)
    if not now:
        return  # GPU indices not shown (yet, or any more): keep what was allocated
    if js.gres_detail is None and job.nodes == js.nodes:
        js.gres_detail = tuple(job.gres_detail)  # a state file from before GPU sets were kept: take them as they are
        return
    if now == _gpu_set(js.nodes, js.gres_detail or ()):
        js.nodes, js.gres_detail = job.nodes, tuple(job.gres_detail)  # written differently, the same GPUs
        return
    _reallocate(job, js, out, job_gpus(job, out.node_gpus), job.resize_ms or promised_ms,
                f"resized: {len(now)} GPU(s) on {len(job.nodes)} node(s)")
    js.nodes, js.gres_detail = job.nodes, tuple(job.gres_detail)


def _reallocate(job: SlurmJob, js: JobState, out: _Emitter, gpus: list[GpuAssignment], at_ms: int, note: str) -> None:
    """A further `allocated` of the allocated attempt `js.attempt` (a resize): ids `…:allocated:2`, `:3`, …;
    then `started` again (`…:started:resized:2`, …) unless the job is suspended: the worker takes an
    `allocated` as a set not running yet, so the GPUs the job kept were billed idle to its end."""
    js.allocations = max(js.allocations, 1) + 1
    js.alloc_start_ms = max(at_ms, js.alloc_start_ms)
    at = _with(job, attempt=js.attempt)
    out.emit(at, JobEventKind.allocated, js.alloc_start_ms, gpus=gpus, reason=note, suffix=f":{js.allocations}")
    if not js.suspended:
        out.emit(at, JobEventKind.started, js.alloc_start_ms, reason=note, suffix=f":resized:{js.allocations}")


def _attempt_groups(rows: list[SacctRow]) -> list[list[SacctRow]]:
    """sacct's rows of one job (`--duplicates`, oldest first) → one list per attempt. A row ends an
    attempt (REQUEUED, PREEMPTED, NODE_FAIL, ... or the final state), but a RESIZING row: Slurm
    writes one when a running job is resized, and the same attempt goes on in the next row (restart
    count unchanged), on the nodes that row lists, from the RESIZING row's End."""
    groups: list[list[SacctRow]] = [[]]
    for row in rows:
        groups[-1].append(row)
        if row.state != "RESIZING":
            groups.append([])
    return [g for g in groups if g]


def _replay_attempt(job: SlurmJob, js: JobState, out: _Emitter, group: list[SacctRow], note: str, *,
                    allocate: bool) -> None:
    """The allocation and the resizes of the attempt whose sacct rows `group` holds, as the live path
    would have seen them: `allocated` at its Start if not published yet (GPU indices not seen: every
    GPU of its nodes when AllocTRES shows it held whole nodes, else no GPU time), and at each RESIZING
    row's End the GPUs it had on the nodes of the row after it."""
    first = group[0]
    if allocate and not js.allocated and first.start_s:
        try:
            nodes = expand_hostlist(first.nodes)
        except SlurmInputError as exc:
            out.warnings.append(f"job {job.job_id}: sacct's NodeList {first.nodes!r}: {exc}; its GPUs are not known")
            nodes = []
        seen, reason = _unseen_gpus(_with(job, start_ms=first.start_s * 1000), nodes, tres_gpus(first.alloc_tres),
                                    "sacct's AllocTRES", out, note)
        if not seen.gres_detail:
            seen = _with(seen, nodes=[])  # as before: an allocation on no known GPU keeps no nodes to resize
        _allocate(seen, js, out, job_gpus(seen, out.node_gpus), reason)
    for row, after in zip(group, group[1:]):
        if row.state == "RESIZING" and row.end_s and after.nodes:
            _keep_nodes(job, js, out, set(expand_hostlist(after.nodes)), row.end_s * 1000,
                        f"resized to {after.nodes} ({note})")


def _keep_nodes(job: SlurmJob, js: JobState, out: _Emitter, kept: set[str], at_ms: int, note: str) -> None:
    """A shrink the live path did not see (sacct's RESIZING row, or a job seen only after it ended): the
    attempt keeps the GPUs it was last seen with on the nodes in `kept`, from `at_ms`."""
    if not js.allocated or not _gpu_set(js.nodes, js.gres_detail or ()):
        return  # no GPUs known to keep (indices not seen, or a state file from before they were kept)
    pairs = [(n, g) for n, g in zip(js.nodes, js.gres_detail or ()) if n in kept]
    if not pairs or [n for n, _ in pairs] == js.nodes:
        return  # nothing released (a live poll saw the resize, or it kept all nodes), or not a shrink
    _reallocate(job, js, out, job_gpus(_with(job, nodes=[n for n, _ in pairs], gres_detail=[g for _, g in pairs]), out.node_gpus),
                at_ms, note)
    js.nodes, js.gres_detail = [n for n, _ in pairs], tuple(g for _, g in pairs)


def _replay_requeues(job: SlurmJob, js: JobState, state: AgentState, out: _Emitter, groups: list[list[SacctRow]],
                     upto: int, note: str) -> None:
    """Attempts `js.attempt` .. `upto - 1` requeued (sacct's rows by attempt, `_attempt_groups`): each
    allocated from its row if not published yet, ended with `preempted` at its row's End, then
    `retried`; stops at an attempt sacct has no row ending it for (the caller goes on as without sacct)."""
    while js.attempt < upto and js.attempt < len(groups):
        group = groups[js.attempt]
        row = group[-1]
        if row.state == "RESIZING":
            return
        at = _with(job, attempt=js.attempt)
        _replay_attempt(at, js, out, group, note, allocate=True)
        requeued_ms = max((row.end_s or 0) * 1000, js.alloc_start_ms)
        preempted = row.state == "PREEMPTED"
        _requeue(at, js, state, out, requeued_ms=requeued_ms, retried_ms=requeued_ms, new_attempt=js.attempt + 1,
                 reason=f"{'requeued to reclaim resources' if preempted else 'requeued'} ({note})", by_job_id=None,
                 rule="partition_prio/requeue" if preempted else "requeue")


def close_vanished(job_ids: Iterable[str], state: AgentState, accounting: Mapping[str, list[SacctRow]] | None, *,
                   cluster: str, lost_at_ms: int, promised_ms: int, node_gpus: Mapping[str, int] | None = None,
                   recorded: AllocationLookup | None = None) -> tuple[list[JobEvent], AgentState, list[str]]:
    """End jobs that left squeue unfinished (the agent was down longer than MinJobAge) from sacct's
    rows: each attempt from `js.attempt` on, requeues included, then the final outcome; a job sacct
    has no row for is closed as `failed` at `lost_at_ms` with a reason that says so.

    `accounting` None: sacct could not be asked (it failed or timed out). The jobs then stay open
    for the next poll, and the state's watermark goes back to `promised_ms` (the one published
    before this poll): their events, still to come, carry Slurm times after it.
    `node_gpus`, `recorded`: as for `translate`. Returns the events, the next state and warnings."""
    state = state.copy()
    out = _Emitter(cluster, state, node_gpus, recorded)
    job_ids = [j for j in job_ids if j in state.jobs and not state.jobs[j].finished]
    if accounting is None:
        if job_ids:
            out.warnings.append(f"sacct unavailable: job(s) {', '.join(job_ids)} left squeue unfinished and stay "
                                "open (the watermark held) until sacct answers")
            state.watermark_ms = min(state.watermark_ms, promised_ms)
        return out.events, state, out.warnings
    note = "from sacct: the job left squeue while the agent was down"
    for job_id in job_ids:
        js = state.jobs[job_id]
        # one group of rows per attempt (--duplicates; a resize adds a RESIZING row to its attempt);
        # those before js.attempt were published live
        groups = _attempt_groups(_own_rows(js, accounting.get(job_id)) or [])
        walk = groups[js.attempt:] or groups[-1:]
        job = _job_not_in_squeue(job_id, js.raw_id, js.tenant, js.queue, attempt=js.attempt,
                                 start_ms=js.alloc_start_ms, nodes=js.nodes)
        # attempts requeued while the agent was down: as the live path would have seen them
        _replay_requeues(job, js, state, out, groups, js.attempt + len(walk) - 1, note)
        job = _with(job, attempt=js.attempt)
        last = walk[-1][-1] if walk else None
        if last is not None and last.state in FINAL_STATES and last.end_s:
            # it ran entirely while the agent was down: the ledger needs the allocation before the end
            # (GPU indices unknown: whole nodes or no GPU time); and any resize of the attempt
            _replay_attempt(job, js, out, walk[-1], "the job ran while the agent was down",
                            allocate=len(groups) - 1 == js.attempt)
            kind, reason = FINAL_STATES[last.state]
            code, _, signal = last.exit_code.partition(":")
            if reason is None and last.state != "COMPLETED":
                reason = f"signal {signal}" if signal not in ("", "0") else f"exit {code}"
            end_ms, reason = _end_not_below(js, max(last.end_s * 1000, js.alloc_start_ms),
                                            f"{reason} ({note})" if reason else note, promised_ms,
                                            "the last poll saw it suspended")
            out.emit(job, kind, end_ms, reason=reason)
        else:
            seen_as = f"sacct shows it {last.state} with no end" if last is not None else "no accounting record"
            out.warnings.append(f"job {job_id} left squeue unfinished and {seen_as}: closed as failed")
            out.emit(job, JobEventKind.failed, max(lost_at_ms, js.alloc_start_ms),
                     reason=f"lost: left squeue while the agent was down, {seen_as}")
        js.ended = js.finished = True
    return out.events, state, out.warnings


def recover_unseen(accounting: Mapping[str, list[SacctRow]], state: AgentState, known: Iterable[str], *,
                   cluster: str, lost_at_ms: int, promised_ms: int, node_gpus: Mapping[str, int] | None = None,
                   recorded: AllocationLookup | None = None,
                   known_raw: Iterable[int] = ()) -> tuple[list[JobEvent], AgentState, list[str], list[str]]:
    """Jobs that were submitted and left squeue while no poll ran (the agent down longer than MinJobAge): no
    poll saw them, so no state has them and `close_vanished` cannot close them. From sacct's rows of the time
    the polls stopped (`sacct -S`, with Submit and ReqTRES), each finished job not in `known` (the state's
    jobs before and after this poll, and squeue's; `known_raw`: raw ids of squeue records it could not read)
    gets `submitted` at its Submit, then what `close_vanished`
    gives a job that ran while the agent was down: each attempt, its allocation (GPUs from a PrologSlurmctld
    record, else whole nodes, else none), its outcome. One that sacct has unfinished is left: slurmdbd may not
    have its end yet (slurmctld sends it later when slurmdbd was away). Returns the events, the next state,
    warnings, and the ids of those unfinished jobs."""
    state = state.copy()
    known, known_raw = set(known), set(known_raw)
    out = _Emitter(cluster, state, node_gpus, recorded)
    found: list[str] = []
    unfinished: list[str] = []
    for job_id, rows in sorted(accounting.items()):
        if job_id in known or job_id in state.jobs or not rows or "[" in job_id or not rows[0].raw_id.isdigit() \
                or int(rows[0].raw_id) in known_raw:
            continue  # known; or an array's pending remainder (`3_[4-9]`), no job of its own yet
        last = rows[-1]
        if last.state not in FINAL_STATES or not last.end_s:
            unfinished.append(job_id)
            continue
        first = rows[0]
        job = _job_not_in_squeue(job_id, int(first.raw_id), first.account, first.partition,
                                 requested_gpus=tres_gpus(first.req_tres or first.alloc_tres),
                                 submit_ms=(first.submit_s or first.start_s or last.end_s) * 1000)
        out.emit(job, JobEventKind.submitted, job.submit_ms, reason="from sacct: the job came and went while no poll ran")
        state.jobs[job_id] = JobState(raw_id=job.raw_id, submitted=True, tenant=job.tenant, queue=job.queue)
        found.append(job_id)
    more, state, warnings = close_vanished(found, state, accounting, cluster=cluster, lost_at_ms=lost_at_ms,
                                           promised_ms=promised_ms, node_gpus=node_gpus, recorded=recorded)
    return out.events + more, state, out.warnings + warnings, unfinished


def _job_not_in_squeue(job_id: str, raw_id: int, tenant: str, queue: str, **fields: Any) -> SlurmJob:
    """A job squeue no longer lists, as the state or sacct's rows give it (`fields`), its array ids from its
    canonical id (`3_1`)."""
    array, _, task = job_id.partition("_")
    ids = (int(array), int(task)) if array.isdigit() and task.isdigit() else (None, None)
    blank: dict[str, Any] = dict(state="", reason="", priority=0, requested_gpus=0.0, attempt=0, submit_ms=0,
                                 start_ms=0, end_ms=0, nodes=[], gres_detail=[], exit_code=None)
    return SlurmJob(job_id=job_id, raw_id=raw_id, array_job_id=ids[0], array_task_id=ids[1],
                    tenant=tenant or "unknown", queue=queue or "unknown", **{**blank, **fields})


def _with(job: SlurmJob, **changes: Any) -> SlurmJob:
    return SlurmJob(**{**job.__dict__, **changes})


# --------------------------------------------------------------------------- snapshots
def gpus_held_by_no_job(sinfo: Any, squeue: SqueueJobs) -> dict[str, list[int]]:
    """Per node, the GPU indices Slurm counts in use (sinfo's `gres_used`, 'gpu:a100:2(IDX:0-1)') that no
    job in squeue holds (gres_detail of its holding jobs). Slurm 22.05 leaves such GPUs after a controller
    restart (docs/slurm.md, Restarts): jobs needing them pend while nothing runs there. A node where a job
    is setting up or completing, or holds GPUs gres_detail does not list, is left out: not known; so is
    every node when a job record could not be read (its GPUs would look held by none)."""
    if squeue.warnings:
        return {}
    held: dict[str, set[int]] = {}
    unsure: set[str] = set()
    for job in squeue.jobs:
        if job.state not in HOLDING_STATES:
            continue
        if job.state in TRANSITIONAL_STATES or len(job.gres_detail) < len(job.nodes):
            unsure.update(job.nodes)
            continue
        for node, detail in zip(job.nodes, job.gres_detail):
            held.setdefault(node, set()).update(gpu_indices(detail))
    out: dict[str, list[int]] = {}
    nodes = sinfo.get("nodes") if isinstance(sinfo, Mapping) else None
    for node in nodes if isinstance(nodes, list) else []:
        if not isinstance(node, Mapping) or not node.get("name") or str(node["name"]) in unsure:
            continue
        extra = sorted(set(gpu_indices(str(node.get("gres_used") or ""))) - held.get(str(node["name"]), set()))
        if extra:
            out[str(node["name"])] = extra
    return out


def build_snapshot(squeue: Any, sinfo: Any, *, cluster: str, ts_ms: int, tiers: Mapping[str, int] | None = None,
                   preemptions: Iterable[Mapping[str, Any]] = (), jobs: list[SlurmJob] | None = None,
                   node_gpus: NodeGpus | None = None) -> SchedulerSnapshot:
    """Partitions as queues: quota = GPUs of the partition's nodes (partitions sharing nodes share
    them), allocated = GPUs of its running jobs (parts of GPUs as their shares), pending jobs and GPUs by
    priority (a request for parts of GPUs as the GPUs it amounts to: `part_request_gpus`). `jobs` and `node_gpus`: squeue's and `node_gpu_counts(sinfo)`, when the caller has them already."""
    tiers = tiers or {}
    if not isinstance(sinfo, Mapping) or not isinstance(sinfo.get("nodes"), list):
        raise SlurmInputError("sinfo output has no 'nodes' list (is this `sinfo --json` of Slurm 22.05+?)")
    quota: dict[str, float] = {}
    for node in sinfo["nodes"]:
        if not isinstance(node, Mapping):
            continue
        n = gpu_count(str(node.get("gres") or ""))
        for part in node.get("partitions") or []:
            quota[str(part)] = quota.get(str(part), 0.0) + n
    jobs = parse_jobs(squeue).jobs if jobs is None else jobs
    if node_gpus is None and any(j.requested_parts or any(_has_gpu_parts(d) for d in j.gres_detail) for j in jobs):
        node_gpus = node_gpu_counts(sinfo)  # parts per GPU (22.05 names only the GPU of a part) from sinfo
    allocated: dict[str, float] = {}
    pending: dict[str, dict[int, list[float]]] = {}
    for job in jobs:
        if job.state in HOLDING_STATES:
            allocated[job.queue] = allocated.get(job.queue, 0.0) + sum(
                1000 * len(whole) + sum(share for _, share in parts) for _, whole, parts in _holdings(job, node_gpus)) / 1000
        elif job.state in PENDING_STATES:
            slot = pending.setdefault(job.queue, {}).setdefault(job.priority, [0, 0.0])
            slot[0] += 1
            slot[1] += job.requested_gpus or part_request_gpus(job, node_gpus)
    queues = []
    for q in sorted(set(quota) | set(allocated) | set(pending)):
        by_prio = pending.get(q, {})
        queues.append(QueueState(
            queue=q, priority=tiers.get(q, 0), quota_gpus=quota.get(q, 0.0), allocated_gpus=allocated.get(q, 0.0),
            pending_jobs=sum(int(v[0]) for v in by_prio.values()), pending_gpus=sum(v[1] for v in by_prio.values()),
            pending_by_priority=[PendingByPriority(priority=p, jobs=int(v[0]), gpus=v[1])
                                 for p, v in sorted(by_prio.items(), reverse=True)]))
    return SchedulerSnapshot(cluster=cluster, ts_ms=ts_ms, queues=queues,
                             preemptions=[PreemptionFired.model_validate(p) for p in preemptions])
