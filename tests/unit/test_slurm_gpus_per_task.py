"""GPU counts of jobs that asked `--gpus-per-task` on a cluster that does not account GPUs
(AccountingStorageTRES without gres/gpu: TRES strings carry none), from real output of Slurm 22.05.8,
24.11.5, 23.11.11, 25.05.8 and 25.11.7 (tests/fixtures/slurm/README.md, `*gpus_per_task*`; `scripts/slurm/cluster.sh`
with SLURM_ACCOUNTING=0, the others in their roots). The same jobs on both:
1 `-n 2 --gpus-per-task=2` (4 GPUs), 2 `-N 1 -n 3 --gpus-per-task=1` (3), 3 `-N 2 --ntasks-per-node=2
--gpus-per-task=1` (4 on 2 nodes), 4 `--gpus=3` (per job), 5 `-n 2 -c 2 --gpus-per-task=1` (2; 24.11 writes
`cpu=2,gres/gpu=1`, 23.11 `cpu:2,gres/gpu:1`), 6 `-n 2 --gpus-per-task=a100:1` (2, typed), 7 `-N 4 -n 4 --gpus-per-task=8` (the whole
cluster: pending at `running`, then run for 5 s and completed between the two moments), 8 `-n 2
--gpus-per-task=1` ending at once (completed before the first moment: its indices never seen)."""

from __future__ import annotations


import pytest

from gpuledger.agents.slurm import AgentState, build_snapshot, node_gpu_counts, parse_jobs, task_request_gpus, translate
from slurm_fixtures import load

#: (squeue file prefix, the node records of the `running` moment) per Slurm version
VERSIONS = {"22.05": ("squeue_gpus_per_task", "sinfo_gpus_per_task_running"),
            "24.11": ("squeue_v2411_gpus_per_task", "nodes_v2411_gpus_per_task_running"),
            "23.11": ("squeue_v2311_gpus_per_task", "nodes_v2311_gpus_per_task_running"),
            "25.05": ("squeue_v2505_gpus_per_task", "nodes_v2505_gpus_per_task_running"),
            "25.11": ("squeue_v2511_gpus_per_task", "nodes_v2511_gpus_per_task_running")}
GPUS = {"1": 4.0, "2": 3.0, "3": 4.0, "4": 3.0, "5": 2.0, "6": 2.0, "7": 32.0, "8": 2.0}


def last_change_ms(squeue: dict) -> int:
    """When the moment was recorded, about: its last submit, start or end (a running job's end_time is its
    time limit, a pending one's start_time a guess)."""
    return max(j.submit_ms if j.state == "PENDING" else j.start_ms if j.state == "RUNNING" else j.end_ms
               for j in parse_jobs(squeue).jobs)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_job_counts_its_tasks_gpus(version):
    squeue_prefix, _ = VERSIONS[version]
    for moment in ("running", "done"):
        squeue = load(f"{squeue_prefix}_{moment}")
        assert all("gres/gpu" not in (j["tres_req_str"] + j["tres_alloc_str"]) for j in squeue["jobs"])  # no accounting
        jobs = {j.job_id: j for j in parse_jobs(squeue).jobs}
        assert {k: j.requested_gpus for k, j in jobs.items()} == GPUS
        assert {k: j.alloc_gpus for k, j in jobs.items()} == GPUS


@pytest.mark.parametrize("version", VERSIONS)
def test_pending_gpus_of_the_queue_count_the_tasks(version):
    squeue_prefix, nodes = VERSIONS[version]
    (batch,) = [q for q in build_snapshot(load(f"{squeue_prefix}_running"), load(nodes), cluster="c", ts_ms=0,
                                          tiers={"batch": 1, "prod": 10}).queues if q.queue == "batch"]
    assert (batch.pending_jobs, batch.pending_gpus) == (1, 32.0)  # job 7, 0 before
    assert batch.allocated_gpus == 18.0  # jobs 1-6, from their indices


@pytest.mark.parametrize("version", VERSIONS)
def test_a_whole_cluster_job_that_ran_between_polls_gets_its_32_gpus(version):
    """Job 7 ran and ended between the two moments: squeue shows its 4 nodes but no indices. Its 8 GPUs per
    task × 4 tasks are every GPU of the 4 nodes, so its GPUs are known (whole nodes); job 8, 2 GPUs of a node,
    is allocated with none (which 2 is not known, and never guessed)."""
    squeue_prefix, nodes = VERSIONS[version]
    node_gpus = node_gpu_counts(load(nodes))
    state, allocated = AgentState(), {}
    for moment in ("running", "done"):
        squeue = load(f"{squeue_prefix}_{moment}")
        poll_ms = last_change_ms(squeue) + 2000
        result = translate(squeue, state, cluster="c", poll_started_ms=poll_ms, node_gpus=node_gpus,
                           tiers={"batch": 1, "prod": 10})
        assert result.warnings == []
        state = result.state
        allocated |= {e.job_id: e for e in result.events if e.kind.value == "allocated"}
    assert {k: len(e.gpus) for k, e in allocated.items()} == {
        "1": 4, "2": 3, "3": 4, "4": 3, "5": 2, "6": 2, "7": 32, "8": 0}
    assert "whole nodes" in allocated["7"].reason and "not seen" in allocated["8"].reason


def test_gpus_of_a_task_request():
    assert [task_request_gpus(t) for t in ("gres:gpu:2", "gres:gpu:a100:1", "gres/gpu=2", "cpu=2,gres/gpu=1",
                                           "gres/gpu:a100=1", "cpu=4", "", "gres/shard=2")] == [2, 1, 2, 1, 1, 0, 0, 0]
    # 23.11 writes `--gpus-per-task` with colons (tests/fixtures/slurm/squeue_v2311_gpus_per_task_running.json)
    assert [task_request_gpus(t) for t in ("gres/gpu:2", "cpu:2,gres/gpu:1", "gres/gpu:a100:1", "cpu:4")] == [2, 1, 1, 0]
