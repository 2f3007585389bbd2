"""The four periodic reports built from the warehouse: inventory, monthly, weekly, job health.

- `inventory`: cards per GPU model and their utilization (the three layers), the cards that stayed
  under a utilization threshold (20 %) and the queues that held them, the largest jobs by GPU-hours,
  requested vs allocated vs executed GPU-time per queue, the GPU UUIDs two nodes reported at once.
- `monthly`: the three-layer trend per day, the tenants' cost composition (compute / idle /
  failed-retry), the top-N jobs by cost.
- `weekly`: anomalies (GPUs down, failed attempts, idle-heavy jobs, stragglers), the top-10 costly
  jobs, GPUs reclaimed on followed reclaim suggestions and the savings they made (docs/alerts.md).
- `job`: utilization distribution, per-GPU balance score, loading-stall and straggler hints, cost by attempt,
  each per cluster and attempt (an id in two clusters is two jobs).

Why one file: the four reports share their period handling, capping and money summary helpers, and
each is one function that reads top to bottom as the report does.

Periods end at `as_of` (default: the last day with usage, so a replayed period reports as if it were
now); every period report states how much of the period has data (`Report.coverage`).
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from gpuledger.warehouse import reports as base
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.periodic.model import Plot, Report, Section
from gpuledger.warehouse.periodic.queries import (
    FIRST_DAY,
    LAST_DAY,
    LAYERS,
    as_date,
    balance_score,
    coverage,
    currencies,
    fill_unknown_currency,
    fleet_layers,
    followed_suggestions,
    largest_jobs,
    money_total,
    period_end,
    period_jobs,
    period_start,
    positive_int,
    query,
    stragglers,
    tenant_costs,
    total,
    unsampled_cards,
)


def inventory(client, database: str, *, days: int = 30, as_of: Any = None, low_util_pct: float = 20.0,
               top: int = 10, cards_listed: int = 50, currency: str = "") -> Report:
    days, top = positive_int("days (--days)", days), positive_int("top (--top)", top)
    cards_listed = positive_int("cards_listed (--cards)", cards_listed)
    end = period_end(client, database, as_of)
    start = period_start(end, days)
    db = quoted_database(database)
    p = {"d0": start, "d1": end, "low": float(low_util_pct)}
    cards = query(client, f"""
        SELECT gpu_model, uniqExact(gpu_uuid) AS cards, uniqExact(cluster, node) AS nodes,
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
    # from the per-GPU daily sums (sql/0030), as every query of this report but the jobs and queues; a
    # node is (cluster, node): two clusters may both have a node001, so each card names its cluster
    per_card = query(client, f"""
        SELECT toString(any(cluster)) AS cluster, gpu_uuid, any(node) AS node, any(gpu_model) AS gpu_model,
               sumIf(util_weighted_gpu_ms, state = 'executing') / nullIf(sumIf(gpu_ms, state != 'down'), 0) AS util_pct,
               sumIf(gpu_ms, state != 'down') / 3600000 AS up_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArrayIf(toString(queue), queue != '')), ' ') AS queues,
               sumIf(gpu_ms, state = 'executing') AS executing_ms
        FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_uuid HAVING up_gpu_hours > 0 AND coalesce(util_pct, 0) < {{low:Float64}}
        ORDER BY util_pct, cluster, node, gpu_uuid""", p)
    # executing time with no sample counts 0 above: such cards' utilization is unknown, not low
    unknown = unsampled_cards(client, database, [c["gpu_uuid"] for c in per_card if c.pop("executing_ms")], start, end)
    unsampled = [{**c, "util_pct": None} for c in per_card if c["gpu_uuid"] in unknown]
    per_card = [c for c in per_card if c["gpu_uuid"] not in unknown]
    p["unknown"] = sorted(unknown)
    # a queue is (cluster, queue), as the reclaim suggestions' (two clusters may both have a `gpu` partition)
    low_queues = query(client, f"""
        SELECT toString(cluster) AS cluster, queue, uniqExact(gpu_uuid) AS low_util_cards,
               sum(gpu_ms) / 3600000 AS held_gpu_hours
        FROM {db}.usage_gpu_daily
        WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} AND queue != '' AND gpu_uuid IN
            (SELECT gpu_uuid FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}} GROUP BY gpu_uuid
             HAVING coalesce(sumIf(util_weighted_gpu_ms, state = 'executing')
                    / nullIf(sumIf(gpu_ms, state != 'down'), 0), 0) < {{low:Float64}})
          AND gpu_uuid NOT IN {{unknown:Array(String)}}
        GROUP BY cluster, queue ORDER BY held_gpu_hours DESC, cluster, queue""", p)
    largest = largest_jobs(client, database, start, end, top, currency)
    queues = base.fetch(client, database, "queues", day_from=start, day_to=end)
    req: dict[tuple[str, str], dict] = {}
    for r in queues:
        q = req.setdefault((r["cluster"], r["queue"]), {
            "cluster": r["cluster"], "queue": r["queue"], "attempts": 0, "requested_gpu_hours": 0.0,
            "allocated_gpu_hours": 0.0, "executed_gpu_hours": 0.0})
        q["attempts"] += r["attempts"]
        q["requested_gpu_hours"] += (r["requested_gpu_seconds"] or 0) / 3600
        q["allocated_gpu_hours"] += (r["allocated_gpu_seconds"] or 0) / 3600
        q["executed_gpu_hours"] += (r["executed_gpu_seconds"] or 0) / 3600
    requested = [req[k] for k in sorted(req)]
    for q in requested:
        q["used_to_requested"] = q["executed_gpu_hours"] / q["requested_gpu_hours"] if q["requested_gpu_hours"] else None
        q["gap_gpu_hours"] = q["requested_gpu_hours"] - q["executed_gpu_hours"]
    at_once = gpus_on_two_nodes(client, database, start, end)
    report = Report("inventory", "GPU inventory", f"{start} .. {end} ({days} days)", summary={
        "cards": sum(r["cards"] for r in cards),
        "cards_under_threshold": len(per_card),
        **({"cards_without_utilization_sample": len(unsampled)} if unsampled else {}),
        **({"gpus_on_two_nodes_at_once": len(at_once)} if at_once else {}),
        "threshold_pct": float(low_util_pct),
        "requested_gpu_hours": total(requested, "requested_gpu_hours"),
        "executed_gpu_hours": total(requested, "executed_gpu_hours"),
    })
    report.currencies = currencies(largest) if largest and "currency" in largest[0] else []
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
        *([Section("Cards with no utilization sample", capped(unsampled, cards_listed, label="gpu_uuid",
                                                              sums=("up_gpu_hours",)),
                   "executing with no SM activity reported (e.g. MIG, vGPU): utilization unknown")] if unsampled else []),
        Section(f"Queues holding the cards under {low_util_pct:g}%", low_queues, "",
                Plot("bar", "queue", ["held_gpu_hours"])),
        Section(f"Largest {top} jobs by GPU-hours", largest, _PERIOD_JOBS_NOTE, Plot("bar", "job_id", ["gpu_hours"])),
        Section("Requested vs used GPU-hours per queue", requested,
                "requested = requested GPUs x (end - queued); used = executed", Plot("bar", "queue", [
                    "requested_gpu_hours", "allocated_gpu_hours", "executed_gpu_hours"])),
        Section("GPUs reported by two nodes at once",
                capped(at_once, cards_listed, label="gpu_uuid", sums=("hours_at_once",)),
                "one GPU UUID on two or more (cluster, node) in the same hour: a cloned agent or VM image "
                "(billed on one node only; docs/reliability.md, \"One GPU, one node\"); a GPU moved to another "
                "node shows there only after it left"),
    ]
    return report


def gpus_on_two_nodes(client, database: str, start: dt.date, end: dt.date) -> list[dict]:
    """The GPU UUIDs two or more (cluster, node) reported in one hour of the period (sql/0048's
    `gpu_uuid_shared_hours`, from the hourly health rows), where, and in how many hours."""
    return query(client, f"""
        SELECT gpu_uuid, arrayStringConcat(arraySort(groupUniqArrayArray(placements)), ', ') AS placements,
               count() AS hours_at_once, min(hour) AS first_hour_start, max(hour) AS last_hour_start
        FROM {quoted_database(database)}.gpu_uuid_shared_hours WHERE toDate(hour) BETWEEN {{d0:Date}} AND {{d1:Date}}
        GROUP BY gpu_uuid ORDER BY first_hour_start, gpu_uuid""", {"d0": start, "d1": end})


#: what the job rows of a period report are (queries.period_job_rows)
_PERIOD_JOBS_NOTE = ("the period's days only, each usage record once (closed days as closed, adjustments booked "
                     "in the period, open days live): a job running across periods shows its part")


def _money_summary(tenants: list[dict], keys: tuple[str, ...]) -> dict[str, Any]:
    """The tenants' money totals (per currency where several) and effective GPU-hours."""
    shared = ("cluster_idle_cost", "billed_total_cost") if tenants and "billed_total_cost" in tenants[0] else ()
    return {**{k: money_total(tenants, k) for k in (*keys, *shared)},
            "effective_gpu_hours": total(tenants, "effective_gpu_hours")}


def _tenant_rows(tenants: list[dict]) -> list[dict]:
    """Tenant rows as shown: the currency column only where the period holds several."""
    if len(currencies(tenants)) > 1:
        return tenants
    return [{k: v for k, v in t.items() if k != "currency"} for t in tenants]


def monthly(client, database: str, *, month: str | None = None, as_of: Any = None, top: int = 10,
            idle_redistribution: str | None = None, ledger_idle_redistribution: str = "none",
            currency: str = "") -> Report:
    top = positive_int("top (--top)", top)
    if month:
        try:
            first = dt.date.fromisoformat(f"{month}-01")
        except ValueError:
            raise ValueError(f"month (--month) must be YYYY-MM, got {month!r}") from None
        if not FIRST_DAY <= first < LAST_DAY.replace(day=1):  # the months a ClickHouse Date holds whole
            raise ValueError(f"month (--month) must be from {FIRST_DAY:%Y-%m} to 2149-05, got {month!r}")
        if as_of is not None and as_date(as_of).replace(day=1) != first:  # two answers: neither is ignored
            raise ValueError(f"--as-of {as_date(as_of)} is not in --month {month} (give one of them)")
    else:
        first = period_end(client, database, as_of).replace(day=1)
    last = (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1) - dt.timedelta(days=1)
    trend = base.fetch(client, database, "utilization", by="day", day_from=first, day_to=last)
    trend = [{"day": r["day"], **{k: r[k] for k in LAYERS},
              "executing_gpu_hours": (r["executing_gpu_seconds"] or 0) / 3600} for r in trend]
    tenants = tenant_costs(client, database, first, last, idle_redistribution=idle_redistribution,
                           ledger_idle_redistribution=ledger_idle_redistribution, currency=currency)
    jobs, _ = period_jobs(client, database, first, last, top, currency=currency)
    report = Report("monthly", f"Monthly report {first:%Y-%m}", f"{first} .. {last}", summary={
        **_money_summary(tenants, ("total_cost", "idle_cost", "failed_retry_cost")),
        **fleet_layers(client, database, first, last),  # every cluster together
    })
    report.currencies = currencies(tenants)
    report.coverage = coverage(client, database, first, last)
    shared = any("cluster_idle_cost" in t for t in tenants)
    how = idle_redistribution or "each definition version's [idle] policy"
    report.sections = [
        Section("Three utilization layers per day", trend, "each layer as a ratio of its parent",
                Plot("line", "day", list(LAYERS))),
        Section("Tenant cost composition", _tenant_rows(tenants),
                "compute / idle (allocated, not executing) / failed retry" + (
                    f" / cluster idle shared ({how}); billed total as `report bills`" if shared else ""),
                Plot("stacked", "tenant", ["compute_cost", "idle_cost", "failed_retry_cost"]
                     + (["cluster_idle_cost"] if shared else []))),
        Section(f"Top {top} jobs by cost", jobs, _PERIOD_JOBS_NOTE, Plot("bar", "job_id", ["cost"])),
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
    failed attempts in the period), never one column mixing hours, money and percent. `flagged`: the
    failed and idle-heavy jobs (period_jobs)."""
    db = quoted_database(database)
    p = {"d0": start, "d1": end}
    out = []
    for r in query(client, f"""
            SELECT toString(cluster) AS cluster, node, gpu_uuid, gpu_model,
                   sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds
            FROM {db}.usage_gpu_daily WHERE day BETWEEN {{d0:Date}} AND {{d1:Date}}
            GROUP BY cluster, node, gpu_uuid, gpu_model HAVING down_seconds > 0
            ORDER BY down_seconds DESC, gpu_uuid, cluster""", p):
        out.append({"kind": "GPU down", "cluster": r["cluster"], "subject": f"{r['node']} {r['gpu_uuid']}",
                    "detail": f"{r['gpu_model']} down {r['down_seconds'] / 60:.1f} min",
                    "gpu_hours": r["down_seconds"] / 3600, "cost": None})
    several = len({r["currency"] for r in flagged}) > 1
    for r in sorted((r for r in flagged if r["failed_attempts"] > 0),
                    key=lambda r: (-r["cost"], r["job_id"], r["cluster"])):
        out.append({"kind": "Failed attempts", "cluster": r["cluster"], "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['failed_attempts']} failed attempt(s), their cost this period"
                              + (f" in {r['currency']}" if several else ""), "gpu_hours": None,
                    "cost": r["cost"]})
    for r in sorted((r for r in flagged if r["gpu_hours"] > 0 and r["share"] > idle_share),
                    key=lambda r: (-r["idle_gpu_hours"], r["job_id"], r["cluster"])):
        out.append({"kind": "Idle-heavy job", "cluster": r["cluster"], "subject": r["job_id"],
                    "detail": f"{r['tenant']}: {r['share']:.0%} of held GPU-time idle",
                    "gpu_hours": r["idle_gpu_hours"], "cost": None})
    # the furthest below their attempt's median first: the capped list keeps the worst, not the first job ids
    for r in sorted(stragglers(client, database, start=start, end=end),
                    key=lambda r: (r["util_pct"] / r["median_pct"], r["job_id"], r["cluster"], r["attempt"], r["gpu"])):
        out.append({"kind": "Straggler", "cluster": r["cluster"], "subject": r["job_id"],
                    "detail": f"attempt {r['attempt']}: {r['gpu']} at {r['util_pct']:.0f}% vs median {r['median_pct']:.0f}%",
                    "gpu_hours": None, "cost": None})
    return out


def weekly(client, database: str, *, as_of: Any = None, top: int = 10, idle_share: float = 0.3,
           followed_within_s: float = 3600.0, anomalies_per_kind: int = 20, idle_redistribution: str | None = None,
           ledger_idle_redistribution: str = "none", currency: str = "") -> Report:
    top = positive_int("top (--top)", top)
    anomalies_per_kind = positive_int("anomalies_per_kind (--anomalies)", anomalies_per_kind)
    end = period_end(client, database, as_of)
    start = period_start(end, 7)
    # Reclaimed = idle GPU time avoided by following reclaim suggestions (docs/alerts.md, "Followed
    # suggestions"): a named job released its GPUs within followed_within_s; until the end of that
    # span it would have held gpus_freed x (1 - its execution rate) idle, each idle GPU-hour at what
    # its idle GPU-hours cost. Not a week-over-week difference of idle time. Each week counts the part
    # of that time inside it: a span across the week's end splits between the two weeks (the week of
    # the suggestion counted 0 for a release after its end, and the next week never saw it)
    def midnight_ms(day: dt.date) -> int:
        return int(dt.datetime.combine(day, dt.time(), dt.timezone.utc).timestamp() * 1000)

    week_start_ms, week_end_ms = midnight_ms(start), midnight_ms(end + dt.timedelta(days=1))
    reclaimed = []
    named = base.definition_currencies(client, quoted_database(database), currency or None)
    looked_back = start - dt.timedelta(days=math.ceil(followed_within_s / 86_400))
    for r in followed_suggestions(client, database, looked_back, end, followed_within_s):
        span_end = r["suggested_ms"] + followed_within_s * 1000
        since, until = max(r["released_ms"], week_start_ms), min(span_end, week_end_ms)
        if r["released_ms"] >= week_end_ms or (until <= since and r["released_ms"] < week_start_ms):
            continue  # released after this week, or its span was over before it began
        hours = r["gpus_freed"] * (1 - r["execution_rate"]) * max(0, until - since) / 3_600_000
        when = lambda ms: dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")  # noqa: E731
        reclaimed.append({"cluster": r["cluster"], "queue": r["queue"], "job_id": r["job_id"], "suggested_at": when(r["suggested_ms"]),
                          "released_at": when(r["released_ms"]), "gpus_freed": r["gpus_freed"],
                          "reclaimed_gpu_hours": hours, "saved_cost": hours * r["idle_cost_per_gpu_hour"],
                          "currency": base.currency_of(named, r["definition_version"])})
    tenants = tenant_costs(client, database, start, end, idle_redistribution=idle_redistribution,
                           ledger_idle_redistribution=ledger_idle_redistribution, currency=currency)
    for t in tenants:
        t["avoidable_cost"] = t["idle_cost"] + t["failed_retry_cost"]
    # savings priced in two currencies are summed per currency (money_total), as the tenants' money is
    fill_unknown_currency(reclaimed, {*currencies(tenants), *currencies(reclaimed)})
    savings = [
        {"item": "idle avoided by following reclaim suggestions", "cost": money_total(reclaimed, "saved_cost")},
        {"item": "idle still allocated this week (reclaimable)", "cost": money_total(tenants, "idle_cost")},
        {"item": "failed-retry GPU time this week (avoidable)", "cost": money_total(tenants, "failed_retry_cost")},
    ]
    money = _money_summary(tenants, ("total_cost",))
    money.pop("effective_gpu_hours")
    report = Report("weekly", f"Weekly report, week ending {end}", f"{start} .. {end}", summary={
        **money,
        "reclaimed_gpu_hours": total(reclaimed, "reclaimed_gpu_hours"),
        "estimated_savings": savings[0]["cost"],
        "potential_savings": money_total(tenants, "avoidable_cost"),
    })
    report.currencies = sorted({*currencies(tenants), *currencies(reclaimed)})
    report.coverage = coverage(client, database, start, end)
    jobs, flagged = period_jobs(client, database, start, end, top, idle_share, currency)
    report.sections = [
        Section("Anomalies", capped(anomalies(client, database, start, end, idle_share, flagged), anomalies_per_kind,
                                    label="subject", sums=("gpu_hours", "cost"), kind="kind",
                                    note=("detail", "not listed: their total")),
                f"GPUs down, failed attempts, jobs idle more than {idle_share:.0%} of their held time, stragglers; "
                f"the {anomalies_per_kind} largest of each kind, the rest summed"),
        Section(f"Top {top} costly jobs", jobs, _PERIOD_JOBS_NOTE, Plot("bar", "job_id", ["cost"])),
        Section("Reclaimed on followed reclaim suggestions",  # each row's currency where the week has several
                reclaimed if len(report.currencies) > 1 else [{k: v for k, v in r.items() if k != "currency"}
                                                              for r in reclaimed],
                f"jobs a suggestion named that released their GPUs within {followed_within_s / 60:g} min of it"),
        Section("Estimated savings", savings),
    ]
    return report


def job_summary(rows: list[dict]) -> dict[str, Any]:
    """The jobs report's rows of one job id (one per cluster and definition version: a ledger updated
    while it ran prices its records under two) as one: GPU-hours, idle GPU-hours and cost added up, its
    first and last day; attempts per cluster (each version's row counts them all) added over clusters;
    names that differ joined; `clusters` named where it ran in several (each its own job)."""
    by_cluster: dict[str, list[dict]] = {}
    for r in rows:
        by_cluster.setdefault(str(r["cluster"]), []).append(r)
    joined = lambda key: ", ".join(dict.fromkeys(str(r[key]) for r in rows if r[key] not in (None, "")))  # noqa: E731
    latest = max(rows, key=lambda r: r["last_day"] or dt.date.min)  # a job with no usage has no days
    out = {"tenant": joined("tenant"), "queue": joined("queue"),
           "attempts": sum(max(r["attempts"] or 0 for r in rs) for rs in by_cluster.values()),
           "failed_attempts": sum(max(r["failed_attempts"] or 0 for r in rs) for rs in by_cluster.values()),
           "last_outcome": latest["last_outcome"], "gpu_hours": total(rows, "gpu_hours"),
           "idle_gpu_hours": total(rows, "idle_gpu_hours"), "cost": total(rows, "cost"),
           "first_day": min((r["first_day"] for r in rows if r["first_day"]), default=None),
           "last_day": latest["last_day"]}
    if len(by_cluster) > 1:
        out["clusters"] = ", ".join(sorted(by_cluster))
    return out


def _worst_balance(scores: list[dict], *, several_clusters: bool) -> float | str | None:
    """The lowest balance score of the job's attempts; where its id ran in several clusters (each its
    own job), the lowest of each cluster's as text ("c 1.00; c2 0.56"), as a score of one cluster's
    job says nothing of the other's."""
    worst: dict[str, float] = {}
    for x in scores:
        if x["balance_score"] is not None:
            worst[x["cluster"]] = min(worst.get(x["cluster"], x["balance_score"]), x["balance_score"])
    if not several_clusters:
        return min(worst.values(), default=None)
    return "; ".join(f"{c} {v:.2f}" for c, v in sorted(worst.items())) or None


def job(client, database: str, *, job_id: str, stall_s: float = 60.0, stretches_listed: int = 50) -> Report:
    if not job_id:
        raise ValueError("the job report needs a job id")
    stretches_listed = positive_int("stretches_listed (--stretches)", stretches_listed)
    db = quoted_database(database)
    p = {"job": str(job_id)}
    summary_rows = base.fetch(client, database, "jobs", job_id=str(job_id))
    if not summary_rows:
        raise ValueError(f"no job {job_id!r} in the warehouse")
    s = job_summary(summary_rows)
    hist = query(client, f"""
        SELECT util_bucket, sum(gpu_seconds) / 3600 AS gpu_hours FROM {db}.job_util_histogram
        WHERE job_id = {{job:String}} GROUP BY util_bucket ORDER BY util_bucket""", p)
    # an attempt is (cluster, job_id, attempt): the same id in two clusters is two jobs (Slurm numbers
    # jobs per cluster), so every per-attempt section is keyed and labelled by cluster too
    gpus = query(client, f"""
        SELECT toString(cluster) AS cluster, attempt, gpu, gpu_model, executing_gpu_seconds / 3600 AS executing_gpu_hours,
               idle_gpu_seconds / 3600 AS idle_gpu_hours, mean_util_pct AS util_pct
        FROM {db}.job_gpu_balance WHERE job_id = {{job:String}} ORDER BY cluster, attempt, gpu""", p)
    of_attempt = lambda rows, key: [x for x in rows if (x["cluster"], x["attempt"]) == key]  # noqa: E731
    attempts = sorted({(g["cluster"], g["attempt"]) for g in gpus})
    scores = [{"cluster": c, "attempt": a, "gpus": len(of_attempt(gpus, (c, a))),
               "balance_score": balance_score([g["util_pct"] for g in of_attempt(gpus, (c, a))])} for c, a in attempts]
    stretches = query(client, f"""
        SELECT toString(cluster) AS cluster, attempt, node, gpu_uuid, stretch_start, duration_seconds,
               idle_gpu_seconds, offset_ms
        FROM {db}.job_idle_stretches WHERE job_id = {{job:String}}
        ORDER BY cluster, attempt, stretch_start, gpu_uuid""", p)
    hints = []
    for c, a in attempts:
        own = of_attempt(stretches, (c, a))
        first = [x for x in own if x["offset_ms"] == 0 and x["duration_seconds"] >= stall_s]
        if first:
            longest = max(x["duration_seconds"] for x in first)
            hints.append({"cluster": c, "attempt": a, "hint": "loading stall",
                          "detail": f"{len(first)} GPU(s) idle for up to {longest:.0f} s after allocation "
                                    "(image pull / data loading before the first step)"})
        later = [x for x in own if x["offset_ms"] > 0 and x["duration_seconds"] >= stall_s]
        if later:
            hints.append({"cluster": c, "attempt": a, "hint": "mid-run stalls",
                          "detail": f"{len(later)} idle stretch(es) of >= {stall_s:.0f} s while running, "
                                    f"{sum(x['idle_gpu_seconds'] for x in later) / 60:.1f} GPU-minutes "
                                    "(checkpoints, input pipeline, hangs)"})
    for r in stragglers(client, database, job_id=str(job_id)):
        hints.append({"cluster": r["cluster"], "attempt": r["attempt"], "hint": "straggler",
                      "detail": f"{r['gpu']} at {r['util_pct']:.0f}% vs the attempt's median {r['median_pct']:.0f}%"})
    cost = query(client, f"""
        SELECT toString(cluster) AS cluster, attempt, any(outcome) AS outcome,
               sumIf(cost, line = 'compute') AS compute_cost, sumIf(cost, line = 'idle') AS idle_cost,
               sumIf(cost, line = 'failed_retry') AS failed_retry_cost, sum(cost) AS total_cost,
               sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours,
               arrayStringConcat(arraySort(groupUniqArray(toString(gpu_model))), ' ') AS gpu_models
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}}
        GROUP BY cluster, attempt ORDER BY cluster, attempt""", p)
    by_model = query(client, f"""
        SELECT gpu_model, sum(cost) AS cost, sum(gpu_hours) AS gpu_hours, sum(effective_gpu_hours) AS effective_gpu_hours
        FROM {db}.job_cost_by_attempt WHERE job_id = {{job:String}} GROUP BY gpu_model ORDER BY gpu_model""", p)
    executing = total(hist, "gpu_hours")
    low = sum(h["gpu_hours"] for h in hist if h["util_bucket"] < "30")
    report = Report("job", f"Job health report: {job_id}", f"{s['first_day']} .. {s['last_day']}", summary={
        **({"clusters": s["clusters"]} if "clusters" in s else {}),
        "tenant": s["tenant"], "queue": s["queue"], "attempts": s["attempts"], "failed_attempts": s["failed_attempts"],
        "last_outcome": s["last_outcome"], "gpu_hours": s["gpu_hours"], "idle_gpu_hours": s["idle_gpu_hours"],
        "cost": s["cost"], "low_util_share": low / executing if executing else None,
        "balance_score": _worst_balance(scores, several_clusters="clusters" in s),
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


