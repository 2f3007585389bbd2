"""Executing measured, not assumed; GPUs named by index or MIG instance; nothing unmatched in silence.

Pure: the node join and the execution judge without Kafka or ClickHouse, on the golden fixture
ledger with the [execution] definition set per test."""

from dataclasses import replace
from pathlib import Path

import pytest

from gpuledger.schemas.models import (
    AllocationChange,
    GpuAssignment,
    GpuSample,
    MigDevice,
    NodeTick,
    ProcessSample,
)
from gpuledger.streams.join import NodeJoin
from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.pricing import LedgerConfigError, parse_definitions

FIXTURE_LEDGER = load_ledger_config(Path(__file__).parents[1] / "golden" / "ledger.toml")
T0 = 1_793_577_600_000
S = 1000
TICK = 10 * S


def ledger(source="both", floor=1.0, min_idle_s=0.0):
    d = replace(FIXTURE_LEDGER.definitions, execution_source=source, execution_util_floor_pct=floor,
                execution_min_idle_s=min_idle_s)
    # one record per tick (no segments): these tests read the judge's verdict tick by tick
    return replace(FIXTURE_LEDGER, definitions=d, segment_window_ms=1)


def gpu(uuid="GPU-a", index=0, util=None, processes=(), mig=()):
    return GpuSample(gpu_uuid=uuid, index=index, model="A100-80GB", util_gpu_pct=util, power_w=100.0,
                     processes=list(processes), mig_devices=list(mig))


def tick(k, *gpus, node="n1"):
    return NodeTick(cluster="c", node=node, ts_ms=T0 + TICK * k, interval_ms=TICK, gpus=list(gpus) or [gpu()])


def change(kind, at_s, gpus, job="j1", attempt=0, n=None):
    return AllocationChange(ts_ms=T0 + at_s * S, event_id=f"{job}-{attempt}-{kind}-{n or at_s}", kind=kind, node="n1",
                            job_id=job, attempt=attempt, tenant="t", queue="q", gpus=gpus)


def run(utils, *, source="both", floor=1.0, min_idle_s=0.0, assignment=None, processes=None):
    """One GPU allocated and started at 0, one tick per util value; GPU-ms by state."""
    assignment = assignment or GpuAssignment(node="n1", gpu_index=0, container_id="slurm-job-7")
    join = NodeJoin(node="n1")
    join.add_change(change("allocated", 0, [assignment]))
    join.add_change(change("started", 0, [assignment]))
    for k, util in enumerate(utils):
        procs = processes(k) if processes else ()
        join.add_tick(tick(k, gpu(util=util, processes=procs)))
    records = join.close_until(T0 + TICK * len(utils), ledger(source, floor, min_idle_s))
    states = [r["state"] for r in records]
    return states, join


# --------------------------------------------------------------------------- definitions
def test_execution_definition_is_read_and_checked():
    d = parse_definitions({"execution": {"source": "measured", "util_floor_pct": 0, "min_idle_s": 60}}, "x")
    assert (d.execution_source, d.execution_util_floor_pct, d.execution_min_idle_s) == ("measured", 0.0, 60.0)
    assert parse_definitions({}, "x").execution_source == "both"  # the default
    with pytest.raises(LedgerConfigError, match="execution.source"):
        parse_definitions({"execution": {"source": "vibes"}}, "x")
    with pytest.raises(LedgerConfigError, match="min_idle_s"):
        parse_definitions({"execution": {"min_idle_s": -1}}, "x")


# --------------------------------------------------------------------------- executing, measured
def test_events_definition_ignores_the_measurement():
    states, _ = run([0.0, 0.0, 50.0], source="events")
    assert states == ["executing"] * 3


def test_both_turns_quiet_ticks_idle_with_no_minimum_stretch():
    states, _ = run([50.0, 0.0, 0.0, 80.0], source="both", floor=0.0)
    assert states == ["executing", "allocated_idle", "allocated_idle", "executing"]


def test_a_quiet_stretch_is_idle_only_from_min_idle_on():
    # quiet from tick 1 (t=10 s); min 20 s: ticks starting at 30 s and later are idle
    states, join = run([50.0, 0.5, 0.5, 0.5, 0.5, 60.0, 0.5], floor=1.0, min_idle_s=20)
    assert states == ["executing", "executing", "executing", "allocated_idle", "allocated_idle", "executing", "executing"]
    assert join.judge.quiet_since["GPU-a"] == {("j1", 0): T0 + 6 * TICK}  # a new stretch began at the last tick


def test_nothing_measured_leaves_it_to_the_events():
    assert run([None, None], source="both")[0] == ["executing", "executing"]
    assert run([None, None], source="measured")[0] == ["executing", "executing"]


def test_measured_counts_a_busy_gpu_as_executing_before_any_started_event():
    join = NodeJoin(node="n1")
    a = GpuAssignment(node="n1", gpu_index=0)
    join.add_change(change("allocated", 0, [a]))
    for k, util in enumerate([0.0, 70.0]):
        join.add_tick(tick(k, gpu(util=util)))
    by_source = {}
    for source in ("measured", "both"):
        j = NodeJoin.from_state(join.to_state())
        for k, util in enumerate([0.0, 70.0]):
            j.add_tick(tick(k, gpu(util=util)))
        by_source[source] = [r["state"] for r in j.close_until(T0 + 2 * TICK, ledger(source, 0.0))]
    assert by_source == {"measured": ["allocated_idle", "executing"], "both": ["allocated_idle", "allocated_idle"]}


def test_a_gpu_busy_with_someone_elses_container_is_quiet_for_the_holder():
    other = [ProcessSample(pid=9, container_id="slurm-job-99", sm_util_pct=90.0)]
    states, _ = run([90.0, 90.0], processes=lambda k: other)
    assert states == ["allocated_idle", "allocated_idle"]
    mine = [ProcessSample(pid=9, container_id="slurm-job-7", sm_util_pct=90.0)]
    assert run([90.0], processes=lambda k: mine)[0] == ["executing"]


def test_quiet_stretches_survive_a_snapshot():
    _, join = run([50.0, 0.0], floor=0.0, min_idle_s=15)
    restored = NodeJoin.from_state(join.to_state())
    assert restored.judge.quiet_since == join.judge.quiet_since
    for k in (2, 3):
        restored.add_tick(tick(k, gpu(util=0.0)))
    # quiet since 10 s: the tick at 20 s is within the 15 s grace, the one at 30 s is past it
    assert [r["state"] for r in restored.close_until(T0 + 4 * TICK, ledger("both", 0.0, 15))] == \
        ["executing", "allocated_idle"]


def test_hung_and_stalled_shares_of_a_shared_gpu_go_idle_separately():
    a = GpuAssignment(node="n1", gpu_uuid="GPU-a", share_milli=500, container_id="ca")
    b = GpuAssignment(node="n1", gpu_uuid="GPU-a", share_milli=500, container_id="cb")
    join = NodeJoin(node="n1")
    for job, g in (("ja", a), ("jb", b)):
        join.add_change(change("allocated", 0, [g], job=job))
        join.add_change(change("started", 0, [g], job=job))
    procs = [ProcessSample(pid=1, container_id="ca", sm_util_pct=40.0, mem_used_bytes=1),
             ProcessSample(pid=2, container_id="cb", sm_util_pct=0.0, mem_used_bytes=1)]
    join.add_tick(tick(0, gpu(util=40.0, processes=procs)))
    records = join.close_until(T0 + TICK, ledger("both", 0.0))
    held = {(r["job_id"], r["state"]) for r in records if r["job_id"]}
    assert ("jb", "executing") not in held and ("jb", "allocated_idle") in held and ("ja", "executing") in held
    assert sum(r["gpu_ms"] for r in records) == TICK  # conservation holds


# --------------------------------------------------------------------------- GPUs by index and MIG
def test_a_gpu_index_resolves_to_the_uuid_the_node_reports_at_that_index():
    join = NodeJoin(node="n1")
    join.add_change(change("allocated", 0, [GpuAssignment(node="n1", gpu_index=1)]))
    join.add_change(change("started", 0, [GpuAssignment(node="n1", gpu_index=1)]))
    join.add_tick(tick(0, gpu("GPU-a", 0, 10.0), gpu("GPU-b", 1, 90.0)))
    records = join.close_until(T0 + TICK, ledger())
    assert {r["gpu_uuid"]: r["state"] for r in records} == {"GPU-a": "unallocated", "GPU-b": "executing"}
    assert join.take_unmatched() == {"busy_unallocated_gpu_seconds": 10.0}  # GPU-a works for no one


def test_a_mig_instance_holds_its_share_of_the_parent_gpu():
    mig = [MigDevice(uuid="MIG-1", profile="3g.40gb", share_milli=428), MigDevice(uuid="MIG-2", profile="4g.40gb",
                                                                                 share_milli=571)]
    join = NodeJoin(node="n1")
    for k, uuid in (("ja", "MIG-1"), ("jb", "MIG-2")):
        g = GpuAssignment(node="n1", gpu_uuid=uuid)
        join.add_change(change("allocated", 0, [g], job=k))
        join.add_change(change("started", 0, [g], job=k))
    join.add_tick(tick(0, gpu("GPU-a", 0, 50.0, mig=mig)))
    records = join.close_until(T0 + TICK, ledger("events"))
    shares = {r["job_id"]: r["share_milli"] for r in records}
    assert shares == {"ja": 428, "jb": 571, "": 1}
    assert sum(r["gpu_ms"] for r in records) == TICK
    assert join.take_unmatched() == {"mig_assignments": 4}  # two changes x two instances, resolved


def test_an_allocation_naming_a_gpu_the_node_does_not_report_is_counted():
    join = NodeJoin(node="n1")
    join.add_change(change("allocated", 0, [GpuAssignment(node="n1", gpu_index=5)]))
    join.add_tick(tick(0, gpu("GPU-a", 0, 0.0)))
    records = join.close_until(T0 + TICK, ledger())
    assert [r["state"] for r in records] == ["unallocated"]
    assert join.take_unmatched() == {"allocation_gpu_not_reporting": 1}
    assert join.take_unmatched() == {}


def test_changes_for_a_node_that_never_reports_are_counted_once_and_kept():
    join = NodeJoin(node="ghost")
    join.add_change(change("allocated", 0, [GpuAssignment(node="ghost", gpu_index=0)]))
    assert join.report_unknown_node(T0 + 5 * S, grace_ms=10 * S) == 0  # within the grace
    assert join.report_unknown_node(T0 + 60 * S, grace_ms=10 * S) == 1
    assert join.report_unknown_node(T0 + 120 * S, grace_ms=10 * S) == 0  # counted once
    assert len(join.pending_changes) == 1
    assert join.take_unmatched() == {"unknown_node_changes": 1}
