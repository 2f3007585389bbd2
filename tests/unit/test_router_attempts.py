"""The router keeps a route per attempt until it ends: an attempt moved to other GPUs releases the
nodes it left, and an attempt's end read after the next attempt's `allocated` still releases its
own GPUs (records through the node join, conservation checked)."""

import orjson
import pytest
from pathlib import Path

from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, NodeTick
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.router import LifecycleRouter

LEDGER = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
T0 = 1_793_577_600_000
S = 1000
A, B = GpuAssignment(node="n1", gpu_uuid="A"), GpuAssignment(node="n2", gpu_uuid="B")


def event(kind, at_s, n, job="j1", attempt=0, gpus=()):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id=job, attempt=attempt,
                    tenant="t", queue="q", gpus=list(gpus))


def tick(k, node, uuids):
    return NodeTick(cluster="c", node=node, ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid=u, index=i, model="A100-80GB", power_w=100.0) for i, u in enumerate(uuids)])


def run(events, gpus_by_node, seconds=100):
    """Events through sequence checks and the router into one join per node; records per
    (gpu, state, job, attempt) -> gpu_ms, and the rejected events' reasons."""
    router, joins, rejected = LifecycleRouter(), {n: NodeJoin(node=n) for n in gpus_by_node}, []
    for e in events:
        problem = router.sequence_problem(e)
        if problem:
            rejected.append(problem)
            continue
        for change in router.route(e):
            joins[change.node].add_change(change)
    out = {}
    for node, uuids in gpus_by_node.items():
        for k in range(seconds // 10):
            joins[node].add_tick(tick(k, node, uuids))
        records = joins[node].close_until(T0 + seconds * S, LEDGER)
        for uuid in uuids:  # conservation: each GPU's records tile its time
            assert sum(r["gpu_ms"] for r in records if r["gpu_uuid"] == uuid) == seconds * S
        for r in records:
            key = (r["gpu_uuid"], r["state"], r["job_id"], r["attempt"])
            out[key] = out.get(key, 0) + r["gpu_ms"]
    return out, rejected, router


def test_an_attempt_moved_off_a_node_is_released_there():
    # what agents/kubernetes.py `_reallocate` sends: one pod of the 2-pod job ends at 30 s, the attempt
    # is re-allocated on n1/A only; j2 takes n2/B at 50 s; j1 completes at 60 s
    events = [event("allocated", 0, 1, gpus=[A, B]), event("started", 0, 2),
              event("allocated", 30, 3, gpus=[A]), event("started", 30, 4),
              event("allocated", 50, 1, job="j2", gpus=[B]), event("started", 50, 2, job="j2"),
              event("completed", 60, 5)]
    out, rejected, router = run(events, {"n1": ["A"], "n2": ["B"]})
    assert not rejected
    assert out[("B", "executing", "j1", 0)] == 30_000  # not until j1's end (or for ever)
    assert out[("B", "unallocated", "", 0)] == 20_000 and out[("B", "executing", "j2", 0)] == 50_000
    assert out[("A", "executing", "j1", 0)] == 60_000
    assert "j1" not in router.routes


def test_the_release_goes_to_the_left_node_only_at_the_new_allocation_time():
    router = LifecycleRouter()
    router.route(event("allocated", 0, 1, gpus=[A, B]))
    changes = router.route(event("allocated", 30, 2, gpus=[A]))
    assert [(c.node, c.kind.value, [g.gpu_uuid for g in c.gpus], c.ts_ms, c.event_id) for c in changes] == [
        ("n1", "allocated", ["A"], T0 + 30 * S, "j1-2"), ("n2", "allocated", [], T0 + 30 * S, "j1-2")]


@pytest.mark.parametrize("end", ["failed", "cancelled", "preempted", "completed"])
def test_an_attempts_end_read_after_the_next_attempts_allocation_releases_its_gpus(end):
    events = [event("allocated", 0, 1, gpus=[A]), event("started", 5, 2),
              event("allocated", 40, 4, attempt=1, gpus=[GpuAssignment(node="n1", gpu_uuid="B")]),
              event(end, 30, 3, attempt=0)]  # dated before attempt 1's allocation, read after it
    out, rejected, router = run(events, {"n1": ["A", "B"]})
    assert not rejected
    assert out[("A", "executing", "j1", 0)] == 25_000 and out[("A", "allocated_idle", "j1", 0)] == 5_000
    assert out[("A", "unallocated", "", 0)] == 70_000
    assert out[("B", "allocated_idle", "j1", 1)] == 60_000
    assert list(router.routes[("c", "j1")]) == [1]  # the ended attempt's route is dropped


def test_impossible_sequences_of_older_attempts_are_still_rejected():
    router = LifecycleRouter()
    for e in (event("allocated", 0, 1, gpus=[A]), event("allocated", 40, 2, attempt=1, gpus=[A])):
        router.route(e)
    assert "never allocated" in router.sequence_problem(event("completed", 50, 3, attempt=2))
    assert "before its allocation" in router.sequence_problem(event("completed", -5, 4, attempt=0))
    router.route(event("completed", 30, 5, attempt=0))
    assert "already ended" in router.sequence_problem(event("failed", 35, 6, attempt=0))
    assert "after the attempt's end" in router.sequence_problem(event("started", 36, 7, attempt=0))


def test_per_attempt_routes_survive_a_snapshot_and_old_snapshots_load():
    router = LifecycleRouter()
    router.route(event("allocated", 0, 1, gpus=[A]))
    router.route(event("allocated", 40, 2, attempt=1, gpus=[B]))
    restored = LifecycleRouter.from_state(orjson.loads(orjson.dumps(router.to_state())))
    assert restored == router and sorted(restored.routes[("c", "j1")]) == [0, 1]
    # a snapshot written with one route per job
    old = {"routes": {"j1": {"attempt": 1, "gpus": [B.model_dump(mode="json")], "since_ms": T0}},
           "seen": {"j1": ["j1-1"]}}
    loaded = LifecycleRouter.from_state(old)
    # an old snapshot's entry has no cluster ("") until the job's next event names it
    assert loaded.routes[("", "j1")][1].gpus == [B] and loaded.routes[("", "j1")][1].since_ms == T0
    assert [c.node for c in loaded.route(event("completed", 50, 3, attempt=1))] == ["n2"]
    assert loaded.routes == {}


@pytest.mark.parametrize("order", ["started then end", "checkpoint then end"])
def test_an_end_dated_before_an_event_of_its_attempt_already_routed_still_releases_the_gpu(order):
    # A producer whose clocks disagree (no agent of ours: they keep a job's events in time order).
    # Routed at its own time the end came before the running event in the node join, which then held
    # the GPU for the ended attempt for ever (80 of 100 s executing, the router thinking it ended).
    # The end takes effect at the latest time already routed for its attempt.
    running = event("started", 60, 2) if order == "started then end" else event("checkpoint_begin", 70, 2)
    events = [event("allocated", 0, 1, gpus=[A])] + ([] if order == "started then end" else [event("started", 0, 4)])
    out, rejected, router = run(events + [running, event("completed", 50, 3)], {"n1": ["A"]})
    assert not rejected and router.routes == {}
    held_until_s = running.ts_ms // S - T0 // S
    assert out[("A", "unallocated", "", 0)] == (100 - held_until_s) * S  # released, not held for ever
    assert sum(ms for (_, state, job, _), ms in out.items() if job == "j1") == held_until_s * S


def test_a_running_event_dated_before_its_attempts_allocation_takes_effect_from_the_allocation():
    # `started` at 5 s read after `allocated` at 10 s: at its own time the join applied it before the
    # allocation (5 s executing on a GPU the job did not hold yet), and the allocation then set the
    # attempt back to not running: its 40 s of work billed as idle.
    events = [event("allocated", 10, 1, gpus=[A]), event("started", 5, 2), event("completed", 50, 3)]
    out, rejected, _ = run(events, {"n1": ["A"]})
    assert not rejected
    assert out == {("A", "unallocated", "", 0): 60_000, ("A", "executing", "j1", 0): 40_000}


def test_a_node_left_by_a_reallocation_dated_before_a_routed_event_is_released():
    # n2 left at 30 s, read after the attempt's `started` at 40 s: the release must not come before
    # the `started` that holds n2's GPU, or n2 is held for ever
    events = [event("allocated", 0, 1, gpus=[A, B]), event("started", 40, 2),
              event("allocated", 30, 3, gpus=[A]), event("completed", 60, 4)]
    out, rejected, _ = run(events, {"n1": ["A"], "n2": ["B"]})
    assert not rejected
    assert out[("B", "unallocated", "", 0)] == 60_000 and out[("A", "unallocated", "", 0)] == 40_000


def test_an_allocation_older_than_the_attempts_current_one_is_rejected_as_stale():
    # the attempt's set of GPUs at 0 s (n1 and n2) read after its newer set at 30 s (n1 only): taken
    # as the current one, it held n2's GPU for ever (no change after it ever named n2 again)
    events = [event("allocated", 30, 1, gpus=[A]), event("allocated", 0, 2, gpus=[A, B]),
              event("completed", 60, 3)]
    out, rejected, router = run(events, {"n1": ["A"], "n2": ["B"]})
    assert rejected == [f"impossible sequence: allocated of j1 attempt 0 at ts_ms={T0} is before the attempt's "
                        f"current allocation at ts_ms={T0 + 30 * S} (a stale allocation, read after the newer one)"]
    assert out[("B", "unallocated", "", 0)] == 100_000
    assert out[("A", "allocated_idle", "j1", 0)] == 30_000 and router.routes == {}
