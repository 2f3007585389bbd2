"""One job id in two clusters is two jobs (an attempt is (cluster, job_id, attempt): Slurm numbers jobs
per cluster). The job health report keys and labels every per-attempt section by cluster and gives a
balance score per cluster; the weekly and monthly reports name the cluster of each job row.

The ledger: cluster c runs job-1 attempt 0 on two GPUs at 90 % for an hour and it fails; cluster c2
runs job-1 attempt 0 on one GPU at 10 % (5 min loading first) and it completes, and job-2 on two GPUs
at 90 % and 10 % (a straggler)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, job_event_row, usage_rows
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_job_clusters"
MIN = 60_000
T = int(dt.datetime(2026, 11, 2, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)


def rec(cluster, gpu, m0, m1, state, job, util=None):
    g = (m1 - m0) * MIN
    return UsageRecord(record_id=f"{cluster}/{gpu}/{m0}/{job}", cluster=cluster, node="n1", gpu_uuid=gpu,
                       gpu_model="A100", start_ms=T + m0 * MIN, end_ms=T + m1 * MIN, state=state, job_id=job,
                       attempt=0, tenant="t1", queue="q1", share_milli=1000, gpu_ms=g, util_pct=util,
                       util_metric_pct=util, energy_j=0.0, coefficient=2.0, coefficient_version="v1",
                       effective_gpu_ms=2 * g, cost_micros=(m1 - m0) * 1000, definition_version="d1")


def ev(cluster, n, minute, kind, job, gpus):
    return JobEvent(event_id=f"{cluster}-{job}-{n}", ts_ms=T + minute * MIN, kind=kind, cluster=cluster, job_id=job,
                    attempt=0, tenant="t1", queue="q1", priority=0, requested_gpus=float(len(gpus)),
                    gpus=[{"node": "n1", "gpu_uuid": g, "share_milli": 1000} for g in gpus])


USAGE = [
    rec("c", "gpu-A", 0, 60, "executing", "job-1", util=90.0), rec("c", "gpu-B", 0, 60, "executing", "job-1", util=90.0),
    rec("c2", "gpu-X", 0, 5, "allocated_idle", "job-1"), rec("c2", "gpu-X", 5, 65, "executing", "job-1", util=10.0),
    rec("c2", "gpu-Y", 0, 60, "executing", "job-2", util=90.0), rec("c2", "gpu-Z", 0, 60, "executing", "job-2", util=10.0),
]
EVENTS = [
    ev("c", 1, 0, "started", "job-1", ("gpu-A", "gpu-B")), ev("c", 2, 60, "failed", "job-1", ("gpu-A", "gpu-B")),
    ev("c2", 1, 0, "started", "job-1", ("gpu-X",)), ev("c2", 2, 65, "completed", "job-1", ("gpu-X",)),
    ev("c2", 3, 0, "started", "job-2", ("gpu-Y", "gpu-Z")), ev("c2", 4, 60, "completed", "job-2", ("gpu-Y", "gpu-Z")),
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('job-clusters') / 'chdb'}", database=DB))
    try:
        warehouse.migrate(c, DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=USAGE), Source("u", 0, 0)),
                              database=DB)
        warehouse.insert_rows(c, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(EVENTS)],
                              database=DB)
        yield c
    finally:
        c.close()  # one chDB directory per process


def test_job_report_keeps_each_clusters_attempts_apart(client):
    r = pr.build_report(client, DB, "job", job_id="job-1")
    assert r.summary["clusters"] == "c, c2"
    # each cluster's attempt 0 is balanced on its own GPUs (merged: 3 GPUs at 90, 90, 10 -> 0.70)
    assert r.section("Balance score per attempt").rows == [
        {"cluster": "c", "attempt": 0, "gpus": 2, "balance_score": pytest.approx(1.0)},
        {"cluster": "c2", "attempt": 0, "gpus": 1, "balance_score": pytest.approx(1.0)}]
    assert r.summary["balance_score"] == "c 1.00; c2 1.00"
    assert [(g["cluster"], g["gpu"]) for g in r.section("Balance across GPUs").rows] == [
        ("c", "n1/A"), ("c", "n1/B"), ("c2", "n1/X")]
    # c's attempt failed (its hour is failed-retry), c2's completed (compute): two rows, never one outcome
    cost = [(x["cluster"], x["attempt"], x["outcome"], x["compute_cost"], x["idle_cost"], x["failed_retry_cost"])
            for x in r.section("Cost by attempt").rows]
    assert cost == [("c", 0, "failed", 0.0, 0.0, pytest.approx(0.12)),
                    ("c2", 0, "completed", pytest.approx(0.06), pytest.approx(0.005), 0.0)]
    # the loading stall is c2's attempt's alone
    assert [(h["cluster"], h["attempt"], h["hint"]) for h in r.section("Hints").rows] == [("c2", 0, "loading stall")]
    assert [(x["cluster"], x["gpu_uuid"]) for x in r.section("Idle stretches").rows] == [("c2", "gpu-X")]
    out = pr.render_report(r, "markdown")
    assert "| Cluster | Attempt | Outcome |" in out and "c 1.00; c2 1.00" in out


def test_job_report_of_one_cluster_names_it_and_keeps_one_score(client):
    r = pr.build_report(client, DB, "job", job_id="job-2")
    assert "clusters" not in r.summary
    assert r.summary["balance_score"] == pytest.approx((90 + 10) / 2 / 90)
    assert [(h["cluster"], h["hint"], h["detail"][:5]) for h in r.section("Hints").rows] == [("c2", "straggler", "n1/Z ")]
    assert [(x["cluster"], x["attempt"]) for x in r.section("Cost by attempt").rows] == [("c2", 0)]


def test_weekly_and_monthly_job_rows_name_their_cluster(client):
    # the same money ranks two clusters' job-1 side by side: only the cluster tells them apart
    expected = [("c", "job-1"), ("c2", "job-1"), ("c2", "job-2")]
    month = pr.build_report(client, DB, "monthly")
    assert sorted((j["cluster"], j["job_id"]) for j in month.section("Top 10 jobs by cost").rows) == expected
    week = pr.build_report(client, DB, "weekly")
    assert sorted((j["cluster"], j["job_id"]) for j in week.section("Top 10 costly jobs").rows) == expected
    assert [(a["kind"], a["cluster"], a["subject"]) for a in week.section("Anomalies").rows] == [
        ("Failed attempts", "c", "job-1"), ("Straggler", "c2", "job-2")]
    inventory = pr.build_report(client, DB, "inventory")
    assert sorted((j["cluster"], j["job_id"]) for j in inventory.section("Largest 10 jobs by GPU-hours").rows) == expected
    assert "| Cluster | Job ID |" in pr.render_report(week, "markdown")
