"""Sizing: the whole warehouse per GPU, one simulated day at 5 s sampling, projected to each table's
retention (docs/retention.md "How much disk").

A simulated cluster (the demo's simulator: 8-GPU nodes, training jobs of 45 minutes at the median,
shared GPUs, queue snapshots every minute) sampled every 5 s for one UTC day, ten ticks to a message, goes
through the worker's own core (no Kafka) and the sink's own row builders (`process_message`, as the
sink writes every line: usage, accepted job events, snapshots, samples) into a fresh chDB with the
real migrations and materialized views. After OPTIMIZE FINAL on every table, `gpuledger report
storage`'s own figures (`storage_rows`) give each table's compressed bytes; per GPU-day, and times the
most days the table holds under the default retention (`retention.days_held`): what a GPU costs the
warehouse once every table is full. Tables kept for ever are shown per GPU-day: those that grow
with jobs grow by that much a day.

    .venv/bin/python -m bench.sizing
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

from gpuledger.agents.simcluster import SimSpec, batch_ticks, simulate
from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.lines import LINE_SAMPLES, LINE_SNAPSHOTS
from gpuledger.schemas.wire import encode
from gpuledger.sink.rows import JOB_EVENTS, SAMPLES, SNAPSHOTS, USAGE, Source, process_message
from gpuledger.streams.checks import DAY_MS
from gpuledger.warehouse import connect, insert_rows, migrate
from gpuledger.warehouse.retention import KEPT, RETENTION, days_held
from gpuledger.warehouse.storage import TOTAL, storage_rows

from bench.common import knob, say, workdir
from bench.footprint import INTERVAL_MS, TICKS_PER_MESSAGE, core_pass

BLOCK_ROWS = 50_000
#: tables kept for ever whose size does not grow with time (a row per GPU, or fixed): the others kept
#: for ever grow by their bytes per GPU-day every day
NOT_GROWING = {"gpu_latest", "gpu_sightings", "schema_migrations", "sink_progress"}


class _Rows:
    """The sink's rows, inserted a block at a time per table."""

    def __init__(self, client, database: str):
        self.client, self.database = client, database
        self.held: dict[str, list[dict]] = {}
        self.offsets: dict[str, int] = {}

    def add(self, kind: str, raw: bytes) -> None:
        offset = self.offsets.get(kind, 0)
        self.offsets[kind] = offset + 1
        for table, rows in process_message(kind, raw, Source(kind, 0, offset)).items():
            held = self.held.setdefault(table, [])
            held.extend(rows)
            if len(held) >= BLOCK_ROWS:
                self._insert(table)

    def _insert(self, table: str) -> None:
        rows = self.held.pop(table, [])
        if rows:
            insert_rows(self.client, table, rows, database=self.database)

    def flush(self) -> None:
        for table in list(self.held):
            self._insert(table)


def _lines(spec: SimSpec, sink: _Rows) -> Iterator[tuple[str, bytes]]:
    """The simulated cluster's messages in event-time order for the worker core; the samples and the
    snapshots (which the worker does not read) also go to the sink's rows on the way."""
    for emission in batch_ticks(simulate(spec), TICKS_PER_MESSAGE):
        raw = encode(emission.message)
        if emission.line == LINE_SNAPSHOTS:
            sink.add(SNAPSHOTS, raw)
            continue
        if emission.line == LINE_SAMPLES:
            sink.add(SAMPLES, raw)
        yield emission.line, raw


def measure(gpus: int, days: int) -> dict:
    settings = Settings()  # the default retentions
    spec = SimSpec(nodes=max(1, gpus // 8), gpus_per_node=8, hours=24.0 * days, sample_interval_ms=INTERVAL_MS,
                   start_ms=(SimSpec().start_ms // DAY_MS) * DAY_MS)  # whole UTC days
    gpus = 8 * spec.nodes
    say(f"sizing: {gpus} GPUs x {days} day(s) at {INTERVAL_MS // 1000} s sampling through the core and the sink's rows ...")
    path = workdir() / "sizing"
    shutil.rmtree(path, ignore_errors=True)
    db = "bench_sizing"
    client = connect(Settings(warehouse=f"chdb:{path}", database=db))
    try:
        migrate(client, db)
        sink = _Rows(client, db)
        _, samples, usage, accepted = core_pass(_lines(spec, sink), load_ledger_config(None))
        for raw in usage:
            sink.add(USAGE, raw)
        for raw in accepted:
            sink.add(JOB_EVENTS, raw)
        sink.flush()
        tables = [r[0] for r in client.query("SELECT name FROM system.tables WHERE database = {d:String} AND engine "
                                             "LIKE '%MergeTree'", parameters={"d": db}).result_rows]
        for table in tables:  # as merged as the background merger leaves a table in time
            client.command(f"OPTIMIZE TABLE `{db}`.`{table}` FINAL")
        stored = storage_rows(client, db, settings)
    finally:
        client.close()
        shutil.rmtree(path, ignore_errors=True)
    detail = project(stored, gpus, days, settings)
    say(f"sizing: {detail['bytes_per_gpu_at_retention'] / 1e6:,.1f} MB per GPU in the tables with a retention once "
        f"full; the tables kept for ever grow by {detail['kept_growth_bytes_per_gpu_day'] / 1e3:,.1f} KB per GPU-day")
    return {"gpus": gpus, "days": days, "samples": samples, **detail}


def project(stored: list[dict], gpus: int, days: int, settings) -> dict:
    """Per table (`storage_rows` of a warehouse holding `days` whole days of `gpus` GPUs): rows and bytes
    per GPU-day, and for a table with a retention the bytes per GPU once it holds all its days; the sum
    of those, and how much the tables kept for ever grow per GPU-day."""
    gpu_days = gpus * days
    out = []
    for r in stored:
        if r["table"] == TOTAL or not r["bytes_on_disk"]:
            continue
        per_gpu_day = r["bytes_on_disk"] / gpu_days
        row = {"table": r["table"], "rows_per_gpu_day": r["rows"] / gpu_days, "bytes_per_gpu_day": round(per_gpu_day)}
        kept = getattr(settings, RETENTION[r["table"]].setting) if r["table"] in RETENTION else 0
        if kept:
            row["days_held"] = days_held(r["table"], kept)
            row["bytes_per_gpu_held"] = round(per_gpu_day * row["days_held"])
        elif r["table"] in RETENTION:
            row["kept"] = f"GPULEDGER_{RETENTION[r['table']].setting.upper()}=0"
        else:
            row["kept"] = KEPT.get(r["table"], "")
        row["grows"] = not kept and r["table"] not in NOT_GROWING
        out.append(row)
    out.sort(key=lambda row: (-row.get("bytes_per_gpu_held", row["bytes_per_gpu_day"]), row["table"]))
    return {"tables": out, "bytes_per_gpu_at_retention": sum(row.get("bytes_per_gpu_held", 0) for row in out),
            "kept_growth_bytes_per_gpu_day": sum(row["bytes_per_gpu_day"] for row in out if row["grows"])}


def run() -> dict:
    detail = measure(knob("sizing_gpus", 96, 32), knob("sizing_days", 1, 1))
    return {"warehouse_bytes_per_gpu_at_retention": detail["bytes_per_gpu_at_retention"],
            "warehouse_kept_growth_bytes_per_gpu_day": detail["kept_growth_bytes_per_gpu_day"], "sizing_detail": detail}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
