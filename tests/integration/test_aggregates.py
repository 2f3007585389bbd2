"""sql/0018: the dashboard views read aggregate tables, with the same rows as the raw-scanning views
they replace (sql/0010, sql/0015), on random usage written before the upgrade (back-filled) and after
it (materialized views), in many blocks, as per-tick records and as segments, with shared GPUs."""

from __future__ import annotations

import math
import random
import re

import pytest

from gpuledger.warehouse import idle_stretches, migrations

from warehouse_helpers import warehouse_before

pytestmark = pytest.mark.integration

DB = "agg_test"
T0 = 1_709_251_200_000  # 2024-03-01T00:00:00Z
STATES = ["executing", "allocated_idle", "unallocated", "down"]
# views of 0018 -> (migration holding the raw-scanning definition it replaces, its ORDER BY)
REPLACED = {
    "gpu_current": ("0010", "cluster, gpu_uuid"),
    "gpu_load_5m": ("0010", "ts, cluster, node, gpu_uuid, queue"),
    "gpu_health_daily": ("0010", "day, cluster, gpu_uuid"),
    "job_util_histogram": ("0010", "cluster, job_id, attempt, gpu_model, util_bucket_pct"),
    "job_gpu_balance": ("0010", "cluster, job_id, attempt, gpu_uuid"),
    "job_idle_stretches": ("0010", "cluster, job_id, attempt, gpu_uuid, stretch_start, stretch_end"),
    "utilization_hourly": ("0010", "hour, cluster, gpu_model"),
    "tenant_daily_bill": ("0015", "day, tenant, definition_version"),
    "job_cost_by_attempt": ("0010", "day, cluster, job_id, attempt, gpu_model, definition_version, line, gpu_hours"),
}


def old_view_sql(name: str, version: str) -> str:
    """The view's last definition before 0018, from its migration file, renamed old_<name>."""
    (mg,) = [m for m in migrations.load_migrations() if m.version == version]
    bodies = ["\n".join(ln for ln in s.splitlines() if not ln.strip().startswith("--")) for s in mg.statements()]
    (stmt,) = [s for s in bodies if re.match(rf"CREATE (OR REPLACE )?VIEW (IF NOT EXISTS )?{name} AS", s)]
    return re.sub(rf"^CREATE (OR REPLACE )?VIEW (IF NOT EXISTS )?{name} AS", f"CREATE VIEW old_{name} AS", stmt)


def usage_rows(rng: random.Random, gpu: int, start: int, end: int, tick_ms: int) -> list[list]:
    """One GPU's records over [start, end): runs of a state and holder(s), cut every tick_ms
    (5 s: per-tick records; 60 s: segments). Some GPUs are shared by two jobs at a time."""
    rows, t = [], start
    while t < end:
        run_end = min(end, t + rng.choice([1, 3, 7, 20]) * 60_000 + rng.choice([0, 5_000, 35_000]))
        state = rng.choice(STATES)
        holders = [("", 0, "", "", 1000)]
        if state in ("executing", "allocated_idle"):
            n = 2 if gpu % 3 == 0 else 1
            holders = [(f"job-{rng.randrange(6)}-{k}", rng.randrange(2), f"tenant-{k}", f"q{k}", 1000 // n)
                       for k in range(n)]
        util = None if rng.random() < 0.2 else round(rng.uniform(0, 100), 3)
        while t < run_end:
            s_end = min(run_end, (t // tick_ms + 1) * tick_ms)
            for job, attempt, tenant, queue, share in holders:
                gms = (s_end - t) * share // 1000
                rows.append([1, f"g{gpu}/{t}/{job}", "c1", f"n{gpu // 4}", f"GPU-{gpu:08d}-x",
                             "A100" if gpu % 2 else "T4", t, s_end, state, job, attempt, tenant, queue, share,
                             gms, util if state != "down" else None, util, None, gms * 0.3, 1.0, "v1", gms,
                             gms * 3, "def-1", "usage", 0, 0])
            t = s_end
    return rows


USAGE_COLS = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms",
              "state", "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "util_pct", "util_metric_pct",
              "mem_used_bytes", "energy_j", "coefficient", "coefficient_version", "effective_gpu_ms", "cost_micros",
              "definition_version", "kafka_topic", "kafka_partition", "kafka_offset"]
HEALTH_COLS = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason",
               "temperature_c", "power_w", "util_gpu_pct", "mem_used_bytes", "xid_errors", "ecc_dbe_total"]
EVENT_COLS = ["schema_version", "event_id", "ts_ms", "kind", "cluster", "job_id", "attempt", "tenant", "queue",
              "priority", "requested_gpus", "gpu_nodes", "gpu_uuids", "gpu_share_milli", "gpu_container_ids",
              "aliases", "reason", "kafka_topic", "kafka_partition", "kafka_offset"]


def write(client, rng: random.Random, day_offset: int) -> None:
    start = T0 + day_offset * 86_400_000 + 22 * 3_600_000  # crosses midnight
    for gpu in range(8):
        rows = usage_rows(rng, gpu, start, start + 3 * 3_600_000, 5_000 if gpu % 2 else 60_000)
        for i in range(0, len(rows), 97):  # many blocks: aggregates merge partial states
            client.insert("usage_raw", rows[i:i + 97], column_names=USAGE_COLS, database=DB)
        health = [["c1", f"n{gpu // 4}", f"GPU-{gpu:08d}-x", "A100" if gpu % 2 else "T4", start + k * 30_000, 30_000,
                   "ok" if k % 17 else "degraded", "" if k % 23 else f"xid {k % 3}",
                   None if k % 11 == 0 else rng.uniform(30, 90), rng.uniform(50, 400), rng.uniform(0, 100),
                   rng.randrange(1 << 30), [79] if k % 29 == 0 else [], None]
                  for k in range(360)]
        client.insert("gpu_health", health, column_names=HEALTH_COLS, database=DB)
    events = [[1, f"e-{day_offset}-{j}-{k}-{a}", start + 1000, "failed" if (j + a) % 3 == 0 else "completed", "c1",
               f"job-{j}-{k}", a, f"tenant-{k}", f"q{k}", 0, 1.0, [], [], [], [], {}, "", "jobs", 0, 0]
              for j in range(6) for k in range(2) for a in range(2) if (j + k + a + day_offset) % 4]
    client.insert("job_events", events, column_names=EVENT_COLS, database=DB)


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return a == b


@pytest.fixture(scope="module")
def warehouse():
    # an "old" warehouse: apply everything before 0018 only, then write, then upgrade
    client = warehouse_before("0018", DB, prefix="agg-")
    write(client, random.Random(13), 0)
    for name, (version, _) in REPLACED.items():
        client.command(old_view_sql(name, version))
    assert "0018" in migrations.migrate(client, DB)  # back-fills from the rows above
    # the raw views below read usage_raw as stored: held unmerged so the replay's copies stay (sql/0022
    # folds copies of a record when parts merge; the aggregates keep counting them)
    client.command(f"SYSTEM STOP MERGES {DB}.usage_raw")
    write(client, random.Random(14), 1)  # through the materialized views
    write(client, random.Random(14), 1)  # every record again (a replay): duplicates count as in the raw views
    yield client


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_aggregate_view_equals_the_raw_view(warehouse, name):
    order = REPLACED[name][1]
    old = warehouse.query(f"SELECT * FROM {DB}.old_{name} ORDER BY {order}")
    new = warehouse.query(f"SELECT {', '.join(old.column_names)} FROM {DB}.{name} ORDER BY {order}")
    assert len(old.result_rows) > 0
    assert len(new.result_rows) == len(old.result_rows)
    for o, n in zip(old.result_rows, new.result_rows):
        assert all(same(x, y) for x, y in zip(o, n)), repr((name, old.column_names, o, n))


def test_health_history_keeps_the_hourly_figures(warehouse):
    raw = warehouse.query(f"""SELECT toStartOfHour(fromUnixTimestamp64Milli(ts_ms, 'UTC')) AS hour, gpu_uuid,
        count(), maxOrNull(temperature_c), sum(length(xid_errors)) FROM {DB}.gpu_health
        GROUP BY hour, gpu_uuid ORDER BY hour, gpu_uuid""").result_rows
    hourly = warehouse.query(f"""SELECT hour, gpu_uuid, samples, max_temperature_c, xid_count
        FROM {DB}.gpu_health_history ORDER BY hour, gpu_uuid""").result_rows
    assert raw and [tuple(r) for r in raw] == [tuple(r) for r in hourly]


def test_node_load_equals_the_per_gpu_load_summed_by_node(warehouse):
    """sql/0024: the per-node table (back-filled from usage_gpu_5m, then filled by its view, replay included)
    holds the sums of its GPUs' 5-minute rows."""
    sums = ("sum(total_gpu_ms), sum(executing_gpu_ms), sum(idle_gpu_ms), sum(unallocated_gpu_ms), sum(down_gpu_ms), "
            "sum(util_weighted_gpu_ms), sum(util_gpu_ms)")
    keys = "ts, day, cluster, node, gpu_model, queue"
    per_gpu = warehouse.query(f"SELECT {keys}, {sums} FROM {DB}.gpu_load_5m GROUP BY {keys} ORDER BY {keys}").result_rows
    per_node = warehouse.query(f"SELECT {keys}, {sums} FROM {DB}.node_load_5m GROUP BY {keys} ORDER BY {keys}").result_rows
    assert len(per_gpu) > 50 and len(per_node) == len(per_gpu)
    for g, n in zip(per_gpu, per_node):
        assert all(same(x, y) for x, y in zip(g, n)), (g, n)
    # fewer rows stored than per GPU: two nodes of four GPUs here
    stored = dict(warehouse.query(f"SELECT name, total_rows FROM system.tables WHERE database = '{DB}' "
                                  "AND name IN ('usage_gpu_5m', 'usage_node_5m')").result_rows)
    assert stored["usage_node_5m"] < stored["usage_gpu_5m"]


def test_idle_stretches_of_worked_out_days_equal_the_raw_view(warehouse):
    """sql/0028: with the first two days' stretches worked out (kept in idle_stretches_daily, as the bill
    close does) and the third left to the idle records, the view still gives the raw view's stretches:
    those across midnight joined, the replay's copies as the raw view sorts them."""
    days = [d for (d,) in warehouse.query(f"SELECT DISTINCT day FROM {DB}.job_idle_segments ORDER BY day").result_rows]
    assert len(days) == 3
    assert idle_stretches.refresh(warehouse, DB, "c1", days[:2]) == days[:2]
    assert idle_stretches.refresh(warehouse, DB, "c1", days[:2]) == []  # nothing changed since
    kept = warehouse.query(f"SELECT count() FROM {DB}.idle_stretches_daily FINAL").result_rows[0][0]
    assert kept > 0
    test_aggregate_view_equals_the_raw_view(warehouse, "job_idle_stretches")
