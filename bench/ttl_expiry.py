"""What expiring one day of `gpu_health` costs the warehouse: rows rewritten by TTL merges, with the
table partitioned by month (before sql/0034) and by day with ttl_only_drop_parts (since; docs/retention.md,
"How rows expire").

On chDB: for each layout a table of DAYS days × ROWS_PER_DAY sample rows, its parts merged as the
background merger folds them (OPTIMIZE ... FINAL). Days pass by shortening the TTL one day at a time
(`MODIFY TTL day + toIntervalDay(k)`, recomputing the parts' TTL only): each step expires one more
day, as a day passing does, and the step waits until the expired rows are gone. Counted from
`system.events`: rows written by merges (MergeWrittenRows) per expired day.

    .venv/bin/python -m bench.ttl_expiry [DAYS_TO_EXPIRE]
"""

from __future__ import annotations

import datetime as dt
import sys
import tempfile
import time

from clickhouse_connect import get_client

DAYS = 30  # days of rows in the table: the oldest expire one by one
ROWS_PER_DAY = 200_000
LAYOUTS = {
    "by month (before sql/0034)": "PARTITION BY toYYYYMM(day) ORDER BY (gpu, ts) SETTINGS merge_with_ttl_timeout = 0",
    "by day, whole parts dropped": "PARTITION BY day ORDER BY (gpu, ts) "
                                   "SETTINGS merge_with_ttl_timeout = 0, ttl_only_drop_parts = 1",
}


def _merged_rows(client) -> int:
    rows = client.query("SELECT value FROM system.events WHERE event = 'MergeWrittenRows'").result_rows
    return int(rows[0][0]) if rows else 0


def _wait_expired(client, table: str, k: int, timeout_s: float = 120.0) -> None:
    """Until no expired row is left (the TTL merges or part drops are done): a TTL has passed once the
    midnight it names has."""
    deadline = time.monotonic() + timeout_s
    while client.query(f"SELECT count() FROM {table} WHERE day + toIntervalDay({k}) <= today()").result_rows[0][0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{table}: expired rows still there after {timeout_s} s")
        time.sleep(0.2)


def run_layout(client, table: str, name: str, layout: str, expire: int) -> dict:
    first = dt.date.today() - dt.timedelta(days=2 * DAYS)  # day i is 2*DAYS - i days old: none expires yet
    client.command(f"CREATE TABLE {table} (day Date, gpu UInt32, ts Int64, temperature Float64, power Float64) "
                   f"ENGINE = MergeTree {layout}, materialize_ttl_recalculate_only = 1")
    for i in range(DAYS):
        client.command(f"INSERT INTO {table} SELECT toDate('{first}') + {i}, number % 1000, number, "
                       f"40 + rand() % 40, 200 + rand() % 500 FROM numbers({ROWS_PER_DAY})")
    client.command(f"OPTIMIZE TABLE {table} FINAL")
    parts = client.query(f"SELECT count() FROM system.parts WHERE table = '{table}' AND active").result_rows[0][0]
    written = []
    for step in range(1, expire + 1):
        k = 2 * DAYS - step + 1  # days 0 .. step-1 are k days old or older: one more day expires
        before = _merged_rows(client)
        client.command(f"ALTER TABLE {table} MODIFY TTL day + toIntervalDay({k})", settings={"mutations_sync": 2})
        _wait_expired(client, table, k)
        written.append(_merged_rows(client) - before)
    left = client.query(f"SELECT count() FROM {table}").result_rows[0][0]
    client.command(f"DROP TABLE {table} SYNC")
    return {"layout": name, "parts_before": parts, "days_expired": expire, "rows_left": left,
            "rows_rewritten_per_expired_day": round(sum(written) / expire),
            "rows_rewritten_per_expired_row": round(sum(written) / (expire * ROWS_PER_DAY), 2)}


def main(argv: list[str]) -> int:
    expire = int(argv[0]) if argv else 10
    client = get_client(interface="chdb", path=tempfile.mkdtemp(prefix="ttl-expiry-"))
    print(f"{DAYS} days x {ROWS_PER_DAY:,} rows; {expire} days expire one at a time")
    print(f"{'layout':32} {'parts':>5} {'rows left':>10} {'rewritten per expired day':>26} {'per expired row':>16}")
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        r = run_layout(client, f"health_{i}", name, layout, expire)
        print(f"{r['layout']:32} {r['parts_before']:>5} {r['rows_left']:>10,} "
              f"{r['rows_rewritten_per_expired_day']:>26,} {r['rows_rewritten_per_expired_row']:>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
