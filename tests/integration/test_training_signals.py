"""Training signals (sql/0042 over sql/0021) on chDB, with the golden pilot of test_golden_estimate.py
(2 A100-80GB x 10 min at 8,000 micros a GPU-minute; reports at 1..6 min, steps 0..500): a usage record
stored twice counts once (so does a checkpoint event), and a job id that ran in two clusters is two jobs, one row each."""

from __future__ import annotations

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import JobProgress, UsageBatch
from gpuledger.sink.rows import PROGRESS, Source, job_event_row, process_message, usage_rows
from gpuledger.warehouse.periodic import commands as pr

from test_golden_estimate import MIN, STEPS, T0, checkpoint, progress, usage

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_training_signals"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('training') / 'chdb'}", database=DB))
    try:
        yield c
    finally:
        c.close()


def fresh(client, name: str) -> str:
    """A new migrated database on the module's engine (one chDB directory per process)."""
    warehouse.migrate(client, name)
    return name


def put_progress(client, db: str, raws: list[bytes], offset: int) -> None:
    """Progress reports through the sink's own conversion."""
    rows = [process_message(PROGRESS, raw, Source("p", 0, offset + i))["job_progress"][0] for i, raw in enumerate(raws)]
    warehouse.insert_rows(client, "job_progress", rows, database=db)


def reports(job: str, cluster: str | None, steps: list[int], late_ms: int = 0) -> list[bytes]:
    return [JobProgress(ts_ms=T0 + (i + 1) * MIN + late_ms, cluster=cluster, job_id=job, attempt=0, step=s,
                        ranks=[{"rank": 0, "step_time_ms": 500.0}, {"rank": 1, "step_time_ms": 650.0}]
                        ).model_dump_json().encode() for i, s in enumerate(steps)]


def signals(client, db: str, job: str) -> list[dict]:
    """The job's rows of job_training_signals, fewest steps first."""
    return list(client.query(f"SELECT * FROM {db}.job_training_signals WHERE job_id = {{j:String}} ORDER BY steps",
                             parameters={"j": job}).named_results())


def test_a_usage_record_stored_twice_counts_once(client):
    db = fresh(client, "ledger_training_twice")
    client.command(f"SYSTEM STOP MERGES {db}.usage_raw")  # the copies stay apart, as before a merge
    for offset in (0, 1):  # the same usage message stored twice (a replay at another offset)
        warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=usage()),
                                                              Source("u", 0, offset)), database=db)
    put_progress(client, db, progress(), 0)
    events = [checkpoint(1, 200, "checkpoint_begin"), checkpoint(2, 230, "checkpoint_end")]
    for offset in (0, 10):  # the checkpoint's events stored twice too
        warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, offset + i))
                                                     for i, e in enumerate(events)], database=db)
    (row,) = signals(client, db, "pilot-1")
    assert (row["checkpoints"], row["checkpoint_seconds"]) == (1, 30.0)  # as stored: 2 and 60 s
    # span 1..6 min: 5 records per GPU x 2 GPUs x 8,000 micros = 0.08 for 500 steps (read as stored: 0.16)
    assert (row["span_cost"], row["span_gpu_hours"]) == pytest.approx((0.08, 10 / 60))
    assert row["cost_per_step"] == pytest.approx(0.08 / 500)
    report = pr.build_report(client, db, "job", job_id="pilot-1")
    assert report.summary["cost"] == pytest.approx(0.16)  # the whole job (10 min), each record once
    assert report.summary["cost_per_step"] == pytest.approx(0.08 / 500)


def two_clusters(client, db: str, job: str, b_cluster: str | None) -> None:
    """Job `job` attempt 0 in cluster a (the golden pilot: 2 GPUs, steps 0..500, a 30 s checkpoint) and
    in cluster b (8 GPUs over the same minutes, steps 90,000..90,050, a 120 s checkpoint); b's reports
    name `b_cluster`."""
    records = [r.model_copy(update=dict(record_id=f"{cl}/{g}/{m}", cluster=cl, gpu_uuid=g, job_id=job,
                                        start_ms=T0 + m * MIN, end_ms=T0 + (m + 1) * MIN))
               for cl, gpus in (("a", ["gpu-A", "gpu-B"]), ("b", [f"h{k}" for k in range(8)]))
               for r in usage()[:1] for g in gpus for m in range(10)]
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=records), Source("u", 0, 0)),
                          database=db)
    put_progress(client, db, reports(job, "a", STEPS), 0)
    put_progress(client, db, reports(job, b_cluster, [90_000 + 10 * i for i in range(6)], late_ms=30_000), 100)
    events = [checkpoint(1, 200, "checkpoint_begin"), checkpoint(2, 230, "checkpoint_end"),
              checkpoint(3, 100, "checkpoint_begin"), checkpoint(4, 220, "checkpoint_end")]
    events = [e.model_copy(update=dict(job_id=job, cluster="a" if i < 2 else "b")) for i, e in enumerate(events)]
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(events)],
                          database=db)


def test_a_job_id_of_two_clusters_is_two_jobs(client):
    db = fresh(client, "ledger_training_clusters")
    two_clusters(client, db, "1234", "b")
    rows = signals(client, db, "1234")
    # merged: one row of 90,050 steps (first report of a to last of b), 12 reports, 0.44, checkpoints 150 s
    assert [(r["steps"], r["reports"]) for r in rows] == [(50, 6), (500, 6)]
    b, a = rows
    assert (a["cluster"], b["cluster"]) == ("a", "b")
    assert (a["span_cost"], a["cost_per_step"], a["checkpoint_seconds"]) == pytest.approx((0.08, 0.08 / 500, 30.0))
    # b: 8 GPUs over 1:30 .. 6:30, 5 GPU-minutes each at 8,000 micros
    assert (b["span_cost"], b["cost_per_step"], b["checkpoint_seconds"]) == pytest.approx((0.32, 0.32 / 50, 120.0))
    windows = list(client.query(f"SELECT cluster, sum(steps) AS steps FROM {db}.job_progress_windows "
                                "WHERE job_id = '1234' GROUP BY cluster ORDER BY cluster").result_rows)
    assert windows == [("a", 500), ("b", 50)]
    report = pr.build_report(client, db, "job", job_id="1234")
    shown = report.section("Training signals").rows
    assert [(r["cluster"], r["attempt"], r["steps"]) for r in shown] == [("a", 0, 500), ("b", 0, 50)]
    # each cluster's ranks on their own: 6 reports per rank, not 12
    spreads = report.section("Rank step-time spread").rows
    assert [(r["cluster"], r["spread"]) for r in spreads] == [("a", pytest.approx(0.3)), ("b", pytest.approx(0.3))]
    # the summary: the attempt that reported last (b's, 30 s after a's)
    assert report.summary["cost_per_step"] == pytest.approx(0.32 / 50)


def test_reports_that_name_no_cluster_take_the_jobs_only_cluster(client):
    db = fresh(client, "ledger_training_unnamed")
    records = [r.model_copy(update=dict(cluster="a")) for r in usage()]
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=records), Source("u", 0, 0)),
                          database=db)
    put_progress(client, db, reports("pilot-1", None, STEPS), 0)  # a ProgressReporter not given cluster=
    (row,) = signals(client, db, "pilot-1")
    assert (row["steps"], row["span_cost"], row["cluster"]) == (500, pytest.approx(0.08), "a")
    # a job id of two clusters: reports naming none cannot be placed; they keep '' and are matched to no
    # usage (0, as an attempt without usage records), a's cost stays its own
    two_clusters(client, db, "1234", None)
    rows = signals(client, db, "1234")
    assert [(r["steps"], r["span_cost"], r["cluster"]) for r in rows] == [(50, 0.0, ""), (500, pytest.approx(0.08), "a")]
