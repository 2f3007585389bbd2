"""The Slurm agent on real output of Slurm 24.11.5 (data_parser v0.0.42), recorded in a Debian trixie chroot
(tests/fixtures/slurm/README.md, `*_v2411_*.json`): squeue lists job_state as [base, flags...], numbers and
exit codes as objects, and `sinfo --json` groups the nodes ({"sinfo": [...]}) so the agent reads them with
`scontrol show nodes --json` (scripts/slurm/record_slurm24.sh record). Jobs: 1 (2 GPUs) completes, 2 exits 3,
3 is cancelled, array 4 (4_0-4_2, 1 GPU each), 5 on gpu[02-03] (4 GPUs each, srun), 8 requeued with `scontrol
requeue` and run again, 9 the whole cluster (4 × 8 GPUs) pending, then running, then requeued by prod job 10
(8 GPUs) and run again."""

from __future__ import annotations

import json
from pathlib import Path

from gpuledger.agents.slurm import (
    AgentState,
    build_snapshot,
    gpus_held_by_no_job,
    gres_request_gpus,
    node_gpu_counts,
    parse_jobs,
    translate,
)
from gpuledger.agents.slurm_agent import SlurmAgent
from slurm_sink import JobEventSink

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
#: the recorded moments, and the watermark the agent published at each (poll start less its 1-s margin)
MOMENTS = {"running": 1796594292000, "changed": 1796594297000, "whole": 1796594370000,
           "preempted": 1796594372000, "done": 1796594395000}
TIERS = {"batch": 1, "prod": 10}


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_list_valued_states_numbers_and_exit_objects_read_as_slurm_22_05_wrote_them():
    jobs = {j.job_id: j for j in parse_jobs(load("squeue_v2411_changed")).jobs}
    assert {k: j.state for k, j in jobs.items()} == {
        "1": "RUNNING", "2": "FAILED", "3": "CANCELLED", "4_0": "RUNNING", "4_1": "RUNNING", "4_2": "RUNNING",
        "5": "RUNNING", "8": "PENDING", "9": "PENDING"}
    assert (jobs["2"].exit_code, jobs["3"].exit_code) == (3 << 8, 15)  # exit 3; SIGTERM
    assert jobs["8"].attempt == 1 and jobs["8"].reason == "BeginTime"
    assert jobs["5"].nodes == ["gpu02", "gpu03"] and jobs["5"].gres_detail == ["gpu:a100:4(IDX:0-3)"] * 2
    assert (jobs["4_1"].array_job_id, jobs["4_1"].array_task_id) == (4, 1)


def test_the_recorded_story_gives_each_attempt_its_outcome_reason_and_gpus():
    state, events, snapshots = AgentState(), [], {}
    for moment, watermark_ms in MOMENTS.items():
        squeue, nodes = load(f"squeue_v2411_{moment}"), load(f"nodes_v2411_{moment}")
        result = translate(squeue, state, cluster="gpuledger", poll_started_ms=watermark_ms + 1000, tiers=TIERS,
                           node_gpus=node_gpu_counts(nodes))
        assert result.warnings == [] and result.vanished == [] and result.watermark.ts_ms == watermark_ms
        state = result.state
        events += [(e.job_id, e.attempt, e.kind.value, e.reason, len(e.gpus or [])) for e in result.events]
        snapshots[moment] = {q.queue: (q.quota_gpus, q.allocated_gpus, q.pending_jobs, q.pending_gpus) for q in build_snapshot(
            squeue, nodes, cluster="gpuledger", ts_ms=watermark_ms, tiers=TIERS).queues}
        assert gpus_held_by_no_job(nodes, parse_jobs(squeue)) == {}
    ends = {(j, a): (k, r) for j, a, k, r, _ in events if k in ("completed", "failed", "cancelled", "preempted")}
    assert ends == {
        ("2", 0): ("failed", "exit 3"), ("3", 0): ("cancelled", "signal 15"), ("8", 0): ("preempted", "requeued"),
        ("1", 0): ("completed", None), ("4_0", 0): ("completed", None), ("4_1", 0): ("completed", None),
        ("4_2", 0): ("completed", None), ("5", 0): ("completed", None), ("8", 1): ("completed", None),
        ("9", 0): ("preempted", "requeued to reclaim resources for job 10"), ("10", 0): ("completed", None),
        ("9", 1): ("completed", None)}
    gpus = {(j, a): n for j, a, k, _, n in events if k == "allocated"}
    assert gpus == {("1", 0): 2, ("2", 0): 1, ("3", 0): 2, ("4_0", 0): 1, ("4_1", 0): 1, ("4_2", 0): 1,
                    ("5", 0): 8, ("8", 0): 2, ("9", 0): 32, ("10", 0): 8, ("9", 1): 32,
                    ("8", 1): 0}  # ran between two recorded moments: 2 of a node's 8, indices not seen
    # 9's rerun also ran between two moments: `-N 4 --gres=gpu:8` is every GPU of its 4 nodes (whole nodes),
    # read from its per-node request: this cluster has no accounting, so its TRES strings carry no GPUs
    assert snapshots["running"] == {"batch": (32.0, 18.0, 1, 32.0), "prod": (32.0, 0.0, 0, 0.0)}
    assert snapshots["whole"]["batch"] == (32.0, 32.0, 0, 0.0)


def test_a_job_between_polls_that_asked_gpus_per_job_is_inferred_as_whole_nodes_too():
    """Job 9's rerun, recorded with `-N 4 --gres=gpu:8`, as if submitted `-N 4 --gpus=32` (tres_per_job):
    its 32 GPUs are every GPU of its 4 nodes either way. As `--gpus=16` its count is 16: part of its nodes,
    which is never inferred (tests/unit/test_slurm_whole_node.py)."""
    state = AgentState()
    for moment in ("preempted", "done"):
        squeue = load(f"squeue_v2411_{moment}")
        for job in squeue["jobs"]:
            if job["job_id"] == 9:
                job.update(tres_per_node="", tres_per_job="gres/gpu:32")
        result = translate(squeue, state, cluster="gpuledger", poll_started_ms=MOMENTS[moment] + 1000, tiers=TIERS,
                           node_gpus=node_gpu_counts(load(f"nodes_v2411_{moment}")))
        state = result.state
    (rerun,) = [e for e in result.events if e.job_id == "9" and e.kind.value == "allocated"]
    assert rerun.attempt == 1 and len(rerun.gpus) == 32
    squeue = load("squeue_v2411_done")
    (job9,) = [j for j in parse_jobs(squeue).jobs if j.job_id == "9"]
    assert job9.alloc_gpus == 32.0  # from tres_per_node 8 x its 4 nodes
    for job in squeue["jobs"]:
        if job["job_id"] == 9:
            job.update(tres_per_node="", tres_per_job="gres/gpu:16")
    (job9,) = [j for j in parse_jobs(squeue).jobs if j.job_id == "9"]
    assert job9.alloc_gpus == 16.0


def test_gpus_of_a_gres_request():
    assert [gres_request_gpus(g) for g in ("gres:gpu:8", "gres/gpu:2", "gres/gpu:a100:3", "gres/gpu",
                                           "gres/shard:4", "gres/gpu:2,gres/shard:4", "", "gres/gpu:a100",
                                           "gres/gpu:1K")] == [8, 2, 3, 1, 0, 2, 0, 1, 0]


class RecordedSlurm:
    """squeue, sinfo (grouped, as 24.11 writes it) and scontrol show nodes of one recorded moment."""

    def __init__(self):
        self.asked: list[str] = []

    def __call__(self, argv, timeout_s, env=None):
        self.asked.append(" ".join(argv[:3]))
        if argv[0] == "squeue":
            return (FIXTURES / "squeue_v2411_running.json").read_text()
        if argv[0] == "sinfo":
            return (FIXTURES / "sinfo_v2411_running.json").read_text()
        if argv[:3] == ["scontrol", "show", "nodes"]:
            return (FIXTURES / "nodes_v2411_running.json").read_text()
        if argv[:2] == ["scontrol", "show"]:
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        raise AssertionError(f"unexpected command {argv}")


def test_the_agent_reads_the_nodes_with_scontrol_once_sinfo_groups_them(tmp_path):
    slurm, sink = RecordedSlurm(), JobEventSink()
    agent = SlurmAgent(cluster="gpuledger", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: MOMENTS["running"] / 1000 + 1)
    assert agent.poll_once() and agent.poll_once()
    assert [a for a in slurm.asked if a.startswith(("sinfo", "scontrol show nodes"))] == [
        "sinfo --json", "scontrol show nodes", "scontrol show nodes"]  # sinfo asked once
    assert len([e for e in sink.events if e.kind.value == "allocated"]) == 8
