"""`report bills` through the Python API (reports.fetch) takes `limit` as every other report does: a
non-negative integer, 0 rows for 0, an error for anything else (gpuledger/warehouse/reports.py)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.warehouse import reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_edges"
MIN = 60_000
B = int(dt.datetime(2024, 3, 1, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)


def test_bills_limit_is_checked_as_the_other_reports_check_it(tmp_path):
    with migrated_warehouse(tmp_path, DB) as (c, _):
        put_usage(c, DB, [usage_record("c1", "g1", B, B + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g2", B, B + 20 * MIN, "executing", "j2", "beta")], 0)
        assert len(reports.fetch(c, DB, "bills")) == 2
        assert len(reports.fetch(c, DB, "bills", limit=1)) == 1
        assert reports.fetch(c, DB, "bills", limit=0) == [], "limit 0 gave every row"
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(ValueError, match="limit must be a non-negative integer"):
                reports.fetch(c, DB, "bills", limit=bad)  # -1 dropped the last row in silence


def test_bills_list_limit_is_checked_before_the_query(tmp_path):
    """`gpuledger bills list --limit -3` gave ClickHouse's BAD_QUERY_PARAMETER, --limit 0 every run."""
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import bills

    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=0) as (c, s):
        put_usage(c, DB, [usage_record("c1", "g1", B, B + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g2", B + 86_400_000, B + 86_400_000 + MIN, "unallocated")], 0)
        assert bills.close_due(c, s, load_ledger_config(None), now=dt.datetime(2024, 3, 3, tzinfo=dt.timezone.utc)
                               ).bill_run_id
        assert len(bills.list_runs(c, DB)) == len(bills.list_runs(c, DB, limit=1)) == 1
        assert bills.list_runs(c, DB, limit=0) == []
        for bad in (-3, 1.5, True):
            with pytest.raises(ValueError, match="limit must be a non-negative integer"):
                bills.list_runs(c, DB, limit=bad)


@pytest.mark.parametrize("floor", [-5.0, 100.5, "busy"])
def test_unmatched_floor_outside_a_percent_is_an_error(tmp_path, floor):
    """--busy-floor-pct -5 listed every unallocated GPU that reports a utilization as busy (util > -5),
    and a word gave Python's "could not convert string to float"."""
    with migrated_warehouse(tmp_path, DB) as (c, _):
        idle = usage_record("c1", "g1", B, B + 10 * MIN, "unallocated").model_copy(update={"util_pct": 0.0})
        put_usage(c, DB, [idle], 0)
        assert reports.fetch(c, DB, "unmatched", busy_floor_pct=0.0) == []  # idle at 0 %: not busy
        with pytest.raises(ValueError, match=r"busy_floor_pct must be a number of percent from 0 to 100, got"):
            reports.fetch(c, DB, "unmatched", busy_floor_pct=floor)


def test_priced_by_default_hours_follow_the_queue_filter(tmp_path):
    """alpha runs 10 min in qa and 30 min in qb on a model priced by default: `--queue qa` showed the
    tenant's 40 min as priced by default on a row of 10 min GPU time."""
    def rec(gpu, minutes, queue):
        return usage_record("c1", gpu, B, B + minutes * MIN, "executing", f"j-{queue}", "alpha").model_copy(
            update={"queue": queue, "priced_by_default": True})

    with migrated_warehouse(tmp_path, DB) as (c, _):
        put_usage(c, DB, [rec("g1", 10, "qa"), rec("g2", 30, "qb")], 0)
        whole, = reports.fetch(c, DB, "bills")
        assert whole["priced_by_default_gpu_hours"] == pytest.approx(40 / 60)
        qa, = reports.fetch(c, DB, "bills", queue="qa")
        assert qa["total_gpu_hours"] == pytest.approx(10 / 60)
        assert qa["priced_by_default_gpu_hours"] == pytest.approx(10 / 60), "the other queue's hours counted"
