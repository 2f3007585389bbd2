"""Shared pieces of the benchmarks: sizes (full / quick), settings, the broker, workloads, output.

Every benchmark runs against the real parts (Tansu broker, `gpuledger worker` child processes,
chDB) or the pure core, and reports either a ratio against a baseline measured in the same run
or a clearly labelled absolute figure (this is a shared, noisy machine)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpuledger.config import Settings

QUICK = os.environ.get("GPULEDGER_BENCH_QUICK", "") not in ("", "0", "false", "no")


def knob(name: str, full, quick):
    """A size: GPULEDGER_BENCH_<NAME> wins, else the quick or the full default."""
    raw = os.environ.get(f"GPULEDGER_BENCH_{name.upper()}")
    default = quick if QUICK else full
    if raw is None:
        return default
    return type(default)(float(raw)) if isinstance(default, int) else type(default)(raw)


@dataclass(frozen=True)
class Sizes:
    # join throughput / scale-out: simulated 8-GPU nodes x hours of event time, sampled every
    # join_interval_ms, each node's ticks sent join_ticks_per_message at a time (NodeTickBatch)
    join_nodes: int = knob("join_nodes", 48, 32)
    # 45 minutes of event time: two workers need ~15 s for it; with 15 minutes (before 2026-12-02)
    # their pass lasted ~5 s, of which the first watermark's and the last flush's hops were a tenth
    join_hours: float = knob("join_hours", 0.75, 0.1)
    join_interval_ms: int = knob("join_interval_ms", 1000, 1000)
    join_ticks_per_message: int = knob("join_ticks_per_message", 10, 10)
    join_repeats: int = knob("join_repeats", 3, 1)             # interleaved 1-worker / 2-worker passes
    profile_nodes: int = knob("profile_nodes", 32, 16)          # worker pass under cProfile
    profile_hours: float = knob("profile_hours", 0.35, 0.25)
    core_ticks_hours: float = knob("core_hours", 0.1, 0.05)     # pure-core profile (16 nodes, join interval)
    agent_ticks: int = knob("agent_ticks", 2000, 300)            # in-process agent ticks
    agent_live_s: float = knob("agent_live_s", 20.0, 6.0)        # live agent process, 1 s interval
    writer_rows: int = knob("writer_rows", 400_000, 100_000)
    bill_small_rows: int = knob("bill_small_rows", 10_000_000, 1_000_000)
    bill_large_rows: int = knob("bill_large_rows", 100_000_000, 5_000_000)
    query_repeats: int = knob("query_repeats", 5, 3)
    e2e_nodes: int = knob("e2e_nodes", 32, 16)
    e2e_seconds: float = knob("e2e_seconds", 45.0, 15.0)
    e2e_interval_s: float = knob("e2e_interval_s", 1.0, 1.0)


SIZES = Sizes()
#: gpu-samples partitions of every benchmark topic set (two workers get four each)
SAMPLE_PARTITIONS = 8
REBALANCE_TIMEOUT_S = 4.0   # Tansu holds a group join for about half of it


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def workdir() -> Path:
    """Scratch space for logs and chDB directories (GPULEDGER_BENCH_DIR, else a temp dir)."""
    base = os.environ.get("GPULEDGER_BENCH_DIR")
    path = Path(base) if base else Path(tempfile.gettempdir()) / "gpuledger-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bench_settings(bootstrap: str, name: str, **overrides) -> Settings:
    """Fresh topic names and consumer groups for one measurement on a shared broker."""
    tag = f"{name}{uuid.uuid4().hex[:6]}"
    values = dict(
        kafka_bootstrap=bootstrap,
        topic_prefix=f"b{tag}.",
        worker_app_id=f"bench-{tag}",
        data_dir=workdir() / tag,
        worker_rebalance_timeout_s=REBALANCE_TIMEOUT_S,
        partitions_gpu_samples=SAMPLE_PARTITIONS,
        partitions_job_events=4,
        partitions_usage=8,
    )
    values.update(overrides)
    return Settings(**values)


def median(xs) -> float:
    return statistics.median(xs)


def percentile(xs, q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(xs)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"
