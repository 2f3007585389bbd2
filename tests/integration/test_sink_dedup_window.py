"""Every block the sink writes carries an insert-deduplication token, which a MergeTree honours only
with `non_replicated_deduplication_window` set (docs/reliability.md, "Exactly-once into ClickHouse").
job_progress (sql/0021) and gpu_sightings (sql/0020, the target of node_inventory's view) had none
until sql/0045: a block written again after a crash was stored twice there. Here the list of tables
is read from the schema, so a future sink table or view target cannot miss the window either."""

from __future__ import annotations

import re
import time

import pytest

from gpuledger.schemas.models import GpuSample, JobProgress, NodeTick
from gpuledger.schemas.wire import encode
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import ClickHouseProgress
from gpuledger.sink.rows import PROGRESS, SAMPLES, Source, process_message
from gpuledger.sink.writer import ClickHouseWriter, StoredHealth
from warehouse_helpers import migrated_warehouse

pytestmark = pytest.mark.integration

DB = "dedup_window"
S = 5000
#: the columns every row the sink writes carries (`Source.columns()`): what marks a sink table
SOURCE_COLUMNS = ("kafka_topic", "kafka_partition", "kafka_offset")
_WINDOW = re.compile(r"\bnon_replicated_deduplication_window\s*=\s*(\d+)")
_TO = re.compile(r"^CREATE MATERIALIZED VIEW \S+ TO (?:`?\w+`?\.)?`?(\w+)`?")


def token_tables(client) -> dict[str, int]:
    """{table: its deduplication window (0: none)} of every table a sink block reaches: the tables the
    sink writes (those with its source columns) and, transitively, the targets of the materialized
    views over them."""
    tables = {name: (engine, query, deps) for name, engine, query, deps in client.query(
        "SELECT name, engine, create_table_query, dependencies_table FROM system.tables "
        "WHERE database = {db:String}", parameters={"db": DB}).result_rows}
    sink = {table for table, n in client.query(
        "SELECT table, countIf(name IN {names:Array(String)}) FROM system.columns WHERE database = {db:String} "
        "GROUP BY table", parameters={"db": DB, "names": list(SOURCE_COLUMNS)}).result_rows
        if n == len(SOURCE_COLUMNS) and tables[table][0].endswith("MergeTree")}
    reached, todo = set(), list(sink)
    while todo:
        table = todo.pop()
        if table in reached:
            continue
        reached.add(table)
        for view in tables[table][2]:  # the materialized views that fire on inserts into it
            target = _TO.match(tables[view][1])
            assert target, f"materialized view {view} without a TO table: {tables[view][1][:200]}"
            todo.append(target.group(1))
    return {t: int(m.group(1)) if (m := _WINDOW.search(tables[t][1])) else 0 for t in sorted(reached)}


def test_every_table_a_sink_block_reaches_keeps_its_tokens(tmp_path) -> None:
    with migrated_warehouse(tmp_path, DB) as (client, _):
        windows = token_tables(client)
    # the derivation finds the tables it must (the sink's raw tables and view targets of each kind)
    assert {"usage_raw", "job_events", "gpu_health", "node_inventory", "job_progress", "scheduler_snapshots",
            "usage_by_job_daily", "job_attempts_state", "gpu_health_hourly", "gpu_sightings"} <= set(windows)
    missing = sorted(t for t, n in windows.items() if n < 1000)
    assert not missing, f"tables a sink block reaches without non_replicated_deduplication_window: {missing}"


def test_a_block_written_again_after_a_crash_is_stored_once(tmp_path) -> None:
    """The sink dies right after inserting a block (before its `done` row) and writes it again on
    restart, under the same token: job_progress and gpu_sightings hold it once."""
    t0 = int(time.time()) // 3600 * 3600 * 1000 - 3_600_000

    class Crash(BaseException):
        pass

    class CrashAfter:
        def __init__(self, inner, crash: bool):
            self.inner, self.crash = inner, crash

        def write(self, table, rows, token=None):
            self.inner.write(table, rows, token=token)
            if self.crash and table in ("job_progress", "node_inventory"):
                raise Crash()

    with migrated_warehouse(tmp_path, DB) as (client, _):
        def run(topic: str, kind: str, messages: list[bytes]) -> None:
            for crash in (True, False):
                sink = BatchingSink(CrashAfter(ClickHouseWriter(client, DB), crash),
                                    ClickHouseProgress(client, DB, "g-sink"), stored_health=StoredHealth(client, DB),
                                    sleep=lambda s: None)
                sink.assign([(topic, 0)])
                try:
                    for i, raw in enumerate(messages):
                        source = Source(topic, 0, i)
                        sink.add(process_message(kind, raw, source, now_ms=t0 + 10**7), source)
                    sink.flush()
                except Crash:
                    assert crash

        run("p.job-progress", PROGRESS,
            [encode(JobProgress(ts_ms=t0 + i * 60_000, cluster="c1", job_id="job-1", step=100 * i)) for i in range(5)])
        run("p.gpu-samples", SAMPLES,
            [encode(NodeTick(cluster="c1", node="n1", ts_ms=t0 + i * S, interval_ms=S,
                             gpus=[GpuSample(gpu_uuid="GPU-1", index=0, model="A100-80GB")])) for i in range(4)])

        def one(sql: str):
            return client.query(sql).result_rows[0][0]

        assert one(f"SELECT count() FROM {DB}.job_progress") == 5, "job_progress stored the block twice"
        assert one(f"SELECT reports FROM {DB}.job_training_signals") == 5
        assert one(f"SELECT count() FROM {DB}.gpu_health") == 4
        assert one(f"SELECT sum(reports) FROM {DB}.gpu_sightings") == 4, "gpu_sightings stored the block twice"

