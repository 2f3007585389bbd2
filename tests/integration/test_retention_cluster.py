"""Retention TTLs applied by the migrator (gpuledger/warehouse/retention.py), and the cluster rendering
of every migration (gpuledger/warehouse/cluster.py) checked with ClickHouse's own parser.

No ClickHouse cluster runs here (no ZooKeeper/Keeper, no second server): the cluster rendering is
checked by parsing every statement and by comparing the columns it creates with the single-node ones."""

from __future__ import annotations

import datetime as dt
import re
import tempfile

import pytest
from clickhouse_connect import get_client

from gpuledger.config import Settings
from gpuledger.warehouse import cluster, migrations, retention

pytestmark = pytest.mark.integration

DB = "ret_test"


@pytest.fixture(scope="module")
def client():
    c = get_client(interface="chdb", path=tempfile.mkdtemp(prefix="ret-"))
    yield c


def ttl_of(client, table: str) -> str:
    return client.query(f"SELECT engine_full FROM system.tables WHERE database = '{DB}' AND name = '{table}'"
                        ).result_rows[0][0]


def test_retention_is_set_from_settings_once_and_removed_at_zero(client, tmp_path):
    settings = Settings(data_dir=tmp_path, retention_health_days=3)
    migrations.migrate(client, DB, retention=retention.wanted_ttls(settings))
    for table, r in retention.RETENTION.items():
        days = getattr(settings, r.setting)
        if client.query(f"EXISTS TABLE {DB}.{table}").result_rows[0][0]:
            assert (" TTL " in ttl_of(client, table)) == (days > 0), table
    assert "toIntervalDay(3)" in ttl_of(client, "gpu_health")
    # rows expire with their partition, and expired parts are dropped whole, not rewritten
    keys = dict(client.query(f"SELECT name, partition_key FROM system.tables WHERE database = '{DB}'").result_rows)
    for table, r in retention.RETENTION.items():
        if table not in keys:
            continue
        day_column = re.search(r"\b(day|booked_day|created_at)\b", r.expiry).group(1)
        assert keys[table] == {"month": f"toYYYYMM({day_column})", "day": day_column, "": ""}[r.partition], table
        engine, expires = ttl_of(client, table), getattr(settings, r.setting) > 0
        assert retention.drop_parts_in_engine(engine) == (expires and r.partition != ""), table
        assert ("toLastDayOfMonth(" in engine) == (expires and retention.counts_from_month_end(table)), table
    # applied already: nothing to do
    assert retention.apply_retention(client, DB, retention.wanted_ttls(settings)) == []
    # every table is either retained by a setting or kept for a stated reason
    tables = {r[0] for r in client.query(f"SELECT name FROM system.tables WHERE database = '{DB}' AND engine LIKE '%MergeTree'").result_rows}
    unclassified = tables - set(retention.RETENTION) - set(retention.KEPT)
    assert not unclassified, f"tables without a retention (retention.RETENTION) or a reason to keep them (KEPT): {unclassified}"
    kept = Settings(data_dir=tmp_path, retention_health_days=0)
    ran = retention.apply_retention(client, DB, retention.wanted_ttls(kept))
    assert ran == [f"ALTER TABLE `{DB}`.`gpu_health` REMOVE TTL"]
    assert " TTL " not in ttl_of(client, "gpu_health")


def test_old_samples_written_now_are_kept_old_aggregates_expire(client, tmp_path):
    settings = Settings(data_dir=tmp_path, retention_health_days=14, retention_load_5m_days=90)
    migrations.migrate(client, DB, retention=retention.wanted_ttls(settings))
    old = int(dt.datetime(2024, 3, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)
    new = int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    cols = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason", "xid_errors"]
    client.insert("gpu_health", [["c", "n", "g", "m", ts, 5000, "ok", "", []] for ts in (old, new)],
                  column_names=cols, database=DB)
    # written in 2024, on a day of its own: its part expired whole (a part that also held the sample
    # written today would wait for it)
    day_after = old + 86_400_000
    old_written = [["c", "n", "g-old", "m", day_after, 5000, "ok", "", [], dt.datetime(2024, 3, 2)]]
    client.insert("gpu_health", old_written, column_names=cols + ["inserted_at"], database=DB)
    usage_cols = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms",
                  "state", "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "energy_j", "coefficient",
                  "coefficient_version", "effective_gpu_ms", "cost_micros", "definition_version", "kafka_topic",
                  "kafka_partition", "kafka_offset"]
    client.insert("usage_raw", [[1, f"r{ts}", "c", "n", "g", "m", ts, ts + 5000, "unallocated", "", 0, "", "", 1000,
                                 5000, 0., 1., "v", 5000, 5000, "d", "t", 0, 0] for ts in (old, new)],
                  column_names=usage_cols, database=DB)
    for table in ("gpu_health", "usage_gpu_5m", "usage_raw"):
        client.command(f"OPTIMIZE TABLE {DB}.{table} FINAL")
    health = client.query(f"SELECT gpu_uuid, ts_ms FROM {DB}.gpu_health ORDER BY gpu_uuid, ts_ms").result_rows
    # a 2024 sample written today stays 14 days; one written in 2024 is gone
    assert health == [("g", old), ("g", new)]
    five = client.query(f"SELECT toUnixTimestamp(ts) * 1000 FROM {DB}.usage_gpu_5m").result_rows
    assert five == [(new - new % 300_000,)]  # the 2024 bucket expired (90 days after its day)
    assert client.query(f"SELECT count() FROM {DB}.usage_raw").result_rows == [(2,)]  # 7 years


# ------------------------------------------------------------------------------------------ cluster
def _columns_from_create(sql: str) -> list[tuple[str, str]]:
    """Columns of a canonical (formatQuery) CREATE TABLE: one `name` Type ... per line."""
    cols = []
    for line in sql.splitlines():
        m = re.match(r"^    `(\w+)` (.+?)(?: DEFAULT .*| MATERIALIZED .*| CODEC.*)?,?$", line)
        if m:
            cols.append((m.group(1), m.group(2).rstrip(",")))
    return cols


def simulate_columns(statements: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Table -> columns after the CREATE TABLE, ALTER ... COLUMN, EXCHANGE TABLES and DROP TABLE
    statements, in order."""
    tables: dict[str, list[tuple[str, str]]] = {}
    for sql in statements:
        if m := re.match(r"^EXCHANGE TABLES `?(\w+)`? AND `?(\w+)`?", sql):
            a, b = m.groups()
            tables[a], tables[b] = tables[b], tables[a]
        elif m := re.match(r"^DROP TABLE IF EXISTS `?(\w+)`?", sql):
            tables.pop(m.group(1), None)
        elif m := re.match(r"^CREATE TABLE (?:IF NOT EXISTS )?`?(\w+)`?(?: ON CLUSTER `?\w+`?)? AS `?(\w+)`?\n", sql):
            tables[m.group(1)] = list(tables[m.group(2)])
        elif m := re.match(r"^CREATE TABLE (?:IF NOT EXISTS )?`?(\w+)`?", sql):
            tables.setdefault(m.group(1), _columns_from_create(sql))
        elif m := re.match(r"^ALTER TABLE `?(\w+)`?", sql):
            cols = tables.get(m.group(1))
            for line in sql.splitlines()[1:]:
                a = re.match(r"^\s*\((ADD|MODIFY) COLUMN (?:IF NOT EXISTS )?`(\w+)` (.*)\),?$", line.strip())
                if not a:
                    continue
                kind, name, rest = a.groups()
                after = re.search(r" AFTER (\w+)$", rest)
                rest = rest[:after.start()] if after else rest
                typ = re.split(r" (?:DEFAULT|MATERIALIZED|CODEC|COMMENT)\b", rest)[0]
                names = [c[0] for c in cols]
                if kind == "ADD" and name not in names:
                    cols.insert(names.index(after.group(1)) + 1 if after else len(cols), (name, typ))
                elif kind == "MODIFY":
                    cols[names.index(name)] = (name, typ)
    return tables


@pytest.fixture(scope="module")
def rendered(client):
    fmt = cluster.server_formatter(client)
    statements = [s for mg in migrations.load_migrations() for s in mg.statements()]
    single = [fmt(s) for s in statements]
    clustered = cluster.render_statements(statements, "ledger", "gpuledger", formatter=fmt)
    return single, clustered


def test_every_cluster_statement_parses_and_is_clustered(client, rendered):
    _, clustered = rendered
    fmt = cluster.server_formatter(client)
    for sql in clustered:
        assert fmt(sql).strip() == sql.strip()  # ClickHouse reads it back to the same text
        if sql.startswith("INSERT"):  # synchronous: on the shards before the next statement runs
            assert re.search(r"\nSETTINGS (.+, )?distributed_foreground_insert = 1(, .+)?\n", sql), sql
            # IN subqueries over Distributed tables run once on the initiator (test_cluster_two_shards.py)
            assert re.search(r"\nSETTINGS (.+, )?distributed_product_mode = 'global'(, .+)?\n", sql), sql
        else:
            assert re.search(r"ON CLUSTER `?ledger`?\b", sql), sql
        assert not re.search(r"ENGINE = (Replacing|Summing|Aggregating)?MergeTree", sql), sql
        assert "non_replicated_deduplication_window" not in sql
    mvs = [s for s in clustered if s.startswith("CREATE MATERIALIZED VIEW")]
    assert mvs and all(re.search(r"TO `?\w+_local`?\n", s) and re.search(r"FROM `?\w+_local`?\n", s) for s in mvs)
    dist = {re.match(r"CREATE TABLE IF NOT EXISTS `?(\w+)`?", s).group(1): s for s in clustered if "Distributed(" in s}
    assert "cityHash64(gpu_uuid)" in dist["usage_raw"] and "cityHash64(cluster, job_id)" in dist["job_events"]


def test_both_renderings_create_the_same_columns(client, rendered):
    single, clustered = rendered
    one = simulate_columns(single)
    many = simulate_columns(clustered)
    # the simulation reads the single-node rendering as the engine does
    migrations.migrate(client, DB)
    for table, cols in one.items():
        if table == migrations.MIGRATIONS_TABLE:
            continue
        real = client.query(f"SELECT name, type FROM system.columns WHERE database = '{DB}' AND table = '{table}' "
                            "ORDER BY position").result_rows
        assert [tuple(r) for r in real] == cols, table
    assert one, "no tables"
    for table, cols in one.items():
        assert many[table + cluster.LOCAL_SUFFIX] == cols, table
        assert many[table] == cols, table  # the Distributed table
    assert set(many) == set(one) | {t + cluster.LOCAL_SUFFIX for t in one}
