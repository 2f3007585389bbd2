"""Run the real pipeline on the embedded default over any source of messages.

`run_embedded(settings, emissions)`: Tansu broker (child process) -> topics -> migrations
(chDB) -> publish the emissions -> Faust worker (child process) -> sink (thread in this
process, which holds the chDB directory) -> wait until everything is consumed -> stop all.
Used by `gpuledger demo`, the trace replays, the golden scenarios and the benchmarks.
Afterwards the chDB directory is free for reports."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuledger.broker import EmbeddedBroker
from gpuledger.config import Settings
from gpuledger.processes import ChildProcess, wait_until_caught_up


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
    timeout_s: float = 3600,
) -> PipelineRun:
    """Push `emissions` (simulator Emissions or dump lines) through broker, worker and sink
    into the embedded warehouse. `fresh` empties the warehouse first: the broker always
    starts empty, so old rows would otherwise mix with a new run."""
    from gpuledger.agents.publisher import KafkaPublisher
    from gpuledger.coefficients import sync_library
    from gpuledger.streams.pricing import load_ledger_config
    from gpuledger.replay import publish
    from gpuledger.sink import run_sink, sink_topics
    from gpuledger.topics import create_topics
    from gpuledger.warehouse import connect, migrate

    started = time.monotonic()
    warehouse_dir = settings.embedded_warehouse_dir
    if warehouse_dir is None:
        raise SystemExit("this command runs on the embedded warehouse; unset GPULEDGER_WAREHOUSE (or set it to 'chdb')")
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
            applied = migrate(client, s.database)
            sync_library(client, s.database, load_ledger_config(s.ledger_config))
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
        with ChildProcess(s, "worker", log_path=logs / "worker.log") as worker:
            sink = threading.Thread(target=sink_thread, name="sink", daemon=True)
            sink.start()
            try:
                with KafkaPublisher(s) as publisher:
                    run.published = publish(emissions, publisher, s, progress=progress)
                log(f"[pipeline] published {run.published}; waiting for the worker ...")
                wait_until_caught_up(s, s.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                                     alive=worker, timeout_s=timeout_s)
            except BaseException:
                stop_sink.set()
                raise
        log("[pipeline] worker done; waiting for the sink ...")
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
    run.seconds = time.monotonic() - started
    return run
