"""One GPU UUID reported by two nodes (a cloned agent or VM image, a fake backend): both nodes' ticks
were billed, as records with the same ids (`gpu/start/slot`), and the sink's per-GPU horizon kept
whichever came first, dropping the other node's in silence: a clone that started a minute after the
real node left 60,000 of its job's 600,000 GPU-ms in the warehouse. The first node to report a UUID
in its partition keeps it; the other's ticks are dead letters naming both, until the first has sent
nothing for GPU_MOVE_MS (a GPU moved between nodes). streams/core.py `_gpu_taken`."""

from __future__ import annotations

from gpuledger.schemas.models import UsageBatch
from gpuledger.schemas.wire import decode, encode_node_ticks
from gpuledger.streams.core import GPU_MOVE_MS, JOIN, WorkerCore
from worker_feeder import LEDGER, MIN, S, T, T0, Feeder, allocate, tick, watermark


def records(feed: Feeder):
    return [r for o in feed.outs if o.topic == T.usage for r in decode(UsageBatch, o.value).records]


def run(clone_from: int, ticks: int = 60, core: WorkerCore | None = None) -> Feeder:
    """Node a (job-a holds its GPU) ticks every 10 s; from tick `clone_from` on, node "0" reports a's GPU too."""
    core = core or WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    allocate(feed, "a", kinds=("allocated", "started"))
    for k in range(ticks):
        ts = T0 + k * 10 * S
        now = ts + 10 * S + 500
        if k >= clone_from:
            feed(T.gpu_samples, encode_node_ticks("0", [tick("0", ts, gpu_uuid="GPU-a")]), now)
        feed(T.gpu_samples, encode_node_ticks("a", [tick("a", ts)]), now)
        watermark(feed, ts + 10 * S, now)
    return feed


def test_a_clone_of_a_reporting_node_is_refused_and_the_job_is_billed_once():
    feed = run(clone_from=6)
    gpu_a = [r for r in records(feed) if r.gpu_uuid == "GPU-a"]
    # before the fix: 1,140,000 GPU-ms of GPU-a from two nodes, with colliding record ids
    assert {r.node for r in gpu_a} == {"a"}, "node 0's ticks of GPU-a were billed too"
    assert len({r.record_id for r in gpu_a}) == len(gpu_a)
    assert sum(r.gpu_ms for r in gpu_a if r.job_id == "job-a") == 600_000
    reasons = [d.reason for d in feed.letters()]
    assert len(reasons) == 54 and all(r.startswith("inconsistent tick: 0 ts_ms=") for r in reasons)
    assert "reports GPU GPU-a, which node a of cluster c reports" in reasons[0]


def test_the_first_reporter_keeps_the_gpu_across_a_snapshot():
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    run(clone_from=6, ticks=12, core=core)
    twin = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    twin.restore(JOIN, 0, core.snapshot(JOIN, 0))
    assert twin.joins[0] == core.joins[0] and twin.joins[0].gpu_owner_keys() == {"GPU-a": ["c", "a"]}
    assert twin.joins[0].gpu_owners["GPU-a"] is twin.joins[0].nodes[("c", "a")]
    offset = core.join_partition(0).next_offsets[T.gpu_samples]
    ts = T0 + 12 * 10 * S
    outs = twin.on_node(T.gpu_samples, 0, offset, encode_node_ticks("0", [tick("0", ts, gpu_uuid="GPU-a")]), ts + 11 * S)
    assert [o.topic for o in outs] == [T.dead_letters]


def test_a_gpu_moved_to_another_node_is_taken_once_the_first_is_silent():
    """Node a reports its GPU for a minute and stops; node b reports that GPU from GPU_MOVE_MS after the end of a's
    last tick (moved): b's ticks are accepted, and a's would now be refused."""
    core = WorkerCore(T, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(core)
    for k in range(6):
        ts = T0 + k * 10 * S
        feed(T.gpu_samples, encode_node_ticks("a", [tick("a", ts)]), ts + 10 * S + 500)
        watermark(feed, ts + 10 * S)
    too_soon = T0 + 60 * S + GPU_MOVE_MS - 10 * S  # a's last tick ended at T0 + 60 s
    feed(T.gpu_samples, encode_node_ticks("b", [tick("b", too_soon, gpu_uuid="GPU-a")]), too_soon + 11 * S)
    assert len(feed.letters()) == 1
    for k in range(6):
        ts = T0 + 60 * S + GPU_MOVE_MS + k * 10 * S
        feed(T.gpu_samples, encode_node_ticks("b", [tick("b", ts, gpu_uuid="GPU-a")]), ts + 11 * S)
        watermark(feed, ts + 10 * S)
    assert len(feed.letters()) == 1
    assert core.joins[0].gpu_owner_keys() == {"GPU-a": ["c", "b"]}
    watermark(feed, T0 + 60 * S + GPU_MOVE_MS + 10 * MIN)
    assert sum(r.gpu_ms for r in records(feed) if r.node == "b") == 60_000
