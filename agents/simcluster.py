"""A deterministic simulated GPU cluster: a small scheduler plus telemetry, emitting the three
data lines (GPU samples, job lifecycle events, scheduler snapshots) coherently. What a run is made
of (GPU models, queues, rates, `SimSpec`) is in agents/simspec.py.

Why one file: the simulator is one event-driven state machine (`_Sim`): its handlers (arrivals,
scheduling, lifecycle, faults, telemetry) share one heap of timed actions, the GPUs and the jobs,
and each is short; split, they would pass the whole state around.

Everything runs on event time: a heap of timed actions is drained in time order, so the
emissions come out in non-decreasing `ts_ms`. The same spec (seed included) always yields the
same emissions, byte for byte. There is no wall clock in here.

Phenomena the simulation produces on purpose, because the ledger must account for them:
heterogeneous GPU models; tenants and queues with priorities and quotas; queue waits when demand
exceeds capacity; failed attempts that are retried; priority preemption (the victim is retried
later); fractional jobs packed onto one GPU (several containers per GPU); GPUs that go down
(Xid 79) and fail the jobs on them; allocated-but-not-running time (image pulls, hung jobs);
checkpoints with low utilization; the shapes the watcher alerts on (docs/alerts.md): a rank that
falls behind mid-run (straggler), jobs starved by their input pipeline (low utilization), and
queues where some jobs hold their GPUs without running anything (a reserved notebook), which make
a queue's execution rate low while higher-priority work waits (a reclaim suggestion).

Timing convention: a state change at time t is visible in the sample at the first tick ts >= t;
the sample at ts reflects the state at ts (after every lifecycle event with ts_ms <= ts).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator


from gpuledger.agents.simspec import DEFAULT_START_MS, GPU_MODELS, GpuModelSpec, SimSpec, gpu_uuid  # noqa: F401 (the simulator's public names)
from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES, LINE_SNAPSHOTS, Emission
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuHealth,
    GpuSample,
    JobEvent,
    JobEventKind,
    LifecycleWatermark,
    NodeTick,
    NodeTickBatch,
    PendingByPriority,
    PreemptionFired,
    ProcessSample,
    QueueState,
    SchedulerSnapshot,
)


_MIB = 1024 * 1024
_MINUTE = 60_000
_HOUR = 3_600_000


_SERVING_PREFERENCE = {"T4": 0, "L40S": 1, "V100-32GB": 2, "A100-80GB": 3, "H100-80GB": 4}


# --------------------------------------------------------------------------- internal state
@dataclass(eq=False)
class _Gpu:
    idx: int                  # position in the cluster-wide list
    node_idx: int
    node: str
    index: int                # NVML index on the node
    uuid: str
    model: GpuModelSpec
    energy_j: float
    temp_c: float
    holders: dict[str, int] = field(default_factory=dict)  # job_id -> share_milli
    down_reason: str | None = None
    xids: list[int] = field(default_factory=list)  # Xids not yet reported in a sample
    sbe: int = 0

    @property
    def free(self) -> int:
        return 0 if self.down_reason else 1000 - sum(self.holders.values())


@dataclass(eq=False)
class _Slot:
    gpu: _Gpu
    share: int
    container_id: str
    pid: int
    rank: int


@dataclass(eq=False)
class _Job:
    job_id: str
    seq: int
    tenant: str
    queue: str
    priority: int
    kind: str                 # "train" | "serve"
    gpus: int                 # whole GPUs; 1 for a fractional job
    share: int                # 1000 for whole GPUs, else the fraction of one GPU
    work_ms: int              # running time needed to complete
    task_name: str
    base_util: float
    mem_frac: float
    straggler_rank: int | None
    cancel_at_ms: int | None
    attempt: int = 0
    failures: int = 0
    state: str = "new"        # pending | allocated | running | interrupted | backoff | done
    token: int = 0            # bumped on every transition; stale scheduled actions check it
    queued_ms: int = 0
    allocated_ms: int = 0
    wake_set: bool = False
    slots: list[_Slot] = field(default_factory=list)
    assignments: list[GpuAssignment] = field(default_factory=list)
    containers: dict[str, str] = field(default_factory=dict)  # node -> container id
    saved_ms: int = 0         # work saved by the last checkpoint (survives attempts)
    done_ms: int = 0          # work done before the current running segment
    seg_start: int = 0
    loading_until: int = 0
    in_ckpt: bool = False
    ckpt_progress: int = 0
    next_ckpt: int = 0        # progress at which the next checkpoint begins
    milestone: int = 0        # progress of the next milestone (complete / fail / hang)
    fail_at: int | None = None
    hang_at: int | None = None
    event_seq: int = 0
    behaviour: str = ""       # "" | "idle" (holds its GPUs, runs nothing) | "underfed" (2-8 % busy)

    @property
    def requested(self) -> float:
        return self.gpus if self.share == 1000 else self.share / 1000

    def progress(self, now: int) -> int:
        return self.done_ms + (now - self.seg_start if self.state == "running" else 0)


# Heap classes at equal timestamps: lifecycle first, then the scheduling pass (sees all of them),
# then samples and snapshots (reflect the state after them), then watermarks.
_C_LIFECYCLE, _C_PASS, _C_SAMPLE, _C_SNAPSHOT, _C_WATERMARK = range(5)

_TRAIN_WORDS = ("llm-pretrain", "llm-finetune", "vit-train", "asr-train", "ctr-train", "policy-rl", "diffusion")
_SERVE_WORDS = ("embed-serve", "rerank-serve", "asr-serve", "ctr-serve", "chat-serve")
_FAIL_REASONS = (
    "exit code 1: CUDA error: out of memory",
    "exit code 137: OOMKilled",
    "NCCL error: unhandled system error",
    "exit code 1: RuntimeError: loss is NaN",
)


class _Sim:
    def __init__(self, spec: SimSpec):
        self.spec = spec
        self.rates = spec.rates
        # Independent streams: the workload does not shift when telemetry settings change.
        self.rng_jobs = random.Random(f"{spec.seed}:jobs")
        self.rng_fate = random.Random(f"{spec.seed}:fate")
        self.rng_fault = random.Random(f"{spec.seed}:faults")
        self.rng_tel = random.Random(f"{spec.seed}:telemetry")
        self.now = spec.start_ms
        self.end = spec.end_ms
        self.heap: list[tuple[int, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self.heap_seq = 0
        self.out: list[Emission] = []
        self.pass_pending = False
        self.job_count = 0
        self.jobs: dict[str, _Job] = {}
        self.pending: dict[str, _Job] = {}
        self.holding: dict[str, _Job] = {}
        self.preemptions: list[PreemptionFired] = []
        self.quota = {q.name: q.quota_gpus for q in spec.queues}
        self.queue_priority = {q.name: q.priority for q in spec.queues}

        self.nodes: list[list[_Gpu]] = []
        self.gpus: list[_Gpu] = []
        for n in range(spec.nodes):
            model = GPU_MODELS[spec.node_model(n)]
            node = spec.node_name(n)
            row = []
            for i in range(spec.gpus_per_node):
                g = _Gpu(
                    idx=len(self.gpus), node_idx=n, node=node, index=i,
                    uuid=gpu_uuid(spec.cluster, node, i), model=model,
                    energy_j=round(self.rng_tel.uniform(1e6, 5e8), 3),  # driver loaded long ago
                    temp_c=model.temp_idle_c + self.rng_tel.uniform(-2, 2),
                )
                row.append(g)
                self.gpus.append(g)
            self.nodes.append(row)
        self.sizes = [(n, w) for n, w in self.rates.whole_sizes if n <= spec.total_gpus] or [(1, 1)]

    # ------------------------------------------------------------------ event loop
    def push(self, t: int, cls: int, fn: Callable[..., None], *args: Any) -> None:
        self.heap_seq += 1
        heapq.heappush(self.heap, (t, cls, self.heap_seq, fn, args))

    def run(self) -> Iterator[Emission]:
        spec, r = self.spec, self.rates
        self.push(spec.start_ms, _C_SAMPLE, self.sample_tick)
        self.push(spec.start_ms, _C_SNAPSHOT, self.snapshot_tick)
        self.push(spec.start_ms + spec.watermark_every_ms, _C_WATERMARK, self.watermark_tick)
        self.seed_backlog()
        self.push(self.next_arrival_time(spec.start_ms), _C_LIFECYCLE, self.arrival)
        if r.gpu_faults_per_gpu_hour > 0:
            self.push(self.next_fault_time(spec.start_ms), _C_LIFECYCLE, self.gpu_fault)

        last_sample_end = spec.start_ms
        while self.heap and self.heap[0][0] < self.end:
            t, cls, _, fn, args = heapq.heappop(self.heap)
            self.now = t
            fn(*args)
            if cls == _C_SAMPLE:
                last_sample_end = t + spec.sample_interval_ms
            if self.out:
                yield from self.out
                self.out.clear()
        # Everything below the end has been emitted: one last watermark lets consumers close all.
        final = max(self.end, last_sample_end)
        yield Emission(LINE_JOB_EVENTS, None, LifecycleWatermark(cluster=spec.cluster, ts_ms=final))

    # ------------------------------------------------------------------ periodic ticks
    def watermark_tick(self) -> None:
        # Actions are drained in time order, so every lifecycle event below `now` is already out.
        self.out.append(Emission(LINE_JOB_EVENTS, None, LifecycleWatermark(cluster=self.spec.cluster, ts_ms=self.now)))
        self.push(self.now + self.spec.watermark_every_ms, _C_WATERMARK, self.watermark_tick)

    def snapshot_tick(self) -> None:
        alloc = self.queue_allocated()
        pending_by: dict[str, dict[int, list[float]]] = {q.name: {} for q in self.spec.queues}
        for job in self.pending.values():
            pending_by[job.queue].setdefault(job.priority, []).append(job.requested)
        queues = []
        for q in self.spec.queues:
            groups = pending_by[q.name]
            queues.append(QueueState(
                queue=q.name, priority=q.priority, quota_gpus=q.quota_gpus,
                allocated_gpus=round(alloc[q.name], 3),
                pending_jobs=sum(len(v) for v in groups.values()),
                pending_gpus=round(sum(sum(v) for v in groups.values()), 3),
                pending_by_priority=[
                    PendingByPriority(priority=p, jobs=len(v), gpus=round(sum(v), 3))
                    for p, v in sorted(groups.items(), reverse=True)
                ],
            ))
        snap = SchedulerSnapshot(cluster=self.spec.cluster, ts_ms=self.now, queues=queues, preemptions=self.preemptions)
        self.preemptions = []
        self.out.append(Emission(LINE_SNAPSHOTS, self.spec.cluster, snap))
        self.push(self.now + self.spec.snapshot_every_ms, _C_SNAPSHOT, self.snapshot_tick)

    def sample_tick(self) -> None:
        spec = self.spec
        for n, row in enumerate(self.nodes):
            tick = NodeTick(
                cluster=spec.cluster, node=spec.node_name(n), ts_ms=self.now,
                interval_ms=spec.sample_interval_ms, gpus=[self.gpu_sample(g) for g in row],
            )
            self.out.append(Emission(LINE_SAMPLES, tick.node, tick))
        self.push(self.now + spec.sample_interval_ms, _C_SAMPLE, self.sample_tick)

    def gpu_sample(self, g: _Gpu) -> GpuSample:
        rng, m, now = self.rng_tel, g.model, self.now
        xids, g.xids = g.xids, []
        if g.down_reason:
            # Off the bus: NVML answers nothing but the fact that the device is gone.
            return GpuSample(gpu_uuid=g.uuid, index=g.index, model=m.name, health=GpuHealth.down,
                             down_reason=g.down_reason, xid_errors=xids)
        slots: list[_Slot] = []
        loads: list[float] = []
        mems: list[int] = []
        multi_gpu = False
        for job_id, share in g.holders.items():
            job = self.jobs[job_id]
            if job.state not in ("running", "interrupted"):
                continue  # container still starting: nothing on the GPU yet
            slot = next(s for s in job.slots if s.gpu is g)
            frac = share / 1000
            mem = int(m.mem_bytes * job.mem_frac * frac)
            if job.state == "interrupted":
                load = 0.0  # hung: holds memory, runs nothing
            elif now < job.loading_until:
                load = rng.uniform(3, 30) * frac
                mem //= 2
            elif job.behaviour == "idle":
                load = 0.0  # a reserved notebook: memory held, nothing running
            elif job.in_ckpt:
                load = rng.uniform(5, 25) * frac
            elif job.behaviour == "underfed":
                load = rng.uniform(2, 8) * frac
            else:
                load = min(100.0, max(60.0, job.base_util + rng.gauss(0, 4))) * frac
                if slot.rank == job.straggler_rank and job.progress(now) >= job.work_ms // 3:
                    load *= 0.5  # falls behind a third of the way in
            multi_gpu = multi_gpu or len(job.slots) > 1
            slots.append(slot)
            loads.append(load)
            mems.append(mem)
        total = sum(loads)
        if total > 100.0:  # time slicing cannot exceed the whole GPU
            loads = [x * 100.0 / total for x in loads]
        loads = [math.floor(x * 10) / 10 for x in loads]
        samples = [
            ProcessSample(pid=slot.pid, container_id=slot.container_id, sm_util_pct=load, mem_used_bytes=mem)
            for slot, load, mem in zip(slots, loads, mems)
        ]
        busy = min(100.0, round(sum(loads), 1))
        mem_used = int(m.mem_bytes * 0.005) + sum(mems)  # driver/context reserve + processes
        power = m.idle_w + (m.tdp_w - m.idle_w) * (busy / 100) ** 0.9 * rng.uniform(0.85, 0.98) + rng.gauss(0, 1.5)
        if samples and busy == 0:
            power += m.idle_w * 0.1  # a context resident on the GPU costs a little
        power = round(min(max(power, m.idle_w * 0.8), m.tdp_w * 1.02), 1)
        target = m.temp_idle_c + (m.temp_busy_c - m.temp_idle_c) * busy / 100
        g.temp_c += 0.3 * (target - g.temp_c) + rng.gauss(0, 0.3)
        throttle = 0x1 if busy == 0 else 0
        if power > 0.95 * m.tdp_w:
            throttle |= 0x4  # software power cap
        if g.temp_c > 83:
            throttle |= 0x20
        if rng.random() < 0.0005:
            g.sbe += 1
        pcie = busy / 100 * rng.uniform(0.3e9, 3e9) + rng.uniform(1e5, 1e6)
        nvlink = (busy / 100 * rng.uniform(20e9, 120e9) if multi_gpu else 0.0) if m.nvlink else None
        sample = GpuSample(
            gpu_uuid=g.uuid, index=g.index, model=m.name,
            util_gpu_pct=busy,
            sm_active_pct=round(busy * rng.uniform(0.78, 0.92), 1),
            mem_used_bytes=min(mem_used, m.mem_bytes), mem_total_bytes=m.mem_bytes,
            temperature_c=round(g.temp_c, 1), power_w=power, power_limit_w=m.tdp_w, energy_j=round(g.energy_j, 3),
            pcie_tx_bytes_per_s=round(pcie * 0.4), pcie_rx_bytes_per_s=round(pcie * 0.6),
            nvlink_tx_bytes_per_s=None if nvlink is None else round(nvlink),
            nvlink_rx_bytes_per_s=None if nvlink is None else round(nvlink),
            sm_clock_mhz=m.sm_clock_idle_mhz if busy == 0 else round(m.sm_clock_max_mhz * rng.uniform(0.9, 1.0)),
            mem_clock_mhz=m.mem_clock_mhz, throttle_reasons=throttle,
            ecc_sbe_total=g.sbe, ecc_dbe_total=0, xid_errors=xids, processes=samples,
        )
        # The counter read at ts holds energy up to ts; this tick's energy shows in the next reading.
        g.energy_j += power * self.spec.sample_interval_ms / 1000
        return sample

    # ------------------------------------------------------------------ workload
    def arrival_rate_per_ms(self, t: int) -> float:
        r = self.rates
        phase = 2 * math.pi * (t - self.spec.start_ms) / r.burst_period_ms
        per_hour = r.arrivals_per_gpu_hour * self.spec.total_gpus * (1 + r.burst_amplitude * math.sin(phase))
        return max(per_hour, 0.0) / _HOUR

    def next_arrival_time(self, t: int) -> int:
        # Thinning of a non-homogeneous Poisson process with the peak rate as envelope.
        r = self.rates
        peak = r.arrivals_per_gpu_hour * self.spec.total_gpus * (1 + abs(r.burst_amplitude)) / _HOUR
        if peak <= 0:
            return self.end
        while True:
            t += max(1, round(self.rng_jobs.expovariate(peak)))
            if t >= self.end or self.rng_jobs.random() * peak <= self.arrival_rate_per_ms(t):
                return t

    def seed_backlog(self) -> None:
        """Jobs already submitted when the simulation starts (a cluster is rarely empty)."""
        want = self.rates.initial_load * self.spec.total_gpus
        asked, t = 0.0, self.spec.start_ms
        while asked < want:
            t += self.rng_jobs.randint(500, 4000)
            job = self.new_job(t)
            asked += job.requested
            self.push(t, _C_LIFECYCLE, self.submit, job)

    def new_job(self, t: int) -> _Job:
        rng, r, spec = self.rng_jobs, self.rates, self.spec
        self.job_count += 1
        n = self.job_count
        queue = rng.choices(spec.queues, weights=[q.weight for q in spec.queues])[0]
        tenant = rng.choice(spec.tenants)
        urgent = rng.random() < r.urgent_share
        if rng.random() < r.fractional_share:
            kind, gpus, share = "serve", 1, rng.choice((250, 250, 500))
            work = rng.randint(*r.serve_ms)
            base = rng.uniform(60, 95)
            word = rng.choice(_SERVE_WORDS)
        else:
            kind, share = "train", 1000
            gpus = rng.choices([s for s, _ in self.sizes], weights=[w for _, w in self.sizes])[0]
            work = int(min(max(r.train_median_ms * math.exp(rng.gauss(0, 0.8)), 5 * _MINUTE), 5 * _HOUR))
            base = rng.uniform(70, 97)
            word = rng.choice(_TRAIN_WORDS)
        straggler = rng.randrange(gpus) if gpus > 1 and rng.random() < r.straggler_prob else None
        cancel_at = t + rng.randint(5 * _MINUTE, 2 * _HOUR) if rng.random() < r.cancel_prob else None
        job = _Job(
            job_id=f"job-{n:05d}", seq=n, tenant=tenant, queue=queue.name,
            priority=queue.priority + (10 if urgent else 0), kind=kind, gpus=gpus, share=share,
            work_ms=work, task_name=f"{tenant}/{word}-{n:05d}", base_util=base,
            mem_frac=rng.uniform(0.35, 0.95), straggler_rank=straggler, cancel_at_ms=cancel_at,
        )
        # drawn from the job's id, not from the random streams: the rest of the workload stays as it was
        draw = int(hashlib.sha1(f"{spec.seed}:{job.job_id}:behaviour".encode()).hexdigest()[:12], 16) / 16 ** 12
        if draw < queue.idle_share:
            job.behaviour = "idle"
        elif kind == "train" and draw < queue.idle_share + r.underfed_share:
            job.behaviour = "underfed"
        self.jobs[job.job_id] = job
        return job

    def arrival(self) -> None:
        self.submit(self.new_job(self.now))
        self.push(self.next_arrival_time(self.now), _C_LIFECYCLE, self.arrival)

    def submit(self, job: _Job) -> None:
        self.event(job, JobEventKind.submitted)
        self.enqueue(job)
        if job.cancel_at_ms is not None:
            self.push(job.cancel_at_ms, _C_LIFECYCLE, self.cancel, job)

    def enqueue(self, job: _Job) -> None:
        job.state, job.queued_ms, job.wake_set = "pending", self.now, False
        self.pending[job.job_id] = job
        self.event(job, JobEventKind.queued)
        self.request_pass()

    # ------------------------------------------------------------------ lifecycle
    def event(self, job: _Job, kind: JobEventKind, reason: str | None = None, with_gpus: bool = True) -> None:
        job.event_seq += 1
        aliases = {"task_name": job.task_name}
        gpus: list[GpuAssignment] = []
        if with_gpus and job.slots:
            gpus = job.assignments
            for i, (node, cid) in enumerate(job.containers.items()):
                aliases["container_id" if i == 0 else f"container_id.{node}"] = cid
            aliases["pod"] = f"{job.job_id}-a{job.attempt}"
        ev = JobEvent(
            event_id=f"{self.spec.cluster}:{job.job_id}:a{job.attempt}:{job.event_seq:03d}:{kind.value}",
            ts_ms=self.now, kind=kind, cluster=self.spec.cluster, job_id=job.job_id, attempt=job.attempt,
            tenant=job.tenant, queue=job.queue, priority=job.priority, requested_gpus=job.requested,
            gpus=gpus, aliases=aliases, reason=reason,
        )
        self.out.append(Emission(LINE_JOB_EVENTS, job.job_id, ev))

    def allocate(self, job: _Job, plan: list[tuple[int, int]]) -> None:
        rng = self.rng_jobs
        del self.pending[job.job_id]
        self.holding[job.job_id] = job
        job.state, job.allocated_ms = "allocated", self.now
        job.token += 1
        job.slots, job.containers = [], {}
        for rank, (gi, share) in enumerate(plan):
            g = self.gpus[gi]
            g.holders[job.job_id] = share
            cid = job.containers.get(g.node)
            if cid is None:
                digest = hashlib.sha1(f"{self.spec.cluster}/{job.job_id}/{job.attempt}/{g.node}".encode()).hexdigest()
                cid = job.containers[g.node] = f"ctr-{digest[:12]}"
            job.slots.append(_Slot(gpu=g, share=share, container_id=cid, pid=rng.randint(1000, 4_000_000), rank=rank))
        job.assignments = [
            GpuAssignment(node=s.gpu.node, gpu_uuid=s.gpu.uuid, share_milli=s.share, container_id=s.container_id)
            for s in job.slots
        ]
        self.event(job, JobEventKind.allocated)
        # Image pull and container start: the GPUs are held but nothing runs yet.
        self.push(self.now + rng.randint(*self.rates.image_pull_ms), _C_LIFECYCLE, self.container_up, job, job.token)

    def container_up(self, job: _Job, token: int) -> None:
        if job.token != token:
            return
        rng, r = self.rng_fate, self.rates
        self.event(job, JobEventKind.started)
        job.done_ms = job.saved_ms  # a new attempt resumes from the last checkpoint
        remaining = job.work_ms - job.done_ms
        job.fail_at = job.done_ms + int(remaining * rng.uniform(0.05, 0.9)) if rng.random() < r.fail_prob else None
        job.hang_at = job.done_ms + int(remaining * rng.uniform(0.1, 0.8)) if rng.random() < r.hang_prob else None
        job.next_ckpt = job.done_ms + rng.randint(*r.checkpoint_every_ms)
        self.start_segment(job, loading_ms=rng.randint(*r.loading_ms))

    def start_segment(self, job: _Job, loading_ms: int) -> None:
        job.state, job.seg_start = "running", self.now
        job.token += 1
        job.loading_until = self.now + loading_ms
        targets = [(job.work_ms, "complete")]
        if job.fail_at is not None:
            targets.append((job.fail_at, "fail"))
        if job.hang_at is not None:
            targets.append((job.hang_at, "hang"))
        job.milestone, what = min(targets)
        self.push(self.time_at(job, job.milestone), _C_LIFECYCLE, self.reach_milestone, job, job.token, what)
        self.plan_checkpoint(job)

    def time_at(self, job: _Job, progress: int) -> int:
        return job.seg_start + max(progress - job.done_ms, 0)

    def plan_checkpoint(self, job: _Job) -> None:
        if job.kind != "train":
            return
        dur = self.rng_fate.randint(*self.rates.checkpoint_ms)
        # Only checkpoints that end before the next milestone: milestones never cut one short.
        if job.next_ckpt + dur < job.milestone:
            at = max(self.time_at(job, job.next_ckpt), job.loading_until, self.now + 1)
            if at + dur < self.time_at(job, job.milestone):
                self.push(at, _C_LIFECYCLE, self.checkpoint_begin, job, job.token, dur)

    def checkpoint_begin(self, job: _Job, token: int, dur: int) -> None:
        if job.token != token:
            return
        job.in_ckpt, job.ckpt_progress = True, job.progress(self.now)
        self.event(job, JobEventKind.checkpoint_begin)
        self.push(self.now + dur, _C_LIFECYCLE, self.checkpoint_end, job, token)

    def checkpoint_end(self, job: _Job, token: int) -> None:
        if job.token != token:
            return
        job.in_ckpt, job.saved_ms = False, job.ckpt_progress
        self.event(job, JobEventKind.checkpoint_end)
        job.next_ckpt = job.progress(self.now) + self.rng_fate.randint(*self.rates.checkpoint_every_ms)
        self.plan_checkpoint(job)

    def reach_milestone(self, job: _Job, token: int, what: str) -> None:
        if job.token != token:
            return
        if what == "complete":
            self.end_attempt(job, JobEventKind.completed)
        elif what == "fail":
            self.end_attempt(job, JobEventKind.failed, self.rng_fate.choice(_FAIL_REASONS))
        else:  # hang: the process stops making progress but keeps its GPUs and memory
            job.done_ms, job.hang_at = job.progress(self.now), None
            job.state = "interrupted"
            job.token += 1
            self.event(job, JobEventKind.interrupted, "hung: no progress, NCCL watchdog waiting")
            self.push(self.now + self.rng_fate.randint(*self.rates.hang_ms), _C_LIFECYCLE, self.hang_over, job, job.token)

    def hang_over(self, job: _Job, token: int) -> None:
        if job.token != token:
            return
        if self.rng_fate.random() < self.rates.hang_recover_prob:
            self.event(job, JobEventKind.started, "resumed after hang")
            self.start_segment(job, loading_ms=0)
        else:
            self.end_attempt(job, JobEventKind.failed, "hung: killed by watchdog")

    def end_attempt(self, job: _Job, kind: JobEventKind, reason: str | None = None) -> None:
        """Emit the terminal event of the current attempt and release its GPUs."""
        self.event(job, kind, reason)
        for s in job.slots:
            s.gpu.holders.pop(job.job_id, None)
        job.slots, job.assignments, job.containers = [], [], {}
        job.in_ckpt = False
        job.token += 1
        self.holding.pop(job.job_id, None)
        retry = kind == JobEventKind.preempted
        if kind == JobEventKind.failed:
            job.failures += 1
            retry = job.failures < self.rates.max_failures
        if retry:
            job.state = "backoff"
            self.push(self.now + self.rng_fate.randint(*self.rates.retry_backoff_ms), _C_LIFECYCLE, self.retry, job)
        else:
            job.state = "done"
        self.request_pass()

    def retry(self, job: _Job) -> None:
        if job.state != "backoff":
            return  # cancelled meanwhile
        job.attempt += 1
        self.event(job, JobEventKind.retried)
        self.enqueue(job)

    def cancel(self, job: _Job) -> None:
        if job.state == "done":
            return
        if job.job_id in self.holding:
            self.end_attempt(job, JobEventKind.cancelled, "cancelled by user")
            job.state = "done"
            return
        self.pending.pop(job.job_id, None)
        job.state = "done"
        job.token += 1
        self.event(job, JobEventKind.cancelled, "cancelled by user")

    def gpu_fault(self) -> None:
        rng = self.rng_fault
        healthy = [g for g in self.gpus if not g.down_reason]
        if healthy:
            # Xid 79 shows up under load far more often than on idle cards.
            busy = [g for g in healthy if any(self.jobs[j].state == "running" for j in g.holders)]
            g = rng.choice(busy if busy and rng.random() < 0.8 else healthy)
            g.down_reason = "xid 79"
            g.xids.append(79)
            for job_id in list(g.holders):
                self.end_attempt(self.jobs[job_id], JobEventKind.failed,
                                 f"xid 79: GPU {g.uuid} on {g.node} (index {g.index}) has fallen off the bus")
            self.push(self.now + rng.randint(*self.rates.down_ms), _C_LIFECYCLE, self.gpu_repaired, g)
        self.push(self.next_fault_time(self.now), _C_LIFECYCLE, self.gpu_fault)

    def next_fault_time(self, t: int) -> int:
        per_ms = self.rates.gpu_faults_per_gpu_hour * self.spec.total_gpus / _HOUR
        return t + max(1, round(self.rng_fault.expovariate(per_ms)))

    def gpu_repaired(self, g: _Gpu) -> None:
        g.down_reason = None
        if self.rates.energy_reset_on_repair:
            g.energy_j = 0.0
        self.request_pass()

    # ------------------------------------------------------------------ scheduler
    def request_pass(self) -> None:
        if not self.pass_pending:
            self.pass_pending = True
            self.push(self.now, _C_PASS, self.schedule_pass)

    def wake(self, job: _Job, attempt: int) -> None:
        if job.state == "pending" and job.attempt == attempt:
            self.request_pass()

    def queue_allocated(self) -> dict[str, float]:
        alloc = {q.name: 0.0 for q in self.spec.queues}
        for job in self.holding.values():
            alloc[job.queue] += sum(s.share for s in job.slots) / 1000
        return alloc

    def schedule_pass(self) -> None:
        """Highest priority first, oldest first; smaller jobs backfill when a big one does not fit."""
        self.pass_pending = False
        r = self.rates
        free = [g.free for g in self.gpus]
        for job in sorted(self.pending.values(), key=lambda j: (-j.priority, j.queued_ms, j.seq)):
            plan = self.place(job, free)
            if plan is None and r.preemption and self.now - job.queued_ms >= r.preempt_after_ms:
                victims = self.find_victims(job, free)
                if victims:
                    for victim, rule in victims:
                        self.preempt(victim, job, rule)
                    free = [g.free for g in self.gpus]
                    plan = self.place(job, free)
            if plan is None:
                if r.preemption and not job.wake_set:
                    job.wake_set = True  # look again once it has waited long enough to preempt
                    self.push(job.queued_ms + r.preempt_after_ms, _C_LIFECYCLE, self.wake, job, job.attempt)
                continue
            for gi, share in plan:
                free[gi] -= share
            self.allocate(job, plan)

    def place(self, job: _Job, free: list[int]) -> list[tuple[int, int]] | None:
        if job.share < 1000:
            best = None
            for g in self.gpus:
                f = free[g.idx]
                if f >= job.share:  # f > 0 means no whole-GPU job is there
                    key = (f, _SERVING_PREFERENCE.get(g.model.name, 9), g.idx)
                    if best is None or key < best[0]:
                        best = (key, g.idx)
            return None if best is None else [(best[1], job.share)]
        per_node = [[g.idx for g in row if free[g.idx] == 1000] for row in self.nodes]
        if job.gpus <= self.spec.gpus_per_node:
            fits = [(len(idle), n) for n, idle in enumerate(per_node) if len(idle) >= job.gpus]
            if not fits:
                return None
            _, n = min(fits)  # best fit: the fullest node that still fits
            return [(gi, 1000) for gi in per_node[n][: job.gpus]]
        # Multi-node job: take the emptiest nodes first, to span as few as possible.
        if sum(len(idle) for idle in per_node) < job.gpus:
            return None
        plan: list[tuple[int, int]] = []
        for n in sorted(range(len(per_node)), key=lambda n: (-len(per_node[n]), n)):
            plan.extend((gi, 1000) for gi in per_node[n][: job.gpus - len(plan)])
            if len(plan) == job.gpus:
                break
        return plan

    def find_victims(self, job: _Job, free: list[int]) -> list[tuple[_Job, str]] | None:
        """Lower-priority attempts whose eviction lets `job` fit, fewest first.

        A queue within its quota may preempt any lower priority ("priority" rule); a queue over
        its quota may only reclaim from queues that are over theirs ("reclaim" rule)."""
        alloc = self.queue_allocated()
        over = {q: alloc[q] - self.quota[q] for q in alloc}
        within_quota = alloc[job.queue] + job.requested <= self.quota[job.queue]
        candidates = [
            v for v in self.holding.values()
            if v.priority < job.priority and (within_quota or over[v.queue] > 0)
        ]
        if not candidates:
            return None
        candidates.sort(key=lambda v: (v.priority, -over[v.queue], -v.allocated_ms, v.seq))

        def fits(chosen: list[_Job]) -> bool:
            trial = list(free)
            for v in chosen:
                for s in v.slots:
                    trial[s.gpu.idx] += s.share
            return self.place(job, trial) is not None

        chosen: list[_Job] = []
        for v in candidates:
            chosen.append(v)
            if fits(chosen):
                break
        else:
            return None
        for v in list(reversed(chosen[:-1])):  # drop victims the fit does not need
            rest = [c for c in chosen if c is not v]
            if fits(rest):
                chosen = rest
        return [(v, "reclaim" if over[v.queue] > 0 else "priority") for v in chosen]

    def preempt(self, victim: _Job, by: _Job, rule: str) -> None:
        self.preemptions.append(PreemptionFired(job_id=victim.job_id, by_job_id=by.job_id, queue=victim.queue, rule=rule))
        self.end_attempt(victim, JobEventKind.preempted, f"preempted by {by.job_id} (queue {by.queue}, priority {by.priority}, rule {rule})")


def simulate(spec: SimSpec | None = None) -> Iterator[Emission]:
    """Emissions of the simulated cluster, in non-decreasing event time (`message.ts_ms`).

    Lines: "gpu-samples" (NodeTick, key node), "job-events" (JobEvent, key job_id; and
    LifecycleWatermark, key None: to be broadcast to every partition), "scheduler-snapshots"
    (SchedulerSnapshot, key cluster). A watermark T follows every job event with ts_ms < T."""
    return _Sim(spec or SimSpec()).run()


def batch_ticks(emissions: Iterable[Emission], ticks_per_message: int) -> Iterator[Emission]:
    """The same emissions with each node's ticks sent `ticks_per_message` at a time, as an agent
    with GPULEDGER_AGENT_TICKS_PER_MESSAGE does: a node's `NodeTickBatch` goes out where its last
    tick would have (a node's leftover ticks at the end); other lines are unchanged."""
    if ticks_per_message < 1:
        raise ValueError(f"ticks_per_message must be >= 1, got {ticks_per_message}")
    if ticks_per_message == 1:
        yield from emissions
        return
    held: dict[str, list[NodeTick]] = {}
    for emission in emissions:
        if emission.line != LINE_SAMPLES:
            yield emission
            continue
        ticks = held.setdefault(emission.key, [])
        ticks.append(emission.message)
        if len(ticks) == ticks_per_message:
            yield Emission(LINE_SAMPLES, emission.key, NodeTickBatch(node=emission.key, ticks=held.pop(emission.key)))
    for node, ticks in held.items():
        yield Emission(LINE_SAMPLES, node, ticks[0] if len(ticks) == 1 else NodeTickBatch(node=node, ticks=ticks))
