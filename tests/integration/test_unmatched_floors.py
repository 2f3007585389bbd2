"""`report unmatched`'s busy unallocated GPU time at any floor (sql/0033): a whole-number floor reads
unallocated_util_daily (util_step = ceil(util_pct) > floor), a floor with a fraction scans usage_raw.
On the real engine (chDB), on random unallocated records in two clusters over three days, with
utilization at whole numbers (where `>` must not count the floor itself), fractions, 0, 100 and none,
written before the migration (its back-fill) and after it (its materialized view, a replay's copies
included): the report equals the scan of usage_raw for every floor and filter."""

from __future__ import annotations

import datetime as dt
import random

import pytest
from warehouse_helpers import put_usage, usage_record, warehouse_before

from gpuledger.warehouse import migrations, reports

pytestmark = pytest.mark.integration

DB = "unmatched_floors"
T0 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
FLOORS = [0.0, 1.0, 2.0, 5.0, 37.0, 50.0, 99.0, 100.0, 0.5, 2.5, 37.25]


def write(client, rnd: random.Random, shift_ms: int, offset: int = 0) -> None:
    """Random unallocated records (starts shifted by `shift_ms`), written as the message at `offset`."""
    records = []
    for cluster in ("c1", "c2"):
        for g in range(6):
            gpu = f"{cluster}-g{g}"
            for minute in rnd.sample(range(0, 3 * 1440, 5), rnd.randrange(20, 40)):  # one record per id
                start = T0 + minute * MIN + shift_ms
                util = rnd.choice([None, 0.0, 100.0, float(rnd.randrange(0, 101)), round(rnd.uniform(0, 100), 3),
                                   1.0, 2.0, 37.0, 37.25, 1e-9 + 5])
                record = usage_record(cluster, gpu, start, start + rnd.choice([1, 3, 5]) * MIN, "unallocated")
                records.append(record.model_copy(update={"util_pct": util}))
    put_usage(client, DB, records, offset)


def scanned(client, floor: float, where: str, params: dict) -> list[tuple]:
    """The busy GPUs as usage_raw holds them: (cluster, node, gpu, first day, GPU-hours)."""
    return [tuple(r) for r in client.query(f"""
        SELECT toString(cluster), toString(node), gpu_uuid, min(day), sum(gpu_ms) / 3600000 FROM {DB}.usage_raw
        WHERE state = 'unallocated' AND util_pct > {{floor:Float64}} AND {where}
        GROUP BY cluster, node, gpu_uuid ORDER BY cluster, node, gpu_uuid""",
        parameters={**params, "floor": floor}).result_rows]


@pytest.fixture(scope="module")
def ledger():
    client = warehouse_before("0033", DB, prefix="unmatched-floors-")
    write(client, random.Random(5), 0)
    assert "0033" in migrations.migrate(client, DB)  # back-fills from the records above
    assert migrations.migrate(client, DB) == []      # run again: nothing pending, nothing added twice
    # the scan reads usage_raw as stored: held unmerged so the replay's copies stay (merges fold copies
    # of a record; the aggregates, like busy_unallocated_daily, keep counting them)
    client.command(f"SYSTEM STOP MERGES {DB}.usage_raw")
    write(client, random.Random(6), 1_000)           # through the materialized view
    write(client, random.Random(6), 1_000, 5_000)    # a replay (a later message): its copies count, as in the scan
    yield client
    client.close()


FILTERS = [({}, "1"), ({"cluster": "c2"}, "cluster = 'c2'"),
           ({"day_from": dt.date(2026, 11, 11)}, "day >= '2026-11-11'"),
           ({"day_from": dt.date(2026, 11, 10), "day_to": dt.date(2026, 11, 10)}, "day = '2026-11-10'")]


@pytest.mark.parametrize("floor", FLOORS)
def test_busy_unallocated_equals_the_scan_at_every_floor(ledger, floor):
    for filters, where in FILTERS:
        rows = reports.fetch(ledger, DB, "unmatched", busy_floor_pct=floor, **filters)
        got = [(r["cluster"], r["node"], r["detail"], r["day"], r["gpu_hours"]) for r in rows
               if r["kind"] == "busy_unallocated"]
        expected = scanned(ledger, floor, where, {})
        assert len(rows) == len(got)  # nothing else in this data
        assert sorted(got) == sorted(expected), (floor, filters)  # the same sums of integer GPU-ms
        assert expected or floor >= 99.0, (floor, filters)


def test_whole_number_floors_read_the_aggregate_and_the_floor_itself_is_not_above_it(ledger):
    """The data has records at exactly 37 %: the aggregate must leave them out at floor 37 and count
    them at 36; util_step holds each record's ceil(util_pct)."""
    at_37 = ledger.query(f"SELECT count() FROM {DB}.usage_raw WHERE util_pct = 37").result_rows[0][0]
    assert at_37 > 0
    steps = ledger.query(f"SELECT sum(gpu_ms) FROM {DB}.unallocated_util_daily WHERE util_step = 37").result_rows[0][0]
    assert steps == ledger.query(f"""SELECT sum(gpu_ms) FROM {DB}.usage_raw
        WHERE state = 'unallocated' AND util_pct > 36 AND util_pct <= 37""").result_rows[0][0]
    for floor in (36.0, 37.0):
        rows = reports.fetch(ledger, DB, "unmatched", busy_floor_pct=floor)
        assert sorted((r["cluster"], r["node"], r["detail"], r["day"], r["gpu_hours"]) for r in rows) == \
            sorted(scanned(ledger, floor, "1", {}))
