"""The replays' JSON summaries, every figure computed by ClickHouse from the ledger's tables.
"""

from __future__ import annotations

from typing import Any
from gpuledger.traces.readers import CLUSTER_GENAI, CLUSTER_V2023, HOUR_MS, say
from gpuledger.traces.v2023 import PHASES
from gpuledger.streams.watchdefs import RULES




# =========================================================================== summaries (SQL)
def _scalar_rows(client, sql: str, params: dict) -> list[dict]:
    return list(client.query(sql, parameters=params).named_results())


def has_replay(client, cluster: str) -> bool:
    """Whether the warehouse holds a replay of `cluster` (every replay writes job attempts)."""
    return bool(client.query("SELECT count() FROM job_attempts WHERE cluster = {cluster:String}",
                             parameters={"cluster": cluster}).result_rows[0][0])


# A v2023 pod's phase as the warehouse tells it: completed / failed decide; no allocation =
# never scheduled (Pending, ended by `cancelled` at its deletion); allocated and cancelled =
# deleted while running, allocated without a terminal = still running (both Running).
_V2023_PODS = """
    SELECT job_id, queue, requested_gpus, allocated_gpus, queued_ms, allocated_ms, ended_ms,
           multiIf(outcome = 'completed', 'Succeeded', outcome = 'failed', 'Failed',
                   allocated_ms IS NULL, 'Pending', 'Running') AS phase
    FROM job_attempts
    WHERE cluster = {cluster:String} AND attempt = 0
"""
# GPU-hours held by each scheduled GPU pod: [allocated, terminal) or to the end of the observation
# (the last scheduler snapshot) for pods still running then.
_V2023_HELD = """
    SELECT queue, phase, allocated_gpus,
           allocated_gpus * (coalesce(ended_ms, (SELECT max(ts_ms) FROM scheduler_snapshots WHERE cluster = {cluster:String}))
                             - allocated_ms) / 3600000 AS gpu_hours
    FROM (""" + _V2023_PODS + """)
    WHERE allocated_ms IS NOT NULL AND allocated_gpus > 0
"""


def v2023_summary(client, cluster: str = CLUSTER_V2023) -> dict[str, Any]:
    """The v2023 summary, every figure computed by ClickHouse from the ledger's tables."""
    p = {"cluster": cluster}
    pods = _scalar_rows(client, f"""
        SELECT count() AS pods, countIf(requested_gpus > 0) AS gpu_pods, countIf(allocated_ms IS NULL) AS never_scheduled
        FROM ({_V2023_PODS})""", p)[0]
    phases = {r["phase"]: r["n"] for r in _scalar_rows(client, f"SELECT phase, count() AS n FROM ({_V2023_PODS}) GROUP BY phase", p)}
    delay = _scalar_rows(client, f"""
        SELECT count() AS n, quantilesExactInclusive(0.5, 0.9, 0.99)(d) AS q, avg(d) AS mean
        FROM (SELECT (allocated_ms - queued_ms) / 1000 AS d FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL)""", p)[0]
    held = _scalar_rows(client, f"SELECT sum(gpu_hours) AS h FROM ({_V2023_HELD})", p)[0]
    by_qos = _scalar_rows(client, f"SELECT queue, sum(gpu_hours) AS h FROM ({_V2023_HELD}) GROUP BY queue ORDER BY queue", p)
    by_phase = _scalar_rows(client, f"SELECT phase, sum(gpu_hours) AS h FROM ({_V2023_HELD}) GROUP BY phase ORDER BY phase", p)
    # Peak: +share at allocation, -share at the terminal event; sum per instant, then a running sum.
    peak = _scalar_rows(client, f"""
        SELECT max(held) AS peak_milli FROM (
            SELECT sum(d) OVER (ORDER BY t ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS held
            FROM (
                SELECT t, sum(d) AS d FROM (
                    SELECT allocated_ms AS t, toInt64(round(allocated_gpus * 1000)) AS d
                    FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL
                    UNION ALL
                    SELECT assumeNotNull(ended_ms) AS t, -toInt64(round(allocated_gpus * 1000)) AS d
                    FROM ({_V2023_PODS}) WHERE allocated_ms IS NOT NULL AND ended_ms IS NOT NULL
                ) GROUP BY t
            )
        )""", p)[0]
    spec = _scalar_rows(client, """
        SELECT count() AS gpu_pods, countIf(startsWith(reason, 'gpu_spec=')) AS with_spec
        FROM (SELECT job_id, reason FROM job_events
              WHERE cluster = {cluster:String} AND kind = 'submitted' AND requested_gpus > 0
              ORDER BY job_id, ts_ms LIMIT 1 BY job_id)""", p)[0]
    inventory = _scalar_rows(client, """
        SELECT count() AS nodes, countIf(gpu_count > 0) AS gpu_nodes, sum(gpu_count) AS gpus
        FROM node_inventory FINAL WHERE cluster = {cluster:String}""", p)[0]
    gpus = _scalar_rows(client, """
        SELECT uniqExact(node) AS gpu_nodes, uniqExact(gpu_uuid) AS gpus FROM usage_raw WHERE cluster = {cluster:String}""", p)[0]
    by_model = _scalar_rows(client, """
        SELECT gpu_model, uniqExact(gpu_uuid) AS gpus FROM usage_raw WHERE cluster = {cluster:String}
        GROUP BY gpu_model ORDER BY gpu_model""", p)
    if (inventory["gpu_nodes"], inventory["gpus"]) != (gpus["gpu_nodes"], gpus["gpus"]):
        say(f"[replay-trace] warning: node_inventory has {inventory['gpu_nodes']} GPU nodes / {inventory['gpus']} GPUs "
            f"but usage_raw {gpus['gpu_nodes']} / {gpus['gpus']}")
    total = float(held["h"] or 0.0)
    hours_by_phase = {r["phase"]: round(float(r["h"]), 3) for r in by_phase}
    failed = sum(float(r["h"]) for r in by_phase if r["phase"] == "Failed")
    q = list(delay["q"]) if delay["n"] else [None, None, None]
    return {
        "pods": int(pods["pods"]),
        "gpu_pods": int(pods["gpu_pods"]),
        "nodes": int(inventory["nodes"]),
        "gpu_nodes": int(gpus["gpu_nodes"]),
        "gpus_total": int(gpus["gpus"]),
        "gpus_by_model": {r["gpu_model"]: int(r["gpus"]) for r in by_model},
        "phases": {phase: int(phases.get(phase, 0)) for phase in PHASES},
        "never_scheduled": int(pods["never_scheduled"]),
        "sched_delay_s": {
            "n": int(delay["n"]),
            "p50": _round(q[0], 3), "p90": _round(q[1], 3), "p99": _round(q[2], 3),
            "mean": _round(delay["mean"] if delay["n"] else None, 3),
        },
        "allocated_gpu_hours": round(total, 3),
        "allocated_gpu_hours_by_qos": {r["queue"]: round(float(r["h"]), 3) for r in by_qos},
        "allocated_gpu_hours_by_phase": {phase: hours_by_phase.get(phase, 0.0) for phase in PHASES},
        "failed_share_of_gpu_hours": round(failed / total, 4) if total else 0.0,
        "peak_allocated_gpus": int(peak["peak_milli"] or 0) / 1000,
        "gpu_spec_share_of_gpu_pods": round(spec["with_spec"] / spec["gpu_pods"], 4) if spec["gpu_pods"] else 0.0,
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def genai_summary(client, cluster: str = CLUSTER_GENAI) -> dict[str, Any]:
    """The GenAI summary from usage_raw (every slice a pod's GPU was held, with its duty cycle)
    and job_attempts. Rows are de-duplicated by record_id (the sink delivers at least once)."""
    p = {"cluster": cluster}
    usage = "(SELECT * FROM usage_raw WHERE cluster = {cluster:String} ORDER BY record_id LIMIT 1 BY record_id)"
    held = "state IN ('executing', 'allocated_idle')"
    totals = _scalar_rows(client, f"""
        SELECT uniqExactIf(job_id, {held}) AS pods, uniqExact(gpu_uuid) AS gpus,
               (max(end_ms) - min(start_ms)) / 3600000 AS span_hours,
               sumIf(gpu_ms, {held}) AS held_ms,
               sumIf(gpu_ms, state = 'allocated_idle') AS ledger_idle_ms,
               sumIf(gpu_ms, {held} AND util_pct IS NOT NULL) AS measured_ms,
               sumIf(assumeNotNull(util_pct) * gpu_ms, {held} AND util_pct IS NOT NULL) AS util_weighted,
               sumIf(gpu_ms, {held} AND util_pct = 0) AS zero_ms,
               sumIf(gpu_ms, {held} AND mem_used_bytes IS NOT NULL) AS mem_ms,
               sumIf(toFloat64(assumeNotNull(mem_used_bytes)) * gpu_ms, {held} AND mem_used_bytes IS NOT NULL) AS mem_weighted
        FROM {usage}""", p)[0]
    per_pod = _scalar_rows(client, f"""
        SELECT count() AS pods, quantilesExactInclusive(0.1, 0.5, 0.9)(u) AS q, countIf(u < 20) AS under_20
        FROM (SELECT job_id, sum(assumeNotNull(util_pct) * gpu_ms) / sum(gpu_ms) AS u
              FROM {usage} WHERE {held} AND util_pct IS NOT NULL GROUP BY job_id HAVING sum(gpu_ms) > 0)""", p)[0]
    attempts = _scalar_rows(client, """
        SELECT count() AS attempts, countIf(outcome = 'completed') AS completed FROM job_attempts WHERE cluster = {cluster:String}""", p)[0]
    held_ms = int(totals["held_ms"] or 0)
    measured = int(totals["measured_ms"] or 0)
    q = list(per_pod["q"]) if per_pod["pods"] else [None, None, None]
    return {
        "pods": int(totals["pods"]),
        "gpus": int(totals["gpus"]),
        "attempts": int(attempts["attempts"]),
        "span_hours": _round(totals["span_hours"], 3),
        "allocated_gpu_hours": round(held_ms / HOUR_MS, 3),
        "hardware_utilization_pct": _round(totals["util_weighted"] / measured, 3) if measured else None,
        "zero_duty_share_of_allocated": round(int(totals["zero_ms"]) / held_ms, 4) if held_ms else None,
        "idle_allocation_gpu_hours": round(int(totals["zero_ms"]) / HOUR_MS, 3),
        "ledger_allocated_idle_gpu_hours": round(int(totals["ledger_idle_ms"]) / HOUR_MS, 3),
        "per_pod_utilization_pct": {"p10": _round(q[0], 3), "p50": _round(q[1], 3), "p90": _round(q[2], 3)},
        "pods_under_20pct_utilization": int(per_pod["under_20"]),
        "mem_used_gib_mean": _round(totals["mem_weighted"] / totals["mem_ms"] / 2**30, 3) if totals["mem_ms"] else None,
        **watch_summary(client, cluster),
    }


def watch_summary(client, cluster: str) -> dict[str, Any]:
    """What `gpuledger watch` raised on the replay (docs/alerts.md): per rule, how many alerts opened
    and on how many pods (jobs), and how many reclaim suggestions opened (latest status per id)."""
    p = {"cluster": cluster}
    by_rule = {r["rule"]: r for r in _scalar_rows(client, """
        SELECT rule, count() AS alerts, uniqExact(job_id) AS pods, countIf(status = 'open') AS still_open
        FROM alerts FINAL WHERE cluster = {cluster:String} GROUP BY rule""", p)}
    suggestions = _scalar_rows(client, """
        SELECT count() AS n FROM reclaim_suggestions FINAL WHERE cluster = {cluster:String}""", p)[0]
    return {
        "alerts_by_rule": {rule: {"alerts": int(by_rule[rule]["alerts"]) if rule in by_rule else 0,
                                  "pods": int(by_rule[rule]["pods"]) if rule in by_rule else 0,
                                  "still_open": int(by_rule[rule]["still_open"]) if rule in by_rule else 0}
                           for rule in RULES},
        "pods_with_alerts": int(_scalar_rows(client, """
            SELECT uniqExact(job_id) AS n FROM alerts FINAL WHERE cluster = {cluster:String}""", p)[0]["n"]),
        "reclaim_suggestions": int(suggestions["n"]),
    }
