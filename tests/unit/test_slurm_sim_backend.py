"""`--backend sim-slurm`: simulated GPUs busy where a Slurm job's processes run on this node."""

from __future__ import annotations

from pathlib import Path

from gpuledger.agents.gpu_agent import build_tick, make_backend
from gpuledger.agents.sim_backend import SimBackend
from gpuledger.agents.slurm_sim_backend import SlurmSimBackend, job_gpus_of, read_environ


def process(root: Path, pid: int, **env: str) -> None:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")


def test_environment_of_a_job_process():
    env = read_environ(b"PATH=/bin\0SLURM_JOB_ID=12\0SLURMD_NODENAME=gpu01\0CUDA_VISIBLE_DEVICES=0,3\0")
    assert env == {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "gpu01", "CUDA_VISIBLE_DEVICES": "0,3"}
    assert job_gpus_of(env, "gpu01") == ("12", [0, 3], 90.0)
    assert job_gpus_of(env, "gpu02") is None  # another node's step
    assert job_gpus_of({**env, "CUDA_VISIBLE_DEVICES": "", "SLURM_JOB_GPUS": "5", "GPULEDGER_SIM_LOAD": "0"},
                       "gpu01") == ("12", [5], 0.0)
    assert job_gpus_of({"PATH": "/bin"}, "gpu01") is None


def test_gpus_of_running_jobs_are_busy_with_the_jobs_container(tmp_path):
    process(tmp_path, 100, SLURM_JOB_ID="7", SLURMD_NODENAME="gpu01", CUDA_VISIBLE_DEVICES="0,1", GPULEDGER_SIM_LOAD="80")
    process(tmp_path, 101, SLURM_JOB_ID="7", SLURMD_NODENAME="gpu01", CUDA_VISIBLE_DEVICES="0,1")  # same job
    process(tmp_path, 200, SLURM_JOB_ID="9", SLURMD_NODENAME="gpu01", CUDA_VISIBLE_DEVICES="5", GPULEDGER_SIM_LOAD="0")
    process(tmp_path, 300, SLURM_JOB_ID="8", SLURMD_NODENAME="gpu02", CUDA_VISIBLE_DEVICES="2")
    (tmp_path / "self").mkdir()
    backend = make_backend("sim-slurm", sim_gpus="8xA100-80GB", node="gpu01", proc_root=str(tmp_path))
    assert isinstance(backend, SlurmSimBackend)
    tick = build_tick(backend, cluster="c", node="gpu01", now_ms=1_000, interval_ms=1000)
    gpus = {g.index: g for g in tick.gpus}
    assert [(p.pid, p.container_id, p.sm_util_pct) for p in gpus[0].processes] == [(100, "slurm-job-7", 80.0)]
    assert gpus[0].util_gpu_pct > 70 and gpus[1].util_gpu_pct > 70
    assert [p.container_id for p in gpus[5].processes] == ["slurm-job-9"] and gpus[5].util_gpu_pct == 0  # hung
    assert gpus[2].processes == [] and gpus[2].util_gpu_pct == 0  # job 8 runs on gpu02
    # UUIDs are the simulated node's: the same for every agent of node gpu01
    assert [g.gpu_uuid for g in tick.gpus] == SimBackend(["A100-80GB"] * 8, node="gpu01").uuids
    # the job ends: its GPUs go idle
    for pid in ("100", "101"):
        (tmp_path / pid / "environ").unlink()
        (tmp_path / pid).rmdir()
    later = build_tick(backend, cluster="c", node="gpu01", now_ms=2_000, interval_ms=1000)
    assert later.gpus[0].processes == [] and later.gpus[0].util_gpu_pct == 0
