"""The node join, pure: one node's samples + allocation changes -> usage records. The router that
turns lifecycle events into those changes is in router.py; segments are in segments.py.

Why one file: `NodeJoin` is one state machine over one node's ticks, holders and open segments;
its methods read and write that state together (and snapshot it as one).

Event time rules (docs/architecture.md):
- a tick at ts covers [ts, ts + interval); it is closed (turned into usage records) only when
  the lifecycle watermark has reached its end, so every allocation change that happened
  inside it is known — replays at any speed give the same records;
- allocation changes inside a tick split it at the change's timestamp;
- the energy of a tick is the NVML counter delta since the node's previous contiguous tick
  (the last interval's measurement), power x duration when there is none.

Segments (docs/accounting.md, "Segments"): the records of consecutive closed ticks add up into one
record per GPU, holder and state (a *segment*) until the holders or states change, the GPU misses a
tick, or the tick starts at or after the segment's window end (`[segments] window_s`, aligned to
UTC). A tick goes whole to the window it starts in, so every piece of GPU time lands in the same
day and hour as in per-tick records, and costs, GPU-ms and effective GPU-ms are sums of the
per-tick figures: bills are those of per-tick records to the micro-unit. A segment is emitted when
it closes; one of a node that stopped reporting (the partition's samples clock moved on by its last
message's span + `flush_after_s` without it) is flushed once that clock is `flush_after_s` past its
window's end, and the node's closed horizon moves to that end (a tick of the flushed window arriving
later is late and rejected, so a record is never extended after it was emitted).

Late, duplicate and out-of-order input (docs/reliability.md, "Late, duplicate and out-of-order data"):
- a lifecycle event is applied once per node: every node join remembers the event ids it has seen
  for `retention_ms` of event time behind its closed horizon, so a redelivered or re-emitted change
  is a silent duplicate;
- a change older than the closed horizon (the watermark promise was broken) is *late*: it takes
  effect from the next tick that is still open, and is reported; one older than the horizon by
  more than `retention_ms` is *too late* and rejected (its duplicate could no longer be recognised);
- a tick already closed is a silent duplicate; a tick before the horizon that was never seen is
  late and rejected (its GPU-time would otherwise be counted after newer records of the GPU); a
  tick overlapping a pending one is rejected (the first received is kept: no GPU-time twice).

An assignment naming a GPU the node's tick does not report (yet) is counted when its change is
applied and kept with that change: each later tick of the node tries it again, and it holds its GPU
from the first tick that resolves it (docs/accounting.md §1b) — a MIG device created after the
agent last read its GPU's MIG layout, an index of a GPU unreadable until now. The router does not
send an allocation again, so dropping it would leave the job unbilled for its whole life.

Every piece of state here can be turned into plain JSON-able data (`to_state`) and back
(`from_state`), which is how the worker snapshots itself (docs/reliability.md, "Worker state").
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from gpuledger.schemas.models import (
    TERMINAL_KINDS,
    AllocationChange,
    GpuAssignment,
    GpuHealth,
    JobEvent,
    JobEventKind,
    MeteredGpu,
    MeteredTick,
    NodeTick,
)
from gpuledger.streams.attribution import Holder, RecordMaker, whole_gpu_util, whole_pieces
from gpuledger.streams.checks import CLOCK_AHEAD_MS, DAY_MS, MAX_AHEAD_MS, MIN_EVENT_MS, tick_gpus_problem, time_problem  # noqa: F401 (re-exported)
from gpuledger.streams.execution import ExecutionJudge
from gpuledger.streams.pricing import LedgerConfig
from gpuledger.streams.router import RUNNING_KINDS
from gpuledger.streams.segments import Segment, holder_state, new_slot, piece_key

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------- input checks
# The time window and a tick's GPU list are judged in streams/checks.py, shared with the sink
# (one set of rules).


def check_tick(tick: MeteredTick | NodeTick, watermark_ms: int, max_ahead_ms: int = MAX_AHEAD_MS,
               now_ms: int | None = None, clock_ahead_ms: int = CLOCK_AHEAD_MS) -> str | None:
    """Semantic checks the schema cannot make; returns the reason a tick is unusable, or None.
    `now_ms`: the caller's clock at receipt (judges the future also before the first watermark); a
    tick more than `clock_ahead_ms` ahead of it is refused (its node's clock is off)."""
    problem = time_problem(f"tick of {tick.node}", tick.ts_ms, watermark_ms, max_ahead_ms, now_ms, clock_ahead_ms)
    return problem or tick_gpus_problem(tick)


def check_event(event: JobEvent, watermark_ms: int, max_ahead_ms: int = MAX_AHEAD_MS,
                now_ms: int | None = None, clock_ahead_ms: int = CLOCK_AHEAD_MS) -> str | None:
    """Semantic checks of a lifecycle event; returns the reason it is unusable, or None. An event is
    held to the clock at receipt as a tick is (`clock_ahead_ms`): it reports what happened, and an
    `allocated` dated days ahead was accepted, the job's real end then refused as before its
    allocation, and the attempt held its GPUs with no end from that date on."""
    problem = time_problem(f"event {event.event_id}", event.ts_ms, watermark_ms, max_ahead_ms, now_ms, clock_ahead_ms)
    if problem:
        return problem
    shares: dict[str, int] = {}
    for gpu in event.gpus:
        if gpu.ref in shares:
            return f"inconsistent event: {event.event_id} lists GPU {gpu.ref} twice"
        shares[gpu.ref] = gpu.share_milli
    return None


# --------------------------------------------------------------------------- node join
def _busy(gpu: MeteredGpu, floor_pct: float) -> bool:
    """A GPU that no attempt holds but that works: processes on it, or use above the floor."""
    util = whole_gpu_util(gpu)
    return bool(gpu.processes) or (util is not None and util > floor_pct)


ACCEPTED, DUPLICATE, LATE, REJECTED = "accepted", "duplicate", "late", "rejected"


@dataclass(frozen=True)
class Verdict:
    """What the node join did with one input: accepted; a silent duplicate; accepted but late
    (reported); or rejected (dead letter) with the reason."""

    status: str
    reason: str = ""



#: A pending tick's GPU in a snapshot: these fields, then its processes as _PROCESS_STATE lists.
#: Fields added later go after "mig_devices" (snapshots written before them lack them: None).
_GPU_STATE = ("gpu_uuid", "model", "health", "util_gpu_pct", "sm_active_pct", "mem_used_bytes", "mem_total_bytes",
              "power_w", "energy_j", "index", "mig_devices", "power_limit_w")
_MIG_AT = _GPU_STATE.index("mig_devices")
_PROCESS_STATE = ("container_id", "sm_util_pct", "mem_used_bytes")


def tick_state(tick: MeteredTick) -> list:
    """A pending tick as plain data for a snapshot (cheaper than model_dump, and smaller)."""
    return [tick.cluster, tick.node, tick.ts_ms, tick.interval_ms, [
        [*(getattr(g, f) for f in _GPU_STATE[:_MIG_AT]), [m.model_dump() for m in g.mig_devices],
         *(getattr(g, f) for f in _GPU_STATE[_MIG_AT + 1:]),
         [[getattr(p, f) for f in _PROCESS_STATE] for p in g.processes]]
        for g in tick.gpus]]


def tick_from_state(state: list | dict) -> MeteredTick:
    if isinstance(state, dict):  # a snapshot written before ticks were kept metered: a whole NodeTick
        return MeteredTick.model_validate(state)
    cluster, node, ts_ms, interval_ms, gpus = state
    return MeteredTick.model_validate({
        "cluster": cluster, "node": node, "ts_ms": ts_ms, "interval_ms": interval_ms,
        "gpus": [{**dict(zip(_GPU_STATE, g[:-1])),
                  "processes": [dict(zip(_PROCESS_STATE, p)) for p in g[-1]]}
                 for g in gpus]})




@dataclass
class NodeJoin:
    """One node: who holds each of its GPUs, ticks waiting for the watermark, and the
    allocation changes not yet applied. Closing emits usage records in event-time order."""

    node: str
    cluster: str = ""
    holders: dict[str, dict[tuple[str, int], Holder]] = field(default_factory=dict)
    pending_ticks: list[MeteredTick] = field(default_factory=list)
    #: input offset of each pending tick's message (None: unknown), for snapshots that leave
    #: pending ticks out and have them re-read from the input instead (`to_state`)
    pending_offsets: list[int | None] = field(default_factory=list)
    pending_changes: list[AllocationChange] = field(default_factory=list)
    last_energy: dict[str, tuple[int, float]] = field(default_factory=dict)  # gpu -> (tick ts, energy_j)
    closed_until_ms: int = 0
    late_changes: int = 0
    #: how long (event time, behind the closed horizon) change ids and closed tick ranges are kept
    retention_ms: int = DAY_MS
    seen_changes: dict[str, int] = field(default_factory=dict)  # event id -> ts_ms
    closed_ranges: list[list[int]] = field(default_factory=list)  # merged [start, end) of closed ticks
    duplicates: int = 0
    #: executing or idle, measured (streams/execution.py)
    judge: ExecutionJudge = field(default_factory=ExecutionJudge)
    #: what could not be matched since the last `take_unmatched()` (metrics; not part of the state):
    #: kind -> amount (docs/reliability.md, "Nothing unmatched in silence")
    unmatched: dict[str, float] = field(default_factory=dict, compare=False)
    #: changes of a node that never sent a tick are reported once, up to this event time
    unknown_reported_ms: int = 0
    #: gpu_uuid -> its open segment (records not emitted yet: part of the state)
    segments: dict[str, Segment] = field(default_factory=dict)
    #: start times of the pending ticks a restored snapshot left out, until they are read again: no
    #: flush may close a segment such a tick would have extended (sorted)
    awaiting_ms: list[int] = field(default_factory=list)
    #: (job_id, attempt) -> (its latest change, that change's assignments no GPU of the node answered to):
    #: tried again at each tick, held from the first that resolves them (insertion order: deterministic)
    unresolved: dict[tuple[str, int], tuple[AllocationChange, list[GpuAssignment]]] = field(default_factory=dict)
    #: the partition's samples clock right after the node's latest message was read, and the event time
    #: that message covered (its ticks x their interval), both set by WorkerCore: the node has stopped once
    #: the clock moved that span + flush_after on without it (`_flush`). None: never heard through
    #: WorkerCore (tools: the clock alone decides); -1: restored from a snapshot older than these fields
    #: (the first look sets it to the clock then)
    clock_at_last_message: int | None = None
    message_span_ms: int = 0
    #: the record maker of the last close (its templates and price lookups are reused; not state)
    _maker: RecordMaker | None = field(default=None, compare=False, repr=False)
    #: held GPUs the last tick closed did not report (`_held_not_reported`: logs each once; not state)
    _missing_held: set[str] = field(default_factory=set, compare=False, repr=False)

    # -- input
    def add_tick(self, tick: MeteredTick | NodeTick, offset: int | None = None) -> Verdict:
        """Buffer a tick (read at input `offset`, if known). A tick seen before (pending or closed)
        is a silent duplicate; an unseen tick before the closed horizon is rejected (late), and so is
        one overlapping a pending tick (overlapping)."""
        if isinstance(tick, NodeTick):  # the whole tick (tests, tools): keep what the worker would
            tick = MeteredTick.model_validate(tick.model_dump())
        end = tick.ts_ms + tick.interval_ms
        if tick.ts_ms < self.closed_until_ms:
            if any(lo <= tick.ts_ms and end <= hi for lo, hi in self.closed_ranges):
                self.duplicates += 1
                return Verdict(DUPLICATE)
            return Verdict(REJECTED, f"late tick: {self.node} ts_ms={tick.ts_ms} is before the closed horizon "
                                     f"{self.closed_until_ms} and was never seen")
        pending = self.pending_ticks
        i = len(pending)
        if pending and pending[-1].ts_ms >= tick.ts_ms:
            i = bisect.bisect_left(pending, tick.ts_ms, key=lambda t: t.ts_ms)
            if pending[i].ts_ms == tick.ts_ms:
                if pending[i] == tick:
                    self.duplicates += 1
                    return Verdict(DUPLICATE)
                return Verdict(REJECTED, f"conflicting duplicate tick: {self.node} ts_ms={tick.ts_ms} differs from "
                                         "the tick already received for that time in what the ledger meters (the "
                                         "first one is kept)")
        # A tick overlapping a pending one (an agent restarted with another interval) would count that
        # GPU time twice: the first received is kept, whatever closes when (one inside a closed tick
        # is a duplicate above, one across the closed horizon is late).
        before = pending[i - 1] if i else None
        other = before if before is not None and before.ts_ms + before.interval_ms > tick.ts_ms else \
            pending[i] if i < len(pending) and pending[i].ts_ms < end else None
        if other is not None:
            return Verdict(REJECTED, f"overlapping tick: {self.node} ts_ms={tick.ts_ms} interval_ms={tick.interval_ms} "
                                     f"overlaps the tick already received at ts_ms={other.ts_ms} interval_ms="
                                     f"{other.interval_ms} (the first one is kept)")
        self.cluster = tick.cluster
        if self.awaiting_ms and tick.ts_ms in self.awaiting_ms:
            self.awaiting_ms.remove(tick.ts_ms)
        pending.insert(i, tick)
        self.pending_offsets.insert(i, offset)
        return Verdict(ACCEPTED)

    def add_change(self, change: AllocationChange) -> Verdict:
        """Buffer an allocation change once (by event id). Before the closed horizon it is late: it
        takes effect from the next tick; further back than `retention_ms` it is rejected."""
        if change.event_id in self.seen_changes:
            self.duplicates += 1
            return Verdict(DUPLICATE)
        behind = self.closed_until_ms - change.ts_ms
        if behind > self.retention_ms:
            return Verdict(REJECTED, f"too late: allocation change {change.event_id} for {self.node} is {behind} ms "
                                     f"behind the closed horizon {self.closed_until_ms} (at most {self.retention_ms} "
                                     "ms are accepted)")
        self.seen_changes[change.event_id] = change.ts_ms
        keys = [c.ts_ms for c in self.pending_changes]
        self.pending_changes.insert(bisect.bisect_right(keys, change.ts_ms), change)
        if behind > 0:
            # Too late to split a closed tick: it takes effect from the next tick on.
            self.late_changes += 1
            log.warning("late allocation change %s for %s (%d ms behind)", change.event_id, self.node, behind)
            return Verdict(LATE, f"late allocation change: {change.kind} of {change.job_id}/{change.attempt} at "
                                 f"ts_ms={change.ts_ms} is {behind} ms behind the closed horizon of {self.node}; "
                                 f"applied from {self.closed_until_ms} on")
        return Verdict(ACCEPTED)

    # -- state
    def _count(self, kind: str, amount: float = 1) -> None:
        self.unmatched[kind] = self.unmatched.get(kind, 0) + amount

    def take_unmatched(self) -> dict[str, float]:
        """What went unmatched since the last call (for the worker's metrics)."""
        taken, self.unmatched = self.unmatched, {}
        return taken

    def _resolve(self, gpu: GpuAssignment, tick: MeteredTick) -> tuple[str, int] | None:
        """The metered GPU (UUID) an assignment holds and its share, through the node's GPU
        inventory in the tick: a GPU's UUID, a MIG instance's UUID (its parent GPU, the instance's
        share), or a device index. None: no GPU of this node's tick answers to it."""
        if gpu.gpu_uuid is not None:
            for g in tick.gpus:
                if g.gpu_uuid == gpu.gpu_uuid:
                    return g.gpu_uuid, gpu.share_milli
            for g in tick.gpus:
                for mig in g.mig_devices:
                    if mig.uuid == gpu.gpu_uuid:
                        self._count("mig_assignments")
                        return g.gpu_uuid, max(1, mig.share_milli * gpu.share_milli // 1000)
        if gpu.gpu_index is not None:
            for g in tick.gpus:
                if g.index == gpu.gpu_index:
                    return g.gpu_uuid, gpu.share_milli
        return None

    def _apply(self, change: AllocationChange, tick: MeteredTick) -> None:
        key = (change.job_id, change.attempt)
        if change.kind in TERMINAL_KINDS:
            for held in self.holders.values():
                held.pop(key, None)
            self.unresolved.pop(key, None)
            return
        if change.kind == JobEventKind.allocated:
            for held in self.holders.values():
                held.pop(key, None)
            self.unresolved.pop(key, None)
        # Several assignments of one change may name the same GPU (two MIG instances of it): the
        # attempt holds the sum of their shares (at most the whole GPU), not the last one's.
        per_gpu: dict[str, list] = {}  # uuid -> [share, container_id]
        missing: list[GpuAssignment] = []
        for gpu in change.gpus:
            resolved = self._resolve(gpu, tick)
            if resolved is None:
                # Billed to no GPU until a later tick resolves it: counted, logged, listed by
                # `gpuledger report unmatched` while it stays unbilled.
                self._count("allocation_gpu_not_reporting")
                log.warning("%s of %s/%s names GPU %s, which node %s does not report (tried again at each tick)",
                            change.kind, change.job_id, change.attempt, gpu.ref, self.node)
                missing.append(gpu)
                continue
            uuid, share = resolved
            got = per_gpu.setdefault(uuid, [0, None])
            got[0] = min(1000, got[0] + share)
            got[1] = got[1] or gpu.container_id
        if change.gpus:  # every change carries the attempt's GPUs on the node: the latest one says what is missing
            if missing:
                self.unresolved[key] = (change, missing)
            else:
                self.unresolved.pop(key, None)
        for uuid, (share, container_id) in per_gpu.items():
            self._hold(change, uuid, share, container_id, replace=True)

    def _hold(self, change: AllocationChange, uuid: str, share: int, container_id: str | None,
              replace: bool) -> None:
        """The attempt of `change` holds `share` of GPU `uuid`; `replace=False` adds the share to what the
        attempt already holds there (another instance of that GPU resolved later), at most the whole GPU."""
        key = (change.job_id, change.attempt)
        held = self.holders.setdefault(uuid, {})
        previous = held.get(key)
        if not replace and previous is not None:
            share = min(1000, previous.share_milli + share)
        held[key] = Holder(
            job_id=change.job_id, attempt=change.attempt, tenant=change.tenant, queue=change.queue,
            share_milli=share, running=change.kind in RUNNING_KINDS,
            container_id=container_id or (previous.container_id if previous else None),
        )

    def _retry_unresolved(self, tick: MeteredTick) -> None:
        """Try the kept unresolved assignments against this tick: those that resolve hold their GPU from
        its start (the time before stays unbilled, counted when their change was applied)."""
        for key, (change, missing) in list(self.unresolved.items()):
            still: list[GpuAssignment] = []
            for gpu in missing:
                resolved = self._resolve(gpu, tick)
                if resolved is None:
                    still.append(gpu)
                    continue
                log.info("%s/%s: GPU %s named at %d resolves on node %s from %d on", change.job_id, change.attempt,
                         gpu.ref, change.ts_ms, self.node, tick.ts_ms)
                self._hold(change, resolved[0], resolved[1], gpu.container_id, replace=False)
            if still:
                self.unresolved[key] = (change, still)
            else:
                del self.unresolved[key]

    def report_unknown_node(self, watermark_ms: int, grace_ms: int) -> int:
        """Allocation changes for this node older than watermark - grace while the node has never
        sent a tick: counted once each (the node is unknown to the ledger, or its agent is down).
        They are kept: ticks that arrive later are still billed with them."""
        if self.pending_ticks or self.closed_until_ms or self.awaiting_ms:
            return 0
        until = watermark_ms - grace_ms
        n = sum(1 for c in self.pending_changes if self.unknown_reported_ms < c.ts_ms <= until)
        if n:
            self._count("unknown_node_changes", n)
        self.unknown_reported_ms = max(self.unknown_reported_ms, until)
        return n

    def _tick_energy(self, tick: MeteredTick, gpu: MeteredGpu, ledger: LedgerConfig, maker: RecordMaker) -> float:
        """One GPU's energy over the tick, joules: the counter delta since the node's previous
        contiguous tick, else power x time. Sane values or none (docs/accounting.md): a delta above
        the card's power limit x the interval (x the tolerance) is not believed, nor is a power
        reading above the limit: power x time, the power capped at the limit, and counted (metric
        gpuledger_value_fallbacks_total). The limit is the config's for the model, or the sample's own
        where that is lower: a sample cannot raise it (a producer's word would inflate the energy cost).
        Also counts the GPU time of models priced under the [unpriced] policy."""
        seconds = tick.interval_ms / 1000.0
        limit = ledger.power_limit_w(gpu.model)
        if gpu.power_limit_w and gpu.power_limit_w < limit:
            limit = gpu.power_limit_w
        believable = limit * ledger.power_limit_tolerance
        previous = self.last_energy.get(gpu.gpu_uuid)
        model = gpu.model
        price, coef = maker.entries(model, tick.ts_ms)
        if price.model != model or coef.model != model:
            self._count(f"priced_by_default:{model}", seconds)
        if gpu.energy_j is not None:
            self.last_energy[gpu.gpu_uuid] = (tick.ts_ms, gpu.energy_j)
            if previous and previous[0] + tick.interval_ms == tick.ts_ms:
                delta = gpu.energy_j - previous[1]
                if 0 <= delta <= believable * seconds:
                    return delta
                if delta > 0:
                    self._count("fallback_energy_over_power_limit")
                    log.warning("%s %s: energy counter rose %.6g J in %g s, above the power limit %g W; power x "
                                "time used", self.node, gpu.gpu_uuid, delta, seconds, limit)
                else:
                    self._count("fallback_energy_counter_reset")
        power = gpu.power_w or 0.0
        if power > believable:
            self._count("fallback_power_over_power_limit")
            power = limit
        return power * seconds

    # -- output
    def close_until(self, watermark_ms: int, ledger: LedgerConfig, data_ms: int | None = None) -> list[dict]:
        """Close every tick that ends at or before the watermark into the GPUs' segments; return the
        usage records (wire dicts) of the segments that closed, and of those flushed (see `_flush`).
        `data_ms`: the samples clock of the node's input partition (the latest tick start received
        there, from any node); None: the watermark stands in for it (tools, tests)."""
        data_ms = watermark_ms if data_ms is None else data_ms
        pending = self.pending_ticks
        n = 0
        while n < len(pending) and pending[n].ts_ms + pending[n].interval_ms <= watermark_ms:
            n += 1
        if not n:
            if not self.segments:
                return []
            return self._close_ended(watermark_ms, ledger, None) + self._flush(data_ms, ledger, None)
        closing, self.pending_ticks = pending[:n], pending[n:]
        del self.pending_offsets[:n]
        records: list[dict] = []
        maker = None
        definitions = ledger.definitions
        metric = definitions.utilization_metric
        window = ledger.segment_window_ms
        segments = self.segments
        for tick in closing:
            start, end = tick.ts_ms, tick.ts_ms + tick.interval_ms
            while self.pending_changes and self.pending_changes[0].ts_ms <= start:
                self._apply(self.pending_changes.pop(0), tick)
            if self.unresolved:
                self._retry_unresolved(tick)
            cuts = [start]
            inside: list[AllocationChange] = []
            while self.pending_changes and self.pending_changes[0].ts_ms < end:
                change = self.pending_changes.pop(0)
                inside.append(change)
                if change.ts_ms != cuts[-1]:
                    cuts.append(change.ts_ms)
            cuts.append(end)
            if maker is None or maker.cluster != tick.cluster or maker.ledger is not ledger:
                if maker is not None:  # another cluster's records: nothing of the old one continues
                    records += self._close_segments(maker, None)
                maker = self._maker
                if maker is None or maker.cluster != tick.cluster or maker.ledger is not ledger:
                    maker = self._maker = RecordMaker(ledger, tick.cluster, self.node)
            energies = [self._tick_energy(tick, gpu, ledger, maker) for gpu in tick.gpus]
            for seg_start, seg_end in zip(cuts, cuts[1:]):
                while inside and inside[0].ts_ms <= seg_start:
                    self._apply(inside.pop(0), tick)
                share = (seg_end - seg_start) / tick.interval_ms
                for gpu, energy in zip(tick.gpus, energies):
                    held = self.holders.get(gpu.gpu_uuid)
                    holders = list(held.values()) if held else []
                    if holders:
                        # judged per tick, not per piece: another job's change cutting the tick must not
                        # move this GPU's holders between executing and idle (accounting.md §1a)
                        holders = self.judge.judge(gpu, holders, tick.ts_ms, definitions)
                    else:
                        self.judge.forget(gpu.gpu_uuid)  # nobody holds it: no quiet stretch goes on
                        if gpu.health is GpuHealth.ok and _busy(gpu, definitions.execution_util_floor_pct):
                            self._count("busy_unallocated_gpu_seconds", (seg_end - seg_start) / 1000)
                    uuid = gpu.gpu_uuid
                    seg = segments.get(uuid)
                    whole = maker.whole(gpu, holders, seg_start, seg_end, energy * share)
                    if whole is None:  # a shared GPU
                        made = maker.shared_pieces(gpu, holders, seg_start, seg_end, energy * share)
                        if made is None:
                            continue
                    elif seg is not None and seg.extend(whole, metric, seg_start, seg_end, tick.ts_ms):
                        continue  # the usual case: a GPU in one state, continuing its segment
                    else:
                        made = whole_pieces(whole, seg_end - seg_start)
                    template, pieces = made
                    key = piece_key(template, pieces)
                    if seg is not None:
                        if seg.end_ms == seg_start and seg_start < seg.window_end_ms and seg.key == key:
                            seg.add(pieces, metric, seg_start, seg_end, tick.ts_ms)
                            continue
                        records += seg.records(maker._fill)
                    segments[uuid] = Segment(seg_start, seg_end, (seg_start // window + 1) * window, template, key,
                                             [new_slot(p, metric, seg_end - seg_start) for p in pieces],
                                             1, 1, tick.ts_ms)
            if self.holders or self._missing_held:  # any held GPU may drop out, however few are held
                self._held_not_reported(tick)
            # closed with this tick: segments that reached their window's end, and those of GPUs it did not report
            records += self._close_segments(maker, end)
            self.closed_until_ms = end
            if self.closed_ranges and self.closed_ranges[-1][1] == start:
                self.closed_ranges[-1][1] = end
            else:
                self.closed_ranges.append([start, end])
        if segments:
            records += self._close_ended(watermark_ms, ledger, maker)
            records += self._flush(data_ms, ledger, maker)
        self._prune()
        return records

    def _held_not_reported(self, tick: MeteredTick) -> None:
        """GPUs an attempt holds that this tick does not report (fallen off the bus, the agent cannot
        read them): nothing bills that time, to the job or as capacity. Counted per GPU-second
        (`held_gpu_not_reporting_seconds`), logged when a GPU starts missing. Their holders' quiet
        stretches end, as a down GPU's do: the time unmeasured is the platform's, not their quiet."""
        reported = {g.gpu_uuid for g in tick.gpus}
        missing = {uuid for uuid, held in self.holders.items() if held and uuid not in reported}
        for uuid in missing:
            self.judge.forget(uuid)
        for uuid in sorted(missing - self._missing_held):
            log.warning("node %s does not report GPU %s, held by %s, from %d on: that time is billed to no one",
                        self.node, uuid, ", ".join(f"{h.job_id}/{h.attempt}" for h in self.holders[uuid].values()),
                        tick.ts_ms)
        if missing:
            self._count("held_gpu_not_reporting_seconds", len(missing) * tick.interval_ms / 1000)
        self._missing_held = missing

    def _close_segments(self, maker: RecordMaker, tick_end: int | None) -> list[dict]:
        """Emit the segments that cannot grow after a tick ending at tick_end (None: all of them)."""
        records: list[dict] = []
        for uuid, seg in list(self.segments.items()):
            if tick_end is None or seg.end_ms != tick_end or seg.end_ms >= seg.window_end_ms:
                records += seg.records(maker._fill)
                del self.segments[uuid]
        return records

    def _close_ended(self, watermark_ms: int, ledger: LedgerConfig, maker: RecordMaker | None) -> list[dict]:
        """Emit the open segments that an attempt's end closes: a terminal change at or before the
        segment's end (and behind the watermark, so final) for an attempt holding one of its slots.
        The next sample of that GPU cannot continue the segment (the holder is gone from it), so
        waiting for it would only delay the records — and a node whose samples end with the job's
        end (a trace replay, a node drained with its job) would keep them open."""
        if not self.pending_changes:
            return []
        ended = {}
        for c in self.pending_changes:
            if c.ts_ms > watermark_ms:
                break
            if c.kind in TERMINAL_KINDS:
                key = (c.job_id, c.attempt)
                ended[key] = min(ended.get(key, c.ts_ms), c.ts_ms)
        if not ended:
            return []
        records: list[dict] = []
        for uuid, seg in list(self.segments.items()):
            if any(sl[1] is not None and ended.get((sl[1].job_id, sl[1].attempt), seg.end_ms + 1) <= seg.end_ms
                   for sl in seg.slots):
                if maker is None:
                    maker = self._maker if self._maker is not None and self._maker.ledger is ledger else \
                        RecordMaker(ledger, self.cluster, self.node)
                records += seg.records(maker._fill)
                del self.segments[uuid]
        return records

    def _flush(self, data_ms: int, ledger: LedgerConfig, maker: RecordMaker | None) -> list[dict]:
        """Emit the open segments of a node that stopped reporting. Stopped: since the node's latest
        message, the samples clock of the partition has moved on by that message's span plus
        `segment_flush_after_ms` (other nodes have sent that much more; this one nothing) — measured
        from where the clock was, not from the node's tick times, so a peer's clock ahead (from the
        partition's first tick, or a tick from the future) flushes no node that keeps sending, and a
        node that batches its ticks is waited for one batch. Then the segments whose window ended,
        and whose next tick (one more interval of the segment's last tick) was due, at least
        `segment_flush_after_ms` before the clock, unless a pending tick of the node starts before
        that end (it is waiting for the watermark and will extend or close the segment). The
        lifecycle watermark is not the judge: a worker catching up on a samples backlog has it far
        ahead of every tick. The closed horizon moves to the window's end, so no tick can extend a
        record already emitted: a tick of that window arriving later is late (rejected, like any tick
        behind the horizon; docs/accounting.md "Segments")."""
        heard = self.clock_at_last_message
        if heard is not None:
            if heard < 0:  # restored from a snapshot older than the field: span + flush_after from now
                self.clock_at_last_message = heard = data_ms
            if data_ms - heard < self.message_span_ms + ledger.segment_flush_after_ms:
                return []  # the node has not been silent for a message of its own + flush_after
        limit = data_ms - ledger.segment_flush_after_ms
        first_pending = self.pending_ticks[0].ts_ms if self.pending_ticks else None
        if self.awaiting_ms:  # a tick left out of the snapshot and not read again yet counts as pending
            self.awaiting_ms = [ts for ts in self.awaiting_ms if ts >= self.closed_until_ms]
            if self.awaiting_ms and (first_pending is None or self.awaiting_ms[0] < first_pending):
                first_pending = self.awaiting_ms[0]
        records: list[dict] = []
        for uuid, seg in list(self.segments.items()):
            next_tick_end = 2 * seg.end_ms - seg.last_tick_ms
            if seg.window_end_ms <= limit and next_tick_end <= limit and \
                    (first_pending is None or first_pending >= seg.window_end_ms):
                if maker is None:
                    maker = RecordMaker(ledger, self.cluster, self.node)
                records += seg.records(maker._fill)
                del self.segments[uuid]
                self.closed_until_ms = max(self.closed_until_ms, seg.window_end_ms)
        return records

    def is_quiet_since(self, horizon_ms: int) -> bool:
        """Nothing of this node is held, pending or open, and its last closed tick ended before
        `horizon_ms`: its join can go (`WorkerCore._retire_quiet_nodes`)."""
        return (0 < self.closed_until_ms < horizon_ms and not any(self.holders.values())
                and not self.pending_ticks and not self.pending_changes and not self.segments
                and not self.unresolved and not self.awaiting_ms)

    def _prune(self) -> None:
        horizon = self.closed_until_ms - self.retention_ms
        if any(ts < horizon for ts in self.seen_changes.values()):
            self.seen_changes = {k: ts for k, ts in self.seen_changes.items() if ts >= horizon}
        while self.closed_ranges and self.closed_ranges[0][1] < horizon:
            self.closed_ranges.pop(0)

    # -- snapshots
    def resume_offset(self) -> int | None:
        """The first input offset holding a pending tick that `to_state` leaves out (None: none)."""
        return min((o for o in self.pending_offsets if o is not None), default=None)

    def to_state(self) -> dict:
        """Everything but the pending ticks whose input offset is known: those are not snapshotted
        (a backlog of them would make every snapshot grow) but re-read from the input, from
        `resume_offset()` on; ticks closed meanwhile are then recognised as duplicates."""
        kept = [tick_state(t) for t, o in zip(self.pending_ticks, self.pending_offsets) if o is None]
        return {
            "node": self.node,
            "cluster": self.cluster,
            "holders": {gpu: [holder_state(h) for h in held.values()] for gpu, held in self.holders.items()},
            "pending_ticks": kept,
            "pending_changes": [c.model_dump(mode="json") for c in self.pending_changes],
            "last_energy": {gpu: list(v) for gpu, v in self.last_energy.items()},
            "closed_until_ms": self.closed_until_ms,
            "late_changes": self.late_changes,
            "retention_ms": self.retention_ms,
            "seen_changes": dict(self.seen_changes),
            "closed_ranges": [list(r) for r in self.closed_ranges],
            "duplicates": self.duplicates,
            "quiet_since": self.judge.to_state(),
            "quiet_in": self.judge.containers_to_state(),
            "unknown_reported_ms": self.unknown_reported_ms,
            "segments": {gpu: seg.to_state() for gpu, seg in self.segments.items()},
            "awaiting_ms": sorted({*self.awaiting_ms, *(t.ts_ms for t, o in zip(self.pending_ticks, self.pending_offsets)
                                                         if o is not None)}),
            "unresolved": [[c.model_dump(mode="json"), [g.model_dump(mode="json") for g in missing]]
                           for c, missing in self.unresolved.values()],
            "clock_at_last_message": self.clock_at_last_message,
            "message_span_ms": self.message_span_ms,
        }

    @classmethod
    def from_state(cls, state: dict) -> "NodeJoin":
        holders = {}
        for gpu, held in state["holders"].items():
            hs = [Holder(**h) for h in held]
            holders[gpu] = {(h.job_id, h.attempt): h for h in hs}
        return cls(
            node=state["node"],
            cluster=state["cluster"],
            holders=holders,
            pending_ticks=[tick_from_state(t) for t in state["pending_ticks"]],
            pending_offsets=[None] * len(state["pending_ticks"]),
            pending_changes=[AllocationChange.model_validate(c) for c in state["pending_changes"]],
            last_energy={gpu: (int(v[0]), float(v[1])) for gpu, v in state["last_energy"].items()},
            closed_until_ms=state["closed_until_ms"],
            late_changes=state["late_changes"],
            retention_ms=state["retention_ms"],
            seen_changes=dict(state["seen_changes"]),
            closed_ranges=[list(r) for r in state["closed_ranges"]],
            duplicates=state["duplicates"],
            judge=ExecutionJudge.from_state(state.get("quiet_since"), state.get("quiet_in")),
            unknown_reported_ms=state.get("unknown_reported_ms", 0),
            segments={gpu: Segment.from_state(seg) for gpu, seg in state.get("segments", {}).items()},
            awaiting_ms=list(state.get("awaiting_ms", [])),
            unresolved={(c.job_id, c.attempt): (c, [GpuAssignment.model_validate(g) for g in missing])
                        for c, missing in ((AllocationChange.model_validate(c), m)
                                           for c, m in state.get("unresolved", []))},
            clock_at_last_message=state.get("clock_at_last_message", -1),
            message_span_ms=state.get("message_span_ms", 0),
        )
