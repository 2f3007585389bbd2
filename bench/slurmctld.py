"""What the Slurm agent's poll costs the controller: slurmctld's CPU for the three client commands of one poll
(`squeue --json --states=all`, `sinfo --json`, `scontrol show partition --oneliner`, as
`agents/slurm_agent.py` runs them) with more and more jobs in its queue, on the real Slurm 22.05 of
`scripts/slurm/cluster.sh` (4 fake 8-GPU nodes, no accounting).

The queue: 32 running 1-GPU jobs (every GPU busy, each record with its gres_detail) and N held 1-GPU jobs
(`sbatch --hold`: real job records that stay pending), one `sbatch` each, in a cluster directory made
afresh. Per size, `polls` polls one after the other: slurmctld's CPU (utime + stime of its process, /proc,
over all of them, less its own rate measured over 10 s without polls just before), the wall time of each
command, the bytes squeue wrote, and the CPU of the commands themselves (22.05's squeue builds its JSON in
the client, on the agent's host, from the job records slurmctld packs). The share of a core is the
controller's CPU a poll over the agent's default interval (GPULEDGER_SLURM_AGENT_INTERVAL_S). The agent's
own side (parsing and translating that JSON) is `bench.slurm`'s.

    .venv/bin/python -m bench.slurmctld [--jobs 0,1000,5000,9000] [--polls 20]

Needs root and Slurm (cluster.sh installs it with apt when missing). It uses cluster.sh's fixed ports, so
it must not run beside `make slurm-check`. Not a stage of `make bench` (it needs a Slurm install).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import say

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "slurm" / "cluster.sh"
POLL = (["squeue", "--json", "--states=all"], ["sinfo", "--json"], ["scontrol", "show", "partition", "--oneliner"])
TICKS = os.sysconf("SC_CLK_TCK")


def sh(*args: str, timeout: float = 60) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()[-500:]}")
    return out.stdout


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def submit(n: int, *args: str) -> None:
    for _ in range(n):
        sh("sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "sleep 3600")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def poll() -> dict:
    """One poll's three commands: each one's wall time, their own CPU (Slurm 22.05's squeue builds the JSON
    in the client, from the job records slurmctld sends), and squeue's bytes."""
    walls, squeue_bytes = [], 0
    before = children_cpu_s()
    for cmd in POLL:
        t = time.perf_counter()
        out = sh(*cmd)
        walls.append(time.perf_counter() - t)
        if cmd[0] == "squeue":
            squeue_bytes = len(out.encode())
    return {"wall_s": walls, "client_cpu_s": children_cpu_s() - before, "squeue_bytes": squeue_bytes}


def controller_cpu_per_poll(ctld: int, polls: int, quiet_s: float) -> tuple[float, float, float, list[dict]]:
    """(slurmctld CPU seconds a poll, the same less its own work meanwhile, its CPU seconds a second with no
    poll, the polls). The process's CPU counts in clock ticks (10 ms), so it is read over all the polls; its
    own work (scheduling passes every 2 s here, over every pending job) is its rate over `quiet_s` seconds
    without polls just before."""
    c0, t0 = cpu_s(ctld), time.monotonic()
    time.sleep(quiet_s)
    c1, t1 = cpu_s(ctld), time.monotonic()
    samples = [poll() for _ in range(polls)]
    c2, t2 = cpu_s(ctld), time.monotonic()
    own_rate = (c1 - c0) / (t1 - t0)
    return (c2 - c1) / polls, max(0.0, (c2 - c1) - own_rate * (t2 - t1)) / polls, own_rate, samples


def run(sizes: tuple[int, ...] = (0, 1000, 5000, 9000), polls: int = 20, quiet_s: float = 10.0,
        interval_s: float | None = None) -> dict:
    from gpuledger.config import Settings

    interval_s = interval_s or Settings().slurm_agent_interval_s
    directory = ROOT / "build" / "bench-slurmctld"
    env = {**os.environ, "SLURM_ACCOUNTING": "0", "SLURM_MIN_JOB_AGE": "600"}
    if directory.exists():  # slurmctld keeps its jobs in the directory: start with none
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(directory)], capture_output=True, env=env, timeout=120)
        shutil.rmtree(directory)
    for line in subprocess.run(["bash", str(CLUSTER_SH), "start", str(directory)], capture_output=True, text=True,
                               env=env, timeout=900, check=True).stdout.splitlines():
        if line.startswith("export "):  # SLURM_CONF (and PATH for a chroot's wrappers)
            name, _, value = line.removeprefix("export ").partition("=")
            os.environ[name] = value.strip("'\"")
    results = {"interval_s": interval_s, "sizes": []}
    try:
        ctld = int((directory / "run" / "slurmctld.pid").read_text())
        submit(32, "--gres=gpu:1")
        deadline = time.monotonic() + 60
        while sh("squeue", "-h", "-t", "R", "-o", "%i").count("\n") < 32:
            assert time.monotonic() < deadline, "the 32 running jobs did not start"
            time.sleep(0.5)
        held = 0
        for size in sorted(sizes):
            t = time.perf_counter()
            submit(size - held, "--hold", "--gres=gpu:1")
            say(f"slurmctld: {size} held jobs ({size - held} submitted in {time.perf_counter() - t:.0f} s)")
            held = size
            time.sleep(3)  # let the scheduler's passes over the new jobs end
            raw, cpu, own_rate, samples = controller_cpu_per_poll(ctld, polls, quiet_s)
            row = {"held_jobs": size, "running_jobs": 32, "polls": polls,
                   "ctld_cpu_ms_per_poll_with_own_work": round(raw * 1000, 1),
                   "ctld_cpu_ms_per_poll": round(cpu * 1000, 1),
                   "ctld_own_cpu_share": round(own_rate, 4),
                   "ctld_core_share_at_interval": round(cpu / interval_s, 5),
                   "client_cpu_ms_per_poll": round(statistics.median(x["client_cpu_s"] for x in samples) * 1000, 1),
                   "squeue_wall_ms": round(statistics.median(s["wall_s"][0] for s in samples) * 1000, 1),
                   "poll_wall_ms": round(statistics.median(sum(s["wall_s"]) for s in samples) * 1000, 1),
                   "squeue_mb": round(samples[-1]["squeue_bytes"] / 1e6, 2)}
            say(f"  {row}")
            results["sizes"].append(row)
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(directory)], capture_output=True, env=env, timeout=120)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="0,1000,5000,9000",
                   help="held job counts, comma-separated (default 0,1000,5000,9000; Slurm's MaxJobCount is 10,000)")
    p.add_argument("--polls", type=int, default=20)
    args = p.parse_args()
    print(json.dumps(run(tuple(int(x) for x in args.jobs.split(",")), args.polls), indent=2))


if __name__ == "__main__":
    main()
