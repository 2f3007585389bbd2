"""Queue efficiency of a closed cohort day is revised by later close runs (docs/accounting.md §6a), on the
real embedded engine (chDB).

Cluster c1, grace 1 h, cohort day D = 2024-03-01 UTC: job-1 (alpha, queue q, 1 GPU) is queued at 23:00
on D; gpu-Z is unallocated 22:00 on D to 02:00 on D+1, so D closes at the run of 03:00 on D+1 with the
attempt still waiting (attempts 1, waits 0, nothing allocated). At 08:00 on D+1 the job gets gpu-A and
runs 2 h (completed at 10:00). The next run revises D's queue rows: allocated = executed = 7,200 GPU-s,
requested = 1 GPU x (10:00 on D+1 - 23:00 on D) = 39,600 GPU-s, one wait of 9 h = 32,400 s, as the live
queue_efficiency view says. The bills do not change (D+1's usage is D+1's), and a run with nothing new
writes nothing. A cohort day older than the look-back keeps its last figures.
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import GpuAssignment, JobEvent
from gpuledger.sink.rows import Source, job_event_row
from gpuledger.warehouse import bills, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "queue_revision"
D = dt.date(2024, 3, 1)
HOUR = 3_600_000
DAY0 = 1709251200000                  # 2024-03-01T00:00:00Z
QUEUED = DAY0 + 23 * HOUR             # 23:00 on D
ALLOCATED = DAY0 + 32 * HOUR          # 08:00 on D+1, after D's close


def utc(day: int, hour: int) -> dt.datetime:
    return dt.datetime(2024, 3, day, hour, tzinfo=dt.timezone.utc)


def ev(n: int, ts: int, kind: str, gpu: str | None = None) -> JobEvent:
    return JobEvent(event_id=f"e{n}", ts_ms=ts, kind=kind, cluster="c1", job_id="job-1", attempt=0, tenant="alpha",
                    queue="q", requested_gpus=1.0, gpus=[GpuAssignment(node="n1", gpu_uuid=gpu)] if gpu else [])


def put_events(client, events, offset):
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("t.job-events", 0, offset + i))
                                                 for i, e in enumerate(events)], database=DB)


def allocate_after_the_close(client, offset):
    put_events(client, [ev(2, ALLOCATED, "allocated", "gpu-A"), ev(3, ALLOCATED, "started", "gpu-A"),
                        ev(4, ALLOCATED + 2 * HOUR, "completed", "gpu-A")], offset)
    put_usage(client, DB, [usage_record("c1", "gpu-A", ALLOCATED, ALLOCATED + 2 * HOUR, "executing", "job-1",
                                        "alpha")], offset)


def figures(rows):
    keys = ("day", "status", "attempts", "requested_gpu_seconds", "allocated_gpu_seconds", "executed_gpu_seconds",
            "waits", "queue_wait_max_s")
    return [{k: r[k] for k in keys} for r in rows]


def stored(client):
    return client.query(f"SELECT count() FROM {DB}.closed_queue_efficiency").result_rows[0][0]


@pytest.fixture
def ledger(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (client, settings):
        put_events(client, [ev(1, QUEUED, "queued")], 0)
        put_usage(client, DB, [usage_record("c1", "gpu-Z", DAY0 + 22 * HOUR, DAY0 + 26 * HOUR, "unallocated")], 0)
        yield client, settings, load_ledger_config(None)


def test_closed_cohort_shows_an_attempt_allocated_after_its_close(ledger):
    client, settings, led = ledger
    first = bills.close_due(client, settings, led, now=utc(2, 3))
    assert first.closed == {"c1": [D]}
    # requested: nothing was seen of the attempt after its queued event
    waiting = dict(day=D, status="closed", attempts=1, requested_gpu_seconds=0.0,
                   allocated_gpu_seconds=0.0, executed_gpu_seconds=0.0, waits=0, queue_wait_max_s=None)
    assert figures(reports.fetch(client, DB, "queues")) == [waiting]
    assert stored(client) == 2                       # all tenants ('') and alpha

    allocate_after_the_close(client, 10)
    second = bills.close_due(client, settings, led, now=utc(2, 11))
    assert second.closed == {} and second.adjustment_rows == 0   # the bills: nothing to correct
    revised = dict(day=D, status="closed", attempts=1, requested_gpu_seconds=pytest.approx(11 * 3600),
                   allocated_gpu_seconds=pytest.approx(7200), executed_gpu_seconds=pytest.approx(7200), waits=1,
                   queue_wait_max_s=pytest.approx(9 * 3600))
    assert figures(reports.fetch(client, DB, "queues")) == [revised], \
        "the closed cohort day does not show the attempt allocated after its close"
    assert figures(reports.fetch(client, DB, "queues", tenant="alpha")) == [revised]
    assert second.bill_run_id                        # committed by a run of its own
    live = [r for r in client.query(f"SELECT * FROM {DB}.queue_efficiency").named_results()]
    assert [(r["day"], r["allocated_gpu_seconds"], r["waits"], r["queue_wait_max_s"]) for r in live] == [
        (D, pytest.approx(7200), 1, pytest.approx(9 * 3600))]
    assert stored(client) == 4                       # append-only: the close's rows stay, the revision is added
    assert [r["tenant"] for r in reports.fetch(client, DB, "bills")] == ["alpha"]  # D+1's, open

    # nothing new: no queue row, no run
    third = bills.close_due(client, settings, led, now=utc(2, 12))
    assert third.bill_run_id is None and stored(client) == 4
    assert figures(reports.fetch(client, DB, "queues")) == [revised]


def test_cohort_day_before_the_look_back_keeps_its_last_figures(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600, bills_adjust_lookback_days=1) as (client, settings):
        led = load_ledger_config(None)
        put_events(client, [ev(1, QUEUED, "queued")], 0)
        put_usage(client, DB, [usage_record("c1", "gpu-Z", DAY0 + 22 * HOUR, DAY0 + 26 * HOUR, "unallocated")], 0)
        assert bills.close_due(client, settings, led, now=utc(2, 3)).closed == {"c1": [D]}
        put_usage(client, DB, [usage_record("c1", "gpu-Z", DAY0 + 26 * HOUR, DAY0 + 50 * HOUR, "unallocated")], 5)
        assert bills.close_due(client, settings, led, now=utc(3, 3)).closed == {"c1": [D + dt.timedelta(days=1)]}
        allocate_after_the_close(client, 10)   # D+1 is closed, and D is before the look-back of one day
        bills.close_due(client, settings, led, now=utc(3, 4))
        rows = figures(r for r in reports.fetch(client, DB, "queues") if r["day"] == D)
        assert [(r["status"], r["waits"], r["allocated_gpu_seconds"]) for r in rows] == [("closed", 0, 0.0)]


def test_a_cohort_day_with_an_attempt_still_running_waits_for_its_end(ledger):
    """Its figures grow while the attempt runs: revising them at every run would write the day's rows
    again at each close run for as long as the job lasts. They are revised once it has ended."""
    client, settings, led = ledger
    assert bills.close_due(client, settings, led, now=utc(2, 3)).closed == {"c1": [D]}
    put_events(client, [ev(2, ALLOCATED, "allocated", "gpu-A"), ev(3, ALLOCATED, "started", "gpu-A")], 10)
    put_usage(client, DB, [usage_record("c1", "gpu-A", ALLOCATED, ALLOCATED + HOUR, "executing", "job-1", "alpha")], 10)
    running = bills.close_due(client, settings, led, now=utc(2, 9))
    assert running.bill_run_id is None and stored(client) == 2, "a running attempt's cohort day was revised"
    put_events(client, [ev(4, ALLOCATED + 2 * HOUR, "completed", "gpu-A")], 20)
    put_usage(client, DB, [usage_record("c1", "gpu-A", ALLOCATED + HOUR, ALLOCATED + 2 * HOUR, "executing", "job-1",
                                        "alpha")], 20)
    assert bills.close_due(client, settings, led, now=utc(2, 11)).bill_run_id and stored(client) == 4
    assert [(r["waits"], r["allocated_gpu_seconds"]) for r in reports.fetch(client, DB, "queues")] == [
        (1, pytest.approx(7200))]
