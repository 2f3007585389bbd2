"""WorkerCore, pure: a node that holds nothing and has sent no tick for `retention_ms` of the partition's
event time is retired from the join partition (autoscaled or decommissioned nodes kept their whole join,
and every snapshot carried it, for ever). Only its closed horizon stays: a tick from before it is still
late when the node comes back, and the node's new ticks are billed as before."""

from __future__ import annotations

from gpuledger.schemas.wire import encode_node_ticks
from gpuledger.streams.core import JoinPartition, WorkerCore
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, allocate, tick, watermark


def core_with(retention_min: int) -> tuple[WorkerCore, Feeder]:
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER,
                      retention_ms=retention_min * MIN)
    return core, Feeder(core)


def run(feed: Feeder, nodes_until: dict[str, int], minutes: int, start_min: int = 0) -> None:
    """10-s ticks of each node up to its minute, the watermark 30 s behind."""
    for r in range(start_min * 60 + 10, minutes * 60 + 1, 10):
        watermark(feed, T0 + (r - 30) * S)
        for node, until in nodes_until.items():
            if r <= until * 60:
                feed(T.gpu_samples, encode_node_ticks(node, [tick(node, T0 + (r - 10) * S)]))


def test_a_quiet_node_that_holds_nothing_is_retired_and_comes_back_billed_once() -> None:
    core, feed = core_with(retention_min=10)
    retired = []
    core.on_retired = lambda cluster, node: retired.append((cluster, node))  # the worker's age gauge forgets it
    run(feed, {"a": 40, "b": 5}, 40)
    assert retired == [("c", "b")]
    jp = core.joins[0]
    assert ("c", "b") not in jp.nodes and ("c", "a") in jp.nodes
    assert jp.retired == {("c", "b"): T0 + 5 * MIN}
    assert "GPU-b" not in jp.gpu_owners
    assert core.counters["retired_nodes"] == 1
    assert feed.billed("b") == 5 * MIN  # all of its time, billed before it went
    # the snapshot keeps the horizon
    assert JoinPartition.from_state(jp.to_state()).retired == jp.retired
    # b comes back: a tick it sent before it went (closed long ago) is late, not billed again; its new
    # ticks are billed
    feed(T.gpu_samples, encode_node_ticks("b", [tick("b", T0 + 2 * MIN)]))
    assert len(feed.late("b")) == 1
    run(feed, {"a": 50, "b": 50}, 50, start_min=40)
    assert feed.billed("b") + sum(t.interval_ms for t in jp.nodes[("c", "b")].pending_ticks) + \
        sum(sl[3] for seg in jp.nodes[("c", "b")].segments.values() for sl in seg.slots) == 15 * MIN
    assert ("c", "b") not in jp.retired


def test_a_quiet_node_whose_gpu_a_job_still_holds_is_kept() -> None:
    """b's GPU is allocated to a job that has not ended: its join holds the holder, and must stay (its
    next ticks are the job's)."""
    core, feed = core_with(retention_min=10)
    allocate(feed, "b")
    run(feed, {"a": 40, "b": 5}, 40)
    assert ("c", "b") in core.joins[0].nodes and core.counters["retired_nodes"] == 0
