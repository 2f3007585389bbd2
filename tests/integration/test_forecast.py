"""`gpuledger forecast run` and `gpuledger report forecast` on chDB: 42 days of usage (two queues on
A100s, capacity 4 cards) and scheduler snapshots with pending GPUs; the stored run holds history equal
to the usage, a quarter of forecast per series and per model with bands, and the report states it.
Then, each in its own database: the day still being written is left out, records written twice count
once, and capacity is the median of the last complete days (retired and new models, an outage)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import QueueState, SchedulerSnapshot, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, snapshot_rows, usage_rows
from gpuledger.warehouse import bills, forecast
from gpuledger.warehouse.client import quoted_database
from gpuledger.warehouse.periodic import commands as pr
from warehouse_helpers import put_usage

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_forecast"
D0 = dt.datetime(2026, 9, 1, tzinfo=dt.timezone.utc)
HOUR = 3_600_000
DAYS = 42


def day_ms(i: int) -> int:
    return int((D0 + dt.timedelta(days=i)).timestamp() * 1000)


def record(i: int, gpu: str, hours: float, state: str, queue: str = "", model: str = "A100-80GB",
           start_h: float = 0.0) -> UsageRecord:
    ms, start = round(hours * HOUR), day_ms(i) + round(start_h * HOUR)
    return UsageRecord(
        record_id=f"{gpu}/{i}/{state}", cluster="c", node="n1", gpu_uuid=gpu, gpu_model=model,
        start_ms=start, end_ms=start + ms, state=state, job_id=f"job-{queue}-{i}" if queue else "",
        attempt=0, tenant="t" if queue else "", queue=queue, share_milli=1000, gpu_ms=ms, util_pct=None,
        energy_j=0.0, coefficient=2.3, coefficient_version="v", effective_gpu_ms=round(2.3 * ms), cost_micros=0,
        definition_version="d")


def usage() -> list[UsageRecord]:
    out = []
    for i in range(DAYS):
        busy = 20.0 if i % 7 < 5 else 8.0  # weekdays busier
        out += [record(i, "g1", busy, "executing", "q1"), record(i, "g1", 24 - busy, "unallocated"),
                record(i, "g2", 12.0, "executing", "q2"), record(i, "g2", 12.0, "unallocated"),
                record(i, "g3", 24.0, "unallocated"), record(i, "g4", 24.0, "unallocated")]
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("forecast") / "chdb"
    c = warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))
    try:
        warehouse.migrate(c, DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n1", records=usage()), Source("u", 0, 0)),
                              database=DB)
        # q1 has 2 GPUs pending from 00:00 to 01:00 every day (snapshots at 00:00 and 01:00; 0 after)
        snaps = []
        for i in range(DAYS):
            for hour, pending in ((0, 2.0), (1, 0.0)):
                s = SchedulerSnapshot(cluster="c", ts_ms=day_ms(i) + hour * HOUR, queues=[QueueState(
                    queue="q1", priority=0, quota_gpus=4, allocated_gpus=1, pending_jobs=int(pending > 0),
                    pending_gpus=pending)])
                snaps += snapshot_rows(s, Source("s", 0, len(snaps)))["scheduler_snapshots"]
        warehouse.insert_rows(c, "scheduler_snapshots", snaps, database=DB)
        yield c
    finally:
        c.close()


def test_forecast_run_stores_history_forecast_and_bands(client):
    result = forecast.run_forecast(client, DB, horizon=91)
    rows = list(client.query(f"SELECT * FROM {DB}.capacity_forecast_latest").named_results())
    assert {r["run_id"] for r in rows} == {result["run_id"]}
    series = {(r["gpu_model"], r["queue"]) for r in rows}
    assert series == {("A100-80GB", "q1"), ("A100-80GB", "q2"), ("A100-80GB", "*"),
                      (forecast.PENDING_MODEL, "q1"), (forecast.PENDING_MODEL, "*")}
    hist = {(r["queue"], r["day"]): r["demand_gpu_hours"] for r in rows
            if r["kind"] == "history" and r["gpu_model"] == "A100-80GB"}
    assert hist[("q1", D0.date())] == pytest.approx(20.0)  # a Tuesday
    assert hist[("*", D0.date())] == pytest.approx(32.0)
    pending = [r for r in rows if r["gpu_model"] == forecast.PENDING_MODEL and r["kind"] == "history" and r["queue"] == "q1"]
    # 2 GPUs x 1 h a day (the last day's 01:00 snapshot has no successor: 0 after it)
    assert {round(r["demand_gpu_hours"], 6) for r in pending} == {2.0}
    fc = [r for r in rows if r["kind"] == "forecast" and r["queue"] == "*" and r["gpu_model"] == "A100-80GB"]
    assert len(fc) == 91 and fc[0]["day"] == (D0 + dt.timedelta(days=DAYS)).date()
    assert all(r["lower_gpu_hours"] <= r["demand_gpu_hours"] <= r["upper_gpu_hours"] for r in fc)
    # capacity: 4 cards x 24 h, held flat
    assert [r["capacity_gpu_hours"] for r in fc] == pytest.approx([96.0] * 91)
    assert fc[0]["method"].startswith("ETS(A,Ad,A,7)")
    # the weekly shape carries on: day 42 (42 % 7 = 0) is a busy day of the pattern, day 47 a quiet one
    assert fc[0]["demand_gpu_hours"] - fc[5]["demand_gpu_hours"] == pytest.approx(12.0, abs=2.0)


def test_report_forecast_reads_the_latest_run(client):
    forecast.run_forecast(client, DB, horizon=91)
    report = pr.build_report(client, DB, "forecast")
    models = {r["gpu_model"]: r for r in report.section("Demand against capacity per GPU model").rows}
    a100 = models["A100-80GB"]
    assert a100["days"] == 91 and a100["capacity_gpu_hours"] == pytest.approx(96.0 * 91)
    assert a100["lower_gpu_hours"] <= a100["demand_gpu_hours"] <= a100["upper_gpu_hours"]
    # demand ~28.6 GPU-hours a day (20 x 5 + 8 x 2 + 12 x 7) / 7 against 96: about 30 % of capacity
    assert a100["demand_to_capacity"] == pytest.approx((116 / 7 + 12) / 96, rel=0.25)
    assert report.summary["pending_gpu_hours"] == pytest.approx(models[forecast.PENDING_MODEL]["demand_gpu_hours"])
    html = pr.render_report(report, "html")
    assert "<svg" in html and "Capacity forecast" in html
    # UTC weeks from Monday: history starts on a Tuesday (6 days in its first week) and ends on a Monday, whose
    # week is 1 day of history and 6 of forecast; a week's sums were shown without saying it was partial
    weeks = {r["week"]: r for r in report.section("Weekly demand, all GPU models").rows}
    assert [(weeks[w]["history_days"], weeks[w]["forecast_days"]) for w in (dt.date(2026, 8, 31), dt.date(2026, 9, 7),
                                                                          dt.date(2026, 10, 12))] == [(6, 0), (7, 0), (1, 6)]
    assert weeks[dt.date(2026, 10, 12)]["history_gpu_hours"] == pytest.approx(20.0)  # day 41 alone (8 + 12)
    assert "partial" in report.section("Weekly demand, all GPU models").note
    # a week without forecast days has no forecast (not 0) and the other way round: the chart's lines
    # broke to 0 there (the history line under the forecast, the band under the history)
    history_week, forecast_week = weeks[dt.date(2026, 9, 7)], max(weeks.values(), key=lambda r: r["week"])
    assert [history_week[k] for k in ("forecast_gpu_hours", "lower_gpu_hours", "upper_gpu_hours")] == [None] * 3
    assert forecast_week["history_gpu_hours"] is None and forecast_week["forecast_gpu_hours"] > 0


# --------------------------------------------------------------------------- complete days, each record once
def cards(days, gpus, model: str = "A100-80GB", until_h: float = 24.0) -> list[UsageRecord]:
    """Each card of `gpus` on each day of `days` from midnight to `until_h`: half executing for q1, then
    unallocated (a whole day: 12 + 12 h, ending at the next midnight)."""
    return [r for i in days for g in gpus for r in (
        record(i, g, until_h / 2, "executing", "q1", model), record(i, g, until_h / 2, "unallocated", "", model,
                                                                   until_h / 2))]


def fresh(client, name: str) -> str:
    """A new migrated database on the module's engine (one chDB directory per process)."""
    warehouse.migrate(client, name)
    return name


def latest(client, db: str, model: str = "A100-80GB", queue: str = "*") -> dict[str, list[dict]]:
    rows = list(client.query(f"SELECT * FROM {db}.capacity_forecast_latest WHERE gpu_model = {{m:String}} "
                             "AND queue = {q:String} ORDER BY day", parameters={"m": model, "q": queue}).named_results())
    return {k: [r for r in rows if r["kind"] == k] for k in ("history", "forecast")}


A100S = ("g1", "g2", "g3", "g4")


def test_the_day_still_being_written_is_left_out(client):
    db = fresh(client, "ledger_forecast_open_day")
    put_usage(client, db, cards(range(14), A100S), 0)  # the horizon: exactly midnight of day 14
    snaps = [row for i in range(15) for hour, pending in ((0, 2.0), (1, 0.0)) for row in snapshot_rows(
        SchedulerSnapshot(cluster="c", ts_ms=day_ms(i) + hour * HOUR, queues=[QueueState(
            queue="q1", priority=0, quota_gpus=4, allocated_gpus=1, pending_jobs=1, pending_gpus=pending)]),
        Source("s", 0, i * 2 + hour))["scheduler_snapshots"]]
    warehouse.insert_rows(client, "scheduler_snapshots", snaps, database=db)
    day = lambda i: (D0 + dt.timedelta(days=i)).date()  # noqa: E731
    for step in ("midnight", "06:00"):
        if step == "06:00":  # today's records so far: 4 cards x 6 h, half executing
            put_usage(client, db, cards([14], A100S, until_h=6.0), 1)
        forecast.run_forecast(client, db, horizon=28)
        run = latest(client, db)
        # day 13 is complete (the midnight horizon starts day 14); day 14 is not, in demand nor capacity
        assert [r["day"] for r in run["history"]] == [day(i) for i in range(14)], step
        assert {r["demand_gpu_hours"] for r in run["history"]} == {48.0}, step
        assert run["forecast"][0]["day"] == day(14) and run["forecast"][0]["capacity_gpu_hours"] == 96.0, step
        assert sum(r["demand_gpu_hours"] for r in run["forecast"]) == pytest.approx(48.0 * 28, rel=0.02), step
        pending = latest(client, db, forecast.PENDING_MODEL, "q1")["history"]
        assert [(r["day"], r["demand_gpu_hours"]) for r in pending] == [(day(i), 2.0) for i in range(14)], step


def test_records_written_twice_count_once(client):
    db = fresh(client, "ledger_forecast_twice")
    put_usage(client, db, cards(range(14), A100S), 0)
    # a close run notes the open days' exact hours (the reports' and the forecast's shortcut), then the last
    # week is written again in another block (a replay), and day 3 reaches usage_by_job_daily twice only
    # (as a copy merged away in usage_raw before sql/0027's back-fill would)
    bills.record_exact_hours(client, db, {"c": [(D0 + dt.timedelta(days=i)).date() for i in range(14)]})
    put_usage(client, db, cards(range(7, 14), A100S), 1)
    client.command(f"INSERT INTO {db}.usage_by_job_daily SELECT * FROM {db}.usage_by_job_daily "
                   f"WHERE day = toDate('{(D0 + dt.timedelta(days=3)).date()}')")
    series, capacity = forecast.demand_history(client, db)
    assert series[("A100-80GB", "q1")] == {(D0 + dt.timedelta(days=i)).date(): 48.0 for i in range(14)}
    assert capacity == {"A100-80GB": 96.0}
    # the days counted once are read from the daily aggregate, only the others from usage_raw
    days = {"c": [(D0 + dt.timedelta(days=i)).date() for i in range(14)]}
    assert forecast._exact_days(client, quoted_database(db), days) == {"c": [days["c"][i] for i in (0, 1, 2, 4, 5, 6)]}
    forecast.run_forecast(client, db, horizon=28)
    assert sum(r["demand_gpu_hours"] for r in latest(client, db)["forecast"]) == pytest.approx(48.0 * 28, rel=0.02)


def test_capacity_is_the_median_of_the_last_complete_days(client):
    db = fresh(client, "ledger_forecast_capacity")
    put_usage(client, db, [
        *cards(range(14), A100S),  # the window: days 7..13 (day 14 is the horizon's)
        *cards(range(10), ("h1", "h2"), "H100"),  # retired 4 days ago: 4 of 7 days without records
        *cards(range(11), ("v1", "v2"), "V100"),  # retired 3 days ago
        *cards(range(10, 14), ("l1", "l2"), "L40S"),  # added 4 days ago
        *cards(range(11, 14), ("t1", "t2"), "T4"),  # added 3 days ago
        *cards([i for i in range(14) if i != 12], ("a1",), "A10"),  # its agent lost day 12
    ], 0)
    _series, capacity = forecast.demand_history(client, db)
    got = {m: capacity.get(m, 0.0) for m in ("A100-80GB", "H100", "V100", "L40S", "T4", "A10")}
    assert got == {"A100-80GB": 96.0, "H100": 0.0, "V100": 48.0, "L40S": 48.0, "T4": 0.0, "A10": 24.0}
    forecast.run_forecast(client, db, horizon=28)
    assert {r["capacity_gpu_hours"] for r in latest(client, db, "H100")["forecast"]} == {0.0}
    note = pr.build_report(client, db, "forecast").section("Demand against capacity per GPU model").note
    assert f"median of the daily GPU time in every state over the last {forecast.CAPACITY_DAYS} complete days" in note


def test_a_cluster_still_writing_an_earlier_day_ends_the_history_for_all(client):
    db = fresh(client, "ledger_forecast_cluster_horizons")
    day = lambda i: (D0 + dt.timedelta(days=i)).date()  # noqa: E731
    # cluster c is written up to day 14 06:00; cluster b's sink is behind: day 13 to 06:00 so far
    put_usage(client, db, cards(range(14), A100S) + cards([14], A100S, until_h=6.0), 0)
    b = cards(range(13), ("b1", "b2", "b3", "b4")) + cards([13], ("b1", "b2", "b3", "b4"), until_h=6.0)
    put_usage(client, db, [r.model_copy(update={"cluster": "b", "record_id": "b/" + r.record_id}) for r in b], 1)
    # one horizon for the warehouse (day 14) counted b's day 13 as complete: 48 + 12 = 60 GPU-hours
    assert forecast.usage_horizon_day(client, db) == day(13)
    series, capacity = forecast.demand_history(client, db)
    assert series[("A100-80GB", "q1")] == {day(i): 96.0 for i in range(13)}
    assert capacity == {"A100-80GB": 192.0}
    forecast.run_forecast(client, db, horizon=28)
    run = latest(client, db)
    assert run["history"][-1]["day"] == day(12) and run["forecast"][0]["day"] == day(13)
    # a cluster that stopped sending three days ago (its horizon day 11 06:00) holds no one back
    gone = [r.model_copy(update={"cluster": "gone", "record_id": "gone/" + r.record_id})
            for r in cards(range(11), ("g1",)) + cards([11], ("g1",), until_h=6.0)]
    put_usage(client, db, gone, 2)
    assert forecast.usage_horizon_day(client, db) == day(13)


def test_a_model_without_demand_still_shows_its_capacity(client):
    db = fresh(client, "ledger_forecast_idle_model")
    # the A100s' demand as before; two H100s installed and never allocated (unallocated all 14 days)
    idle = [record(i, g, 24.0, "unallocated", model="H100") for i in range(14) for g in ("h1", "h2")]
    put_usage(client, db, cards(range(14), A100S) + idle, 0)
    _series, capacity = forecast.demand_history(client, db)
    assert capacity == {"A100-80GB": 96.0, "H100": 48.0}
    forecast.run_forecast(client, db, horizon=28)
    # the H100s were left out of the run: the report's capacity was the A100s' 2,688 GPU-hours alone
    h100 = latest(client, db, "H100")
    assert [r["demand_gpu_hours"] for r in h100["history"]] == [0.0] * 14
    assert [(r["demand_gpu_hours"], r["capacity_gpu_hours"]) for r in h100["forecast"]] == [(0.0, 48.0)] * 28
    report = pr.build_report(client, db, "forecast")
    models = {r["gpu_model"]: r for r in report.section("Demand against capacity per GPU model").rows}
    assert models["H100"]["capacity_gpu_hours"] == pytest.approx(48.0 * 28)
    assert report.summary["capacity_gpu_hours"] == pytest.approx((96.0 + 48.0) * 28)
    # no queue of its own: a model without demand is its total alone
    assert not list(client.query(f"SELECT 1 FROM {db}.capacity_forecast_latest WHERE gpu_model = 'H100' "
                                 "AND queue != '*'").result_rows)


def test_too_short_a_history_is_refused_saying_how_long_it_is(client):
    db = fresh(client, "ledger_forecast_short")
    put_usage(client, db, cards(range(3), A100S) + cards([3], A100S, until_h=6.0), 0)  # day 3 still being written
    # it said "every demand series is shorter than a forecast needs", and not how long that is
    with pytest.raises(ValueError, match=r"a forecast needs at least 4 complete days of history; the warehouse "
                                         r"has 3 \(2026-09-01 \.\. 2026-09-03\)"):
        forecast.run_forecast(client, db, horizon=28)
