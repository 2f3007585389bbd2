"""With GPULEDGER_RETENTION_USAGE_DAYS, a close run does not adjust a closed day whose usage may have
expired (docs/accounting.md §6a, docs/retention.md): the look-back counts back from the cluster's last
closed day, which stays put while a cluster is quiet or retired, so without a bound its closed days'
usage expired under it and the run booked their whole closed bill back as negative `late_samples`
(and wiped their closed energy and cluster idle).

The expiry is simulated as the TTL merge does it (DROP PARTITION of the month's parts of the tables under
the usage retention), so that the run's `now` can be chosen: retention 70 days; October 2026's usage
expires on 31 October + 70 days = 9 January 2027, August's on 9 November 2026."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, reports
from gpuledger.warehouse.retention import RETENTION
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_usage_retention"
MIN = 60_000
HOUR = 3_600_000
DAY = 86_400_000
UTC = dt.timezone.utc
#: the monthly tables of the usage retention
USAGE_MONTHLY = tuple(t for t, r in RETENTION.items() if r.setting == "retention_usage_days" and r.partition == "month")


def day_ms(d: dt.date) -> int:
    return int(dt.datetime.combine(d, dt.time(), UTC).timestamp() * 1000)


def expire_usage(c, month: str) -> None:
    """As the TTL merge drops a month's usage parts whole."""
    for table in USAGE_MONTHLY:
        c.command(f"ALTER TABLE {DB}.{table} DROP PARTITION {month}")


def test_a_retired_clusters_closed_day_is_not_booked_back_when_its_usage_expires(tmp_path):
    d = dt.date(2026, 10, 30)
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600, retention_usage_days=70) as (c, s):
        b = day_ms(d) + HOUR
        # alpha's job on 30 October (600 micros, 216 kJ), an unallocated GPU that day (cluster idle), and the
        # cluster's last record on 31 October; then the cluster is retired
        put_usage(c, DB, [usage_record("c1", "g1", b, b + 10 * MIN, "executing", "j1", "alpha", energy=216_000.0),
                          usage_record("c1", "g2", b, b + 20 * MIN, "unallocated"),
                          usage_record("c1", "g1", day_ms(d) + DAY, day_ms(d) + DAY + 2 * HOUR, "unallocated")], 0)
        assert bills.close_due(c, s, ledger, now=dt.datetime(2026, 10, 31, 4, tzinfo=UTC)).closed == {"c1": [d]}
        energy = c.query(f"SELECT sum(energy_mj) FROM {DB}.closed_energy").result_rows[0][0]
        idle = c.query(f"SELECT sum(gpu_ms) FROM {DB}.closed_cluster_idle").result_rows[0][0]
        assert (energy, idle) == (216_000_000, 20 * MIN)
        expire_usage(c, "202610")
        run = bills.close_due(c, s, ledger, now=dt.datetime(2027, 1, 10, 4, tzinfo=UTC))
        assert c.query(f"SELECT corrects_day, line, reason, cost_micros FROM {DB}.bill_adjustments").result_rows == [], \
            "expired usage booked back as adjustments"
        assert run.bill_run_id is None
        assert c.query(f"SELECT sum(energy_mj) FROM {DB}.closed_energy").result_rows[0][0] == energy, "closed energy wiped"
        assert c.query(f"SELECT sum(gpu_ms) FROM {DB}.closed_cluster_idle").result_rows[0][0] == idle, "cluster idle wiped"
        assert [(r["day"], r["status"], r["total_cost_micros"]) for r in reports.fetch(c, DB, "bills", tenant="alpha")] \
            == [(d, "closed", 600)]


def test_a_cluster_offline_while_a_month_of_its_usage_expires_keeps_its_bills(tmp_path):
    """c1 bills daily up to 31 October, then sends nothing 1-10 November; August's usage expires on
    9 November, under the look-back of its last closed day. Days still kept are adjusted as before."""
    ledger = load_ledger_config(None)
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600, retention_usage_days=70) as (c, s):
        first, last = dt.date(2026, 8, 31), dt.date(2026, 10, 31)
        recs = [usage_record("c1", "g1", day_ms(first) + i * DAY + HOUR, day_ms(first) + i * DAY + HOUR + 10 * MIN,
                             "executing", "j1", "alpha") for i in range((last - first).days + 1)]
        nov1 = day_ms(dt.date(2026, 11, 1))
        put_usage(c, DB, recs + [usage_record("c1", "g1", nov1, nov1 + 2 * HOUR, "unallocated")], 0)
        run = bills.close_due(c, s, ledger, now=dt.datetime(2026, 11, 1, 4, tzinfo=UTC))
        assert (run.closed["c1"][0], run.closed["c1"][-1]) == (first, last)
        expire_usage(c, "202608")
        # a late record of 15 September (still kept) arrives during the outage: it is adjusted as before
        sep15 = day_ms(dt.date(2026, 9, 15)) + 5 * HOUR
        put_usage(c, DB, [usage_record("c1", "g9", sep15, sep15 + 10 * MIN, "executing", "j1", "alpha")], 1)
        bills.close_due(c, s, ledger, now=dt.datetime(2026, 11, 10, 4, tzinfo=UTC))
        assert c.query(f"SELECT booked_day, corrects_day, line, reason, cost_micros FROM {DB}.bill_adjustments "
                       f"ORDER BY ALL").result_rows == [
            (dt.date(2026, 11, 1), dt.date(2026, 9, 15), "compute", "late_samples", 600)], \
            "31 August's expired usage booked back as an adjustment"
        assert bills.close_due(c, s, ledger, now=dt.datetime(2026, 11, 10, 5, tzinfo=UTC)).bill_run_id is None
