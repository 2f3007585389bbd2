"""The node join after a MIG reconfiguration: an allocation naming a MIG device the node's samples do
not list yet (the agent reads the layout now and then) is kept and tried again at each tick, billed
from the first tick that lists it; the pending assignment survives a snapshot and restore."""

import json
from pathlib import Path

from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import AllocationChange, GpuAssignment, GpuSample, MigDevice, NodeTick
from gpuledger.streams.join import NodeJoin

LEDGER = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
T0 = 1_793_577_600_000
S = 1000
OLD = [MigDevice(uuid="MIG-3333", profile="3g.40gb", share_milli=428),
       MigDevice(uuid="MIG-4444", profile="4g.40gb", share_milli=571)]
NEW = [OLD[0], MigDevice(uuid="MIG-5555", profile="4g.40gb", share_milli=571)]


def tick(at_s, migs):
    return NodeTick(cluster="c", node="n1", ts_ms=T0 + at_s * S, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=100.0, mig_devices=list(migs))])


def change(kind, at_s, n, refs, job="j1"):
    return AllocationChange(ts_ms=T0 + at_s * S, event_id=f"{job}-e{n}", kind=kind, node="n1", job_id=job,
                            tenant="t", queue="q", gpus=[GpuAssignment(node="n1", gpu_uuid=r) for r in refs])


def billed(records, job="j1"):
    return sum(r["gpu_ms"] for r in records if r["job_id"] == job)


def reconfigured(join, layout_seen_s=60, end_s=120, refs=("MIG-5555",), snapshot_at_s=None):
    """j1 allocated and started at 20 s on MIG-5555, which the ticks list from `layout_seen_s` on;
    completed at `end_s`. Closed 10 s at a time, optionally through a snapshot at `snapshot_at_s`."""
    for n, (kind, at) in enumerate((("allocated", 20), ("started", 20), ("completed", end_s))):
        join.add_change(change(kind, at, n, refs))
    for k in range(14):
        join.add_tick(tick(10 * k, NEW if 10 * k >= layout_seen_s else OLD))
    records, unmatched = [], {}
    for k in range(1, 15):
        records += join.close_until(T0 + 10 * k * S, LEDGER)
        for kind, amount in join.take_unmatched().items():
            unmatched[kind] = unmatched.get(kind, 0) + amount
        if snapshot_at_s == 10 * k:
            join = NodeJoin.from_state(json.loads(json.dumps(join.to_state())))
    return records, unmatched


def test_a_job_on_a_mig_device_the_samples_list_later_is_billed_from_that_tick():
    records, unmatched = reconfigured(NodeJoin(node="n1"))
    assert billed(records) == 571 * 60  # 60 s..120 s at 4/7; 20 s..60 s unbilled (the parent GPU unallocated)
    assert {r["state"] for r in records if r["job_id"] == "j1"} == {"executing"}
    # the unbilled stretch is reported as before: once per change applied while the name did not resolve
    assert unmatched["allocation_gpu_not_reporting"] == 2
    assert unmatched["mig_assignments"] == 1


def test_a_pending_unresolved_assignment_survives_a_snapshot_and_gives_the_same_records():
    straight, _ = reconfigured(NodeJoin(node="n1"))
    restored, _ = reconfigured(NodeJoin(node="n1"), snapshot_at_s=40)  # j1 pending, MIG-5555 not listed yet
    assert restored == straight
    join = NodeJoin(node="n1")
    join.add_change(change("allocated", 0, 0, ["MIG-5555"]))
    join.add_tick(tick(0, OLD))
    join.close_until(T0 + 10 * S, LEDGER)
    assert NodeJoin.from_state(json.loads(json.dumps(join.to_state()))) == join
    assert list(join.unresolved) == [("j1", 0)]


def test_an_attempt_that_ends_before_its_mig_device_is_listed_is_never_billed():
    records, _ = reconfigured(NodeJoin(node="n1"), layout_seen_s=80, end_s=50)
    assert billed(records) == 0
    assert {r["state"] for r in records} == {"unallocated"}


def test_an_instance_resolved_later_adds_to_the_instance_of_the_same_gpu_already_held():
    records, _ = reconfigured(NodeJoin(node="n1"), refs=("MIG-3333", "MIG-5555"))
    shares = sorted({r["share_milli"] for r in records if r["job_id"] == "j1"})
    assert shares == [428, 999]  # MIG-3333 alone from 20 s, both from 60 s
    assert billed(records) == 428 * 40 + 999 * 60
