"""Training signals in the job health report (docs/planning.md, "Training signals").

The views of sql/0021 (keyed by cluster since sql/0042) join a job's progress reports (line 4) to its
usage and lifecycle events; this module reads them for one job id, a row per cluster it ran in, and turns
them into report sections. The judgement ("busy but not
productive", "rank spread") is pure (`busy_not_productive`, `rank_spread`) and tested on plain rows.
"""

from __future__ import annotations

from gpuledger.warehouse.client import quoted_database

#: "busy": the GPUs' utilization in the last window at least this (percent)
BUSY_UTIL_PCT = 50.0
#: "not productive": the last window's step rate below this share of the best window's
PRODUCTIVE_SHARE = 0.7
#: rank spread worth a hint: (slowest - fastest) / fastest mean step time
RANK_SPREAD_HINT = 0.2


def busy_not_productive(windows: list[dict]) -> dict | None:
    """Compare the last 10-minute window of an attempt with its best one. `windows`: rows of
    job_progress_windows for one attempt, in time order (steps_per_s, util_pct). A finding when the
    last window's rate is below PRODUCTIVE_SHARE of the best while utilization stays at or above
    BUSY_UTIL_PCT; None otherwise (or with fewer than two windows)."""
    rated = [w for w in windows if w.get("steps_per_s") is not None]
    if len(rated) < 2:
        return None
    best, last = max(rated, key=lambda w: w["steps_per_s"]), rated[-1]
    if best["steps_per_s"] <= 0:
        return None
    share = last["steps_per_s"] / best["steps_per_s"]
    util = last.get("util_pct")
    if share < PRODUCTIVE_SHARE and util is not None and util >= BUSY_UTIL_PCT:
        return {"best_steps_per_s": best["steps_per_s"], "last_steps_per_s": last["steps_per_s"],
                "rate_share": share, "util_pct": util, "best_window": best["window_start"],
                "last_window": last["window_start"]}
    return None


def rank_spread(ranks: list[dict]) -> dict | None:
    """Spread of the ranks' mean step times of one attempt: (slowest - fastest) / fastest, with the
    slowest rank. `ranks`: rows of job_rank_step_times (rank, mean_step_time_ms). None under two ranks."""
    if len(ranks) < 2:
        return None
    slow = max(ranks, key=lambda r: (r["mean_step_time_ms"], r["rank"]))
    fast = min(ranks, key=lambda r: (r["mean_step_time_ms"], r["rank"]))
    return {"slowest_rank": slow["rank"], "slowest_step_time_ms": slow["mean_step_time_ms"],
            "fastest_rank": fast["rank"], "fastest_step_time_ms": fast["mean_step_time_ms"],
            "spread": (slow["mean_step_time_ms"] - fast["mean_step_time_ms"]) / fast["mean_step_time_ms"]}


def _query(client, sql: str, params: dict) -> list[dict]:
    return list(client.query(sql, parameters=params).named_results())


def training_sections(client, database: str, job_id: str) -> tuple[dict, list]:
    """(summary entries, report sections) of a job's training signals; nothing when it reported no progress."""
    from gpuledger.warehouse.periodic.model import Plot, Section

    db = quoted_database(database)
    p = {"job": str(job_id)}
    # Slurm numbers jobs per cluster: a job id of two clusters is two jobs, each with its own rows (sql/0042)
    signals = _query(client, f"""
        SELECT cluster, attempt, reports, steps, tokens, span_seconds, span_gpu_hours, span_cost, cost_per_step,
               cost_per_million_tokens, last_loss, checkpoints, checkpoint_seconds,
               checkpoint_seconds / nullIf(span_seconds, 0) AS checkpoint_share, last_ms
        FROM {db}.job_training_signals WHERE job_id = {{job:String}} ORDER BY cluster, attempt""", p)
    if not signals:
        return {}, []
    windows = _query(client, f"""
        SELECT cluster, attempt, window_start, steps, seconds, steps_per_s, tokens_per_s, util_pct
        FROM {db}.job_progress_windows WHERE job_id = {{job:String}} ORDER BY cluster, attempt, window_start""", p)
    ranks = _query(client, f"""
        SELECT cluster, attempt, rank, mean_step_time_ms, reports FROM {db}.job_rank_step_times
        WHERE job_id = {{job:String}} ORDER BY cluster, attempt, rank""", p)
    hints, spreads = [], []
    for s in signals:
        key = (s["cluster"], s["attempt"])
        where = {"cluster": s["cluster"], "attempt": s["attempt"]}
        found = busy_not_productive([w for w in windows if (w["cluster"], w["attempt"]) == key])
        if found:
            hints.append({**where, "hint": "busy but not productive",
                          "detail": f"{found['last_steps_per_s']:.3g} steps/s in the last window vs "
                                    f"{found['best_steps_per_s']:.3g} at best ({found['rate_share']:.0%}) while the "
                                    f"GPUs stay {found['util_pct']:.0f}% busy"})
        spread = rank_spread([r for r in ranks if (r["cluster"], r["attempt"]) == key])
        if spread:
            spreads.append({**where, **spread})
            if spread["spread"] >= RANK_SPREAD_HINT:
                hints.append({**where, "hint": "slow rank",
                              "detail": f"rank {spread['slowest_rank']} takes {spread['slowest_step_time_ms']:.0f} ms "
                                        f"per step, {spread['spread']:.0%} more than rank {spread['fastest_rank']}"})
        if s["checkpoint_share"] and s["checkpoint_share"] >= 0.1:
            hints.append({**where, "hint": "checkpoint time",
                          "detail": f"{s['checkpoint_seconds'] / 60:.1f} min in {s['checkpoints']} checkpoint(s), "
                                    f"{s['checkpoint_share']:.0%} of the reported span"})
    # the summary's figures: the attempt that reported last (of any cluster the job id ran in)
    last = max(signals, key=lambda s: (s["last_ms"], s["attempt"]))
    for s in signals:
        del s["last_ms"]
    summary = {"cost_per_step": last["cost_per_step"], "cost_per_million_tokens": last["cost_per_million_tokens"],
               "checkpoint_share": last["checkpoint_share"]}
    sections = [
        Section("Training signals", signals, "per cluster and attempt, between its first and last progress report: "
                "cost of its GPU time over that span per step and per million tokens; time in checkpoints"),
        Section("Step rate per window", windows, "10-minute windows: steps per second beside the GPUs' "
                "utilization (busy vs productive)", Plot("line", "window_start", ["steps_per_s"])),
        Section("Rank step-time spread", spreads, "(slowest - fastest) / fastest mean step time per attempt"),
        Section("Training hints", hints, f"busy but not productive: last window under {PRODUCTIVE_SHARE:.0%} of the "
                f"best with utilization >= {BUSY_UTIL_PCT:.0f}%; slow rank: spread >= {RANK_SPREAD_HINT:.0%}"),
    ]
    return summary, sections
