"""The weekly report's reclaimed savings across the week's end (chDB filled by hand). A suggestion opened
30 min before the week ended, its job released 10 min after the end: the week of the suggestion counted
it with 0 GPU-hours (its span cut at the week's end, before the release) and the next week never looked
at suggestions of the week before, so 20 GPU-minutes of savings were in no report. Now each week counts
the part of the follow span inside it; a release before the end splits between the two weeks."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent, ReclaimSuggestion, SuggestedJob, UsageBatch, UsageRecord, WaitingDemand
from gpuledger.sink.rows import Source, job_event_row, suggestion_row, usage_rows
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "periodic_week_edge"
WEEK_END = int(dt.datetime(2026, 11, 9, tzinfo=dt.timezone.utc).timestamp() * 1000)  # the week 11-02 .. 11-08
MIN = 60_000
#: job -> (its GPU, minutes from the week's end of: suggestion, release)
JOBS = {"after": ("gpu-A", -30, 10), "before": ("gpu-B", -30, -10)}


def idle(job):
    gpu, opened, _ = JOBS[job]
    start, end = WEEK_END + (opened - 60) * MIN, WEEK_END + opened * MIN
    return UsageRecord(record_id=f"{gpu}/0", cluster="c", node="n1", gpu_uuid=gpu, gpu_model="A100", start_ms=start,
                       end_ms=end, state="allocated_idle", job_id=job, attempt=0, tenant="t1", queue="q1",
                       share_milli=1000, gpu_ms=end - start, energy_j=0.0, coefficient=1.0, coefficient_version="v1",
                       effective_gpu_ms=end - start, cost_micros=60_000, definition_version="d1")  # 0.06 an hour


def completed(job):
    gpu, _, released = JOBS[job]
    return JobEvent(event_id=f"{job}-end", ts_ms=WEEK_END + released * MIN, kind="completed", cluster="c", job_id=job,
                    attempt=0, tenant="t1", queue="q1", priority=0, requested_gpus=1.0,
                    gpus=[{"node": "n1", "gpu_uuid": gpu, "share_milli": 1000}])


def suggestion(job):
    gpu, opened, _ = JOBS[job]
    named = SuggestedJob(job_id=job, attempt=0, tenant="t1", gpus=[gpu], gpus_freed=1.0, execution_rate=0.0,
                         idle_cost_micros=60_000)
    return ReclaimSuggestion(
        suggestion_id=f"s-{job}", definition_version="r/reclaim.v1", cluster="c", queue="q1", status="withdrawn",
        opened_at_ms=WEEK_END + opened * MIN, withdrawn_at_ms=WEEK_END + (opened + 5) * MIN, execution_rate=0.0,
        window_ms=30 * MIN, jobs=[named], gpus_freed=1.0, currency="USD", message="m", idle_cost_micros=60_000,
        waiting_demand=WaitingDemand(gpus=1.0, jobs=1, priority=10, queues=["q2"], snapshot_ms=WEEK_END))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('edge') / 'chdb'}", database=DB))
    try:
        warehouse.migrate(c, DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=[idle(j) for j in JOBS]),
                                                         Source("u", 0, 0)), database=DB)
        warehouse.insert_rows(c, "job_events", [job_event_row(completed(j), Source("e", 0, i))
                                                for i, j in enumerate(JOBS)], database=DB)
        warehouse.insert_rows(c, "reclaim_suggestions", [suggestion_row(suggestion(j), Source("s", 0, i))
                                                         for i, j in enumerate(JOBS)], database=DB)
        yield c
    finally:
        c.close()  # one chDB directory per process


def reclaimed(client, as_of: str) -> dict[str, float]:
    wk = pr.build_report(client, DB, "weekly", as_of=as_of, currency="USD", followed_within_s=3600.0)
    return {r["job_id"]: round(r["reclaimed_gpu_hours"] * 60, 6)
            for r in wk.section("Reclaimed on followed reclaim suggestions").rows}


def test_a_follow_span_across_the_weeks_end_is_counted_in_the_weeks_it_falls_in(client):
    # each span: 60 min from the suggestion (30 min before the end) = 30 min after the end
    assert reclaimed(client, "2026-11-08") == {"before": 10.0}  # from its release to the end; `after` not yet
    assert reclaimed(client, "2026-11-15") == {"after": 20.0, "before": 30.0}  # the rest of both spans
