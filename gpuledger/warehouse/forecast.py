"""Capacity forecast (issue #15 point 3; docs/planning.md, "Capacity forecast").

Demand is GPU-hours per day: allocated (usage records in executing or allocated_idle, from the
usage_by_job_daily aggregate) plus pending (the scheduler snapshots' pending GPUs x the time to the
queue's next snapshot, at most SNAPSHOT_GAP_CAP_S). Allocated demand is known by GPU model and queue;
pending demand only by queue (the scheduler does not say which model a waiting job would get), so it
is its own series under gpu_model PENDING_MODEL. Capacity per GPU model is the mean daily GPU time of
its cards (every state) over the last CAPACITY_DAYS days, held flat: the fleet as it is, no purchases.

Each series (a model and queue, and each model's total, queue '*', fitted on its own: bands do not add)
is fitted by statsmodels' ETSModel — additive errors, a damped additive trend, weekly seasonality where
there are four weeks of history — and forecast HORIZON_DAYS ahead with its prediction interval
(`get_prediction(...).summary_frame(alpha)`, 80 % by default). `gpuledger forecast run` stores history
and forecast in `capacity_forecast` (sql/0021); `gpuledger report forecast` and the cockpit chart read
the latest run. `backtest` holds out the last days of a series and reports MAE, MAPE and band coverage.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
import warnings
from dataclasses import dataclass

from gpuledger.warehouse.client import quoted_database

HORIZON_DAYS = 91  # a quarter
ALPHA = 0.2  # 80 % band
SEASON = 7
CAPACITY_DAYS = 30
SNAPSHOT_GAP_CAP_S = 3600
PENDING_MODEL = "(pending: any model)"
MIN_DAYS = 4


@dataclass
class Fitted:
    method: str
    mean: list[float]
    lower: list[float]
    upper: list[float]


def fit_forecast(values: list[float], horizon: int = HORIZON_DAYS, alpha: float = ALPHA) -> Fitted:
    """Forecast a daily series `horizon` days ahead with statsmodels' ETS and its (1 - alpha) band.
    Demand cannot be negative: the mean and band are cut at 0."""
    import numpy as np
    from statsmodels.tsa.exponential_smoothing.ets import ETSModel

    import pandas as pd

    y = pd.Series(np.asarray(values, dtype=float))  # an index: the prediction frame is labelled by it
    if len(y) < MIN_DAYS:
        raise ValueError(f"a forecast needs at least {MIN_DAYS} days of history, got {len(y)}")
    seasonal = len(y) >= 4 * SEASON
    trend = len(y) >= 10
    model = ETSModel(y, error="add", trend="add" if trend else None, damped_trend=trend,
                     seasonal="add" if seasonal else None, seasonal_periods=SEASON if seasonal else None)
    with warnings.catch_warnings():  # convergence chatter on flat or short series; the fit is still usable
        warnings.simplefilter("ignore")
        result = model.fit(disp=False)
        frame = result.get_prediction(start=len(y), end=len(y) + horizon - 1).summary_frame(alpha=alpha)
    name = f"ETS(A,{'Ad' if trend else 'N'},{'A' if seasonal else 'N'}{f',{SEASON}' if seasonal else ''}) {1 - alpha:.0%}"
    clip = lambda col: [max(0.0, float(v)) if math.isfinite(v) else 0.0 for v in frame[col]]  # noqa: E731
    return Fitted(name, clip("mean"), clip("pi_lower"), clip("pi_upper"))


def backtest(values: list[float], holdout: int = 30, alpha: float = ALPHA) -> dict:
    """Fit on all but the last `holdout` days, forecast them, compare: MAE, MAPE (days with demand),
    the share of actual days inside the band, and the error of the holdout's total."""
    if len(values) <= holdout + MIN_DAYS:
        raise ValueError(f"a backtest of {holdout} days needs more than {holdout + MIN_DAYS} days, got {len(values)}")
    train, actual = values[:-holdout], values[-holdout:]
    f = fit_forecast(train, holdout, alpha)
    errors = [abs(p - a) for p, a in zip(f.mean, actual)]
    pct = [abs(p - a) / a for p, a in zip(f.mean, actual) if a > 0]
    inside = sum(lo <= a <= hi for lo, a, hi in zip(f.lower, actual, f.upper))
    naive = sum(train[-SEASON:]) / len(train[-SEASON:])  # the baseline to beat: the last week's mean, held flat
    return {"method": f.method, "train_days": len(train), "holdout_days": holdout,
            "mae_gpu_hours": sum(errors) / holdout, "mape": sum(pct) / len(pct) if pct else None,
            "naive_mae_gpu_hours": sum(abs(naive - a) for a in actual) / holdout,
            "band_coverage": inside / holdout, "actual_total_gpu_hours": sum(actual),
            "forecast_total_gpu_hours": sum(f.mean),
            "total_error": (sum(f.mean) - sum(actual)) / sum(actual) if sum(actual) else None}


# --------------------------------------------------------------------------- warehouse
def _query(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


def demand_history(client, database: str) -> tuple[dict[tuple[str, str], dict[dt.date, float]], dict[str, float]]:
    """({(gpu_model, queue): {day: demand GPU-hours}}, {gpu_model: capacity GPU-hours per day})."""
    db = quoted_database(database)
    series: dict[tuple[str, str], dict[dt.date, float]] = {}
    for r in _query(client, f"""
            SELECT day, gpu_model, toString(queue) AS queue, sum(gpu_ms) / 3600000 AS gpu_hours
            FROM {db}.usage_by_job_daily WHERE state IN ('executing', 'allocated_idle')
            GROUP BY day, gpu_model, queue"""):
        series.setdefault((r["gpu_model"], r["queue"]), {})[r["day"]] = r["gpu_hours"]
    for r in _query(client, f"""
            SELECT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS day, queue,
                   sum(pending_gpus * least(greatest(next_ms - ts_ms, 0), {SNAPSHOT_GAP_CAP_S * 1000})) / 3600000
                       AS gpu_hours
            FROM (SELECT ts_ms, toString(queue) AS queue, pending_gpus,
                         leadInFrame(ts_ms, 1, ts_ms) OVER (PARTITION BY cluster, queue ORDER BY ts_ms
                             ROWS BETWEEN CURRENT ROW AND 1 FOLLOWING) AS next_ms
                  FROM {db}.scheduler_snapshots)
            GROUP BY day, queue HAVING gpu_hours > 0"""):
        series.setdefault((PENDING_MODEL, r["queue"]), {})[r["day"]] = r["gpu_hours"]
    capacity = {r["gpu_model"]: r["gpu_hours"] for r in _query(client, f"""
        SELECT gpu_model, sum(gpu_ms) / 3600000 / uniqExact(day) AS gpu_hours FROM {db}.usage_by_job_daily
        WHERE day > (SELECT max(day) FROM {db}.usage_by_job_daily) - {CAPACITY_DAYS}
        GROUP BY gpu_model""")}
    return series, capacity


def _dense(by_day: dict[dt.date, float], first: dt.date, last: dt.date) -> list[float]:
    return [by_day.get(first + dt.timedelta(days=i), 0.0) for i in range((last - first).days + 1)]


def forecast_rows(series: dict[tuple[str, str], dict[dt.date, float]], capacity: dict[str, float], *,
                  horizon: int = HORIZON_DAYS, alpha: float = ALPHA, run_id: str | None = None,
                  created_at: dt.datetime | None = None) -> list[dict]:
    """capacity_forecast rows: history and forecast of every (model, queue) series and every model's total.
    Days without a record count as 0 demand between the first and last day of all the data."""
    if not series:
        raise ValueError("no demand in the warehouse (usage_by_job_daily, scheduler_snapshots): nothing to forecast")
    first = min(d for s in series.values() for d in s)
    last = max(d for s in series.values() for d in s)
    totals: dict[tuple[str, str], dict[dt.date, float]] = {}
    for (model, _queue), by_day in series.items():
        t = totals.setdefault((model, "*"), {})
        for d, v in by_day.items():
            t[d] = t.get(d, 0.0) + v
    run_id = run_id or uuid.uuid4().hex[:12]
    created_at = created_at or dt.datetime.now(dt.timezone.utc)
    rows = []
    for (model, queue), by_day in sorted({**series, **totals}.items()):
        values = _dense(by_day, first, last)
        cap = capacity.get(model, 0.0)
        base = {"run_id": run_id, "created_at": created_at, "gpu_model": model, "queue": queue,
                "capacity_gpu_hours": cap}
        try:
            f = fit_forecast(values, horizon, alpha)
        except ValueError:
            continue  # too short to forecast: left out of the run (docs/planning.md)
        for i, v in enumerate(values):
            rows.append({**base, "day": first + dt.timedelta(days=i), "kind": "history", "demand_gpu_hours": v,
                         "lower_gpu_hours": v, "upper_gpu_hours": v, "method": f.method})
        for i in range(horizon):
            rows.append({**base, "day": last + dt.timedelta(days=i + 1), "kind": "forecast",
                         "demand_gpu_hours": f.mean[i], "lower_gpu_hours": f.lower[i], "upper_gpu_hours": f.upper[i],
                         "method": f.method})
    return rows


def run_forecast(client, database: str, *, horizon: int = HORIZON_DAYS, alpha: float = ALPHA) -> dict:
    from gpuledger.warehouse.client import insert_rows

    series, capacity = demand_history(client, database)
    rows = forecast_rows(series, capacity, horizon=horizon, alpha=alpha)
    if not rows:
        raise ValueError("every demand series is shorter than a forecast needs")
    insert_rows(client, "capacity_forecast", rows, database=database)
    return {"run_id": rows[0]["run_id"], "rows": len(rows), "series": len({(r["gpu_model"], r["queue"]) for r in rows})}


def quarter_summary(client, database: str) -> list[dict]:
    """Per GPU model (queue '*') in the latest run: next quarter's demand with its band against capacity."""
    db = quoted_database(database)
    return _query(client, f"""
        SELECT gpu_model, count() AS days, min(d) AS first_day, max(d) AS last_day,
               sum(dem) AS demand_gpu_hours, sum(lo) AS lower_gpu_hours, sum(hi) AS upper_gpu_hours,
               sum(cap) AS capacity_gpu_hours, sum(dem) / nullIf(sum(cap), 0) AS demand_to_capacity,
               countIf(hi > cap) AS days_upper_over_capacity, any(meth) AS method
        FROM (SELECT gpu_model, day AS d, demand_gpu_hours AS dem, lower_gpu_hours AS lo, upper_gpu_hours AS hi,
                     capacity_gpu_hours AS cap, method AS meth
              FROM {db}.capacity_forecast_latest WHERE kind = 'forecast' AND queue = '*')
        GROUP BY gpu_model ORDER BY gpu_model""")


def forecast_report(client, database: str, **_opts):
    """`gpuledger report forecast`: the latest stored run (gpuledger forecast run writes one)."""
    from gpuledger.warehouse.periodic.model import Plot, Report, Section

    db = quoted_database(database)
    summary = quarter_summary(client, database)
    if not summary:
        raise ValueError("no capacity forecast stored yet: run `gpuledger forecast run` first")
    weekly = _query(client, f"""
        SELECT toMonday(d) AS week, sumIf(dem, k = 'history') AS history_gpu_hours,
               sumIf(dem, k = 'forecast') AS forecast_gpu_hours, sumIf(lo, k = 'forecast') AS lower_gpu_hours,
               sumIf(hi, k = 'forecast') AS upper_gpu_hours, sum(cap) AS capacity_gpu_hours
        FROM (SELECT day AS d, kind AS k, demand_gpu_hours AS dem, lower_gpu_hours AS lo, upper_gpu_hours AS hi,
                     capacity_gpu_hours AS cap
              FROM {db}.capacity_forecast_latest WHERE queue = '*' AND gpu_model != {{p:String}})
        GROUP BY week ORDER BY week""", {"p": PENDING_MODEL})
    queues = _query(client, f"""
        SELECT gpu_model, queue, sum(dem) AS demand_gpu_hours, sum(lo) AS lower_gpu_hours, sum(hi) AS upper_gpu_hours,
               any(meth) AS method
        FROM (SELECT gpu_model, queue, demand_gpu_hours AS dem, lower_gpu_hours AS lo, upper_gpu_hours AS hi,
                     method AS meth
              FROM {db}.capacity_forecast_latest WHERE kind = 'forecast' AND queue != '*')
        GROUP BY gpu_model, queue ORDER BY demand_gpu_hours DESC""")
    run = summary[0]
    models = [s for s in summary if s["gpu_model"] != PENDING_MODEL]
    report = Report("forecast", "Capacity forecast, next quarter", f"{run['first_day']} .. {run['last_day']}", summary={
        "demand_gpu_hours": sum(s["demand_gpu_hours"] for s in models),
        "capacity_gpu_hours": sum(s["capacity_gpu_hours"] for s in models),
        "pending_gpu_hours": sum(s["demand_gpu_hours"] for s in summary if s["gpu_model"] == PENDING_MODEL),
        "method": run["method"],
    })
    report.sections = [
        Section("Demand against capacity per GPU model", summary, "sum over the quarter of the daily forecast and its "
                "band (each model fitted on its own); capacity: the last 30 days' mean, held flat"),
        Section("Weekly demand, all GPU models", weekly, "history, then forecast with its band, against capacity",
                Plot("line", "week", ["history_gpu_hours", "forecast_gpu_hours", "lower_gpu_hours", "upper_gpu_hours",
                                      "capacity_gpu_hours"])),
        Section("Demand per GPU model and queue", queues, "next quarter; pending demand has no GPU model"),
    ]
    return report


# --------------------------------------------------------------------------- the v2023 trace, directly
def trace_daily_demand(pods, days: int | None = None) -> dict[str, list[float]]:
    """Daily demand GPU-hours of a v2023 pod list computed from the pods themselves (no replay): per
    QoS (the replay's queue) and '*', allocated (scheduled .. deletion) plus pending (creation .. scheduled,
    or .. deletion for a pod never scheduled), num_gpu x gpu_milli / 1000 GPUs each."""
    from gpuledger.traces.v2023 import trace_end_s

    end_s = trace_end_s(pods)
    n = days or (end_s // 86400 + 1)
    out: dict[str, list[float]] = {}

    def add(queue: str, a: int, b: int, gpus: float) -> None:
        rows = out.setdefault(queue, [0.0] * n), out.setdefault("*", [0.0] * n)
        d = a // 86400
        while a < b and d < n:
            cut = min(b, (d + 1) * 86400)
            for row in rows:
                row[d] += gpus * (cut - a) / 3600
            a, d = cut, d + 1

    for p in pods:
        gpus = p.held_milli / 1000
        if gpus <= 0:
            continue
        waited_to = p.scheduled_s if p.scheduled_s is not None else p.deletion_s
        add(p.qos, p.creation_s, waited_to, gpus)
        if p.scheduled_s is not None:
            add(p.qos, p.scheduled_s, p.deletion_s, gpus)
    return out


# --------------------------------------------------------------------------- CLI
def cmd_forecast(args) -> int:
    import json

    from gpuledger.cli import settings_from_args
    from gpuledger.warehouse import connect
    from gpuledger.warehouse.report_text import render

    settings = settings_from_args(args)
    if args.action == "backtest":
        from gpuledger.traces.v2023 import read_pods

        series = trace_daily_demand(read_pods(args.pods))
        full = [q for q in series if q == "*" or not args.total_only]
        # the last day is cut by the trace's end: leave it out
        rows = [{"queue": q, **backtest(series[q][:-1], args.holdout)} for q in sorted(full)]
        print(json.dumps(rows, indent=2, default=str) if args.format == "json" else render(rows, "table"), end="")
        return 0
    client = connect(settings)
    try:
        result = run_forecast(client, settings.database, horizon=args.horizon, alpha=1 - args.band)
    finally:
        client.close()
    print(f"forecast run {result['run_id']}: {result['series']} series, {result['rows']} rows in capacity_forecast")
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("forecast", help="capacity forecast: fit and store next quarter's demand (run), or backtest "
                                        "on a v2023 pod list", description="capacity forecast (docs/planning.md)")
    p.set_defaults(func=cmd_forecast)
    p.add_argument("action", choices=["run", "backtest"])
    p.add_argument("--horizon", type=int, default=HORIZON_DAYS, help="days ahead (default: a quarter, 91)")
    p.add_argument("--band", type=float, default=1 - ALPHA, help="the band's coverage, 0..1 (default 0.8)")
    p.add_argument("--pods", help="backtest: a v2023 pod list (openb_pod_list_default.csv)")
    p.add_argument("--holdout", type=int, default=30, help="backtest: days held out at the end (default 30)")
    p.add_argument("--total-only", action="store_true", help="backtest: only the whole cluster's series")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
