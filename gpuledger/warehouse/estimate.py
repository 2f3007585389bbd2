"""Pilot-run estimates and their approvals (issue #15 point 4; docs/planning.md, "Pilot-run estimate").

A job that reports its progress (line 4) runs a short pilot; `gpuledger estimate JOB_ID --target-steps N`
(or --target-tokens, --target-epochs) turns the pilot's measured step rate, the GPUs it held and the
power they drew into the full run's wall time, GPU-hours, effective GPU-hours, energy and cost, priced
with the ledger's own cost function (`LedgerConfig.entry_cost_micros`) and the entries valid now.

Interval: the pilot's step rate is measured between consecutive progress reports; the band is the
10th to 90th percentile of those rates (numpy's linear interpolation). The slow end gives the upper
wall time and cost, the fast end the lower. It is the spread the pilot showed, not a statistical
confidence interval: a pilot too short to show its slow phases gives a band too narrow.

Above the approval threshold (ledger TOML `[approvals] threshold`, currency; default
DEFAULT_THRESHOLD) — compared with the upper end of the cost — the estimate is recorded as pending
in `approvals` (sql/0021, append-only; with its cluster and pilot attempt since sql/0044) and sent to
`<prefix>approvals` (key "<cluster>/<job id>": job ids are per cluster); `gpuledger approvals
approve|reject ID --by WHO` records and sends the decision.

`estimate_run` is pure (plain data in, an Estimate out); the rest reads and writes the warehouse.

Why one file: the estimate and its approval are one flow (an estimate above the threshold becomes a
pending approval; `approvals` decides and publishes it), and the `estimate` and `approvals` commands
are registered together (gpuledger/cli.py MODULE_COMMANDS loads this module for both).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuledger.streams.pricing import JOULES_PER_KWH, MAX_APPROVAL_THRESHOLD, LedgerConfig
from gpuledger.warehouse.client import quoted_database

DEFAULT_THRESHOLD = 10_000.0
#: the band: these percentiles of the pilot's interval step rates
LOW_PCT, HIGH_PCT = 10.0, 90.0
TARGETS = ("steps", "tokens", "epochs")
#: the largest cost `approvals` can keep (Int64 micros)
MAX_COST_MICROS = 2**63 - 1


@dataclass(frozen=True)
class Pilot:
    """What the warehouse knows of a pilot attempt. `reports`: (ts_ms, step, tokens, epoch) in time
    order; `gpus`: GPU model -> GPUs held (shares add up); `power_w`: GPU model -> mean power of one
    held GPU over the pilot, watts; `cluster`: the job's cluster (job ids are per cluster)."""

    job_id: str
    attempt: int
    reports: list[tuple[int, int, int | None, float | None]]
    gpus: dict[str, float]
    power_w: dict[str, float]
    cluster: str = ""


@dataclass
class Estimate:
    job_id: str
    attempt: int
    target: str  # e.g. "steps=100000"
    target_steps: float
    steps_per_s: float  # the pilot's mean rate: its steps / its span
    steps_per_s_low: float  # LOW_PCT percentile of the interval rates
    steps_per_s_high: float
    gpus: dict[str, float]
    wall_hours: float
    wall_hours_low: float
    wall_hours_high: float
    gpu_hours: float
    effective_gpu_hours: float
    energy_kwh: float  # GPU energy; the facility's is this x PUE
    cost: float
    cost_low: float
    cost_high: float
    currency: str
    priced_at_ms: int
    price_versions: dict[str, str] = field(default_factory=dict)
    priced_by_default: list[str] = field(default_factory=list)
    cluster: str = ""

    def rows(self) -> list[dict]:
        """The estimate as report rows (figure, central, low, high)."""
        f = self.wall_hours_low / self.wall_hours if self.wall_hours else 0.0
        g = self.wall_hours_high / self.wall_hours if self.wall_hours else 0.0
        return [
            {"figure": "wall time (h)", "central": self.wall_hours, "low": self.wall_hours_low, "high": self.wall_hours_high},
            {"figure": "GPU-hours", "central": self.gpu_hours, "low": self.gpu_hours * f, "high": self.gpu_hours * g},
            {"figure": "effective GPU-hours", "central": self.effective_gpu_hours, "low": self.effective_gpu_hours * f,
             "high": self.effective_gpu_hours * g},
            {"figure": "GPU energy (kWh)", "central": self.energy_kwh, "low": self.energy_kwh * f, "high": self.energy_kwh * g},
            {"figure": f"cost ({self.currency})", "central": self.cost, "low": self.cost_low, "high": self.cost_high},
        ]


def _steps_for(target: str, value: float, reports: list) -> float:
    """The target as optimizer steps, at the pilot's tokens per step or steps per epoch: between the first
    and the last report that give the count (a report without one, such as a forced one, changes nothing)."""
    if target == "steps":
        return float(value)
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    column, what = ((2, "reports tokens (and processed some)") if target == "tokens"
                    else (3, "reports epoch (and advanced it)"))
    counted = [r for r in reports if r[column] is not None]
    if not counted or counted[-1][column] <= counted[0][column] or counted[-1][1] <= counted[0][1]:
        raise ValueError(f"--target-{target} needs a pilot that {what}")
    first, last = counted[0], counted[-1]
    return value * (last[1] - first[1]) / (last[column] - first[column])


def estimate_run(pilot: Pilot, target: str, value: float, ledger: LedgerConfig, at_ms: int) -> Estimate:
    """The full run's figures from a pilot (pure; docs/planning.md works one through by hand)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the target must be positive and finite, got {value:g}")
    reports = [r for i, r in enumerate(pilot.reports) if i == 0 or r[0] > pilot.reports[i - 1][0]]
    if len(reports) < 3:
        raise ValueError(f"job {pilot.job_id} attempt {pilot.attempt}: the pilot has {len(reports)} progress "
                         "report(s) at distinct times; an estimate needs at least 3")
    span_s = (reports[-1][0] - reports[0][0]) / 1000
    d_step = reports[-1][1] - reports[0][1]
    if d_step <= 0:
        raise ValueError(f"job {pilot.job_id} attempt {pilot.attempt}: the pilot made no steps")
    if not pilot.gpus or sum(pilot.gpus.values()) <= 0:
        raise ValueError(f"job {pilot.job_id} attempt {pilot.attempt}: no usage records, so the GPUs it holds are "
                         "unknown (has the sink caught up?)")
    import numpy as np  # here: the CLI builds its parser from this module and should not load numpy for it

    rate = d_step / span_s
    interval = [(b[1] - a[1]) / ((b[0] - a[0]) / 1000) for a, b in zip(reports, reports[1:])]
    rate_low = float(np.percentile(interval, LOW_PCT))
    rate_high = float(np.percentile(interval, HIGH_PCT))
    if rate_low <= 0:
        raise ValueError(f"job {pilot.job_id}: the pilot's slow intervals made no steps; the upper end is unbounded "
                         "(run the pilot longer, or past its stalls)")
    # the band holds the mean: it weighs each interval by its time, the percentiles count each interval once,
    # so one long slow interval (an evaluation) among many short fast ones put the mean below p10 and the
    # "upper" cost, which the approval threshold is compared with, under the central one
    rate_low, rate_high = min(rate_low, rate), max(rate_high, rate)
    steps = _steps_for(target, value, reports)
    wall_s = steps / rate
    walls = {"central": wall_s, "low": steps / rate_high, "high": steps / rate_low}
    cost = {k: 0 for k in walls}
    gpu_hours = effective = energy_j = 0.0
    versions, defaulted = {}, []
    for model, gpus in sorted(pilot.gpus.items()):
        entry = ledger.price_at(model, at_ms)
        versions[model] = entry.version
        if entry.model != model:
            defaulted.append(model)
        power = pilot.power_w.get(model, 0.0)
        for k, w in walls.items():
            gpu_ms = round(gpus * w * 1000)
            cost[k] += ledger.entry_cost_micros(entry, model, gpu_ms, power * gpu_ms / 1000)
        hours = gpus * wall_s / 3600
        gpu_hours += hours
        effective += hours * ledger.coefficient_at(model, at_ms).coefficient
        energy_j += power * hours * 3600
    if cost["high"] > MAX_COST_MICROS:  # approvals keeps costs as Int64 micros
        raise ValueError(f"job {pilot.job_id}: {target}={value:g} costs up to {cost['high'] / 1e6:.3g} "
                         f"{ledger.currency}, beyond what the ledger can record: check the target")
    return Estimate(
        job_id=pilot.job_id, attempt=pilot.attempt, target=f"{target}={value:g}", target_steps=steps,
        steps_per_s=rate, steps_per_s_low=rate_low, steps_per_s_high=rate_high, gpus=dict(pilot.gpus),
        wall_hours=wall_s / 3600, wall_hours_low=walls["low"] / 3600, wall_hours_high=walls["high"] / 3600,
        gpu_hours=gpu_hours, effective_gpu_hours=effective, energy_kwh=energy_j / JOULES_PER_KWH,
        cost=cost["central"] / 1e6, cost_low=cost["low"] / 1e6, cost_high=cost["high"] / 1e6,
        currency=ledger.currency, priced_at_ms=at_ms, price_versions=versions, priced_by_default=defaulted,
        cluster=pilot.cluster)


def approval_threshold(path: Path | None) -> float:
    """`[approvals] threshold` of the ledger TOML (currency), else DEFAULT_THRESHOLD. Read by the ledger
    loader, so a misspelt key or a non-finite threshold is refused like any other (LedgerConfigError)."""
    from gpuledger.ledger_files import load_ledger_config

    threshold = load_ledger_config(path).approval_threshold
    return DEFAULT_THRESHOLD if threshold is None else threshold


def check_threshold(threshold: float) -> float:
    """--threshold within the bounds the ledger TOML's is held to: NaN would make every estimate
    "within the threshold" (no comparison with it is true), a negative one a row the topic refuses."""
    if not (math.isfinite(threshold) and 0 <= threshold <= MAX_APPROVAL_THRESHOLD):
        raise ValueError(f"--threshold must be a number >= 0 and <= {MAX_APPROVAL_THRESHOLD:g}, got {threshold:g}")
    return threshold


# --------------------------------------------------------------------------- warehouse
def _query(client, sql: str, params: dict) -> list[dict]:
    return list(client.query(sql, parameters=params).named_results())


def job_clusters(client, database: str, job_id: str, attempt: int | None = None) -> tuple[list[str], set[str]]:
    """The clusters job id `job_id` (of `attempt`, if given) ran in: those of its executing or
    allocated-idle usage (`job_gpu_usage`, keyed by job id) and those its progress reports name; and
    the clusters its progress reports carry ('' for a report that names none)."""
    db = quoted_database(database)
    p = {"job": job_id, "attempt": -1 if attempt is None else int(attempt)}
    only = "AND ({attempt:Int64} < 0 OR attempt = {attempt:Int64})"
    progress = {r["c"] for r in _query(client, f"""
        SELECT DISTINCT toString(cluster) AS c FROM {db}.job_progress WHERE job_id = {{job:String}} {only}""", p)}
    used = {r["c"] for r in _query(client, f"""
        SELECT DISTINCT toString(cluster) AS c FROM {db}.job_gpu_usage WHERE job_id = {{job:String}} {only}""", p)}
    return sorted(used | (progress - {""})), progress


def load_pilot(client, database: str, job_id: str, attempt: int | None = None, cluster: str | None = None) -> Pilot:
    """The pilot attempt (default: the latest attempt that reported progress) with its reports, the GPUs
    it held per model (each GPU at its largest share) and their mean power over the reported span.

    Slurm numbers jobs per cluster, so a job is (cluster, job id). Without `cluster`, the one cluster
    the job id ran in (`job_clusters`); a job id of several clusters is refused. Progress reports are
    those that name the cluster, else those that name none (a reporter not given its cluster)."""
    if attempt is not None and attempt < 0:  # job_clusters reads a negative one as "any attempt"
        raise ValueError(f"--attempt is the scheduler's attempt number, 0 or more, got {attempt}")
    db = quoted_database(database)
    clusters, progress = job_clusters(client, database, job_id, attempt)
    if not progress:
        of = "" if attempt is None else f" attempt {attempt}"
        raise ValueError(f"job {job_id!r}{of} reported no progress (line 4, gpuledger/progress.py): nothing to "
                         "estimate from")
    if cluster is None:
        if len(clusters) > 1:
            raise ValueError(f"job {job_id} ran in clusters {', '.join(clusters)}: give --cluster")
        cluster = clusters[0] if clusters else ""  # '' only when no usage names one: no GPUs found below
    where = f"job {job_id!r}" + (f" in cluster {cluster!r}" if cluster else "")
    p = {"job": job_id, "cluster": cluster, "pc": cluster if cluster in progress else ""}
    if attempt is None:
        rows = _query(client, f"""SELECT max(attempt) AS a, count() AS n FROM {db}.job_progress
                                 WHERE job_id = {{job:String}} AND cluster = {{pc:String}}""", p)
        if not rows or not rows[0]["n"]:
            raise ValueError(f"{where} reported no progress (line 4, gpuledger/progress.py): nothing to estimate from")
        attempt = rows[0]["a"]
    p["attempt"] = int(attempt)
    reports = [(r["ts_ms"], r["step"], r["tokens"], r["epoch"]) for r in _query(client, f"""
        SELECT ts_ms, step, tokens, epoch FROM {db}.job_progress
        WHERE job_id = {{job:String}} AND attempt = {{attempt:UInt32}} AND cluster = {{pc:String}}
        ORDER BY ts_ms, step""", p)]
    if not reports:
        raise ValueError(f"{where} attempt {attempt} reported no progress")
    p.update(t0=reports[0][0], t1=reports[-1][0])
    mine = "job_id = {job:String} AND attempt = {attempt:UInt32} AND cluster = {cluster:String}"
    held = _query(client, f"""
        SELECT gpu_model, sum(share) AS gpus FROM
            (SELECT gpu_uuid, any(gpu_model) AS gpu_model, max(share_milli) / 1000 AS share FROM {db}.usage_raw
             WHERE {mine} AND state IN ('executing', 'allocated_idle')
             GROUP BY gpu_uuid)
        GROUP BY gpu_model""", p)
    power = _query(client, f"""
        SELECT gpu_model, sum(energy_j * part) / nullIf(sum(gpu_ms * part), 0) * 1000 AS power_w FROM
            (SELECT gpu_model, energy_j, gpu_ms,
                    greatest(least(end_ms, {{t1:Int64}}) - greatest(start_ms, {{t0:Int64}}), 0)
                        / greatest(end_ms - start_ms, 1) AS part
             FROM {db}.usage_raw
             WHERE {mine} AND state IN ('executing', 'allocated_idle'))
        GROUP BY gpu_model""", p)
    # None: no record of the model inside the span (the sink behind), not 0 W: priced so, the energy was lost
    unknown = sorted(r["gpu_model"] for r in power if r["power_w"] is None)
    if unknown:
        raise ValueError(f"{where} attempt {attempt}: no usage record of its {', '.join(unknown)} falls within its "
                         "progress reports' span, so the power drawn is unknown (has the sink caught up?)")
    return Pilot(job_id=job_id, attempt=int(attempt), reports=reports,
                 gpus={r["gpu_model"]: float(r["gpus"]) for r in held},
                 power_w={r["gpu_model"]: float(r["power_w"]) for r in power}, cluster=cluster)


def _approval_id(est: Estimate, now_ms: int) -> str:
    digest = hashlib.sha256(f"{est.cluster}/{est.job_id}/{est.attempt}/{est.target}/{now_ms}".encode()).hexdigest()
    return f"apr-{digest[:12]}"


def record_pending(client, database: str, est: Estimate, threshold: float, now_ms: int) -> dict:
    """Record the estimate as awaiting approval; returns the row written."""
    row = {"approval_id": _approval_id(est, now_ms), "cluster": est.cluster, "job_id": est.job_id,
           "attempt": est.attempt, "status": "pending", "ts_ms": now_ms,
           "decided_by": "", "note": "", "target": est.target, "cost_micros": round(est.cost * 1e6),
           "cost_low_micros": round(est.cost_low * 1e6), "cost_high_micros": round(est.cost_high * 1e6),
           "threshold_micros": round(threshold * 1e6), "currency": est.currency, "gpu_hours": est.gpu_hours,
           "wall_hours": est.wall_hours, "estimate": json.dumps(asdict(est), sort_keys=True)}
    from gpuledger.warehouse.client import insert_rows

    insert_rows(client, "approvals", [row], database=database)
    return row


def approval_history(client, database: str, approval_id: str) -> list[dict]:
    """The approval's rows in time order. Rows written before sql/0044 have cluster '' and attempt 0:
    they get those of the estimate their pending (first) row keeps, as approvals_current does."""
    db = quoted_database(database)
    rows = _query(client, f"""SELECT * EXCEPT (inserted_at) FROM {db}.approvals
                             WHERE approval_id = {{id:String}} ORDER BY ts_ms""", {"id": approval_id})
    origin = json.loads(rows[0]["estimate"]) if rows and rows[0]["estimate"] else {}
    for r in rows:
        del r["estimate"]
        if not r["cluster"]:
            r["cluster"] = origin.get("cluster") or ""
        r["attempt"] = max(r["attempt"], int(origin.get("attempt") or 0))
    return rows


def decide(client, database: str, approval_id: str, status: str, by: str, note: str, now_ms: int) -> dict:
    """Append the decision (approved / rejected) on a pending approval; returns the row written."""
    if status not in ("approved", "rejected"):
        raise ValueError(f"a decision is approved or rejected, not {status!r}")
    if not by.strip():
        raise ValueError("--by: who decides must be named")
    history = approval_history(client, database, approval_id)
    if not history:
        raise ValueError(f"no approval {approval_id!r}")
    latest = history[-1]
    if latest["status"] != "pending":
        raise ValueError(f"approval {approval_id} is already {latest['status']} (by {latest['decided_by']})")
    if status == "approved" and not latest["cluster"]:
        # keyed "/<job id>", an approval would admit nothing, silently; the reason is the view's (sql/0046)
        raise ValueError(f"approval {approval_id} cannot be approved: {needs_reapproval(client, database, approval_id)}")
    row = {k: latest[k] for k in ("approval_id", "cluster", "job_id", "attempt", "target", "cost_micros", "cost_low_micros",
                                  "cost_high_micros", "threshold_micros", "currency", "gpu_hours", "wall_hours")}
    row.update(status=status, ts_ms=max(now_ms, latest["ts_ms"] + 1), decided_by=by.strip(), note=note or "",
               estimate="")
    from gpuledger.warehouse.client import insert_rows

    insert_rows(client, "approvals", [row], database=database)
    return row


def needs_reapproval(client, database: str, approval_id: str) -> str:
    """Why the approval admits no job ('' when it can): approvals_current.needs_reapproval (sql/0046)."""
    rows = _query(client, f"""SELECT needs_reapproval FROM {quoted_database(database)}.approvals_current
                             WHERE approval_id = {{id:String}}""", {"id": approval_id})
    return rows[0]["needs_reapproval"] if rows else ""


def list_approvals(client, database: str, status: str | None = None) -> list[dict]:
    db = quoted_database(database)
    where = "WHERE status = {s:String}" if status else ""
    return _query(client, f"SELECT * FROM {db}.approvals_current {where} ORDER BY requested_ms, approval_id",
                  {"s": status or ""})


def decision_message(row: dict):
    from gpuledger.schemas.models import ApprovalDecision

    return ApprovalDecision(approval_id=row["approval_id"], cluster=row["cluster"], job_id=row["job_id"],
                            attempt=row["attempt"], status=row["status"],
                            ts_ms=row["ts_ms"], by=row["decided_by"], note=row["note"], target=row["target"],
                            cost_micros=row["cost_micros"], cost_high_micros=row["cost_high_micros"],
                            threshold_micros=row["threshold_micros"], currency=row["currency"],
                            gpu_hours=row["gpu_hours"], wall_hours=row["wall_hours"])


def message_key(row: dict) -> bytes:
    """The approvals topic's key: "<cluster>/<job id>" (job ids are per cluster). An approval without a
    cluster (recorded before sql/0044 from an estimate that named none) is keyed "/<job id>", which no
    cluster's admission hook reads: it admits nothing (`decide` refuses to approve it; `approvals list`
    and `publish` say so)."""
    return f"{row['cluster']}/{row['job_id']}".encode()


def publish(settings, rows: list[dict], timeout_s: float = 15.0) -> None:
    """Send approval rows to `<prefix>approvals` (key: message_key); raises when the broker does not confirm them."""
    from confluent_kafka import Producer

    from gpuledger.schemas.wire import encode

    errors: list[str] = []
    producer = Producer({**settings.kafka_client_config(), "enable.idempotence": True})
    for row in rows:
        producer.produce(settings.topics.approvals, key=message_key(row), value=encode(decision_message(row)),
                         on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
    left = producer.flush(timeout_s)
    if left or errors:
        raise RuntimeError(f"recorded in the warehouse, but not sent to {settings.topics.approvals} "
                           f"({errors[:1] or f'{left} unsent'}); send it again: gpuledger approvals publish ID")


# --------------------------------------------------------------------------- CLI
def cmd_estimate(args) -> int:
    from gpuledger.cli import settings_from_args
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect
    from gpuledger.warehouse.report_text import render

    settings = settings_from_args(args)
    targets = [(t, getattr(args, f"target_{t}")) for t in TARGETS if getattr(args, f"target_{t}") is not None]
    if len(targets) != 1:
        raise ValueError("give exactly one of --target-steps, --target-tokens, --target-epochs")
    ledger = load_ledger_config(settings.ledger_config)
    threshold = check_threshold(args.threshold) if args.threshold is not None else \
        approval_threshold(settings.ledger_config)
    now_ms = int(time.time() * 1000)
    client = connect(settings)
    try:
        pilot = load_pilot(client, settings.database, args.job_id, args.attempt, args.cluster)
        est = estimate_run(pilot, *targets[0], ledger, now_ms)
        pending = est.cost_high > threshold
        row = record_pending(client, settings.database, est, threshold, now_ms) if pending else None
    finally:
        client.close()
    if args.format == "json":
        print(json.dumps({**asdict(est), "threshold": threshold, "approval": row and row["approval_id"]}, indent=2))
    else:
        gpus = ", ".join(f"{n:g} x {m}" for m, n in est.gpus.items())
        where = f" (cluster {est.cluster})" if est.cluster else ""
        print(f"job {est.job_id}{where} attempt {est.attempt}: {est.target} ({est.target_steps:,.0f} steps) on {gpus}; pilot "
              f"{est.steps_per_s:.4g} steps/s (band {est.steps_per_s_low:.4g} .. {est.steps_per_s_high:.4g}: "
              f"p{LOW_PCT:g}..p{HIGH_PCT:g} of its interval rates"
              f"{', widened to the mean' if est.steps_per_s in (est.steps_per_s_low, est.steps_per_s_high) else ''})")
        print(render(est.rows(), "table"), end="")
        if est.priced_by_default:
            print(f"priced by default (no price of their own): {', '.join(est.priced_by_default)}")
        if row:
            print(f"above the approval threshold ({threshold:,.2f} {est.currency}, upper end {est.cost_high:,.2f}): "
                  f"recorded as {row['approval_id']}, awaiting approval")
        else:
            print(f"within the approval threshold ({threshold:,.2f} {est.currency}): no approval needed")
    if row and not args.no_publish:
        publish(settings, [row])
    return 0


def cmd_approvals(args) -> int:
    from gpuledger.cli import settings_from_args
    from gpuledger.warehouse import connect, connect_readonly
    from gpuledger.warehouse.report_text import render

    settings = settings_from_args(args)
    if args.action == "list":
        client = connect_readonly(settings)
        try:
            rows = list_approvals(client, settings.database, args.status)
        finally:
            client.close()
        print(render(rows, args.format, utc_days=True), end="")
        return 0
    if not args.approval_id:
        raise SystemExit(f"usage: gpuledger approvals {args.action} ID")
    client = connect(settings)
    try:
        if args.action == "publish":
            rows = approval_history(client, settings.database, args.approval_id)
            if not rows:
                raise ValueError(f"no approval {args.approval_id!r}")
            reason = needs_reapproval(client, settings.database, args.approval_id)
            if reason:
                print(f"gpuledger: warning: {args.approval_id} {reason}", file=sys.stderr)
        else:
            status = "approved" if args.action == "approve" else "rejected"
            rows = [decide(client, settings.database, args.approval_id, status, args.by or "", args.note or "",
                           int(time.time() * 1000))]
    finally:
        client.close()
    for r in rows:
        print(f"{r['approval_id']}\t{r['cluster']}\t{r['job_id']}\t{r['status']}\t{r['decided_by']}\t{r['note']}")
    if not args.no_publish:
        publish(settings, rows)
    return 0


def register_cli(sub) -> None:
    """`gpuledger estimate` and `gpuledger approvals` (called by gpuledger/cli.py build_parser)."""
    p = sub.add_parser("estimate", help="estimate a full training run from its pilot's progress reports",
                       description="estimate a full training run (cost, GPU-hours, energy, wall time, with a band) from "
                                   "the pilot's progress reports; above the approval threshold it awaits approval")
    p.set_defaults(func=cmd_estimate)
    p.add_argument("job_id")
    p.add_argument("--target-steps", type=float)
    p.add_argument("--target-tokens", type=float)
    p.add_argument("--target-epochs", type=float)
    p.add_argument("--attempt", type=int, help="the pilot attempt (default: the latest that reported progress)")
    p.add_argument("--cluster", help="the job's cluster (job ids are per cluster; default: the one cluster the job "
                                     "id ran in, refused when it ran in several)")
    p.add_argument("--threshold", type=float, help="approval threshold, currency (default: ledger [approvals] threshold)")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--no-publish", action="store_true", help="record in the warehouse only, send nothing to Kafka")
    _common(p)
    p = sub.add_parser("approvals", help="list pilot-run approvals; approve or reject one (who and when are kept)",
                       description="list pilot-run approvals; approve or reject one; publish one again to the topic")
    p.set_defaults(func=cmd_approvals)
    p.add_argument("action", choices=["list", "approve", "reject", "publish"])
    p.add_argument("approval_id", nargs="?")
    p.add_argument("--by", help="approve/reject: who decides")
    p.add_argument("--note", help="approve/reject: why")
    p.add_argument("--status", choices=["pending", "approved", "rejected"], help="list: only these")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")
    p.add_argument("--no-publish", action="store_true", help="approve/reject: record only, send nothing to Kafka")
    _common(p)


def _common(p) -> None:
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP)")
    p.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
