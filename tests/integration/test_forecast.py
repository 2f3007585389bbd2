"""`gpuledger forecast run` and `gpuledger report forecast` on chDB: 42 days of usage (two queues on
A100s, capacity 4 cards) and scheduler snapshots with pending GPUs; the stored run holds history equal
to the usage, a quarter of forecast per series and per model with bands, and the report states it."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import QueueState, SchedulerSnapshot, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, snapshot_rows, usage_rows
from gpuledger.warehouse import forecast
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_forecast"
D0 = dt.datetime(2026, 9, 1, tzinfo=dt.timezone.utc)
HOUR = 3_600_000
DAYS = 42


def day_ms(i: int) -> int:
    return int((D0 + dt.timedelta(days=i)).timestamp() * 1000)


def record(i: int, gpu: str, hours: float, state: str, queue: str = "") -> UsageRecord:
    ms = round(hours * HOUR)
    return UsageRecord(
        record_id=f"{gpu}/{i}/{state}", cluster="c", node="n1", gpu_uuid=gpu, gpu_model="A100-80GB",
        start_ms=day_ms(i), end_ms=day_ms(i) + ms, state=state, job_id=f"job-{queue}-{i}" if queue else "",
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
