"""GPUs Slurm counts in use that no job holds (agents/slurm.py `gpus_held_by_no_job`, the agent's
`gpuledger_scheduler_gpus_held_by_no_job`), on real output of Slurm 22.05.8 (tests/fixtures/slurm/README.md,
`*_held_by_no_job.json`): a 2-GPU job ended on gpu01 while slurmctld was down and another was started there
as soon as it was back; after both ended gpu01 still counted GPUs 0-1 in use (`GresUsed=gpu:a100:2(IDX:0-1)`),
while a 1-GPU job ran on gpu01 and a 3-GPU job on gpu02. `*_freed_by_restart.json`: the same jobs after
the next controller restart, which freed them."""

from __future__ import annotations

import copy
import logging

from gpuledger.agents.slurm import gpus_held_by_no_job, parse_jobs
from gpuledger.agents.slurm_agent import UNHELD_POLLS, SlurmAgent
from slurm_sink import JobEventSink
from slurm_fixtures import FIXTURES, load


def recorded(moment: str) -> tuple[dict, dict]:
    return load(f"squeue_{moment}"), load(f"sinfo_{moment}")


def test_the_recorded_leak_is_found_and_held_gpus_are_not():
    squeue, sinfo = recorded("held_by_no_job")
    used = {n["name"]: n["gres_used"] for n in sinfo["nodes"]}
    assert used["gpu01"].startswith("gpu:a100:3") and used["gpu02"].startswith("gpu:a100:3"), used
    assert gpus_held_by_no_job(sinfo, parse_jobs(squeue)) == {"gpu01": [0, 1]}
    squeue, sinfo = recorded("freed_by_restart")
    assert gpus_held_by_no_job(sinfo, parse_jobs(squeue)) == {}


def test_a_node_with_a_job_completing_or_unlisted_is_not_judged():
    squeue, sinfo = recorded("held_by_no_job")
    for change in ({"job_state": "COMPLETING"}, {"job_state": "CONFIGURING"}, {"gres_detail": []}):
        changed = copy.deepcopy(squeue)
        for job in changed["jobs"]:
            if job["nodes"] == "gpu01" and job["job_state"] == "RUNNING":
                job.update(change)
        assert gpus_held_by_no_job(sinfo, parse_jobs(changed)) == {}, change


def test_an_unreadable_job_record_judges_no_node():
    squeue, sinfo = recorded("held_by_no_job")
    squeue["jobs"].append({"job_id": 99, "job_state": "RUNNING", "nodes": "gpu03", "gres_detail": "gpu:1"})  # unreadable
    parsed = parse_jobs(squeue)
    assert parsed.warnings and gpus_held_by_no_job(sinfo, parsed) == {}


class RecordedSlurm:
    def __init__(self):
        self.moment = "held_by_no_job"

    def __call__(self, argv, timeout_s, env=None):
        if argv[0] in ("squeue", "sinfo"):
            return (FIXTURES / f"{argv[0]}_{self.moment}.json").read_text()
        if argv[0] == "scontrol":
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        raise AssertionError(f"unexpected command {argv}")


def test_the_agent_counts_them_after_three_polls_logs_once_and_forgets_them_when_freed(tmp_path, caplog):
    slurm = RecordedSlurm()
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=JobEventSink(), partitions=1, run=slurm,
                       clock=lambda: 1_796_100_000.0)
    caplog.set_level(logging.INFO, logger="gpuledger.agents.slurm")
    counted = []
    for _ in range(UNHELD_POLLS + 1):
        assert agent.poll_once()
        counted.append(agent.stats()["gpus_held_by_no_job"])
    assert counted == [0] * (UNHELD_POLLS - 1) + [2, 2]
    warned = [r.getMessage() for r in caplog.records if "no job in squeue holding them" in r.getMessage()]
    assert len(warned) == 1 and "GPU(s) 0,1 of node gpu01" in warned[0], warned
    slurm.moment = "freed_by_restart"
    assert agent.poll_once() and agent.stats()["gpus_held_by_no_job"] == 0
    assert any("gpu01: Slurm no longer counts" in r.getMessage() for r in caplog.records)
