"""The warehouse sink: Kafka (usage, lifecycle-accepted, scheduler-snapshots, gpu-samples) -> ClickHouse tables.

Modules: rows.py (pure conversion), batching.py (BatchingSink), writer.py (ClickHouseWriter, error
classes, StoredHealth), progress.py (the progress table), letters.py (DeadLetterOutbox), loop.py
(`run_sink`, the Kafka loop).

Three layers, each replaceable:
- pure conversion (rows.py): `process_message(kind, raw, source)` turns one message into rows per table
  (or raises DecodeError) — no Kafka, no ClickHouse;
- `BatchingSink` (batching.py): buffers rows per (topic, partition) and table, cuts each partition's rows into
  blocks at recorded Kafka offset ranges, and writes them through a `Writer` backend with an
  insert-deduplication token per block, retrying with backoff until the backend takes them;
  a `ProgressStore` records each block's range before ("pending") and after ("done") the insert;
- `ClickHouseWriter` / `ClickHouseProgress` (writer.py, progress.py): the backend (one insert per table and block) and the
  progress table (`sink_progress`, sql/0009).

Exactly-once effect (docs/reliability.md, "Exactly-once into ClickHouse"):
- a block is the rows of messages [from, to) of one partition; its token names that range, so a
  block written again after a crash is dropped by ClickHouse (usage_raw and, with
  `deduplicate_blocks_in_dependent_materialized_views`, each materialized view's target on its own);
- after a restart the sink resumes from the progress table: messages below a done range are
  skipped; a pending range is rebuilt exactly (same messages, same horizons, same token, from its
  recorded start even when its first messages are gone) and written again, so whatever part of it
  reached ClickHouse is not counted twice; a continuous sink, like a caught-up run, writes one whose
  rest is past its partition's end (its consumer had every message) rather than hold it;
- usage records the worker emitted twice (after a worker crash, at new offsets) are dropped before
  the insert by a per-GPU horizon: the worker emits each GPU's records in time order, so a record
  starting before the end of the latest record already taken for its GPU is a re-emission (counted
  in gpuledger_duplicates_total{component="sink",kind="row"}, as resent health rows are).
- gpu_health rows of a tick an agent sent again (its spool delivers at least once, at new offsets)
  are dropped before the insert when gpu_health already holds the same (cluster, node, GPU, ts_ms)
  from a message outside the block's own range (so a rebuilt pending block keeps its rows).
Undecodable messages go to the dead-letter topic with the reason and the original bytes; they
never stop the good data behind them. Dead letters are confirmed delivered before the block holding
their message is recorded done.
"""
