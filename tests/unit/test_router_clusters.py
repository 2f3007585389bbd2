"""A job is (cluster, job id), and a lifecycle watermark promises one cluster's events only.

Two Slurm clusters number their jobs independently, so both may run a job "1001"; the job-events key
is the bare job id, so both land on one partition and the router must keep them apart. And while
one cluster's scheduler agent spools through an outage, another cluster's watermarks must not close
its ticks. Driven through WorkerCore, the node-allocations outputs fed back as the Faust shell does."""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from pathlib import Path

import orjson

from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import (
    DeadLetter,
    GpuAssignment,
    GpuSample,
    JobEvent,
    LifecycleWatermark,
    NodeTick,
    UsageBatch,
)
from gpuledger.schemas.wire import decode, decode_node_allocation, encode, encode_node_ticks
from gpuledger.streams.core import JOIN, ROUTER, SNAPSHOT_VERSION, WorkerCore
from gpuledger.streams.router import LEGACY, LifecycleRouter
from gpuledger.streams.topic_names import TopicNames

LEDGER = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
T = TopicNames.with_prefix("t.")
T0 = 1_793_577_600_000
S = 1000
NODES = {"c1": ("n1", "GPU-a"), "c2": ("n2", "GPU-b")}


class Pipe:
    """One job-events and one gpu-samples partition; node-allocations outputs are fed back."""

    def __init__(self, **kw):
        self.core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER, **kw)
        self.offsets: Counter[str] = Counter()
        self.outs = []

    def node(self, topic, raw):
        self.outs.extend(self.core.on_node(topic, 0, self.offsets[topic], raw))
        self.offsets[topic] += 1

    def lifecycle(self, message):
        out = self.core.on_lifecycle(0, self.offsets["je"], encode(message))
        self.offsets["je"] += 1
        self.send(out)

    def send(self, out):
        for o in out:
            if o.topic == T.node_allocations:
                self.node(T.node_allocations, o.value)
            else:
                self.outs.append(o)

    def ticks(self, cluster, seconds, start_s=0):
        n, gpu = NODES[cluster]
        for k in range(start_s // 10, seconds // 10):
            self.node(T.gpu_samples, encode_node_ticks(n, [NodeTick(
                cluster=cluster, node=n, ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                gpus=[GpuSample(gpu_uuid=gpu, index=0, model="A100-80GB", power_w=300.0, util_gpu_pct=90.0)])]))

    def usage(self):
        by = defaultdict(int)
        for o in self.outs:
            if o.topic == T.usage:
                for r in decode(UsageBatch, o.value).records:
                    by[(r.cluster, r.state.value, r.job_id)] += r.gpu_ms // 1000
        return dict(by)

    def letters(self, topic):
        return [decode(DeadLetter, o.value).reason for o in self.outs if o.topic == topic]


def ev(cluster, kind, at_s, job="1001", attempt=0):
    n, gpu = NODES[cluster]
    return JobEvent(event_id=f"slurm:{cluster}:{job}:{attempt}:{kind}", ts_ms=T0 + at_s * S, kind=kind,
                    cluster=cluster, job_id=job, attempt=attempt, tenant=f"tenant-{cluster}", queue="q",
                    requested_gpus=1, gpus=[GpuAssignment(node=n, gpu_uuid=gpu)] if kind == "allocated" else [])


def mark(cluster, at_s):
    return LifecycleWatermark(cluster=cluster, ts_ms=T0 + at_s * S)


def forwarded(outs):
    return [decode_node_allocation(o.value).ts_ms for o in outs if o.topic == T.node_allocations]


# ------------------------------------------------------------------ defect A: a job is (cluster, job id)
def test_two_clusters_jobs_of_one_id_running_at_once_are_two_jobs():
    p = Pipe()
    for e in (ev("c1", "allocated", 0), ev("c1", "started", 0), ev("c2", "allocated", 20), ev("c2", "started", 20),
              ev("c1", "completed", 60), ev("c2", "completed", 120)):
        p.lifecycle(e)
    p.ticks("c1", 150)
    p.ticks("c2", 150)
    p.lifecycle(mark("c1", 3600))
    p.lifecycle(mark("c2", 3600))
    usage = p.usage()
    assert (usage[("c1", "executing", "1001")], usage[("c2", "executing", "1001")]) == (60, 100), usage
    assert usage[("c1", "unallocated", "")] == 90 and usage[("c2", "unallocated", "")] == 50
    assert p.letters(T.dead_letters) == [] and p.letters(T.late_events) == []


def test_one_clusters_ended_job_does_not_block_anothers_job_of_the_same_id():
    p = Pipe()
    for e in (ev("c1", "allocated", 0), ev("c1", "started", 0), ev("c1", "completed", 30),
              ev("c2", "allocated", 40), ev("c2", "started", 40), ev("c2", "completed", 140)):
        p.lifecycle(e)
    p.ticks("c1", 150)
    p.ticks("c2", 150)
    p.lifecycle(mark("c1", 3600))
    p.lifecycle(mark("c2", 3600))
    usage = p.usage()
    assert (usage[("c1", "executing", "1001")], usage.get(("c2", "executing", "1001"), 0)) == (30, 100), usage
    assert p.letters(T.dead_letters) == []
    # a duplicate is one of its own cluster's job only; each job's state is pruned on its own
    router = p.core.routers[0].router
    assert set(router.seen_event_ids) == {("c1", "1001"), ("c2", "1001")}
    assert router.is_duplicate(ev("c2", "started", 40)) and not router.is_duplicate(ev("c2", "failed", 40))


def test_router_state_of_two_clusters_survives_a_snapshot():
    router = LifecycleRouter()
    router.route(ev("c1", "allocated", 0))
    router.route(ev("c2", "allocated", 5))
    router.sequence_problem(ev("c2", "completed", 1))  # before its allocation: marks its end
    restored = LifecycleRouter.from_state(orjson.loads(orjson.dumps(router.to_state())))
    assert restored == router and set(restored.routes) == {("c1", "1001"), ("c2", "1001")}
    assert [c.node for c in restored.route(ev("c1", "completed", 30))] == ["n1"]
    assert set(restored.routes) == {("c2", "1001")}


def test_a_snapshot_keyed_by_job_id_alone_restores_and_its_job_goes_to_the_cluster_that_speaks_first():
    """A worker snapshot written before the router knew clusters: the entries record no cluster.
    Kept under LEGACY, the first event of that job id takes them over (exact for one cluster)."""
    old_router = {"routes": {"1001": [{"attempt": 0, "gpus": [GpuAssignment(node="n1", gpu_uuid="GPU-a")
                                                              .model_dump(mode="json")], "since_ms": T0}]},
                  "ended": {}, "seen": {"1001": ["slurm:c1:1001:0:allocated", "slurm:c1:1001:0:started"]},
                  "last_seen_ms": {"1001": T0}, "duplicates": 0}
    doc = {"version": SNAPSHOT_VERSION, "kind": ROUTER, "partition": 0,
           "state": {"router": old_router, "watermark_ms": T0, "next_offset": 2, "forwarded_ms": T0}}
    p = Pipe()
    p.core.restore(ROUTER, 0, zlib.compress(orjson.dumps(doc)))
    p.offsets["je"] = 2
    rp = p.core.routers[0]
    assert rp.router.legacy == {"1001"} and (LEGACY, "1001") in rp.router.routes
    assert (rp.watermark_ms, rp.closing_ms, rp.cluster_marks) == (T0, T0, {})
    p.lifecycle(ev("c1", "started", 0))  # seen before the snapshot: still a duplicate
    assert p.core.counters["duplicate_events"] == 1 and set(rp.router.routes) == {("c1", "1001")}
    p.lifecycle(ev("c1", "completed", 30))  # releases the node the old snapshot held
    p.lifecycle(ev("c2", "allocated", 40))  # another cluster's 1001: not that job's end
    assert p.letters(T.dead_letters) == [] and set(rp.router.routes) == {("c2", "1001")}
    # written again, the state is of the new form and reads back the same
    again = LifecycleRouter.from_state(orjson.loads(orjson.dumps(rp.router.to_state())))
    assert again == rp.router


# ------------------------------------------------------------------ defect B: a watermark is one cluster's promise
def test_one_clusters_watermark_does_not_close_anothers_ticks_while_its_agent_spools():
    p = Pipe()
    p.lifecycle(mark("c2", 0))  # c2's agent promised everything before T0, then went unreachable
    for k in range(30):  # 300 s of c2's samples while only c1's agent gets watermarks through
        p.ticks("c2", 10 * (k + 1), start_s=10 * k)
        p.lifecycle(mark("c1", 10 * (k + 1)))
    p.lifecycle(ev("c2", "allocated", 0, job="train-7"))  # c2's spooled events, then its watermark
    p.lifecycle(ev("c2", "started", 0, job="train-7"))
    p.lifecycle(mark("c2", 300))
    assert p.usage() == {("c2", "executing", "train-7"): 300}
    assert p.letters(T.late_events) == [] and p.letters(T.dead_letters) == []


def test_a_cluster_that_sends_no_watermark_is_closed_by_the_others_and_none_at_all_closes_nothing():
    p = Pipe()
    p.ticks("c2", 100)  # no lifecycle watermark yet: nothing closes (as with one cluster and no watermarks)
    assert p.usage() == {}
    p.lifecycle(mark("c1", 100))  # c2 never sent one: its ticks close by c1's, as before clusters counted
    assert p.usage() == {("c2", "unallocated", ""): 100}


def test_deferred_watermarks_forward_the_slowest_clusters_and_snapshot_per_cluster():
    p = Pipe(defer_watermarks=True)
    p.lifecycle(mark("c1", 50))
    p.lifecycle(mark("c2", 20))
    p.lifecycle(mark("c1", 90))
    assert forwarded(p.core.flush_watermarks()) == [T0 + 20 * S]
    rp = p.core.routers[0]
    assert (rp.watermark_ms, rp.cluster_marks) == (T0 + 90 * S, {"c1": T0 + 90 * S, "c2": T0 + 20 * S})
    restored = Pipe(defer_watermarks=True)
    restored.core.restore(ROUTER, 0, p.core.snapshot(ROUTER, 0))
    assert restored.core.routers[0] == rp
    restored.core.on_lifecycle(0, 3, encode(mark("c2", 70)))
    assert forwarded(restored.core.flush_watermarks()) == [T0 + 70 * S]
    # an older snapshot: one watermark of no cluster, forwarded already; the clusters' own take over
    doc = orjson.loads(zlib.decompress(p.core.snapshot(ROUTER, 0)))
    for key in ("cluster_marks", "closing_ms"):
        del doc["state"][key]
    doc["state"]["forwarded_ms"] = doc["state"]["watermark_ms"] = T0 + 40 * S
    old = Pipe(defer_watermarks=True)
    old.core.restore(ROUTER, 0, zlib.compress(orjson.dumps(doc)))
    assert old.core.routers[0].closing_ms == T0 + 40 * S and old.core.flush_watermarks() == []
    old.core.on_lifecycle(0, 3, encode(mark("c1", 60)))
    old.core.on_lifecycle(0, 4, encode(mark("c2", 30)))  # behind what was forwarded: nothing goes back
    assert old.core.flush_watermarks() == []
    old.core.on_lifecycle(0, 5, encode(mark("c2", 80)))
    assert forwarded(old.core.flush_watermarks()) == [T0 + 60 * S]


def test_a_cluster_further_behind_than_the_retention_stops_holding_the_others_back():
    p = Pipe(retention_ms=3600 * S)
    p.lifecycle(mark("c2", 0))
    p.lifecycle(mark("c1", 3000))
    assert p.core.routers[0].forwarded_ms == T0  # c2's agent may still send events of [T0, ...)
    p.lifecycle(mark("c1", 3601))  # c2 over an hour behind: a retired cluster, or too late to apply
    assert p.core.routers[0].forwarded_ms == T0 + 3601 * S


# ------------------------------------------------------------------ defect C: a node is (cluster, node name)
def test_two_clusters_nodes_of_one_name_are_two_nodes(monkeypatch):
    """Both clusters have a node001 (the Kafka key is the bare node name: one partition, one worker).
    One join for both took the first cluster's ticks and dead-lettered the other's as conflicting
    duplicates: c2's job billed nothing, its 150 GPU-seconds gone."""
    monkeypatch.setitem(NODES, "c1", ("node001", "GPU-a"))
    monkeypatch.setitem(NODES, "c2", ("node001", "GPU-b"))
    p = Pipe()
    seen = set()
    p.core.on_tick = lambda node, ts_ms, cluster: seen.add((cluster, node))  # the silence metric's series
    for e in (ev("c1", "allocated", 0), ev("c1", "started", 0), ev("c2", "allocated", 0, job="2002"),
              ev("c2", "started", 0, job="2002"), ev("c1", "completed", 100), ev("c2", "completed", 120, job="2002")):
        p.lifecycle(e)
    for k in range(15):  # the two nodes' ticks interleaved, at the same times
        p.ticks("c1", 10 * (k + 1), start_s=10 * k)
        p.ticks("c2", 10 * (k + 1), start_s=10 * k)
    p.lifecycle(mark("c1", 3600))
    p.lifecycle(mark("c2", 3600))
    assert p.usage() == {("c1", "executing", "1001"): 100, ("c1", "unallocated", ""): 50,
                         ("c2", "executing", "2002"): 120, ("c2", "unallocated", ""): 30}
    assert p.letters(T.dead_letters) == [] and p.letters(T.late_events) == []
    jp = p.core.joins[0]
    assert set(jp.nodes) == seen == {("c1", "node001"), ("c2", "node001")}
    twin = Pipe()
    twin.core.restore(JOIN, 0, p.core.snapshot(JOIN, 0))
    assert twin.core.joins[0] == jp


def test_a_change_that_names_no_cluster_goes_to_the_one_node_of_its_name(monkeypatch):
    """Changes written by a worker from before they carried their cluster, read after an upgrade, and
    joins restored from such a worker's snapshot (one per node name, under the cluster of its ticks, or
    none): they apply as before where the node name is one node's, and are refused, with the reason, only
    where two clusters have a node of that name."""
    monkeypatch.setitem(NODES, "c2", ("n1", "GPU-b"))

    def old_change(job, kind, at_s, gpu):
        change = {"ts_ms": T0 + at_s * S, "event_id": f"old:{job}:{kind}", "kind": kind, "node": "n1",
                  "job_id": job, "attempt": 0, "tenant": "t-old", "queue": "q",
                  "gpus": [{"node": "n1", "gpu_uuid": gpu}] if kind == "allocated" else []}
        return orjson.dumps({"schema_version": 1, "type": "alloc", **change})

    p = Pipe()
    p.node(T.node_allocations, old_change("7", "allocated", 0, "GPU-a"))  # before any tick: kept under cluster ""
    assert set(p.core.joins[0].nodes) == {("", "n1")}
    p.ticks("c1", 50)  # c1's node n1 speaks first: it takes the join over, and the old change with it
    assert set(p.core.joins[0].nodes) == {("c1", "n1")}
    p.node(T.node_allocations, old_change("7", "completed", 30, ""))  # the one n1 there is: c1's
    p.ticks("c2", 50)  # now two clusters have an n1: an old change cannot say which
    p.node(T.node_allocations, old_change("8", "allocated", 40, "GPU-b"))
    p.lifecycle(mark("c1", 3600))
    p.lifecycle(mark("c2", 3600))
    assert p.usage() == {("c1", "allocated_idle", "7"): 30, ("c1", "unallocated", ""): 20,
                         ("c2", "unallocated", ""): 50}
    (reason,) = p.letters(T.dead_letters)
    assert "old:8:allocated names no cluster and node n1 is a node of 2 clusters (c1, c2)" in reason


def test_a_node_known_only_from_its_clusters_changes_is_still_reported_unknown(monkeypatch):
    """A join now learns its cluster from the first change; it still counts as never heard from
    (unknown_node_changes) until a tick of its own comes."""
    monkeypatch.setitem(NODES, "c1", ("ghost", "GPU-g"))
    p = Pipe()
    p.lifecycle(ev("c1", "allocated", 0))
    p.lifecycle(mark("c1", 11 * 60))  # past the unknown-node grace of 10 minutes
    assert p.core.joins[0].nodes[("c1", "ghost")].cluster == "c1"
    assert p.core.counters["unmatched_unknown_node_changes"] == 1
