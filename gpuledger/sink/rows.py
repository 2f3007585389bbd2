"""Pure conversion: one Kafka message -> rows per warehouse table (or DecodeError). No Kafka, no ClickHouse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson

from gpuledger.schemas.models import JobEvent, JobProgress, LifecycleWatermark, NodeTick, SchedulerSnapshot, UsageBatch
from gpuledger.schemas.models import Alert, ReclaimSuggestion
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_metered_ticks, decode_node_ticks
from gpuledger.streams.checks import CLOCK_AHEAD_MS, MAX_AHEAD_MS, rows_problem, tick_gpus_problem, time_problem



log = logging.getLogger(__name__)


USAGE, JOB_EVENTS, SNAPSHOTS, SAMPLES = "usage", "job_events", "scheduler_snapshots", "gpu_samples"
ALERTS, SUGGESTIONS = "alerts", "reclaim_suggestions"  # gpuledger watch (docs/alerts.md)
PROGRESS = "job_progress"  # line 4 (optional): training progress


# --------------------------------------------------------------------------- pure conversion
class Rows(dict):
    """Rows per table of a message part of which was rejected (a NodeTickBatch with bad ticks):
    `rejected` = [(reason, the rejected part as a JSON object)], one per part, for one dead letter
    each beside the rows of the good parts (the run loop sends them keyed by the message's key)."""

    rejected: list[tuple[str, object]] | None = None


@dataclass(frozen=True)
class Source:
    """Where a message came from; stored with every row it produced."""

    topic: str
    partition: int
    offset: int

    def columns(self) -> dict:
        return {"kafka_topic": self.topic, "kafka_partition": self.partition, "kafka_offset": self.offset}


def usage_rows(batch: UsageBatch, source: Source) -> list[dict]:
    meta = source.columns()
    # mode="json" turns enums into their string values; every other field is already plain
    return [{**record.model_dump(mode="json"), **meta} for record in batch.records]


def job_event_row(event: JobEvent, source: Source) -> dict:
    return {
        "schema_version": event.schema_version,
        "event_id": event.event_id,
        "ts_ms": event.ts_ms,
        "kind": event.kind.value,
        "cluster": event.cluster,
        "job_id": event.job_id,
        "attempt": event.attempt,
        "tenant": event.tenant,
        "queue": event.queue,
        "priority": event.priority,
        "requested_gpus": event.requested_gpus,
        "gpu_nodes": [g.node for g in event.gpus],
        "gpu_uuids": [g.ref for g in event.gpus],  # a UUID, or node#index until resolved
        "gpu_share_milli": [g.share_milli for g in event.gpus],
        "gpu_container_ids": [g.container_id or "" for g in event.gpus],
        "aliases": dict(event.aliases),
        "reason": event.reason or "",
        **source.columns(),
    }


def snapshot_rows(snapshot: SchedulerSnapshot, source: Source) -> dict[str, list[dict]]:
    meta = source.columns()
    queues = [
        {
            "schema_version": snapshot.schema_version,
            "cluster": snapshot.cluster,
            "ts_ms": snapshot.ts_ms,
            "queue": q.queue,
            "queue_priority": q.priority,
            "quota_gpus": q.quota_gpus,
            "allocated_gpus": q.allocated_gpus,
            "pending_jobs": q.pending_jobs,
            "pending_gpus": q.pending_gpus,
            "pending_priorities": [p.priority for p in q.pending_by_priority],
            "pending_jobs_by_priority": [p.jobs for p in q.pending_by_priority],
            "pending_gpus_by_priority": [p.gpus for p in q.pending_by_priority],
            **meta,
        }
        for q in snapshot.queues
    ]
    preemptions = [
        {
            "cluster": snapshot.cluster,
            "ts_ms": snapshot.ts_ms,
            "queue": p.queue,
            "job_id": p.job_id,
            "by_job_id": p.by_job_id or "",
            "rule": p.rule,
            **meta,
        }
        for p in snapshot.preemptions
    ]
    out = {"scheduler_snapshots": queues}
    if preemptions:
        out["scheduler_preemptions"] = preemptions
    return out


def health_rows(tick: NodeTick, source: Source) -> list[dict]:
    """`gpu_health` rows of one tick (line 1), one per GPU: the health record of the operations view."""
    meta = source.columns()
    return [{
        "cluster": tick.cluster, "node": tick.node, "gpu_uuid": g.gpu_uuid, "gpu_model": g.model,
        "ts_ms": tick.ts_ms, "interval_ms": tick.interval_ms, "health": g.health.value,
        "down_reason": g.down_reason or "", "temperature_c": g.temperature_c, "power_w": g.power_w,
        "util_gpu_pct": g.util_gpu_pct, "mem_used_bytes": g.mem_used_bytes, "xid_errors": list(g.xid_errors),
        "ecc_dbe_total": g.ecc_dbe_total, **meta,
    } for g in tick.gpus]


def inventory_row(tick: NodeTick, source: Source) -> dict:
    """`node_inventory` row of one tick: the node and the GPUs (uuid, model) it reports."""
    return {
        "cluster": tick.cluster, "node": tick.node, "seen_ms": tick.ts_ms, "gpu_count": len(tick.gpus),
        "gpu_uuids": [g.gpu_uuid for g in tick.gpus], "gpu_models": [g.model for g in tick.gpus],
        # the GPUs' identity for their ID cards (sql/0020), '' where the agent could not read it
        "gpu_serials": [g.serial or "" for g in tick.gpus],
        "gpu_board_part_numbers": [g.board_part_number or "" for g in tick.gpus],
        "gpu_vbios_versions": [g.vbios_version or "" for g in tick.gpus],
        "source": "gpu-samples", **source.columns(),
    }


def progress_row(report: JobProgress, source: Source) -> dict:
    """`job_progress` row of one progress report (line 4); per-rank step times as parallel arrays."""
    return {
        "schema_version": report.schema_version, "ts_ms": report.ts_ms, "cluster": report.cluster or "",
        "job_id": report.job_id, "attempt": report.attempt, "step": report.step, "samples": report.samples,
        "tokens": report.tokens, "epoch": report.epoch, "samples_per_s": report.samples_per_s,
        "tokens_per_s": report.tokens_per_s, "step_time_ms": report.step_time_ms, "loss": report.loss,
        "rank_ids": [r.rank for r in report.ranks], "rank_step_time_ms": [r.step_time_ms for r in report.ranks],
        **source.columns(),
    }


def alert_row(alert: Alert, source: Source) -> dict:
    """`alerts` row: the alert as published, `version` 1 once closed (the table keeps the latest)."""
    return {**alert.model_dump(mode="json"), "version": int(alert.status == "closed"), **source.columns()}


def suggestion_row(s: ReclaimSuggestion, source: Source) -> dict:
    """`reclaim_suggestions` row: the named jobs as parallel arrays, `version` 1 once withdrawn."""
    return {
        "schema_version": s.schema_version, "suggestion_id": s.suggestion_id, "definition_version": s.definition_version,
        "cluster": s.cluster, "queue": s.queue, "status": s.status, "version": int(s.status == "withdrawn"),
        "opened_at_ms": s.opened_at_ms, "withdrawn_at_ms": s.withdrawn_at_ms, "execution_rate": s.execution_rate,
        "window_ms": s.window_ms, "job_ids": [j.job_id for j in s.jobs], "job_attempts": [j.attempt for j in s.jobs],
        "job_tenants": [j.tenant for j in s.jobs], "job_gpus": [list(j.gpus) for j in s.jobs],
        "job_gpus_freed": [j.gpus_freed for j in s.jobs], "job_execution_rates": [j.execution_rate for j in s.jobs],
        "job_idle_cost_micros": [j.idle_cost_micros for j in s.jobs], "gpus_freed": s.gpus_freed,
        "waiting_gpus": s.waiting_demand.gpus, "waiting_jobs": s.waiting_demand.jobs,
        "waiting_priority": s.waiting_demand.priority, "waiting_queues": list(s.waiting_demand.queues),
        "idle_cost_micros": s.idle_cost_micros, "currency": s.currency, "message": s.message, **source.columns(),
    }


def _ranks_problem(report: JobProgress) -> str | None:
    """A rank twice in one report would count twice in the rank step-time spread (job_rank_step_times)."""
    seen: set[int] = set()
    for r in report.ranks:
        if r.rank in seen:
            return f"progress of {report.job_id}: rank {r.rank} is reported twice in one report"
        seen.add(r.rank)
    return None


def process_message(kind: str, raw: bytes | None, source: Source, *, now_ms: int | None = None,
                    max_ahead_ms: int = MAX_AHEAD_MS, clock_ahead_ms: int = CLOCK_AHEAD_MS) -> dict[str, list[dict]]:
    """Rows per table for one message of the given line (USAGE, JOB_EVENTS, SNAPSHOTS, SAMPLES, PROGRESS).

    Watermarks give no rows (the warehouse does not need them). Raises DecodeError — also for a
    message outside the time window (streams/checks.py, the worker's rules; `now_ms` is the sink's
    clock at receipt) and for values their column cannot hold, so no insert ever sees them."""
    if raw is None:
        raise DecodeError("empty message (no value)")
    if kind == USAGE:
        rows = {"usage_raw": usage_rows(decode(UsageBatch, raw), source)}
    elif kind == JOB_EVENTS:  # what the worker accepted (lifecycle-accepted): it judged time and sequence
        message = decode_lifecycle(raw)
        if isinstance(message, LifecycleWatermark):
            return {}
        rows = {"job_events": [job_event_row(message, source)]}
    elif kind == SNAPSHOTS:  # the worker never sees these: the same checks here
        snapshot = decode(SchedulerSnapshot, raw)
        problem = time_problem(f"snapshot of {snapshot.cluster}", snapshot.ts_ms, 0, max_ahead_ms, now_ms,
                               clock_ahead_ms)
        if problem:
            raise DecodeError(problem)
        rows = snapshot_rows(snapshot, source)
    elif kind == SAMPLES:
        return sample_rows(raw, source, now_ms=now_ms, max_ahead_ms=max_ahead_ms, clock_ahead_ms=clock_ahead_ms)
    elif kind == PROGRESS:  # straight from the jobs: the same time window as the snapshots
        report = decode(JobProgress, raw)
        # held to the clock like a tick: one report from a node an hour fast became the pilot's last
        # window and moved its estimate's central cost 12-fold (tests/unit/test_sink_rules.py)
        problem = time_problem(f"progress of {report.job_id}", report.ts_ms, 0, max_ahead_ms, now_ms,
                               clock_ahead_ms) or _ranks_problem(report)
        if problem:
            raise DecodeError(problem)
        rows = {"job_progress": [progress_row(report, source)]}
    elif kind == ALERTS:  # the watcher's output (gpuledger watch)
        rows = {"alerts": [alert_row(decode(Alert, raw), source)]}
    elif kind == SUGGESTIONS:
        rows = {"reclaim_suggestions": [suggestion_row(decode(ReclaimSuggestion, raw), source)]}
    else:
        raise ValueError(f"unknown line {kind!r}")
    problem = rows_problem(rows)
    if problem:
        raise DecodeError(problem)
    return rows


def _node_ticks(raw: bytes) -> list[tuple[NodeTick | None, str | None, object]]:
    """The ticks of a gpu-samples message as (tick, None, JSON) or, for one that fails the schema,
    (None, why, JSON). A message the worker cannot read whole (malformed, a tick it cannot meter, a
    batch of another node's ticks) raises DecodeError, as in the worker: no tick of it is billed."""
    try:
        return [(tick, None, None) for tick in decode_node_ticks(raw)]  # one NodeTick or a node's NodeTickBatch
    except DecodeError as whole:
        try:
            decode_metered_ticks(raw)
        except DecodeError:
            raise whole from None
        obj = orjson.loads(raw)
        if "ticks" not in obj:
            raise whole from None
    # The worker bills these ticks; only health fields of some fail the full schema: judge each alone.
    out: list[tuple[NodeTick | None, str | None, object]] = []
    for i, item in enumerate(obj["ticks"]):
        try:
            out.append((decode(NodeTick, orjson.dumps(item)), None, item))
        except DecodeError as exc:  # named as a whole batch's violation would be: at ticks.<i>.…
            why = str(exc)
            head = "NodeTick: schema violation at "
            why = f"NodeTickBatch: schema violation at ticks.{i}.{why[len(head):]}" if why.startswith(head) \
                else f"NodeTickBatch ticks.{i}: {why}"
            out.append((None, why, item))
    return out


def sample_rows(raw: bytes, source: Source, *, now_ms: int | None = None,
                max_ahead_ms: int = MAX_AHEAD_MS, clock_ahead_ms: int = CLOCK_AHEAD_MS) -> dict[str, list[dict]]:
    """`gpu_health` and `node_inventory` rows of a gpu-samples message. Each tick of a batch is judged
    on its own, as the worker does (streams/core.py `_on_ticks`): a bad tick does not cost the good
    ones their rows. Rows of the good ones come back as `Rows` with one rejection per bad tick (its
    own reason, the tick as original); DecodeError when no tick is usable."""
    ticks = _node_ticks(raw)
    rows: dict[str, list[dict]] = {"gpu_health": [], "node_inventory": []}
    problems: list[str] = []
    bad: list[object] = []
    for tick, problem, item in ticks:
        if tick is not None:
            problem = time_problem(f"tick of {tick.node}", tick.ts_ms, 0, max_ahead_ms, now_ms, clock_ahead_ms) \
                or tick_gpus_problem(tick)
        if problem is None:
            mine = {"gpu_health": health_rows(tick, source), "node_inventory": [inventory_row(tick, source)]}
            problem = rows_problem(mine)
        if problem:
            problems.append(problem)
            bad.append(item if item is not None else tick.model_dump(mode="json", exclude_none=True))
            continue
        for table, more in mine.items():
            rows[table] += more
    if not problems:
        return rows
    if len(problems) == len(ticks):
        reason = "; ".join(problems[:3])  # starts with the first problem: its first word is the metric's kind
        raise DecodeError(reason + (f" (all {len(ticks)} ticks of the batch)" if len(ticks) > 1 else ""))
    # one letter per bad tick, each with its own reason (its first word is the metric's kind)
    tail = f" ({len(problems)} of the batch's {len(ticks)} ticks rejected; the others stored)"
    out = Rows(rows)
    out.rejected = [(problem + tail, item) for problem, item in zip(problems, bad)]
    return out
