"""`gpuledger agent slurm`: poll a Slurm controller, publish the ledger's lifecycle line and
scheduler snapshots.

Every poll runs `squeue --json --states=all`, `sinfo --json` and `scontrol show partition
--oneliner` (each under a timeout: client commands hang while slurmctld is down), hands the
output to the pure core (agents/slurm.py), and publishes its JobEvents (key: canonical job id),
a LifecycleWatermark on every partition of the job-events topic, and a SchedulerSnapshot (key:
cluster). Jobs that left squeue unfinished (the agent was down longer than MinJobAge) are
closed from `sacct`; jobs that came and left squeue while no poll ran are recovered from sacct's
rows of that time; GPU indices no poll saw come from the PrologSlurmctld records (`AllocationRecords`).

Why one file: the agent's thin I/O edge around the pure core: the commands, the sacct parser, the
state file and the spool sink share one poll's order (spool, then state, then watermark).

Durability: every message goes into a local disk spool (agents/spool.py) before the state file
is written, and the spool is drained to Kafka in order; so a Kafka outage or an agent crash
loses nothing, and a crash between the two re-emits events with the same ids (the ledger drops
the duplicates).

    gpuledger agent slurm --once --print        # one poll, JSON lines (a `gpuledger replay` dump) on stdout
    gpuledger agent slurm --interval 10         # publish forever
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import orjson

from gpuledger.agents.slurm import (
    AgentState,
    RecordedAllocation,
    SacctRow,
    SlurmInputError,
    build_snapshot,
    close_vanished,
    gpus_held_by_no_job,
    node_gpu_counts,
    parse_jobs,
    parse_recorded_allocation,
    partition_tiers,
    recover_unseen,
    translate,
)
from gpuledger.schemas.wire import encode

log = logging.getLogger("gpuledger.agents.slurm")

#: the state file is DATA_DIR/slurm-agent-<cluster>.json, the spool slurm-agent-<cluster> (`agent_file_name`)
FILE_PREFIX = "slurm-agent"

#: Routing of a spooled message: "<line>\x1f<partition>\x1f<key>" (the spool holds one key per record).
_SEP = "\x1f"
LINE_EVENTS, LINE_SNAPSHOTS = "job-events", "scheduler-snapshots"
#: Polls in a row a node must show the same GPUs held by no job before they count (and are logged): a job
#: starting or ending between the squeue and sinfo reads shows so for one poll.
UNHELD_POLLS = 3
#: a job stays in squeue MinJobAge seconds after it ends (`scontrol show config`; Slurm's default 300, less on busy
#: clusters): when no poll was published for that long (the agent down, or its polls failing), jobs may have come
#: and left squeue unseen, and sacct is asked for the jobs since then. This stands in while MinJobAge is unknown.
RECOVER_AFTER_S = 30
#: sacct's window for those reaches this far before the last poll (clock skew between the hosts)
RECOVER_MARGIN_S = 60
#: polls in a row that ask sacct again while a job it lists unfinished is no longer in squeue (slurmdbd gets a
#: job's end late when it was away), holding the watermark; then that job is given up (logged)
RECOVER_RETRY_POLLS = 6
#: what sacct is asked for: `parse_sacct`'s columns
SACCT_FIELDS = "JobID,JobIDRaw,State,Start,End,ExitCode,Account,Partition,NodeList,AllocTRES"


class CommandFailed(RuntimeError):
    pass


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector off while a poll works out its output. A poll of a large cluster
    builds hundreds of thousands of objects (the parsed JSON, the jobs, the next state) that form no
    cycle, yet every collection walks them all: at 100,000 GPUs a steady poll took 1.0 s of CPU with
    the collector on and 0.6 s with it off (bench/slurm.py). It is on again afterwards, and collects
    whatever cycles were made then."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_command(argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """stdout of a Slurm client command; CommandFailed (with the reason) on a timeout or an error.
    Bytes that are not UTF-8 become U+FFFD: Slurm passes a job name through as the user's raw bytes
    (`sbatch -J $'caf\\xe9'`), and one such name must not stop every poll of the cluster."""
    try:
        done = subprocess.run(list(argv), capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"{argv[0]} timed out after {timeout_s:.0f}s (is slurmctld up?)") from None
    except OSError as exc:
        raise CommandFailed(f"{argv[0]}: {exc}") from None
    if done.returncode != 0:
        stderr = done.stderr.decode("utf-8", errors="replace").strip()
        raise CommandFailed(f"{' '.join(argv)} exited {done.returncode}: {stderr[:500]}")
    return done.stdout.decode("utf-8", errors="replace")


def load_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SlurmInputError(f"{what} printed malformed JSON: {exc}") from None


def parse_sacct(text: str) -> dict[str, list[SacctRow]]:
    """`sacct -P -n --duplicates -X -o JobID,JobIDRaw,State,Start,End,ExitCode,Account,Partition[,NodeList[,AllocTRES[,Submit,ReqTRES]]]`
    with SLURM_TIME_FORMAT=%s → rows by canonical job id, oldest attempt first: JobID (`3_1`), but
    JobIDRaw (`7`) for a heterogeneous job's component (`6+1`), as squeue lists it by its own id."""
    rows: dict[str, list[SacctRow]] = {}
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 8:
            continue

        def epoch(v: str) -> int | None:
            return int(v) if v.isdigit() else None

        row = SacctRow(job_id=f[1] if "+" in f[0] else f[0], raw_id=f[1], state=(f[2].split() or [""])[0],
                       start_s=epoch(f[3]), end_s=epoch(f[4]), exit_code=f[5], account=f[6], partition=f[7],
                       nodes=f[8] if len(f) > 8 and f[8] not in ("None assigned", "(null)") else "",
                       alloc_tres=f[9] if len(f) > 9 else "", submit_s=epoch(f[10]) if len(f) > 10 else None,
                       req_tres=f[11] if len(f) > 11 else "")
        rows.setdefault(row.job_id, []).append(row)
    return rows


# --------------------------------------------------------------------------- state file
def load_state(path: Path) -> AgentState:
    if not path.exists():
        return AgentState()
    try:
        return AgentState.from_json(orjson.loads(path.read_bytes()))
    except (ValueError, SlurmInputError) as exc:
        # A state file we cannot read must not silently restart from nothing: that would re-emit
        # history (harmless, ids are deterministic) but also hide a real problem. Stop loudly.
        raise SystemExit(f"slurm agent: cannot read state file {path}: {exc}; move it away to start afresh")


def save_state(path: Path, state: AgentState, cluster: str | None = None) -> int:
    """Atomic: write a temporary file, fsync, rename over the old one, fsync the directory; returns
    the bytes written. orjson: at 15,625 tracked jobs (3.8 MB) 0.07 s of CPU a poll, where the json
    module took 0.28 s. `cluster` is recorded in it: whose state it is (`default_state_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    doc = state.to_json()
    if cluster is not None:
        doc["cluster"] = cluster
    data = orjson.dumps(doc)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


# --------------------------------------------------------------------------- publishing
class RoutingPublisher:
    """Between the spool's forwarder and Kafka: the spool stores one key per record, so the
    record's key carries its line, partition and Kafka key; this unpacks them."""

    def __init__(self, inner: Any, topics: dict[str, str]):
        self.inner = inner
        self.topics = topics

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None,
                on_delivery: Any = None) -> None:
        raw = key.decode() if isinstance(key, bytes) else (key or "")
        line, part, real_key = raw.split(_SEP, 2)
        self.inner.publish(self.topics[line], real_key or None, value,
                           partition=int(part) if part else None, on_delivery=on_delivery)

    def __getattr__(self, name: str) -> Any:  # poll, flush, close, pending, fatal_error
        return getattr(self.inner, name)


class SpoolSink:
    """Where a poll's messages go: the disk spool (drained to Kafka by a forwarder thread)."""

    def __init__(self, settings: Any, cluster: str, metrics: Any = None):
        """`metrics`: an AgentMetrics for the spool's depth and deliveries (optional)."""
        from gpuledger.agents.publisher import EVENT_PRODUCER_OVERRIDES, SPOOL_PRODUCER_OVERRIDES, KafkaPublisher
        from gpuledger.agents.spool import Forwarder, Spool

        topics = {LINE_EVENTS: settings.topics.job_events, LINE_SNAPSHOTS: settings.topics.scheduler_snapshots}

        def factory() -> Any:
            return RoutingPublisher(KafkaPublisher(settings, **SPOOL_PRODUCER_OVERRIDES, **EVENT_PRODUCER_OVERRIDES),
                                    topics)

        adopt_earlier_spool(settings, cluster)
        self.spool = Spool(spool_path(settings, cluster), max_bytes=max(settings.agent_spool_max_bytes, 1 << 20),
                           fsync=settings.agent_spool_fsync, on_drop=metrics.spool_dropped if metrics is not None else None)
        try:
            self.forwarder = Forwarder(self.spool, factory(), settings.topics.job_events, metrics=metrics,
                                       publisher_factory=factory).start()
        except Exception:
            self.spool.close()
            raise
        if metrics is not None:
            metrics.attach_spool(self.spool, self.forwarder)

    def put(self, line: str, key: str | None, value: bytes, partition: int | None = None) -> None:
        """Raises SpoolRefused when the spool could not write the message (disk full or failing): the
        poll must fail before its state file says the message was sent."""
        from gpuledger.agents.spool import SpoolRefused

        if not self.spool.append(value, f"{line}{_SEP}{'' if partition is None else partition}{_SEP}{key or ''}"):
            raise SpoolRefused(f"spool {self.spool.directory} could not write a {line} message (disk full or failing?)")
        self.forwarder.wake()

    def close(self, timeout: float = 10.0) -> int:
        left = self.forwarder.stop(flush_s=timeout, close_publisher=True)
        self.spool.close()
        return left


class PrintSink:
    """--print: one `gpuledger replay` dump line per message (a watermark once, key null)."""

    def __init__(self, out: Any = None):
        self.out = out or sys.stdout

    def put(self, line: str, key: str | None, value: bytes, partition: int | None = None) -> None:
        if partition not in (None, 0):
            return  # a broadcast watermark: printed once
        self.out.write('{"topic":%s,"key":%s,"value":%s}\n' % (json.dumps(line), json.dumps(key), value.decode()))
        self.out.flush()

    def close(self, timeout: float = 0) -> int:
        return 0


# --------------------------------------------------------------------------- allocations recorded by PrologSlurmctld
#: a record's file name: `<job id>.<restart count>` (deploy/slurm/gpuledger-prolog-slurmctld); the script's
#: temporary files start with a dot
_RECORD_NAME = re.compile(r"^(\d+)\.(\d+)$")
#: a record no poll has used or seen the attempt of is removed after this (its job was never in squeue
#: when a poll ran: it started and left while the agent was down, or its record was never needed)
RECORD_MAX_AGE_S = 7 * 86400


class AllocationRecords:
    """The allocations deploy/slurm/gpuledger-prolog-slurmctld records in `directory`, one file per attempt
    (docs/slurm.md, "Jobs between two polls"): looked up for an attempt whose GPU indices no poll saw,
    removed once a poll has seen the attempt allocated or ended (`prune`)."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.time):
        self.directory = directory
        self.clock = clock
        self._reported: set[str] = set()  # problems logged once each

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._reported:
            self._reported.add(key)
            log.warning(message, *args)

    def lookup(self, raw_id: int, attempt: int) -> RecordedAllocation | None:
        path = self.directory / f"{raw_id}.{attempt}"
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._once(f"read {path}", "PrologSlurmctld record %s cannot be read: %s", path, exc)
            return None
        try:
            return parse_recorded_allocation(text, raw_id)
        except SlurmInputError as exc:
            self._once(f"parse {path}", "PrologSlurmctld record %s not used: %s", path, exc)
            return None

    def prune(self, state: AgentState) -> int:
        """Removes the records of attempts the state has allocated or ended (a later poll never needs them),
        those of attempts before the job's current one, and any file older than RECORD_MAX_AGE_S. Returns how
        many it removed."""
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            self._once(f"list {self.directory}", "PrologSlurmctld records in %s cannot be listed: %s",
                       self.directory, exc)
            return 0
        if not entries:
            return 0  # nothing recorded since the last poll (or no PrologSlurmctld writes here)
        current = {js.raw_id: (js.attempt, js.allocated or js.ended) for js in state.jobs.values()}
        removed = 0
        now = self.clock()
        for entry in entries:
            name = _RECORD_NAME.match(entry.name)
            done = False
            if name:
                attempt, seen = current.get(int(name[1]), (-1, False))
                done = int(name[2]) < attempt or (int(name[2]) == attempt and seen)
            try:
                if not done and now - entry.stat().st_mtime < RECORD_MAX_AGE_S:
                    continue
                os.unlink(entry.path)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._once(f"remove {self.directory}", "PrologSlurmctld records in %s cannot be removed (%s): "
                           "the agent needs write access to the directory", self.directory, exc)
                break
        return removed


# --------------------------------------------------------------------------- one poll
class SlurmAgent:
    """Reads Slurm, keeps the state file, hands messages to a sink. `run` is injectable for tests."""

    def __init__(self, *, cluster: str, state_file: Path, sink: Any, partitions: int, command_timeout_s: float = 20.0,
                 margin_ms: int = 1000, run: Callable[..., str] = run_command,
                 clock: Callable[[], float] = time.time, persist: bool = True,
                 records: AllocationRecords | None = None):
        self.cluster = cluster
        self.state_file = state_file
        self.sink = sink
        self.partitions = partitions
        self.command_timeout_s = command_timeout_s
        self.margin_ms = margin_ms
        self.run = run  # run(argv, timeout_s, env=None) -> stdout, raises CommandFailed
        self.clock = clock
        self.persist = persist
        #: the allocations PrologSlurmctld records (--allocations-dir), or None
        self.records = records
        self.state = load_state(state_file)
        self.failures = 0
        self.polls = 0
        self.state_bytes_written = 0
        self.events_published = 0
        #: the nodes come from `scontrol show nodes --json`: sinfo groups them (`_read_nodes`)
        self.nodes_from_scontrol = False
        self.min_job_age_s: int | None = None  # Slurm's MinJobAge, read once it matters (`_min_job_age_s`)
        #: node -> (GPU indices Slurm counts in use that no job holds, polls in a row it has shown them)
        self.unheld: dict[str, tuple[tuple[int, ...], int]] = {}

    def stats(self) -> dict[str, float]:
        """What its metrics show (gpuledger.metrics.SCHEDULER_STATS), read from another thread."""
        state = self.state
        return {"watermark_timestamp_seconds": state.watermark_ms / 1000, "events_published": self.events_published,
                "jobs_tracked": len(state.jobs), "polls": self.polls, "poll_failures": self.failures,
                "state_bytes_written": self.state_bytes_written,
                "gpus_held_by_no_job": sum(len(gpus) for gpus, polls in self.unheld.values() if polls >= UNHELD_POLLS)}

    def _read_nodes(self) -> Any:
        """The nodes, one record each (name, gres, gres_used, partitions, boot times): `sinfo --json` of
        Slurm 22.05 lists them so; newer sinfo groups them ({"sinfo": [...]}, recorded on 24.11) and
        `scontrol show nodes --json` (23.02 on) lists them as 22.05's sinfo did: asked from then on."""
        if not self.nodes_from_scontrol:
            sinfo = load_json(self.run(["sinfo", "--json"], self.command_timeout_s), "sinfo")
            if not (isinstance(sinfo, dict) and "nodes" not in sinfo and isinstance(sinfo.get("sinfo"), list)):
                return sinfo
            self.nodes_from_scontrol = True
            log.info("sinfo --json groups the nodes (newer Slurm): they are read with `scontrol show nodes --json`")
        return load_json(self.run(["scontrol", "show", "nodes", "--json"], self.command_timeout_s),
                         "scontrol show nodes")

    def _note_gpus_held_by_no_job(self, found: Mapping[str, list[int]]) -> None:
        """Counts each node's run of polls showing the same GPUs held by no job; logs a run that reaches
        UNHELD_POLLS, and its end."""
        now: dict[str, tuple[tuple[int, ...], int]] = {}
        for node, gpus in found.items():
            before = self.unheld.get(node)
            polls = before[1] + 1 if before and before[0] == tuple(gpus) else 1
            now[node] = (tuple(gpus), polls)
            if polls == UNHELD_POLLS:
                log.warning("Slurm counts GPU(s) %s of node %s in use with no job in squeue holding them (%d polls "
                            "in a row): jobs that need them pend. `scontrol show node -d %s` shows them in "
                            "GresUsed; Slurm 22.05 leaves such GPUs after a controller restart and frees them at "
                            "the next one (docs/slurm.md, Restarts)", ",".join(map(str, gpus)), node, polls, node)
        for node in self.unheld.keys() - now.keys():
            if self.unheld[node][1] >= UNHELD_POLLS:
                log.info("node %s: Slurm no longer counts GPUs in use that no job holds", node)
        self.unheld = now

    def poll_once(self) -> bool:
        """One poll; False (logged, counted) when Slurm could not be read or its output used, or when
        the spool refused a message."""
        from gpuledger.agents.spool import SpoolRefused

        started_ms = int(self.clock() * 1000)
        try:
            with gc_paused():
                return self._poll(started_ms)
        except (CommandFailed, SlurmInputError) as exc:
            self.failures += 1
            log.warning("poll failed (%d so far): %s", self.failures, exc)
            return False
        except SpoolRefused as exc:
            # The state is not saved: the next poll derives the same events again (same ids; the
            # ones spooled before the refusal arrive twice and the worker drops the repeats).
            self.failures += 1
            log.error("poll failed (%d so far): %s; its events are published again at the next poll", self.failures, exc)
            return False

    def _poll(self, started_ms: int) -> bool:
        """poll_once's work: Slurm read, translated and published; raises CommandFailed or
        SlurmInputError before anything is published, SpoolRefused before the state is saved."""
        squeue = load_json(self.run(["squeue", "--json", "--states=all"], self.command_timeout_s), "squeue")
        sinfo = self._read_nodes()
        try:
            tiers = partition_tiers(self.run(["scontrol", "show", "partition", "--oneliner"], self.command_timeout_s))
        except CommandFailed as exc:
            log.warning("partition tiers unknown this poll: %s", exc)
            tiers = {}
        node_gpus = node_gpu_counts(sinfo)  # whole nodes for attempts whose GPU indices were not seen; parts of GPUs
        recorded = self.records.lookup if self.records is not None else None
        accounting = None
        for _ in range(2):  # again with sacct's rows when jobs were requeued more than once since the last poll, or first seen requeued
            result = translate(squeue, self.state, cluster=self.cluster, poll_started_ms=started_ms, tiers=tiers,
                               margin_ms=self.margin_ms, accounting=accounting, node_gpus=node_gpus, recorded=recorded)
            # result.state: a job first seen this poll (at a restart count above 0) is only there
            if not result.needs_sacct or (accounting := self._sacct(result.needs_sacct, result.state)) is None:
                break  # sacct failed: its warning says those attempts in between are only `retried`
        events, state = result.events, result.state
        warnings = list(result.warnings)
        if result.vanished:
            more, state, w = close_vanished(result.vanished, state, self._sacct(result.vanished, state),
                                            cluster=self.cluster, lost_at_ms=started_ms, promised_ms=result.promised_ms,
                                            node_gpus=node_gpus, recorded=recorded)
            events += more
            warnings += w
        parsed = parse_jobs(squeue)
        if not state.recover_from_ms and state.polled_ms \
                and started_ms - state.polled_ms >= 1000 * min(RECOVER_AFTER_S, self._min_job_age_s()):
            state.recover_from_ms = state.polled_ms  # no poll published since then: jobs may have come and gone
        if state.recover_from_ms:
            # a squeue record with no readable id may be any of sacct's jobs: recovered at a later poll
            rows = None if parsed.unreadable_unknown else self._sacct_since(state.recover_from_ms, started_ms)
            if rows is None:  # asked again next poll; their events, still to come, carry times after this one
                state.watermark_ms = min(state.watermark_ms, result.promised_ms)
            else:
                if state.recover_waiting:  # the others were recovered at an earlier poll
                    rows = {k: v for k, v in rows.items() if k in state.recover_waiting}
                known = set(self.state.jobs) | set(state.jobs) | {j.job_id for j in parsed.jobs}
                more, state, w, unfinished = recover_unseen(
                    rows, state, known, cluster=self.cluster, lost_at_ms=started_ms, promised_ms=result.promised_ms,
                    node_gpus=node_gpus, recorded=recorded, known_raw=parsed.unreadable_ids)
                events += more
                warnings += w
                if unfinished and state.recover_polls < RECOVER_RETRY_POLLS:
                    # asked again next poll, for these only; the watermark waits
                    state.recover_polls, state.recover_waiting = state.recover_polls + 1, unfinished
                    state.watermark_ms = min(state.watermark_ms, result.promised_ms)
                    log.info("job(s) %s: unfinished in sacct, gone from squeue: sacct asked again next poll (%d of %d)",
                             ", ".join(unfinished), state.recover_polls, RECOVER_RETRY_POLLS)
                else:
                    if unfinished:
                        warnings.append(f"job(s) {', '.join(unfinished)} unfinished in sacct but gone from squeue "
                                        f"after {RECOVER_RETRY_POLLS} polls: not recovered (sacctmgr show runawayjobs)")
                    state.recover_from_ms, state.recover_polls, state.recover_waiting = 0, 0, []
        state.polled_ms = started_ms
        snapshot = build_snapshot(squeue, sinfo, cluster=self.cluster, ts_ms=(started_ms // 1000) * 1000,
                                  tiers=tiers, preemptions=state.preemptions, jobs=parsed.jobs, node_gpus=node_gpus)
        self._note_gpus_held_by_no_job(gpus_held_by_no_job(sinfo, parsed))
        for w in warnings:
            log.warning("%s", w)
        for event in events:
            self.sink.put(LINE_EVENTS, event.job_id, encode(event))
        self.events_published += len(events)
        # close_vanished may hold it back (jobs waiting for sacct): the state's is the one to publish
        watermark = encode(result.watermark.model_copy(update={"ts_ms": state.watermark_ms}))
        for p in range(self.partitions):
            self.sink.put(LINE_EVENTS, None, watermark, partition=p)
        self.sink.put(LINE_SNAPSHOTS, self.cluster, encode(snapshot))
        state.preemptions = []
        # The messages are in the spool (on disk) before the state that says they were sent.
        if self.persist:
            self.state_bytes_written += save_state(self.state_file, state, self.cluster)
            if self.records is not None:  # after the state: a crash before it leaves them for the same poll again
                self.records.prune(state)
        self.state = state
        self.polls += 1
        log.info("poll %d: %d event(s), watermark %d, %d job(s) tracked", self.polls, len(events),
                 state.watermark_ms, len(state.jobs))
        return True

    def _sacct(self, job_ids: list[str], state: AgentState) -> dict[str, list[SacctRow]] | None:
        """sacct's rows for these jobs; None when sacct failed (vanished jobs wait for the next poll). A
        cluster without accounting storage can never answer: there, no record at all."""
        raw = sorted({str(state.jobs[j].raw_id) for j in job_ids if j in state.jobs})
        if not raw:
            return {}
        try:
            text = self.run(["sacct", "-P", "-n", "--duplicates", "-X", "-j", ",".join(raw), "-o", SACCT_FIELDS + ",Submit"],
                            self.command_timeout_s,
                            env={**os.environ, "SLURM_TIME_FORMAT": "%s"})  # epoch seconds, no time zone guessing
        except CommandFailed as exc:
            if "accounting storage is disabled" in str(exc).lower():  # accounting_storage/none: never answers
                log.warning("sacct: no accounting storage on this cluster (%s): vanished jobs %s have no record", exc, raw)
                return {}
            log.warning("sacct for jobs %s failed (vanished ones: asked again next poll): %s", raw, exc)
            return None
        return parse_sacct(text)

    def _min_job_age_s(self) -> int:
        """Slurm's MinJobAge (`scontrol show config`), read once; RECOVER_AFTER_S while it cannot be read."""
        if self.min_job_age_s is None:
            try:
                text = self.run(["scontrol", "show", "config"], self.command_timeout_s)
            except CommandFailed as exc:
                log.warning("scontrol show config failed (MinJobAge taken as %d s this poll): %s", RECOVER_AFTER_S, exc)
                return RECOVER_AFTER_S
            found = re.search(r"^MinJobAge\s*=\s*(\d+)", text, re.M)
            self.min_job_age_s = int(found[1]) if found else RECOVER_AFTER_S
        return self.min_job_age_s

    def _sacct_since(self, from_ms: int, now_ms: int) -> dict[str, list[SacctRow]] | None:
        """sacct's rows (with Submit and ReqTRES) of every user's jobs since `from_ms` less RECOVER_MARGIN_S, for
        `recover_unseen`; None when sacct failed (asked again next poll). A window relative to now (`-S now-N`):
        no time zone between the agent's host and slurmdbd's."""
        back_s = max(0, now_ms - from_ms) // 1000 + RECOVER_MARGIN_S
        try:
            text = self.run(["sacct", "-P", "-n", "--duplicates", "-X", "--allusers", "-S", f"now-{back_s}", "-E", "now",
                             "-o", SACCT_FIELDS + ",Submit,ReqTRES"], self.command_timeout_s,
                            env={**os.environ, "SLURM_TIME_FORMAT": "%s"})
        except CommandFailed as exc:
            if "accounting storage is disabled" in str(exc).lower():
                log.warning("polls stopped for a while, and this cluster has no accounting storage (%s): jobs that "
                            "came and left squeue meanwhile are not known to the ledger", exc)
                return {}
            log.warning("sacct for the jobs since the polls stopped failed (asked again next poll): %s", exc)
            return None
        log.info("polls had stopped for %d s: asked sacct for the jobs since then", back_s - RECOVER_MARGIN_S)
        return parse_sacct(text)


def run_forever(agent: SlurmAgent, interval_s: float, stop: threading.Event) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            agent.poll_once()
        except Exception:  # never let one bad poll end the agent
            agent.failures += 1
            log.exception("poll crashed; carrying on")
        stop.wait(max(0.0, interval_s - (time.monotonic() - t0)))


def _earlier_name(cluster: str) -> str:
    """What versions before `agent_file_name` named the cluster's state file and spool by: the name
    with other characters than [A-Za-z0-9._-] as '_', which 'a b', 'a:b' and 'a_b' all share."""
    from gpuledger.agents.gpu_agent import file_safe

    return f"{FILE_PREFIX}-{file_safe(cluster)}"


def _recorded_cluster(path: Path) -> str | None:
    """The cluster a state file says it is of (`save_state`); None: not recorded (an earlier version
    wrote it) or not readable (load_state says why, if it comes to reading it)."""
    try:
        cluster = orjson.loads(path.read_bytes()).get("cluster")
    except (OSError, ValueError, AttributeError):
        return None
    return cluster if isinstance(cluster, str) else None


def default_state_file(settings: Any, cluster: str) -> Path:
    """GPULEDGER_SLURM_AGENT_STATE_FILE, else DATA_DIR/<agent_file_name('slurm-agent', cluster)>.json.

    A cluster whose name file_safe changes had its file under `_earlier_name` before, a name other
    clusters share. While no file of the new name exists, such a file is: moved to the new name if it
    says it is this cluster's; left alone if it says it is another's (this cluster never had one);
    and if it does not say (an earlier version wrote it), the agent stops with a message saying what
    to do: starting from an empty state would send this cluster's history again and leave the jobs
    that left squeue meanwhile open for ever, and taking another cluster's state would close its jobs
    under this cluster's name."""
    from gpuledger.agents.gpu_agent import agent_file_name, file_safe

    if settings.slurm_agent_state_file:
        return Path(settings.slurm_agent_state_file)
    data = Path(settings.data_dir)
    path = data / f"{agent_file_name(FILE_PREFIX, cluster)}.json"
    earlier = data / f"{_earlier_name(cluster)}.json"
    if earlier == path or path.exists() or not earlier.exists():
        return path
    owner = _recorded_cluster(earlier)
    if owner == cluster:
        os.replace(earlier, path)
        log.warning("moved the state file %s of an earlier version to %s", earlier, path)
    elif owner is None:
        raise SystemExit(
            f"slurm agent: cluster {cluster!r} has no state file {path} yet; {earlier} was written by an earlier "
            f"version, which named state files by the cluster name with other characters than [A-Za-z0-9._-] as '_', "
            f"so it may be this cluster's or another's (e.g. cluster {file_safe(cluster)!r}'s). If it is this "
            f"cluster's, move it to {path}; if it is another's, run that cluster's agent once with this version (it "
            f"then records its name in the file) or start this one with --state-file {path}. Not started from an "
            f"empty state: that would publish this cluster's history again and leave open the jobs that left squeue")
    return path


def spool_path(settings: Any, cluster: str) -> Path:
    """The cluster's spool directory: <spool dir>/<agent_file_name('slurm-agent', cluster)>."""
    from gpuledger.agents.gpu_agent import agent_file_name, spool_dir

    return spool_dir(settings, agent_file_name(FILE_PREFIX, cluster))


def adopt_earlier_spool(settings: Any, cluster: str) -> None:
    """The spool directory of `_earlier_name` is taken over whole (one rename) while the cluster has
    none of its new name, so that messages spooled and not yet sent before an upgrade are sent: its
    records name their own line, partition and key, so any Slurm agent may send them. Left alone when
    that name's state file says it is another cluster's, or another agent holds the spool's lock."""
    from gpuledger.agents.gpu_agent import spool_dir
    from gpuledger.agents.spool import take_over_spool

    own = spool_path(settings, cluster)
    earlier = spool_dir(settings, _earlier_name(cluster))
    if earlier == own or not earlier.is_dir() or own.exists():
        return
    if _recorded_cluster(Path(settings.data_dir) / f"{_earlier_name(cluster)}.json") not in (None, cluster):
        return
    take_over_spool(earlier, own)


def build_parser(settings: Any) -> argparse.ArgumentParser:
    """The agent's command line (defaults from `settings`); deploy/ files are checked against it."""
    p = argparse.ArgumentParser(prog="gpuledger agent slurm",
                                description="Publish a Slurm cluster's job lifecycle and queue snapshots to the ledger.")
    p.add_argument("--cluster", default=settings.cluster, help="cluster name in the ledger (default %(default)s)")
    p.add_argument("--interval", type=float, default=settings.slurm_agent_interval_s, help="seconds between polls (default %(default)s)")
    p.add_argument("--state-file", type=Path, default=None,
                   help="the agent's state (default DATA_DIR/slurm-agent-<cluster>.json; with --print only when given)")
    p.add_argument("--allocations-dir", type=Path, default=settings.slurm_agent_allocations_dir,
                   help="where deploy/slurm/gpuledger-prolog-slurmctld records each job's GPUs at its allocation "
                        "(default GPULEDGER_SLURM_AGENT_ALLOCATIONS_DIR; unset: none)")
    p.add_argument("--command-timeout", type=float, default=settings.slurm_agent_command_timeout_s,
                   help="seconds a Slurm client command may take (default %(default)s)")
    p.add_argument("--once", action="store_true", help="poll once and exit")
    p.add_argument("--print", dest="print_", action="store_true", help="write messages to stdout (replay dump lines), not Kafka")
    p.add_argument("--metrics-port", type=int, default=settings.agent_metrics_port,
                   help="port of the agent's Prometheus /metrics (default GPULEDGER_AGENT_METRICS_PORT; 0: off)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from gpuledger.config import check_cluster_name, load_settings

    settings = load_settings()
    p = build_parser(settings)
    args = p.parse_args(argv)
    if args.interval <= 0 or args.command_timeout <= 0:
        p.error("--interval and --command-timeout must be positive")
    try:  # GPULEDGER_CLUSTER's rule: every event carries the name, and the state file and spool are named by it
        check_cluster_name(args.cluster)
    except ValueError as exc:
        p.error(f"--cluster {exc}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    state_file = args.state_file or default_state_file(settings, args.cluster)
    from gpuledger.metrics import SCHEDULER_AGENTS, serve_scheduler_agent_metrics

    spool_metrics = serve_scheduler_agent_metrics(args.metrics_port, spool_path(settings, args.cluster).name)
    if args.print_:
        sink: Any = PrintSink()
    else:
        from gpuledger.agents.spool import SpoolLocked
        try:
            sink = SpoolSink(settings, args.cluster, spool_metrics)
        except SpoolLocked as exc:
            print(f"slurm agent: {exc} (is another slurm agent running for cluster {args.cluster}?)", file=sys.stderr)
            return 2
    agent = SlurmAgent(cluster=args.cluster, state_file=state_file, sink=sink,
                       partitions=settings.partitions_job_events, command_timeout_s=args.command_timeout,
                       margin_ms=round(settings.slurm_agent_watermark_margin_s * 1000),
                       # a look with --print must not advance the state a publishing agent relies on
                       persist=not args.print_ or args.state_file is not None or settings.slurm_agent_state_file is not None,
                       records=AllocationRecords(args.allocations_dir) if args.allocations_dir else None)
    if args.metrics_port:
        SCHEDULER_AGENTS.attach("slurm", args.cluster, agent.stats)
    try:
        if args.once:
            ok = agent.poll_once()
            left = sink.close(timeout=30)
            return 0 if ok and not left else 1
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            run_forever(agent, args.interval, stop)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        if not args.once:
            sink.close()
