"""Capacity forecast (issue #15 point 3; docs/planning.md, "Capacity forecast").

Why one file: reading the demand history, fitting it and the forecast report share one series shape
(model, queue) -> day -> GPU-hours and the same constants; split, each part would import the others.

Demand is GPU-hours per day: allocated (usage records in executing or allocated_idle, each record id
once) plus pending (the scheduler snapshots' pending GPUs x the time to the queue's next snapshot, at
most SNAPSHOT_GAP_CAP_S). Allocated demand is known by GPU model and queue; pending demand only by queue
(the scheduler does not say which model a waiting job would get), so it is its own series under
gpu_model PENDING_MODEL. Capacity per GPU model is the median of its daily GPU time (every state) over
the last CAPACITY_DAYS complete days, a day without records counting 0, held flat: the fleet as it is,
no purchases. Only complete days count: those before the day of the usage horizon (max end_ms of
usage_raw), which is still being written. A day whose records the aggregates counted once each
(bills.exact_hourly_days) is read from usage_by_job_daily, any other from usage_raw FINAL.

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
import numbers
import statistics
import uuid
import warnings
from dataclasses import dataclass

from gpuledger.warehouse.client import quoted_database

HORIZON_DAYS = 91  # a quarter
ALPHA = 0.2  # 80 % band
SEASON = 7
CAPACITY_DAYS = 7  # capacity: the median of these last complete days (a one-day outage does not move it)
DEMAND_STATES = "('executing', 'allocated_idle')"
SNAPSHOT_GAP_CAP_S = 3600
PENDING_MODEL = "(pending: any model)"
MIN_DAYS = 4
#: a cluster whose usage horizon is this far behind the newest one stopped sending (decommissioned, or
#: its agents down): its days are all it will send, so it does not hold the others' history back
STOPPED_CLUSTER_MS = 2 * 86_400_000


@dataclass
class Fitted:
    method: str
    mean: list[float]
    lower: list[float]
    upper: list[float]


def check_options(horizon: int, alpha: float) -> None:
    """A horizon of at least one whole day and a band (1 - alpha) strictly between 0 and 1, or ValueError:
    anything else stores a broken run, or reads as "too short" once forecast_rows skips the series."""
    if isinstance(horizon, bool) or not isinstance(horizon, numbers.Integral) or horizon < 1:
        raise ValueError(f"the horizon (--horizon) is a whole number of days, at least 1, got {horizon!r}")
    if not 0 < alpha < 1:  # NaN too
        raise ValueError(f"the band (--band) is its coverage, between 0 and 1 (0.8 for 80 %), got {1 - alpha:g}")


def fit_forecast(values: list[float], horizon: int = HORIZON_DAYS, alpha: float = ALPHA) -> Fitted:
    """Forecast a daily series `horizon` days ahead with statsmodels' ETS and its (1 - alpha) band.
    Demand cannot be negative: the mean and band are cut at 0."""
    check_options(horizon, alpha)
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
    if isinstance(holdout, bool) or not isinstance(holdout, numbers.Integral) or holdout < 1:
        raise ValueError(f"the holdout (--holdout) is a whole number of days, at least 1, got {holdout!r}")
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


def usage_horizon_day(client, database: str) -> dt.date | None:
    """The first day not complete: the earliest of the clusters' horizon days. A cluster's usage horizon
    (max end_ms of its usage_raw, as bills close reads it per cluster) lies in the day it is still
    writing; a cluster whose sink is behind still writes an earlier day than the others, so the history
    ends before it for all — unless its horizon is STOPPED_CLUSTER_MS behind the newest: it stopped
    sending. A horizon at exactly midnight starts a day with no usage yet, so the day before is
    complete. Without usage, the latest scheduler snapshot's day; None without either."""
    db = quoted_database(database)
    horizons = f"SELECT h, max(h) OVER () AS newest FROM (SELECT max(end_ms) AS h FROM {db}.usage_raw GROUP BY cluster)"
    for sql in (f"SELECT count(), min(h) FROM ({horizons}) WHERE h >= newest - {STOPPED_CLUSTER_MS}",
                f"SELECT count(), max(ts_ms) FROM {db}.scheduler_snapshots"):
        n, horizon_ms = client.query(sql).result_rows[0]
        if n:
            return dt.date(1970, 1, 1) + dt.timedelta(days=int(horizon_ms) // 86_400_000)
    return None


def _counted_once(client, db: str, exact: dict[str, list[dt.date]]) -> dict[str, list[dt.date]]:
    """The days of `exact` (bills.exact_hourly_days: usage_by_job_hourly counted each record once) on which
    usage_by_job_daily counted as many records: it is read for them (the hourly table has no GPU model),
    and has its own view and back-fill, so a copy can reach one table and not the other."""
    from gpuledger.warehouse import bills as b

    cond, params = b.days_condition(exact, "e")
    if cond == "0":
        return {}
    hourly, daily = ({(r["cluster"], r["day"]): r["n"] for r in _query(
        client, f"SELECT toString(cluster) AS cluster, day, sum({n}) AS n FROM {db}.{table} WHERE {cond} "
                "GROUP BY cluster, day", params)}
        for table, n in (("usage_by_job_hourly", "records"), ("usage_by_job_daily", "slices")))
    out: dict[str, list[dt.date]] = {}
    for (cluster, day), n in sorted(hourly.items()):
        if n and daily.get((cluster, day)) == n:
            out.setdefault(cluster, []).append(day)
    return out


def _exact_days(client, db: str, days: dict[str, list[dt.date]]) -> dict[str, list[dt.date]]:
    """The days of `days` on which usage_by_job_hourly (bills.exact_hourly_days) and usage_by_job_daily
    (_counted_once) counted each usage record once. Open days are checked as the reports check them,
    trusting the hours a close run found exact; closed days, merged and many, in one count per cluster
    (checked_hours costs a query per day: 5 s for two years of days)."""
    from gpuledger.warehouse import bills as b

    open_days = b.days_by_cluster(client, b.open_days_sql(db))
    split: tuple[dict, dict] = ({}, {})  # open, closed
    for cluster, ds in days.items():
        is_open = set(open_days.get(cluster, ()))
        for day in ds:
            split[day not in is_open].setdefault(cluster, []).append(day)
    exact: dict[str, list[dt.date]] = {}
    for part, checked in zip(split, (True, False)):
        for cluster, ds in b.exact_hourly_days(client, db, part, checked_hours=checked).items():
            exact.setdefault(cluster, []).extend(ds)
    return _counted_once(client, db, {c: sorted(ds) for c, ds in exact.items()})


def demand_history(client, database: str, until: dt.date | None = None
                   ) -> tuple[dict[tuple[str, str], dict[dt.date, float]], dict[str, float]]:
    """({(gpu_model, queue): {day: demand GPU-hours}}, {gpu_model: capacity GPU-hours per day}) of the
    complete days, those before `until` (default usage_horizon_day), each usage record id once."""
    from gpuledger.warehouse import bills as b

    db = quoted_database(database)
    until = until or usage_horizon_day(client, database)
    if until is None:
        return {}, {}
    days = b.days_by_cluster(client, f"SELECT DISTINCT cluster, day FROM {db}.usage_capacity_daily "
                                     f"WHERE day < toDate('{until.isoformat()}')")
    # days each record was counted once on come from the daily aggregate, the rest deduplicated from usage_raw
    exact = _exact_days(client, db, days)
    raw = {c: sorted(set(ds) - set(exact.get(c, ()))) for c, ds in days.items()}
    exact_cond, exact_params = b.days_condition(exact, "x")
    raw_cond, raw_params = b.days_condition({c: ds for c, ds in raw.items() if ds}, "r")
    parts = [f"SELECT day, gpu_model, queue, state, toUInt64(gpu_ms) AS g FROM {db}.usage_by_job_daily "
             f"WHERE {exact_cond}"] if exact_cond != "0" else []
    if raw_cond != "0":  # planning a FINAL read costs even when it reads nothing
        parts.append(b.dedup_usage_sql(db, [raw_cond], "day, gpu_model, queue, state, gpu_ms AS g"))
    usage = _query(client, f"""
        SELECT day, toString(gpu_model) AS model, toString(queue) AS q, state IN {DEMAND_STATES} AS demand,
               sum(g) / 3600000 AS gpu_hours
        FROM ({' UNION ALL '.join(parts)}) GROUP BY day, model, q, demand""",
                   {**exact_params, **raw_params}) if parts else []
    series: dict[tuple[str, str], dict[dt.date, float]] = {}
    window = until - dt.timedelta(days=CAPACITY_DAYS)
    daily_capacity: dict[str, dict[dt.date, float]] = {}
    for r in usage:
        if r["demand"]:
            s = series.setdefault((r["model"], r["q"]), {})
            s[r["day"]] = s.get(r["day"], 0.0) + r["gpu_hours"]
        if r["day"] >= window:
            c = daily_capacity.setdefault(r["model"], {})
            c[r["day"]] = c.get(r["day"], 0.0) + r["gpu_hours"]
    for r in _query(client, f"""
            SELECT toDate(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS day, queue,
                   sum(pending_gpus * least(greatest(next_ms - ts_ms, 0), {SNAPSHOT_GAP_CAP_S * 1000})) / 3600000
                       AS gpu_hours
            FROM (SELECT ts_ms, toString(queue) AS queue, pending_gpus,
                         leadInFrame(ts_ms, 1, ts_ms) OVER (PARTITION BY cluster, queue ORDER BY ts_ms
                             ROWS BETWEEN CURRENT ROW AND 1 FOLLOWING) AS next_ms
                  FROM {db}.scheduler_snapshots)
            GROUP BY day, queue HAVING gpu_hours > 0 AND day < {{until:Date}}""", {"until": until}):
        series.setdefault((PENDING_MODEL, r["queue"]), {})[r["day"]] = r["gpu_hours"]
    # the median over the window, a day without records 0: a retired model fades out, one lost day does not count
    capacity = {m: statistics.median([by_day.get(window + dt.timedelta(days=i), 0.0) for i in range(CAPACITY_DAYS)])
                for m, by_day in daily_capacity.items()}
    return series, capacity


def _dense(by_day: dict[dt.date, float], first: dt.date, last: dt.date) -> list[float]:
    return [by_day.get(first + dt.timedelta(days=i), 0.0) for i in range((last - first).days + 1)]


def forecast_rows(series: dict[tuple[str, str], dict[dt.date, float]], capacity: dict[str, float], *,
                  horizon: int = HORIZON_DAYS, alpha: float = ALPHA, run_id: str | None = None,
                  created_at: dt.datetime | None = None, last: dt.date | None = None) -> list[dict]:
    """capacity_forecast rows: history and forecast of every (model, queue) series and every model's total.
    Days without a record count as 0 demand between the series' first day and `last` (default the data's
    last day; run_forecast gives the last complete one), the forecast starts the day after. From the
    series' own first day: a queue or model that came months after the data began had as many days of 0
    before it existed, which the fit took for demand that jumped from nothing: a queue at 100 GPU-hours a
    day since it came 10 days ago, 60 days into the data, had a 14th-day band of 38.5 .. 163.1 (a weekly
    season fitted to the zeros), now 100 .. 100, and its chart drew 50 days of 0. A model with capacity
    and no demand has 0 from the data's first day."""
    check_options(horizon, alpha)
    if not series:
        raise ValueError("no demand on complete days in the warehouse (usage_raw, scheduler_snapshots): "
                         "nothing to forecast")
    first = min(d for s in series.values() for d in s)
    last = last or max(d for s in series.values() for d in s)
    totals: dict[tuple[str, str], dict[dt.date, float]] = {}
    for (model, _queue), by_day in series.items():
        t = totals.setdefault((model, "*"), {})
        for d, v in by_day.items():
            t[d] = t.get(d, 0.0) + v
    for model, cap in capacity.items():  # a model nobody asked for (new, idle) is capacity all the same
        if cap > 0:
            totals.setdefault((model, "*"), {})
    run_id = run_id or uuid.uuid4().hex[:12]
    created_at = created_at or dt.datetime.now(dt.timezone.utc)
    rows = []
    for (model, queue), by_day in sorted({**series, **totals}.items()):
        start = min(by_day, default=first)
        values = _dense(by_day, start, last)
        cap = capacity.get(model, 0.0)
        base = {"run_id": run_id, "created_at": created_at, "gpu_model": model, "queue": queue,
                "capacity_gpu_hours": cap}
        try:
            f = fit_forecast(values, horizon, alpha)
        except ValueError:
            continue  # too short to forecast: left out of the run (docs/planning.md)
        for i, v in enumerate(values):
            rows.append({**base, "day": start + dt.timedelta(days=i), "kind": "history", "demand_gpu_hours": v,
                         "lower_gpu_hours": v, "upper_gpu_hours": v, "method": f.method})
        for i in range(horizon):
            rows.append({**base, "day": last + dt.timedelta(days=i + 1), "kind": "forecast",
                         "demand_gpu_hours": f.mean[i], "lower_gpu_hours": f.lower[i], "upper_gpu_hours": f.upper[i],
                         "method": f.method})
    return rows


def run_forecast(client, database: str, *, horizon: int = HORIZON_DAYS, alpha: float = ALPHA) -> dict:
    from gpuledger.warehouse.client import insert_rows

    check_options(horizon, alpha)  # before reading anything
    until = usage_horizon_day(client, database)
    series, capacity = demand_history(client, database, until)
    last = until - dt.timedelta(days=1) if until else None
    rows = forecast_rows(series, capacity, horizon=horizon, alpha=alpha, last=last)
    if not rows:  # every series has the same days: all too short (a new warehouse)
        first = min(d for s in series.values() for d in s)
        raise ValueError(f"a forecast needs at least {MIN_DAYS} complete days of history; the warehouse has "
                         f"{(last - first).days + 1} ({first} .. {last})")
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
        SELECT toMonday(d) AS week, uniqExactIf(d, k = 'history') AS history_days,
               uniqExactIf(d, k = 'forecast') AS forecast_days,
               -- none, not 0, in a week without such days (a line plot would drop to 0 there)
               if(history_days = 0, NULL, sumIf(dem, k = 'history')) AS history_gpu_hours,
               if(forecast_days = 0, NULL, sumIf(dem, k = 'forecast')) AS forecast_gpu_hours,
               if(forecast_days = 0, NULL, sumIf(lo, k = 'forecast')) AS lower_gpu_hours,
               if(forecast_days = 0, NULL, sumIf(hi, k = 'forecast')) AS upper_gpu_hours, sum(cap) AS capacity_gpu_hours
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
                "band (each model fitted on its own); capacity: the median of the daily GPU time in every state over "
                f"the last {CAPACITY_DAYS} complete days (a day without records counts 0), held flat"),
        Section("Weekly demand, all GPU models", weekly, "history, then forecast with its band, against capacity; "
                "UTC weeks from Monday: the first, the last and the one where history meets forecast may be partial "
                "(history_days, forecast_days say how many days each sum holds)",
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

        if not args.pods:
            raise SystemExit("usage: gpuledger forecast backtest --pods FILE (a v2023 pod list, "
                             "openb_pod_list_default.csv)")
        check_options(HORIZON_DAYS, 1 - args.band)  # the band, before the trace is read (--horizon is not used)
        series = trace_daily_demand(read_pods(args.pods))
        full = [q for q in series if q == "*" or not args.total_only]
        # the last day is cut by the trace's end: leave it out
        rows = [{"queue": q, **backtest(series[q][:-1], args.holdout, 1 - args.band)} for q in sorted(full)]
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
