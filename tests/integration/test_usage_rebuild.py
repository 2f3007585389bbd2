"""sql/0022 rebuilds usage_raw (day-first sort key, ReplacingMergeTree) on a warehouse that holds rows:
every record survives, the materialized views follow the name, copies fold, and a file interrupted after
its EXCHANGE (or after everything but its record) runs again without swapping the tables back. On the
real engine (chDB)."""

from __future__ import annotations

import pytest

from gpuledger.warehouse import migrations

from warehouse_helpers import warehouse_before

pytestmark = pytest.mark.integration

DB = "rebuild_test"
T0 = 1_709_335_800_000  # 2024-03-01T23:30:00Z: the records cross midnight
NEW_KEY = "cluster, day, intDiv(start_ms, 3600000), gpu_uuid, start_ms, record_id"
COLS = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms", "state",
        "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "util_pct", "util_metric_pct",
        "mem_used_bytes", "energy_j", "coefficient", "coefficient_version", "effective_gpu_ms", "cost_micros",
        "definition_version", "kafka_topic", "kafka_partition", "kafka_offset"]


def records(first_minute: int, minutes: int, gpus: int = 4) -> list[list]:
    return [[1, f"GPU-{g}/{T0 + m * 60_000}/0", "c1", "n1", f"GPU-{g}", "A100", T0 + m * 60_000, T0 + (m + 1) * 60_000,
             "executing" if (g + m) % 3 else "allocated_idle", f"job-{g % 2}", 0, "t1", "q1", 1000, 60_000, 50.0,
             50.0, None, 10.0, 1.0, "v1", 60_000, 8_840, "def-1", "usage", 0, m]
            for m in range(first_minute, first_minute + minutes) for g in range(gpus)]


def insert(client, rows: list[list]) -> None:
    client.insert("usage_raw", rows, column_names=COLS, database=DB)


@pytest.fixture()
def old_warehouse():
    """A warehouse at 0021 holding 240 records, 40 of them written twice (a replay)."""
    client = warehouse_before("0022", DB, prefix="rebuild-")
    insert(client, records(0, 60))
    insert(client, records(0, 10))
    yield client
    client.close()


def state(client) -> dict:
    table = client.query("SELECT engine, sorting_key FROM system.tables WHERE database = {db:String} "
                         "AND name = 'usage_raw'", parameters={"db": DB}).result_rows[0]
    leftovers = client.query("SELECT count() FROM system.tables WHERE database = {db:String} "
                             "AND name = 'usage_raw_by_day'", parameters={"db": DB}).result_rows[0][0]
    ids, cost = client.query(f"SELECT uniqExact(record_id), sum(cost_micros) FROM {DB}.usage_raw FINAL").result_rows[0]
    written = client.query(f"SELECT sum(slices) FROM {DB}.usage_capacity_daily").result_rows[0][0]
    return {"engine": table[0], "key": table[1], "staging_left": leftovers, "ids": ids, "final_cost": cost,
            "written": written}


def test_the_rebuild_keeps_every_record_and_the_views_follow(old_warehouse):
    client = old_warehouse
    assert "0022" in migrations.migrate(client, DB)
    after = state(client)
    assert after == {"engine": "ReplacingMergeTree", "key": NEW_KEY, "staging_left": 0, "ids": 240,
                     "final_cost": 240 * 8_840, "written": 280}
    # both days of the records are there, each record once under FINAL
    days = client.query(f"SELECT day, count() FROM {DB}.usage_raw FINAL GROUP BY day ORDER BY day").result_rows
    assert [n for _, n in days] == [120, 120]
    # the materialized views fire on the rebuilt table: a new record reaches the aggregates
    insert(client, records(60, 1, gpus=1))
    assert state(client)["written"] == 281
    # a replay of records already there: FINAL reads each once, merges keep one
    insert(client, records(0, 60))
    assert state(client)["ids"] == 241 and state(client)["final_cost"] == 241 * 8_840
    client.command(f"OPTIMIZE TABLE {DB}.usage_raw FINAL")
    assert client.query(f"SELECT count() FROM {DB}.usage_raw").result_rows[0][0] == 241


def test_a_rebuild_interrupted_after_its_exchange_does_not_swap_back(old_warehouse):
    client = old_warehouse
    (rebuild,) = [mg for mg in migrations.load_migrations() if mg.version == "0022"]
    create, copy, exchange, drop = rebuild.statements()
    assert exchange.startswith("EXCHANGE TABLES") and drop.startswith("DROP TABLE")
    for statement in (create, copy, exchange):  # the process dies before the DROP and the record
        client.command(statement)
    assert state(client)["key"] == NEW_KEY
    assert migrations.migrate(client, DB)[0] == "0022"  # the whole file again: copy, (no) exchange, drop
    assert state(client) == {"engine": "ReplacingMergeTree", "key": NEW_KEY, "staging_left": 0, "ids": 240,
                             "final_cost": 240 * 8_840, "written": 280}


def test_a_rebuild_done_but_not_recorded_runs_again_harmlessly(old_warehouse):
    client = old_warehouse
    migrations.migrate(client, DB)
    client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0022'")
    assert migrations.migrate(client, DB) == ["0022"]
    assert state(client) == {"engine": "ReplacingMergeTree", "key": NEW_KEY, "staging_left": 0, "ids": 240,
                             "final_cost": 240 * 8_840, "written": 280}
