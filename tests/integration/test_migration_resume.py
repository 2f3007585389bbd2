"""A migration interrupted half-way (the process dies, the connection drops) and run again: the
back-fills it had done are not done twice. sql/0018's back-fills add to summing aggregates with no
check of what is there, so the migrator notes each INSERT it completes and a re-run resumes after the
last one noted. On the real engine (chDB); the interruption is an error raised before one statement."""

from __future__ import annotations

import pytest

from gpuledger.warehouse import WarehouseError, migrations

from warehouse_helpers import put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

DB = "resume_test"
T0 = 1_709_251_200_000  # 2024-03-01T00:00:00Z


def dies_before(client, start: str):
    """client.command raises once, before the first statement that starts with `start`."""
    real = client.command
    state = {"died": False}

    def command(sql, *args, **kwargs):
        code = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--")).strip()
        if not state["died"] and code.startswith(start):
            state["died"] = True
            raise ConnectionError("connection reset by peer")
        return real(sql, *args, **kwargs)
    client.command = command


def test_an_interrupted_back_fill_is_not_done_twice():
    client = warehouse_before("0018", DB, prefix="resume-")
    try:
        put_usage(client, DB, [usage_record("c1", f"GPU-{g}", T0 + m * 60_000, T0 + (m + 1) * 60_000, "executing",
                                            job="j1", tenant="t1") for g in range(3) for m in range(30)], 0)
        dies_before(client, "INSERT INTO usage_gpu_hourly")  # after usage_gpu_5m's back-fill
        with pytest.raises(WarehouseError, match="0018_retention_aggregates failed: connection reset"):
            migrations.migrate(client, DB)
        assert "0018" in migrations.migrate(client, DB)
        raw = client.query(f"SELECT sum(gpu_ms) FROM {DB}.usage_raw").result_rows[0][0]
        assert raw == 3 * 30 * 60_000
        for table, column in (("usage_gpu_5m", "total_gpu_ms"), ("usage_gpu_hourly", "gpu_ms")):
            assert client.query(f"SELECT sum({column}) FROM {DB}.{table}").result_rows[0][0] == raw, table
        # the notes of completed statements are not migrations
        assert "0018" in migrations.applied_migrations(client, DB)
        assert all("." not in v for v in migrations.applied_migrations(client, DB))
    finally:
        client.close()


def test_a_rebuild_interrupted_before_its_exchange_keeps_every_row():
    """sql/0034 empties its copy (TRUNCATE) before filling it: a re-run resumes after the copy, it
    neither empties the copy again nor swaps an empty table in."""
    client = warehouse_before("0034", DB, prefix="resume-")
    try:
        cols = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason",
                "temperature_c", "xid_errors"]
        client.insert("gpu_health", [["c1", "n1", f"GPU-{g}", "A100", T0 + m * 60_000, 60_000, "ok", "", 40.0, []]
                                     for g in range(2) for m in range(50)], column_names=cols, database=DB)
        dies_before(client, "EXCHANGE TABLES gpu_health")
        with pytest.raises(WarehouseError, match="0034_gpu_health_by_day failed"):
            migrations.migrate(client, DB)
        assert "0034" in migrations.migrate(client, DB)
        rows = client.query(f"SELECT count(), uniqExact(gpu_uuid, ts_ms) FROM {DB}.gpu_health").result_rows[0]
        assert rows == (100, 100)
        assert client.query("SELECT partition_key FROM system.tables WHERE database = {db:String} "
                            "AND name = 'gpu_health'", parameters={"db": DB}).result_rows[0][0] == "day"
    finally:
        client.close()


def test_migrations_this_release_does_not_know_are_warned_of(tmp_path, caplog):
    """A warehouse migrated by a newer release, then run by an older one (a rollback): nothing to apply,
    and the operator is told which recorded migrations this release lacks."""
    client = warehouse_before("0002", DB, prefix="resume-")
    try:
        client.insert(migrations.MIGRATIONS_TABLE, [["9999", "from_the_future", "0" * 64]],
                      column_names=["version", "name", "checksum"], database=DB)
        with caplog.at_level("WARNING", logger=migrations.__name__):
            migrations.migrate(client, DB)
        assert "9999_from_the_future" in caplog.text and "newer release" in caplog.text
    finally:
        client.close()
