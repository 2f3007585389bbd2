"""Periodic reports from the warehouse: inventory, monthly, weekly, and the per-job health report.

    report = build_report(client, "gpuledger", "inventory", days=30)
    print(render_report(report, "markdown"))          # or "table", "html"

- `inventory`: cards per GPU model, their last-N-day utilization (the three layers), the cards that
  stayed under a utilization threshold (20 %) and the queues that held them, the largest jobs by
  GPU-hours, requested vs allocated vs executed GPU-time per queue.
- `monthly`: the three-layer trend per day, the tenants' cost composition (compute / idle /
  failed-retry), the top-N jobs by cost.
- `weekly`: anomalies (GPUs down, failed attempts, idle-heavy jobs, stragglers), the top-10 costly
  jobs, idle reclaimed against the previous week and estimated savings.
- `job`: the job health report: utilization distribution, per-GPU balance score, loading-stall and
  straggler hints, cost by attempt.

Periods end at `as_of` (a date; default: the last day with usage in the warehouse, so a replayed or
simulated period reports as if it were now). HTML is one self-contained page: inline CSS and SVG
plots drawn here, no script, nothing fetched.

Numbers come from the same views as `gpuledger report` (gpuledger.reports.fetch) and the
dashboards (sql/0010_dashboards_tenant_access.sql), so the three agree.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from gpuledger import reports as base

REPORT_NAMES = ("inventory", "monthly", "weekly", "job")
FORMATS = ("table", "markdown", "html")
LAYERS = ("scheduling_utilization", "execution_utilization", "hardware_utilization")


@dataclass
class Plot:
    """A plot of some rows: `kind` line, bar or stacked; `x` the category column; `series` the value columns."""

    kind: str
    x: str
    series: list[str]
    percent: bool = False


@dataclass
class Section:
    title: str
    rows: list[dict]
    note: str = ""
    plot: Plot | None = None


@dataclass
class Report:
    name: str
    title: str
    period: str
    summary: dict[str, Any] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)
    #: currency of every money figure (cost columns), shown in the header of every rendering
    currency: str = ""

    @property
    def units(self) -> str:
        """The header line that says what the figures are in."""
        money = f"Money in {self.currency}. " if self.currency else ""
        return f"{money}Days are UTC days (day_utc)."

    def section(self, title: str) -> Section:
        for s in self.sections:
            if s.title == title:
                return s
        raise KeyError(title)


# --------------------------------------------------------------------------- helpers
def _q(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


def _date(value: Any) -> dt.date:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    return dt.date.fromisoformat(str(value))


def last_day(client, database: str) -> dt.date | None:
    db = base._qualify(database)
    rows = client.query(f"SELECT max(day) AS d, count() AS n FROM {db}.usage_by_job_daily").result_rows
    return rows[0][0] if rows and rows[0][1] else None


def _as_of(client, database: str, as_of: Any) -> dt.date:
    if as_of is not None:
        return _date(as_of)
    return last_day(client, database) or dt.datetime.now(dt.timezone.utc).date()


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _total(rows: Sequence[dict], key: str) -> float:
    return float(sum(r.get(key) or 0 for r in rows))


# --------------------------------------------------------------------------- inventory
def _inventory(client, database: str, *, days: int = 30, as_of: Any = None, low_util_pct: float = 20.0,
               top: int = 10) -> Report:
    days, top = _positive_int("days", days), _positive_int("top", top)
    end = _as_of(client, database, as_of)
    start = end - dt.timedelta(days=days - 1)
    db = base._qualify(database)
    p = {"d0": start, "d1": end, "low": float(low_util_pct)}
    cards = _q(client, f"""
        SELECT gpu_model, uniqExact(gpu_uuid) AS cards, uniqExact(node) AS nodes,
               sum(gpu_ms) / 3600000 AS capacity_gpu_hours
        FROM {db}.usage_raw WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_model ORDER BY gpu_model""", p)
    util = base.fetch(client, database, "utilization", by="gpu_model", day_from=start, day_to=end)
    by_model = {r["gpu_model"]: r for r in util}
    for r in cards:
        u = by_model.get(r["gpu_model"], {})
        for layer in LAYERS:
            r[layer] = u.get(layer)
    # per card: time-weighted utilization over the time it was up (idle and unallocated time count as 0)
    per_card = _q(client, f"""
        SELECT gpu_uuid, any(node) AS node, any(gpu_model) AS gpu_model,
               sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL)
                   / nullIf(sumIf(gpu_ms, state != 'down'), 0) AS util_pct,
               sumIf(gpu_ms, state != 'down') / 3600000 AS up_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArrayIf(toString(queue), queue != '')), ' ') AS queues
        FROM {db}.usage_raw WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_uuid HAVING up_gpu_hours > 0 AND coalesce(util_pct, 0) < {{low:Float64}}
        ORDER BY util_pct, node, gpu_uuid""", p)
    low_queues = _q(client, f"""
        SELECT queue, uniqExact(gpu_uuid) AS low_util_cards, sum(gpu_ms) / 3600000 AS held_gpu_hours
        FROM {db}.usage_raw
        WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} AND queue != '' AND gpu_uuid IN
            (SELECT gpu_uuid FROM {db}.usage_raw WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} GROUP BY gpu_uuid
             HAVING coalesce(sumIf(assumeNotNull(util_pct) * gpu_ms, state = 'executing' AND util_pct IS NOT NULL)
                    / nullIf(sumIf(gpu_ms, state != 'down'), 0), 0) < {{low:Float64}})
        GROUP BY queue ORDER BY held_gpu_hours DESC, queue""", p)
    largest = _q(client, f"""
        SELECT job_id, tenant, queue, attempts, gpu_hours, effective_gpu_hours, idle_gpu_hours, cost
        FROM {db}.job_cost WHERE last_day >= {{d0:Date}} AND first_day <= {{d1:Date}}
        ORDER BY gpu_hours DESC, job_id LIMIT {{top:UInt32}}""", {**p, "top": top})
    queues = base.fetch(client, database, "queues", day_from=start, day_to=end)
    req: dict[str, dict] = {}
    for r in queues:
        q = req.setdefault(r["queue"], {"queue": r["queue"], "attempts": 0, "requested_gpu_hours": 0.0,
                                        "allocated_gpu_hours": 0.0, "executed_gpu_hours": 0.0})
        q["attempts"] += r["attempts"]
        q["requested_gpu_hours"] += (r["requested_gpu_seconds"] or 0) / 3600
        q["allocated_gpu_hours"] += (r["allocated_gpu_seconds"] or 0) / 3600
        q["executed_gpu_hours"] += (r["executed_gpu_seconds"] or 0) / 3600
    requested = sorted(req.values(), key=lambda r: r["queue"])
    for q in requested:
        q["used_to_requested"] = q["executed_gpu_hours"] / q["requested_gpu_hours"] if q["requested_gpu_hours"] else None
        q["gap_gpu_hours"] = q["requested_gpu_hours"] - q["executed_gpu_hours"]
    report = Report("inventory", "GPU inventory", f"{start} .. {end} ({days} days)", summary={
        "cards": sum(r["cards"] for r in cards),
        "cards_under_threshold": len(per_card),
        "threshold_pct": float(low_util_pct),
        "requested_gpu_hours": _total(requested, "requested_gpu_hours"),
        "executed_gpu_hours": _total(requested, "executed_gpu_hours"),
    })
    report.sections = [
        Section("Cards per GPU model and their utilization", cards,
                "scheduling = allocated / up time, execution = executing / allocated, hardware = SM activity while executing",
                Plot("bar", "gpu_model", list(LAYERS), percent=True)),
        Section(f"Cards under {low_util_pct:g}% utilization", per_card,
                "utilization over the time the card was up; idle and unallocated time count as 0"),
        Section(f"Queues holding the cards under {low_util_pct:g}%", low_queues, "",
                Plot("bar", "queue", ["held_gpu_hours"])),
        Section(f"Largest {top} jobs by GPU-hours", largest, "", Plot("bar", "job_id", ["gpu_hours"])),
        Section("Requested vs used GPU-hours per queue", requested,
                "requested = requested GPUs x (end - queued); used = executed", Plot("bar", "queue", [
                    "requested_gpu_hours", "allocated_gpu_hours", "executed_gpu_hours"])),
    ]
    return report


# --------------------------------------------------------------------------- monthly
def _tenant_costs(client, database: str, start: dt.date, end: dt.date) -> list[dict]:
    out: dict[str, dict] = {}
    for r in base.fetch(client, database, "bills", day_from=start, day_to=end):
        t = out.setdefault(r["tenant"], {"tenant": r["tenant"], "compute_cost": 0.0, "idle_cost": 0.0,
                                          "failed_retry_cost": 0.0, "total_cost": 0.0, "effective_gpu_hours": 0.0})
        for k in ("compute_cost", "idle_cost", "failed_retry_cost", "total_cost"):
            t[k] += r[k]
        t["effective_gpu_hours"] += r["total_effective_gpu_hours"]
    rows = sorted(out.values(), key=lambda r: (-r["total_cost"], r["tenant"]))
    for r in rows:
        r["idle_share"] = r["idle_cost"] / r["total_cost"] if r["total_cost"] else None
    return rows


def _top_jobs(client, database: str, start: dt.date, end: dt.date, top: int) -> list[dict]:
    cols = ("job_id", "tenant", "queue", "attempts", "failed_attempts", "gpu_hours", "effective_gpu_hours",
            "idle_gpu_hours", "cost")
    rows = base.fetch(client, database, "jobs", day_from=start, day_to=end, limit=top)
    return [{c: r[c] for c in cols} for r in rows]


def _monthly(client, database: str, *, month: str | None = None, as_of: Any = None, top: int = 10) -> Report:
    top = _positive_int("top", top)
    if month:
        try:
            first = dt.date.fromisoformat(f"{month}-01")
        except ValueError:
            raise ValueError(f"month must be YYYY-MM, got {month!r}") from None
    else:
        first = _as_of(client, database, as_of).replace(day=1)
    last = (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1) - dt.timedelta(days=1)
    trend = base.fetch(client, database, "utilization", by="day", day_from=first, day_to=last)
    trend = [{"day": r["day"], **{k: r[k] for k in LAYERS},
              "executing_gpu_hours": (r["executing_gpu_seconds"] or 0) / 3600} for r in trend]
    tenants = _tenant_costs(client, database, first, last)
    jobs = _top_jobs(client, database, first, last, top)
    overall = base.fetch(client, database, "utilization", by="cluster", day_from=first, day_to=last)
    report = Report("monthly", f"Monthly report {first:%Y-%m}", f"{first} .. {last}", summary={
        "total_cost": _total(tenants, "total_cost"),
        "idle_cost": _total(tenants, "idle_cost"),
        "failed_retry_cost": _total(tenants, "failed_retry_cost"),
        "effective_gpu_hours": _total(tenants, "effective_gpu_hours"),
        **({k: overall[0][k] for k in LAYERS} if len(overall) == 1 else {}),
    })
    report.sections = [
        Section("Three utilization layers per day", trend, "each layer as a ratio of its parent",
                Plot("line", "day", list(LAYERS), percent=True)),
        Section("Tenant cost composition", tenants, "compute / idle (allocated, not executing) / failed retry",
                Plot("stacked", "tenant", ["compute_cost", "idle_cost", "failed_retry_cost"])),
        Section(f"Top {top} jobs by cost", jobs, "", Plot("bar", "job_id", ["cost"])),
    ]
    return report


# --------------------------------------------------------------------------- weekly
def _idle_by_queue(client, database: str, start: dt.date, end: dt.date) -> dict[str, dict]:
    db = base._qualify(database)
    rows = _q(client, f"""
        SELECT queue, sum(idle_gpu_hours) AS idle_gpu_hours, sum(idle_cost) AS idle_cost
        FROM {db}.idle_waste_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} GROUP BY queue""",
              {"d0": start, "d1": end})
    return {r["queue"]: r for r in rows}


def _anomalies(client, database: str, start: dt.date, end: dt.date, idle_share: float) -> list[dict]:
    db = base._qualify(database)
    p = {"d0": start, "d1": end, "share": idle_share}
    out = []
    for r in _q(client, f"""
            SELECT node, gpu_uuid, gpu_model, sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds
            FROM {db}.usage_raw WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
            GROUP BY node, gpu_uuid, gpu_model HAVING down_seconds > 0 ORDER BY down_seconds DESC, gpu_uuid""", p):
        out.append({"kind": "gpu_down", "subject": f"{r['node']} {r['gpu_uuid']}",
                    "detail": f"{r['gpu_model']} down {r['down_seconds'] / 60:.1f} min", "value": r["down_seconds"] / 3600})
    for r in _q(client, f"""
            SELECT job_id, tenant, failed_attempts, cost FROM {db}.job_cost
            WHERE failed_attempts > 0 AND last_day >= {{d0:Date}} AND first_day <= {{d1:Date}}
            ORDER BY cost DESC, job_id""", p):
        out.append({"kind": "failed_attempts", "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['failed_attempts']} failed attempt(s)", "value": r["cost"]})
    for r in _q(client, f"""
            SELECT job_id, tenant, idle_gpu_hours, gpu_hours, idle_gpu_hours / gpu_hours AS share
            FROM {db}.job_cost WHERE gpu_hours > 0 AND idle_gpu_hours / gpu_hours > {{share:Float64}}
              AND last_day >= {{d0:Date}} AND first_day <= {{d1:Date}}
            ORDER BY idle_gpu_hours DESC, job_id""", p):
        out.append({"kind": "idle_heavy_job", "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['share']:.0%} of held GPU-time idle", "value": r["idle_gpu_hours"]})
    for r in _stragglers(client, database, start=start, end=end):
        out.append({"kind": "straggler", "subject": r["job_id"],
                    "detail": f"attempt {r['attempt']}: {r['gpu']} at {r['util_pct']:.0f}% vs median {r['median_pct']:.0f}%",
                    "value": r["util_pct"]})
    return out


def _weekly(client, database: str, *, as_of: Any = None, top: int = 10, idle_share: float = 0.3) -> Report:
    top = _positive_int("top", top)
    end = _as_of(client, database, as_of)
    start = end - dt.timedelta(days=6)
    prev_end, prev_start = start - dt.timedelta(days=1), start - dt.timedelta(days=7)
    now, before = _idle_by_queue(client, database, start, end), _idle_by_queue(client, database, prev_start, prev_end)
    reclaimed = []
    for queue in sorted(set(now) | set(before)):
        cur, prev = now.get(queue, {}), before.get(queue, {})
        reclaimed.append({
            "queue": queue,
            "idle_gpu_hours_previous": prev.get("idle_gpu_hours", 0.0), "idle_gpu_hours": cur.get("idle_gpu_hours", 0.0),
            "reclaimed_gpu_hours": max(0.0, prev.get("idle_gpu_hours", 0.0) - cur.get("idle_gpu_hours", 0.0)),
            "idle_cost_previous": prev.get("idle_cost", 0.0), "idle_cost": cur.get("idle_cost", 0.0),
            "saved_cost": max(0.0, prev.get("idle_cost", 0.0) - cur.get("idle_cost", 0.0)),
        })
    tenants = _tenant_costs(client, database, start, end)
    savings = [
        {"item": "idle reclaimed vs previous week", "cost": _total(reclaimed, "saved_cost")},
        {"item": "idle still allocated this week (reclaimable)", "cost": _total(tenants, "idle_cost")},
        {"item": "failed-retry GPU time this week (avoidable)", "cost": _total(tenants, "failed_retry_cost")},
    ]
    report = Report("weekly", f"Weekly report, week ending {end}", f"{start} .. {end}", summary={
        "total_cost": _total(tenants, "total_cost"),
        "reclaimed_gpu_hours": _total(reclaimed, "reclaimed_gpu_hours"),
        "estimated_savings": savings[0]["cost"],
        "potential_savings": savings[1]["cost"] + savings[2]["cost"],
    })
    report.sections = [
        Section("Anomalies", _anomalies(client, database, start, end, idle_share),
                f"GPUs down, failed attempts, jobs idle more than {idle_share:.0%} of their held time, stragglers"),
        Section(f"Top {top} costly jobs", _top_jobs(client, database, start, end, top), "", Plot("bar", "job_id", ["cost"])),
        Section("Idle reclaimed per queue (vs previous week)", reclaimed, f"previous week {prev_start} .. {prev_end}",
                Plot("bar", "queue", ["idle_gpu_hours_previous", "idle_gpu_hours"])),
        Section("Estimated savings", savings),
    ]
    return report


# --------------------------------------------------------------------------- job health
def _stragglers(client, database: str, *, job_id: str | None = None, start: dt.date | None = None,
                end: dt.date | None = None, ratio: float = 0.8) -> list[dict]:
    """GPUs of multi-GPU attempts whose utilization is under `ratio` x the attempt's median."""
    db = base._qualify(database)
    conds, p = ["util_gpu_ms > 0"], {"ratio": ratio}
    if job_id is not None:
        conds.append("job_id = {job:String}")
        p["job"] = job_id
    if start is not None:
        conds.append("toDate(fromUnixTimestamp64Milli(last_end_ms, 'UTC')) >= {d0:Date}")
        p["d0"] = start
    if end is not None:
        conds.append("toDate(fromUnixTimestamp64Milli(first_start_ms, 'UTC')) <= {d1:Date}")
        p["d1"] = end
    return _q(client, f"""
        SELECT job_id, attempt, gpu, util_pct, median_pct FROM
        (
            SELECT job_id, attempt, gpu, mean_util_pct AS util_pct,
                   median(mean_util_pct) OVER (PARTITION BY cluster, job_id, attempt) AS median_pct,
                   count() OVER (PARTITION BY cluster, job_id, attempt) AS gpus
            FROM {db}.job_gpu_balance WHERE {' AND '.join(conds)}
        )
        WHERE gpus > 1 AND util_pct < median_pct * {{ratio:Float64}}
        ORDER BY job_id, attempt, util_pct""", p)


def balance_score(utils: Sequence[float]) -> float | None:
    """Mean over max of the per-GPU utilizations: 1.0 when every GPU works equally hard."""
    vals = [u for u in utils if u is not None]
    if not vals or max(vals) <= 0:
        return None
    return sum(vals) / len(vals) / max(vals)


def _job(client, database: str, *, job_id: str, stall_s: float = 60.0) -> Report:
    if not job_id:
        raise ValueError("the job report needs a job id")
    db = base._qualify(database)
    p = {"job": str(job_id)}
    summary_rows = base.fetch(client, database, "jobs", job_id=str(job_id))
    if not summary_rows:
        raise ValueError(f"no job {job_id!r} in the warehouse")
    s = summary_rows[0]
    hist = _q(client, f"""
        SELECT util_bucket, sum(gpu_seconds) / 3600 AS gpu_hours FROM {db}.job_util_histogram
        WHERE job_id = {{job:String}} GROUP BY util_bucket ORDER BY util_bucket""", p)
    gpus = _q(client, f"""
        SELECT attempt, gpu, gpu_model, executing_gpu_seconds / 3600 AS executing_gpu_hours,
               idle_gpu_seconds / 3600 AS idle_gpu_hours, mean_util_pct AS util_pct
        FROM {db}.job_gpu_balance WHERE job_id = {{job:String}} ORDER BY attempt, gpu""", p)
    attempts = sorted({g["attempt"] for g in gpus})
    scores = [{"attempt": a, "gpus": sum(1 for g in gpus if g["attempt"] == a),
               "balance_score": balance_score([g["util_pct"] for g in gpus if g["attempt"] == a])} for a in attempts]
    stretches = _q(client, f"""
        SELECT attempt, node, gpu_uuid, stretch_start, duration_seconds, idle_gpu_seconds, offset_ms
        FROM {db}.job_idle_stretches WHERE job_id = {{job:String}}
        ORDER BY attempt, stretch_start, gpu_uuid""", p)
    hints = []
    for a in attempts:
        first = [x for x in stretches if x["attempt"] == a and x["offset_ms"] == 0 and x["duration_seconds"] >= stall_s]
        if first:
            longest = max(x["duration_seconds"] for x in first)
            hints.append({"attempt": a, "hint": "loading stall",
                          "detail": f"{len(first)} GPU(s) idle for up to {longest:.0f} s after allocation "
                                    "(image pull / data loading before the first step)"})
        later = [x for x in stretches if x["attempt"] == a and x["offset_ms"] > 0 and x["duration_seconds"] >= stall_s]
        if later:
            hints.append({"attempt": a, "hint": "mid-run stalls",
                          "detail": f"{len(later)} idle stretch(es) of >= {stall_s:.0f} s while running, "
                                    f"{sum(x['idle_gpu_seconds'] for x in later) / 60:.1f} GPU-minutes "
                                    "(checkpoints, input pipeline, hangs)"})
    for r in _stragglers(client, database, job_id=str(job_id)):
        hints.append({"attempt": r["attempt"], "hint": "straggler",
                      "detail": f"{r['gpu']} at {r['util_pct']:.0f}% vs the attempt's median {r['median_pct']:.0f}%"})
    cost = _q(client, f"""
        SELECT attempt, any(outcome) AS outcome,
               sumIf(cost, line = 'compute') AS compute_cost, sumIf(cost, line = 'idle') AS idle_cost,
               sumIf(cost, line = 'failed_retry') AS failed_retry_cost, sum(cost) AS total_cost,
               sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArray(toString(gpu_model))), ' ') AS gpu_models
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}} GROUP BY attempt ORDER BY attempt""", p)
    by_model = _q(client, f"""
        SELECT gpu_model, sum(cost) AS cost, sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}} GROUP BY gpu_model ORDER BY gpu_model""", p)
    executing = _total(hist, "gpu_hours")
    low = sum(h["gpu_hours"] for h in hist if h["util_bucket"] < "30")
    report = Report("job", f"Job health report: {job_id}", f"{s['first_day']} .. {s['last_day']}", summary={
        "tenant": s["tenant"], "queue": s["queue"], "attempts": s["attempts"], "failed_attempts": s["failed_attempts"],
        "last_outcome": s["last_outcome"], "gpu_hours": s["gpu_hours"], "idle_gpu_hours": s["idle_gpu_hours"],
        "cost": s["cost"], "low_util_share": low / executing if executing else None,
        "balance_score": min((x["balance_score"] for x in scores if x["balance_score"] is not None), default=None),
    })
    report.sections = [
        Section("Utilization distribution", hist, "executing GPU-hours by utilization bucket",
                Plot("bar", "util_bucket", ["gpu_hours"])),
        Section("Balance across GPUs", gpus, "time-weighted utilization of each GPU while executing",
                Plot("bar", "gpu", ["util_pct"])),
        Section("Balance score per attempt", scores, "mean / max of the per-GPU utilizations (1 = balanced)"),
        Section("Hints", hints, "loading stalls, mid-run stalls and stragglers"),
        Section("Idle stretches", stretches, "runs of allocated-but-not-executing time"),
        Section("Cost by attempt", cost, "", Plot("stacked", "attempt", ["compute_cost", "idle_cost", "failed_retry_cost"])),
        Section("Cost by GPU model", by_model),
    ]
    return report


_BUILDERS = {"inventory": _inventory, "monthly": _monthly, "weekly": _weekly, "job": _job}


def build_report(client, database: str, name: str, **opts) -> Report:
    """Build one report. Options: inventory(days=30, as_of, low_util_pct=20, top=10), monthly(month='YYYY-MM'
    or as_of, top=10), weekly(as_of, top=10, idle_share=0.3), job(job_id, stall_s=60)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown report {name!r}; reports: {', '.join(REPORT_NAMES)}")
    opts = {k: v for k, v in opts.items() if v is not None}
    currency = opts.pop("currency", "")
    report = _BUILDERS[name](client, database, **opts)
    report.currency = currency
    return report


# --------------------------------------------------------------------------- rendering
def _md_cell(value: Any) -> str:
    return base._cell(value).replace("|", "\\|").replace("\n", " ")


def _markdown_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = base._columns(rows)
    numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                   for r in rows if r.get(c) is not None) for c in cols]
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    out += ["| " + " | ".join(_md_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out) + "\n"


def _summary_pairs(report: Report) -> list[tuple[str, str]]:
    pairs = []
    for k, v in report.summary.items():
        if isinstance(v, float) and (k.endswith(("_utilization", "_share")) or k == "balance_score"):
            pairs.append((k, f"{v:.1%}" if k != "balance_score" else f"{v:.2f}"))
        else:
            pairs.append((k, base._cell(v)))
    return pairs


def _render_text(report: Report) -> str:
    out = [f"{report.title} — {report.period}", report.units, ""]
    out += [f"  {k}: {v}" for k, v in _summary_pairs(report)]
    for s in report.sections:
        out += ["", f"== {s.title}" + (f"  ({s.note})" if s.note else ""),
                base.render(s.rows, "table", utc_days=True).rstrip("\n")]
    return "\n".join(out) + "\n"


def _render_markdown(report: Report) -> str:
    out = [f"# {report.title}", "", f"Period: {report.period}", "", report.units, ""]
    out += [f"- **{k}**: {v}" for k, v in _summary_pairs(report)]
    for s in report.sections:
        out += ["", f"## {s.title}", ""]
        if s.note:
            out += [f"_{s.note}_", ""]
        out.append(_markdown_table(base.utc_labels(s.rows)).rstrip("\n"))
    return "\n".join(out) + "\n"


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _fmt_axis(value: float, percent: bool) -> str:
    if percent:
        return f"{value:.0%}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def svg_plot(rows: Sequence[dict], plot: Plot, width: int = 720, height: int = 280) -> str:
    """An inline SVG: grouped bars, stacked bars or lines of `plot.series` over the `plot.x` categories."""
    cats = [base._cell(r.get(plot.x)) for r in rows]
    vals = [[float(r.get(s) or 0) if isinstance(r.get(s), (int, float)) and math.isfinite(float(r.get(s) or 0)) else 0.0
             for s in plot.series] for r in rows]
    if not rows:
        return ""
    left, right, top, bottom = 64, 16, 28, 64
    pw, ph = width - left - right, height - top - bottom
    ymax = max([sum(v) for v in vals] if plot.kind == "stacked" else [max(v) for v in vals] + [0.0])
    if plot.percent:
        ymax = max(ymax, 1.0)
    ymax = ymax or 1.0
    y = lambda v: top + ph - v / ymax * ph  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'role="img" font-family="sans-serif" font-size="11">']
    for i in range(5):
        v = ymax * i / 4
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" fill="#555">{_fmt_axis(v, plot.percent)}</text>')
    n = len(cats)
    band = pw / n
    for i, cat in enumerate(cats):
        cx = left + band * (i + 0.5)
        if n <= 40 or i % max(1, n // 20) == 0:
            parts.append(f'<text x="{cx:.1f}" y="{top + ph + 14}" text-anchor="end" fill="#333" '
                         f'transform="rotate(-30 {cx:.1f} {top + ph + 14})">{html.escape(cat[:24])}</text>')
    if plot.kind == "line":
        for j, name in enumerate(plot.series):
            pts = " ".join(f"{left + band * (i + 0.5):.1f},{y(v[j]):.1f}" for i, v in enumerate(vals))
            color = _PALETTE[j % len(_PALETTE)]
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
            parts += [f'<circle cx="{left + band * (i + 0.5):.1f}" cy="{y(v[j]):.1f}" r="3" fill="{color}"/>'
                      for i, v in enumerate(vals)]
    else:
        for i, v in enumerate(vals):
            x0 = left + band * i + band * 0.1
            if plot.kind == "stacked":
                acc = 0.0
                for j, val in enumerate(v):
                    parts.append(f'<rect x="{x0:.1f}" y="{y(acc + val):.1f}" width="{band * 0.8:.1f}" '
                                 f'height="{max(0.0, y(acc) - y(acc + val)):.1f}" fill="{_PALETTE[j % len(_PALETTE)]}">'
                                 f'<title>{html.escape(cats[i])} {html.escape(plot.series[j])}: {val:,.4g}</title></rect>')
                    acc += val
            else:
                w = band * 0.8 / len(v)
                for j, val in enumerate(v):
                    parts.append(f'<rect x="{x0 + j * w:.1f}" y="{y(val):.1f}" width="{w:.1f}" '
                                 f'height="{max(0.0, y(0) - y(val)):.1f}" fill="{_PALETTE[j % len(_PALETTE)]}">'
                                 f'<title>{html.escape(cats[i])} {html.escape(plot.series[j])}: {val:,.4g}</title></rect>')
    for j, name in enumerate(plot.series):
        lx = left + j * 180
        parts.append(f'<rect x="{lx}" y="6" width="10" height="10" fill="{_PALETTE[j % len(_PALETTE)]}"/>'
                     f'<text x="{lx + 14}" y="15" fill="#333">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}.note{color:#666;font-style:italic}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}th,td{border:1px solid #ddd;padding:3px 8px}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}dl{display:grid;
grid-template-columns:max-content auto;gap:2px 16px}dt{font-weight:600}dd{margin:0}"""


def _html_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "<p class='note'>(no rows)</p>"
    cols = base._columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            num = isinstance(v, (int, float)) and not isinstance(v, bool)
            cells.append(f"<td{' class=n' if num else ''}>{html.escape(base._cell(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _render_html(report: Report) -> str:
    out = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
           f"<title>{html.escape(report.title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{html.escape(report.title)}</h1><p>Period: {html.escape(report.period)}</p>",
           f"<p class='units'>{html.escape(report.units)}</p><dl>"]
    out += [f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in _summary_pairs(report)]
    out.append("</dl>")
    for s in report.sections:
        out.append(f"<section><h2>{html.escape(s.title)}</h2>")
        if s.note:
            out.append(f"<p class='note'>{html.escape(s.note)}</p>")
        if s.plot and s.rows:
            out.append(f"<figure>{svg_plot(s.rows, s.plot)}</figure>")
        out.append(_html_table(base.utc_labels(s.rows)) + "</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_report(report: Report, fmt: str = "table") -> str:
    """`table` (aligned text), `markdown` (GitHub tables) or `html` (one self-contained page with SVG plots)."""
    if fmt == "table":
        return _render_text(report)
    if fmt == "markdown":
        return _render_markdown(report)
    if fmt == "html":
        return _render_html(report)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


# --------------------------------------------------------------------------- CLI
def register_report_cli(parser) -> None:
    """Options the periodic reports take, for `gpuledger report` (the lead wires the command)."""
    parser.add_argument("--days", type=int, help="inventory: length of the period in days (default 30)")
    parser.add_argument("--as-of", help="last day of the period, YYYY-MM-DD (default: the last day with usage)")
    parser.add_argument("--month", help="monthly: YYYY-MM (default: the month of --as-of)")
    parser.add_argument("--top", type=int, help="how many jobs in the top lists (default 10)")


def report_options(name: str, args) -> dict:
    """The build_report options of `name` from parsed arguments (see register_report_cli)."""
    get = lambda k: getattr(args, k, None)  # noqa: E731
    if name == "inventory":
        return {"days": get("days"), "as_of": get("as_of"), "top": get("top")}
    if name == "monthly":
        return {"month": get("month"), "as_of": get("as_of"), "top": get("top")}
    if name == "weekly":
        return {"as_of": get("as_of"), "top": get("top")}
    return {"job_id": get("job_id")}
