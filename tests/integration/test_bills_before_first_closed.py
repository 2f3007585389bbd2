"""Late usage of a day before a cluster's first closed day is closed by the next run (docs/accounting.md
§6a), not left open for ever: the day was never closed, so closing it changes no bill."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_first"
MIN = 60_000
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def day_ms(d: dt.date) -> int:
    return int(dt.datetime.combine(d, dt.time(), dt.timezone.utc).timestamp() * 1000)


def test_late_usage_before_the_first_closed_day_is_closed_next_run(tmp_path):
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        mar1 = day_ms(dt.date(2024, 3, 1)) + 3_600_000
        put_usage(c, DB, [usage_record("c1", "g1", mar1, mar1 + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", mar1 + 86_400_000, mar1 + 86_400_000 + 2 * 3_600_000, "unallocated")], 0)
        assert bills.close_due(c, s, ledger, now=NOW).closed == {"c1": [dt.date(2024, 3, 1)]}
        # a spool drained: usage of 28 and 29 Feb, and of later days
        feb28 = day_ms(dt.date(2024, 2, 28)) + 3_600_000
        put_usage(c, DB, [usage_record("c1", "g2", feb28, feb28 + 30 * MIN, "executing", "j0", "alpha"),
                          usage_record("c1", "g1", day_ms(dt.date(2024, 3, 5)), day_ms(dt.date(2024, 3, 5)) + 3_600_000,
                                       "unallocated")], 1)
        run = bills.close_due(c, s, ledger, now=NOW)
        assert run.closed == {"c1": [dt.date(2024, 2, 28), dt.date(2024, 2, 29), dt.date(2024, 3, 2),
                                     dt.date(2024, 3, 3), dt.date(2024, 3, 4)]}
        assert run.adjustment_rows == 0
        assert {(m.day, m.kind, m.cost_micros) for m in run.messages} == {("2024-02-28", "closed", 1800)}
        rows = reports.fetch(c, DB, "bills")
        assert [(r["day"], r["status"], r["total_cost_micros"]) for r in rows] == [
            (dt.date(2024, 2, 28), "closed", 1800), (dt.date(2024, 3, 1), "closed", 600)]
        # 1 March's closed rows are as they were, and nothing more to do
        again = bills.close_due(c, s, ledger, now=NOW)
        assert again.closed == {} and again.adjustment_rows == 0 and again.bill_run_id is None


def test_days_whose_closed_rows_expired_are_not_closed_again():
    from gpuledger.warehouse.retention import closed_rows_kept_from

    # rows of a month expire N days after its last day (toLastDayOfMonth(day) + N)
    assert closed_rows_kept_from(0, dt.date(2026, 1, 1)) == dt.date.min
    assert closed_rows_kept_from(10, dt.date(2024, 4, 10)) == dt.date(2024, 4, 1)   # 31 Mar + 10 = 10 Apr: gone
    assert closed_rows_kept_from(10, dt.date(2024, 4, 9)) == dt.date(2024, 3, 1)    # 10 Apr: not yet
