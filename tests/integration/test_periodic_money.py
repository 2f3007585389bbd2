"""The periodic reports' money against the ledger's own reports on small chDB ledgers filled by hand
(each in its own database), for the cases the review found wrong:
- weekly "Failed attempts" shows what the failed attempts cost in the week, not the job's whole cost;
- monthly top jobs are priced and ranked on the month's days only (a job across a month boundary);
- inventory largest jobs count a usage record delivered twice once (as `report jobs` and the bills);
- monthly tenant figures share the cluster idle as `report bills` does under the ledger's policy;
- money in two currencies is never added up under one currency;
- the job report's summary adds up every definition version of the job;
- the monthly summary keeps the three utilization layers with two clusters (the whole fleet's)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, job_event_row, usage_rows
from gpuledger.warehouse import reports
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

MIN = 60_000
_offsets = iter(range(1, 1_000_000))


def ms(y, m, d, h=0, mi=0) -> int:
    return int(dt.datetime(y, m, d, h, mi, tzinfo=dt.timezone.utc).timestamp() * 1000)


def rec(gpu, start, end, state, job="", attempt=0, util=None, tenant="", queue="", cluster="c", dv="d1"):
    g = end - start
    return UsageRecord(record_id=f"{cluster}/{gpu}/{start}/{job}/{attempt}", cluster=cluster, node="n1", gpu_uuid=gpu,
                       gpu_model="A100", start_ms=start, end_ms=end, state=state, job_id=job, attempt=attempt,
                       tenant=tenant if job else "", queue=queue if job else "", share_milli=1000, gpu_ms=g,
                       util_pct=util, util_metric_pct=util, energy_j=0.0, coefficient=2.0, coefficient_version="v1",
                       effective_gpu_ms=2 * g, cost_micros=(g // MIN) * 1000, definition_version=dv)


def ev(n, ts, kind, job, attempt=0, gpus=(), tenant="t1", queue="q1", cluster="c"):
    return JobEvent(event_id=f"{job}-{n}", ts_ms=ts, kind=kind, cluster=cluster, job_id=job, attempt=attempt,
                    tenant=tenant, queue=queue, priority=0, requested_gpus=float(max(1, len(gpus))),
                    gpus=[{"node": "n1", "gpu_uuid": g, "share_milli": 1000} for g in gpus])


def put(client, db, records):
    """The records as one usage message of the sink (a new offset: a copy is a second delivery)."""
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n", records=records),
                                                          Source("u", 0, next(_offsets))), database=db)


def put_events(client, db, events):
    base = next(_offsets) * 1000
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, base + i)) for i, e in enumerate(events)],
                          database=db)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('periodic-money') / 'chdb'}",
                                   database="pm_failed"))
    try:
        yield c
    finally:
        c.close()  # one chDB directory per process


def ledger(client, db: str):
    warehouse.migrate(client, db)
    return client


def test_weekly_failed_attempts_cost_what_the_failed_attempts_cost(client):
    db = "pm_failed"
    ledger(client, db)
    t0, m = ms(2026, 11, 2), lambda k: ms(2026, 11, 2) + k * MIN
    j = dict(job="job-1", tenant="t1", queue="q1")
    # attempt 0: 5 idle + 20 executing minutes on 2 GPUs, then it fails; attempt 1: 3 idle + 300 executing
    put(client, db, [rec(g, m(0), m(5), "allocated_idle", **j) for g in ("gpu-A", "gpu-B")]
        + [rec(g, m(5), m(25), "executing", util=90.0, **j) for g in ("gpu-A", "gpu-B")]
        + [rec(g, m(30), m(33), "allocated_idle", attempt=1, **j) for g in ("gpu-A", "gpu-B")]
        + [rec(g, m(33), m(333), "executing", attempt=1, util=80.0, **j) for g in ("gpu-A", "gpu-B")])
    gpus = ("gpu-A", "gpu-B")
    put_events(client, db, [ev(1, t0, "allocated", "job-1", gpus=gpus), ev(2, m(5), "started", "job-1", gpus=gpus),
                            ev(3, m(25), "failed", "job-1", gpus=gpus), ev(4, m(30), "allocated", "job-1", 1, gpus),
                            ev(5, m(33), "started", "job-1", 1, gpus), ev(6, m(333), "completed", "job-1", 1, gpus)])
    failed = [a for a in pr.build_report(client, db, "weekly").section("Anomalies").rows if a["kind"] == "Failed attempts"]
    # the failed attempt: 2 GPUs x (5 idle + 20 executing) min at 1,000 micros a minute; the job: 0.656
    assert [(a["subject"], a["cost"]) for a in failed] == [("job-1", pytest.approx(2 * 25 * 1000 / 1e6))]
    by_attempt = {c["attempt"]: c["total_cost"] for c in pr.build_report(client, db, "job", job_id="job-1").section(
        "Cost by attempt").rows}
    assert failed[0]["cost"] == pytest.approx(by_attempt[0])
    # a week later the failed attempt cost nothing: the job is no anomaly of that week
    later = pr.build_report(client, db, "weekly", as_of="2026-11-09").section("Anomalies").rows
    assert not [a for a in later if a["kind"] == "Failed attempts"]


def months_ledger(client, db: str) -> list[UsageRecord]:
    """job-X: 10 h on 2026-10-31 and 1 h on 2026-11-01; job-Y: 2 h on 2026-11-01. Returns the usage."""
    ledger(client, db)
    x, y = dict(job="job-X", tenant="t1", queue="q1"), dict(job="job-Y", tenant="t2", queue="q2")
    usage = [rec("gpu-A", ms(2026, 10, 31, 14), ms(2026, 11, 1), "executing", util=50.0, **x),
             rec("gpu-A", ms(2026, 11, 1), ms(2026, 11, 1, 1), "executing", util=50.0, **x),
             rec("gpu-B", ms(2026, 11, 1), ms(2026, 11, 1, 2), "executing", util=50.0, **y)]
    put(client, db, usage)
    put_events(client, db, [ev(1, ms(2026, 10, 31, 14), "started", "job-X", gpus=("gpu-A",)),
                            ev(2, ms(2026, 11, 1, 1), "completed", "job-X", gpus=("gpu-A",)),
                            ev(1, ms(2026, 11, 1), "started", "job-Y", gpus=("gpu-B",), tenant="t2", queue="q2"),
                            ev(2, ms(2026, 11, 1, 2), "completed", "job-Y", gpus=("gpu-B",), tenant="t2", queue="q2")])
    return usage


def test_top_jobs_are_priced_on_the_periods_days(client):
    db = "pm_months"
    months_ledger(client, db)
    month = pr.build_report(client, db, "monthly", month="2026-11")
    top = [(j["job_id"], j["cost"], j["gpu_hours"]) for j in month.section("Top 10 jobs by cost").rows]
    assert top == [("job-Y", pytest.approx(0.12), pytest.approx(2.0)), ("job-X", pytest.approx(0.06), pytest.approx(1.0))]
    assert sum(c for _, c, _ in top) == pytest.approx(month.summary["total_cost"])
    october = pr.build_report(client, db, "monthly", month="2026-10").section("Top 10 jobs by cost").rows
    assert [(j["job_id"], j["cost"], j["gpu_hours"]) for j in october] == [("job-X", pytest.approx(0.6), pytest.approx(10.0))]
    week = pr.build_report(client, db, "weekly", as_of="2026-11-01").section("Top 10 costly jobs").rows
    assert [j["job_id"] for j in week] == ["job-X", "job-Y"]  # 10/31 and 11/01 both in the week
    # the inventory's period only: job-X's October hours are left out of a period starting in November
    one_day = pr.build_report(client, db, "inventory", days=1, as_of="2026-11-01").section("Largest 10 jobs by GPU-hours")
    assert [(r["job_id"], r["gpu_hours"]) for r in one_day.rows] == [("job-Y", pytest.approx(2.0)),
                                                                      ("job-X", pytest.approx(1.0))]


def test_largest_jobs_count_a_record_delivered_twice_once(client):
    db = "pm_duplicate"
    usage = months_ledger(client, db)
    put(client, db, [usage[2]])  # job-Y's record delivered a second time (another Kafka message)
    inv = pr.build_report(client, db, "inventory", days=30, as_of="2026-11-01")
    jobs = {j["job_id"]: j for j in reports.fetch(client, db, "jobs", day_from="2026-10-03", day_to="2026-11-01")}
    largest = inv.section("Largest 10 jobs by GPU-hours").rows
    assert [r["job_id"] for r in largest] == ["job-X", "job-Y"]
    for r in largest:  # as the jobs report and the bills count it: once
        assert (r["gpu_hours"], r["cost"]) == (pytest.approx(jobs[r["job_id"]]["gpu_hours"]),
                                              pytest.approx(jobs[r["job_id"]]["cost"])), r["job_id"]
    assert (largest[1]["gpu_hours"], largest[1]["cost"]) == (pytest.approx(2.0), pytest.approx(0.12))


@pytest.fixture
def two_currencies(client):
    db = "pm_money"
    if "pm_money" in {r[0] for r in client.query("SHOW DATABASES").result_rows}:
        return db
    ledger(client, db)
    t = ms(2026, 11, 2, 10)
    put(client, db, [rec("gpu-A", t, t + 60 * MIN, "executing", job="j1", tenant="t1", queue="q1", util=50.0),
                     rec("gpu-B", t, t + 60 * MIN, "unallocated"),
                     rec("gpu-C", t, t + 60 * MIN, "executing", job="j2", tenant="t2", queue="q2", util=50.0, dv="d2"),
                     # and j2 alone on 2026-11-20: a week with EUR money only
                     rec("gpu-C", t + 18 * 1440 * MIN, t + 19 * 1440 * MIN - 600 * MIN, "executing", job="j2",
                         tenant="t2", queue="q2", util=50.0, dv="d2")])
    put_events(client, db, [ev(1, t, "started", "j1", gpus=("gpu-A",)), ev(2, t + 60 * MIN, "completed", "j1", gpus=("gpu-A",)),
                            ev(1, t, "started", "j2", gpus=("gpu-C",), tenant="t2", queue="q2"),
                            ev(2, t + 60 * MIN, "completed", "j2", gpus=("gpu-C",), tenant="t2", queue="q2")])
    # the accounting library as `gpuledger migrate` records it: d1 in USD, d2 (a later ledger) in EUR
    client.insert(f"{db}.definitions", [["d1", "f1", json.dumps({"currency": "USD"})],
                                        ["d2", "f2", json.dumps({"currency": "EUR"})]],
                  column_names=["definition_version", "fingerprint", "content"])
    return db


@pytest.mark.parametrize("policy", ["even", "usage"])
def test_monthly_shares_cluster_idle_as_the_bills(client, two_currencies, policy):
    db = two_currencies
    bills = reports.fetch(client, db, "bills", day_from="2026-11-01", day_to="2026-11-30", idle_redistribution=policy,
                          currency="USD")
    r = pr.build_report(client, db, "monthly", month="2026-11", idle_redistribution=policy, currency="USD")
    tenants = {t["tenant"]: t for t in r.section("Tenant cost composition").rows}
    for tenant in ("t1", "t2"):
        for key in ("total_cost", "cluster_idle_cost", "billed_total_cost"):
            billed = sum(b[key] for b in bills if b["tenant"] == tenant)
            assert tenants[tenant][key] == pytest.approx(billed), (tenant, key)
    assert tenants["t1"]["cluster_idle_cost"] == pytest.approx(0.06)  # gpu-B's hour, d1's cluster idle
    assert r.summary["cluster_idle_cost"] == "0.00 EUR; 0.06 USD"
    assert r.summary["billed_total_cost"] == "0.90 EUR; 0.12 USD"
    assert "Cluster idle cost" in pr.render_report(r, "html")  # a series of the tenants' plot
    week = pr.build_report(client, db, "weekly", as_of="2026-11-02", idle_redistribution=policy, currency="USD")
    assert week.summary["billed_total_cost"] == "0.06 EUR; 0.12 USD"
    # without a policy, no share (the ledger's default)
    plain = pr.build_report(client, db, "monthly", month="2026-11", currency="USD")
    assert "cluster_idle_cost" not in plain.summary
    assert "cluster_idle_cost" not in plain.section("Tenant cost composition").rows[0]


def test_two_currencies_are_never_added(client, two_currencies):
    db = two_currencies
    r = pr.build_report(client, db, "monthly", month="2026-11", currency="USD")
    assert r.currencies == ["EUR", "USD"] and r.currency == ""
    assert r.summary["total_cost"] == "0.90 EUR; 0.06 USD"
    assert {(t["tenant"], t["currency"]) for t in r.section("Tenant cost composition").rows} == {("t1", "USD"),
                                                                                                 ("t2", "EUR")}
    assert {(j["job_id"], j["currency"]) for j in r.section("Top 10 jobs by cost").rows} == {("j1", "USD"), ("j2", "EUR")}
    text = pr.render_report(r, "table")
    assert "Money in EUR, USD" in text and "(USD)" not in text
    week = pr.build_report(client, db, "weekly", as_of="2026-11-02", currency="USD")
    assert week.summary["total_cost"] == "0.06 EUR; 0.06 USD"
    # one currency in the period: the report's, whatever the ledger prices in now; no money: the ledger's
    eur = pr.build_report(client, db, "weekly", as_of="2026-11-20", currency="USD")
    assert eur.currency == "EUR" and eur.summary["total_cost"] == pytest.approx(0.84)
    assert "Money in EUR." in pr.render_report(eur, "table")
    assert pr.build_report(client, db, "weekly", as_of="2026-11-12", currency="USD").currency == "USD"


def test_job_summary_adds_up_every_definition_version(client):
    db = "pm_versions"
    ledger(client, db)
    t = ms(2026, 11, 2, 10)
    j = dict(job="job-1", tenant="t1", queue="q1")
    put(client, db, [rec("gpu-A", t, t + 120 * MIN, "executing", util=60.0, dv="d1", **j),
                     rec("gpu-A", t + 120 * MIN, t + 180 * MIN, "executing", util=60.0, dv="d2", **j),
                     rec("gpu-B", t + 1440 * MIN, t + 1500 * MIN, "executing", util=60.0, dv="d2", **j)])
    put_events(client, db, [ev(1, t, "started", "job-1", gpus=("gpu-A",)),
                            ev(2, t + 1500 * MIN, "completed", "job-1", gpus=("gpu-A",))])
    rows = reports.fetch(client, db, "jobs", job_id="job-1")
    assert len(rows) == 2
    r = pr.build_report(client, db, "job", job_id="job-1")
    assert r.summary["gpu_hours"] == pytest.approx(4.0)
    assert r.summary["cost"] == pytest.approx(sum(c["total_cost"] for c in r.section("Cost by attempt").rows))
    assert r.summary["attempts"] == 1 and r.summary["last_outcome"] == "completed"
    assert r.period == "2026-11-02 .. 2026-11-03"
    assert "clusters" not in r.summary


def test_job_summary_names_its_clusters(client):
    db = "pm_job_clusters"
    ledger(client, db)
    t = ms(2026, 11, 2, 10)
    for cluster in ("c", "c2"):
        put(client, db, [rec("gpu-A", t, t + 60 * MIN, "executing", job="job-1", tenant="t1", queue="q1",
                             cluster=cluster)])
    r = pr.build_report(client, db, "job", job_id="job-1")
    assert r.summary["clusters"] == "c, c2" and r.summary["gpu_hours"] == pytest.approx(2.0)


def test_monthly_layers_of_the_whole_fleet(client):
    db = "pm_clusters"
    ledger(client, db)
    t = ms(2026, 11, 2, 10)
    for cluster, util, hours in (("c", 60.0, 1), ("c2", 20.0, 3)):
        put(client, db, [rec("gpu-1", t, t + hours * 60 * MIN, "executing", util=util, job=f"{cluster}-j", tenant="t1",
                             queue="q1", cluster=cluster),
                         rec("gpu-2", t, t + 60 * MIN, "unallocated", cluster=cluster),
                         rec("gpu-3", t, t + 60 * MIN, "allocated_idle", job=f"{cluster}-k", tenant="t1", queue="q1",
                             cluster=cluster)])
    r = pr.build_report(client, db, "monthly", month="2026-11")
    # allocated 4 + 2 h of 8 h; executing 4 of those 6; SM activity (60 x 1 + 20 x 3) / 4 h
    assert r.summary["scheduling_utilization"] == pytest.approx(6 / 8)
    assert r.summary["execution_utilization"] == pytest.approx(4 / 6)
    assert r.summary["hardware_utilization"] == pytest.approx((60 + 60) / 4 / 100)
    per_cluster = reports.fetch(client, db, "utilization", by="cluster", day_from="2026-11-01", day_to="2026-11-30")
    assert len(per_cluster) == 2
