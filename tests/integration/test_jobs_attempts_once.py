"""`report jobs` and job_cost (sql/0038): a job's attempt-side columns (attempts, failed_attempts,
queue_wait_seconds, queue_wait_gpu_hours, hence opportunity_cost) are on one of its rows only, the
version its usage started under, 0 on its other versions' rows (review finding F2: a job whose usage
crossed a definition change showed its 10-minute wait twice, 0.80 of opportunity cost for 0.40).
And the report's `limit` is checked as the other reports' (F3). On chDB."""

from __future__ import annotations

import datetime as dt

import pytest
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

from gpuledger import warehouse
from gpuledger.schemas.models import JobEvent
from gpuledger.sink.rows import Source, job_event_row
from gpuledger.warehouse import reports

pytestmark = pytest.mark.integration

DB = "jobs_attempts_once"
T0 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
ATTEMPT_COLS = ("attempts", "failed_attempts", "queue_wait_seconds", "queue_wait_gpu_hours", "opportunity_cost")


def event(n: int, kind: str, ts: int, job: str, attempt: int = 0):
    ev = JobEvent(event_id=f"e{n}", ts_ms=ts, kind=kind, cluster="c1", job_id=job, attempt=attempt, tenant="t1",
                  queue="q", requested_gpus=1.0, gpus=[{"node": "n1", "gpu_uuid": "g1"}] if kind == "allocated" else [])
    return job_event_row(ev, Source("e", 0, n))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("jobs"), DB) as (client, _):
        # job-x: usage under "v9" first, then under "v10" (a smaller string, later): the wait on v9's row
        put_usage(client, DB, [
            usage_record("c1", "g1", T0 + 10 * MIN, T0 + 40 * MIN, "executing", "job-x", "t1").model_copy(
                update={"definition_version": "v9"}),
            usage_record("c1", "g1", T0 + 40 * MIN, T0 + 70 * MIN, "executing", "job-x", "t1").model_copy(
                update={"definition_version": "v10"}),
            usage_record("c1", "g2", T0, T0 + 60 * MIN, "executing", "job-y", "t1"),
        ], 0)
        warehouse.insert_rows(client, "job_events", [
            event(0, "submitted", T0, "job-x"), event(1, "allocated", T0 + 10 * MIN, "job-x"),
            event(2, "failed", T0 + 70 * MIN, "job-x"),
            event(3, "submitted", T0, "job-z"),  # waiting, no usage yet: one row, version ''
        ], database=DB)
        yield client


def test_attempt_columns_on_the_first_version_row_only(jobs):
    rows = reports.fetch(jobs, DB, "jobs", reference_cost_per_gpu_hour=2.4)
    by = {(r["job_id"], r["definition_version"]): r for r in rows}
    assert set(by) == {("job-x", "v9"), ("job-x", "v10"), ("job-y", "d1"), ("job-z", "")}
    first, later = by[("job-x", "v9")], by[("job-x", "v10")]
    assert (first["attempts"], first["failed_attempts"], first["queue_wait_seconds"]) == (1, 1, 600.0)
    assert first["opportunity_cost"] == pytest.approx(0.40)  # 10 min x 1 GPU x 2.40/h
    assert all(later[c] == 0 for c in ATTEMPT_COLS)
    assert later["gpu_hours"] == pytest.approx(0.5) and later["last_outcome"] == "failed"
    assert sum(r["opportunity_cost"] for r in rows if r["job_id"] == "job-x") == pytest.approx(0.40)
    assert sum(r["attempts"] for r in rows if r["job_id"] == "job-x") == 1
    assert by[("job-z", "")]["attempts"] == 1 and by[("job-z", "")]["first_day"] is None
    # the same rows read alone and through the top-N path
    assert reports.fetch(jobs, DB, "jobs", job_id="job-x", reference_cost_per_gpu_hour=2.4) == [
        r for r in rows if r["job_id"] == "job-x"]
    assert reports.fetch(jobs, DB, "jobs", limit=2, reference_cost_per_gpu_hour=2.4) == rows[:2]


def test_jobs_limit_is_checked_like_the_other_reports(jobs):
    assert len(reports.fetch(jobs, DB, "jobs")) == 4
    assert reports.fetch(jobs, DB, "jobs", limit=0) == []
    assert len(reports.fetch(jobs, DB, "jobs", limit=2)) == 2
    for bad in (-1, "2", 1.5, True):
        with pytest.raises(ValueError, match="limit must be a non-negative integer"):
            reports.fetch(jobs, DB, "jobs", limit=bad)
