"""Retention on a real chDB warehouse (docs/retention.md): a node retired longer ago than the operations
retention (400 days) still has its allocations in job_events (kept with the usage, 7 years), so
node_inventory, which report unmatched checks them against, must be kept as long; with the operations
retention it had, the node's row expired and each of its allocations read as `unknown_node` (an
allocation on a node that never sent a sample)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.config import Settings
from gpuledger.warehouse import connect
from gpuledger.warehouse.migrations import migrate_configured
from gpuledger.warehouse.reports import fetch

pytestmark = pytest.mark.integration

EVENT_COLS = ["schema_version", "event_id", "ts_ms", "kind", "cluster", "job_id", "attempt", "tenant", "queue", "priority",
              "requested_gpus", "gpu_nodes", "gpu_uuids", "gpu_share_milli", "gpu_container_ids", "aliases", "reason",
              "kafka_topic", "kafka_partition", "kafka_offset", "inserted_at"]


def test_a_retired_nodes_allocations_are_not_unknown_nodes(tmp_path):
    settings = Settings(data_dir=tmp_path, warehouse=f"chdb:{tmp_path / 'chdb'}")  # the default retentions
    client = connect(settings)
    try:
        migrate_configured(client, settings)  # with the TTLs
        db = settings.database
        # a node that ran a job two years ago, written then, and retired since
        day = dt.date.today() - dt.timedelta(days=2 * 365)
        at = dt.datetime.combine(day, dt.time(12), dt.timezone.utc)
        ts = int(at.timestamp() * 1000)
        client.insert("job_events", [[1, "e1", ts, "allocated", "c", "j1", 0, "t", "q", 0, 1.0, ["n-retired"], ["g1"],
                                      [1000], [""], {}, "", "t", 0, 0, at]], column_names=EVENT_COLS)
        client.insert("node_inventory", [["c", "n-retired", ts, 1, ["g1"], ["m"], at]],
                      column_names=["cluster", "node", "seen_ms", "gpu_count", "gpu_uuids", "gpu_models", "inserted_at"])
        for table in ("job_events", "node_inventory"):
            client.command(f"OPTIMIZE TABLE {db}.{table} FINAL")  # the merges that apply the TTLs
        found = {(r["kind"], r["node"]) for r in fetch(client, db, "unmatched", day_from=day, day_to=day)}
        assert ("unknown_node", "n-retired") not in found, found
        assert client.query(f"SELECT count() FROM {db}.job_events").result_rows[0][0] == 1
        assert client.query(f"SELECT count() FROM {db}.node_inventory").result_rows[0][0] == 1
    finally:
        client.close()
