"""Worker crash safety without Kafka: WorkerCore over topics kept as lists, snapshotted and
crashed at random points, restored from its last snapshots with consumers restarting at (or
before) the snapshot's offsets. Outputs written before a crash stay in the topics, so the
restarted worker's re-emissions are real duplicates; after the sink's per-GPU horizon, the usage
records equal the crash-free run's, record for record."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from gpuledger.agents.simcluster import SimSpec, batch_ticks, simulate
from gpuledger.streams.topic_names import TopicNames
from gpuledger.schemas.models import LifecycleWatermark, NodeWatermark, UsageBatch
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import MemoryProgress
from gpuledger.sink.rows import Source, usage_rows
from gpuledger.streams.core import JOIN, ROUTER, WorkerCore
from gpuledger.ledger_files import load_ledger_config

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults

LEDGER = load_ledger_config(UNIT_LEDGER)
TOPICS = TopicNames.with_prefix("t.")
P_SAMPLES, P_EVENTS = 2, 2


def partition_of(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n


def lay_out(emissions):
    """Messages on partitions as the publisher would lay them out."""
    samples = {p: [] for p in range(P_SAMPLES)}
    events = {p: [] for p in range(P_EVENTS)}
    for e in emissions:
        raw = encode(e.message)
        if e.line == "gpu-samples":
            samples[partition_of(e.key, P_SAMPLES)].append(raw)
        elif e.line == "job-events":
            if e.key is None:
                for p in events:
                    events[p].append(raw)
            else:
                events[partition_of(e.key, P_EVENTS)].append(raw)
    return samples, events


SPEC = SimSpec(hours=0.75, nodes=3, gpus_per_node=4, seed=3)


@pytest.fixture(scope="module")
def inputs():
    """The simulator's messages, laid out on partitions as the publisher would."""
    return lay_out(simulate(SPEC))


class Cluster:
    """Topics as lists and one worker core reading them at its own positions."""

    def __init__(self, samples, events, defer_watermarks: bool = False):
        self.defer_watermarks = defer_watermarks
        self.topics = {TOPICS.gpu_samples: dict(samples), TOPICS.job_events: dict(events),
                       TOPICS.node_allocations: {p: [] for p in range(P_SAMPLES)}}
        self.usage: list[bytes] = []
        self.dead: list[bytes] = []
        self.core = self.new_core(defer_watermarks)
        self.position = {(t, p): 0 for t, parts in self.topics.items() for p in parts}
        self.snapshots: dict[tuple[str, int], bytes] = {}
        self.crashes = 0

    @staticmethod
    def new_core(defer_watermarks: bool = False):
        return WorkerCore(TOPICS, partitions_gpu_samples=P_SAMPLES, partitions_job_events=P_EVENTS, ledger=LEDGER,
                          defer_watermarks=defer_watermarks)

    def ready(self):
        return [tp for tp, pos in self.position.items() if pos < len(self.topics[tp[0]][tp[1]])]

    def step(self, rng) -> bool:
        if self.defer_watermarks and rng.random() < 0.05:  # the app's flush timer
            self.deliver(self.core.flush_watermarks())
        ready = self.ready()
        if not ready:
            if self.defer_watermarks:
                held = self.core.flush_watermarks()
                self.deliver(held)
                return bool(held)
            return False
        topic, p = rng.choice(ready)
        offset = self.position[(topic, p)]
        raw = self.topics[topic][p][offset]
        self.position[(topic, p)] = offset + 1
        if topic == TOPICS.job_events:
            outs = self.core.on_lifecycle(p, offset, raw)
        else:
            outs = self.core.on_node(topic, p, offset, raw)
        self.deliver(outs)
        return True

    def deliver(self, outs) -> None:
        for out in outs:
            if out.topic == TOPICS.node_allocations:
                part = out.partition if out.partition is not None else partition_of(out.key.decode(), P_SAMPLES)
                self.topics[out.topic][part].append(out.value)
            elif out.topic == TOPICS.usage:
                self.usage.append(out.value)
            elif out.topic == TOPICS.dead_letters:
                self.dead.append(out.value)

    def snapshot(self) -> None:
        if self.defer_watermarks:  # as the app does: a snapshot never holds a watermark back
            self.deliver(self.core.flush_watermarks())
        for p in range(P_EVENTS):
            self.snapshots[(ROUTER, p)] = self.core.snapshot(ROUTER, p)
        for p in range(P_SAMPLES):
            self.snapshots[(JOIN, p)] = self.core.snapshot(JOIN, p)

    def crash(self, rng) -> None:
        """A new process: state from the last snapshots; each consumer restarts at or before the
        snapshot's offset (the committed offset may lag the snapshot)."""
        self.crashes += 1
        self.core = self.new_core(self.defer_watermarks)
        for (kind, p), blob in self.snapshots.items():
            self.core.restore(kind, p, blob)
        for (topic, p) in self.position:
            if topic == TOPICS.job_events:
                part = self.core.routers.get(p)
                covered = part.next_offset if part else 0
            else:
                part = self.core.joins.get(p)
                covered = part.next_offsets.get(topic, 0) if part else 0
            self.position[(topic, p)] = rng.randint(max(0, covered - 5), covered)

    def run(self, rng, crash_every: int | None = None) -> None:
        steps = 0
        while self.step(rng):
            steps += 1
            if crash_every and rng.random() < 1 / crash_every:
                self.snapshot()
            if crash_every and rng.random() < 1 / (3 * crash_every):
                self.crash(rng)


def sink_records(usage: list[bytes]) -> dict[str, dict]:
    """What the warehouse ends up with: the sink's horizon filter over the usage stream."""

    class Store:
        rows: list[dict] = []

        def write(self, table, rows, token=None):
            self.rows.extend(rows)

    store = Store()
    store.rows = []
    sink = BatchingSink(store, MemoryProgress(), usage_topic="u")
    for offset, raw in enumerate(usage):
        sink.add({"usage_raw": usage_rows(decode(UsageBatch, raw), Source("u", 0, offset))}, Source("u", 0, offset))
    sink.flush()
    out = {}
    for r in store.rows:
        r = {k: v for k, v in r.items() if not k.startswith("kafka_")}
        assert r["record_id"] not in out, f"record {r['record_id']} inserted twice"
        out[r["record_id"]] = r
    return out


def test_snapshot_round_trip_is_exact(inputs):
    cluster = Cluster(*inputs)
    rng = random.Random(0)
    for _ in range(3000):
        cluster.step(rng)
    for kind, parts in ((ROUTER, range(P_EVENTS)), (JOIN, range(P_SAMPLES))):
        for p in parts:
            blob = cluster.core.snapshot(kind, p)
            twin = Cluster.new_core()
            twin.restore(kind, p, blob)
            assert twin.snapshot(kind, p) == blob
            assert (twin.routers if kind == ROUTER else twin.joins)[p] == (cluster.core.routers if kind == ROUTER else cluster.core.joins)[p]


def _without_counters(part):
    from dataclasses import replace

    return replace(part, nodes={n: replace(j, duplicates=0) for n, j in part.nodes.items()})


def test_snapshot_leaves_waiting_ticks_to_be_read_again(inputs):
    """A join snapshot does not carry the ticks waiting for their watermark (a backlog would make
    every snapshot grow): its gpu-samples offset stops at the first of them, and re-reading from
    there rebuilds exactly the state the worker had."""
    cluster = Cluster(*inputs)
    rng = random.Random(5)
    checked_pending = 0
    for round_ in range(12):
        for _ in range(150):
            cluster.step(rng)
        for p in range(P_SAMPLES):
            part = cluster.core.joins.get(p)
            if part is None:
                continue
            twin = Cluster.new_core()
            twin.restore(JOIN, p, cluster.core.snapshot(JOIN, p))
            restored = twin.joins[p]
            assert all(not j.pending_ticks for j in restored.nodes.values())
            for topic in (TOPICS.gpu_samples, TOPICS.node_allocations):
                for offset in range(restored.next_offsets.get(topic, 0), cluster.position[(topic, p)]):
                    twin.on_node(topic, p, offset, cluster.topics[topic][p][offset])
            checked_pending += sum(len(j.pending_ticks) for j in part.nodes.values())
            assert _without_counters(twin.joins[p]) == _without_counters(part)
    assert checked_pending > 0  # the check did meet waiting ticks


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_crashes_at_random_points_give_the_same_records(inputs, seed):
    reference = Cluster(*inputs)
    reference.run(random.Random(100))
    expected = sink_records(reference.usage)
    assert expected and not reference.dead

    chaotic = Cluster(*inputs)
    chaotic.run(random.Random(seed), crash_every=100)
    got = sink_records(chaotic.usage)
    assert chaotic.crashes >= 3
    emitted = sum(len(decode(UsageBatch, raw).records) for raw in chaotic.usage)
    assert emitted > len(expected)  # records were re-emitted after crashes, and dropped by the sink
    assert got == expected
    assert not chaotic.dead  # redelivered ticks and re-emitted changes are silent duplicates


def test_batched_ticks_and_deferred_watermarks_give_the_same_records(inputs):
    """Agents sending 7 ticks per message, and a router that holds watermarks back to send one per
    burst, change how many messages flow, not a single record (nor with crashes on top)."""
    reference = Cluster(*inputs)
    reference.run(random.Random(100))
    expected = sink_records(reference.usage)

    batched = lay_out(batch_ticks(simulate(SPEC), 7))
    assert sum(map(len, batched[0].values())) < sum(map(len, inputs[0].values())) / 5
    for defer, crash_every in [(False, None), (True, None), (True, 60)]:
        cluster = Cluster(*batched, defer_watermarks=defer)
        cluster.run(random.Random(7), crash_every=crash_every)
        assert not cluster.dead
        assert sink_records(cluster.usage) == expected


def test_deferred_watermarks_go_out_latest_only_and_once():
    core = Cluster.new_core(defer_watermarks=True)
    for offset, ts in enumerate([10_000, 20_000, 30_000]):
        mark = encode(LifecycleWatermark(cluster="c", ts_ms=1_793_577_600_000 + ts))
        assert core.on_lifecycle(0, offset, mark) == []
    outs = core.flush_watermarks()
    assert len(outs) == P_SAMPLES and {o.partition for o in outs} == set(range(P_SAMPLES))
    assert {decode(NodeWatermark, o.value).ts_ms for o in outs} == {1_793_577_630_000}
    assert core.flush_watermarks() == []


def test_a_bad_tick_in_a_batch_costs_only_itself_and_gives_one_dead_letter():
    from gpuledger.schemas.models import DeadLetter, GpuSample, NodeTick
    from gpuledger.schemas.wire import encode_node_ticks

    def tick(k, **gpu):
        return NodeTick(cluster="c", node="n", ts_ms=1_793_577_600_000 + 1000 * k, interval_ms=1000,
                        gpus=[GpuSample(gpu_uuid="G", index=0, model="T4", **gpu)])

    core = Cluster.new_core()
    for source in range(P_EVENTS):  # every job-events partition has promised up to 10 s
        mark = NodeWatermark(ts_ms=1_793_577_610_000, source_partition=source, source_partitions=P_EVENTS)
        core.on_node(TOPICS.node_allocations, 0, source, encode(mark))
    bad = tick(3, mem_used_bytes=10, mem_total_bytes=5)  # uses more memory than it has
    batch = [tick(0), tick(1), tick(2), bad, tick(4)]
    outs = core.on_node(TOPICS.gpu_samples, 0, 0, encode_node_ticks("n", batch))
    letters = [decode(DeadLetter, o.value) for o in outs if o.topic == TOPICS.dead_letters]
    assert len(letters) == 1
    assert letters[0].reason.startswith("inconsistent tick: n GPU G uses 10 bytes of 5")
    assert "(1 of the batch's 5 ticks rejected; the others counted)" in letters[0].reason
    records = [r for o in outs if o.topic == TOPICS.usage for r in decode(UsageBatch, o.value).records]
    assert sorted(r.start_ms - 1_793_577_600_000 for r in records) == [0, 1000, 2000, 4000]


def test_samples_waiting_for_the_watermark_are_measured_per_partition():
    """What the Faust shell paces a gpu-samples partition by (streams/app.py `pace_samples`): the
    event time of the pending ticks per node but its newest (which waits for the watermark whatever
    its interval), on average over the partition's nodes; a tick from far in the future (a bad clock)
    counts as one tick, not as the days it claims."""
    from gpuledger.schemas.models import GpuSample, NodeTick

    t0 = 1_793_577_600_000

    def ticks(node, start_s, n):
        return [NodeTick(cluster="c", node=node, ts_ms=t0 + 1000 * (start_s + k), interval_ms=1000,
                         gpus=[GpuSample(gpu_uuid=f"G-{node}", index=0, model="T4")]) for k in range(n)]

    def watermark(at_s, first_offset):
        for offset, source in enumerate(range(P_EVENTS), start=first_offset):
            mark = NodeWatermark(ts_ms=t0 + 1000 * at_s, source_partition=source, source_partitions=P_EVENTS)
            core.on_node(TOPICS.node_allocations, 0, offset, encode(mark))

    core = Cluster.new_core()
    assert core.samples_waiting_ms(0) == 0
    core.on_node(TOPICS.gpu_samples, 0, 0, encode_node_ticks("n", ticks("n", 0, 90)))
    core.on_node(TOPICS.gpu_samples, 0, 1, encode_node_ticks("m", ticks("m", 0, 30) + ticks("m", 5 * 86_400, 1)))
    # before any watermark: n waits 90 s, m 31 ticks; each one's newest is not backlog
    assert core.samples_waiting_ms(0) == (89_000 + 30_000) // 2 and core.samples_waiting_ms(1) == 0
    watermark(20, 0)
    assert core.samples_waiting_ms(0) == (69_000 + 10_000) // 2
    watermark(120, P_EVENTS)
    assert core.samples_waiting_ms(0) == 0  # only the tick from the future waits: m's newest
    # a node sampled hourly: its one tick waits an hour for the watermark and is no backlog (counted, it
    # made 1,200 s per node on average here, over the 120-s pause threshold: the partition paused for the hour)
    hourly = NodeTick(cluster="c", node="h", ts_ms=t0 + 200_000, interval_ms=3_600_000,
                      gpus=[GpuSample(gpu_uuid="G-h", index=0, model="T4")])
    core.on_node(TOPICS.gpu_samples, 0, 2, encode_node_ticks("h", [hourly]))
    assert core.samples_waiting_ms(0) == 0
