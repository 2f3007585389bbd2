"""Helpers of the warehouse tests: a migrated embedded warehouse, one as an older release left it (for
the tests of upgrades), and usage records worked by hand, written as the sink writes them."""

from __future__ import annotations

import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from clickhouse_connect import get_client

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import UsageBatch, UsageRecord
from gpuledger.sink.loop import run_sink
from gpuledger.sink.rows import Source, usage_rows
from gpuledger.warehouse import migrations


@contextmanager
def migrated_warehouse(tmp_path: Path, database: str, **settings):
    """(client, Settings) of an embedded warehouse in tmp_path with every migration applied; `settings`:
    more Settings fields. Closed on exit."""
    config = Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", database=database, **settings)
    client = warehouse.connect(config)
    try:
        warehouse.migrate(client, database)
        yield client, config
    finally:
        client.close()


def warehouse_before(version: str, database: str, prefix: str = "old-warehouse-"):
    """A chDB client (database selected) on a new directory holding every migration before `version`,
    applied and recorded; the rest pending (`migrations.migrate` applies them)."""
    client = get_client(interface="chdb", path=tempfile.mkdtemp(prefix=prefix))
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    client.database = database
    client.command(f"CREATE TABLE {database}.{migrations.MIGRATIONS_TABLE} (version String, name String, "
                   "checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) ENGINE = MergeTree ORDER BY version")
    for mg in migrations.load_migrations():
        if mg.version < version:
            for statement in mg.statements():
                client.command(statement)
            client.insert(migrations.MIGRATIONS_TABLE, [[mg.version, mg.name, mg.checksum]],
                          column_names=["version", "name", "checksum"], database=database)
    return client


def usage_record(cluster: str, gpu: str, start: int, end: int, state: str, job: str = "", tenant: str = "",
                 energy: float = 0.0) -> UsageRecord:
    """A whole A100's record on node n1 (queue q for a job), 1 micro per GPU-second, definition d1."""
    ms = end - start
    return UsageRecord(record_id=f"{gpu}/{start}/0", cluster=cluster, node="n1", gpu_uuid=gpu, gpu_model="A100",
                       start_ms=start, end_ms=end, state=state, job_id=job, tenant=tenant, queue="q" if job else "",
                       share_milli=1000, gpu_ms=ms, util_pct=None, energy_j=energy, coefficient=1.0,
                       coefficient_version="v1", effective_gpu_ms=ms, cost_micros=ms // 1000, definition_version="d1")


def put_usage(client, database: str, records: list[UsageRecord], offset: int) -> None:
    """The records as the sink writes one usage message (at `offset` of t.usage[0])."""
    rows = usage_rows(UsageBatch(node="n1", records=records), Source("t.usage", 0, offset))
    warehouse.insert_rows(client, "usage_raw", rows, database=database)


def run_until_caught_up(settings, **kw) -> dict:
    """`run_sink` until it has read everything there is; a sink that hangs fails the test after 90 s."""
    stop = threading.Event()
    guard = threading.Timer(90, stop.set)
    guard.start()
    try:
        stats = run_sink(settings, until_caught_up=True, idle_s=1.0, stop=stop, **kw)
    finally:
        guard.cancel()
    assert not stop.is_set(), "the sink did not catch up within 90 s"
    return stats
