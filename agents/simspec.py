"""What the simulated cluster (agents/simcluster.py) is made of: GPU models with their physical
traits, queues, event rates, and the `SimSpec` that names a whole run (seed included).
"""

from __future__ import annotations

import calendar
import hashlib
from dataclasses import dataclass

_MIB = 1024 * 1024
_MINUTE = 60_000
_HOUR = 3_600_000

#: 2026-11-02T00:00:00Z — a fixed UTC midnight, so default runs are reproducible.
DEFAULT_START_MS = calendar.timegm((2026, 11, 2, 0, 0, 0)) * 1000


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class GpuModelSpec:
    """Physical traits of a GPU model, enough to make plausible telemetry."""

    name: str
    mem_bytes: int
    tdp_w: float
    idle_w: float
    sm_clock_max_mhz: float
    sm_clock_idle_mhz: float
    mem_clock_mhz: float
    nvlink: bool
    temp_idle_c: float
    temp_busy_c: float


#: Models the simulator knows; the names match gpuledger/ledger_defaults.toml.
GPU_MODELS: dict[str, GpuModelSpec] = {
    m.name: m
    for m in (
        GpuModelSpec("A100-80GB", 81920 * _MIB, 400.0, 60.0, 1410.0, 210.0, 1593.0, True, 32.0, 72.0),
        GpuModelSpec("H100-80GB", 81559 * _MIB, 700.0, 70.0, 1980.0, 345.0, 2619.0, True, 30.0, 75.0),
        GpuModelSpec("V100-32GB", 32768 * _MIB, 300.0, 45.0, 1530.0, 135.0, 877.0, True, 33.0, 74.0),
        GpuModelSpec("T4", 15360 * _MIB, 70.0, 12.0, 1590.0, 300.0, 5001.0, False, 35.0, 70.0),
        GpuModelSpec("L40S", 46068 * _MIB, 350.0, 35.0, 2520.0, 210.0, 9001.0, False, 32.0, 76.0),
    )
}

# Fractional (serving) jobs go to cheap cards first, so big cards stay free for training.


@dataclass(frozen=True)
class QueueSpec:
    name: str
    priority: int
    quota_gpus: float
    weight: float = 1.0  # relative share of submissions that go to this queue
    #: share of its jobs that hold their GPUs and run nothing on them (reserved notebooks)
    idle_share: float = 0.0


@dataclass(frozen=True)
class SimRates:
    """Workload and fault knobs. Ranges are (low, high) in milliseconds, drawn uniformly."""

    arrivals_per_gpu_hour: float = 0.25       # mean submissions per hour, per GPU of capacity
    burst_amplitude: float = 0.6              # arrival rate swings ±60 % over burst_period_ms
    burst_period_ms: int = 3 * _HOUR
    initial_load: float = 1.0                 # backlog at start, in requested GPUs / capacity
    fractional_share: float = 0.25            # fraction of jobs asking for part of one GPU
    whole_sizes: tuple[tuple[int, int], ...] = ((1, 30), (2, 20), (4, 18), (8, 12), (16, 4))  # (gpus, weight)
    urgent_share: float = 0.15                # jobs submitted with priority +10 within their queue
    train_median_ms: int = 45 * _MINUTE
    serve_ms: tuple[int, int] = (60 * _MINUTE, 5 * _HOUR)
    fail_prob: float = 0.12                   # per attempt
    hang_prob: float = 0.08                   # per attempt: interrupted (hung) for a while
    hang_recover_prob: float = 0.6            # a hung attempt resumes; otherwise the watchdog fails it
    cancel_prob: float = 0.03                 # per job: the user cancels it at some point
    max_failures: int = 3                     # failed attempts before the job is given up
    preemption: bool = True
    preempt_after_ms: int = 2 * _MINUTE       # a job waits this long before it may preempt
    gpu_faults_per_gpu_hour: float = 0.012
    down_ms: tuple[int, int] = (15 * _MINUTE, 45 * _MINUTE)
    energy_reset_on_repair: bool = True       # the repair reloads the driver: NVML energy counter restarts at 0
    image_pull_ms: tuple[int, int] = (20_000, 300_000)
    loading_ms: tuple[int, int] = (60_000, 300_000)
    hang_ms: tuple[int, int] = (3 * _MINUTE, 15 * _MINUTE)
    checkpoint_every_ms: tuple[int, int] = (15 * _MINUTE, 40 * _MINUTE)
    checkpoint_ms: tuple[int, int] = (60_000, 180_000)
    retry_backoff_ms: tuple[int, int] = (15_000, 90_000)
    straggler_prob: float = 0.12              # multi-GPU jobs with one rank that falls behind mid-run
    underfed_share: float = 0.04              # training jobs starved by their input pipeline (2-8 % busy)


@dataclass(frozen=True)
class SimSpec:
    cluster: str = "sim"
    start_ms: int = DEFAULT_START_MS
    hours: float = 6.0
    nodes: int = 8
    gpus_per_node: int = 8
    #: model of node i is node_models[i % len(node_models)]
    node_models: tuple[str, ...] = ("A100-80GB",) * 3 + ("H100-80GB",) * 2 + ("V100-32GB",) * 2 + ("T4",)
    tenants: tuple[str, ...] = ("vision", "nlp", "speech", "recsys", "robotics")
    queues: tuple[QueueSpec, ...] = (
        QueueSpec("prod", 100, 32.0, 0.35),
        QueueSpec("research", 50, 24.0, 0.40),
        QueueSpec("batch", 10, 16.0, 0.25, idle_share=0.6),
    )
    sample_interval_ms: int = 10_000
    snapshot_every_ms: int = 60_000
    watermark_every_ms: int = 10_000
    seed: int = 7
    rates: SimRates = SimRates()
    #: the nodes' names, one per node (empty: "<cluster>-nodeNN"); the join benchmark picks names that
    #: spread evenly over the gpu-samples partitions (bench/join.py `balanced_node_names`)
    node_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.cluster:
            problems.append("cluster must not be empty")
        if self.start_ms < 0:
            problems.append(f"start_ms must be >= 0, got {self.start_ms}")
        if not 0 < self.hours < float("inf"):  # also refuses NaN (every comparison with it is false)
            problems.append(f"hours must be > 0 and finite, got {self.hours}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            problems.append(f"need at least 1 node and 1 GPU per node, got {self.nodes}×{self.gpus_per_node}")
        if not self.node_models:
            problems.append("node_models must not be empty")
        unknown = sorted({m for m in self.node_models if m not in GPU_MODELS})
        if unknown:
            problems.append(f"unknown GPU models {unknown}; known: {sorted(GPU_MODELS)}")
        if not self.tenants:
            problems.append("tenants must not be empty")
        if not self.queues:
            problems.append("queues must not be empty")
        if len({q.name for q in self.queues}) != len(self.queues):
            problems.append("queue names must be unique")
        for name in ("sample_interval_ms", "snapshot_every_ms", "watermark_every_ms"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0")
        if not 0 < self.sample_interval_ms <= 3_600_000:
            problems.append("sample_interval_ms must be within (0, 3600000]")
        if self.node_names and (len(self.node_names) != self.nodes or len(set(self.node_names)) != self.nodes
                                or not all(self.node_names)):
            problems.append(f"node_names must be {self.nodes} distinct non-empty names, got {len(self.node_names)}")
        if problems:
            raise ValueError("invalid SimSpec: " + "; ".join(problems))

    @property
    def end_ms(self) -> int:
        return self.start_ms + round(self.hours * _HOUR)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_name(self, i: int) -> str:
        return self.node_names[i] if self.node_names else f"{self.cluster}-node{i:02d}"

    def node_model(self, i: int) -> str:
        return self.node_models[i % len(self.node_models)]


def gpu_uuid(cluster: str, node: str, index: int) -> str:
    """A stable NVML-style UUID: the hardware identity depends on where it sits, not on the seed."""
    h = hashlib.sha1(f"{cluster}/{node}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
