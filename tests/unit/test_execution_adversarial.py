"""Executing or idle, measured, under adversarial input: neighbours' processes, down GPUs, holders that
leave and come back, snapshots between any two closes (docs/accounting.md §1a).

Pure: the node join and the execution judge, on the golden fixture ledger with the [execution]
definition set per test (helpers of tests/unit/test_execution.py); two tests check the node join's
side (an unheld GPU ends its stretches; a tick cut by another job's change is judged whole)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuledger.schemas.models import GpuAssignment, GpuHealth, ProcessSample
from gpuledger.streams.attribution import Holder
from gpuledger.streams.execution import ACTIVE, QUIET, UNKNOWN, ExecutionJudge, measured_activity
from gpuledger.streams.join import NodeJoin
from test_execution import T0, TICK, change, gpu, ledger, run, tick

MINE, OTHER = "slurm-job-7", "slurm-job-99"
HOLDER = Holder("j1", 0, "t", "q", 1000, True, MINE)


def proc(container, sm=None, mem=10**9, pid=1):
    return ProcessSample(pid=pid, container_id=container, sm_util_pct=sm, mem_used_bytes=mem)


# --------------------------------------------------------------------------- neighbours
def test_a_busy_neighbour_does_not_make_a_hung_job_look_busy():
    # The job's process holds memory and runs nothing (NVML: no SM sample for it); another container's
    # process works at 90 %. The GPU's 90 % is the neighbour's: the job is quiet. It was executing.
    hung = [proc(MINE, sm=None, pid=1), proc(OTHER, sm=90.0, pid=2)]
    assert run([90.0, 90.0], processes=lambda k: hung)[0] == ["allocated_idle", "allocated_idle"]
    # an unattributed process (no container) measured beside it says as much
    rogue = [proc(MINE, sm=None, pid=1), proc(None, sm=90.0, pid=2)]
    assert run([90.0], processes=lambda k: rogue)[0] == ["allocated_idle"]


def test_a_neighbour_nobody_measures_leaves_a_busy_gpu_to_the_events():
    # no per-process SM shares at all: a GPU at 90 % with another container on it is not the holder's
    # work, nor proof of its idleness; at 0 % nobody works on it
    both = [proc(MINE, pid=1), proc(OTHER, pid=2)]
    g = gpu(util=90.0, processes=both)
    assert measured_activity(g, HOLDER, True, 1.0) == UNKNOWN
    assert measured_activity(gpu(util=0.0, processes=both), HOLDER, True, 1.0) == QUIET
    # under `measured`, an attempt the events do not call running is no longer executing on the
    # neighbour's 90 % (it was: the GPU's activity counted as the holder's)
    join = NodeJoin(node="n1")
    join.add_change(change("allocated", 0, [GpuAssignment(node="n1", gpu_index=0, container_id=MINE)]))
    join.add_tick(tick(0, gpu(util=90.0, processes=both)))
    assert [r["state"] for r in join.close_until(T0 + TICK, ledger("measured", 1.0, 0))] == ["allocated_idle"]


def test_without_per_container_data_a_holder_alone_is_judged_by_the_gpu():
    # Slurm without cgroup tracking: processes carry no container; the GPU's activity is the job's
    g = gpu(util=80.0, processes=[proc(None, sm=80.0)])
    assert measured_activity(g, HOLDER, True, 1.0) == ACTIVE
    assert measured_activity(gpu(util=0.5, processes=[proc(None, sm=0.5)]), HOLDER, True, 1.0) == QUIET
    # a holder named by no container: the processes may be its own
    anonymous = Holder("j1", 0, "t", "q", 1000, True)
    assert measured_activity(gpu(util=80.0, processes=[proc(OTHER, sm=80.0)]), anonymous, True, 1.0) == ACTIVE
    # no processes listed: the GPU's activity
    assert measured_activity(gpu(util=80.0), HOLDER, True, 1.0) == ACTIVE


others = st.lists(st.builds(proc, container=st.sampled_from([None, OTHER, "k8s://ns/pod/c"]),
                            sm=st.one_of(st.none(), st.floats(0, 100)), mem=st.one_of(st.none(), st.integers(0, 10**10)),
                            pid=st.integers(2, 99)), max_size=4)


@given(own=st.floats(1.0001, 100), neighbours=others, whole=st.one_of(st.none(), st.floats(0, 100)),
       alone=st.booleans())
def test_a_busy_job_stays_busy_whatever_runs_beside_it(own, neighbours, whole, alone):
    g = gpu(util=whole, processes=[proc(MINE, sm=own), *neighbours])
    assert measured_activity(g, HOLDER, alone, 1.0) == ACTIVE


@given(own=st.one_of(st.none(), st.floats(0, 1.0)), neighbours=others, whole=st.one_of(st.none(), st.floats(0, 100)),
       alone=st.booleans())
def test_an_idle_job_never_looks_busy_with_a_neighbours_work(own, neighbours, whole, alone):
    # the holder's processes are listed, measured at or below the floor or not at all; whatever its
    # neighbours do, it is never ACTIVE while another container's or a measured process shares the GPU
    g = gpu(util=whole, processes=[proc(MINE, sm=own), *neighbours])
    shared_with_someone = any(p.container_id not in (None, MINE) or p.sm_util_pct is not None for p in neighbours)
    if own is not None or shared_with_someone:
        assert measured_activity(g, HOLDER, alone, 1.0) != ACTIVE


# --------------------------------------------------------------------------- the quiet stretch's state
def test_a_down_gpu_ends_the_quiet_stretch():
    # quiet from 0 s, min_idle 30 s; down 10-150 s (its samples still read 0 %); back at 150 s and still
    # quiet: a new stretch from 150 s, idle from 180 s. Before, the stretch ran on through the down time
    # and the job was idle at 150 s straight away.
    join = NodeJoin(node="n1")
    a = GpuAssignment(node="n1", gpu_index=0, container_id=MINE)
    join.add_change(change("allocated", 0, [a]))
    join.add_change(change("started", 0, [a]))
    for k in range(20):
        g = gpu(util=0.0)
        join.add_tick(tick(k, g.model_copy(update={"health": GpuHealth.down, "down_reason": "xid 48"}) if 1 <= k < 15 else g))
    states = [r["state"] for r in join.close_until(T0 + 20 * TICK, ledger("both", 1.0, 30))]
    assert states == ["executing"] + ["down"] * 14 + ["executing"] * 3 + ["allocated_idle"] * 2
    assert join.judge.quiet_since["GPU-a"] == {("j1", 0): T0 + 15 * TICK}


def test_the_judge_forgets_a_down_gpus_stretches_directly():
    judge = ExecutionJudge({"GPU-a": {("j1", 0): T0}})
    down = gpu(util=0.0).model_copy(update={"health": GpuHealth.down})
    d = ledger("both", 1.0, 0).definitions
    assert judge.judge(down, [HOLDER], T0 + TICK, d) == [HOLDER]  # the records are `down` anyway
    assert judge.quiet_since == {}


def test_a_restarted_container_starts_a_new_quiet_stretch():
    # Kubernetes: the attempt's container ca is quiet from 0 s and restarts at 30 s as cb (the agent sends
    # the GPU set again, from the new container's start, with `started`); cb loads its data, quiet too.
    # min_idle 20 s: ca's stretch makes 20 s idle; cb's own stretch begins at 30 s, so 30 and 40 s are
    # its grace and 50 s idle. Before, cb went on with ca's stretch and was idle from 30 s.
    join = NodeJoin(node="n1")
    for n, at, container in ((1, 0, "ca"), (2, 30, "cb")):
        g = GpuAssignment(node="n1", gpu_index=0, container_id=container)
        join.add_change(change("allocated", at, [g], n=n))
        join.add_change(change("started", at, [g], n=n))
    for k in range(6):
        container = "ca" if k < 3 else "cb"
        join.add_tick(tick(k, gpu(util=0.0, processes=[proc(container, sm=0.0)])))
    states = [r["state"] for r in join.close_until(T0 + 6 * TICK, ledger("both", 1.0, 20))]
    assert states == ["executing", "executing", "allocated_idle", "executing", "executing", "allocated_idle"]


def test_quiet_stretches_of_an_older_snapshot_go_on():
    # a snapshot written before the judge kept each stretch's container: [job, attempt, since]
    judge = ExecutionJudge.from_state({"GPU-a": [["j1", "0", T0]]})
    d = ledger("both", 1.0, 20).definitions
    assert [h.running for h in judge.judge(gpu(util=0.0), [HOLDER], T0 + 3 * TICK, d)] == [False]  # idle: since T0
    # the stretch's container is kept beside the stretches, in a shape an earlier worker ignores
    assert judge.to_state() == {"GPU-a": [["j1", 0, T0]]}
    assert judge.containers_to_state() == {"GPU-a": [["j1", 0, MINE]]}
    assert ExecutionJudge.from_state(judge.to_state(), judge.containers_to_state()) == judge


def test_a_gpu_held_again_after_a_gap_starts_a_new_stretch():
    # j1 holds GPU-a and GPU-b; GPU-a is quiet throughout. At 20 s its set shrinks to GPU-b (a pod of the
    # attempt ended), at 300 s GPU-a is in it again (a new pod of the same attempt). Its quiet stretch
    # starts at 300 s, so with min_idle 60 s GPU-a is idle from 360 s — not at 300 s, by the stretch
    # that began at 0 s before the attempt let the GPU go (same key (job, attempt): also a Kubernetes Job
    # re-created under its name, a Slurm job id reused).
    a = GpuAssignment(node="n1", gpu_index=0, container_id="c")
    b = GpuAssignment(node="n1", gpu_index=1, container_id="c")
    join = NodeJoin(node="n1")
    for n, at, gpus in ((1, 0, [a, b]), (2, 20, [b]), (3, 300, [a, b])):
        join.add_change(change("allocated", at, gpus, n=n))
        join.add_change(change("started", at, gpus, n=n))
    for k in range(40):
        join.add_tick(tick(k, gpu("GPU-a", 0, 0.0), gpu("GPU-b", 1, 50.0)))
    records = join.close_until(T0 + 40 * TICK, ledger("both", 1.0, 60))
    idle = [(r["start_ms"] - T0) // 1000 for r in records if r["gpu_uuid"] == "GPU-a" and r["state"] == "allocated_idle"]
    assert idle[0] == 360


def test_another_tenants_change_does_not_move_a_holders_idle_time():
    # docs/accounting.md §1a: "Granularity is the tick". j1's GPU-a is quiet from 0 s, min_idle 25 s: the
    # ticks at 30 and 40 s are idle (20 s). Another tenant's job allocated on GPU-b at 25 s cuts the tick
    # 20-30 s of the whole node, and j1's second half of it was judged on its own start (25 s): 5 s moved
    # from j1's compute to its idle line by someone else's event.
    def j1_idle(other_change: bool) -> int:
        join = NodeJoin(node="n1")
        a = GpuAssignment(node="n1", gpu_index=0)
        join.add_change(change("allocated", 0, [a]))
        join.add_change(change("started", 0, [a]))
        if other_change:
            join.add_change(change("allocated", 25, [GpuAssignment(node="n1", gpu_index=1)], job="other"))
        for k in range(5):
            join.add_tick(tick(k, gpu("GPU-a", 0, 0.0), gpu("GPU-b", 1, 0.0)))
        records = join.close_until(T0 + 5 * TICK, ledger("both", 1.0, 25))
        return sum(r["gpu_ms"] for r in records if r["job_id"] == "j1" and r["state"] == "allocated_idle")

    assert j1_idle(False) == 20_000
    assert j1_idle(True) == 20_000


# --------------------------------------------------------------------------- replays and restarts
step = st.tuples(st.sampled_from(["busy", "quiet", "hung-beside-busy", "unmeasured", "down", "gone"]),
                 st.booleans())  # what GPU-a's tick shows; whether a snapshot is taken after it closes


def _sample(kind: str):
    if kind == "busy":
        return gpu("GPU-a", 0, 70.0, processes=[proc(MINE, sm=70.0)])
    if kind == "quiet":
        return gpu("GPU-a", 0, 0.0, processes=[proc(MINE, sm=0.0)])
    if kind == "hung-beside-busy":
        return gpu("GPU-a", 0, 90.0, processes=[proc(MINE, pid=1), proc(OTHER, sm=90.0, pid=2)])
    if kind == "unmeasured":
        return gpu("GPU-a", 0, None)
    return gpu("GPU-a", 0, 0.0).model_copy(update={"health": GpuHealth.down})


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=25), source=st.sampled_from(["both", "measured"]))
def test_snapshots_between_closes_give_the_records_of_one_run(steps, source):
    """The quiet stretch is the judge's only state: closing tick by tick, with a snapshot and restore
    after any of them, gives exactly the records of one run closed at once."""
    led = ledger(source, 1.0, 25)
    a = GpuAssignment(node="n1", gpu_index=0, container_id=MINE)

    def fresh() -> NodeJoin:
        join = NodeJoin(node="n1")
        join.add_change(change("allocated", 0, [a]))
        join.add_change(change("started", 0, [a]))
        return join

    ticks = []
    for k, (kind, _) in enumerate(steps):
        gpus = [gpu("GPU-b", 1, 10.0)] + ([] if kind == "gone" else [_sample(kind)])
        ticks.append(tick(k, *gpus))
    whole = fresh()
    for t in ticks:
        whole.add_tick(t)
    expected = whole.close_until(T0 + len(ticks) * TICK, led)

    join, got = fresh(), []
    for k, (t, (_, snapshot)) in enumerate(zip(ticks, steps)):
        join.add_tick(t)
        got += join.close_until(T0 + (k + 1) * TICK, led)
        if snapshot:
            join = NodeJoin.from_state(join.to_state())
    assert got == expected
