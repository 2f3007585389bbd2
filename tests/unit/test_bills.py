"""The pure parts of closing (gpuledger/warehouse/bills.py): lines, due days, the adjustment diff, the bills
topic's rows, and the UTC labels of the reports. No warehouse."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.warehouse import bills
from gpuledger.warehouse.report_text import render, utc_labels
from gpuledger.schemas.models import BillRow

D = dt.date(2024, 3, 1)
DAY_MS = 86_400_000
END_D = 1709337600000  # 2024-03-02T00:00Z = end of D


def test_lines_follow_the_tenant_bill():
    assert bills.line_of("allocated_idle", "failed") == "idle"
    assert bills.line_of("executing", "failed") == "failed_retry"
    for outcome in ("", "completed", "preempted", "cancelled"):
        assert bills.line_of("executing", outcome) == "compute"


@pytest.mark.parametrize("horizon, grace_s, due", [
    (END_D + 6 * 3600_000, 6 * 3600, D),                       # exactly end + grace: closes
    (END_D + 6 * 3600_000 - 1, 6 * 3600, D - dt.timedelta(days=1)),  # a millisecond short: not yet
    (END_D, 0, D),
    (END_D + DAY_MS + 5 * 3600_000, 6 * 3600, D),              # D+1 needs until 06:00 of D+2
    (0, 0, None),
])
def test_last_due_day(horizon, grace_s, due):
    assert bills.last_due_day(horizon, grace_s) == due
    if due is not None:
        assert bills.day_end_ms(due) + grace_s * 1000 <= horizon < bills.day_end_ms(due + dt.timedelta(days=1)) + grace_s * 1000


def basis(state, gpu_ms, job="j", attempt=0, tenant="t", queue="q", day=D, eff=None, cost=None):
    return dict(day=day, cluster="c", tenant=tenant, queue=queue, job_id=job, attempt=attempt,
                definition_version="v1", state=state, gpu_ms=gpu_ms,
                effective_gpu_ms=gpu_ms * 2 if eff is None else eff, cost_micros=gpu_ms if cost is None else cost)


def key(line, job="j", attempt=0, day=D):
    return (day, "c", "t", "q", job, attempt, "v1", line)


def test_job_and_tenant_lines():
    lines = bills.job_lines([basis("executing", 10), basis("allocated_idle", 5), basis("executing", 7, job="k"),
                             basis("executing", 3)], {("c", "k", 0): "failed"})
    assert lines == {key("compute"): [13, 26, 13], key("idle"): [5, 10, 5], key("failed_retry", "k"): [7, 14, 7]}
    assert bills.tenant_lines(lines) == {(D, "c", "t", "q", "compute", "v1"): [13, 26, 13],
                                         (D, "c", "t", "q", "idle", "v1"): [5, 10, 5],
                                         (D, "c", "t", "q", "failed_retry", "v1"): [7, 14, 7]}


def test_nothing_changed_books_nothing():
    now = {key("compute"): [10, 20, 10], key("idle"): [5, 10, 5]}
    assert bills.diff_adjustments(dict(now), now, {}) == []


def test_a_late_failure_moves_compute_to_failed_retry():
    booked = {key("compute"): [10, 20, 10], key("idle"): [5, 10, 5]}
    now = {key("failed_retry"): [10, 20, 10], key("idle"): [5, 10, 5]}
    assert bills.diff_adjustments(booked, now, {("c", "j", 0): "failed"}) == [
        (key("compute"), bills.LATE_OUTCOME, [-10, -20, -10]),
        (key("failed_retry"), bills.LATE_OUTCOME, [10, 20, 10])]


def test_late_samples_and_a_late_outcome_together():
    booked = {key("compute"): [10, 20, 10]}
    now = {key("failed_retry"): [16, 32, 16], key("idle"): [2, 4, 2]}
    got = bills.diff_adjustments(booked, now, {("c", "j", 0): "failed"})
    assert got == [(key("compute"), bills.LATE_OUTCOME, [-10, -20, -10]),
                   (key("failed_retry"), bills.LATE_OUTCOME, [10, 20, 10]),
                   (key("failed_retry"), bills.LATE_SAMPLES, [6, 12, 6]),
                   (key("idle"), bills.LATE_SAMPLES, [2, 4, 2])]
    # booked + adjustments == now, line by line, and a second diff is empty
    after = {k: list(v) for k, v in booked.items()}
    for k, _reason, amount in got:
        after[k] = [a + b for a, b in zip(after.get(k, [0, 0, 0]), amount)]
    assert {k: v for k, v in after.items() if any(v)} == now
    assert bills.diff_adjustments(after, now, {("c", "j", 0): "failed"}) == []


def test_usage_of_a_new_attempt_on_a_closed_day_is_late_samples():
    got = bills.diff_adjustments({}, {key("compute", job="new"): [1, 2, 3]}, {})
    assert got == [(key("compute", job="new"), bills.LATE_SAMPLES, [1, 2, 3])]


def test_bill_messages_are_valid_rows():
    closed = [dict(day=D, cluster="c", tenant="t", queue="q", line="compute", definition_version="v1", gpu_ms=10,
                   effective_gpu_ms=20, cost_micros=10, currency="EUR")]
    adj = [dict(booked_day=D + dt.timedelta(days=1), corrects_day=D, cluster="c", tenant="t", queue="q",
                line=line, reason=bills.LATE_OUTCOME, definition_version="v1", gpu_ms=g, effective_gpu_ms=2 * g,
                cost_micros=g, currency="EUR", job_id=job) for line, g, job in
           (("compute", -10, "a"), ("failed_retry", 10, "a"), ("failed_retry", 5, "b"), ("failed_retry", -5, "c"))]
    rows = bills.bill_messages("br-1", closed, adj)
    assert all(isinstance(r, BillRow) for r in rows)
    assert [(r.kind, r.day, r.line, r.cost_micros, r.corrects_day, r.reason) for r in rows] == [
        ("closed", "2024-03-01", "compute", 10, None, None),
        ("adjustment", "2024-03-02", "compute", -10, "2024-03-01", bills.LATE_OUTCOME),
        ("adjustment", "2024-03-02", "failed_retry", 10, "2024-03-01", bills.LATE_OUTCOME)]
    assert {r.currency for r in rows} == {"EUR"}
    with pytest.raises(ValueError):
        BillRow(kind="closed", bill_run_id="x", day="1.3.2024", cluster="c", tenant="t", queue="q", line="compute",
                definition_version="v1", gpu_ms=0, effective_gpu_ms=0, cost_micros=0, currency="EUR")


def test_reports_label_days_as_utc_in_every_format():
    rows = [{"day": D, "status": "closed", "tenant": "t", "currency": "USD", "total_cost_micros": 5,
             "corrects_day": None}]
    assert list(utc_labels(rows)[0]) == ["day_utc", "status", "tenant", "currency", "total_cost_micros",
                                         "corrects_day_utc"]
    assert render(rows, "table", utc_days=True).split()[0] == "day_utc"
    assert render(rows, "csv", utc_days=True).startswith("day_utc,status,tenant,currency,")
    assert '"day_utc": "2024-03-01"' in render(rows, "json", utc_days=True)
    assert render(rows, "csv").startswith("day,")  # the Python API keeps `day`


def test_diff_amounts_books_exact_differences_only():
    day = dt.date(2026, 11, 10)
    k1 = (day, "c", 493_000, "t", "q", "j1", 0, "d1", "executing")
    k2 = (day, "c", 493_001, "t", "q", "j1", 0, "d1", "allocated_idle")
    k3 = (day, "c", 493_001, "t", "q", "j2", 0, "d1", "executing")
    booked = {k1: [36_000_000, 1], k2: [5, 1]}
    now = {k1: [36_000_000, 1], k2: [5, 2], k3: [7, 1]}
    # k1 unchanged: nothing; k2: one more record of 0 mJ; k3: new
    assert bills.diff_amounts(booked, now) == [(k2, [0, 1]), (k3, [7, 1])]
    assert bills.diff_amounts(now, now) == []
    # a record gone from the usage (expired, deleted) is written back out
    assert bills.diff_amounts(booked, {k1: [36_000_000, 1]}) == [(k2, [-5, -1])]


def test_report_day_filters_take_the_utc_day_of_an_aware_datetime():
    """Report days are UTC: 2 March 01:00 at UTC+5 is 1 March 20:00 UTC, so the filter is 1 March (its
    local date selected the next day); a date, and a naive datetime, are taken as they are."""
    from gpuledger.warehouse import reports

    at_plus5 = dt.datetime(2024, 3, 2, 1, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    assert reports._where({"day_from": at_plus5}, ["day_from"])[1] == {"day_from": D}
    assert reports._where({"day_to": dt.datetime(2024, 3, 1, 23)}, ["day_to"])[1] == {"day_to": D}
    assert reports._where({"day_to": D}, ["day_to"])[1] == {"day_to": D}
