"""Slurm agent cost per poll at fleet scale (pure, no Slurm): what `gpuledger agent slurm` does with one
`squeue --json --states=all` and one `sinfo --json` of a cluster of N 8-GPU nodes.

The job and node records are the recorded Slurm 22.05 ones of tests/fixtures/slurm (trimmed to the
fields the agent reads: a real record is several times larger, which costs only in the JSON parse,
reported on its own per MB), one job per node holding its 8 GPUs, plus a quarter as many pending
jobs. Timed per poll, CPU seconds of this process: the JSON parse, `translate` (squeue + the state
-> events, watermark, next state) and `build_snapshot` (queues and nodes -> the snapshot). The first
poll emits every job's events; the next ones find nothing new, as most polls of a running cluster.
Each poll runs with the cyclic collector paused, as the agent's (`slurm_agent.gc_paused`), and ends
with the agent's state file written (`save_state`, fsync included; CPU only is counted).
The share of a core is the steady poll over the agent's default interval
(GPULEDGER_SLURM_AGENT_INTERVAL_S).

    .venv/bin/python -m bench.slurm
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.common import QUICK, say, workdir

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "slurm"
GPUS = (1_000, 10_000) if QUICK else (1_000, 10_000, 100_000)
STEADY_POLLS = 3
START_S = 1_796_084_016  # the recorded jobs' submit time


def cluster(nodes: int) -> tuple[bytes, bytes]:
    """(squeue, sinfo) JSON of `nodes` 8-GPU nodes, each running one job; nodes // 4 jobs pending."""
    squeue = json.loads((FIXTURES / "squeue_running.json").read_text())
    sinfo = json.loads((FIXTURES / "sinfo_running.json").read_text())
    job, node = squeue["jobs"][0], sinfo["nodes"][0]
    jobs = [dict(job, job_id=i + 1, nodes=f"gpu{i:06d}", gres_detail=["gpu:a100:8(IDX:0-7)"],
                 tres_req_str="cpu=1,node=1,gres/gpu=8", tres_alloc_str="cpu=1,node=1,billing=1,gres/gpu=8",
                 tres_per_node="gres:gpu:8", submit_time=START_S + i % 1000, start_time=START_S + i % 1000)
            for i in range(nodes)]
    jobs += [dict(job, job_id=nodes + i + 1, job_state="PENDING", state_reason="Resources", nodes="", gres_detail=[],
                  start_time=0, tres_alloc_str="", submit_time=START_S + i % 1000) for i in range(nodes // 4)]
    hosts = [dict(node, name=f"gpu{i:06d}", gres_used="gpu:a100:8(IDX:0-7)") for i in range(nodes)]
    return json.dumps(dict(squeue, jobs=jobs)).encode(), json.dumps(dict(sinfo, nodes=hosts)).encode()


def measure(gpus: int) -> dict:
    from gpuledger.agents.slurm import AgentState, build_snapshot, gpus_held_by_no_job, parse_jobs, translate
    from gpuledger.agents.slurm_agent import gc_paused, load_json, save_state

    squeue_raw, sinfo_raw = cluster(gpus // 8)
    now_ms = (START_S + 2_000) * 1000
    state = AgentState()
    state_file = workdir() / f"slurm-agent-state-{gpus}.json"
    polls = []
    for k in range(1 + STEADY_POLLS):
        with gc_paused():  # as SlurmAgent.poll_once
            t0 = time.process_time()
            squeue, sinfo = load_json(squeue_raw.decode(), "squeue"), load_json(sinfo_raw.decode(), "sinfo")
            t1 = time.process_time()
            result = translate(squeue, state, cluster="bench", poll_started_ms=now_ms + 10_000 * k)
            t2 = time.process_time()
            parsed = parse_jobs(squeue)  # as SlurmAgent._poll: the snapshot and the GPUs held by no job
            build_snapshot(squeue, sinfo, cluster="bench", ts_ms=now_ms + 10_000 * k,
                           preemptions=result.state.preemptions, jobs=parsed.jobs)
            assert not gpus_held_by_no_job(sinfo, parsed)
            t3 = time.process_time()
            save_state(state_file, result.state)
            t4 = time.process_time()
        state = result.state
        polls.append({"parse_s": t1 - t0, "translate_s": t2 - t1, "snapshot_s": t3 - t2, "save_s": t4 - t3,
                      "events": len(result.events)})
    state_bytes = state_file.stat().st_size
    state_file.unlink()
    parts = ("parse_s", "translate_s", "snapshot_s", "save_s")
    steady = [sum(p[k] for k in parts) for p in polls[1:]]
    megabytes = (len(squeue_raw) + len(sinfo_raw)) / 1e6
    out = {"gpus": gpus, "jobs": gpus // 8 + gpus // 32, "json_mb": round(megabytes, 2),
           "first_poll_s": round(sum(polls[0][k] for k in parts), 3),
           "first_poll_events": polls[0]["events"], "steady_poll_s": round(statistics.median(steady), 3),
           "steady_parse_s_per_mb": round(statistics.median(p["parse_s"] for p in polls[1:]) / megabytes, 4),
           "steady_translate_s": round(statistics.median(p["translate_s"] for p in polls[1:]), 3),
           "steady_snapshot_s": round(statistics.median(p["snapshot_s"] for p in polls[1:]), 3),
           "steady_save_s": round(statistics.median(p["save_s"] for p in polls[1:]), 3), "state_bytes": state_bytes}
    say(f"slurm agent, {gpus:,} GPUs ({out['jobs']:,} jobs, {megabytes:.1f} MB of JSON): first poll "
        f"{out['first_poll_s']:.2f} s ({out['first_poll_events']:,} events), steady {out['steady_poll_s']:.2f} s "
        f"(translate {out['steady_translate_s']:.2f}, snapshot {out['steady_snapshot_s']:.2f}, state file "
        f"{out['steady_save_s']:.2f} for {state_bytes / 1e6:.1f} MB, parse {out['steady_parse_s_per_mb']:.3f} s/MB)")
    return out


def run() -> dict:
    from gpuledger.config import Settings

    interval_s = Settings().slurm_agent_interval_s
    rows = [measure(g) for g in GPUS]
    largest = rows[-1]
    return {"slurm_poll_core_share": largest["steady_poll_s"] / interval_s,
            "slurm_poll_detail": {"interval_s": interval_s, "sizes": rows}}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
