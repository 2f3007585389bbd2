"""A simulated GPU node: the fake-GPU switch (`--backend sim`), for tests and demos.

Deterministic: the same models, seed, node name, settings and tick times give the same
samples. Each GPU's state (utilization, processes with their containers, down, Xids) is
set by the caller; the backend adds small seeded jitter and derives the rest (power from
utilization, an energy counter that integrates power over time, temperature, throughput).
"""

from __future__ import annotations

import hashlib
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from gpuledger.agents.backend import FATAL_XIDS, xid_down_reason
from gpuledger.schemas.models import GpuHealth, GpuSample, ProcessSample

GiB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """What the simulator needs to know about a card (public datasheet figures, rounded)."""

    mem_total_bytes: int
    idle_w: float
    max_w: float
    sm_clock_mhz: float          # boost clock under load
    mem_clock_mhz: float
    pcie_max_bytes_per_s: float
    nvlink_max_bytes_per_s: float | None  # None: no NVLink on this card


MODEL_SPECS: dict[str, ModelSpec] = {
    "A100-80GB": ModelSpec(80 * GiB, 60, 400, 1410, 1593, 25e9, 300e9),
    "A100-40GB": ModelSpec(40 * GiB, 55, 400, 1410, 1215, 25e9, 300e9),
    "H100-80GB": ModelSpec(80 * GiB, 70, 700, 1980, 2619, 50e9, 450e9),
    "H200-141GB": ModelSpec(141 * GiB, 75, 700, 1980, 3201, 50e9, 450e9),
    "V100-32GB": ModelSpec(32 * GiB, 40, 300, 1530, 877, 12e9, 150e9),
    "T4": ModelSpec(15 * GiB, 10, 70, 1590, 5001, 12e9, None),
    "L40S": ModelSpec(45 * GiB, 35, 350, 2520, 9001, 25e9, None),
}
DEFAULT_SPEC = ModelSpec(24 * GiB, 30, 300, 1500, 1500, 12e9, None)
#: board part number and VBIOS of a simulated card, per model (shaped like NVIDIA's; not real ones)
SIM_BOARDS: dict[str, tuple[str, str]] = {
    "A100-80GB": ("692-2G506-0210-002", "92.00.45.00.05"),
    "A100-40GB": ("692-2G506-0200-002", "92.00.36.00.02"),
    "H100-80GB": ("692-2G520-0200-000", "96.00.30.00.01"),
    "H200-141GB": ("692-2G530-0200-000", "96.00.74.00.0C"),
    "V100-32GB": ("692-2G503-0203-200", "88.00.80.00.01"),
    "T4": ("900-2G183-0000-001", "90.04.38.00.03"),
    "L40S": ("900-2G133-0080-000", "95.02.5D.00.02"),
}


def sim_identity(gpu_uuid: str, model: str) -> dict[str, str]:
    """A simulated card's serial, board part number and VBIOS, derived from its UUID (not the backend's
    random stream, so adding them changed no other simulated value). Serials fall in three batches
    per model: the serial's first 7 digits, as on NVIDIA boards."""
    digest = int(hashlib.sha256(gpu_uuid.encode()).hexdigest(), 16)
    part, vbios = SIM_BOARDS.get(model, ("699-00000-0000-000", "00.00.00.00.00"))
    batch = 1320220 + (sum(map(ord, model)) % 50) * 10 + digest % 3
    return {"serial": f"{batch}{digest % 10**6:06d}", "board_part_number": part, "vbios_version": vbios}
IDLE_SM_CLOCK_MHZ = 345.0


@dataclass(frozen=True)
class SimProcess:
    """A process on a simulated GPU. sm_util_pct None: gets an even part of the GPU's unclaimed busy time."""

    pid: int
    container_id: str | None = None
    sm_util_pct: float | None = None
    mem_used_bytes: int | None = None


@dataclass
class _SimGpu:
    index: int
    uuid: str
    model: str
    spec: ModelSpec
    energy_j: float
    util_pct: float = 0.0
    processes: list[SimProcess] = field(default_factory=list)
    down_reason: str | None = None
    pending_xids: list[int] = field(default_factory=list)
    last_ms: int | None = None
    last_power_w: float | None = None


def parse_sim_models(spec: str) -> list[str]:
    """'4xA100-80GB,2xT4' or 'A100-80GB,T4' -> the list of models, one per GPU."""
    models: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)\s*[xX]\s*(.+)", part)
        count, model = (int(m.group(1)), m.group(2).strip()) if m else (1, part)
        if count < 1 or not model:
            raise ValueError(f"bad simulated GPU spec {part!r}: expected MODEL or NxMODEL, e.g. 4xA100-80GB")
        models.extend([model] * count)
    if not models:
        raise ValueError(f"no simulated GPUs in {spec!r}: expected e.g. 8xA100-80GB or A100-80GB,T4")
    return models


def _round(x: float, digits: int = 3) -> float:
    return round(x, digits)


class SimBackend:
    """N simulated GPUs of the given models. Idle (0% busy, no processes) until told otherwise."""

    def __init__(self, models: Sequence[str] = ("A100-80GB",) * 8, *, seed: int = 0, node: str = "sim-node",
                 jitter_pct: float = 2.0):
        if not models:
            raise ValueError("SimBackend needs at least one GPU model")
        # The node name is part of the seed so that many simulated nodes get distinct GPUs.
        self._rng = random.Random(f"{seed}/{node}")
        self._jitter = jitter_pct
        self.calls_last_tick = 0
        self._gpus = [
            _SimGpu(
                index=i,
                uuid=f"GPU-{uuid.UUID(int=self._rng.getrandbits(128), version=4)}",
                model=model,
                spec=MODEL_SPECS.get(model, DEFAULT_SPEC),
                energy_j=_round(self._rng.uniform(1e6, 5e7)),  # driver loaded a while ago
            )
            for i, model in enumerate(models)
        ]

    # ------------------------------------------------------------------ control
    @property
    def uuids(self) -> list[str]:
        return [g.uuid for g in self._gpus]

    def _gpu(self, index: int) -> _SimGpu:
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"no simulated GPU {index} (this node has {len(self._gpus)})")
        return self._gpus[index]

    def set_gpu(self, index: int, *, util_pct: float | None = None,
                processes: Iterable[SimProcess] | None = None) -> None:
        """Set a GPU's busy percent and/or its processes. Processes without util_pct:
        the GPU's busy percent becomes the sum of its processes' SM shares (at most 100)."""
        gpu = self._gpu(index)
        if processes is not None:
            gpu.processes = sorted(processes, key=lambda p: p.pid)
        if util_pct is not None:
            if not 0 <= util_pct <= 100:
                raise ValueError(f"util_pct must be within 0..100, got {util_pct}")
            gpu.util_pct = float(util_pct)
        elif processes is not None:
            gpu.util_pct = min(100.0, sum(p.sm_util_pct or 0.0 for p in gpu.processes))

    def set_down(self, index: int, reason: str = "drained") -> None:
        self._gpu(index).down_reason = reason

    def set_up(self, index: int) -> None:
        self._gpu(index).down_reason = None

    def inject_xid(self, index: int, xid: int) -> None:
        """An Xid error, reported at the next tick; a fatal one takes the GPU down."""
        gpu = self._gpu(index)
        gpu.pending_xids.append(xid)
        if xid in FATAL_XIDS and gpu.down_reason is None:
            gpu.down_reason = xid_down_reason(xid)

    def close(self) -> None:
        pass

    def __enter__(self) -> SimBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ tick
    def _jitter_of(self, value: float, lo: float, hi: float) -> float:
        return min(hi, max(lo, value + self._rng.uniform(-self._jitter, self._jitter)))

    def sample(self, now_ms: int) -> list[GpuSample]:
        self.calls_last_tick = 1  # the event queue, as the NVML backend polls it once per tick
        return [self._sample_gpu(gpu, now_ms) for gpu in self._gpus]

    def _sample_gpu(self, gpu: _SimGpu, now_ms: int) -> GpuSample:
        self.calls_last_tick += 1
        dt_s = (now_ms - gpu.last_ms) / 1000.0 if gpu.last_ms is not None and now_ms > gpu.last_ms else 0.0
        gpu.last_ms = now_ms
        xids, gpu.pending_xids = gpu.pending_xids, []
        ident = dict(gpu_uuid=gpu.uuid, index=gpu.index, model=gpu.model, xid_errors=xids,
                     **sim_identity(gpu.uuid, gpu.model))
        if gpu.down_reason is not None:
            gpu.last_power_w = None  # a down card reports nothing; its counter resumes where it was
            return GpuSample(**ident, health=GpuHealth.down, down_reason=gpu.down_reason)

        spec = gpu.spec
        util = _round(self._jitter_of(gpu.util_pct, 0, 100), 1) if gpu.util_pct > 0 else 0.0
        load = util / 100.0
        power = _round(self._jitter_of(spec.idle_w + (spec.max_w - spec.idle_w) * load, 0, spec.max_w))
        if gpu.last_power_w is not None:  # trapezoid: the counter integrates power between ticks
            gpu.energy_j = _round(gpu.energy_j + (gpu.last_power_w + power) / 2 * dt_s)
        gpu.last_power_w = power

        procs = self._processes(gpu, util)
        mem_used = sum(p.mem_used_bytes or 0 for p in procs)
        return GpuSample(
            **ident,
            util_gpu_pct=util,
            mem_used_bytes=min(mem_used, spec.mem_total_bytes),
            mem_total_bytes=spec.mem_total_bytes,
            temperature_c=_round(self._jitter_of(30 + 50 * load, 20, 95), 1),
            power_w=power,
            power_limit_w=spec.max_w,
            energy_j=gpu.energy_j,
            pcie_tx_bytes_per_s=_round(spec.pcie_max_bytes_per_s * 0.1 * load),
            pcie_rx_bytes_per_s=_round(spec.pcie_max_bytes_per_s * 0.2 * load),
            nvlink_tx_bytes_per_s=_round(spec.nvlink_max_bytes_per_s * 0.3 * load) if spec.nvlink_max_bytes_per_s else None,
            nvlink_rx_bytes_per_s=_round(spec.nvlink_max_bytes_per_s * 0.3 * load) if spec.nvlink_max_bytes_per_s else None,
            sm_clock_mhz=spec.sm_clock_mhz if util > 0 else IDLE_SM_CLOCK_MHZ,
            mem_clock_mhz=spec.mem_clock_mhz,
            throttle_reasons=0 if util > 0 else 1,  # NVML's "GPU idle" clock-event bit
            ecc_sbe_total=0,
            ecc_dbe_total=0,
            processes=procs,
        )

    def _processes(self, gpu: _SimGpu, util: float) -> list[ProcessSample]:
        explicit = sum(p.sm_util_pct for p in gpu.processes if p.sm_util_pct is not None)
        unset = [p for p in gpu.processes if p.sm_util_pct is None]
        even = max(0.0, util - explicit) / len(unset) if unset else 0.0
        return [
            ProcessSample(
                pid=p.pid,
                container_id=p.container_id,
                sm_util_pct=_round(min(100.0, p.sm_util_pct if p.sm_util_pct is not None else even), 1),
                mem_used_bytes=p.mem_used_bytes,
            )
            for p in gpu.processes
        ]
