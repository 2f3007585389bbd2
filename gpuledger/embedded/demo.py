"""`gpuledger demo`: the simulated cluster, or your own JSON Lines topic dump (`--input`), through
the whole pipeline on the embedded default (gpuledger.pipeline.run_embedded), then the reports
read back from the ClickHouse tables, with the watcher's alerts and reclaim suggestions. Leaves no process running; the data directory stays for
later `gpuledger report`."""

from __future__ import annotations

from pathlib import Path

from gpuledger.config import Settings
from gpuledger.embedded.pipeline import run_embedded, say

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
    ("alerts", "Behaviour alerts (gpuledger watch, docs/alerts.md)", {},
     ("opened_at", "closed_at", "rule", "job_id", "tenant", "queue", "gpus")),
    ("suggestions", "Reclaim suggestions", {},
     ("opened_at", "withdrawn_at", "status", "queue", "execution_rate", "jobs", "gpus_freed", "waiting_gpus", "followed")),
)


def run_demo(settings: Settings, *, hours: float = 6.0, nodes: int = 8, seed: int = 7,
             dump: str | Path | None = None) -> int:
    """The pipeline over the simulated cluster (hours, nodes, seed), or over `dump`, then the reports."""
    if dump is None:
        from gpuledger.agents.simcluster import SimSpec, simulate

        spec = SimSpec(hours=hours, nodes=nodes, seed=seed)
        say(f"[demo] simulating {spec.nodes} nodes x {spec.gpus_per_node} GPUs for {spec.hours} h of event time")
        messages = simulate(spec)
    else:
        messages = load_dump(Path(dump), settings.topic_prefix)
    run = run_embedded(settings, messages)
    print_reports(settings)
    say(f"\n[demo] done in {run.seconds:.0f}s. More: gpuledger report "
        "{bills,jobs,queues,utilization,capacity,alerts,suggestions} [--format json|csv]")
    return 0


def load_dump(path: Path, prefix: str) -> list:
    """The dump's lines for run_embedded; warns when no tick can be billed (no lifecycle watermark)."""
    from gpuledger.schemas.lines import LINE_JOB_EVENTS
    from gpuledger.embedded.replay import logical_line, read_dump

    lines = read_dump(path, prefix)
    if not lines:
        raise ValueError(f"{path}: the dump holds no message")
    say(f"[demo] replaying {len(lines)} messages from {path}")
    # A tick is closed only once the lifecycle watermark passes it: without one nothing is billed.
    if not any(line.key is None and logical_line(line.topic, prefix) == LINE_JOB_EVENTS for line in lines):
        say(f"[demo] warning: {path} has no lifecycle watermark (a job-events line with key null): "
            "the worker will hold every tick back and the reports will be empty")
    return lines


def print_reports(settings: Settings) -> None:
    """The demo's reports, as terminal tables, from the warehouse the run left."""
    from gpuledger.warehouse.reports import fetch
    from gpuledger.warehouse.report_text import render
    from gpuledger.warehouse import connect

    client = connect(settings)
    try:
        for name, title, filters, columns in DEMO_REPORTS:
            rows = [{c: row[c] for c in columns} for row in fetch(client, settings.database, name, **filters)]
            print(f"\n== {title} ==")
            print(render(rows, "table"), end="")
    finally:
        client.close()
