"""The simulated cluster: deterministic, ordered, valid, coherent, and rich enough to exercise the ledger."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from gpuledger.agents.simcluster import GPU_MODELS, SimSpec, simulate
from gpuledger.schemas.lines import Emission
from gpuledger.schemas.models import (
    TERMINAL_KINDS,
    GpuHealth,
    JobEvent,
    JobEventKind,
    LifecycleWatermark,
    NodeTick,
    SchedulerSnapshot,
)
from gpuledger.schemas.wire import decode, decode_lifecycle, encode

SMALL = SimSpec(nodes=2, gpus_per_node=4, hours=1.0, node_models=("A100-80GB", "T4"), seed=3)


@pytest.fixture(scope="module")
def default_run() -> list[Emission]:
    return list(simulate(SimSpec()))


def job_events(run: list[Emission]) -> list[JobEvent]:
    return [e.message for e in run if isinstance(e.message, JobEvent)]


def ticks(run: list[Emission]) -> list[NodeTick]:
    return [e.message for e in run if isinstance(e.message, NodeTick)]


# --------------------------------------------------------------------------- determinism, order, validity
def test_same_seed_same_output_and_other_seed_differs():
    a = [(e.line, e.key, encode(e.message)) for e in simulate(SMALL)]
    b = [(e.line, e.key, encode(e.message)) for e in simulate(SMALL)]
    assert a == b
    c = [(e.line, e.key, encode(e.message)) for e in simulate(replace(SMALL, seed=4))]
    assert a != c


def test_event_time_never_decreases(default_run):
    ts = [e.message.ts_ms for e in default_run]
    assert all(x <= y for x, y in zip(ts, ts[1:]))
    spec = SimSpec()
    assert ts[0] >= spec.start_ms


def test_watermark_follows_every_earlier_job_event(default_run):
    spec = SimSpec()
    promised = -1
    watermarks = []
    for e in default_run:
        m = e.message
        if isinstance(m, LifecycleWatermark):
            assert e.line == "job-events" and e.key is None
            assert m.ts_ms >= promised
            promised = m.ts_ms
            watermarks.append(m.ts_ms)
        elif isinstance(m, JobEvent):
            assert m.ts_ms >= promised, f"{m.event_id} at {m.ts_ms} published after watermark {promised}"
    # periodic, then one final watermark covering the last sample interval, as the last emission
    assert all(b - a == spec.watermark_every_ms for a, b in zip(watermarks[:-2], watermarks[1:-1]))
    last_tick = ticks(default_run)[-1]
    assert isinstance(default_run[-1].message, LifecycleWatermark)
    assert watermarks[-1] >= last_tick.ts_ms + last_tick.interval_ms
    assert watermarks[-1] >= spec.end_ms


def test_every_message_validates_and_round_trips(default_run):
    for e in default_run:
        raw = encode(e.message)
        if e.line == "job-events":
            assert decode_lifecycle(raw) == e.message
        elif e.line == "gpu-samples":
            assert decode(NodeTick, raw) == e.message and e.key == e.message.node
        else:
            assert e.line == "scheduler-snapshots"
            assert decode(SchedulerSnapshot, raw) == e.message and e.key == e.message.cluster
        if isinstance(e.message, JobEvent):
            assert e.key == e.message.job_id


def test_event_ids_unique_and_events_fully_described(default_run):
    events = job_events(default_run)
    assert len({ev.event_id for ev in events}) == len(events)
    for ev in events:
        assert ev.tenant and ev.queue and ev.requested_gpus > 0
        assert "task_name" in ev.aliases
        if ev.kind == JobEventKind.allocated:
            assert ev.gpus and all(a.container_id for a in ev.gpus)
            assert ev.aliases["container_id"] in {a.container_id for a in ev.gpus}
            assert sum(a.share_milli for a in ev.gpus) == round(ev.requested_gpus * 1000)


def test_sample_grid_one_tick_per_node_per_interval(default_run):
    spec = SimSpec()
    per_ts = Counter(t.ts_ms for t in ticks(default_run))
    expected = range(spec.start_ms, spec.end_ms, spec.sample_interval_ms)
    assert sorted(per_ts) == list(expected)
    assert set(per_ts.values()) == {spec.nodes}


# --------------------------------------------------------------------------- coherence with the lifecycle
class Fold:
    """The GPU holdings implied by the job events alone (what the ledger will reconstruct)."""

    def __init__(self) -> None:
        self.holders: dict[str, dict[str, tuple[int, str | None]]] = defaultdict(dict)  # gpu -> job -> (share, ctr)
        self.status: dict[str, str] = {}
        self.held_gpus: dict[str, list[str]] = {}

    def apply(self, ev: JobEvent) -> None:
        k = ev.kind
        if k == JobEventKind.allocated:
            assert ev.job_id not in self.held_gpus, f"{ev.event_id}: allocated while already holding"
            for a in ev.gpus:
                self.holders[a.gpu_uuid][ev.job_id] = (a.share_milli, a.container_id)
            self.held_gpus[ev.job_id] = [a.gpu_uuid for a in ev.gpus]
            self.status[ev.job_id] = "allocated"
        elif k == JobEventKind.started:
            assert ev.job_id in self.held_gpus, f"{ev.event_id}: started without allocation"
            self.status[ev.job_id] = "running"
        elif k == JobEventKind.interrupted:
            assert self.status.get(ev.job_id) == "running"
            self.status[ev.job_id] = "interrupted"
        elif k in TERMINAL_KINDS:
            for uuid in self.held_gpus.pop(ev.job_id, []):
                del self.holders[uuid][ev.job_id]
            self.status.pop(ev.job_id, None)


def test_samples_coherent_with_lifecycle(default_run):
    fold = Fold()
    checked_running = 0
    for e in default_run:
        m = e.message
        if isinstance(m, JobEvent):
            fold.apply(m)
            continue
        if not isinstance(m, NodeTick):
            continue
        for g in m.gpus:
            holders = fold.holders[g.gpu_uuid]
            assert sum(share for share, _ in holders.values()) <= 1000, f"{g.gpu_uuid} over-allocated at {m.ts_ms}"
            procs = {p.container_id for p in g.processes}
            if g.health == GpuHealth.down:
                assert g.down_reason and not holders, f"down GPU {g.gpu_uuid} still held at {m.ts_ms}"
                continue
            running = {ctr for job, (_, ctr) in holders.items() if fold.status[job] == "running"}
            present = {ctr for job, (_, ctr) in holders.items() if fold.status[job] in ("running", "interrupted")}
            assert running <= procs, f"{g.gpu_uuid} at {m.ts_ms}: running containers missing from processes"
            assert procs <= present, f"{g.gpu_uuid} at {m.ts_ms}: processes of no running/interrupted job"
            assert sum(p.sm_util_pct or 0 for p in g.processes) <= 100.0
            if not running:
                assert g.util_gpu_pct == 0.0, f"{g.gpu_uuid} busy at {m.ts_ms} with nothing running"
            else:
                checked_running += 1
    assert checked_running > 1000


def test_snapshots_agree_with_lifecycle(default_run):
    fold = Fold()
    queue_of: dict[str, str] = {}
    seen = 0
    for e in default_run:
        m = e.message
        if isinstance(m, JobEvent):
            fold.apply(m)
            queue_of[m.job_id] = m.queue
        elif isinstance(m, SchedulerSnapshot):
            alloc: Counter[str] = Counter()
            for holders in fold.holders.values():
                for job, (share, _) in holders.items():
                    alloc[queue_of[job]] += share
            for q in m.queues:
                assert q.allocated_gpus == pytest.approx(alloc[q.queue] / 1000)
                assert q.pending_jobs == sum(p.jobs for p in q.pending_by_priority)
            seen += 1
    assert seen == SimSpec().hours * 60


def test_energy_counter_integrates_power(default_run):
    spec = SimSpec()
    last: dict[str, tuple[float, float]] = {}
    for t in ticks(default_run):
        for g in t.gpus:
            if g.health == GpuHealth.down:
                last.pop(g.gpu_uuid, None)  # counter restarts after the repair
                continue
            if g.gpu_uuid in last:
                energy, power = last[g.gpu_uuid]
                assert g.energy_j == pytest.approx(energy + power * spec.sample_interval_ms / 1000, abs=0.01)
            assert 0 < g.power_w <= GPU_MODELS[g.model].tdp_w * 1.02
            last[g.gpu_uuid] = (g.energy_j, g.power_w)


# --------------------------------------------------------------------------- required phenomena
def test_default_spec_shows_every_required_phenomenon(default_run):
    events = job_events(default_run)
    by_job: dict[str, list[JobEvent]] = defaultdict(list)
    for ev in events:
        by_job[ev.job_id].append(ev)

    def follows(evs: list[JobEvent], first: JobEventKind) -> bool:
        """`first`, then retried with attempt+1, then queued/allocated/started for that attempt."""
        for i, ev in enumerate(evs):
            if ev.kind != first:
                continue
            nxt = [x.kind for x in evs[i + 1:] if x.attempt == ev.attempt + 1]
            if nxt[:4] == [JobEventKind.retried, JobEventKind.queued, JobEventKind.allocated, JobEventKind.started]:
                return True
        return False

    assert any(follows(evs, JobEventKind.failed) for evs in by_job.values()), "no failed-then-retried job"
    assert any(follows(evs, JobEventKind.preempted) for evs in by_job.values()), "no preempted-then-retried job"

    # shared GPUs: fractional allocations, and a tick with several running containers on one GPU
    assert any(a.share_milli in (250, 500) for ev in events if ev.kind == JobEventKind.allocated for a in ev.gpus)
    assert any(len({p.container_id for p in g.processes}) >= 2 for t in ticks(default_run) for g in t.gpus)

    # GPUs going down, failing the job on them
    assert any(g.health == GpuHealth.down and g.down_reason == "xid 79" for t in ticks(default_run) for g in t.gpus)
    assert any(ev.kind == JobEventKind.failed and "xid 79" in (ev.reason or "") for ev in events)

    # holding without running: image pulls over a minute, hung jobs
    queued_at, allocated_at, pulls, waits = {}, {}, [], []
    for ev in events:
        k = (ev.job_id, ev.attempt)
        if ev.kind == JobEventKind.queued:
            queued_at[k] = ev.ts_ms
        elif ev.kind == JobEventKind.allocated:
            allocated_at[k] = ev.ts_ms
            waits.append(ev.ts_ms - queued_at[k])
        elif ev.kind == JobEventKind.started and k in allocated_at and ev.reason is None:
            pulls.append(ev.ts_ms - allocated_at.pop(k))
    assert max(pulls) > 60_000
    assert max(waits) > 10 * 60_000, "no real queue wait"
    kinds = Counter(ev.kind for ev in events)
    assert kinds[JobEventKind.interrupted] > 0
    assert any(ev.kind == JobEventKind.started and ev.reason == "resumed after hang" for ev in events)
    assert kinds[JobEventKind.checkpoint_begin] > 0 and kinds[JobEventKind.checkpoint_end] > 0
    assert kinds[JobEventKind.completed] > 0

    # demand above capacity at times, preemptions reported by the scheduler
    snaps = [e.message for e in default_run if isinstance(e.message, SchedulerSnapshot)]
    assert any(sum(q.pending_gpus for q in s.queues) > 0 for s in snaps)
    assert any(s.preemptions for s in snaps)

    assert len({ev.tenant for ev in events}) >= 5
    assert {ev.queue for ev in events} == {"prod", "research", "batch"}
    assert len({ev.priority for ev in events}) >= 3
    assert len({g.model for t in ticks(default_run) for g in t.gpus}) >= 2


def test_checkpoints_lower_utilization(default_run):
    """Between checkpoint_begin and checkpoint_end the job's GPUs work visibly less."""
    fold_ckpt: dict[str, set[str]] = {}
    during, training = [], []
    for e in default_run:
        m = e.message
        if isinstance(m, JobEvent):
            ctrs = {a.container_id for a in m.gpus}
            if m.kind == JobEventKind.checkpoint_begin:
                fold_ckpt[m.job_id] = ctrs
            elif m.kind in (JobEventKind.checkpoint_end, *TERMINAL_KINDS):
                fold_ckpt.pop(m.job_id, None)
        elif isinstance(m, NodeTick):
            in_ckpt = set().union(*fold_ckpt.values()) if fold_ckpt else set()
            for g in m.gpus:
                for p in g.processes:
                    (during if p.container_id in in_ckpt else training).append(p.sm_util_pct or 0)
    assert during and max(during) <= 25.0
    assert sum(training) / len(training) > 40


# --------------------------------------------------------------------------- small specs
def test_tiny_cluster_runs_and_stays_valid():
    spec = SimSpec(nodes=1, gpus_per_node=2, hours=1.0, seed=11)
    run = list(simulate(spec))
    assert len(ticks(run)) == 360
    assert job_events(run), "a tiny cluster still gets work"
    assert all(ev.requested_gpus <= 2 for ev in job_events(run))
    assert isinstance(run[-1].message, LifecycleWatermark) and run[-1].message.ts_ms == spec.end_ms


def test_spec_without_faults_or_preemption():
    from gpuledger.agents.simspec import SimRates

    spec = SimSpec(nodes=2, gpus_per_node=4, hours=2.0, rates=SimRates(preemption=False, gpu_faults_per_gpu_hour=0.0))
    run = list(simulate(spec))
    kinds = {ev.kind for ev in job_events(run)}
    assert JobEventKind.preempted not in kinds
    assert all(g.health == GpuHealth.ok for t in ticks(run) for g in t.gpus)


def test_invalid_spec_is_rejected_with_reasons():
    with pytest.raises(ValueError, match="unknown GPU models \\['B300'\\]"):
        SimSpec(node_models=("B300",))
    with pytest.raises(ValueError, match="hours must be > 0"):
        SimSpec(hours=0)
    with pytest.raises(ValueError, match="node_names must be 2 distinct non-empty names"):
        SimSpec(nodes=2, node_names=("a", "a"))


def test_named_nodes_send_their_ticks_and_hold_their_jobs_gpus():
    names = ("rack1-a", "rack7-b")
    run = list(simulate(SimSpec(nodes=2, gpus_per_node=2, hours=1.0, seed=11, node_names=names)))
    assert {t.node for t in ticks(run)} == set(names)
    assert {g.node for ev in job_events(run) for g in ev.gpus} <= set(names)
