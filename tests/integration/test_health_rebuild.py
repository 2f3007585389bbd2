"""sql/0034 rebuilds gpu_health partitioned by day on a warehouse that holds samples: every sample
survives once, the columns stay, the materialized views follow the name, and a file interrupted
anywhere (after its copy, after its EXCHANGE, or after everything but its record) runs again without
copying a sample twice or swapping the tables back. On the real engine (chDB)."""

from __future__ import annotations

import pytest

from clickhouse_connect import get_client

from gpuledger.sink.writer import ClickHouseWriter
from gpuledger.warehouse import migrations

from warehouse_helpers import warehouse_before

pytestmark = pytest.mark.integration

DB = "health_rebuild_test"
T0 = 1_709_335_800_000  # 2024-03-01T23:30:00Z: the samples cross midnight
DAY_MS = 86_400_000
SPARSE_DAYS = 120  # one GPU sampled once a day: more days than ClickHouse's 100 partitions per insert block
COLS = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason",
        "temperature_c", "xid_errors"]


def samples(first_minute: int, minutes: int, gpus: int = 4) -> list[list]:
    return [["c1", "n1", f"GPU-{g}", "A100", T0 + m * 60_000, 60_000, "ok" if m % 7 else "degraded", "",
             40.0 + g, [79] if m == 3 else []]
            for m in range(first_minute, first_minute + minutes) for g in range(gpus)]


def sparse() -> list[list]:
    return [["c1", "n2", "GPU-sparse", "T4", T0 + d * DAY_MS, DAY_MS, "ok", "", None, []] for d in range(SPARSE_DAYS)]


@pytest.fixture()
def old_warehouse():
    """A warehouse at 0033 holding 240 samples over two days and 120 over 120 days, partitioned by month."""
    client = warehouse_before("0034", DB, prefix="health-rebuild-")
    client.insert("gpu_health", samples(0, 60), column_names=COLS, database=DB)
    client.insert("gpu_health", sparse(), column_names=COLS, database=DB)
    yield client
    client.close()


def columns(client) -> list[tuple]:
    return [tuple(r) for r in client.query("SELECT name, type, default_expression FROM system.columns "
                                           "WHERE database = {db:String} AND table = 'gpu_health' ORDER BY position",
                                           parameters={"db": DB}).result_rows]


def state(client) -> dict:
    partition = client.query("SELECT partition_key FROM system.tables WHERE database = {db:String} "
                             "AND name = 'gpu_health'", parameters={"db": DB}).result_rows[0][0]
    leftovers = client.query("SELECT count() FROM system.tables WHERE database = {db:String} "
                             "AND name = 'gpu_health_by_day'", parameters={"db": DB}).result_rows[0][0]
    rows, distinct = client.query(f"SELECT count(), uniqExact(gpu_uuid, ts_ms) FROM {DB}.gpu_health").result_rows[0]
    partitions = client.query(f"SELECT uniqExact(partition), min(partition), max(partition) FROM system.parts "
                              f"WHERE database = '{DB}' AND table = 'gpu_health' AND active").result_rows[0]
    hourly = client.query(f"SELECT sum(samples) FROM {DB}.gpu_health_hourly").result_rows[0][0]
    return {"partition_key": partition, "staging_left": leftovers, "rows": rows, "distinct": distinct,
            "partitions": tuple(partitions), "hourly_samples": hourly}


AFTER = {"partition_key": "day", "staging_left": 0, "rows": 240 + SPARSE_DAYS, "distinct": 240 + SPARSE_DAYS,
         "partitions": (SPARSE_DAYS, "2024-03-01", "2024-06-28"), "hourly_samples": 240 + SPARSE_DAYS}


def test_the_rebuild_keeps_every_sample_and_the_views_follow(old_warehouse):
    client = old_warehouse
    before = columns(client)
    assert "0034" in migrations.migrate(client, DB)
    assert state(client) == AFTER
    assert columns(client) == before
    settings = client.query("SELECT engine_full FROM system.tables WHERE database = {db:String} "
                            "AND name = 'gpu_health'", parameters={"db": DB}).result_rows[0][0]
    assert "ttl_only_drop_parts = 1" in settings and "non_replicated_deduplication_window = 1000" in settings
    # the hourly view fires on the rebuilt table: a new sample reaches it
    client.insert("gpu_health", samples(60, 1, gpus=1), column_names=COLS, database=DB)
    assert state(client)["hourly_samples"] == 240 + SPARSE_DAYS + 1


@pytest.mark.parametrize("done", [2, 3])  # the process dies after the copy, or after the EXCHANGE
def test_a_rebuild_interrupted_runs_again_without_copying_twice(old_warehouse, done):
    client = old_warehouse
    (rebuild,) = [mg for mg in migrations.load_migrations() if mg.version == "0034"]
    statements = rebuild.statements()
    verbs = [next(line for line in s.splitlines() if line.strip() and not line.startswith("--")).split()[0]
             for s in statements]
    assert verbs == ["CREATE", "TRUNCATE", "INSERT", "EXCHANGE", "DROP"]
    for statement in statements[:done + 1]:
        client.command(statement)
    assert migrations.migrate(client, DB)[0] == "0034"  # the whole file again
    assert state(client) == AFTER


def test_a_rebuild_done_but_not_recorded_runs_again_harmlessly(old_warehouse):
    client = old_warehouse
    migrations.migrate(client, DB)
    client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0034'")
    assert migrations.migrate(client, DB) == ["0034"]
    assert state(client) == AFTER


def test_the_sink_writes_a_block_of_more_days_than_clickhouses_partition_limit(tmp_path):
    """A backlog or a rebuild can bring the sink one block that spans more than 100 days: by day,
    that is more than ClickHouse's default partitions per insert block. Refused, the block would be
    retried for ever; the sink's writer lifts the limit, and its dedup token still holds."""
    client = get_client(interface="chdb", path=str(tmp_path / "chdb"))
    try:
        migrations.migrate(client, DB)
        rows = [dict(zip(COLS, r)) for r in sparse()]
        writer = ClickHouseWriter(client, DB)
        writer.write("gpu_health", rows, token="gpu-samples/0/e0/0-119/gpu_health")
        writer.write("gpu_health", rows, token="gpu-samples/0/e0/0-119/gpu_health")  # a restart writes it again
        assert client.query(f"SELECT count(), uniqExact(day) FROM {DB}.gpu_health").result_rows == [(SPARSE_DAYS, SPARSE_DAYS)]
    finally:
        client.close()
