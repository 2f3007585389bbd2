"""`--backend sim-slurm`: simulated GPUs that are busy while a real Slurm job runs on them.

For a Slurm cluster with fake GPUs (scripts/slurm/cluster.sh: dummy /dev/nvidia* nodes), so the
ledger sees load where Slurm put jobs. Each tick scans /proc for processes whose environment
names a Slurm job on this node (`SLURM_JOB_ID`, `SLURMD_NODENAME` == the agent's `--node`) and
the GPUs Slurm gave it (`CUDA_VISIBLE_DEVICES`, else `SLURM_JOB_GPUS` / `GPU_DEVICE_ORDINAL`, the
indices of the node's dummy devices). Those GPUs report the job's process, with container id
`slurm-job-<SLURM_JOB_ID>` (what the NVML backend reads from a real job's cgroup), busy at
`GPULEDGER_SIM_LOAD` percent from the job's environment (default 90; a job that sets 0
simulates a hung job that holds its GPUs without using them). Other GPUs are idle.
GPU UUIDs are those of `SimBackend` for the node name: deterministic per (node, index).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpuledger.agents.sim_backend import SimBackend, SimProcess
from gpuledger.schemas.models import GpuSample

log = logging.getLogger(__name__)

DEFAULT_LOAD_PCT = 90.0
_WANTED = (b"SLURM_JOB_ID", b"SLURMD_NODENAME", b"CUDA_VISIBLE_DEVICES", b"SLURM_JOB_GPUS", b"GPU_DEVICE_ORDINAL",
           b"GPULEDGER_SIM_LOAD")


def read_environ(raw: bytes) -> dict[str, str]:
    """The variables of a /proc/<pid>/environ this backend uses."""
    out = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name in _WANTED:
            out[name.decode()] = value.decode("utf-8", "replace")
    return out


def job_gpus_of(env: dict[str, str], node: str) -> tuple[str, list[int], float] | None:
    """(job id, GPU indices, load percent) of a process of a Slurm job on `node`, or None."""
    job = env.get("SLURM_JOB_ID")
    if not job or env.get("SLURMD_NODENAME") != node:
        return None
    devices = env.get("CUDA_VISIBLE_DEVICES") or env.get("SLURM_JOB_GPUS") or env.get("GPU_DEVICE_ORDINAL") or ""
    indices = [int(d) for d in devices.split(",") if d.strip().isdigit()]
    try:
        load = float(env.get("GPULEDGER_SIM_LOAD", DEFAULT_LOAD_PCT))
    except ValueError:
        load = DEFAULT_LOAD_PCT
    return job, indices, min(100.0, max(0.0, load))


class SlurmSimBackend:
    """SimBackend GPUs driven by the Slurm jobs found in /proc."""

    def __init__(self, models: list[str], *, node: str, seed: int = 0, proc_root: str | Path = "/proc"):
        self.sim = SimBackend(models, seed=seed, node=node)
        self.node = node
        self.proc_root = Path(proc_root)
        self.calls_last_tick = 0

    def scan(self) -> dict[int, list[SimProcess]]:
        """GPU index → the Slurm jobs' processes on it (one per job: its lowest pid)."""
        by_gpu: dict[int, dict[str, SimProcess]] = {}
        try:
            entries = os.listdir(self.proc_root)
        except OSError:
            return {}
        for name in sorted(entries, key=lambda n: int(n) if n.isdigit() else 0):
            if not name.isdigit():
                continue
            try:
                env = read_environ((self.proc_root / name / "environ").read_bytes())
            except OSError:  # gone, or not ours to read
                continue
            found = job_gpus_of(env, self.node)
            if found is None:
                continue
            job, indices, load = found
            for index in indices:
                by_gpu.setdefault(index, {}).setdefault(
                    job, SimProcess(pid=int(name), container_id=f"slurm-job-{job}", sm_util_pct=load))
        return {i: list(jobs.values()) for i, jobs in by_gpu.items()}

    def sample(self, now_ms: int) -> list[GpuSample]:
        busy = self.scan()
        for index in range(len(self.sim.uuids)):
            procs = busy.get(index, [])
            self.sim.set_gpu(index, processes=procs, util_pct=min(100.0, sum(p.sm_util_pct or 0 for p in procs)))
        samples = self.sim.sample(now_ms)
        self.calls_last_tick = self.sim.calls_last_tick
        return samples

    def close(self) -> None:
        self.sim.close()
