"""The reads that a period's reports make cheaper than the views they stand for, against those views on
the real engine (chDB), on random attempts in two clusters (the same job ids in both), two definition
versions, failed, completed and still running attempts (a running one's usage outlasts its last event),
jobs with usage and no attempts and attempts with no usage; the first day closed by a bill run, the
second open with replayed records (its hourly sums count them twice, so it is read raw) and an
adjustment of the first booked into it, the third open and exact (read from usage_by_job_hourly):
- the queues report's open cohorts, with the exact days' usage summed from the hourly sums and the
  running attempts' last ends from job_gpu_usage, equal the same report read from usage_raw alone;
- the periodic reports' jobs (period_job_rows: money on the period's days only) add up to the
  period's bills, equal the jobs report's money over every day, and the top, largest and flagged
  lists are their rows."""

from __future__ import annotations

import datetime as dt
import math
import random

import pytest
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import GpuAssignment, JobEvent
from gpuledger.sink.rows import Source, job_event_row
from gpuledger.warehouse import bills, reports
from gpuledger.warehouse.periodic import queries as pr_queries

pytestmark = pytest.mark.integration

DB = "period_reads"
DAY0 = dt.date(2026, 11, 10)
T0 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
DAY_MS = 1440 * MIN
DAYS = 3


def random_jobs(rnd: random.Random, cluster: str) -> tuple[list, list[JobEvent]]:
    """(usage records, job events) of random attempts in one cluster."""
    records, events = [], []
    for k in range(24):
        job, tenant, queue = f"job-{k}", f"t{rnd.randrange(3)}", f"q{rnd.randrange(2)}"
        dv = "d2" if rnd.random() < 0.2 else "d1"
        rate = rnd.choice([1, 2, 5])  # micros per GPU-second: costs not in the order of GPU-hours
        for attempt in range(rnd.choice([1, 1, 2])):
            start = T0 + rnd.randrange(0, DAYS * 1440 - 300, 30) * MIN
            length = rnd.choice([60, 120, 240, 480])  # from a few lengths: equal GPU-hours, ties to order
            end = min(start + length * MIN, T0 + DAYS * DAY_MS)
            gpus = [f"{cluster}-{job}-{attempt}-{i}" for i in range(rnd.choice([1, 2]))]
            outcome = rnd.choice(["completed", "completed", "failed", None])  # None: still running
            n = len(events)

            def ev(i: int, ts: int, kind: str, assigned: bool = False) -> JobEvent:
                return JobEvent(event_id=f"{cluster}-{n + i}", ts_ms=ts, kind=kind, cluster=cluster, job_id=job,
                                attempt=attempt, tenant=tenant, queue=queue, requested_gpus=float(len(gpus)),
                                gpus=[GpuAssignment(node="n1", gpu_uuid=g) for g in gpus] if assigned else [])
            events += [ev(0, start - rnd.randrange(0, 90) * MIN, "queued"), ev(1, start, "allocated", True),
                       ev(2, start, "started", True)]
            if outcome:
                events.append(ev(3, end, outcome, True))
            for gpu in gpus:
                t = start
                while t < end:
                    step = min(rnd.choice([10, 30, 60]) * MIN, end - t)
                    state = rnd.choice(["executing", "executing", "allocated_idle"])
                    r = usage_record(cluster, gpu, t, t + step, state, job, tenant)
                    records.append(r.model_copy(update={"attempt": attempt, "queue": queue, "definition_version": dv,
                                                        "cost_micros": r.cost_micros * rate}))
                    t += step
    for i in range(3):  # usage of a job no scheduler event named, and attempts still waiting
        records.append(usage_record(cluster, f"{cluster}-orphan-{i}", T0 + (600 + i) * MIN, T0 + (900 + i) * MIN,
                                    "allocated_idle", f"orphan-{i}", "t9"))
        events.append(JobEvent(event_id=f"{cluster}-w{i}", ts_ms=T0 + (i + 1) * DAY_MS + MIN, kind="queued",
                               cluster=cluster, job_id=f"waiting-{i}", attempt=0, tenant="t1", queue="q0",
                               requested_gpus=1.0, gpus=[]))
    return records, events


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    rnd = random.Random(11)
    with migrated_warehouse(tmp_path_factory.mktemp("period-reads"), DB, bills_close_grace_s=3600) as (client, settings):
        records, events = [], []
        for cluster in ("c1", "c2"):
            r, e = random_jobs(rnd, cluster)
            records += r
            events += e
        warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(events)],
                              database=DB)
        # the usage up to 02:00 of day 1 first, and day 0 closed (the clusters' horizon is then past its
        # end and the grace); the rest after, so that day 1 stays open
        early = [r for r in records if r.end_ms <= T0 + DAY_MS + 120 * MIN]
        late = [r for r in records if r.end_ms > T0 + DAY_MS + 120 * MIN]
        for i in range(0, len(early), 50):
            put_usage(client, DB, early[i:i + 50], i)
        cfg = load_ledger_config(None)
        assert bills.close_due(client, settings, cfg, now=dt.datetime(2026, 11, 13, tzinfo=dt.timezone.utc)).closed
        # a late record of a closed day: an adjustment booked into day 1 (the jobs report's money counts it)
        late_record = usage_record("c1", "c1-late", T0 + 600 * MIN, T0 + 700 * MIN, "executing", "job-3", "t0")
        put_usage(client, DB, [late_record], 9_000)
        assert bills.close_due(client, settings, cfg, now=dt.datetime(2026, 11, 13, tzinfo=dt.timezone.utc)).adjustment_rows
        for i in range(0, len(late), 50):
            put_usage(client, DB, late[i:i + 50], 10_000 + i)
        day1 = [r for r in records if T0 + DAY_MS <= r.start_ms < T0 + 2 * DAY_MS]
        put_usage(client, DB, day1[::4], 50_000)  # replayed: day 1's hourly sums count these twice
        yield client


def test_the_data_has_what_the_reads_must_get_right(ledger):
    """Day 1 open and read raw, day 2 open and exact, day 0 closed; running attempts whose usage on the
    exact day outlasts their last event; failed attempts; ties in GPU-hours."""
    days = bills.days_between(DAY0 + dt.timedelta(days=1), DAY0 + dt.timedelta(days=DAYS - 1))  # the open days
    exact = bills.exact_hourly_days(ledger, DB, {"c1": days, "c2": days})
    assert exact == {"c1": [DAY0 + dt.timedelta(days=2)], "c2": [DAY0 + dt.timedelta(days=2)]}
    closed = ledger.query(f"SELECT DISTINCT day FROM {DB}.closed_days").result_rows
    assert closed == [(DAY0,)]
    outlasting = ledger.query(f"""
        SELECT count() FROM {DB}.job_attempts AS a
        INNER JOIN (SELECT cluster, job_id, attempt, max(last_end_ms) AS e FROM {DB}.job_gpu_usage GROUP BY ALL) AS u
          ON a.cluster = u.cluster AND a.job_id = u.job_id AND a.attempt = u.attempt
        WHERE a.ended_ms IS NULL AND u.e > a.last_seen_ms
          AND toDate(fromUnixTimestamp64Milli(u.e, 'UTC')) = {{d:Date}}
          AND toDate(fromUnixTimestamp64Milli(coalesce(a.queued_ms, a.first_seen_ms), 'UTC')) >= {{d0:Date}}""",
        parameters={"d": DAY0 + dt.timedelta(days=2), "d0": DAY0 + dt.timedelta(days=1)}).result_rows[0][0]
    assert outlasting > 0
    assert ledger.query(f"SELECT countIf(failed_attempts > 0), count() - uniqExact(gpu_hours) FROM {DB}.job_cost"
                        ).result_rows[0] >= (3, 3)


QUEUE_FILTERS = [{}, {"tenant": "t1"}, {"cluster": "c2"}, {"day_from": DAY0 + dt.timedelta(days=1)},
                 {"day_from": DAY0, "day_to": DAY0 + dt.timedelta(days=1)}, {"day_from": DAY0 + dt.timedelta(days=2)}]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(
        math.isclose(x[k], y[k], rel_tol=1e-12) if isinstance(x[k], float) and isinstance(y[k], float) else x[k] == y[k]
        for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("filters", QUEUE_FILTERS, ids=lambda f: ",".join(sorted(f)) or "none")
def test_queues_report_equals_the_read_of_usage_raw_alone(ledger, filters, monkeypatch):
    fast = reports.fetch(ledger, DB, "queues", **filters)
    with monkeypatch.context() as m:  # no day's hourly sums trusted: every open cohort read from usage_raw
        m.setattr(bills, "exact_hourly_days", lambda *args, **kwargs: {})
        raw = reports.fetch(ledger, DB, "queues", **filters)
    assert any(r["status"] == "open" for r in raw) or filters.get("day_to") == DAY0
    assert same(fast, raw)


def test_queues_report_over_closed_days_reads_no_usage(ledger, monkeypatch):
    """A range of closed days has no open cohort: its live part reads no usage row (an empty cohort's
    first day used to be 1970-01-01, and all of usage_raw was read FINAL: 3-4 s at 100 M records).
    Its query may read fewer rows in all than usage_raw holds (the old one read them all and more)."""
    usage_rows = ledger.query(f"SELECT count() FROM {DB}.usage_raw").result_rows[0][0]
    query = ledger.query

    def bounded(sql, parameters=None, settings=None, **kwargs):
        if "closed_queue_efficiency" in sql:
            settings = {**(settings or {}), "max_rows_to_read": usage_rows - 1, "read_overflow_mode": "throw"}
        return query(sql, parameters=parameters, settings=settings, **kwargs)

    monkeypatch.setattr(ledger, "query", bounded)
    rows = reports.fetch(ledger, DB, "queues", day_to=DAY0)
    assert rows and all(r["status"] == "closed" for r in rows)


def test_exactness_counted_once_per_open_day(ledger, monkeypatch):
    """The exactness count (usage_raw FINAL) is made for open days only, and in one_reading each
    cluster's day once, whichever reports ask."""
    asked: list[tuple[str, dt.date]] = []
    count = bills.exact_hourly_days

    def counting(client, db, days, **options):
        asked.extend((c, d) for c, ds in days.items() for d in ds)
        return count(client, db, days, **options)

    monkeypatch.setattr(bills, "exact_hourly_days", counting)
    reports.fetch(ledger, DB, "queues", cluster="c2", day_to=DAY0)
    assert asked == [("c2", DAY0 + dt.timedelta(days=1)), ("c2", DAY0 + dt.timedelta(days=2))]
    asked.clear()
    with reports.one_reading():
        for filters in QUEUE_FILTERS:
            reports.fetch(ledger, DB, "queues", **filters)
        reports.fetch(ledger, DB, "bills")
        reports.fetch(ledger, DB, "jobs")
    open_days = [(c, DAY0 + dt.timedelta(days=k)) for c in ("c1", "c2") for k in (1, 2)]
    assert sorted(asked) == open_days


PERIODS = [(DAY0, DAY0 + dt.timedelta(days=2)), (DAY0 + dt.timedelta(days=1), DAY0 + dt.timedelta(days=1)),
           (DAY0 + dt.timedelta(days=2), DAY0 + dt.timedelta(days=9)), (DAY0, DAY0)]


def period_bills(ledger, start, end) -> dict[tuple[str, str], list[float]]:
    """The bills report over [start, end] per cluster and definition version: [cost, failed-retry cost]."""
    out: dict[tuple[str, str], list[float]] = {}
    for b in reports.fetch(ledger, DB, "bills", day_from=start, day_to=end):
        acc = out.setdefault((b["cluster"], b["definition_version"]), [0.0, 0.0])
        acc[0] += b["total_cost"]
        acc[1] += b["failed_retry_cost"]
    return out


@pytest.mark.parametrize("start,end", PERIODS)
def test_period_jobs_add_up_to_the_periods_bills(ledger, start, end):
    """A period's jobs are priced on its days only, as the bills are (closed rows, the adjustment booked
    in it, the open days each record once): per cluster and version they add up to the period's bills;
    every failed attempt's executing time is failed-retry there, and its cost is in failed_cost."""
    with reports.one_reading(), reports.without_carbon():
        rows = pr_queries.period_job_rows(ledger, DB, start, end)
    bills_of = period_bills(ledger, start, end)
    assert rows and bills_of
    got: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        acc = got.setdefault((r["cluster"], r["definition_version"]), [0.0, 0.0])
        acc[0] += r["cost"]
        acc[1] += r["failed_cost"]
        assert 0 <= r["failed_cost"] <= r["cost"] + 1e-9 and (r["failed_cost"] > 0) <= (r["failed_attempts"] > 0)
    assert got.keys() == bills_of.keys()
    for key, (cost, failed_cost) in bills_of.items():
        assert got[key][0] == pytest.approx(cost, abs=1e-9), key
        assert got[key][1] >= failed_cost - 1e-9, key  # failed attempts' idle too
    assert rows == sorted(rows, key=lambda r: (-r["cost"], -r["gpu_hours"], r["cluster"], r["job_id"],
                                               r["definition_version"]))


def test_period_jobs_over_every_day_are_the_jobs_reports_money(ledger):
    """Over every day with usage, each job's money is the jobs report's (which reads all of it)."""
    with reports.one_reading(), reports.without_carbon():
        rows = pr_queries.period_job_rows(ledger, DB, DAY0, DAY0 + dt.timedelta(days=DAYS))
    whole = {(r["cluster"], r["job_id"], r["definition_version"]): r for r in reports.fetch(ledger, DB, "jobs")}
    assert rows
    for r in rows:
        j = whole[(r["cluster"], r["job_id"], r["definition_version"])]
        for col in ("cost", "gpu_hours", "idle_gpu_hours", "effective_gpu_hours"):
            assert r[col] == pytest.approx(j[col], abs=1e-9), (r["job_id"], col)


@pytest.mark.parametrize("start,end", PERIODS)
def test_top_largest_and_flagged_are_period_rows(ledger, start, end):
    with reports.one_reading(), reports.without_carbon():
        rows = pr_queries.period_job_rows(ledger, DB, start, end)
        for top in (1, 3, 500):
            # the query that keeps the first `top` rows gives those rows, currencies included
            assert pr_queries.period_job_rows(ledger, DB, start, end, top=top) == rows[:top]
            first, flagged = pr_queries.period_jobs(ledger, DB, start, end, top)
            assert first == [{c: r[c] for c in pr_queries.TOP_JOB_COLUMNS} for r in rows[:top]] and flagged == []
            largest = pr_queries.largest_jobs(ledger, DB, start, end, top)
            by_hours = sorted(rows, key=lambda r: (-r["gpu_hours"], r["job_id"], r["cluster"], r["definition_version"]))
            assert [r["job_id"] for r in largest] == [r["job_id"] for r in by_hours[:top]]
        for share in (0.1, 0.6):
            _, got = pr_queries.period_jobs(ledger, DB, start, end, 3, share)
            expected = [r for r in rows if r["failed_attempts"] > 0 or r["idle_share"] > share]
            assert [(g["job_id"], g["cost"], g["job_cost"]) for g in got] == [
                (r["job_id"], r["failed_cost"], r["cost"]) for r in expected], share
            assert any(r["tenant"] == "t9" for r in got) or start > DAY0  # a job known from its usage alone
