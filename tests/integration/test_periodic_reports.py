"""Periodic reports (inventory, monthly, weekly, job health) on a small chDB filled by hand: numbers
agree with the ledger's own reports (gpuledger.reports.fetch), hints fire where the data says so,
the period's data coverage is stated, and the three renderings hold what they should (HTML
self-contained, with SVG plots). The renderings' rules on hand-made reports: tests/unit/test_periodic_rendering.py."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from gpuledger.warehouse.periodic import commands as pr
from gpuledger import warehouse
from gpuledger.warehouse import reports
from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, job_event_row, usage_rows

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_periodic"
T0 = int(dt.datetime(2026, 11, 2, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
GPUS = {"gpu-A": ("n1", "A100-80GB"), "gpu-B": ("n1", "A100-80GB"), "gpu-C": ("n2", "T4")}


def rec(gpu, m0, m1, state, job="", attempt=0, util=None, tenant="", queue="", cost_per_min=1000):
    node, model = GPUS[gpu]
    ms = (m1 - m0) * MIN
    return UsageRecord(
        record_id=f"{gpu}/{m0}/{job}", cluster="c", node=node, gpu_uuid=gpu, gpu_model=model,
        start_ms=T0 + m0 * MIN, end_ms=T0 + m1 * MIN, state=state, job_id=job, attempt=attempt,
        tenant=tenant if job else "", queue=queue if job else "", share_milli=1000, gpu_ms=ms, util_pct=util,
        energy_j=0.0, coefficient=2.0, coefficient_version="v1", effective_gpu_ms=2 * ms,
        cost_micros=(m1 - m0) * cost_per_min, definition_version="d1")


def ev(n, minute, kind, job, attempt=0, gpus=(), tenant="t1", queue="q1", requested=2.0):
    return JobEvent(
        event_id=f"e{n}", ts_ms=T0 + minute * MIN, kind=kind, cluster="c", job_id=job, attempt=attempt,
        tenant=tenant, queue=queue, priority=0, requested_gpus=requested,
        gpus=[{"node": GPUS[g][0], "gpu_uuid": g, "share_milli": 1000} for g in gpus])


J1 = dict(job="job-1", tenant="t1", queue="q1")
J2 = dict(job="job-2", tenant="t2", queue="q2")
USAGE = [
    # job-1 attempt 0 on gpu-A and gpu-B: 5 min loading, 20 min running, then it fails
    rec("gpu-A", 0, 5, "allocated_idle", **J1), rec("gpu-B", 0, 5, "allocated_idle", **J1),
    rec("gpu-A", 5, 25, "executing", util=90.0, **J1), rec("gpu-B", 5, 25, "executing", util=30.0, **J1),
    # attempt 1 on the same GPUs: 3 min loading, 30 min balanced running
    rec("gpu-A", 30, 33, "allocated_idle", attempt=1, **J1), rec("gpu-B", 30, 33, "allocated_idle", attempt=1, **J1),
    rec("gpu-A", 33, 63, "executing", attempt=1, util=80.0, **J1),
    rec("gpu-B", 33, 63, "executing", attempt=1, util=80.0, **J1),
    rec("gpu-A", 25, 30, "unallocated"), rec("gpu-B", 25, 30, "unallocated"),
    # job-2 on gpu-C: 10 min, low utilization; gpu-C then down for 20 min
    rec("gpu-C", 0, 10, "executing", util=10.0, **J2), rec("gpu-C", 10, 30, "down"),
    rec("gpu-C", 30, 63, "unallocated"),
]
EVENTS = [
    ev(1, 0, "submitted", "job-1"), ev(2, 0, "allocated", "job-1", gpus=("gpu-A", "gpu-B")),
    ev(3, 5, "started", "job-1", gpus=("gpu-A", "gpu-B")), ev(4, 25, "failed", "job-1", gpus=("gpu-A", "gpu-B")),
    ev(5, 28, "retried", "job-1", attempt=1), ev(6, 30, "allocated", "job-1", attempt=1, gpus=("gpu-A", "gpu-B")),
    ev(7, 33, "started", "job-1", attempt=1, gpus=("gpu-A", "gpu-B")),
    ev(8, 63, "completed", "job-1", attempt=1, gpus=("gpu-A", "gpu-B")),
    ev(9, 0, "submitted", "job-2", tenant="t2", queue="q2", requested=1.0),
    ev(10, 0, "allocated", "job-2", gpus=("gpu-C",), tenant="t2", queue="q2", requested=1.0),
    ev(11, 0, "started", "job-2", gpus=("gpu-C",), tenant="t2", queue="q2", requested=1.0),
    ev(12, 10, "completed", "job-2", gpus=("gpu-C",), tenant="t2", queue="q2", requested=1.0),
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("periodic") / "chdb"
    c = warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))
    try:
        warehouse.migrate(c, DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=USAGE), Source("u", 0, 0)),
                              database=DB)
        warehouse.insert_rows(c, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(EVENTS)],
                              database=DB)
        yield c
    finally:
        c.close()  # one chDB directory per process


def test_job_report_cost_balance_and_hints(client):
    r = pr.build_report(client, DB, "job", job_id="job-1")
    job = reports.fetch(client, DB, "jobs", job_id="job-1")[0]
    cost = r.section("Cost by attempt").rows
    assert [c["attempt"] for c in cost] == [0, 1]
    assert sum(c["total_cost"] for c in cost) == pytest.approx(job["cost"])
    # attempt 0 failed: its executing time is the failed-retry line, loading is idle
    assert cost[0]["failed_retry_cost"] == pytest.approx(2 * 20 * 1000 / 1e6)
    assert cost[0]["idle_cost"] == pytest.approx(2 * 5 * 1000 / 1e6)
    assert cost[1]["compute_cost"] == pytest.approx(2 * 30 * 1000 / 1e6)
    scores = {s["attempt"]: s["balance_score"] for s in r.section("Balance score per attempt").rows}
    assert scores[0] == pytest.approx((90 + 30) / 2 / 90)
    assert scores[1] == pytest.approx(1.0)
    hints = r.section("Hints").rows
    assert {(h["attempt"], h["hint"]) for h in hints} >= {(0, "loading stall"), (1, "loading stall"), (0, "straggler")}
    assert [h["detail"][:5] for h in hints if h["hint"] == "straggler"] == ["n1/B "]
    hist = {h["util_bucket"]: h["gpu_hours"] for h in r.section("Utilization distribution").rows}
    assert hist == pytest.approx({"30-40%": 20 / 60, "80-90%": 60 / 60, "90-100%": 20 / 60})
    # idle stretches: the longest listed (--stretches), the rest counted and summed in one row
    stretches = r.section("Idle stretches").rows
    assert len(stretches) > 1
    one = pr.build_report(client, DB, "job", job_id="job-1", stretches_listed=1).section("Idle stretches").rows
    assert len(one) == 2 and one[0] == max(stretches, key=lambda x: x["idle_gpu_seconds"])
    assert one[1]["gpu_uuid"] == f"{len(stretches) - 1} more"
    assert one[0]["idle_gpu_seconds"] + one[1]["idle_gpu_seconds"] == pytest.approx(
        sum(x["idle_gpu_seconds"] for x in stretches))
    with pytest.raises(ValueError, match=r"stretches_listed \(--stretches\) must be a positive integer"):
        pr.build_report(client, DB, "job", job_id="job-1", stretches_listed=0)


def test_monthly_agrees_with_bills_and_jobs(client):
    r = pr.build_report(client, DB, "monthly")
    assert r.period.startswith("2026-11-01")
    bills = reports.fetch(client, DB, "bills")
    tenants = {t["tenant"]: t for t in r.section("Tenant cost composition").rows}
    for b in bills:
        assert tenants[b["tenant"]]["total_cost"] == pytest.approx(b["total_cost"])
        assert tenants[b["tenant"]]["failed_retry_cost"] == pytest.approx(b["failed_retry_cost"])
    assert [j["job_id"] for j in r.section("Top 10 jobs by cost").rows] == ["job-1", "job-2"]
    trend = r.section("Three utilization layers per day").rows
    util = reports.fetch(client, DB, "utilization", by="day")
    assert [t["scheduling_utilization"] for t in trend] == pytest.approx([u["scheduling_utilization"] for u in util])


def test_inventory_and_weekly(client):
    inv = pr.build_report(client, DB, "inventory", days=30)
    cards = {c["gpu_model"]: c["cards"] for c in inv.section("Cards per GPU model and their utilization").rows}
    assert cards == {"A100-80GB": 2, "T4": 1}
    low = inv.section("Cards under 20% utilization").rows
    assert [c["gpu_uuid"] for c in low] == ["gpu-C"] and low[0]["queues"] == "q2"
    assert inv.section("Largest 10 jobs by GPU-hours").rows[0]["job_id"] == "job-1"
    assert pr.build_report(client, DB, "inventory", days=30, cards_listed=1).section(
        "Cards under 20% utilization").rows == low  # one card: nothing to sum
    with pytest.raises(ValueError, match=r"cards_listed \(--cards\) must be a positive integer"):
        pr.build_report(client, DB, "inventory", cards_listed=0)
    wk = pr.build_report(client, DB, "weekly")
    kinds = {(a["kind"], a["subject"].split()[-1]) for a in wk.section("Anomalies").rows}
    assert ("GPU down", "gpu-C") in kinds and ("Failed attempts", "job-1") in kinds and ("Straggler", "job-1") in kinds
    assert wk.summary["potential_savings"] == pytest.approx(
        sum(b["idle_cost"] + b["failed_retry_cost"] for b in reports.fetch(client, DB, "bills")))
    # one per kind: each kind's largest, then its rest counted and summed in one row
    one = pr.build_report(client, DB, "weekly", anomalies_per_kind=1).section("Anomalies").rows
    every = wk.section("Anomalies").rows
    for kind in {a["kind"] for a in every}:
        of_kind = [a for a in every if a["kind"] == kind]
        kept = [a for a in one if a["kind"] == kind]
        assert kept[0] == of_kind[0]
        if len(of_kind) == 1:
            assert len(kept) == 1
            continue
        assert len(kept) == 2 and kept[1]["subject"] == f"{len(of_kind) - 1} more"
        for col in ("gpu_hours", "cost"):
            rest = [a[col] for a in of_kind[1:] if a[col] is not None]
            assert kept[1][col] == (pytest.approx(sum(rest)) if rest else None)
    with pytest.raises(ValueError, match=r"anomalies_per_kind \(--anomalies\) must be a positive integer"):
        pr.build_report(client, DB, "weekly", anomalies_per_kind=0)


@pytest.mark.parametrize("fmt", pr.FORMATS)
def test_renderings(client, fmt):
    r = pr.build_report(client, DB, "job", job_id="job-1")
    out = pr.render_report(r, fmt)
    assert "job-1" in out and "Cost by attempt" in out
    if fmt == "markdown":
        assert re.search(r"^\| Cluster \| Attempt \| Outcome \| Compute cost \| ", out, re.M)  # human headers
    if fmt == "html":
        assert out.startswith("<!DOCTYPE html>") and out.count("<svg") >= 3
        # self-contained: no scripts, no external resources
        assert "<script" not in out and not re.search(r"(src|href)=['\"]?https?:", out)


def test_period_reports_state_their_data_coverage(client):
    for name in ("inventory", "monthly", "weekly"):
        r = pr.build_report(client, DB, name)
        assert r.coverage.partial and r.coverage.hours == pytest.approx(63 / 60), name
        assert "1.1 h of data in" in pr.render_report(r, "table"), name
    assert pr.build_report(client, DB, "monthly").coverage.text().startswith("1.1 h of data in 30 days (2026-11-02 00:00")


def test_unknown_report_and_job(client):
    with pytest.raises(ValueError, match="unknown report"):
        pr.build_report(client, DB, "daily")
    with pytest.raises(ValueError, match="no job"):
        pr.build_report(client, DB, "job", job_id="nope")


def test_a_release_named_by_two_suggestions_is_reclaimed_once(client):
    """The watcher may name a job again in a later suggestion (the first withdrawn when the waiting work
    went away, a second opened when it came back): the job's one release is reclaimed once, at the
    latest suggestion's rate and follow span, not once per suggestion."""
    from gpuledger.schemas.models import ReclaimSuggestion, SuggestedJob, WaitingDemand
    from gpuledger.sink.rows import suggestion_row

    db = "ledger_periodic_reclaim"  # its own database: the other tests' weekly figures stay as they are
    warehouse.migrate(client, db)
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n", records=USAGE), Source("u", 0, 0)),
                          database=db)
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(EVENTS)],
                          database=db)

    def suggestion(sid, minute, withdrawn, rate):  # job-1's attempt 0 fails at minute 25: both were followed
        job = SuggestedJob(job_id="job-1", attempt=0, tenant="t1", gpus=["gpu-A", "gpu-B"], gpus_freed=2.0,
                           execution_rate=rate, idle_cost_micros=10_000)
        return ReclaimSuggestion(
            suggestion_id=sid, definition_version="r/reclaim.v1", cluster="c", queue="q1", status="withdrawn",
            opened_at_ms=T0 + minute * MIN, withdrawn_at_ms=T0 + withdrawn * MIN, execution_rate=rate,
            window_ms=30 * MIN, jobs=[job], gpus_freed=2.0, currency="EUR", message="m", idle_cost_micros=10_000,
            waiting_demand=WaitingDemand(gpus=2.0, jobs=1, priority=10, queues=["q2"], snapshot_ms=T0))

    warehouse.insert_rows(client, "reclaim_suggestions", [
        suggestion_row(s, Source("s", 0, i)) for i, s in enumerate(
            [suggestion("first", 10, 15, 0.5), suggestion("second", 20, 26, 0.25)])], database=db)
    wk = pr.build_report(client, db, "weekly", followed_within_s=3600.0)
    # once, from the second suggestion: 2 GPUs x (1 - 0.25) from the release (25) to 20 + 60 min, at
    # job-1's idle cost of 1000 micros a GPU-minute (0.06 a GPU-hour)
    (row,) = wk.section("Reclaimed on followed reclaim suggestions").rows
    assert (row["cluster"], row["job_id"], row["suggested_at"]) == ("c", "job-1", "2026-11-02 00:20")
    assert row["reclaimed_gpu_hours"] == pytest.approx(2 * 0.75 * 55 / 60)
    assert wk.summary["reclaimed_gpu_hours"] == pytest.approx(2 * 0.75 * 55 / 60)
    assert wk.summary["estimated_savings"] == pytest.approx(2 * 0.75 * 55 / 60 * 0.06)
