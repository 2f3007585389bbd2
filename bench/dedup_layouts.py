"""Why usage_raw is a day-first ReplacingMergeTree (sql/0022): one open day's bill basis read with
each record once, on four layouts of the same rows. Not part of `make bench` (~10 min at full size);
its figures are quoted in docs/reliability.md ("What may write usage_raw, and what counts").

    .venv/bin/python -m bench.dedup_layouts                  # 10,000 GPUs x 7 days of 60-s segments
    GPULEDGER_BENCH_QUICK=1 .venv/bin/python -m bench.dedup_layouts

Layouts: `before` (MergeTree, sorted GPU first: the table before 0022), `day_first` (MergeTree sorted
(cluster, day, gpu_uuid, ...)), `replacing_day` (ReplacingMergeTree, the same key), `replacing_hour`
(the table since 0022: (cluster, day, hour, gpu_uuid, ...)). Each gets every row and one OPTIMIZE
(merges caught up), then the open day's last hour again in six inserts of ten minutes (a replay of
recent records, as the sink writes them: copies in small parts). Timed: the open day's basis summed
by day, tenant, queue, job, attempt, state, deduplicated by `LIMIT 1 BY cluster, record_id`
(MergeTree layouts) or `FINAL` (ReplacingMergeTree), and the same sum without dedup (the floor).
Median of 3 after a warm-up.
"""

from __future__ import annotations

import shutil
import statistics
import time

from bench.common import knob, say, workdir

GPUS = knob("dedup_gpus", 10_000, 1_000)
DAYS = knob("dedup_days", 7, 2)
START_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
COLUMNS = """(record_id String, cluster LowCardinality(String), gpu_uuid String, start_ms Int64,
    day Date DEFAULT toDate(fromUnixTimestamp64Milli(start_ms, 'UTC')), state LowCardinality(String),
    job_id String, attempt UInt32, tenant LowCardinality(String), queue LowCardinality(String),
    definition_version LowCardinality(String), gpu_ms UInt64, effective_gpu_ms UInt64, cost_micros UInt64)"""
LAYOUTS = {
    "before": "MergeTree PARTITION BY toYYYYMM(day) ORDER BY (cluster, gpu_uuid, start_ms, record_id)",
    "day_first": "MergeTree PARTITION BY toYYYYMM(day) ORDER BY (cluster, day, gpu_uuid, start_ms, record_id)",
    "replacing_day": "ReplacingMergeTree PARTITION BY toYYYYMM(day) ORDER BY (cluster, day, gpu_uuid, start_ms, record_id)",
    "replacing_hour": "ReplacingMergeTree PARTITION BY toYYYYMM(day) "
                      "ORDER BY (cluster, day, intDiv(start_ms, 3600000), gpu_uuid, start_ms, record_id)",
}
BASIS = ("cluster, record_id, day, tenant, queue, job_id, attempt, definition_version, state, gpu_ms, "
         "effective_gpu_ms, cost_micros")


def _rows_sql(gpus: int, rows: int) -> str:
    return f"""SELECT concat(g, '/', toString(st), '/0'), 'bench', g, st, if(h % 5 = 0, 'allocated_idle', 'executing'),
        concat('j-', toString(intDiv(number % {gpus}, 8)), '-', toString(intDiv(intDiv(number, {gpus}), 240))), 0,
        ['a', 'b', 'c', 'd', 'e'][h % 5 + 1], ['p', 'r', 'b'][h % 3 + 1], 'v1', 60000, 60000, 8840
    FROM (SELECT number, concat('GPU-bench-', toString(number % {gpus})) AS g,
                 {START_MS} + intDiv(number, {gpus}) * 60000 AS st, cityHash64(number) AS h FROM numbers({rows}))"""


def _summed(inner: str) -> str:
    return (f"SELECT day, cluster, tenant, queue, job_id, attempt, definition_version, state, sum(gpu_ms), "
            f"sum(effective_gpu_ms), sum(toInt128(cost_micros)) FROM ({inner}) "
            "GROUP BY day, cluster, tenant, queue, job_id, attempt, definition_version, state FORMAT Null")


def run() -> dict:
    import chdb.session

    path = workdir() / "dedup-layouts"
    shutil.rmtree(path, ignore_errors=True)
    session = chdb.session.Session(str(path))
    open_day = f"toDate('2026-11-{DAYS:02d}')"

    def timed(sql: str, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            session.query(sql)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    try:
        session.query("CREATE DATABASE IF NOT EXISTS d")
        rows = GPUS * 1440 * DAYS
        for name, engine in LAYOUTS.items():
            t0 = time.perf_counter()
            session.query(f"CREATE TABLE d.{name} {COLUMNS} ENGINE = {engine}")
            session.query(f"INSERT INTO d.{name} (record_id, cluster, gpu_uuid, start_ms, state, job_id, attempt, "
                          f"tenant, queue, definition_version, gpu_ms, effective_gpu_ms, cost_micros) "
                          f"{_rows_sql(GPUS, rows)}")
            session.query(f"OPTIMIZE TABLE d.{name} FINAL")
            last_hour = START_MS + (DAYS * 24 - 1) * 3_600_000
            for m in range(6):
                session.query(f"INSERT INTO d.{name} SELECT * FROM d.{name} WHERE start_ms >= {last_hour + m * 600_000} "
                              f"AND start_ms < {last_hour + (m + 1) * 600_000}")
            say(f"dedup_layouts: {name}: {rows:,} rows in {time.perf_counter() - t0:.0f} s")
        where = f"WHERE job_id != '' AND day = {open_day}"
        out = {"no_dedup_ms": timed(_summed(f"SELECT {BASIS} FROM d.day_first {where}"))}
        for name, engine in LAYOUTS.items():
            if engine.startswith("Replacing"):
                out[f"{name}_final_ms"] = timed(_summed(f"SELECT {BASIS} FROM d.{name} FINAL {where}"))
            else:
                out[f"{name}_limit_by_ms"] = timed(_summed(f"SELECT {BASIS} FROM d.{name} {where} "
                                                           "LIMIT 1 BY cluster, record_id"))
        out = {k: round(1000 * v, 1) for k, v in out.items()}
        out.update(gpus=GPUS, days=DAYS, open_day_rows=GPUS * 1440)
        for k, v in out.items():
            say(f"dedup_layouts: {k}: {v:,}")
        return out
    finally:
        session.close()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    run()
