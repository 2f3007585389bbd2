"""`gpuledger report storage` end to end on a real chDB (gpuledger/warehouse/storage.py): every stored
table with its retention setting, whether its TTL is the configured one, rows, compressed bytes, the
span of event days and the bytes it will hold at its retention; a setting changed without `gpuledger
migrate` is reported, and the migrate that follows clears it."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from gpuledger.cli import main
from gpuledger.config import Settings
from gpuledger.warehouse import connect
from gpuledger.warehouse.retention import KEPT, RETENTION
from gpuledger.warehouse.storage import parts_sql

pytestmark = pytest.mark.integration

USAGE_COLS = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms",
              "state", "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "energy_j", "coefficient",
              "coefficient_version", "effective_gpu_ms", "cost_micros", "definition_version", "kafka_topic",
              "kafka_partition", "kafka_offset"]
HEALTH_COLS = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason", "xid_errors"]


def ms(day: str) -> int:
    return int(dt.datetime.fromisoformat(day).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


def storage(wh, capsys) -> dict[str, dict]:
    assert main(["report", "storage", "--format", "json", *wh]) == 0
    rows = json.loads(capsys.readouterr().out)
    return {r["table"]: r for r in rows}


def test_storage_report_shows_each_table_against_its_retention(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPULEDGER_RETENTION_HEALTH_DAYS", "3")
    wh = ["--warehouse", f"chdb:{tmp_path / 'chdb'}", "--data-dir", str(tmp_path)]
    assert main(["migrate", *wh]) == 0
    capsys.readouterr()
    settings = Settings(data_dir=tmp_path, warehouse=f"chdb:{tmp_path / 'chdb'}")
    client = connect(settings)
    try:
        client.insert("usage_raw", [[1, f"r{i}", "c", "n", "g", "m", ms(d), ms(d) + 60_000, "unallocated", "", 0, "",
                                     "", 1000, 60_000, 0., 1., "v", 60_000, 0, "d", "t", 0, i]
                                    for i, d in enumerate(("2026-11-01", "2026-11-04", "2026-11-10"))],
                      column_names=USAGE_COLS)
        client.insert("gpu_health", [["c", "n", "g", "m", ms("2026-11-10") + i * 5000, 5000, "ok", "", []]
                                     for i in range(4)], column_names=HEALTH_COLS)
        # not partitioned by a date: its day span is read from its rows
        client.insert("node_inventory", [["c", "n", ms("2026-11-03"), 8, [], []], ["c", "m", ms("2026-11-05"), 8, [], []]],
                      column_names=["cluster", "node", "seen_ms", "gpu_count", "gpu_uuids", "gpu_models"])
        # no ClickHouse cluster runs here: its query is checked with ClickHouse's own parser
        parsed = client.query("SELECT formatQuery({q:String})", parameters={"q": parts_sql("prod")}).result_rows[0][0]
        assert "cluster('prod', system.parts)" in parsed
        # its TTL as configured, but expired parts would be rewritten instead of dropped
        client.command("ALTER TABLE usage_gpu_5m MODIFY SETTING ttl_only_drop_parts = 0")
    finally:
        client.close()

    tables = storage(wh, capsys)
    total = tables.pop("(all tables)")
    assert set(tables) <= set(RETENTION) | set(KEPT)
    assert {"usage_raw", "gpu_health", "closed_tenant_bill", "gpu_latest", "schema_migrations"} <= set(tables)

    usage = tables["usage_raw"]
    assert (usage["kept_for"], usage["setting"], usage["ttl"]) == ("2557 days", "GPULEDGER_RETENTION_USAGE_DAYS", "applied")
    assert (usage["rows"], usage["first_day_utc"], usage["last_day_utc"]) == (3, "2026-11-01", "2026-11-10")
    assert usage["bytes_on_disk"] > 0
    assert usage["daily_bytes"] == round(usage["bytes_on_disk"] / 10)  # 10 days of data
    assert usage["bytes_at_retention"] == usage["daily_bytes"] * (2557 + 31)  # its rows wait for their month's end

    health = tables["gpu_health"]
    assert (health["kept_for"], health["ttl"], health["rows"]) == ("3 days", "applied", 4)
    assert health["bytes_at_retention"] == health["daily_bytes"] * (3 + 1)  # one day of data; partitioned by day
    assert tables["usage_gpu_5m"]["ttl"] == "differs: run gpuledger migrate"

    nodes = tables["node_inventory"]
    assert (nodes["rows"], nodes["first_day_utc"], nodes["last_day_utc"]) == (2, "2026-11-03", "2026-11-05")
    assert tables["gpu_latest"]["first_day_utc"] is None  # no day column

    bill = tables["closed_tenant_bill"]  # retention 0 by default: kept, no TTL, nothing in it yet
    assert (bill["kept_for"], bill["ttl"], bill["rows"], bill["bytes_at_retention"]) == ("kept", "none", 0, None)
    latest = tables["gpu_latest"]  # kept on purpose, with the reason
    assert (latest["setting"], latest["why"]) == ("", KEPT["gpu_latest"])

    assert total["rows"] == sum(t["rows"] for t in tables.values())
    assert total["bytes_on_disk"] == sum(t["bytes_on_disk"] for t in tables.values())
    assert total["bytes_at_retention"] == sum(t["bytes_at_retention"] or 0 for t in tables.values())

    # a setting changed without a migrate: the report says so; the migrate sets it
    monkeypatch.setenv("GPULEDGER_RETENTION_HEALTH_DAYS", "5")
    monkeypatch.setenv("GPULEDGER_RETENTION_BILLS_DAYS", "3650")
    tables = storage(wh, capsys)
    assert tables["gpu_health"]["ttl"] == "differs: run gpuledger migrate"
    assert tables["closed_tenant_bill"]["ttl"] == "missing: run gpuledger migrate"
    monkeypatch.setenv("GPULEDGER_RETENTION_HEALTH_DAYS", "0")
    assert storage(wh, capsys)["gpu_health"]["ttl"] == "set, not configured: run gpuledger migrate"
    assert main(["migrate", *wh]) == 0
    capsys.readouterr()
    tables = storage(wh, capsys)
    assert (tables["gpu_health"]["ttl"], tables["gpu_health"]["kept_for"]) == ("none", "kept")
    assert (tables["closed_tenant_bill"]["ttl"], tables["closed_tenant_bill"]["kept_for"]) == ("applied", "3650 days")
    assert tables["usage_gpu_5m"]["ttl"] == "applied"

    assert main(["report", "storage", *wh]) == 0  # the table: one line per table, the total last
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["table", "kept_for", "setting"] and lines[-1].startswith("(all tables)")
    assert main(["report", "storage", "--tenant", "t1", *wh]) == 2
    assert "report storage takes no --tenant" in capsys.readouterr().err
