"""Run the real pipeline on the embedded default over any source of messages.

`run_embedded(settings, emissions)`: Tansu broker (child process) -> topics -> migrations
(chDB) -> publish the emissions -> Faust worker (child process) -> watcher (alerts and reclaim
suggestions, thread) -> sink (thread in this process, which holds the chDB directory) -> wait until
everything is consumed -> stop all.
Used by `gpuledger demo`, the trace replays, the golden scenarios and the benchmarks.
Afterwards the chDB directory is free for reports."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuledger.embedded.broker import EmbeddedBroker
from gpuledger.config import Settings
from gpuledger.embedded.processes import ChildProcess, wait_until_caught_up


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class PipelineError(RuntimeError):
    """The embedded pipeline cannot run with these settings (the message says why)."""


class Stage(NamedTuple):
    """A step of `run_embedded`, reported to its `on_stage` callback as it begins.

    `name`: "publishing", "worker" (waiting for the worker to consume everything), "watch"
    (waiting for the watcher), "sink" (waiting for the sink), "done". `settings` point at the embedded broker; `group` and
    `topics` name what is being waited on (None / empty for publishing and done)."""

    name: str
    settings: Settings
    group: str | None = None
    topics: tuple[str, ...] = ()


@dataclass
class PipelineRun:
    published: dict = field(default_factory=dict)
    sink: dict = field(default_factory=dict)
    seconds: float = 0.0


def run_embedded(
    settings: Settings,
    emissions: Iterable,
    *,
    fresh: bool = True,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] = say,
    on_stage: Callable[[Stage], None] | None = None,
    timeout_s: float = 3600,
) -> PipelineRun:
    """Push `emissions` (simulator Emissions or dump lines) through broker, worker and sink
    into the embedded warehouse. `fresh` empties the warehouse first: the broker always
    starts empty, so old rows would otherwise mix with a new run. `log` gets one line per
    step for people; `on_stage` gets each `Stage` for programs (e.g. a progress reporter)."""
    stage = on_stage or (lambda _stage: None)
    from gpuledger.agents.publisher import KafkaPublisher
    from gpuledger.warehouse.library import sync_library
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.embedded.replay import publish
    from gpuledger.sink.loop import run_sink, sink_topics
    from gpuledger.topics import create_topics
    from gpuledger.warehouse import connect, migrate
    from gpuledger.watch import watch_group, watch_inputs

    started = time.monotonic()
    warehouse_dir = settings.embedded_warehouse_dir
    if warehouse_dir is None:
        raise PipelineError("this command runs on the embedded warehouse; unset GPULEDGER_WAREHOUSE (or set it to 'chdb')")
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if fresh and warehouse_dir.exists():
        shutil.rmtree(warehouse_dir)
    run = PipelineRun()

    with EmbeddedBroker(log_path=logs / "tansu.log") as broker:
        s = settings.model_copy(update={"kafka_bootstrap": broker.bootstrap})
        log(f"[pipeline] broker (Tansu) on {broker.bootstrap}; data in {settings.data_dir.resolve()}")
        create_topics(s)
        client = connect(s)
        try:
            applied = migrate(client, s.database)  # no TTLs: a replayed old trace keeps its aggregates (docs/retention.md)
            ledger = load_ledger_config(s.ledger_config)
            sync_library(client, s.database, ledger)
            from gpuledger.warehouse.carbon import record_definition
            record_definition(client, s.database, ledger.carbon)  # carbon figures in the reports (docs/carbon.md)
        finally:
            client.close()
        log(f"[pipeline] topics created; {len(applied)} migrations applied to chDB at {warehouse_dir}")

        stop_sink = threading.Event()
        sink_result: dict = {}

        def sink_thread() -> None:
            try:
                sink_result.update(run_sink(s, stop=stop_sink))
            except BaseException as exc:  # surfaced after join
                sink_result["error"] = exc

        t = s.topics
        with ChildProcess(s, "worker", log_path=logs / "worker.log") as worker, \
                ChildProcess(s, "watch", log_path=logs / "watch.log") as watcher:
            sink = threading.Thread(target=sink_thread, name="sink", daemon=True)
            sink.start()
            try:
                stage(Stage("publishing", s))
                with KafkaPublisher(s) as publisher:
                    run.published = publish(emissions, publisher, s, progress=progress)
                log(f"[pipeline] published {run.published}; waiting for the worker ...")
                worker_inputs = [t.gpu_samples, t.job_events, t.node_allocations]
                stage(Stage("worker", s, s.worker_app_id, tuple(worker_inputs)))
                wait_until_caught_up(s, s.worker_app_id, worker_inputs, alive=worker, timeout_s=timeout_s)
                log("[pipeline] worker done; waiting for the watcher ...")
                stage(Stage("watch", s, watch_group(s), tuple(watch_inputs(s))))
                # caught up = every input acknowledged = covered by a durable snapshot, alerts included
                wait_until_caught_up(s, watch_group(s), watch_inputs(s), alive=watcher, timeout_s=timeout_s)
            except BaseException:
                stop_sink.set()
                raise
        log("[pipeline] watcher done; waiting for the sink ...")
        stage(Stage("sink", s, f"{s.worker_app_id}-sink", tuple(sink_topics(s))))
        try:
            wait_until_caught_up(s, f"{s.worker_app_id}-sink", sink_topics(s),
                                 timeout_s=timeout_s)
        finally:
            stop_sink.set()
            sink.join(timeout=120)
        if "error" in sink_result:
            raise sink_result["error"]
        run.sink = sink_result
        log(f"[pipeline] sink wrote {sink_result}")
        stage(Stage("done", s))
    run.seconds = time.monotonic() - started
    return run
