"""The jobs report with a limit finds its jobs first (reports._top_job_keys), then reads their rows: on
the real engine (chDB), with random jobs over four days in two clusters (the same job ids in both), two
definition versions, replayed records (job_cost's own sums count them twice, the money once), equal costs (the order's later keys decide), jobs with attempts and no usage, days
closed by a bill run and a late record booked as an adjustment, the other days open; a carbon definition
and an intensity series for one cluster. Every limited
report equals the first rows of the same report without a limit, over every filter the periodic
reports and the CLI use."""

from __future__ import annotations

import datetime as dt
import math
import random

import pytest
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

from gpuledger import warehouse
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import JobEvent
from gpuledger.sink.rows import Source, job_event_row
from gpuledger.streams.carbondefs import CarbonDefinition
from gpuledger.warehouse import bills, carbon, reports

pytestmark = pytest.mark.integration

DB = "top_jobs"
DAY0 = dt.date(2026, 11, 10)
T0 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
DAYS = 4


def random_usage(rnd: random.Random, cluster: str) -> list:
    out = []
    for gpu in range(6):
        minute = rnd.randrange(30)
        while minute < DAYS * 1440:
            length = rnd.choice([10, 10, 30, 60, 240])  # equal lengths: equal costs
            state = rnd.choice(["executing", "executing", "allocated_idle", "unallocated"])
            job = f"job-{rnd.randrange(25)}" if state != "unallocated" else ""
            r = usage_record(cluster, f"{cluster}-gpu-{gpu}", T0 + minute * MIN, T0 + (minute + length) * MIN,
                             state, job, f"t{rnd.randrange(3)}" if job else "", energy=rnd.uniform(0, 1e5))
            if job and rnd.random() < 0.2:
                r = r.model_copy(update={"definition_version": "d2"})
            out.append(r)
            minute += length + rnd.choice([0, 0, 5])
    return out


def attempts_without_usage() -> list[JobEvent]:
    return [JobEvent(event_id=f"w{i}", ts_ms=T0 + i * MIN, kind="submitted", cluster="c1", job_id=f"waiting-{i}",
                     attempt=0, tenant="t1", queue="q", priority=0, requested_gpus=1.0, gpus=[]) for i in range(3)]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    rnd = random.Random(7)
    with migrated_warehouse(tmp_path_factory.mktemp("top-jobs"), DB, bills_close_grace_s=3600) as (client, settings):
        records = random_usage(rnd, "c1") + random_usage(rnd, "c2")
        for i in range(0, len(records), 40):
            put_usage(client, DB, records[i:i + 40], i)
        put_usage(client, DB, records[::7], 20_000)  # a replay: the bills count it once, job_cost's sums twice
        warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i))
                                                     for i, e in enumerate(attempts_without_usage())], database=DB)
        carbon.record_definition(client, DB, CarbonDefinition(version="c-test", pue=1.2, default_gco2e_per_kwh=400.0,
                                                              default_source="test"))
        carbon.load_intensity(client, DB, [{"zone": "c1", "valid_from_ms": T0, "gco2e_per_kwh": 300.0},
                                           {"zone": "c1", "valid_from_ms": T0 + 1500 * MIN, "gco2e_per_kwh": 500.0}],
                              "series.csv", "ops")
        # the first two days closed, then a late record for day 1 booked as an adjustment
        cfg = load_ledger_config(None)
        assert bills.close_due(client, settings, cfg, now=dt.datetime(2026, 11, 12, 3, tzinfo=dt.timezone.utc)).bill_run_id
        late = usage_record("c1", "c1-gpu-late", T0 + 600 * MIN, T0 + 900 * MIN, "executing", "job-3", "t0")
        put_usage(client, DB, [late], 10_000)
        assert bills.close_due(client, settings, cfg, now=dt.datetime(2026, 11, 12, 4, tzinfo=dt.timezone.utc)).bill_run_id
        yield client


FILTERS = [
    {},
    {"day_from": DAY0, "day_to": DAY0 + dt.timedelta(days=DAYS - 1)},
    {"day_from": DAY0 + dt.timedelta(days=1), "day_to": DAY0 + dt.timedelta(days=1)},
    {"day_from": DAY0 + dt.timedelta(days=3)},
    {"day_to": DAY0},
    {"day_from": DAY0 + dt.timedelta(days=2), "cluster": "c2"},
    {"cluster": "c1"},
    {"tenant": "t1", "day_from": DAY0},
    {"queue": "q", "day_to": DAY0 + dt.timedelta(days=2)},
    {"definition_version": "d2"},
    {"day_from": DAY0, "reference_cost_per_gpu_hour": 2.5},
]


def same(a: list[dict], b: list[dict]) -> bool:
    """Equal rows; floats to 1e-12 (the engine adds a job's energy in an order of its choosing)."""
    return len(a) == len(b) and all(x.keys() == y.keys() and all(
        math.isclose(x[k], y[k], rel_tol=1e-12) if isinstance(x[k], float) and isinstance(y[k], float) else x[k] == y[k]
        for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(sorted(f)) or "none")
def test_a_limited_jobs_report_is_the_first_rows_of_the_whole(ledger, filters):
    client = ledger
    whole = reports.fetch(client, DB, "jobs", **filters)
    assert len(whole) > 5
    for limit in (1, 3, 5, len(whole) - 1, len(whole) + 5):
        assert same(reports.fetch(client, DB, "jobs", limit=limit, **filters), whole[:limit]), limit


def test_the_data_has_what_the_order_must_decide(ledger):
    """Equal costs ordered by the later keys, a job in both clusters and under two versions, closed days,
    an adjustment, open days, jobs with no usage: the cases the test above needs to be able to fail."""
    rows = reports.fetch(ledger, DB, "jobs")
    costs = [r["cost"] for r in rows if r["cost"]]
    assert len(costs) > len(set(costs))
    assert {r["status"] for r in rows} == {"open", "closed"}
    keys = [(r["cluster"], r["job_id"], r["definition_version"]) for r in rows]
    assert any(k[1] == other[1] and k[0] != other[0] for k in keys for other in keys)
    assert any(k[:2] == other[:2] and k[2] != other[2] for k in keys for other in keys)
    assert any(r["first_day"] is None for r in rows)
    assert ledger.query(f"SELECT count() FROM {DB}.bill_adjustments").result_rows[0][0] > 0


@pytest.mark.parametrize("name,filters", [("jobs", {}), ("jobs", {"day_from": DAY0, "limit": 5}),
                                          ("jobs", {"job_id": "job-3"}), ("bills", {}),
                                          ("bills", {"day_from": DAY0 + dt.timedelta(days=2)})])
def test_without_carbon_the_same_rows_with_carbon_left_empty(ledger, name, filters):
    """reports.without_carbon (the periodic reports, which show no carbon): the same rows, money and
    order, with co2e_kg and carbon_version empty."""
    full = reports.fetch(ledger, DB, name, **filters)
    with reports.without_carbon():
        bare = reports.fetch(ledger, DB, name, **filters)
    assert any(r["co2e_kg"] for r in full)
    assert all(r["co2e_kg"] is None and r["carbon_version"] is None for r in bare)
    def strip(rows):
        return [{k: v for k, v in r.items() if k not in ("co2e_kg", "carbon_version")} for r in rows]
    assert same(strip(bare), strip(full))
