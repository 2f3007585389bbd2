"""The watcher's logic without Kafka: behaviour alerts on jobs and reclaim suggestions on queues.

`Watcher` is fed the ledger's own output and the scheduler's snapshots, one message at a time:
- usage batches (`<prefix>usage`): per GPU slice, its state, holder, utilization, memory, cost;
- the lifecycle events the worker accepted (`<prefix>lifecycle-accepted`): when an attempt started,
  its checkpoint windows, when it ended;
- scheduler snapshots (`<prefix>scheduler-snapshots`): queue priorities and pending demand.
It returns the messages to publish on `<prefix>alerts` and `<prefix>reclaim-suggestions`.

Time is event time only (the records' and events' own times): replaying the same messages in the
same order gives the same alerts with the same ids. A usage record is a time slice
[start_ms, end_ms), of any length (a 5-s tick or a 60-s segment): it is split by duration into
buckets of `[alerts] bucket_s`, and the rules read buckets. A job's rules are evaluated up to the
last bucket every GPU of the job has covered (its horizon), a queue's up to the cluster's newest
record less one bucket. The rules, their parameters and versions are in docs/alerts.md.

The state (`to_state`/`from_state`) is plain JSON data; the process (gpuledger/watch.py) snapshots it
with the input offsets it covers before it commits them, as the worker does (docs/reliability.md).

Why one file: the job rules, the reclaim logic and the lifecycle handling read and change one state
(attempts with their buckets, queues, open alerts and suggestions) that is snapshotted as one
document; the definitions are apart (streams/watchdefs.py), the I/O is apart (gpuledger/watch.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import zlib
from collections import Counter
from dataclasses import dataclass, field

import orjson
from pydantic import ValidationError

from gpuledger.schemas.models import (
    TERMINAL_KINDS,
    Alert,
    JobEvent,
    JobEventKind,
    ReclaimSuggestion,
    SchedulerSnapshot,
    SuggestedJob,
    UsageBatch,
    UsageRecord,
    UsageState,
    WaitingDemand,
)
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, encode
from gpuledger.streams.core import Out
from gpuledger.streams.watchdefs import RECLAIM_VERSION, RULE_VERSIONS, WatchDefinitions

log = logging.getLogger(__name__)

STATE_VERSION = 1
#: ended attempts are remembered this long (event time) so their late usage reopens nothing
ENDED_RETENTION_MS = 86_400_000
#: how often (in usage time) the GPUs and nodes silent for ENDED_RETENTION_MS are looked for (`_prune_seen`)
SEEN_PRUNE_EVERY_MS = 3_600_000
#: a GPU going down this soon after its holder's last slice (and no later than this after the
#: holder's end: a job usually dies of its GPU's fatal Xid at once) went down under that holder
DOWN_GAP_MS = 300_000
#: An ended attempt is forgotten, its open alerts closed at its end, once every GPU it held has
#: reported a bucket past its end: lifecycle runs ahead of usage, which still has the job's last
#: minutes, and one node's usage can run hours ahead of another's (a replay's backlog), so the
#: cluster's progress says nothing about this job's. (A node that never reports again: `_prune`.)

# fields of a bucket (a list, for compact state)
DUR, GPU_MS, EXEC, UTIL_MS, MEASURED, UTIL_MAX, MEM_MIN, IDLE_COST = range(8)
MEM_NONE, MEM_UNKNOWN = -2, -1  # no slice yet / some slice did not measure memory

EXECUTING, IDLE, DOWN = UsageState.executing.value, UsageState.allocated_idle.value, UsageState.down.value


def _id(*parts) -> str:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()[:32]


def _minutes(ms: float) -> str:
    return f"{ms / 60_000:.0f} min"


@dataclass
class Attempt:
    """What the watcher knows of one job attempt."""

    cluster: str
    job_id: str
    attempt: int
    tenant: str = ""
    queue: str = ""
    #: when it started (its `started` event; else `allocated`; else its first usage)
    start_ms: int | None = None
    started_by_event: bool = False
    checkpoints: list[list] = field(default_factory=list)   # [begin_ms, end_ms or None]
    buckets: dict[str, dict[int, list]] = field(default_factory=dict)  # gpu -> bucket index -> bucket
    last_end: dict[str, int] = field(default_factory=dict)  # gpu -> end of its newest slice
    shares: dict[str, int] = field(default_factory=dict)    # gpu -> share_milli of its newest slice
    idle_cost_micros: int = 0
    evaluated_bucket: int = 0
    #: rule -> {"alert": open Alert wire dict, "ref": reference the rule closes against}
    open: dict[str, dict] = field(default_factory=dict)
    down: list[str] = field(default_factory=list)            # its GPUs down now
    #: rule -> the bucket its last alert closed at: a new one judges only time after it (no flapping)
    rearm: dict[str, int] = field(default_factory=dict)
    #: its end (a terminal lifecycle event), and how it ended; its usage before it is still judged
    ended_ms: int | None = None
    ended_kind: str = ""
    #: node -> when the attempt was allocated GPUs on it (its `allocated` events): a node not read up to
    #: DOWN_GAP_MS past that yet holds the job's judgement back (`_nodes_behind`); dropped once read
    awaited_nodes: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.cluster, self.job_id, self.attempt)

    def to_state(self) -> dict:
        return {"cluster": self.cluster, "job_id": self.job_id, "attempt": self.attempt, "tenant": self.tenant,
                "queue": self.queue, "start_ms": self.start_ms, "started_by_event": self.started_by_event,
                "checkpoints": self.checkpoints,
                "buckets": {g: [[i, *b] for i, b in sorted(bs.items())] for g, bs in self.buckets.items()},
                "last_end": self.last_end, "shares": self.shares, "idle_cost_micros": self.idle_cost_micros,
                "evaluated_bucket": self.evaluated_bucket, "open": self.open, "down": self.down, "rearm": self.rearm,
                "ended_ms": self.ended_ms, "ended_kind": self.ended_kind, "awaited_nodes": self.awaited_nodes}

    @classmethod
    def from_state(cls, s: dict) -> "Attempt":
        return cls(s["cluster"], s["job_id"], s["attempt"], s["tenant"], s["queue"], s["start_ms"],
                   s["started_by_event"], [list(c) for c in s["checkpoints"]],
                   {g: {row[0]: list(row[1:]) for row in rows} for g, rows in s["buckets"].items()},
                   dict(s["last_end"]), dict(s["shares"]), s["idle_cost_micros"], s["evaluated_bucket"],
                   dict(s["open"]), list(s["down"]), dict(s["rearm"]), s["ended_ms"], s["ended_kind"],
                   dict(s.get("awaited_nodes", {})))


#: reclaim judgement stops waiting for a GPU whose usage is this far behind the rest of its usage
#: partition (its node stopped reporting), or for a whole partition this far behind the cluster's
#: newest that has also delivered none of the cluster's usage for RECLAIM_QUIET_S of wall-clock time
#: (every node of the cluster on it stopped; another cluster's nodes on it may still report). A
#: partition that is only behind (a backlog being read) is waited for.
RECLAIM_STALE_MS = 10 * 60_000
RECLAIM_QUIET_S = 60.0
#: buckets are kept for reclaim steps not yet judged (usage of a partition, or the snapshots, behind)
#: at most this far behind what the alert rules need: bounded memory while snapshots stop
RECLAIM_MAX_LAG_MS = 2 * 3_600_000
#: scheduler snapshots are kept at most this far behind a cluster's newest (no step is judged while
#: reclaim is disabled or the cluster's usage has stopped, so nothing else prunes them)
SNAPSHOT_RETENTION_MS = ENDED_RETENTION_MS


class Watcher:
    """All of the watcher's state and logic; the process only moves bytes in and out."""

    def __init__(self, definitions: WatchDefinitions, *, currency: str,
                 alerts_topic: str, suggestions_topic: str, usage_topic: str, lifecycle_topic: str,
                 snapshots_topic: str):
        self.d = definitions
        self.currency = currency
        self.alerts_topic, self.suggestions_topic = alerts_topic, suggestions_topic
        self.usage_topic, self.lifecycle_topic, self.snapshots_topic = usage_topic, lifecycle_topic, snapshots_topic
        self.bucket_ms = int(definitions.alerts.bucket_s * 1000)
        a, r = definitions.alerts, definitions.reclaim
        # the closing windows too: a bucket pruned before a long close window filled kept the alert open
        lookback_s = max(a.util_drop.baseline_s + a.util_drop.recover_s, a.util_drop.close_s, a.low_util.for_s,
                         a.low_util.recover_s, 2 * a.straggler.window_s, a.hung.for_s, a.hung.close_s, r.window_s)
        # judged time skips checkpoints: look back over the longest one as well
        self.lookback_buckets = self._n(lookback_s + a.checkpoint_max_s) + 2
        self.attempts: dict[tuple[str, str, int], Attempt] = {}
        self.ended: dict[tuple[str, str, int], int] = {}
        #: (cluster, gpu) -> [[job_id, attempt, last end], ...]: several while the GPU is shared (time
        #: slicing, MPS), and the one before a successor for DOWN_GAP_MS
        self.holders: dict[tuple[str, str], list[list]] = {}
        self.gpu_seen: dict[tuple[str, str], int] = {}         # (cluster, gpu) -> end of its newest record
        #: (cluster, node) -> [end of its newest record, usage partition it comes on]
        self.node_seen: dict[tuple[str, str], list[int]] = {}
        self.gpu_partition: dict[tuple[str, str], int] = {}    # (cluster, gpu) -> usage partition it comes on
        self.partition_seen: dict[tuple[str, int], int] = {}   # (cluster, usage partition) -> newest record end
        #: (cluster, usage partition) -> wall-clock time (the caller's `now_s`) the partition last
        #: delivered usage of the cluster; not in the state. Per cluster: the usage topic is keyed by the
        #: bare node name, so nodes of two clusters share partitions, and one cluster's nodes reporting
        #: must not keep another's silent partition from counting as quiet (`_waited_for`)
        self.partition_heard: dict[tuple[str, int], float] = {}
        self.now_s: float | None = None
        self.queues: dict[tuple[str, str], dict[int, list]] = {}  # (cluster, queue) -> bucket -> [gpu_ms, exec]
        self.horizon: dict[str, int] = {}                        # cluster -> newest record end
        self.reclaim_evaluated: dict[str, int] = {}              # cluster -> bucket evaluated up to
        #: cluster -> compact scheduler snapshots by time: a queue is judged against the one of its
        #: window's end, not the newest read (snapshots run ahead of usage, as lifecycle does)
        self.snapshots: dict[str, list[dict]] = {}
        #: cluster -> the newest snapshot time read: reclaim is judged only up to it, so the same input
        #: gives the same suggestions whether snapshots arrive before or after the usage they judge
        self.snapshot_horizon: dict[str, int] = {}
        self.suggestions: dict[tuple[str, str], dict] = {}       # (cluster, queue) -> open suggestion wire dict
        #: ended attempts the alert rules are done with but a reclaim step before their end has yet to
        #: judge (usage of other partitions, or the snapshot, still behind): kept for those steps only
        self.reclaim_pending: dict[tuple[str, str, int], Attempt] = {}
        self.next_offsets: dict[str, dict[int, int]] = {}        # topic -> partition -> next offset
        self.counters: Counter[str] = Counter()
        self._reset_indexes()

    def _reset_indexes(self) -> None:
        """Indexes over the state that keep the work per usage message proportional to the message,
        not to the fleet (derived, not saved: rebuilt from the state as needed). Before them every
        usage message looked at every GPU, attempt and holder of its cluster: 12 ms a message at
        10,000 GPUs (bench/watch.py)."""
        #: keys of attempts with an end (ended_ms set) not forgotten yet: `_forget_ended` looks at these
        self._ending: set[tuple[str, str, int]] = {a.key for a in self.attempts.values() if a.ended_ms is not None}
        #: cluster -> [T, GPUs whose usage ended before T when last looked at]: `_evaluate_reclaim`
        #: asks whether one it waits for is still below T (the bucket its next step needs)
        self._lagging: dict[str, list] = {}
        self._seen_pruned_ms: dict[str, int] = {}  # cluster -> usage horizon at its last `_prune_seen`
        #: cluster -> a time no ended entry / no attempt's last activity of the cluster is older than
        #: (absent: unknown); `_prune` looks at them all only once the retention cut-off passes it
        self._ended_floor: dict[str, float] = {}
        self._attempts_floor: dict[str, float] = {}
        #: clusters an attempt was forgotten in since their holders were last pruned
        self._holders_dirty: set[str] = set(self.horizon)

    # ------------------------------------------------------------------ input
    def on_message(self, topic: str, partition: int, offset: int, raw: bytes | None,
                   now_s: float | None = None) -> list[Out]:
        """One input message (any of the three topics); messages already seen are skipped. `now_s`:
        wall-clock seconds (the process passes its clock; None: whole usage partitions are never
        taken for silent, as in tests that replay without one)."""
        self.now_s = now_s
        offsets = self.next_offsets.setdefault(topic, {})
        if offset < offsets.get(partition, 0):
            self.counters["redelivered"] += 1
            if topic == self.usage_topic and now_s is not None:
                try:  # read again, it is still its clusters' usage coming on the partition
                    self._heard(partition, {r["cluster"] for r in orjson.loads(raw or b"")["records"]})
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    pass
            return []
        offsets[partition] = offset + 1
        try:
            if topic == self.usage_topic:
                return self.on_usage(raw, partition, where=f"{topic}[{partition}]@{offset}")
            if topic == self.lifecycle_topic:
                return self.on_lifecycle(raw)
            if topic == self.snapshots_topic:
                return self.on_snapshot(raw)
        except DecodeError as exc:
            # the worker and sink set bad input aside with the reason; here it is only skipped
            self.counters["bad_input"] += 1
            log.warning("watch: skipping %s[%d]@%d: %s", topic, partition, offset, str(exc)[:300])
            return []
        raise ValueError(f"the watcher does not read topic {topic!r}")

    def readable_records(self, raw: bytes | None, where: str = "usage") -> list[UsageRecord]:
        """The batch's records the watcher can read (a `UsageRecord`, attempt >= 0 as an alert's),
        validated once. Applied record by record, a record it could not read, k of n, stopped the
        batch half way (records after k never applied, the alerts of those before k never sent, and
        the message counted as read); each one left out is logged with the reason and counted
        (`bad_records`). A message that is no batch at all raises DecodeError (`bad_input`)."""
        try:
            records = UsageBatch.model_validate_json(raw or b"", extra="ignore").records
            if all(r.attempt >= 0 for r in records):
                return records  # the usual case: one validation of the whole batch
        except ValidationError:
            pass
        try:
            batch = orjson.loads(raw or b"")
        except orjson.JSONDecodeError as exc:
            raise DecodeError(f"not a usage batch: JSONDecodeError: {exc}") from None
        if not isinstance(batch, dict) or not isinstance(batch.get("records"), list):
            raise DecodeError("not a usage batch: no list of records")
        readable = []
        for i, r in enumerate(batch["records"]):
            try:
                record = UsageRecord.model_validate(r, extra="ignore")
                if record.attempt < 0:
                    raise ValueError(f"attempt {record.attempt} is negative")
            except ValidationError as exc:
                first = exc.errors()[0]
                why = f"{'.'.join(map(str, first['loc'])) or 'record'}: {first['msg']}"
            except ValueError as exc:
                why = str(exc)
            else:
                readable.append(record)
                continue
            log.warning("watch: leaving out record %d of %d of %s: %s", i, len(batch["records"]), where, why[:300])
            self.counters["bad_records"] += 1
        return readable

    def on_usage(self, raw: bytes | None, partition: int = 0, where: str = "usage") -> list[Out]:
        parsed = [(r.cluster, r.gpu_uuid, r.start_ms, r.end_ms, r.state.value, r)
                  for r in self.readable_records(raw, where)]
        self.counters["usage_records"] += len(parsed)
        self._heard(partition, {p[0] for p in parsed})
        # the worker emits each GPU's records in time order and, after its restart, emits some again
        # (same ids, new offsets): a record starting before the newest already read for its GPU is such
        # a copy, skipped as the sink skips it (per message: shared GPUs have several records a slice)
        read_to = {(p[0], p[1]): self.gpu_seen.get((p[0], p[1]), 0) for p in parsed}
        outs: list[Out] = []
        touched: set[tuple[str, str, int]] = set()
        clusters: set[str] = set()
        for cluster, gpu, start, end, state, r in sorted(parsed, key=lambda p: (p[2], p[0], p[1])):
            if end <= start:
                continue
            if start < read_to[(cluster, gpu)]:
                self.counters["duplicate_records"] += 1
                continue
            clusters.add(cluster)
            self.horizon[cluster] = max(self.horizon.get(cluster, 0), end)
            self.gpu_seen[(cluster, gpu)] = max(self.gpu_seen.get((cluster, gpu), 0), end)
            self.gpu_partition[(cluster, gpu)] = partition
            self.partition_seen[(cluster, partition)] = max(self.partition_seen.get((cluster, partition), 0), end)
            if r.node:
                seen = self.node_seen.get((cluster, r.node))
                self.node_seen[(cluster, r.node)] = [max(end, seen[0] if seen else 0), partition]
            if state == DOWN:
                outs += self._gpu_down(cluster, gpu, start, end)
                continue
            job_id = r.job_id
            outs += self._gpu_up(cluster, gpu, start, end, (job_id, r.attempt)
                                 if state in (EXECUTING, IDLE) and job_id else None)
            if state not in (EXECUTING, IDLE) or not job_id:
                continue
            key = (cluster, job_id, r.attempt)
            ended = self.ended.get(key)
            if ended is not None and (start >= ended or key not in self.attempts):
                continue  # after its end (the worker's last records come after the end event)
            self._add_slice(key, gpu, start, end, state, r)
            touched.add(key)
        for key in sorted(touched):
            if key in self.attempts:
                outs += self._evaluate(self.attempts[key])
        for cluster in sorted(clusters):
            outs += self._evaluate_reclaim(cluster)
            outs += self._forget_ended(cluster)
            outs += self._prune(cluster)
        return outs

    def _heard(self, partition: int, clusters: set[str]) -> None:
        """These clusters' usage came on this usage partition now (`partition_heard`)."""
        if self.now_s is not None:
            for cluster in clusters:
                self.partition_heard[(cluster, partition)] = self.now_s

    def on_lifecycle(self, raw: bytes | None) -> list[Out]:
        message = decode_lifecycle(raw or b"")
        if not isinstance(message, JobEvent):
            return []
        e = message
        key = (e.cluster, e.job_id, e.attempt)
        if key in self.ended:
            return []
        if e.kind in TERMINAL_KINDS:
            self.ended[key] = e.ts_ms
            if e.cluster in self._ended_floor:
                self._ended_floor[e.cluster] = min(self._ended_floor[e.cluster], e.ts_ms)
            a = self.attempts.get(key)
            if a is not None:  # its alerts close once its usage up to the end has been judged
                a.ended_ms, a.ended_kind = e.ts_ms, e.kind.value
                self._ending.add(key)
            # (a suggestion naming it is withdrawn by the reclaim step that passes its end)
            return []
        if e.kind not in (JobEventKind.allocated, JobEventKind.started, JobEventKind.checkpoint_begin,
                          JobEventKind.checkpoint_end):
            return []
        a = self._attempt(key, e.tenant, e.queue)
        if e.kind is JobEventKind.started and not a.started_by_event:
            a.start_ms, a.started_by_event = e.ts_ms, True
        elif e.kind is JobEventKind.allocated:
            if not a.started_by_event:
                a.start_ms = e.ts_ms if a.start_ms is None else min(a.start_ms, e.ts_ms)
                self._attempts_floor.pop(a.cluster, None)  # its last activity may have moved back
            # its nodes' usage comes on their own partitions, at each one's pace (`_nodes_behind`); a
            # second allocation without a node (a pod ended) no longer waits for it
            a.awaited_nodes = {n: a.awaited_nodes.get(n, e.ts_ms) for n in sorted({g.node for g in e.gpus})}
        elif e.kind is JobEventKind.checkpoint_begin:
            # a copy (a restarted worker sends again what it accepted after its last snapshot) would stay
            # open, never ended, and keep checkpoint_max_s of the job from every rule
            if all(c[0] != e.ts_ms for c in a.checkpoints):
                a.checkpoints.append([e.ts_ms, None])
        elif e.kind is JobEventKind.checkpoint_end:
            opened = [c for c in a.checkpoints if c[1] is None and c[0] <= e.ts_ms]
            if opened:
                opened[-1][1] = e.ts_ms
        return []

    def on_snapshot(self, raw: bytes | None) -> list[Out]:
        snap = decode(SchedulerSnapshot, raw or b"")
        compact = {
            "ts_ms": snap.ts_ms,
            "queues": {q.queue: {"priority": q.priority,
                                 "pending": [[p.priority, p.jobs, p.gpus] for p in q.pending_by_priority]
                                 or ([[q.priority, q.pending_jobs, q.pending_gpus]] if q.pending_gpus > 0 else [])}
                       for q in snap.queues}}
        known = [k for k in self.snapshots.get(snap.cluster, []) if k["ts_ms"] != snap.ts_ms]
        self.snapshot_horizon[snap.cluster] = max(self.snapshot_horizon.get(snap.cluster, 0), snap.ts_ms)
        # bounded whatever the usage does: the reclaim steps prune what they have judged, but with
        # [reclaim] disabled, or a cluster whose usage stopped or never came (its scheduler agent
        # names it otherwise), no step ever runs: keep only the newest, or a day of them
        cut = self.snapshot_horizon[snap.cluster] - (SNAPSHOT_RETENTION_MS if self.d.reclaim.enabled else 0)
        self.snapshots[snap.cluster] = sorted([k for k in [*known, compact] if k["ts_ms"] >= cut],
                                              key=lambda k: k["ts_ms"])
        # usage may have come first: the steps it waited on this snapshot for are judged now
        return self._evaluate_reclaim(snap.cluster) if snap.cluster in self.horizon else []

    # ------------------------------------------------------------------ usage
    def _attempt(self, key: tuple[str, str, int], tenant: str, queue: str) -> Attempt:
        a = self.attempts.get(key)
        if a is None:
            a = self.attempts[key] = Attempt(*key, tenant=tenant, queue=queue)
            self._attempts_floor.pop(a.cluster, None)  # a new attempt: the cluster's floor is unknown
        a.tenant, a.queue = tenant or a.tenant, queue or a.queue
        return a

    def _add_slice(self, key, gpu: str, start: int, end: int, state: str, r: UsageRecord) -> None:
        a = self._attempt(key, r.tenant, r.queue)
        if a.start_ms is None:
            a.start_ms = start
        a.last_end[gpu] = max(a.last_end.get(gpu, 0), end)
        a.shares[gpu] = r.share_milli or 1000
        end = a.last_end[gpu]
        others = [h for h in self.holders.get((a.cluster, gpu), [])
                  if (h[0], h[1]) != (a.job_id, a.attempt) and h[2] >= end - DOWN_GAP_MS]
        self.holders[(a.cluster, gpu)] = [*others, [a.job_id, a.attempt, end]]
        gpu_ms, cost = float(r.gpu_ms), float(r.cost_micros)
        util, mem = r.util_pct, r.mem_used_bytes
        if cost and state == IDLE:
            a.idle_cost_micros += int(cost)
        buckets = a.buckets.setdefault(gpu, {})
        queue = self.queues.setdefault((a.cluster, a.queue), {})
        t = start
        while t < end:  # split the slice by duration over the buckets it covers
            i = t // self.bucket_ms
            piece_end = min(end, (i + 1) * self.bucket_ms)
            frac = (piece_end - t) / (end - start)
            b = buckets.get(i)
            if b is None:
                b = buckets[i] = [0, 0.0, 0.0, 0.0, 0, 0.0, MEM_NONE, 0.0]
            dur = piece_end - t
            b[DUR] += dur
            b[GPU_MS] += gpu_ms * frac
            if state == EXECUTING:
                b[EXEC] += gpu_ms * frac
            else:
                b[IDLE_COST] += cost * frac
            if util is not None:
                b[UTIL_MS] += float(util) * dur
                b[MEASURED] += dur
                b[UTIL_MAX] = max(b[UTIL_MAX], float(util))
            if mem is None or b[MEM_MIN] == MEM_UNKNOWN:
                b[MEM_MIN] = MEM_UNKNOWN
            else:
                b[MEM_MIN] = int(mem) if b[MEM_MIN] == MEM_NONE else min(b[MEM_MIN], int(mem))
            q = queue.setdefault(i, [0.0, 0.0])
            q[0] += gpu_ms * frac
            if state == EXECUTING:
                q[1] += gpu_ms * frac
            t = piece_end

    def _holders(self, cluster: str, gpu: str, start: int) -> list[Attempt]:
        """The attempts on the GPU just before `start`: every one whose slices reached the newest end
        read for it (all of its holders when it is shared, not one its successor took it from)."""
        held = self.holders.get((cluster, gpu))
        if not held:
            return []
        newest = max(h[2] for h in held)
        if start - newest > DOWN_GAP_MS:
            return []
        attempts = [self.attempts.get((cluster, h[0], h[1])) for h in held if h[2] == newest]
        return [a for a in attempts if a is not None]

    def _gpu_down(self, cluster: str, gpu: str, start: int, end: int) -> list[Out]:
        outs = []
        for a in self._holders(cluster, gpu, start):
            if gpu in a.down or (a.ended_ms is not None and start > a.ended_ms + DOWN_GAP_MS):
                continue
            a.down.append(gpu)
            if self.d.alerts.gpu_down.enabled and "gpu_down" not in a.open:
                outs.append(self._open(a, "gpu_down", [gpu], start, start, end,
                                       f"GPU {gpu} went down under running job {a.job_id} (attempt {a.attempt})"))
        return outs

    def _gpu_up(self, cluster: str, gpu: str, start: int, end: int, holder: tuple[str, int] | None) -> list[Out]:
        """A GPU's record that is not down; `holder`: the (job, attempt) it is billed to, if any."""
        held = self.holders.get((cluster, gpu), [])
        outs = []
        for h in held:
            a = self.attempts.get((cluster, h[0], h[1]))
            if a is None or gpu not in a.down:
                continue
            a.down.remove(gpu)
            if holder != (a.job_id, a.attempt) and not any(holder == (o[0], o[1]) for o in held):
                # back, but no longer the job's: its usage stopped at the fault, and judging the job must
                # not wait for it (the job's horizon is the least of its GPUs' newest usage). (Back with
                # another of its holders first: this one's record may follow in the same slice.)
                a.last_end.pop(gpu, None)
                a.shares.pop(gpu, None)
                a.buckets.pop(gpu, None)
            if not a.down and "gpu_down" in a.open:
                if a.ended_ms is not None and a.ended_ms <= start:
                    # back after the job's end (its other GPUs' usage behind): closed at the end, as
                    # `_forget_ended` closes it when they are read first
                    outs.append(self._close(a, "gpu_down", a.ended_ms, a.ended_ms, a.ended_ms, f"the job {a.ended_kind}"))
                else:
                    outs.append(self._close(a, "gpu_down", start, start, end, f"GPU {gpu} is back in service"))
        return outs

    # ------------------------------------------------------------------ alerts
    def _n(self, seconds: float) -> int:
        return max(1, math.ceil(seconds * 1000 / self.bucket_ms))

    def _definition(self, rule: str) -> str:
        return f"{self.d.alerts.version}/{rule}.v{RULE_VERSIONS[rule]}"

    def _open(self, a: Attempt, rule: str, gpus: list[str], at_ms: int, window_start: int, window_end: int,
              message: str, ref: float | None = None) -> Out:
        alert = Alert(alert_id=_id(a.cluster, a.job_id, a.attempt, rule, at_ms), rule=rule,
                      definition_version=self._definition(rule), cluster=a.cluster, job_id=a.job_id,
                      attempt=a.attempt, tenant=a.tenant, queue=a.queue, gpus=gpus, status="open",
                      opened_at_ms=at_ms, window_start_ms=window_start, window_end_ms=window_end, message=message)
        a.open[rule] = {"alert": alert.model_dump(mode="json"), "ref": ref}
        self.counters[f"alerts_opened_{rule}"] += 1
        return Out(self.alerts_topic, encode(alert), key=a.job_id.encode())

    def _close(self, a: Attempt, rule: str, at_ms: int, window_start: int, window_end: int, why: str) -> Out:
        opened = a.open.pop(rule)["alert"]
        a.rearm[rule] = at_ms // self.bucket_ms
        alert = Alert.model_validate({**opened, "status": "closed", "closed_at_ms": max(at_ms, opened["opened_at_ms"]),
                                      "window_start_ms": window_start, "window_end_ms": max(window_end, window_start),
                                      "message": f"{opened['message']}; closed: {why}"})
        self.counters[f"alerts_closed_{rule}"] += 1
        return Out(self.alerts_topic, encode(alert), key=a.job_id.encode())

    def _eligible(self, a: Attempt, i: int) -> bool:
        """A bucket the shape rules may judge: after the startup grace, outside checkpoint windows."""
        start, end = i * self.bucket_ms, (i + 1) * self.bucket_ms
        if a.start_ms is None or start < a.start_ms + self.d.alerts.startup_grace_s * 1000:
            return False
        longest = self.d.alerts.checkpoint_max_s * 1000
        return not any(b < end and (e if e is not None else b + longest) > start for b, e in a.checkpoints)

    def _job_util(self, a: Attempt, gpus: list[str], i: int) -> float | None:
        measured = sum(a.buckets[g][i][MEASURED] for g in gpus if i in a.buckets[g])
        if not measured:
            return None
        return sum(a.buckets[g][i][UTIL_MS] for g in gpus if i in a.buckets[g]) / measured

    def _mean(self, a: Attempt, gpus: list[str], indices) -> float | None:
        """Duration-weighted mean utilization over the buckets."""
        util = measured = 0.0
        for i in indices:
            measured += sum(a.buckets[g][i][MEASURED] for g in gpus if i in a.buckets[g])
            util += sum(a.buckets[g][i][UTIL_MS] for g in gpus if i in a.buckets[g])
        return util / measured if measured else None

    def _judged(self, a: Attempt, gpus: list[str], hb: int, count: int, rule: str) -> list[int]:
        """The newest `count` buckets below hb the rules may judge (after the grace, outside
        checkpoints, measured), newest first: a rule's "N minutes" are N minutes of judged time, so
        a checkpoint neither counts towards a drop nor hides one."""
        found = []
        oldest = hb - self.lookback_buckets
        if rule not in a.open:
            oldest = max(oldest, a.rearm.get(rule, oldest))
        for i in range(hb - 1, oldest - 1, -1):
            if len(found) == count:
                break
            if self._eligible(a, i) and any(i in a.buckets[g] and a.buckets[g][i][MEASURED] for g in gpus):
                found.append(i)
        return found

    def _nodes_behind(self, a: Attempt) -> bool:
        """Whether a node of the attempt's allocation has had its usage read only to before the
        allocation + DOWN_GAP_MS: its partition is behind (a backlog), and its GPUs' usage of the job is
        still to come. Judged on the nodes read so far, each step would be judged once without them
        (the demo's straggler, on the one node of six read last, was never seen). Not waited for: a
        node its partition went on without (it stopped), one whose partition stopped (`_waited_for`),
        one never read (no agent on it) once the cluster is RECLAIM_STALE_MS past the allocation
        (within the startup grace: nothing is judged earlier anyway). Nodes read far enough are
        dropped from the list."""
        quiet: dict[int, bool] = {}
        for node, at in list(a.awaited_nodes.items()):
            seen = self.node_seen.get((a.cluster, node))
            if seen is None:
                if self.horizon[a.cluster] - at <= RECLAIM_STALE_MS:
                    return True
            elif seen[0] >= at + DOWN_GAP_MS:
                del a.awaited_nodes[node]
            elif self._partition_waited_for(a.cluster, seen[1], seen[0], self.horizon[a.cluster], quiet):
                return True
        return False

    def _evaluate(self, a: Attempt) -> list[Out]:
        if not a.last_end or self._nodes_behind(a):
            return []
        # every GPU it holds that is not down: one node's usage may lag another's (a replay's backlog),
        # and the job is judged only as far as all of them have reported. A GPU whose own usage has
        # been read DOWN_GAP_MS past the job's last slice on it was given up (one pod of the job
        # ended: a second `allocated` without it): it no longer holds the horizon back, and counts
        # only in the steps its slices cover (so the answer does not depend on when that was read)
        live = sorted(g for g in a.last_end if g not in a.down)
        holding = [g for g in live if self.gpu_seen.get((a.cluster, g), 0) - a.last_end[g] <= DOWN_GAP_MS]
        if not live:
            return []
        # buckets below hb are complete. None holding: its usage on every GPU is complete (its last
        # minutes came in one batch with over DOWN_GAP_MS of the GPUs' later usage, as the worker emits
        # them when it catches up): judged to its last slice, not left unjudged and then forgotten
        hb = (min(a.last_end[g] for g in holding) if holding else max(a.last_end[g] for g in live)) // self.bucket_ms
        if hb <= a.evaluated_bucket:
            return []
        first = a.evaluated_bucket + 1 if a.evaluated_bucket else min(min(b) for b in a.buckets.values() if b) + 1
        a.evaluated_bucket = hb
        outs: list[Out] = []
        # every bucket boundary the horizon passed, in turn: the same alerts at the same times whether
        # the usage came a minute at a time or in one batch per watermark
        for step in range(first, hb + 1):
            gpus = [g for g in live if g in holding or a.last_end[g] >= step * self.bucket_ms]
            for rule, judge in (("util_drop", self._util_drop), ("low_util", self._low_util),
                                ("straggler", self._straggler), ("hung", self._hung)):
                if getattr(self.d.alerts, rule).enabled:
                    out = judge(a, gpus, step, step * self.bucket_ms)
                    if out is not None:
                        outs.append(out)
        keep = self._keep_from(a.cluster, hb)
        for g in list(a.buckets):  # keep what the longest window needs
            for i in [i for i in a.buckets[g] if i < keep]:
                del a.buckets[g][i]
        # and the checkpoint windows that reach a bucket kept: a job running for weeks must not make
        # every later bucket look through all its checkpoints (nor grow the state)
        longest = self.d.alerts.checkpoint_max_s * 1000
        a.checkpoints = [c for c in a.checkpoints if (c[1] if c[1] is not None else c[0] + longest) > keep * self.bucket_ms]
        return outs

    def _util_drop(self, a: Attempt, gpus: list[str], hb: int, horizon: int) -> Out | None:
        p = self.d.alerts.util_drop
        nr, nb = self._n(p.recover_s), self._n(p.baseline_s)
        if "util_drop" in a.open:
            ref = a.open["util_drop"]["ref"]
            nc = self._n(p.close_s)
            back = self._judged(a, gpus, hb, nc, "util_drop")
            utils = [self._job_util(a, gpus, i) for i in back]
            if len(back) == nc and min(utils) > ref * (1 - p.drop_pct / 100):
                return self._close(a, "util_drop", horizon, back[-1] * self.bucket_ms, horizon,
                                   f"utilization back at {sum(utils) / nc:.0f}% for {_minutes(nc * self.bucket_ms)}")
            return None
        judged = self._judged(a, gpus, hb, nr + nb, "util_drop")
        recent, base_idx = judged[:nr], judged[nr:]
        if len(recent) < nr or len(base_idx) * 2 < nb:
            return None
        base = self._mean(a, gpus, base_idx)
        if base is None or base < p.min_baseline_pct:
            return None
        utils = [self._job_util(a, gpus, i) for i in recent]
        if max(utils) > base * (1 - p.drop_pct / 100):
            return None
        mean = sum(utils) / len(utils)
        return self._open(a, "util_drop", gpus, horizon, judged[-1] * self.bucket_ms, horizon,
                          f"{a.job_id}: utilization fell from {base:.0f}% to {mean:.0f}% and has not recovered "
                          f"for {_minutes(nr * self.bucket_ms)}", ref=base)

    def _low_util(self, a: Attempt, gpus: list[str], hb: int, horizon: int) -> Out | None:
        p = self.d.alerts.low_util
        if "low_util" in a.open:
            n = self._n(p.recover_s)
            judged = self._judged(a, gpus, hb, n, "low_util")
            mean = self._mean(a, gpus, judged)
            if len(judged) == n and mean is not None and mean >= p.floor_pct:
                return self._close(a, "low_util", horizon, judged[-1] * self.bucket_ms, horizon,
                                   f"utilization averaged {mean:.1f}% over {_minutes(n * self.bucket_ms)}")
            return None
        n = self._n(p.for_s)
        judged = self._judged(a, gpus, hb, n, "low_util")
        mean = self._mean(a, gpus, judged)
        if len(judged) < n or mean is None or mean >= p.floor_pct:
            return None
        return self._open(a, "low_util", gpus, horizon, judged[-1] * self.bucket_ms, horizon,
                          f"{a.job_id}: utilization averaged {mean:.1f}% over {_minutes(n * self.bucket_ms)}, "
                          f"below the {p.floor_pct:g}% floor")

    def _spread(self, a: Attempt, gpus: list[str], indices: list[int]) -> tuple[float, str] | None:
        means = {}
        for g in gpus:
            covered = [i for i in indices if i in a.buckets[g] and a.buckets[g][i][MEASURED]]
            if len(covered) * 2 >= len(indices):
                means[g] = self._mean(a, [g], covered)
        if len(means) < 2:
            return None
        lagging = min(means, key=lambda g: (means[g], g))
        return max(means.values()) - means[lagging], lagging

    def _straggler(self, a: Attempt, gpus: list[str], hb: int, horizon: int) -> Out | None:
        p = self.d.alerts.straggler
        n = self._n(p.window_s)
        judged = self._judged(a, gpus, hb, 2 * n, "straggler")
        now = self._spread(a, gpus, judged[:n]) if len(judged) >= n else None
        if "straggler" in a.open:
            named = a.open["straggler"]["alert"]["gpus"]
            if not set(named) & set(gpus):  # the job gave the lagging GPU up (or lost it): no spread to judge
                return self._close(a, "straggler", horizon, horizon, horizon,
                                   f"GPU {', '.join(named)} no longer runs the job")
            if now is not None and now[0] < p.min_spread_pct:
                return self._close(a, "straggler", horizon, judged[n - 1] * self.bucket_ms, horizon,
                                   f"spread across the job's GPUs down to {now[0]:.0f} points")
            return None
        before = self._spread(a, gpus, judged[n:]) if len(judged) == 2 * n else None
        if now is None or before is None or now[0] < p.min_spread_pct or now[0] - before[0] < p.widen_pct:
            return None
        spread, lagging = now
        return self._open(a, "straggler", [lagging], horizon, judged[-1] * self.bucket_ms, horizon,
                          f"GPU {lagging} of {a.job_id} lags: {spread:.0f} points below the job's busiest GPU "
                          f"over {_minutes(n * self.bucket_ms)} (spread was {before[0]:.0f})")

    def _quiet_with_memory(self, a: Attempt, gpus: list[str], i: int) -> bool | None:
        """True: every GPU holds memory and is idle in bucket i; None: not measured."""
        p = self.d.alerts.hung
        for g in gpus:
            b = a.buckets[g].get(i)
            if b is None or not b[MEASURED] or b[MEM_MIN] < 0:
                return None
            if b[UTIL_MAX] > p.util_max_pct or b[MEM_MIN] < p.min_mem_bytes:
                return False
        return True

    def _hung(self, a: Attempt, gpus: list[str], hb: int, horizon: int) -> Out | None:
        p = self.d.alerts.hung
        if "hung" in a.open:
            nc = self._n(p.close_s)
            back = self._judged(a, gpus, hb, nc, "hung")
            if len(back) == nc and all(self._quiet_with_memory(a, gpus, i) is False for i in back):
                return self._close(a, "hung", horizon, back[-1] * self.bucket_ms, horizon,
                                   f"the job has been working for {_minutes(nc * self.bucket_ms)}")
            return None
        n = self._n(p.for_s)
        judged = self._judged(a, gpus, hb, n, "hung")
        if len(judged) < n or not all(self._quiet_with_memory(a, gpus, i) for i in judged):
            return None
        return self._open(a, "hung", gpus, horizon, judged[-1] * self.bucket_ms, horizon,
                          f"{a.job_id} holds memory on {len(gpus)} GPU(s) with no utilization for "
                          f"{_minutes(n * self.bucket_ms)}: hung?")

    # ------------------------------------------------------------------ reclaim
    def _waiting(self, cluster: str, queue: str, at_ms: int) -> WaitingDemand | None:
        """Work of higher priority than the queue's waiting at at_ms; None when unknown (no fresh
        snapshot, or the queue is not in it)."""
        snap = next((k for k in reversed(self.snapshots.get(cluster, [])) if k["ts_ms"] <= at_ms), None)
        if snap is None or at_ms - snap["ts_ms"] > self.d.reclaim.snapshot_max_age_s * 1000 or queue not in snap["queues"]:
            return None
        own = snap["queues"][queue]["priority"]
        gpus, jobs, top, names = 0.0, 0, own, set()
        for name, q in snap["queues"].items():
            for priority, n_jobs, n_gpus in q["pending"]:
                if priority > own and n_gpus > 0:
                    gpus, jobs, top = gpus + n_gpus, jobs + n_jobs, max(top, priority)
                    names.add(name)
        return WaitingDemand(gpus=round(gpus, 3), jobs=jobs, priority=top, queues=sorted(names),
                             snapshot_ms=snap["ts_ms"])

    @staticmethod
    def _rate(buckets: dict[int, list], indices: range, total: int = 0, executing: int = 1) -> float | None:
        alloc = sum(buckets[i][total] for i in indices if i in buckets)
        return None if alloc <= 0 else min(1.0, sum(buckets[i][executing] for i in indices if i in buckets) / alloc)

    def _usage_horizon(self, cluster: str) -> int:
        """How far every GPU of the cluster that still reports has had its usage read: a queue's rate
        is judged only over windows all of its GPUs' usage is in (usage comes per node partition, at
        each partition's pace, and a backlog can put one partition hours behind another). Not waited
        for: a GPU RECLAIM_STALE_MS behind the rest of its partition, and the GPUs of a partition
        that is that far behind the newest and quiet for RECLAIM_QUIET_S (see RECLAIM_STALE_MS)."""
        newest = self.horizon[cluster]
        quiet: dict[int, bool] = {}
        waits = [end for (c, gpu), end in self.gpu_seen.items()
                 if c == cluster and self._waited_for(cluster, gpu, end, newest, quiet)]
        return min(waits, default=newest)

    def _waited_for(self, cluster: str, gpu: str, end: int, newest: int, quiet: dict[int, bool]) -> bool:
        """Whether reclaim judgement waits for this GPU's usage (`_usage_horizon`); `quiet` caches
        each partition's silence (for this cluster: other clusters' usage on it does not count) for one
        look."""
        return self._partition_waited_for(cluster, self.gpu_partition.get((cluster, gpu), 0), end, newest, quiet)

    def _partition_waited_for(self, cluster: str, p: int, end: int, newest: int, quiet: dict[int, bool]) -> bool:
        """`_waited_for` of usage read up to `end` on partition p."""
        partition_end = self.partition_seen.get((cluster, p), end)
        if partition_end - end > RECLAIM_STALE_MS:
            return False  # its partition went on without it: its node stopped
        if newest - partition_end > RECLAIM_STALE_MS:
            if p not in quiet:
                # a partition not heard from since this process started (a restart) counts from now:
                # silent RECLAIM_QUIET_S more, it is quiet (else one silent partition would hold the
                # cluster's reclaim judgement for ever after a restart)
                heard = self.partition_heard.setdefault((cluster, p), self.now_s) if self.now_s is not None else None
                quiet[p] = self.now_s is not None and heard is not None and self.now_s - heard > RECLAIM_QUIET_S
            if quiet[p]:
                return False  # the whole partition stopped
        return True

    def _waits_below(self, cluster: str, t_ms: int) -> bool:
        """Whether a GPU reclaim judgement waits for has had its usage read only to before t_ms:
        `_usage_horizon(cluster) < t_ms` when the cluster's newest usage is at t_ms or later, without
        looking at every GPU each time. The GPUs below t_ms are listed once per t_ms; each look drops
        those that moved past it and stops at the first still waited for."""
        lag = self._lagging.get(cluster)
        if lag is None or lag[0] != t_ms:
            lag = self._lagging[cluster] = [t_ms, [g for (c, g), end in self.gpu_seen.items()
                                                   if c == cluster and end < t_ms]]
        gpus, newest, quiet, parked = lag[1], self.horizon[cluster], {}, []
        found = False
        while gpus:
            end = self.gpu_seen[(cluster, gpus[-1])]
            if end >= t_ms:
                gpus.pop()
            elif self._waited_for(cluster, gpus[-1], end, newest, quiet):
                found = True
                break
            else:
                parked.append(gpus.pop())  # not waited for now; may be again later
        gpus.extend(parked)
        return found

    def _evaluate_reclaim(self, cluster: str) -> list[Out]:
        r = self.d.reclaim
        if cluster not in self.snapshot_horizon:
            return []  # no snapshot yet: nothing is known to wait
        done = self.reclaim_evaluated.get(cluster, 0)
        # hb (below) passes `done` only if the snapshots, the newest usage and every GPU waited for are
        # past bucket done + 1: the cheap bounds first, the look at every GPU only when a step is due
        next_ms = (done + 2) * self.bucket_ms
        if not r.enabled or self.snapshot_horizon[cluster] // self.bucket_ms <= done or \
                self.horizon[cluster] < next_ms or self._waits_below(cluster, next_ms):
            return []
        hb = min(self._usage_horizon(cluster) // self.bucket_ms - 1,  # the newest bucket may still be filling
                 self.snapshot_horizon[cluster] // self.bucket_ms)  # a later snapshot may still come for later steps
        if hb <= done:
            self._lagging.pop(cluster, None)  # a GPU below next_ms the list did not have: list them again
            return []
        self.reclaim_evaluated[cluster] = hb
        n = self._n(r.window_s)
        # a step whose window reaches below what RECLAIM_MAX_LAG_MS kept is not judged (counted)
        whole_from = self.horizon[cluster] // self.bucket_ms - self.lookback_buckets - RECLAIM_MAX_LAG_MS // self.bucket_ms + n
        outs = []
        # every step since the last one judged (a catch-up batch of usage moves hb by many buckets at once:
        # skipping steps made suggestions depend on how usage was batched); the first, the last window's
        first = done + 1 if done else hb - n
        if first < whole_from:
            self.counters["reclaim_steps_skipped"] += min(whole_from, hb + 1) - first
            first = whole_from
        for step in range(first, hb + 1):
            outs += self._reclaim_at(cluster, step)
        for key in [k for k, a in self.reclaim_pending.items() if k[0] == cluster and a.ended_ms <= hb * self.bucket_ms]:
            del self.reclaim_pending[key]
        # snapshots no later step can use: the newest at or before this step stays
        snaps = self.snapshots.get(cluster, [])
        usable = [i for i, k in enumerate(snaps) if k["ts_ms"] <= hb * self.bucket_ms]
        if usable:
            self.snapshots[cluster] = snaps[usable[-1]:]
        return outs

    def _reclaim_at(self, cluster: str, hb: int) -> list[Out]:
        """The queues of a cluster judged over the window ending at bucket hb."""
        r = self.d.reclaim
        horizon, n = hb * self.bucket_ms, self._n(r.window_s)
        window = range(hb - n, hb)
        outs = []
        for (c, queue), buckets in sorted(self.queues.items()):
            if c != cluster:
                continue
            open_ = self.suggestions.get((cluster, queue))
            released = self._released_at(cluster, open_) if open_ is not None else None
            if released is not None and released <= horizon:
                outs.append(self._withdraw(cluster, queue, released, "every named job has released its GPUs"))
                open_ = None
            rate = self._rate(buckets, window, 0, 1)
            waiting = self._waiting(cluster, queue, horizon)
            if waiting is None or (rate is None and open_ is None):
                continue  # nothing known: keep what stands
            holds = rate is not None and rate < r.execution_rate_below and waiting.gpus > 0
            if open_ is not None:
                if not holds:
                    why = (f"execution rate back at {rate:.1%}" if rate is not None and rate >= r.execution_rate_below
                           else "no higher-priority work waits" if waiting.gpus <= 0 else "the queue holds no GPUs")
                    outs.append(self._withdraw(cluster, queue, horizon, why))
                continue
            if not holds or min(buckets, default=hb) > hb - n:
                continue  # not observed for a whole window yet
            outs += self._suggest(cluster, queue, rate, waiting, window, horizon)
        return outs

    def _suggest(self, cluster: str, queue: str, rate: float, waiting: WaitingDemand, window: range,
                 horizon: int) -> list[Out]:
        r = self.d.reclaim
        # judged as of the step's horizon, whatever has been read since (lifecycle runs ahead of usage,
        # and one partition's usage ahead of another's): a job ending later is still a candidate; its
        # GPUs are those it held in the window's last bucket, its idle cost what accrued before it
        hb = horizon // self.bucket_ms
        candidates = []
        for a in [*self.attempts.values(), *self.reclaim_pending.values()]:
            if a.cluster != cluster or a.queue != queue or a.start_ms is None or \
                    (a.ended_ms is not None and a.ended_ms <= horizon) or horizon - a.start_ms < r.min_job_age_s * 1000:
                continue
            gpus = sorted(g for g, bs in a.buckets.items() if hb - 1 in bs)
            merged: dict[int, list] = {}
            for g in gpus:
                for i, b in a.buckets[g].items():
                    m = merged.setdefault(i, [0.0, 0.0])
                    m[0] += b[GPU_MS]
                    m[1] += b[EXEC]
            job_rate = self._rate(merged, window, 0, 1)
            if gpus and job_rate is not None and job_rate < r.execution_rate_below:
                later = sum(b[IDLE_COST] for bs in a.buckets.values() for i, b in bs.items() if i >= hb)
                idle = a.idle_cost_micros - round(later)
                candidates.append((job_rate, -idle, a.job_id, a.attempt, a, gpus))
        chosen, freed = [], 0.0
        for job_rate, minus_idle, _, _, a, gpus in sorted(candidates, key=lambda c: c[:4]):
            if freed >= waiting.gpus:
                break
            # its share of each GPU in the window's last bucket (GPU-time / duration), not of the newest
            # record read: a shared GPU's share changes, and usage may be read well past the step
            frees = round(sum(a.buckets[g][hb - 1][GPU_MS] / a.buckets[g][hb - 1][DUR] if a.buckets[g][hb - 1][DUR]
                              else a.shares.get(g, 1000) / 1000 for g in gpus), 3)
            chosen.append(SuggestedJob(job_id=a.job_id, attempt=a.attempt, tenant=a.tenant, gpus=gpus, gpus_freed=frees,
                                       execution_rate=round(job_rate, 4), idle_cost_micros=-minus_idle))
            freed += frees
        if not chosen:
            return []
        idle = sum(j.idle_cost_micros for j in chosen)
        suggestion = ReclaimSuggestion(
            suggestion_id=_id(cluster, queue, horizon), definition_version=f"{self.d.reclaim.version}/reclaim.v{RECLAIM_VERSION}",
            cluster=cluster, queue=queue, status="open", opened_at_ms=horizon, execution_rate=round(rate, 4),
            window_ms=len(window) * self.bucket_ms, jobs=chosen, gpus_freed=round(freed, 3), waiting_demand=waiting,
            idle_cost_micros=idle, currency=self.currency,
            message=f"queue {queue} executed {rate:.1%} of its allocated GPU-time over the last "
                    f"{_minutes(len(window) * self.bucket_ms)} while {waiting.gpus:g} GPU(s) of priority up to "
                    f"{waiting.priority} wait: releasing {len(chosen)} job(s) frees {freed:g} GPU(s), "
                    f"idle so far {idle / 1e6:.2f} {self.currency}")
        self.suggestions[(cluster, queue)] = suggestion.model_dump(mode="json")
        self.counters["suggestions_opened"] += 1
        return [Out(self.suggestions_topic, encode(suggestion), key=queue.encode())]

    def _withdraw(self, cluster: str, queue: str, at_ms: int, why: str) -> Out:
        opened = self.suggestions.pop((cluster, queue))
        suggestion = ReclaimSuggestion.model_validate(
            {**opened, "status": "withdrawn", "withdrawn_at_ms": max(at_ms, opened["opened_at_ms"]),
             "message": f"{opened['message']}; withdrawn: {why}"})
        self.counters["suggestions_withdrawn"] += 1
        return Out(self.suggestions_topic, encode(suggestion), key=queue.encode())

    def _released_at(self, cluster: str, suggestion: dict) -> int | None:
        """When the last of a suggestion's jobs ended (the scheduler, or the owners, acted); None while
        one has not."""
        ends = [self.ended.get((cluster, j["job_id"], j["attempt"])) for j in suggestion["jobs"]]
        return None if None in ends else max(ends)

    def _forget_ended(self, cluster: str) -> list[Out]:
        """Ended attempts whose usage up to the end has been read: open alerts closed at the end."""
        outs = []
        horizon = self.horizon[cluster]

        quiet: dict[int, bool] = {}

        def gpu_done(g: str, end: int) -> bool:
            # a bucket past the end: a GPU the fault killed the job with would show down by then;
            # a node that stops at the job's end (a replayed pod) is done once its partition is well
            # past, or has stopped too (not the cluster's newest: another partition's backlog may run
            # hours ahead, and the job was forgotten before its GPU's down record was read)
            seen = self.gpu_seen.get((cluster, g), 0)
            if seen >= end + self.bucket_ms:
                return True
            p = self.gpu_partition.get((cluster, g), 0)
            return seen >= end and (self.partition_seen.get((cluster, p), seen) >= end + DOWN_GAP_MS
                                    or not self._partition_waited_for(cluster, p, seen, horizon, quiet))

        def done(a: Attempt) -> bool:  # (no usage of it read yet: its end came first, its usage follows;
            # nor of one of its nodes: `_nodes_behind`)
            return bool(a.last_end) and all(gpu_done(g, a.ended_ms) for g in a.last_end) and not self._nodes_behind(a)

        judged_to = self.reclaim_evaluated.get(cluster, 0) * self.bucket_ms
        reclaim_waits = self.d.reclaim.enabled and cluster in self.snapshot_horizon
        for key in sorted(k for k in self._ending if k[0] == cluster and done(self.attempts[k])):
            outs += self._evaluate(self.attempts[key])  # all its usage is in: judged to its last slice first
            a = self.attempts.pop(key)
            self._ending.discard(key)
            self._holders_dirty.add(cluster)
            outs += [self._close(a, rule, a.ended_ms, a.ended_ms, a.ended_ms, f"the job {a.ended_kind}")
                     for rule in sorted(a.open)]
            if reclaim_waits and judged_to < a.ended_ms:
                self.reclaim_pending[key] = a
        return outs

    # ------------------------------------------------------------------ housekeeping
    def _keep_from(self, cluster: str, hb: int) -> int:
        """The oldest bucket to keep when rules have judged up to bucket hb: what their longest
        window needs, and what the reclaim steps not judged yet need (up to RECLAIM_MAX_LAG_MS)."""
        keep = hb - self.lookback_buckets
        if self.d.reclaim.enabled and cluster in self.snapshot_horizon:
            waiting = self.reclaim_evaluated.get(cluster, 0) - self.lookback_buckets
            keep = max(min(keep, waiting), keep - RECLAIM_MAX_LAG_MS // self.bucket_ms)
        return keep

    def _prune(self, cluster: str) -> list[Out]:
        """Forget what no rule can use any more; the alerts of an attempt forgotten unfinished are closed."""
        outs: list[Out] = []
        horizon = self.horizon[cluster]
        oldest = self._keep_from(cluster, horizon // self.bucket_ms)
        for (c, _), buckets in self.queues.items():
            if c == cluster:
                for i in [i for i in buckets if i < oldest]:
                    del buckets[i]
        cut = horizon - ENDED_RETENTION_MS
        # each list below is looked through only when something in it can be due (the floors)
        if self._ended_floor.get(cluster, cut) <= cut:
            for key in [k for k, t in self.ended.items() if k[0] == cluster and t < cut]:
                del self.ended[key]
            self._ended_floor[cluster] = min((t for k, t in self.ended.items() if k[0] == cluster), default=math.inf)
        for key in [k for k, a in self.reclaim_pending.items() if k[0] == cluster and a.ended_ms < cut]:
            del self.reclaim_pending[key]
        # attempts whose end was never seen, or whose usage never came: forgotten after a day
        if self._attempts_floor.get(cluster, cut) <= cut:
            activity = {k: max([*a.last_end.values(), a.ended_ms or 0, a.start_ms or 0])
                        for k, a in self.attempts.items() if k[0] == cluster}
            for key in [k for k, t in activity.items() if t < cut]:
                a = self.attempts.pop(key)
                self._ending.discard(key)
                self._holders_dirty.add(cluster)
                # its alerts would stay open for ever (a node silent since before the job's end: its
                # usage up to the end never comes); closed at the end, else at its last activity
                why = (f"the job {a.ended_kind}; its usage up to the end never came" if a.ended_ms is not None
                       else "no usage or event of the job for a day")
                at = a.ended_ms if a.ended_ms is not None else activity[key]
                outs += [self._close(a, rule, at, at, at, why) for rule in sorted(a.open)]
            self._attempts_floor[cluster] = min((t for t in activity.values() if t >= cut), default=math.inf)
        if cluster in self._holders_dirty:
            self._holders_dirty.discard(cluster)
            for key in [k for k in self.holders if k[0] == cluster]:
                held = [h for h in self.holders[key] if (cluster, h[0], h[1]) in self.attempts]
                if held:
                    self.holders[key] = held
                else:
                    del self.holders[key]
        if horizon - self._seen_pruned_ms.get(cluster, -math.inf) >= SEEN_PRUNE_EVERY_MS:
            self._prune_seen(cluster, cut)
        return outs

    def _prune_seen(self, cluster: str, cut: int) -> None:
        """GPUs and nodes silent since before `cut` that nothing held or awaited names any more: forgotten
        (on a cluster whose nodes come and go, autoscaled or re-carved into MIG instances, they grew
        the state and each snapshot without bound). At most once per SEEN_PRUNE_EVERY_MS of usage."""
        self._seen_pruned_ms[cluster] = self.horizon[cluster]
        awaited = {n for (c, _, _), a in self.attempts.items() if c == cluster for n in a.awaited_nodes}
        for key in [k for k, end in self.gpu_seen.items() if k[0] == cluster and end < cut and k not in self.holders]:
            del self.gpu_seen[key]
            self.gpu_partition.pop(key, None)
        for key in [k for k, v in self.node_seen.items() if k[0] == cluster and v[0] < cut and k[1] not in awaited]:
            del self.node_seen[key]
        self._lagging.pop(cluster, None)  # may name a GPU forgotten: listed again when due

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict:
        return {"version": STATE_VERSION,
                "attempts": [a.to_state() for _, a in sorted(self.attempts.items())],
                "ended": [[*k, t] for k, t in sorted(self.ended.items())],
                "holders": [[*k, *h] for k, held in sorted(self.holders.items()) for h in held],
                "gpu_seen": [[*k, t] for k, t in sorted(self.gpu_seen.items())],
                "node_seen": [[*k, *v] for k, v in sorted(self.node_seen.items())],
                "gpu_partition": [[*k, p] for k, p in sorted(self.gpu_partition.items())],
                "partition_seen": [[*k, t] for k, t in sorted(self.partition_seen.items())],
                "queues": [[c, q, [[i, *b] for i, b in sorted(bs.items())]] for (c, q), bs in sorted(self.queues.items())],
                "horizon": self.horizon, "reclaim_evaluated": self.reclaim_evaluated, "snapshots": self.snapshots,
                "snapshot_horizon": self.snapshot_horizon,
                "suggestions": [s for _, s in sorted(self.suggestions.items())],
                "reclaim_pending": [a.to_state() for _, a in sorted(self.reclaim_pending.items())],
                "next_offsets": {t: {str(p): o for p, o in ps.items()} for t, ps in self.next_offsets.items()}}

    def load_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"watcher state version {state.get('version')!r} is not {STATE_VERSION}")
        attempts = [Attempt.from_state(s) for s in state["attempts"]]
        self.attempts = {a.key: a for a in attempts}
        self.ended = {(c, j, n): t for c, j, n, t in state["ended"]}
        self.holders = {}
        for c, g, j, n, t in state["holders"]:  # (a state written with one holder a GPU reads the same)
            self.holders.setdefault((c, g), []).append([j, n, t])
        self.gpu_seen = {(c, g): t for c, g, t in state["gpu_seen"]}
        self.gpu_partition = {(c, g): p for c, g, p in state.get("gpu_partition", [])}
        self.node_seen = {(c, n): [t, p] for c, n, t, p in state.get("node_seen", [])}
        self.partition_seen = {(c, p): t for c, p, t in state.get("partition_seen", [])}
        self.queues = {(c, q): {row[0]: list(row[1:]) for row in rows} for c, q, rows in state["queues"]}
        self.horizon = dict(state["horizon"])
        self.reclaim_evaluated = dict(state["reclaim_evaluated"])
        self.snapshots = {c: list(snaps) for c, snaps in state["snapshots"].items()}
        self.snapshot_horizon = dict(state.get("snapshot_horizon")
                                     or {c: snaps[-1]["ts_ms"] for c, snaps in self.snapshots.items() if snaps})
        self.suggestions = {(s["cluster"], s["queue"]): s for s in state["suggestions"]}
        self.reclaim_pending = {a.key: a for a in map(Attempt.from_state, state.get("reclaim_pending", []))}
        self.next_offsets = {t: {int(p): o for p, o in ps.items()} for t, ps in state["next_offsets"].items()}
        self._reset_indexes()

    def snapshot(self) -> bytes:
        """The whole state with the input offsets it covers, compressed JSON."""
        return zlib.compress(orjson.dumps(self.to_state()), 1)

    def restore(self, blob: bytes | None) -> None:
        if blob is not None:
            self.load_state(orjson.loads(zlib.decompress(blob)))

    def open_alerts(self) -> list[dict]:
        """The alerts open now (wire dicts), for tests and tools."""
        return [o["alert"] for a in self.attempts.values() for o in a.open.values()]
