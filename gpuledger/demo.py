"""`gpuledger demo`: the whole pipeline on the embedded default, start to finish.

Tansu broker (child process) -> topics -> migrations (chDB) -> simulated cluster published
-> Faust worker (child process) -> sink (thread in this process, which holds the chDB
directory) -> reports read back from the ClickHouse tables. Leaves no process running;
the data directory stays for later `gpuledger report` calls."""

from __future__ import annotations

import shutil
import sys
import threading
import time

from gpuledger.broker import EmbeddedBroker
from gpuledger.config import Settings
from gpuledger.processes import ChildProcess, wait_until_caught_up

# (report, title, filters, columns shown in the terminal; `gpuledger report NAME` shows all)
DEMO_REPORTS = (
    ("bills", "Tenant bills (per day: compute / idle / failed-retry)", {},
     ("day", "tenant", "compute_gpu_hours", "compute_cost", "idle_gpu_hours", "idle_cost",
      "failed_retry_gpu_hours", "failed_retry_cost", "total_effective_gpu_hours", "total_cost")),
    ("queues", "Queue efficiency", {},
     ("day", "queue", "attempts", "requested_gpu_seconds", "allocated_gpu_seconds", "executed_gpu_seconds",
      "allocated_to_requested", "executed_to_allocated", "queue_wait_p50_s", "queue_wait_p90_s", "queue_wait_max_s")),
    ("utilization", "Three utilization layers (per cluster and day)", {},
     ("day", "cluster", "capacity_gpu_seconds", "down_gpu_seconds", "scheduling_utilization",
      "execution_utilization", "hardware_utilization", "hardware_share_of_capacity")),
)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_demo(settings: Settings, *, hours: float = 6.0, nodes: int = 8, seed: int = 7) -> int:
    from gpuledger.agents.publisher import KafkaPublisher
    from gpuledger.agents.simcluster import SimSpec, simulate
    from gpuledger.replay import publish
    from gpuledger.reports import fetch, render
    from gpuledger.sink import run_sink
    from gpuledger.topics import create_topics
    from gpuledger.warehouse import connect, migrate

    started = time.monotonic()
    warehouse_dir = settings.embedded_warehouse_dir
    if warehouse_dir is None:
        raise SystemExit("gpuledger demo runs on the embedded warehouse; unset GPULEDGER_WAREHOUSE (or set it to 'chdb')")
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if warehouse_dir.exists():  # the broker starts empty, so the warehouse must too
        shutil.rmtree(warehouse_dir)

    with EmbeddedBroker(log_path=logs / "tansu.log") as broker:
        s = settings.model_copy(update={"kafka_bootstrap": broker.bootstrap})
        say(f"[demo] broker (Tansu) on {broker.bootstrap}; data in {settings.data_dir.resolve()}")
        create_topics(s)
        client = connect(s)
        try:
            applied = migrate(client, s.database)
        finally:
            client.close()
        say(f"[demo] topics created; {len(applied)} migrations applied to chDB at {warehouse_dir}")

        spec = SimSpec(hours=hours, nodes=nodes, seed=seed)
        stop_sink = threading.Event()
        sink_result: dict = {}

        def sink_thread() -> None:
            try:
                sink_result.update(run_sink(s, stop=stop_sink))
            except BaseException as exc:  # surfaced after join
                sink_result["error"] = exc

        with ChildProcess(s, "worker", log_path=logs / "worker.log") as worker:
            sink = threading.Thread(target=sink_thread, name="sink", daemon=True)
            sink.start()
            say(f"[demo] simulating {spec.nodes} nodes x {spec.gpus_per_node} GPUs for {spec.hours} h of event time ...")
            with KafkaPublisher(s) as publisher:
                counts = publish(simulate(spec), publisher, s)
            say(f"[demo] published {counts}")
            t = s.topics
            say("[demo] waiting for the worker to consume everything ...")
            wait_until_caught_up(s, s.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                                 alive=worker, timeout_s=1800)
        say("[demo] worker done; waiting for the sink ...")
        wait_until_caught_up(s, f"{s.worker_app_id}-sink", [t.usage, t.job_events, t.scheduler_snapshots], timeout_s=900)
        stop_sink.set()
        sink.join(timeout=120)
        if "error" in sink_result:
            raise sink_result["error"]
        say(f"[demo] sink wrote {sink_result}")

    client = connect(settings)
    try:
        for name, title, filters, columns in DEMO_REPORTS:
            rows = [{c: row[c] for c in columns} for row in fetch(client, settings.database, name, **filters)]
            print(f"\n== {title} ==")
            print(render(rows, "table"), end="")
    finally:
        client.close()
    say(f"\n[demo] done in {time.monotonic() - started:.0f}s. More: gpuledger report "
        "{bills,jobs,queues,utilization,capacity} [--format json|csv]")
    return 0
