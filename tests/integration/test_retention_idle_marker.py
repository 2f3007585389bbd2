"""With GPULEDGER_RETENTION_USAGE_DAYS, the marker of a day whose idle stretches are kept
(idle_stretch_days) expires no sooner than the stretches it marks (idle_stretches_daily) and the idle
records behind them (job_idle_segments), which expire with their month: else job_idle_stretches reads
the day's kept stretches and its records again, counting its idle time twice (docs/retention.md).
`gpuledger migrate` gives a warehouse migrated with the old, day-precise TTL the new one."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.warehouse import idle_stretches, migrations, retention
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "ret_idle_marker"
MIN = 60_000
D = dt.date(2024, 3, 1)


def ttl_of(c, table: str) -> str | None:
    rows = c.query("SELECT engine_full FROM system.tables WHERE database = {d:String} AND name = {t:String}",
                   parameters={"d": DB, "t": table}).result_rows
    return retention.ttl_in_engine(rows[0][0])


def test_idle_marker_expires_with_the_month_of_the_stretches_it_marks(tmp_path):
    today = dt.datetime.now(dt.timezone.utc).date()
    # counted from its day the marker of 1 March expired two days ago; the month's stretches and
    # records are kept until 31 March + N
    n = (today - D).days - 2
    with migrated_warehouse(tmp_path, DB, retention_usage_days=n, bills_adjust_lookback_days=1) as (c, s):
        # a warehouse migrated before the fix: the marker's TTL counted from its own day
        c.command(f"ALTER TABLE {DB}.idle_stretch_days MODIFY TTL day + toIntervalDay({n})")
        migrations.migrate_configured(c, s)  # what `gpuledger migrate` does with the retention settings
        assert "toLastDayOfMonth" in ttl_of(c, "idle_stretch_days")

        t0 = int(dt.datetime(2024, 3, 1, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
        put_usage(c, DB, [usage_record("c1", "g1", t0 + i * MIN, t0 + (i + 1) * MIN, "allocated_idle", job="j1",
                                       tenant="t") for i in range(3)], 0)
        idle_stretches.refresh(c, DB, "c1", [D])
        for table in ("idle_stretch_days", "idle_stretches_daily", "job_idle_segments"):
            c.command(f"OPTIMIZE TABLE {DB}.{table} FINAL")  # the TTL merges ClickHouse runs in the background
        assert c.query(f"SELECT count() FROM {DB}.idle_stretch_days").result_rows[0][0] == 1
        stretches = c.query(f"SELECT count(), sum(idle_gpu_seconds) FROM {DB}.job_idle_stretches "
                            "WHERE job_id = 'j1'").result_rows[0]
        assert stretches == (1, 180.0)
