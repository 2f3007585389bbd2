"""With GPULEDGER_RETENTION_BILLS_DAYS, a closed day's markers (closed_days, bill_runs) expire no sooner
than the closed rows they commit, and a day with committed closed rows is never read as open: a day
reads closed or open, never both (docs/retention.md, docs/accounting.md §6a)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, migrations, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "ret_markers"
MIN = 60_000


def day_ms(d: dt.date) -> int:
    return int(dt.datetime.combine(d, dt.time(), dt.timezone.utc).timestamp() * 1000)


def statuses(c):
    return [(r["day"], r["status"], r["total_cost_micros"]) for r in reports.fetch(c, DB, "bills", tenant="alpha")]


def test_markers_expire_with_the_month_of_the_rows_they_commit(tmp_path):
    today = dt.datetime.now(dt.timezone.utc).date()
    # closed_days of 1-2 March would expire today counted from their day; the month's rows on 31 March + N
    n = (today - dt.date(2024, 3, 3)).days
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600, retention_bills_days=n) as (c, s):
        b = day_ms(dt.date(2024, 3, 1)) + 3_600_000
        put_usage(c, DB, [usage_record("c1", "g1", b, b + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", day_ms(dt.date(2024, 3, 5)), day_ms(dt.date(2024, 3, 5)) + 7_200_000,
                                       "unallocated")], 0)
        bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 5, 2, tzinfo=dt.timezone.utc))
        assert statuses(c) == [(dt.date(2024, 3, 1), "closed", 600)]
        migrations.migrate_configured(c, s)  # sets the TTLs
        for table in ("closed_days", "closed_tenant_bill", "bill_runs", "usage_capacity_daily"):
            c.command(f"OPTIMIZE TABLE {DB}.{table} FINAL")
        assert c.query(f"SELECT count() FROM {DB}.closed_days WHERE day = '2024-03-01'").result_rows[0][0] == 1
        assert statuses(c) == [(dt.date(2024, 3, 1), "closed", 600)]
        # nothing to close again
        again = bills.close_due(c, s, ledger, now=dt.datetime.now(dt.timezone.utc))
        assert again.closed == {} and again.adjustment_rows == 0


def test_a_day_with_committed_closed_rows_is_not_open_without_its_marker(tmp_path):
    # TTLs are applied at each table's own merges: the marker may go first; the day must not read twice
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        b = day_ms(dt.date(2024, 3, 1)) + 3_600_000
        put_usage(c, DB, [usage_record("c1", "g1", b, b + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", day_ms(dt.date(2024, 3, 3)), day_ms(dt.date(2024, 3, 3)) + 7_200_000,
                                       "unallocated")], 0)
        bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 3, 2, tzinfo=dt.timezone.utc))
        c.command(f"ALTER TABLE {DB}.closed_days DELETE WHERE day = '2024-03-01' SETTINGS mutations_sync = 1")
        open_days = bills.days_by_cluster(c, bills.open_days_sql(DB))
        assert dt.date(2024, 3, 1) not in open_days.get("c1", [])
        assert statuses(c) == [(dt.date(2024, 3, 1), "closed", 600)]
        assert bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 3, 3, tzinfo=dt.timezone.utc)).closed == {}
        assert statuses(c) == [(dt.date(2024, 3, 1), "closed", 600)]
