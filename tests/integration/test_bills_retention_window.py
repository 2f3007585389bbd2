"""With GPULEDGER_RETENTION_BILLS_DAYS, a close run neither closes again nor adjusts a day whose closed rows
have expired (docs/accounting.md §6a, docs/retention.md): a month's closed rows expire N days after its
last day, their monthly part dropped whole (ttl_only_drop_parts), while the markers (closed_days,
bill_runs) expire at their own merges, later or also.

The expiry is simulated as the TTL merge does it (DROP PARTITION of October's parts), so that the run's
`now` can be chosen: retention 70 days, 30 October 2026 closed; on 10 January 2027 the first day whose
closed rows are kept is 1 November (31 October + 70 days = 9 January)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_retention"
MIN = 60_000
HOUR = 3_600_000
D = dt.date(2026, 10, 30)
#: the monthly tables of the bills retention
BILLS_MONTHLY = ("closed_job_cost", "closed_tenant_bill", "closed_energy", "closed_queue_efficiency",
                 "usage_by_job_daily", "usage_capacity_daily")
LATER = dt.datetime(2027, 1, 10, 4, tzinfo=dt.timezone.utc)
#: the UTC day before October's TTL date (9 January): a server east of UTC (up to +14 h) has reached it, its TTL
#: date being midnight in the server's time zone, so October's closed rows may be gone already
EVE = dt.datetime(2027, 1, 8, 20, tzinfo=dt.timezone.utc)


def day_ms(d: dt.date) -> int:
    return int(dt.datetime.combine(d, dt.time(), dt.timezone.utc).timestamp() * 1000)


@pytest.fixture
def closed_october(tmp_path):
    """30 October closed (alpha 600 micros), then October's closed rows expired; usage of 9 January."""
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600, retention_bills_days=70) as (c, s):
        b = day_ms(D) + HOUR
        put_usage(c, DB, [usage_record("c1", "g1", b, b + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", day_ms(D) + 86_400_000, day_ms(D) + 86_400_000 + 2 * HOUR,
                                       "unallocated")], 0)
        assert bills.close_due(c, s, ledger, now=dt.datetime(2026, 10, 31, 4, tzinfo=dt.timezone.utc)).closed == {"c1": [D]}
        for table in BILLS_MONTHLY:  # as the TTL merge drops October's part whole
            c.command(f"ALTER TABLE {DB}.{table} DROP PARTITION 202610")
        jan9 = day_ms(dt.date(2027, 1, 9))
        put_usage(c, DB, [usage_record("c1", "g1", jan9, jan9 + 2 * HOUR, "unallocated")], 1)
        yield c, s, ledger


@pytest.mark.parametrize("now", [LATER, EVE], ids=["after", "utc-eve"])
def test_a_cluster_whose_closed_days_all_expired_is_not_closed_again(closed_october, now):
    c, s, ledger = closed_october
    for table in ("closed_days", "bill_runs"):  # the markers have expired too: nothing reads closed
        c.command(f"ALTER TABLE {DB}.{table} DELETE WHERE 1 SETTINGS mutations_sync = 1")
    run = bills.close_due(c, s, ledger, now=now)
    assert run.closed["c1"][0] == dt.date(2026, 11, 1), "closed from the first day whose closed rows are kept"
    assert [(m.day, m.tenant, m.cost_micros) for m in run.messages] == [], "nothing of October published again"
    assert c.query(f"SELECT count() FROM {DB}.closed_tenant_bill").result_rows[0][0] == 0
    assert reports.fetch(c, DB, "bills", tenant="alpha") == []


@pytest.mark.parametrize("now", [LATER, EVE], ids=["after", "utc-eve"])
def test_a_day_whose_closed_rows_expired_before_its_marker_is_not_booked_again(closed_october, now):
    c, s, ledger = closed_october
    # 30 October's closed_days marker is still there: the day reads closed, with no closed rows
    assert c.query(f"SELECT count() FROM {DB}.closed_days WHERE day = '{D}'").result_rows[0][0] == 1
    run = bills.close_due(c, s, ledger, now=now)
    assert run.adjustment_rows == 0, "30 October's usage re-booked as an adjustment"
    assert c.query(f"SELECT count() FROM {DB}.bill_adjustments").result_rows[0][0] == 0
    assert run.closed["c1"][0] == dt.date(2026, 11, 1)  # 31 October's closed rows would have expired too
    assert [m for m in run.messages if m.tenant] == []
