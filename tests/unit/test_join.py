"""The join without Kafka: router fan-out, watermark clock, node join in event time."""

import random

from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, NodeTick, NodeWatermark
from gpuledger.streams.join import LifecycleRouter, NodeJoin, WatermarkClock
from gpuledger.streams.pricing import load_ledger_config

LEDGER = load_ledger_config()
T0 = 1_793_577_600_000
S = 1000


def event(kind, at_s, n, job="j1", attempt=0, gpus=()):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=T0 + at_s * S, kind=kind, cluster="c", job_id=job, attempt=attempt,
                    tenant="t", queue="q", gpus=list(gpus))


TWO_NODES = [GpuAssignment(node="n1", gpu_uuid="A"), GpuAssignment(node="n2", gpu_uuid="B", share_milli=500)]


def tick(k, node="n1", uuid="A"):
    return NodeTick(cluster="c", node=node, ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid=uuid, index=0, model="A100-80GB", power_w=100.0)])


def test_router_fans_out_by_node_and_remembers_the_allocation():
    router = LifecycleRouter()
    assert router.route(event("submitted", 0, 0)) == []
    changes = router.route(event("allocated", 1, 1, gpus=TWO_NODES))
    assert [(c.node, [g.gpu_uuid for g in c.gpus]) for c in changes] == [("n1", ["A"]), ("n2", ["B"])]
    started = router.route(event("started", 2, 2))  # carries no GPUs: the router knows them
    assert [c.node for c in started] == ["n1", "n2"] and started[1].gpus[0].share_milli == 500
    assert router.route(event("started", 2, 2)) == [] and router.duplicates == 1
    assert len(router.route(event("failed", 3, 3))) == 2
    assert router.route(event("started", 4, 4)) == []  # attempt ended: no GPUs any more


def test_watermark_clock_waits_for_every_source_partition():
    clock = WatermarkClock()
    assert clock.observe(NodeWatermark(ts_ms=50, source_partition=0, source_partitions=2)) == 0
    assert clock.observe(NodeWatermark(ts_ms=40, source_partition=1, source_partitions=2)) == 40
    assert clock.observe(NodeWatermark(ts_ms=30, source_partition=1, source_partitions=2)) == 40  # never goes back


def changes_for(router_events):
    router = LifecycleRouter()
    return [c for e in router_events for c in router.route(e) if c.node == "n1"]


SCENARIO = [event("allocated", 10, 1, gpus=TWO_NODES), event("started", 25, 2), event("completed", 50, 3)]


def summarise(records):
    out = {}
    for r in records:
        key = (r.state.value, r.job_id)
        out[key] = out.get(key, 0) + r.gpu_ms
    return out


def test_node_join_splits_ticks_at_changes_and_waits_for_watermark():
    join = NodeJoin(node="n1")
    for c in changes_for(SCENARIO):
        join.add_change(c)
    for k in range(6):
        assert join.add_tick(tick(k)) is None
    assert join.close_until(T0 + 25 * S, LEDGER) and join.closed_until_ms == T0 + 20 * S
    rest = join.close_until(T0 + 60 * S, LEDGER)
    assert join.pending_ticks == [] and join.closed_until_ms == T0 + 60 * S
    assert rest[-1].end_ms == T0 + 60 * S
    assert join.add_tick(tick(3)).startswith("late tick")


def test_records_do_not_depend_on_arrival_order():
    expected = None
    for seed in range(5):
        items = [("c", c) for c in changes_for(SCENARIO)] + [("t", tick(k)) for k in range(6)]
        random.Random(seed).shuffle(items)
        join = NodeJoin(node="n1")
        records = []
        for kind, item in items:
            if kind == "c":
                join.add_change(item)
            else:
                join.add_tick(item)
        records += join.close_until(T0 + 60 * S, LEDGER)
        got = summarise(records)
        assert got == {("unallocated", ""): 20_000, ("allocated_idle", "j1"): 15_000, ("executing", "j1"): 25_000}
        expected = expected or records
        assert records == expected


def test_duplicate_tick_is_rejected():
    join = NodeJoin(node="n1")
    assert join.add_tick(tick(0)) is None
    assert join.add_tick(tick(0)).startswith("duplicate tick")


def test_energy_from_counter_deltas_with_power_fallback():
    join = NodeJoin(node="n1")
    for k, energy in enumerate([1000.0, 1600.0, 2500.0]):
        t = tick(k)
        t = t.model_copy(update={"gpus": [t.gpus[0].model_copy(update={"energy_j": energy})]})
        join.add_tick(t)
    energies = [r.energy_j for r in join.close_until(T0 + 30 * S, LEDGER)]
    assert energies == [100.0 * 10, 600.0, 900.0]  # first: power x 10 s; then counter deltas
