"""Dashboard and report queries at fleet scale (issue #13, point 3): with N raw usage segments in the
embedded warehouse (chDB, the real migrations and their materialized views), every Superset chart's
query and every `gpuledger report` is timed; the slowest is printed, the target is < 1 s each.

The fleet: GPULEDGER_BENCH_QUERY_GPUS GPUs (8 per node, 4 models, 3 clusters' worth of nodes in one
cluster), 60 s segments (the worker's default window), as many days as it takes to reach
GPULEDGER_BENCH_QUERY_ROWS rows (full: 100 M rows = 10,000 GPUs x ~7 days). One job per node per 4 h
block (1 in 8 blocks unallocated, 1 in 50 down, 1 in 8 jobs failed); the first 10 minutes of a job
allocated idle, and 5 minutes idle in the middle of each hour (checkpoints); utilization varies per
segment. Health samples: one per GPU per minute for the last day (GPULEDGER_BENCH_QUERY_HEALTH_DAYS).
Everything is generated inside the engine (INSERT ... SELECT FROM numbers()), so the materialized
views fill the aggregates as they would from the sink; then background merges are allowed to finish
(OPTIMIZE ... FINAL on the aggregates, as hours of operation would).

Carbon inputs are recorded as a running ledger has them: the default [carbon] definition (which
`gpuledger migrate` records) and an hourly intensity series for the cluster, so every CO2e figure is
computed. Before the charts and reports are timed, every day past its grace is closed
(`bills.close_due`, as the bills timer does in operation), so they read closed bills (and closed
days' energy) for those days and live, deduplicated usage for the last, open day.

Chart queries are built from the bundle (superset/bundle): the chart's dataset, its metrics'
expressions, group-bys, time grain, row limit and order, as Superset's SQL for those chart types
(no time filter: the dashboards open on "No filter"). Median of GPULEDGER_BENCH_QUERY_REPEATS runs
after one warm-up. Then the CLI end to end (`cli_timings`, in results.json as query_detail.cli_ms; not
a target: it adds ~0.85 s of process start and chDB loading to every report).

    .venv/bin/python -m bench.run --only queries
    GPULEDGER_BENCH_QUICK=1 .venv/bin/python -m bench.run --only queries
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import statistics
import time
from pathlib import Path

import yaml

from bench.common import knob, say, workdir

ROWS = knob("query_rows", 100_000_000, 4_000_000)
GPUS = knob("query_gpus", 10_000, 1_000)
HEALTH_DAYS = knob("query_health_days", 1.0, 0.25)
REPEATS = knob("query_repeats", 3, 2)
#: GPULEDGER_BENCH_QUERY_KEEP_DIR: a chDB directory kept after the run and reused when it holds the same
#: number of rows (for iterating on queries; the timings then skip generation)
KEEP_DIR = os.environ.get("GPULEDGER_BENCH_QUERY_KEEP_DIR") or None
TARGET_S = 1.0

SEGMENT_MS = 60_000
BLOCK_MIN = 240                       # 4 h jobs
START_MS = 1_793_491_200_000          # 2026-11-01T00:00:00Z
DATABASE = "gpuledger"
BUNDLE = Path(__file__).resolve().parents[1] / "superset" / "bundle"
_TENANTS = "['vision','nlp','speech','recsys','robotics']"
_QUEUES = "['prod','research','batch']"
_MODELS = "['A100-80GB','H100-80GB','V100-32GB','T4']"

_GRAINS = {"PT1M": "toStartOfMinute", "PT5M": "toStartOfFiveMinutes", "PT1H": "toStartOfHour", "P1D": "toStartOfDay"}


def _usage_sql(first: int, count: int) -> str:
    return f"""
INSERT INTO usage_raw (schema_version, record_id, cluster, node, gpu_uuid, gpu_model, start_ms, end_ms, state,
    job_id, attempt, tenant, queue, share_milli, gpu_ms, util_pct, util_metric_pct, mem_used_bytes, energy_j,
    coefficient, coefficient_version, effective_gpu_ms, cost_micros, definition_version, kafka_topic,
    kafka_partition, kafka_offset)
SELECT 1, concat(gpu_uuid, '/', toString(start_ms), '/0'), 'bench', node, gpu_uuid, gpu_model, start_ms,
    start_ms + {SEGMENT_MS}, state, if(held, job, ''), 0, if(held, {_TENANTS}[h % 5 + 1], ''),
    if(held, {_QUEUES}[intDiv(h, 5) % 3 + 1], ''), 1000, {SEGMENT_MS},
    if(state = 'down', NULL, toFloat64(cityHash64(number) % 1001) / 10),
    if(state = 'executing', toFloat64(cityHash64(number) % 1001) / 10, NULL), 20000000000,
    if(state = 'executing', 18000., 3600.), 1.0, 'bench@2020-01-01', {SEGMENT_MS}, 8840, 'bench-v1',
    'bench.usage', toInt32(number % 8), toInt64(number)
FROM
(
    SELECT number,
        number % {GPUS} AS gpu, intDiv(number, {GPUS}) AS minute, intDiv(gpu, 8) AS node_i,
        concat('bench-node', toString(node_i)) AS node, concat('GPU-bench-', toString(gpu)) AS gpu_uuid,
        {_MODELS}[node_i % 4 + 1] AS gpu_model,
        {START_MS} + minute * {SEGMENT_MS} AS start_ms,
        concat('j-', toString(node_i), '-', toString(intDiv(minute, {BLOCK_MIN}))) AS job,
        cityHash64(job) AS h,
        h % 8 != 0 AS held,
        multiIf(h % 50 = 7, 'down', NOT held, 'unallocated',
                minute % {BLOCK_MIN} < 10 OR minute % 60 BETWEEN 30 AND 34, 'allocated_idle', 'executing') AS state
    FROM numbers({first}, {count})
)"""


def _events_sql(nodes: int, blocks: int, kind_sql: str, offset_ms: int) -> str:
    return f"""
INSERT INTO job_events (schema_version, event_id, ts_ms, kind, cluster, job_id, attempt, tenant, queue, priority,
    requested_gpus, gpu_nodes, gpu_uuids, gpu_share_milli, gpu_container_ids, aliases, reason,
    kafka_topic, kafka_partition, kafka_offset)
SELECT 1, concat(job, '/', kind), ts, kind, 'bench', job, 0, {_TENANTS}[h % 5 + 1], {_QUEUES}[intDiv(h, 5) % 3 + 1],
    0, 8., [], [], [], [], map(), '', 'bench.job-events', 0, toInt64(number)
FROM
(
    SELECT number, number % {nodes} AS node_i, intDiv(number, {nodes}) AS block,
        concat('j-', toString(node_i), '-', toString(block)) AS job, cityHash64(job) AS h,
        {START_MS} + block * {BLOCK_MIN * SEGMENT_MS} + {offset_ms} AS ts,
        {kind_sql} AS kind
    FROM numbers({nodes * blocks})
)
WHERE h % 8 != 0 AND h % 50 != 7"""


def _health_sql(first_minute: int, minutes: int) -> str:
    return f"""
INSERT INTO gpu_health (cluster, node, gpu_uuid, gpu_model, ts_ms, interval_ms, health, down_reason, temperature_c,
    power_w, util_gpu_pct, mem_used_bytes, xid_errors, ecc_dbe_total)
SELECT 'bench', concat('bench-node', toString(intDiv(gpu, 8))), concat('GPU-bench-', toString(gpu)),
    {_MODELS}[intDiv(gpu, 8) % 4 + 1], {START_MS} + minute * {SEGMENT_MS}, {SEGMENT_MS},
    if(cityHash64(number) % 997 = 0, 'degraded', 'ok'), '', 40 + toFloat64(cityHash64(number, 1) % 450) / 10,
    toFloat64(cityHash64(number, 2) % 400), toFloat64(cityHash64(number, 3) % 101), 20000000000,
    if(cityHash64(number, 4) % 5000 = 0, [79], []), 0
FROM (SELECT number, number % {GPUS} AS gpu, {first_minute} + intDiv(number, {GPUS}) AS minute
      FROM numbers({minutes * GPUS}))"""


def generate(client) -> dict:
    minutes = -(-ROWS // GPUS)
    nodes = -(-GPUS // 8)
    blocks = -(-minutes // BLOCK_MIN)
    t0 = time.perf_counter()
    client.command(_events_sql(nodes, blocks, "'allocated'", 0))
    client.command(_events_sql(nodes, blocks, "'started'", 600_000))
    client.command(_events_sql(nodes, blocks, "if(h % 8 = 3, 'failed', 'completed')", BLOCK_MIN * SEGMENT_MS - 1))
    chunk = GPUS * 1440  # a day at a time: bounded memory for the views' GROUP BYs
    done = 0
    while done < ROWS:
        n = min(chunk, ROWS - done)
        client.command(_usage_sql(done, n), settings={"max_insert_threads": 2})
        done += n
        say(f"queries: {done:,} / {ROWS:,} usage segments ({time.perf_counter() - t0:.0f} s)")
    health_minutes = int(HEALTH_DAYS * 1440)
    client.command(_health_sql(max(0, minutes - health_minutes), health_minutes), settings={"max_insert_threads": 2})
    gen_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for table in ("gpu_latest", "usage_gpu_5m", "usage_gpu_hourly", "job_gpu_usage", "usage_by_job_daily",
                  "usage_capacity_daily", "gpu_health_hourly", "job_attempts_state", "usage_gpu_daily"):
        client.command(f"OPTIMIZE TABLE {table} FINAL")
    merge_s = time.perf_counter() - t1
    counts = dict(client.query(
        "SELECT name, total_rows FROM system.tables WHERE database = currentDatabase() AND total_rows > 0").result_rows)
    return {"generate_s": round(gen_s, 1), "merge_s": round(merge_s, 1), "segments_per_s": round(ROWS / gen_s),
            "days": round(minutes / 1440, 2), "gpus": GPUS, "rows": counts}


def _metric_exprs(dataset: dict) -> dict[str, str]:
    return {m["metric_name"]: m["expression"] for m in dataset.get("metrics") or []}


def _calculated_columns(dataset: dict) -> dict[str, str]:
    """The dataset's columns that Superset computes (an `expression`, e.g. the bill datasets' currency)."""
    return {c["column_name"]: c["expression"] for c in dataset.get("columns") or [] if c.get("expression")}


def chart_sql(chart: dict, dataset: dict) -> str:
    """The SQL Superset sends for the bundle's chart types (table raw/aggregate, pie, big number,
    timeseries bar/line/area), without a time filter."""
    p = chart["params"]
    table = f"{DATABASE}.{dataset['table_name']}"
    metrics = _metric_exprs(dataset)
    calculated = _calculated_columns(dataset)

    def column(name: str) -> str:  # as Superset selects it: a calculated column by its expression
        return f"{calculated[name]} AS {name}" if name in calculated else name

    limit = p.get("row_limit") or 10000
    if p.get("query_mode") == "raw":
        cols = ", ".join(column(c) for c in p["all_columns"])
        order = ""
        if p.get("order_by_cols"):
            import json
            col, asc = json.loads(p["order_by_cols"][0])
            order = f" ORDER BY {col} {'ASC' if asc else 'DESC'}"
        return f"SELECT {cols} FROM {table}{order} LIMIT {limit}"
    names = list(p.get("metrics") or ([p["metric"]] if p.get("metric") else []))
    select_metrics = [f"{metrics[n]} AS `{n}`" for n in names]
    groups = list(p.get("groupby") or [])
    x = p.get("x_axis")
    dims = []
    if x:
        grain = _GRAINS.get(p.get("time_grain_sqla") or "")
        dims.append(f"{grain}(toDateTime({x})) AS {x}" if grain else x)
    dims += [column(g) for g in groups]
    keys = ([x] if x else []) + groups
    sql = f"SELECT {', '.join(dims + select_metrics)} FROM {table}"
    if keys:
        sql += f" GROUP BY {', '.join(keys)}"
    if names:
        sql += f" ORDER BY `{names[0]}` DESC"
    return sql + f" LIMIT {limit}"


def bundle_charts() -> list[tuple[str, str]]:
    datasets = {}
    for f in (BUNDLE / "datasets").rglob("*.yaml"):
        d = yaml.safe_load(f.read_text())
        datasets[d["uuid"]] = d
    out = []
    for f in sorted((BUNDLE / "charts").glob("*.yaml")):
        c = yaml.safe_load(f.read_text())
        d = datasets[c["dataset_uuid"]]
        out.append((f"chart {f.stem}", d["table_name"], chart_sql(c, d)))
    return out


def record_carbon(client) -> int:
    """Carbon inputs as a running ledger has them: the default ledger's [carbon] definition (recorded by
    `gpuledger migrate`) and an hourly grid-intensity series for the bench's cluster over the generated
    days (`gpuledger carbon load`), so the reports' and the carbon chart's CO2e are computed. Returns the
    number of intensity values loaded (0 when a kept directory has them already)."""
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import carbon

    carbon.record_definition(client, DATABASE, load_ledger_config(None).carbon)
    if client.query("SELECT count() FROM carbon_intensity").result_rows[0][0]:
        return 0
    hours = -(-ROWS // GPUS) // 60 + 1
    series = [{"zone": "bench", "valid_from_ms": START_MS + h * 3_600_000, "gco2e_per_kwh": 250.0 + (h * 37) % 300}
              for h in range(hours)]
    return carbon.load_intensity(client, DATABASE, series, "bench-hourly.csv", "bench")


def _timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()  # warm-up
    first = time.perf_counter() - t0
    if first > 5.0:  # far over the target: its first run is the figure (not repeated)
        return first, n
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), n


def other_reports(client, data_dir: Path) -> dict:
    """The `gpuledger report`s beyond reports.REPORTS, each as what the CLI runs before rendering
    (rendering reads nothing): the periodic reports as they open (their default period), the job
    report of a job of the open day, a GPU's card and the fleet's, and the storage report. Each
    returns its count of rows or sections."""
    from gpuledger.config import Settings
    from gpuledger.warehouse import cards, forecast, storage
    from gpuledger.warehouse.periodic import commands as periodic

    try:  # the forecast report shows the latest stored run
        forecast.run_forecast(client, DATABASE)
        fitted = True
    except ValueError as exc:  # a week of usage is shorter than a forecast needs
        say(f"queries: report forecast: skipped ({exc})")
        fitted = False

    job = client.query("SELECT job_id FROM usage_raw WHERE job_id != '' ORDER BY start_ms DESC LIMIT 1").result_rows
    gpu = client.query("SELECT gpu_uuid FROM gpu_sightings LIMIT 1").result_rows
    out = {name: (lambda name=name: len(periodic.build_report(client, DATABASE, name, currency="USD").sections))
           for name in periodic.REPORT_NAMES if name != "job" and (name != "forecast" or fitted)}
    if job:
        out["job"] = lambda: len(periodic.build_report(client, DATABASE, "job", job_id=job[0][0],
                                                       currency="USD").sections)
    if gpu:
        out["gpu"] = lambda: len(cards.build_card(client, DATABASE, gpu[0][0]).sections)
    out["gpu-fleet"] = lambda: len(cards.build_fleet(client, DATABASE).sections)
    settings = Settings(database=DATABASE, data_dir=data_dir)
    out["storage"] = lambda: len(storage.storage_rows(client, DATABASE, settings))
    return out


#: reports timed as a user runs them (informational; the target is on the queries above)
CLI_REPORTS = ("alerts", "bills", "jobs", "queues", "utilization", "capacity", "unmatched", "weekly", "monthly",
               "inventory", "storage")


def cli_timings(path: Path) -> dict[str, float]:
    """Wall time of `gpuledger report R` in a new process, printed as a table to /dev/null (fastest of
    two): Python, the CLI's imports, loading and opening chDB, the queries and the rendering. `alerts`,
    which has no rows here, is about the fixed part."""
    import subprocess
    import sys

    env = {**os.environ, "GPULEDGER_DATABASE": DATABASE, "GPULEDGER_WAREHOUSE": f"chdb:{path}"}
    out = {}
    for name in CLI_REPORTS:
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "gpuledger.cli", "report", name], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            runs.append(time.perf_counter() - t0)
            if done.returncode != 0:
                raise RuntimeError(f"gpuledger report {name} failed: {done.stderr.strip()}")
        out[name] = round(1000 * min(runs), 1)
        say(f"queries: gpuledger report {name}, end to end: {out[name]:,.0f} ms")
    return out


def run() -> dict:
    from clickhouse_connect import get_client

    from gpuledger.warehouse import reports
    from gpuledger.warehouse.migrations import migrate

    keep = KEEP_DIR is not None
    # a directory of this run's own: other benchmarks clean their own under the same scratch dir
    path = Path(KEEP_DIR) if keep else workdir() / f"queries-chdb-{os.getpid()}"
    if not keep:
        shutil.rmtree(path, ignore_errors=True)
    client = get_client(interface="chdb", path=str(path))
    try:
        client.command(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
        migrate(client, DATABASE)
        client.database = DATABASE
        have = client.query("SELECT count() FROM usage_raw").result_rows[0][0]
        if keep and have == ROWS:
            say(f"queries: reusing {have:,} usage segments in {path}")
            detail = {"reused": str(path), "gpus": GPUS, "days": round(-(-ROWS // GPUS) / 1440, 2)}
        else:
            say(f"queries: generating {ROWS:,} usage segments for {GPUS:,} GPUs")
            detail = generate(client)
            say(f"queries: generated in {detail['generate_s']} s, merged in {detail['merge_s']} s: {detail['rows']}")
        detail["intensity_values_loaded"] = record_carbon(client)
        # as in operation (the bills timer): every day past its grace is closed, the last one stays open,
        # and its hours found exact are recorded but the one still being written (on a kept directory the
        # days are closed already: the run records what is not recorded yet)
        from gpuledger.config import Settings
        from gpuledger.ledger_files import load_ledger_config
        from gpuledger.warehouse import bills

        t0 = time.perf_counter()
        closed = bills.close_due(client, Settings(database=DATABASE, data_dir=path.parent / "queries-data"),
                                 load_ledger_config(None), database=DATABASE)
        detail["close_s"] = round(time.perf_counter() - t0, 1)
        detail["closed_days"] = sum(len(d) for d in closed.closed.values())
        detail["exact_hours_recorded"] = closed.exact_hours
        say(f"queries: closed {detail['closed_days']} days in {detail['close_s']} s, "
            f"{closed.exact_hours} open hours recorded exact")
        timings: dict[str, float] = {}
        tables = {r[0] for r in client.query("SELECT name FROM system.tables WHERE database = currentDatabase()").result_rows}
        for name, table, sql in bundle_charts():
            if table not in tables:  # a dataset of a migration this tree does not have yet
                say(f"queries: {name}: skipped, no {table} in the warehouse")
                continue
            s, n = _timed(lambda sql=sql: len(client.query(sql).result_rows))
            timings[name] = s
            say(f"queries: {name}: {1000 * s:,.0f} ms ({n} rows)")
        last_day = dt.date(2026, 11, 1) + dt.timedelta(days=-(-ROWS // GPUS) // 1440)
        for name in reports.REPORTS:
            # closed days only: a range without open days must not read the open days' usage either
            for label, filters in (("all days", {}), ("open day", {"day_from": last_day, "day_to": last_day}),
                                   ("closed days", {"day_to": last_day - dt.timedelta(days=1)})):
                s, n = _timed(lambda name=name, filters=filters: len(reports.fetch(client, DATABASE, name, **filters)))
                timings[f"report {name} ({label})"] = s
                say(f"queries: report {name} ({label}): {1000 * s:,.0f} ms ({n} rows)")
        # a floor other than the default: sql/0033's aggregate, not the scan of usage_raw (1.2-1.9 s)
        s, n = _timed(lambda: len(reports.fetch(client, DATABASE, "unmatched", busy_floor_pct=5.0)))
        timings["report unmatched (busy floor 5 %)"] = s
        say(f"queries: report unmatched (busy floor 5 %): {1000 * s:,.0f} ms ({n} rows)")
        for name, fn in other_reports(client, path.parent / "queries-data").items():
            s, n = _timed(fn)
            timings[f"report {name}"] = s
            say(f"queries: report {name}: {1000 * s:,.0f} ms ({n} rows or sections)")
    finally:
        client.close()
    try:  # the warehouse is free now (one process at a time holds a chDB directory)
        detail["cli_ms"] = cli_timings(path)
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
    slowest = max(timings, key=timings.get)
    over = sorted(k for k, v in timings.items() if v >= TARGET_S)
    say(f"queries: slowest {slowest}: {1000 * timings[slowest]:,.0f} ms; over {TARGET_S} s: {over or 'none'}")
    return {"query_slowest_s": timings[slowest],
            "query_detail": {"rows": ROWS, "slowest": slowest, "over_target": over, **detail,
                             "timings_ms": {k: round(1000 * v, 1) for k, v in sorted(timings.items())}}}


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2, default=str))
