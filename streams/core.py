"""The worker's logic without Faust: one input message in, the output messages out.

`WorkerCore` holds the worker's state per input partition — a `RouterPartition` per job-events
partition, a `JoinPartition` per gpu-samples/node-allocations partition (co-partitioned) — and the
next input offset each has consumed. It is deterministic: the same messages of one partition, in
offset order, give the same state and the same output records. That is what makes the worker
crash-safe (docs/reliability.md, "Worker state"): the Faust shell (`streams/app.py`) snapshots a
partition's state with its input offsets, commits input offsets only up to a durable snapshot, and
after a restart restores the snapshot and re-reads the input after it; messages the restored state
has already seen (offset below its next offset) are skipped, and outputs re-emitted for messages
after the snapshot are identical (same record ids), so downstream drops them.

No Kafka, no Faust here: unit tests drive it directly.

Why one file: `WorkerCore` and the per-partition states it keeps (`RouterPartition`, `JoinPartition`)
are one state machine: its input methods read and write those states together, and its snapshots,
restores and acknowledged offsets are of them.
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field

import orjson

from gpuledger.schemas.models import SCHEMA_VERSION, LifecycleWatermark, NodeWatermark
from gpuledger.schemas.wire import DecodeError, decode_lifecycle, decode_metered_ticks, decode_node_allocation, encode
from gpuledger.streams.join import CLOCK_AHEAD_MS, DAY_MS, DUPLICATE, MAX_AHEAD_MS, LATE, REJECTED, NodeJoin, check_event, check_tick
from gpuledger.streams.router import LifecycleRouter, WatermarkClock
from gpuledger.streams.checks import dead_letter, watermark_problem
from gpuledger.streams.pricing import LedgerConfig
from gpuledger.streams.topic_names import TopicNames

log = logging.getLogger(__name__)

ROUTER, JOIN = "router", "join"
#: A node that has sent no sample this long (event time) after an allocation change names it is
#: reported as unknown (counted once per change; the changes are kept for ticks that come late).
UNKNOWN_NODE_GRACE_MS = 10 * 60_000
#: A GPU UUID that a node of the partition reports is that node's: another node's tick naming it is
#: refused until the first has sent no tick this long (a GPU moved between nodes). Two nodes reporting
#: one UUID (a cloned agent, a fake backend) made records with the same ids, and the sink's per-GPU
#: horizon kept whichever came first: the other node's, its jobs' bills with them, were dropped.
GPU_MOVE_MS = 10 * 60_000
SNAPSHOT_VERSION = 1
#: header of a lifecycle-accepted message: "<job-events partition>:<offset>" of the event it repeats
SOURCE_HEADER = "gpuledger-source"
DEFAULT_DEAD_LETTER_MAX_BYTES = 900_000
#: the largest usage message the worker sends: under the broker's default message size (1 MB), which the
#: usage topic keeps (docs/retention.md, "Large usage batches")
USAGE_MESSAGE_MAX_BYTES = 900_000


@dataclass(frozen=True)
class Out:
    """One message to send: topic, value, and a key or an explicit partition."""

    topic: str
    value: bytes
    key: bytes | None = None
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] | None = None


def usage_messages(node: str, records: list[dict], max_bytes: int = USAGE_MESSAGE_MAX_BYTES) -> list[bytes]:
    """A node's usage records as UsageBatch messages (wire form; the records are UsageRecord wire dicts
    already, attribution.py) of at most `max_bytes` each: one message, unless a close that covers hours
    at once makes more. The parts are cut at a time no record spans (segments never cross a window
    boundary), so every record of a message ends by the first start of the next: the sink takes a
    record that starts before the end of one already taken for its GPU for a worker's re-emission and
    drops it (its per-GPU horizon, gpuledger/sink/batching.py)."""
    raw = orjson.dumps({"schema_version": SCHEMA_VERSION, "node": node, "records": records})
    if len(raw) <= max_bytes or len(records) == 1:
        return [raw]
    ordered = sorted(records, key=lambda r: r["start_ms"])
    cuts, reach = [], 0  # indices i where every record before i ends by the start of record i
    for i, r in enumerate(ordered):
        if i and reach <= r["start_ms"]:
            cuts.append(i)
        reach = max(reach, r["end_ms"])
    if not cuts:  # one stretch of time (a window's records): by GPU then, each GPU's records whole
        by_gpu: dict[str, list[dict]] = {}
        for r in records:
            by_gpu.setdefault(r["gpu_uuid"], []).append(r)
        if len(by_gpu) == 1:
            return [raw]  # cannot be cut without the sink dropping a part: sent whole
        groups = list(by_gpu.values())
        half = len(groups) // 2
        return (usage_messages(node, [r for g in groups[:half] for r in g], max_bytes)
                + usage_messages(node, [r for g in groups[half:] for r in g], max_bytes))
    cut = min(cuts, key=lambda i: abs(i - len(ordered) // 2))
    return usage_messages(node, ordered[:cut], max_bytes) + usage_messages(node, ordered[cut:], max_bytes)


@dataclass
class RouterPartition:
    router: LifecycleRouter = field(default_factory=LifecycleRouter)
    #: the latest lifecycle watermark of any cluster (judges events from the future, prunes jobs of
    #: clusters that send none)
    watermark_ms: int = 0
    next_offset: int = 0
    #: the watermark last sent on to the join partitions (behind closing_ms while deferred)
    forwarded_ms: int = 0
    #: cluster -> its scheduler agent's latest watermark: each promises its own cluster's events only
    cluster_marks: dict[str, int] = field(default_factory=dict)
    #: what the partition may close: the minimum over the clusters' watermarks (`observe`)
    closing_ms: int = 0

    def observe(self, cluster: str, ts_ms: int, stale_ms: int) -> None:
        """One cluster's watermark. The join partitions close every node by one clock, so it may
        move only as far as every cluster has promised: one cluster's agent spooling through an
        outage holds the others back rather than its ticks closing with no allocation. A cluster
        more than `stale_ms` behind the latest (a retired cluster, an agent down for longer than its
        events could still be applied) stops holding the others back. A cluster that sent no
        watermark holds nothing back (its ticks close by the others', as before clusters counted)."""
        if ts_ms > self.cluster_marks.get(cluster, 0):
            self.cluster_marks[cluster] = ts_ms
        self.watermark_ms = max(self.watermark_ms, ts_ms)
        floor = self.watermark_ms - stale_ms
        # may go back (a cluster heard of for the first time); what was forwarded does not (`forwarded_ms`)
        self.closing_ms = min(ts for ts in self.cluster_marks.values() if ts >= floor)

    def to_state(self) -> dict:
        return {"router": self.router.to_state(), "watermark_ms": self.watermark_ms, "next_offset": self.next_offset,
                "forwarded_ms": self.forwarded_ms, "cluster_marks": dict(self.cluster_marks),
                "closing_ms": self.closing_ms}

    @classmethod
    def from_state(cls, state: dict) -> "RouterPartition":
        # an older snapshot has one watermark, of no cluster: it closes what it did (it may have been
        # forwarded), and the clusters' own watermarks take over as they come
        return cls(LifecycleRouter.from_state(state["router"]), state["watermark_ms"], state["next_offset"],
                   state.get("forwarded_ms", state["watermark_ms"]), dict(state.get("cluster_marks", {})),
                   state.get("closing_ms", state["watermark_ms"]))


@dataclass
class JoinPartition:
    #: (cluster, node name) -> its join: two clusters may both have a node001 (the Kafka key is the bare
    #: node name, so both land here). ("", name): a join from before changes carried their cluster, until
    #: its node's first tick or change of a cluster claims it (WorkerCore `_node`)
    nodes: dict[tuple[str, str], NodeJoin] = field(default_factory=dict)
    clock: WatermarkClock = field(default_factory=WatermarkClock)
    next_offsets: dict[str, int] = field(default_factory=dict)  # input topic -> next offset
    #: samples clock: the latest tick start accepted on this partition, from any node, moved at most one
    #: interval per tick and never past the wall clock (flushes the open segments of a node that stopped
    #: reporting: one silent while it moved on by its last message's span + flush_after,
    #: streams/join.py `NodeJoin._flush`). The start, not the end: a tick's end is ahead of what its
    #: peers have sent by its own interval (a node sampled every 3 min would otherwise flush its peers'
    #: windows before their ticks of the same time)
    data_ms: int = 0
    #: the last window (data_ms - flush_after, in windows) for which every node was checked for a flush
    flush_scan: int = field(default=0, compare=False)
    #: GPU UUID -> the join of the node whose ticks report it (`WorkerCore._gpu_taken`); in snapshots as
    #: (cluster, node) (compared through them: `gpu_owner_keys`)
    gpu_owners: dict[str, NodeJoin] = field(default_factory=dict, compare=False)
    #: (cluster, node) -> closed horizon of a node retired from `nodes` (`WorkerCore._retire_quiet_nodes`):
    #: a few bytes where its join kept every GPU's energy and judge for ever (autoscaled nodes come and
    #: go); a node that comes back starts from that horizon, so its ticks from before it stay late
    retired: dict[tuple[str, str], int] = field(default_factory=dict)

    def gpu_owner_keys(self) -> dict[str, list[str]]:
        return {uuid: [j.cluster, j.node] for uuid, j in sorted(self.gpu_owners.items())}

    def __eq__(self, other) -> bool:
        return (isinstance(other, JoinPartition) and
                (self.nodes, self.clock, self.next_offsets, self.data_ms, self.retired) ==
                (other.nodes, other.clock, other.next_offsets, other.data_ms, other.retired)
                and self.gpu_owner_keys() == other.gpu_owner_keys())

    def to_state(self) -> dict:
        return {"nodes": [j.to_state() for _, j in sorted(self.nodes.items())], "clock": self.clock.to_state(),
                "next_offsets": dict(self.next_offsets), "data_ms": self.data_ms, "gpu_owners": self.gpu_owner_keys(),
                "retired": [[c, n, ms] for (c, n), ms in sorted(self.retired.items())]}

    @classmethod
    def from_state(cls, state: dict) -> "JoinPartition":
        nodes = [NodeJoin.from_state(n) for n in state["nodes"]]
        # an older snapshot has one join per node name, with the cluster of its ticks ("" if none came);
        # and no GPU owners: each GPU is its next reporter's
        by_key = {(n.cluster, n.node): n for n in nodes}
        owners = {uuid: by_key[key] for uuid, (c, n) in state.get("gpu_owners", {}).items()
                  if (key := (c, n)) in by_key}
        return cls(by_key, WatermarkClock.from_state(state["clock"]), dict(state["next_offsets"]),
                   state.get("data_ms", 0), gpu_owners=owners,
                   retired={(c, n): ms for c, n, ms in state.get("retired", [])})


def _letter(topic: str, partition: int, offset: int, raw: bytes | None, reason: str, *, seen_ms: int = 0,
            max_bytes: int = DEFAULT_DEAD_LETTER_MAX_BYTES) -> bytes:
    """A DeadLetter that fits its topic (streams/checks.py `dead_letter`, shared with the sink)."""
    return dead_letter(topic, partition, offset, raw, reason, seen_ms=seen_ms, max_bytes=max_bytes)


class WorkerCore:
    """All of the worker's state and logic; the Faust app only moves bytes in and out."""

    def __init__(self, topics: TopicNames, *, partitions_gpu_samples: int, partitions_job_events: int,
                 ledger: LedgerConfig, retention_ms: int = DAY_MS, max_ahead_ms: int = MAX_AHEAD_MS,
                 defer_watermarks: bool = False, dead_letter_max_bytes: int = DEFAULT_DEAD_LETTER_MAX_BYTES,
                 clock_ahead_ms: int = CLOCK_AHEAD_MS):
        self.topics = topics
        self.partitions_gpu_samples = partitions_gpu_samples
        self.partitions_job_events = partitions_job_events
        self.ledger = ledger
        self.retention_ms = retention_ms
        self.max_ahead_ms = max_ahead_ms
        #: a tick further ahead of the wall clock at receipt is refused: held until the watermark reached
        #: it, a node's clock a day ahead paused its partition (every node in it) for that day
        self.clock_ahead_ms = clock_ahead_ms
        #: hold lifecycle watermarks back until `flush_watermarks()` (the Faust app calls it every
        #: `worker_watermark_flush_s` and before each snapshot): a backlog of job-events then sends
        #: one watermark per burst instead of one per message to every join partition
        self.defer_watermarks = defer_watermarks
        self.dead_letter_max_bytes = dead_letter_max_bytes
        #: the caller's wall clock at receipt of the message being processed (epoch ms; None: no
        #: wall-clock judgement). Set by on_lifecycle/on_node from their `now_ms` argument.
        self._now_ms: int | None = None
        self.routers: dict[int, RouterPartition] = {}
        self.joins: dict[int, JoinPartition] = {}
        self.counters: Counter[str] = Counter()
        #: optional hooks for metrics: on_dead_letter(source_topic, reason), on_duplicate(kind), on_tick(node, ts_ms, cluster),
        #: on_unmatched(kind, amount), on_retired(cluster, node)
        self.on_dead_letter = None
        self.on_duplicate = None
        self.on_tick = None
        self.on_unmatched = None
        self.on_retired = None

    # ------------------------------------------------------------------ helpers
    #: the Kafka key of the input message being processed, set by the Faust shell before each one
    #: (streams/app.py `handle`; None: unkeyed, or pure tests): the worker's dead letters keep it,
    #: as the sink's do
    source_key: bytes | None = None

    def dead_letter_out(self, topic: str, partition: int, offset: int, raw: bytes | None, reason: str,
                        problems: list[str] | None = None) -> Out:
        """One dead letter. `problems`: a batch's rejected ticks, one reason each: the letter stays one,
        the metrics hook is called once per problem, so each counts under its own kind."""
        self.counters["dead_letters"] += 1
        if self.on_dead_letter:
            for problem in problems or (reason,):
                self.on_dead_letter(topic, problem)
        log.warning("dead letter from %s[%d]@%d: %s", topic, partition, offset, reason[:500])
        return Out(self.topics.dead_letters, _letter(topic, partition, offset, raw, reason, seen_ms=self._now_ms or 0,
                                                     max_bytes=self.dead_letter_max_bytes), key=self.source_key)

    def _late(self, topic: str, partition: int, offset: int, raw: bytes | None, reason: str) -> Out:
        self.counters["late_events"] += 1
        return Out(self.topics.late_events, _letter(topic, partition, offset, raw, reason, seen_ms=self._now_ms or 0,
                                                    max_bytes=self.dead_letter_max_bytes))

    def router_partition(self, partition: int) -> RouterPartition:
        return self.routers.setdefault(partition, RouterPartition())

    def join_partition(self, partition: int) -> JoinPartition:
        return self.joins.setdefault(partition, JoinPartition())

    def _node(self, jp: JoinPartition, cluster: str, name: str) -> NodeJoin:
        """The join of node `name` of `cluster`. One of that name kept under cluster "" (restored from a
        snapshot that saw only its changes, or made for a change that named no cluster) is taken over
        by the first cluster that speaks of the node: exact for one cluster, as before clusters counted."""
        join = jp.nodes.get((cluster, name))
        if join is None:
            join = jp.nodes.pop(("", name), None) if cluster else None
            if join is None:
                join = NodeJoin(node=name, cluster=cluster, retention_ms=self.retention_ms,
                                closed_until_ms=jp.retired.pop((cluster, name), 0))
            join.cluster = cluster
            jp.nodes[(cluster, name)] = join
        return join

    def _change_node(self, jp: JoinPartition, change) -> NodeJoin | str:
        """The join an allocation change goes to, or why none can take it. A change that names no
        cluster (sent by a worker from before changes carried it, read after an upgrade) goes to the
        one join of its node's name; with several clusters' nodes of that name it is ambiguous."""
        if change.cluster:
            return self._node(jp, change.cluster, change.node)
        named = [join for (_, name), join in jp.nodes.items() if name == change.node]
        if len(named) > 1:
            return (f"allocation change {change.event_id} names no cluster and node {change.node} is a node of "
                    f"{len(named)} clusters ({', '.join(sorted(j.cluster or '?' for j in named))}): written by a "
                    "worker from before changes carried their cluster; replay its job-events to apply it")
        return named[0] if named else self._node(jp, "", change.node)

    def _take_unmatched(self, join: NodeJoin) -> None:
        for kind, amount in join.take_unmatched().items():
            self.counters[f"unmatched_{kind}"] += amount
            if self.on_unmatched:
                self.on_unmatched(kind, amount)

    def _emit(self, join: NodeJoin, watermark_ms: int, data_ms: int | None = None) -> list[Out]:
        records = join.close_until(watermark_ms, self.ledger, data_ms)
        if join.unmatched:
            self._take_unmatched(join)
        if not records:
            return []
        self.counters["usage_records"] += len(records)
        key = join.node.encode()
        return [Out(self.topics.usage, raw, key=key) for raw in usage_messages(join.node, records)]

    # ------------------------------------------------------------------ input
    def on_lifecycle(self, partition: int, offset: int, raw: bytes | None, now_ms: int | None = None) -> list[Out]:
        """One job-events message: re-keyed allocation changes and the event itself on the
        lifecycle-accepted topic (what the sink stores), broadcast watermarks, or a dead letter.
        `now_ms`: the caller's wall clock at receipt; input further ahead of it than max_ahead is
        rejected, also before the first watermark."""
        self._now_ms = now_ms
        rp = self.router_partition(partition)
        if offset < rp.next_offset:
            self.counters["redelivered"] += 1
            return []
        rp.next_offset = offset + 1
        topic = self.topics.job_events
        try:
            message = decode_lifecycle(raw)
        except DecodeError as exc:
            return [self.dead_letter_out(topic, partition, offset, raw, str(exc))]
        if isinstance(message, LifecycleWatermark):
            problem = watermark_problem(message.cluster, message.ts_ms, self.max_ahead_ms, now_ms, self.clock_ahead_ms)
            if problem:  # a promise about the future would close every node's ticks before their changes
                return [self.dead_letter_out(topic, partition, offset, raw, problem)]
            rp.observe(message.cluster, message.ts_ms, self.retention_ms)
            rp.router.prune(rp.watermark_ms - self.retention_ms,
                            {c: ts - self.retention_ms for c, ts in rp.cluster_marks.items()})
            return [] if self.defer_watermarks else self._forward_watermark(partition, rp)
        problem = check_event(message, rp.watermark_ms, self.max_ahead_ms, now_ms, self.clock_ahead_ms)
        if problem:
            return [self.dead_letter_out(topic, partition, offset, raw, problem)]
        if rp.router.is_duplicate(message):
            rp.router.route(message)  # counts it
            self.counters["duplicate_events"] += 1
            return []
        problem = rp.router.sequence_problem(message)
        if problem:
            # sequence_problem also refuses numbers the sink cannot store (streams/checks.py): not a sequence's fault
            impossible = problem.startswith("impossible sequence")
            self.counters["impossible_sequences" if impossible else "unstorable_events"] += 1
            return [self.dead_letter_out(topic, partition, offset, raw, problem)]
        self.counters["job_events"] += 1
        changes = rp.router.route(message)
        outs = [Out(self.topics.node_allocations, encode(c), key=c.node.encode()) for c in changes]
        # the accepted event, byte for byte, on the partition it came from, with where it came from
        # (the sink drops what a restarted worker sends again by this offset)
        outs.append(Out(self.topics.lifecycle_accepted, raw, key=message.job_id.encode(), partition=partition,
                        headers=((SOURCE_HEADER, f"{partition}:{offset}".encode()),)))
        return outs

    def _forward_watermark(self, partition: int, rp: RouterPartition) -> list[Out]:
        """The partition's closing watermark to every join partition (nothing when it has not advanced)."""
        if rp.closing_ms <= rp.forwarded_ms:
            return []
        rp.forwarded_ms = rp.closing_ms
        mark = encode(NodeWatermark(ts_ms=rp.closing_ms, source_partition=partition,
                                    source_partitions=self.partitions_job_events))
        return [Out(self.topics.node_allocations, mark, partition=p) for p in range(self.partitions_gpu_samples)]

    def flush_watermarks(self) -> list[Out]:
        """The watermarks held back (`defer_watermarks`), latest per job-events partition. They
        follow every allocation change already returned, so the promise they carry holds."""
        return [out for p in sorted(self.routers) for out in self._forward_watermark(p, self.routers[p])]

    def on_node(self, topic: str, partition: int, offset: int, raw: bytes | None, now_ms: int | None = None) -> list[Out]:
        """One gpu-samples or node-allocations message: usage batches, late reports or a dead letter.
        `now_ms`: the caller's wall clock at receipt (see on_lifecycle)."""
        self._now_ms = now_ms
        jp = self.join_partition(partition)
        if offset < jp.next_offsets.get(topic, 0):
            self.counters["redelivered"] += 1
            return []
        jp.next_offsets[topic] = offset + 1
        try:
            if topic == self.topics.gpu_samples:
                ticks = decode_metered_ticks(raw)
            else:
                message = decode_node_allocation(raw)
        except DecodeError as exc:
            return [self.dead_letter_out(topic, partition, offset, raw, str(exc))]
        if topic == self.topics.gpu_samples:
            return self._on_ticks(jp, topic, partition, offset, raw, ticks)
        if isinstance(message, NodeWatermark):
            problem = self._node_watermark_problem(message)
            if problem:  # kept, it would stop the partition's clock (or break it: KeyError) for good
                return [self.dead_letter_out(topic, partition, offset, raw, problem)]
            watermark = jp.clock.observe(message)
            for join in jp.nodes.values():
                if join.report_unknown_node(watermark, UNKNOWN_NODE_GRACE_MS):
                    self._take_unmatched(join)
            return [out for key in sorted(jp.nodes) for out in self._emit(jp.nodes[key], watermark, jp.data_ms)]
        join = self._change_node(jp, message)
        if isinstance(join, str):
            return [self.dead_letter_out(topic, partition, offset, raw, join)]
        verdict = join.add_change(message)
        if verdict.status == DUPLICATE:
            self.counters["duplicate_changes"] += 1
            if self.on_duplicate:
                self.on_duplicate("change")
        elif verdict.status == REJECTED:
            return [self.dead_letter_out(topic, partition, offset, raw, verdict.reason)]
        elif verdict.status == LATE:
            return [self._late(topic, partition, offset, raw, verdict.reason)]
        return []

    def _node_watermark_problem(self, mark: NodeWatermark) -> str | None:
        """Why a node watermark names no job-events partition of this worker, or None. The clock waits
        for every one of `source_partitions` (the largest seen), so one naming more partitions than the
        topic has, or a partition beyond its own count, would hold it back or break it for good."""
        if mark.source_partition < mark.source_partitions <= self.partitions_job_events:
            return None
        return (f"inconsistent watermark: job-events partition {mark.source_partition} of {mark.source_partitions}, "
                f"but job-events has {self.partitions_job_events} partitions (GPULEDGER_PARTITIONS_JOB_EVENTS): "
                "not sent by a worker of this topic set")

    def _on_ticks(self, jp: JoinPartition, topic: str, partition: int, offset: int, raw: bytes, ticks) -> list[Out]:
        """The ticks of one gpu-samples message (one, or a node's batch): each is checked and
        buffered on its own, so a bad tick does not cost the good ones of its batch; the message
        gets one dead letter naming every tick it rejected. Then the node closes what the
        watermark allows, in one usage batch."""
        problems: list[str] = []
        join = spoke = None
        owners = jp.gpu_owners
        for tick in ticks:
            problem = check_tick(tick, jp.clock.value, self.max_ahead_ms, self._now_ms, self.clock_ahead_ms)
            if problem:
                problems.append(problem)
                continue
            join = self._node(jp, tick.cluster, tick.node)
            claim = False
            for gpu in tick.gpus:
                if owners.get(gpu.gpu_uuid) is not join:  # a GPU new to the partition, or another node's
                    problem = self._gpu_taken(jp, join, tick)
                    claim = problem is None
                    break
            if problem:
                problems.append(problem)
                continue
            # a tick left out of a restored snapshot, read again: the clock and the node's message are in the snapshot
            again = bool(join.awaiting_ms) and tick.ts_ms in join.awaiting_ms
            verdict = join.add_tick(tick, offset)
            if verdict.status == DUPLICATE:
                self.counters["duplicate_ticks"] += 1
                if self.on_duplicate:
                    self.on_duplicate("tick")
            elif verdict.status == REJECTED:
                problems.append(verdict.reason)
            else:
                self.counters["ticks"] += 1
                if claim:
                    for gpu in tick.gpus:
                        owners[gpu.gpu_uuid] = join
                # the samples clock moves at most one interval per tick and never past the wall clock at
                # receipt (None: pure tools, no cap), so a tick from the future (a node's clock off) does
                # not flush the partition's live nodes in one jump (docs/accounting.md "Segments")
                if not again:
                    start = min(tick.ts_ms, jp.data_ms + tick.interval_ms) if jp.data_ms else tick.ts_ms
                    jp.data_ms = max(jp.data_ms, start if self._now_ms is None else min(start, self._now_ms))
                    spoke = join
                if self.on_tick:
                    self.on_tick(tick.node, tick.ts_ms, tick.cluster)
        outs = []
        if problems:
            reason = "; ".join(problems[:3])
            if len(ticks) > 1:
                reason += f" ({len(problems)} of the batch's {len(ticks)} ticks rejected; the others counted)"
            # one letter; the metric counts every rejected tick under its own kind (a late tick must
            # not hide a malformed one from the kind="invalid" alert)
            outs.append(self.dead_letter_out(topic, partition, offset, raw, reason, problems))
        if spoke is not None:
            # the node sent new ticks: it has stopped only once the clock moves this message's span +
            # flush_after on without it (NodeJoin._flush), wherever its peers' clocks put the samples clock
            spoke.clock_at_last_message = jp.data_ms
            spoke.message_span_ms = len(ticks) * ticks[-1].interval_ms
        if join is not None:
            outs.extend(self._emit(join, jp.clock.value, jp.data_ms))
            # once a window: the other nodes' open segments may be due for a flush (a node that stopped)
            scan = (jp.data_ms - self.ledger.segment_flush_after_ms) // self.ledger.segment_window_ms
            if scan > jp.flush_scan and self.ledger.segment_window_ms > 1:
                jp.flush_scan = scan
                outs.extend(out for key in sorted(jp.nodes) if jp.nodes[key] is not join and jp.nodes[key].segments
                            for out in self._emit(jp.nodes[key], jp.clock.value, jp.data_ms))
                self._retire_quiet_nodes(jp, join)
        return outs

    def _retire_quiet_nodes(self, jp: JoinPartition, speaking: NodeJoin) -> None:
        """Drop the joins of nodes that hold nothing (no holder, pending tick or change, open segment)
        and sent no tick for `retention_ms` of the partition's event time: a node retired or scaled
        away kept its whole join, and every snapshot carried it, for ever. Only its closed horizon
        stays (`JoinPartition.retired`). Decided on event time only, so a replay retires the same."""
        horizon = jp.data_ms - self.retention_ms
        quiet = [key for key, j in sorted(jp.nodes.items()) if j is not speaking and j.is_quiet_since(horizon)]
        for key in quiet:
            join = jp.nodes.pop(key)
            jp.retired[key] = join.closed_until_ms
            for uuid in [u for u, owner in jp.gpu_owners.items() if owner is join]:
                del jp.gpu_owners[uuid]
            self.counters["retired_nodes"] += 1
            if self.on_retired:
                self.on_retired(*key)

    @staticmethod
    def _gpu_taken(jp: JoinPartition, join: NodeJoin, tick) -> str | None:
        """Why `tick` may not report its GPUs, or None: one of them is another node's of this partition
        that reported it within GPU_MOVE_MS before this tick (its latest tick: pending, else its closed
        horizon). The first node to report a UUID keeps it; the refused tick is a dead letter naming both."""
        for gpu in tick.gpus:
            owner = jp.gpu_owners.get(gpu.gpu_uuid)
            if owner is None or owner is join:
                continue
            latest = owner.pending_ticks[-1].ts_ms if owner.pending_ticks else owner.closed_until_ms
            if latest > tick.ts_ms - GPU_MOVE_MS:
                return (f"inconsistent tick: {tick.node} ts_ms={tick.ts_ms} reports GPU {gpu.gpu_uuid}, which node "
                        f"{owner.node} of cluster {owner.cluster or '?'} reports (at {latest}): one GPU UUID on two "
                        f"nodes (a cloned agent?); the first node keeps it until it has sent no tick for "
                        f"{GPU_MOVE_MS // 60_000} minutes")
        return None

    def samples_waiting_ms(self, partition: int) -> int:
        """How much event time of samples waits for the lifecycle watermark on a join partition, per
        node on average: each node's pending ticks x their interval, over the partition's nodes.
        Waiting ticks are held in memory (decoded), so the Faust shell pauses the partition's samples
        while this is large (`worker_samples_ahead_s`). Counted in ticks, not from the latest
        timestamp, so that a tick from the future does not hold a partition back; and averaged, so
        that one node whose clock runs minutes ahead does not hold back the others. A node's newest
        tick is not counted: it waits for the watermark to pass its end in any case, however long its
        interval (one node sampled hourly among four paused its partition, everyone's samples, for up
        to an hour per tick); the ticks behind it are the backlog."""
        jp = self.joins.get(partition)
        if jp is None or not jp.nodes:
            return 0
        waiting = sum((len(j.pending_ticks) - 1) * j.pending_ticks[-1].interval_ms
                      for j in jp.nodes.values() if j.pending_ticks)
        return waiting // len(jp.nodes)

    # ------------------------------------------------------------------ snapshots
    def covered_offsets(self, kind: str, partition: int) -> dict[str, int]:
        """Input topic -> the offset below which a snapshot taken now covers every message: what the
        worker may acknowledge once the snapshot is durable. For gpu-samples that stops at the first
        message with a tick still waiting for its watermark (snapshots leave those out: see
        `NodeJoin.to_state`; they are read again after a restore)."""
        if kind == ROUTER:
            part = self.routers.get(partition)
            return {self.topics.job_events: part.next_offset if part else 0}
        part = self.joins.get(partition)
        if part is None:
            return {}
        covered = dict(part.next_offsets)
        resume = min((o for j in part.nodes.values() if (o := j.resume_offset()) is not None), default=None)
        if resume is not None:
            covered[self.topics.gpu_samples] = min(resume, covered.get(self.topics.gpu_samples, resume))
        return covered

    def snapshot(self, kind: str, partition: int) -> bytes:
        """The state of one partition (with the input offsets it covers), compressed JSON."""
        part = (self.routers if kind == ROUTER else self.joins).get(partition)
        state = part.to_state() if part is not None else None
        if kind == JOIN and state is not None:
            state["next_offsets"] = self.covered_offsets(kind, partition)
        doc = {"version": SNAPSHOT_VERSION, "kind": kind, "partition": partition, "state": state}
        return zlib.compress(orjson.dumps(doc), 1)

    def restore(self, kind: str, partition: int, blob: bytes | None) -> None:
        """Replace one partition's state by a snapshot (None: start empty)."""
        target = self.routers if kind == ROUTER else self.joins
        target.pop(partition, None)
        if blob is None:
            return
        doc = orjson.loads(zlib.decompress(blob))
        version = doc.get("version")
        if isinstance(version, int) and version > SNAPSHOT_VERSION:  # a rollback: its state is not ours to guess
            raise ValueError(f"the snapshot of {kind} partition {partition} is of version {version}, written by a newer "
                             f"worker; this one reads version {SNAPSHOT_VERSION}: run the newer worker")
        if version != SNAPSHOT_VERSION or doc.get("kind") != kind or doc.get("partition") != partition:
            raise ValueError(f"snapshot for {kind} partition {partition} does not match: "
                             f"{ {k: doc.get(k) for k in ('version', 'kind', 'partition')} }")
        if doc["state"] is not None:
            cls = RouterPartition if kind == ROUTER else JoinPartition
            target[partition] = cls.from_state(doc["state"])
            if kind == JOIN:
                self._repair_clock(partition, target[partition].clock)

    def _repair_clock(self, partition: int, clock: WatermarkClock) -> None:
        """Forget what a snapshot's watermark clock holds of job-events partitions the topic does not
        have (kept before `_node_watermark_problem` refused them): it would wait for them for ever."""
        known = self.partitions_job_events
        if clock.source_partitions <= known and all(p < known for p in clock.by_source):
            return
        log.warning("join partition %d: its snapshot's watermark clock names job-events partitions %s of %d; "
                    "job-events has %d: forgotten", partition, sorted(clock.by_source), clock.source_partitions, known)
        clock.source_partitions = min(clock.source_partitions, known)
        clock.by_source = {p: ts for p, ts in clock.by_source.items() if p < known}

    def state_partition(self, kind: str, partition: int) -> int:
        """Partition of the worker-state topic holding this input partition's snapshots."""
        return partition if kind == JOIN else self.partitions_gpu_samples + partition
