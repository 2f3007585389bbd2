"""The node join: two MIG instances of one GPU held by one attempt add up; a tick overlapping a
pending one is rejected (its GPU time would count twice), so records never depend on when ticks
arrive relative to the watermark."""

from pathlib import Path

from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import AllocationChange, GpuAssignment, GpuSample, MigDevice, NodeTick
from gpuledger.streams.join import ACCEPTED, DUPLICATE, REJECTED, NodeJoin
from gpuledger.metrics import dead_letter_kind

LEDGER = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
T0 = 1_793_577_600_000
S = 1000
MIGS = [MigDevice(uuid="MIG-1", profile="3g.40gb", share_milli=428),
        MigDevice(uuid="MIG-2", profile="3g.40gb", share_milli=428),
        MigDevice(uuid="MIG-3", profile="1g.10gb", share_milli=142)]


def tick(at_s, interval_s=10, migs=()):
    return NodeTick(cluster="c", node="n1", ts_ms=T0 + at_s * S, interval_ms=interval_s * S,
                    gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=100.0, mig_devices=list(migs))])


def change(kind, at_s, n, refs):
    return AllocationChange(ts_ms=T0 + at_s * S, event_id=f"e{n}", kind=kind, node="n1", job_id="j1", tenant="t",
                            queue="q", gpus=[GpuAssignment(node="n1", gpu_uuid=r) for r in refs])


def mig_run(refs):
    join = NodeJoin(node="n1")
    for n, kind in enumerate(("allocated", "started")):
        join.add_change(change(kind, 0, n, refs))
    join.add_change(change("completed", 30, 9, refs))
    for k in range(3):
        join.add_tick(tick(10 * k, migs=MIGS))
    return join.close_until(T0 + 30 * S, LEDGER)


def by_state(records):
    out = {}
    for r in records:
        out[r["state"]] = out.get(r["state"], 0) + r["gpu_ms"]
    return out


def test_two_mig_instances_of_one_gpu_held_by_one_attempt_add_up():
    records = mig_run(["MIG-1", "MIG-2"])
    assert by_state(records) == {"executing": 25_680, "unallocated": 4_320}  # 856 thousandths of 30 s
    assert {r["share_milli"] for r in records if r["state"] == "executing"} == {856}
    # conservation: the costs are those of the whole GPU, to the micro-unit
    whole = mig_run([])
    assert sum(r["cost_micros"] for r in records) == sum(r["cost_micros"] for r in whole)


def test_mig_shares_of_one_gpu_are_capped_at_the_whole_gpu():
    records = mig_run(["MIG-1", "MIG-2", "MIG-3", "A"])
    assert by_state(records) == {"executing": 30_000}


def test_a_tick_overlapping_a_pending_tick_is_rejected_whatever_the_arrival():
    # an agent restarted at 20 s with 5 s sampling: its ticks lie inside the 60 s tick at 0
    join = NodeJoin(node="n1")
    assert join.add_tick(tick(0, 60)).status == ACCEPTED
    verdicts = [join.add_tick(tick(at, 5)) for at in range(20, 60, 5)]
    assert {v.status for v in verdicts} == {REJECTED}
    assert verdicts[0].reason.startswith("overlapping tick: n1 ts_ms=") and dead_letter_kind(verdicts[0].reason) == "invalid"
    assert join.add_tick(tick(60, 5)).status == ACCEPTED  # right after it: fine
    records = join.close_until(T0 + 65 * S, LEDGER)
    assert sum(r["gpu_ms"] for r in records) == 65_000  # each millisecond once
    # the same ticks with the 60 s one closed before the others arrive: the same records
    late = NodeJoin(node="n1")
    late.add_tick(tick(0, 60))
    first = late.close_until(T0 + 60 * S, LEDGER)
    assert {late.add_tick(tick(at, 5)).status for at in range(20, 60, 5)} == {DUPLICATE}
    late.add_tick(tick(60, 5))
    assert first + late.close_until(T0 + 65 * S, LEDGER) == records


def test_a_tick_overlapping_the_next_pending_tick_is_rejected():
    join = NodeJoin(node="n1")
    assert join.add_tick(tick(20, 10)).status == ACCEPTED
    assert join.add_tick(tick(10, 15)).status == REJECTED  # ends inside the tick at 20
    assert join.add_tick(tick(25, 10)).status == REJECTED  # starts inside it
    assert join.add_tick(tick(10, 10)).status == ACCEPTED  # ends where it starts
    assert join.add_tick(tick(20, 10)).status == DUPLICATE
    assert [t.ts_ms for t in join.pending_ticks] == [T0 + 10 * S, T0 + 20 * S] and join.pending_offsets == [None, None]
