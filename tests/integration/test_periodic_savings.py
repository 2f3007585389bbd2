"""The weekly report's reclaimed savings in a ledger priced in two currencies (a definition version in
USD, a later one in EUR) on a small chDB filled by hand: each reclaimed row names the currency of the
job's idle cost it is priced at, and the savings are summed per currency, never EUR and USD added up
under one (as the tenants' money already is, tests/integration/test_periodic_money.py)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, ReclaimSuggestion, SuggestedJob, UsageBatch, UsageRecord, WaitingDemand
from gpuledger.sink.rows import Source, job_event_row, suggestion_row, usage_rows
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "periodic_savings"
T0 = int(dt.datetime(2026, 11, 2, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
JOBS = {"j-usd": ("gpu-A", "d1"), "j-eur": ("gpu-B", "d2")}  # job -> its GPU, its definition version


def rec(job, m0, m1, state):
    gpu, dv = JOBS[job]
    g = (m1 - m0) * MIN
    return UsageRecord(record_id=f"{gpu}/{m0}", cluster="c", node="n1", gpu_uuid=gpu, gpu_model="A100",
                       start_ms=T0 + m0 * MIN, end_ms=T0 + m1 * MIN, state=state, job_id=job, attempt=0, tenant="t1",
                       queue="q1", share_milli=1000, gpu_ms=g, util_pct=50.0 if state == "executing" else None,
                       energy_j=0.0, coefficient=1.0, coefficient_version="v1", effective_gpu_ms=g,
                       cost_micros=(m1 - m0) * 1000, definition_version=dv)  # 0.06 a GPU-hour


def ev(n, minute, kind, job):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=T0 + minute * MIN, kind=kind, cluster="c", job_id=job, attempt=0,
                    tenant="t1", queue="q1", priority=0, requested_gpus=1.0,
                    gpus=[{"node": "n1", "gpu_uuid": JOBS[job][0], "share_milli": 1000}])


def suggestion(job, currency):
    named = SuggestedJob(job_id=job, attempt=0, tenant="t1", gpus=[JOBS[job][0]], gpus_freed=1.0, execution_rate=0.0,
                         idle_cost_micros=10_000)
    return ReclaimSuggestion(
        suggestion_id=f"s-{job}", definition_version="r/reclaim.v1", cluster="c", queue="q1", status="withdrawn",
        opened_at_ms=T0 + 10 * MIN, withdrawn_at_ms=T0 + 20 * MIN, execution_rate=0.0, window_ms=30 * MIN, jobs=[named],
        gpus_freed=1.0, currency=currency, message="m", idle_cost_micros=10_000,
        waiting_demand=WaitingDemand(gpus=1.0, jobs=1, priority=10, queues=["q2"], snapshot_ms=T0))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('savings') / 'chdb'}", database=DB))
    try:
        warehouse.migrate(c, DB)
        # both jobs idle 20 min, released at minute 20 on a suggestion opened at minute 10
        records = [rec(job, 0, 20, "allocated_idle") for job in JOBS]
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=records), Source("u", 0, 0)),
                              database=DB)
        events = [e for job in JOBS for e in (ev(1, 0, "started", job), ev(2, 20, "completed", job))]
        warehouse.insert_rows(c, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(events)],
                              database=DB)
        warehouse.insert_rows(c, "reclaim_suggestions", [suggestion_row(suggestion(job, cur), Source("s", 0, i))
                                                         for i, (job, cur) in enumerate([("j-usd", "USD"),
                                                                                         ("j-eur", "EUR")])],
                              database=DB)
        c.insert(f"{DB}.definitions", [["d1", "f1", json.dumps({"currency": "USD"})],
                                       ["d2", "f2", json.dumps({"currency": "EUR"})]],
                 column_names=["definition_version", "fingerprint", "content"])
        yield c
    finally:
        c.close()  # one chDB directory per process


def test_savings_in_two_currencies_are_summed_per_currency(client):
    wk = pr.build_report(client, DB, "weekly", as_of="2026-11-02", currency="USD", followed_within_s=3600.0)
    # each: 1 GPU x (1 - 0) from its release (20) to the end of the follow span (10 + 60): 50 min at 0.06 an hour
    rows = wk.section("Reclaimed on followed reclaim suggestions").rows
    assert sorted((r["job_id"], r["currency"], round(r["saved_cost"], 6)) for r in rows) == [
        ("j-eur", "EUR", 0.05), ("j-usd", "USD", 0.05)]
    assert wk.summary["estimated_savings"] == "0.05 EUR; 0.05 USD"  # before: 0.1, EUR and USD added
    assert wk.section("Estimated savings").rows[0]["cost"] == "0.05 EUR; 0.05 USD"
    assert wk.summary["reclaimed_gpu_hours"] == pytest.approx(2 * 50 / 60)  # GPU-hours add up in any currency
    assert "Money in EUR, USD" in pr.render_report(wk, "table")


def test_one_currency_keeps_plain_numbers(client):
    """Where the week's money is in one currency the savings stay a number and rows name no currency."""
    db = "periodic_savings_one"
    warehouse.migrate(client, db)
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n", records=[rec("j-usd", 0, 20, "allocated_idle")]),
                                                          Source("u", 0, 0)), database=db)
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(
        [ev(1, 0, "started", "j-usd"), ev(2, 20, "completed", "j-usd")])], database=db)
    warehouse.insert_rows(client, "reclaim_suggestions", [suggestion_row(suggestion("j-usd", "USD"), Source("s", 0, 0))],
                          database=db)
    wk = pr.build_report(client, db, "weekly", as_of="2026-11-02", currency="USD", followed_within_s=3600.0)
    assert wk.summary["estimated_savings"] == pytest.approx(0.05)
    assert "currency" not in wk.section("Reclaimed on followed reclaim suggestions").rows[0]
