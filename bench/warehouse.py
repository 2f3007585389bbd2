"""Warehouse (embedded chDB, the real migrations with their materialized views):

- writer: rows/s of usage rows (the sink's dicts, from real UsageBatches) through
  `ClickHouseWriter.write` in the sink's batch size (20,000), against, in the same run,
  (a) the same rows inserted column-oriented (`insert_rows` with columns) and (b) the engine's
  own INSERT ... SELECT of generated rows (no Python in the loop);
- bill query: a month's tenant bill from the materialized-view side (`tenant_daily_bill` over
  `usage_by_job_daily`) against the same aggregation over the raw `usage_raw` rows (same join to
  the job outcomes), at two sizes of raw data generated inside the engine (INSERT ... SELECT FROM
  numbers(), the MVs filling the aggregates as they would from the sink); both answers are
  checked equal. Median of several runs each; the figure is raw / MV.

The generated month: 30 days of 10 s slices, one per GPU per tick, so the GPU count grows with
the size (10 M rows ~ 39 GPUs for a month, 100 M ~ 386 GPUs); 8 GPUs per node, one job per node
per 4 h block (1 in 10 blocks unallocated, 1 in 8 jobs failed), the first 5 minutes of a job idle.
"""

from __future__ import annotations

import math
import shutil
import time

from gpuledger.agents.simcluster import SimSpec
from gpuledger.config import Settings
from gpuledger.schemas.models import UsageBatch
from gpuledger.sink.writer import ClickHouseWriter
from gpuledger.sink.rows import Source, usage_rows
from gpuledger.warehouse import connect, insert_rows, migrate

from bench.common import SIZES, median, say, workdir

MONTH_START_MS = 1_793_491_200_000  # 2026-11-01T00:00:00Z
TICKS_PER_MONTH = 30 * 8640          # 10 s ticks in 30 days
TICK_MS = 10_000
BLOCK_TICKS = 1440                    # 4 h jobs

_TENANTS = "['vision','nlp','speech','recsys','robotics']"
_QUEUES = "['prod','research','batch']"
_MODELS = "['A100-80GB','H100-80GB','V100-32GB','T4']"


def _usage_select(rows: int, gpus: int) -> str:
    return f"""
INSERT INTO usage_raw (schema_version, record_id, cluster, node, gpu_uuid, gpu_model, start_ms, end_ms, state,
    job_id, attempt, tenant, queue, share_milli, gpu_ms, util_pct, mem_used_bytes, energy_j, coefficient,
    coefficient_version, effective_gpu_ms, cost_micros, definition_version, kafka_topic, kafka_partition, kafka_offset)
SELECT 1, concat(gpu_uuid, '/', toString(start_ms), '/0'), 'bench', node, gpu_uuid, gpu_model, start_ms,
    start_ms + {TICK_MS}, state, if(held, job, ''), 0, if(held, {_TENANTS}[h % 5 + 1], ''),
    if(held, {_QUEUES}[intDiv(h, 5) % 3 + 1], ''), 1000, {TICK_MS}, toFloat64(number % 101), 20000000000,
    3000., 1.0, 'bench@2020-01-01', {TICK_MS}, 1473, 'bench-v1', 'bench.usage', toInt32(number % 8), toInt64(number)
FROM
(
    SELECT number,
        number % {gpus} AS gpu, intDiv(number, {gpus}) AS tick, intDiv(gpu, 8) AS node_i,
        concat('bench-node', toString(node_i)) AS node, concat('GPU-bench-', toString(gpu)) AS gpu_uuid,
        {_MODELS}[node_i % 4 + 1] AS gpu_model,
        {MONTH_START_MS} + tick * {TICK_MS} AS start_ms,
        concat('j-', toString(node_i), '-', toString(intDiv(tick, {BLOCK_TICKS}))) AS job,
        cityHash64(job) AS h,
        h % 10 != 0 AS held,
        multiIf(NOT held, 'unallocated', tick % {BLOCK_TICKS} < 30, 'allocated_idle', 'executing') AS state
    FROM numbers({rows})
)"""


def _job_events_select(nodes: int, kind_sql: str, offset_ms: int) -> str:
    blocks = TICKS_PER_MONTH // BLOCK_TICKS
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
        {MONTH_START_MS} + block * {BLOCK_TICKS * TICK_MS} + {offset_ms} AS ts,
        {kind_sql} AS kind
    FROM numbers({nodes * blocks})
)
WHERE h % 10 != 0"""


MV_QUERY = """
SELECT tenant, sum(compute_cost_micros) AS compute, sum(idle_cost_micros) AS idle,
       sum(failed_retry_cost_micros) AS failed_retry, round(sum(total_gpu_hours), 6) AS gpu_hours
FROM tenant_daily_bill
WHERE day >= '2026-11-01' AND day < '2026-12-01'
GROUP BY tenant ORDER BY tenant"""

RAW_QUERY = """
SELECT tenant, sumIf(cost, line = 'compute') AS compute, sumIf(cost, line = 'idle') AS idle,
       sumIf(cost, line = 'failed_retry') AS failed_retry, round(sum(gpu_ms) / 3600000, 6) AS gpu_hours
FROM
(
    SELECT u.tenant AS tenant, u.gpu_ms AS gpu_ms, u.cost_micros AS cost,
           multiIf(u.state = 'allocated_idle', 'idle', a.outcome = 'failed', 'failed_retry', 'compute') AS line
    FROM usage_raw AS u
    LEFT JOIN (SELECT cluster, job_id, attempt, outcome FROM job_attempts) AS a
        ON u.cluster = a.cluster AND u.job_id = a.job_id AND u.attempt = a.attempt
    WHERE u.state IN ('executing', 'allocated_idle') AND u.job_id != ''
      AND u.day >= '2026-11-01' AND u.day < '2026-12-01'
)
GROUP BY tenant ORDER BY tenant"""


def _timed_query(client, sql: str, repeats: int) -> tuple[float, list]:
    """Median of `repeats` runs after one warm-up run; a query slower than 5 s is not warmed
    separately (its first run counts) and runs at most 3 times."""
    t0 = time.perf_counter()
    rows = client.query(sql).result_rows
    first = time.perf_counter() - t0
    times = []
    if first > 5.0:
        times.append(first)
        repeats = min(repeats, 3)
    while len(times) < repeats:
        t0 = time.perf_counter()
        rows = client.query(sql).result_rows
        times.append(time.perf_counter() - t0)
    return median(times), rows


def bill_at(client, database: str, rows: int) -> dict:
    gpus = math.ceil(rows / TICKS_PER_MONTH)
    nodes = math.ceil(gpus / 8)
    client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    migrate(client, database)
    client.database = database
    t0 = time.perf_counter()
    client.command(_job_events_select(nodes, "'allocated'", 0))
    client.command(_job_events_select(nodes, "'started'", 300_000))
    client.command(_job_events_select(nodes, "if(h % 8 = 3, 'failed', 'completed')", BLOCK_TICKS * TICK_MS - 1))
    client.command(_usage_select(rows, gpus), settings={"max_insert_threads": 2})
    gen_s = time.perf_counter() - t0
    counts = dict(client.query(
        "SELECT 'usage_raw', count() FROM usage_raw UNION ALL SELECT 'usage_by_job_daily', count() FROM usage_by_job_daily "
        "UNION ALL SELECT 'job_events', count() FROM job_events").result_rows)
    say(f"warehouse: {rows:,} raw rows ({gpus} GPUs, a month) generated in {gen_s:.0f} s; {counts}")
    client.command("OPTIMIZE TABLE usage_by_job_daily FINAL")  # a background merge would have done it by month's end
    mv_s, mv_rows = _timed_query(client, MV_QUERY, SIZES.query_repeats)
    raw_s, raw_rows = _timed_query(client, RAW_QUERY, SIZES.query_repeats)
    same = [r[:4] for r in mv_rows] == [r[:4] for r in raw_rows]
    if not same:
        raise AssertionError(f"bill from the MVs {mv_rows} != bill from raw rows {raw_rows}")
    return {"raw_rows": counts.get("usage_raw"), "mv_rows": counts.get("usage_by_job_daily"), "gpus": gpus,
            "generate_s": gen_s, "generate_rows_per_s": rows / gen_s, "mv_query_s": mv_s, "raw_query_s": raw_s,
            "speedup": raw_s / mv_s, "answers_equal": same, "tenants": len(mv_rows)}


def writer_rows(n: int) -> list[dict]:
    """Usage rows as the sink builds them, from the pure core's UsageBatches, repeated with new ids."""
    from gpuledger.agents.simcluster import simulate
    from gpuledger.streams.join import NodeJoin
    from gpuledger.ledger_files import load_ledger_config

    ledger = load_ledger_config(None)
    template: list[dict] = []
    joins: dict[str, NodeJoin] = {}
    for e in simulate(SimSpec(nodes=4, hours=0.25)):
        if e.line != "gpu-samples":
            continue
        j = joins.setdefault(e.message.node, NodeJoin(node=e.message.node))
        j.add_tick(e.message)
        recs = j.close_until(e.message.ts_ms + e.message.interval_ms, ledger)
        if recs:
            template.extend(usage_rows(UsageBatch(node=j.node, records=recs), Source("bench.usage", 0, len(template))))
    rows = []
    i = 0
    while len(rows) < n:
        for r in template:
            rows.append({**r, "record_id": f"{r['record_id']}#{i}", "kafka_offset": len(rows)})
            if len(rows) >= n:
                break
        i += 1
    return rows


def writer(client, database: str, n: int, batch: int = 20_000) -> dict:
    client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    migrate(client, database)
    client.database = database
    rows = writer_rows(n)
    w = ClickHouseWriter(client, database)
    w.write("usage_raw", rows[:batch])  # warm
    client.command("TRUNCATE TABLE usage_raw")
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        w.write("usage_raw", rows[i:i + batch])
    writer_s = time.perf_counter() - t0
    client.command("TRUNCATE TABLE usage_raw")
    names = list(rows[0])
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        chunk = rows[i:i + batch]
        insert_rows(client, "usage_raw", {k: [r[k] for r in chunk] for k in names}, database=database)
    columnar_s = time.perf_counter() - t0
    client.command("TRUNCATE TABLE usage_raw")
    gpus = math.ceil(n / TICKS_PER_MONTH)
    t0 = time.perf_counter()
    client.command(_usage_select(n, gpus))
    engine_s = time.perf_counter() - t0
    count = client.query("SELECT count() FROM usage_raw").result_rows[0][0]
    return {"rows": n, "batch_rows": batch, "writer_rows_per_s": n / writer_s,
            "columnar_insert_rows_per_s": n / columnar_s, "engine_insert_select_rows_per_s": n / engine_s,
            "writer_vs_columnar": columnar_s / writer_s, "writer_vs_engine": engine_s / writer_s,
            "engine_rows_checked": count}


def run() -> dict:
    path = workdir() / "warehouse-chdb"
    if path.exists():
        shutil.rmtree(path)
    settings = Settings(warehouse=f"chdb:{path}", database="bench_writer")
    client = connect(settings)
    try:
        say(f"warehouse: writer, {SIZES.writer_rows:,} usage rows in batches of 20,000 ...")
        wr = writer(client, "bench_writer", SIZES.writer_rows)
        say(f"warehouse: writer {wr['writer_rows_per_s']:,.0f} rows/s (columnar {wr['columnar_insert_rows_per_s']:,.0f}, "
            f"engine-internal {wr['engine_insert_select_rows_per_s']:,.0f})")
        client.command("DROP DATABASE bench_writer")
        out = {"writer_rows_per_s": wr["writer_rows_per_s"], "warehouse_detail": {"writer": wr}}
        for key, rows, db in (("10m", SIZES.bill_small_rows, "bench_bill_small"), ("100m", SIZES.bill_large_rows, "bench_bill_large")):
            res = bill_at(client, db, rows)
            say(f"warehouse: bill at {rows:,} rows: MV {res['mv_query_s'] * 1000:.1f} ms, raw {res['raw_query_s'] * 1000:.0f} ms, "
                f"x{res['speedup']:.0f}")
            out[f"bill_query_speedup_{key}"] = res["speedup"]
            out["warehouse_detail"][f"bill_{key}"] = res
            client.command(f"DROP DATABASE {db}")
        return out
    finally:
        client.close()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    for k, v in run().items():
        print(k, v)
