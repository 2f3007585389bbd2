"""The four periodic reports built from the warehouse: inventory, monthly, weekly, job health.

- `inventory`: cards per GPU model and their utilization (the three layers), the cards that stayed
  under a utilization threshold (20 %) and the queues that held them, the largest jobs by GPU-hours,
  requested vs allocated vs executed GPU-time per queue.
- `monthly`: the three-layer trend per day, the tenants' cost composition (compute / idle /
  failed-retry), the top-N jobs by cost.
- `weekly`: anomalies (GPUs down, failed attempts, idle-heavy jobs, stragglers), the top-10 costly
  jobs, GPUs reclaimed on followed reclaim suggestions and the savings they made (docs/alerts.md).
- `job`: utilization distribution, per-GPU balance score, loading-stall and straggler hints, cost by attempt.

Periods end at `as_of` (default: the last day with usage, so a replayed period reports as if it were
now); every period report states how much of the period has data (`Report.coverage`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from gpuledger.warehouse import reports as base
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.periodic.model import Plot, Report, Section
from gpuledger.warehouse.periodic.queries import (
    LAYERS,
    balance_score,
    coverage,
    followed_suggestions,
    largest_jobs,
    period_jobs,
    period_end,
    positive_int,
    query,
    stragglers,
    tenant_costs,
    total,
)


def inventory(client, database: str, *, days: int = 30, as_of: Any = None, low_util_pct: float = 20.0,
               top: int = 10, cards_listed: int = 50) -> Report:
    days, top = positive_int("days", days), positive_int("top", top)
    cards_listed = positive_int("cards_listed (--cards)", cards_listed)
    end = period_end(client, database, as_of)
    start = end - dt.timedelta(days=days - 1)
    db = quoted_database(database)
    p = {"d0": start, "d1": end, "low": float(low_util_pct)}
    cards = query(client, f"""
        SELECT gpu_model, uniqExact(gpu_uuid) AS cards, uniqExact(node) AS nodes,
               sum(gpu_ms) / 3600000 AS capacity_gpu_hours
        FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_model ORDER BY gpu_model""", p)
    util = base.fetch(client, database, "utilization", by="gpu_model", day_from=start, day_to=end)
    by_model = {r["gpu_model"]: r for r in util}
    for r in cards:
        u = by_model.get(r["gpu_model"], {})
        for layer in LAYERS:
            r[layer] = u.get(layer)
    # per card: time-weighted utilization over the time it was up (idle and unallocated time count as 0),
    # from the per-GPU daily sums (sql/0030), as every query of this report but the jobs and queues
    per_card = query(client, f"""
        SELECT gpu_uuid, any(node) AS node, any(gpu_model) AS gpu_model,
               sumIf(util_weighted_gpu_ms, state = 'executing') / nullIf(sumIf(gpu_ms, state != 'down'), 0) AS util_pct,
               sumIf(gpu_ms, state != 'down') / 3600000 AS up_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArrayIf(toString(queue), queue != '')), ' ') AS queues
        FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_uuid HAVING up_gpu_hours > 0 AND coalesce(util_pct, 0) < {{low:Float64}}
        ORDER BY util_pct, node, gpu_uuid""", p)
    low_queues = query(client, f"""
        SELECT queue, uniqExact(gpu_uuid) AS low_util_cards, sum(gpu_ms) / 3600000 AS held_gpu_hours
        FROM {db}.usage_gpu_daily
        WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} AND queue != '' AND gpu_uuid IN
            (SELECT gpu_uuid FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} GROUP BY gpu_uuid
             HAVING coalesce(sumIf(util_weighted_gpu_ms, state = 'executing')
                    / nullIf(sumIf(gpu_ms, state != 'down'), 0), 0) < {{low:Float64}})
        GROUP BY queue ORDER BY held_gpu_hours DESC, queue""", p)
    largest = largest_jobs(client, database, start, end, top)
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
        "requested_gpu_hours": total(requested, "requested_gpu_hours"),
        "executed_gpu_hours": total(requested, "executed_gpu_hours"),
    })
    report.coverage = coverage(client, database, start, end)
    report.sections = [
        Section("Cards per GPU model and their utilization", cards,
                "scheduling = allocated / up time, execution = executing / allocated, hardware = SM activity while executing",
                Plot("bar", "gpu_model", list(LAYERS))),
        Section(f"Cards under {low_util_pct:g}% utilization",
                capped(per_card, cards_listed, label="gpu_uuid", sums=("up_gpu_hours",),
                       note=("queues", "not listed: their up GPU-hours")),
                f"utilization over the time the card was up; idle and unallocated time count as 0; the "
                f"{cards_listed} lowest listed, the rest summed"),
        Section(f"Queues holding the cards under {low_util_pct:g}%", low_queues, "",
                Plot("bar", "queue", ["held_gpu_hours"])),
        Section(f"Largest {top} jobs by GPU-hours", largest, "", Plot("bar", "job_id", ["gpu_hours"])),
        Section("Requested vs used GPU-hours per queue", requested,
                "requested = requested GPUs x (end - queued); used = executed", Plot("bar", "queue", [
                    "requested_gpu_hours", "allocated_gpu_hours", "executed_gpu_hours"])),
    ]
    return report




def monthly(client, database: str, *, month: str | None = None, as_of: Any = None, top: int = 10) -> Report:
    top = positive_int("top", top)
    if month:
        try:
            first = dt.date.fromisoformat(f"{month}-01")
        except ValueError:
            raise ValueError(f"month must be YYYY-MM, got {month!r}") from None
    else:
        first = period_end(client, database, as_of).replace(day=1)
    last = (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1) - dt.timedelta(days=1)
    trend = base.fetch(client, database, "utilization", by="day", day_from=first, day_to=last)
    trend = [{"day": r["day"], **{k: r[k] for k in LAYERS},
              "executing_gpu_hours": (r["executing_gpu_seconds"] or 0) / 3600} for r in trend]
    tenants = tenant_costs(client, database, first, last)
    jobs, _ = period_jobs(client, database, first, last, top)
    overall = base.fetch(client, database, "utilization", by="cluster", day_from=first, day_to=last)
    report = Report("monthly", f"Monthly report {first:%Y-%m}", f"{first} .. {last}", summary={
        "total_cost": total(tenants, "total_cost"),
        "idle_cost": total(tenants, "idle_cost"),
        "failed_retry_cost": total(tenants, "failed_retry_cost"),
        "effective_gpu_hours": total(tenants, "effective_gpu_hours"),
        **({k: overall[0][k] for k in LAYERS} if len(overall) == 1 else {}),
    })
    report.coverage = coverage(client, database, first, last)
    report.sections = [
        Section("Three utilization layers per day", trend, "each layer as a ratio of its parent",
                Plot("line", "day", list(LAYERS))),
        Section("Tenant cost composition", tenants, "compute / idle (allocated, not executing) / failed retry",
                Plot("stacked", "tenant", ["compute_cost", "idle_cost", "failed_retry_cost"])),
        Section(f"Top {top} jobs by cost", jobs, "", Plot("bar", "job_id", ["cost"])),
    ]
    return report




def capped(rows: list[dict], limit: int, *, label: str, sums: tuple[str, ...], kind: str | None = None,
           note: tuple[str, str] | None = None) -> list[dict]:
    """The first `limit` rows (rows come most important first), per value of the `kind` column if one
    is named, and for each group with more, one row in the same columns that says how many more in
    `label`, sums the `sums` columns of the rest (None where none has a value), puts `note` (column,
    text) and leaves the rest empty. A list that grows with the fleet stays readable: a week at 100 M
    records had 12,268 anomalies (a 1.6 MB HTML page)."""
    groups: dict[Any, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[kind] if kind else None, []).append(r)
    out: list[dict] = []
    for value, group in groups.items():
        out += group[:limit]
        rest = group[limit:]
        if rest:
            more = dict.fromkeys(rest[0])
            if kind:
                more[kind] = value
            more[label] = f"{len(rest):,} more"
            more.update({col: None if all(r[col] is None for r in rest) else total(rest, col) for col in sums})
            if note:
                more[note[0]] = note[1]
            out.append(more)
    return out


def longest_first_capped(stretches: list[dict], limit: int) -> list[dict]:
    """A job's idle stretches (in time order) for its report: the `limit` with the most idle GPU-time,
    still in time order, then one row counting and summing the rest (`capped`). They grow with the
    job's GPUs and hours: a week-long 512-GPU job with hourly checkpoints has ~86,000."""
    if len(stretches) <= limit:
        return stretches
    ranked = sorted(range(len(stretches)), key=lambda i: -stretches[i]["idle_gpu_seconds"])
    listed = sorted(ranked[:limit])
    return capped([stretches[i] for i in listed] + [stretches[i] for i in sorted(ranked[limit:])], limit,
                  label="gpu_uuid", sums=("idle_gpu_seconds",))


def anomalies(client, database: str, start: dt.date, end: dt.date, idle_share: float,
              flagged: list[dict]) -> list[dict]:
    """One row per anomaly; its size in the column of its unit (GPU-hours down or idle, the cost of
    failed attempts), never one column mixing hours, money and percent. `flagged`: the failed and
    idle-heavy jobs (period_jobs)."""
    db = quoted_database(database)
    p = {"d0": start, "d1": end}
    out = []
    for r in query(client, f"""
            SELECT node, gpu_uuid, gpu_model, sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds
            FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
            GROUP BY node, gpu_uuid, gpu_model HAVING down_seconds > 0 ORDER BY down_seconds DESC, gpu_uuid""", p):
        out.append({"kind": "GPU down", "subject": f"{r['node']} {r['gpu_uuid']}",
                    "detail": f"{r['gpu_model']} down {r['down_seconds'] / 60:.1f} min",
                    "gpu_hours": r["down_seconds"] / 3600, "cost": None})
    for r in sorted((r for r in flagged if r["failed_attempts"] > 0), key=lambda r: (-r["cost"], r["job_id"])):
        out.append({"kind": "Failed attempts", "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['failed_attempts']} failed attempt(s)", "gpu_hours": None,
                    "cost": r["cost"]})
    for r in sorted((r for r in flagged if r["gpu_hours"] > 0 and r["share"] > idle_share),
                    key=lambda r: (-r["idle_gpu_hours"], r["job_id"])):
        out.append({"kind": "Idle-heavy job", "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['share']:.0%} of held GPU-time idle",
                    "gpu_hours": r["idle_gpu_hours"], "cost": None})
    for r in stragglers(client, database, start=start, end=end):
        out.append({"kind": "Straggler", "subject": r["job_id"],
                    "detail": f"attempt {r['attempt']}: {r['gpu']} at {r['util_pct']:.0f}% vs median {r['median_pct']:.0f}%",
                    "gpu_hours": None, "cost": None})
    return out


def weekly(client, database: str, *, as_of: Any = None, top: int = 10, idle_share: float = 0.3,
           followed_within_s: float = 3600.0, anomalies_per_kind: int = 20) -> Report:
    top = positive_int("top", top)
    anomalies_per_kind = positive_int("anomalies_per_kind (--anomalies)", anomalies_per_kind)
    end = period_end(client, database, as_of)
    start = end - dt.timedelta(days=6)
    # Reclaimed = idle GPU time avoided by following reclaim suggestions (docs/alerts.md, "Followed
    # suggestions"): a named job released its GPUs within followed_within_s; until the end of that
    # span (or of the week) it would have held gpus_freed x (1 - its execution rate) idle, each idle
    # GPU-hour at what its idle GPU-hours cost. Not a week-over-week difference of idle time.
    week_end_ms = int(dt.datetime.combine(end + dt.timedelta(days=1), dt.time(), dt.timezone.utc).timestamp() * 1000)
    reclaimed = []
    for r in followed_suggestions(client, database, start, end, followed_within_s):
        until = min(r["suggested_ms"] + followed_within_s * 1000, week_end_ms)
        hours = r["gpus_freed"] * (1 - r["execution_rate"]) * max(0, until - r["released_ms"]) / 3_600_000
        when = lambda ms: dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")  # noqa: E731
        reclaimed.append({"queue": r["queue"], "job_id": r["job_id"], "suggested_at": when(r["suggested_ms"]),
                          "released_at": when(r["released_ms"]), "gpus_freed": r["gpus_freed"],
                          "reclaimed_gpu_hours": hours, "saved_cost": hours * r["idle_cost_per_gpu_hour"]})
    tenants = tenant_costs(client, database, start, end)
    savings = [
        {"item": "idle avoided by following reclaim suggestions", "cost": total(reclaimed, "saved_cost")},
        {"item": "idle still allocated this week (reclaimable)", "cost": total(tenants, "idle_cost")},
        {"item": "failed-retry GPU time this week (avoidable)", "cost": total(tenants, "failed_retry_cost")},
    ]
    report = Report("weekly", f"Weekly report, week ending {end}", f"{start} .. {end}", summary={
        "total_cost": total(tenants, "total_cost"),
        "reclaimed_gpu_hours": total(reclaimed, "reclaimed_gpu_hours"),
        "estimated_savings": savings[0]["cost"],
        "potential_savings": savings[1]["cost"] + savings[2]["cost"],
    })
    report.coverage = coverage(client, database, start, end)
    jobs, flagged = period_jobs(client, database, start, end, top, idle_share)
    report.sections = [
        Section("Anomalies", capped(anomalies(client, database, start, end, idle_share, flagged), anomalies_per_kind,
                                    label="subject", sums=("gpu_hours", "cost"), kind="kind",
                                    note=("detail", "not listed: their total")),
                f"GPUs down, failed attempts, jobs idle more than {idle_share:.0%} of their held time, stragglers; "
                f"the {anomalies_per_kind} largest of each kind, the rest summed"),
        Section(f"Top {top} costly jobs", jobs, "", Plot("bar", "job_id", ["cost"])),
        Section("Reclaimed on followed reclaim suggestions", reclaimed,
                f"jobs a suggestion named that released their GPUs within {followed_within_s / 60:g} min of it"),
        Section("Estimated savings", savings),
    ]
    return report




def job(client, database: str, *, job_id: str, stall_s: float = 60.0, stretches_listed: int = 50) -> Report:
    if not job_id:
        raise ValueError("the job report needs a job id")
    stretches_listed = positive_int("stretches_listed (--stretches)", stretches_listed)
    db = quoted_database(database)
    p = {"job": str(job_id)}
    summary_rows = base.fetch(client, database, "jobs", job_id=str(job_id))
    if not summary_rows:
        raise ValueError(f"no job {job_id!r} in the warehouse")
    s = summary_rows[0]
    hist = query(client, f"""
        SELECT util_bucket, sum(gpu_seconds) / 3600 AS gpu_hours FROM {db}.job_util_histogram
        WHERE job_id = {{job:String}} GROUP BY util_bucket ORDER BY util_bucket""", p)
    gpus = query(client, f"""
        SELECT attempt, gpu, gpu_model, executing_gpu_seconds / 3600 AS executing_gpu_hours,
               idle_gpu_seconds / 3600 AS idle_gpu_hours, mean_util_pct AS util_pct
        FROM {db}.job_gpu_balance WHERE job_id = {{job:String}} ORDER BY attempt, gpu""", p)
    attempts = sorted({g["attempt"] for g in gpus})
    scores = [{"attempt": a, "gpus": sum(1 for g in gpus if g["attempt"] == a),
               "balance_score": balance_score([g["util_pct"] for g in gpus if g["attempt"] == a])} for a in attempts]
    stretches = query(client, f"""
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
    for r in stragglers(client, database, job_id=str(job_id)):
        hints.append({"attempt": r["attempt"], "hint": "straggler",
                      "detail": f"{r['gpu']} at {r['util_pct']:.0f}% vs the attempt's median {r['median_pct']:.0f}%"})
    cost = query(client, f"""
        SELECT attempt, any(outcome) AS outcome,
               sumIf(cost, line = 'compute') AS compute_cost, sumIf(cost, line = 'idle') AS idle_cost,
               sumIf(cost, line = 'failed_retry') AS failed_retry_cost, sum(cost) AS total_cost,
               sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArray(toString(gpu_model))), ' ') AS gpu_models
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}} GROUP BY attempt ORDER BY attempt""", p)
    by_model = query(client, f"""
        SELECT gpu_model, sum(cost) AS cost, sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}} GROUP BY gpu_model ORDER BY gpu_model""", p)
    executing = total(hist, "gpu_hours")
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
        Section("Idle stretches", longest_first_capped(stretches, stretches_listed),
                f"runs of allocated-but-not-executing time, per GPU; the {stretches_listed} longest listed in "
                "time order, the rest summed"),
        Section("Cost by attempt", cost, "", Plot("stacked", "attempt", ["compute_cost", "idle_cost", "failed_retry_cost"])),
        Section("Cost by GPU model", by_model),
    ]
    # training signals where the job reports its progress (line 4; gpuledger/warehouse/training.py)
    from gpuledger.warehouse.training import training_sections
    extra, sections = training_sections(client, database, str(job_id))
    report.summary.update(extra)
    report.sections += sections
    return report


