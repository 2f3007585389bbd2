"""Run the real pipeline on the embedded default over any source of messages.

`run_embedded(settings, emissions)`: Tansu broker (child process) -> topics -> migrations
(chDB) -> publish the emissions -> Faust worker (child process) -> watcher (alerts and reclaim
suggestions, thread) -> sink (thread in this process, which holds the chDB directory) -> wait until
everything is consumed -> stop all.
Used by `gpuledger demo`, the trace replays, the golden scenarios and the benchmarks.
Afterwards the chDB directory is free for reports."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
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


#: data directories this process holds (`hold_data_dir`), with how many holds each
_HELD: dict[Path, int] = {}
LOCK_FILE = ".pipeline.lock"


@contextmanager
def hold_data_dir(data_dir: Path) -> Iterator[None]:
    """Hold DATA_DIR/.pipeline.lock (flock) for the block: a second demo or replay on the same data
    directory is refused instead of emptying the warehouse under the first. Re-entrant within a
    process (a GenAI replay holds its directory around its two runs); the kernel releases the lock
    when the process dies."""
    import fcntl

    key = Path(data_dir).resolve()
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    key.mkdir(parents=True, exist_ok=True)
    with open(key / LOCK_FILE, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise PipelineError(f"the data directory {key} is in use by {holder} (another demo or replay); "
                                "wait for it to finish, or use another --data-dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"process {os.getpid()}")
        fh.flush()
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]


class _SinkAlive:
    """`alive` for wait_until_caught_up: a sink thread that failed or stopped ends the wait at once
    (instead of after timeout_s)."""

    def __init__(self, thread: threading.Thread, result: dict):
        self.thread = thread
        self.result = result

    def check_alive(self) -> None:
        if "error" in self.result:
            raise self.result["error"]
        if not self.thread.is_alive():
            raise RuntimeError("the sink stopped before it caught up")


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
    step for people; `on_stage` gets each `Stage` for programs (e.g. a progress reporter).
    Refuses (PipelineError) a data directory another run holds, or a warehouse another process has open."""
    if settings.embedded_warehouse_dir is None:
        raise PipelineError("this command runs on the embedded warehouse; unset GPULEDGER_WAREHOUSE (or set it to 'chdb')")
    with hold_data_dir(settings.data_dir):
        return _run_embedded(settings, emissions, fresh=fresh, progress=progress, log=log, on_stage=on_stage,
                             timeout_s=timeout_s)


def _run_embedded(settings: Settings, emissions: Iterable, *, fresh: bool, progress, log, on_stage,
                  timeout_s: float) -> PipelineRun:
    stage = on_stage or (lambda _stage: None)
    from gpuledger.agents.publisher import KafkaPublisher
    from gpuledger.warehouse.library import sync_library
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.embedded.replay import publish
    from gpuledger.sink.loop import run_sink, sink_topics
    from gpuledger.topics import create_topics
    from gpuledger.warehouse import connect, migrate
    from gpuledger.warehouse.client import _chdb_holder
    from gpuledger.watch import watch_group, watch_inputs

    started = time.monotonic()
    warehouse_dir = settings.embedded_warehouse_dir
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if fresh and warehouse_dir.exists():
        holder = _chdb_holder(warehouse_dir)  # chDB would not notice once its flocked files are gone
        if holder:
            raise PipelineError(f"the embedded warehouse {warehouse_dir} is held by {holder}; stop it (a sink, a report, "
                                "another demo) or use another --data-dir")
        shutil.rmtree(warehouse_dir)
    run = PipelineRun()

    with EmbeddedBroker(log_path=logs / "tansu.log") as broker:
        # metrics off: a production GPULEDGER_*_METRICS_PORT in the environment would clash; plaintext
        # without credentials, all Tansu speaks: a production SASL/SSL setting would reach nothing
        s = settings.model_copy(update={"kafka_bootstrap": broker.bootstrap, "worker_metrics_port": 0,
                                        "sink_metrics_port": 0, "agent_metrics_port": 0,
                                        "kafka_security_protocol": "PLAINTEXT", "kafka_sasl_username": None,
                                        "kafka_sasl_password": None, "kafka_sasl_password_file": None,
                                        "kafka_ssl_cafile": None})
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
        sink = threading.Thread(target=sink_thread, name="sink", daemon=True)
        try:
            with ChildProcess(s, "worker", log_path=logs / "worker.log") as worker, \
                    ChildProcess(s, "watch", log_path=logs / "watch.log") as watcher:
                sink.start()
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
            log("[pipeline] watcher done; waiting for the sink ...")
            stage(Stage("sink", s, f"{s.worker_app_id}-sink", tuple(sink_topics(s))))
            wait_until_caught_up(s, f"{s.worker_app_id}-sink", sink_topics(s), alive=_SinkAlive(sink, sink_result),
                                 timeout_s=timeout_s)
        finally:
            stop_sink.set()
            if sink.is_alive():  # before the broker goes: the sink closes its chDB client cleanly
                sink.join(timeout=120)
        if "error" in sink_result:
            raise sink_result["error"]
        run.sink = sink_result
        log(f"[pipeline] sink wrote {sink_result}")
        stage(Stage("done", s))
    run.seconds = time.monotonic() - started
    return run
