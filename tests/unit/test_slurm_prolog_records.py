"""Jobs that ran between two polls on part of a node get their GPUs from the records
deploy/slurm/gpuledger-prolog-slurmctld writes at their allocation (PrologSlurmctld, `allocated_at=` then
`scontrol show job -d`). Real records of Slurm 22.05.8 (tests/fixtures/slurm/prolog/v2205: 1 `--gres=gpu:3`, 2
`-N 2 --gres=gpu:8` (scontrol groups the two nodes: `Nodes=gpu[02-03]`), 4 `--gres=shard:2` (`shard:2(IDX:3)`))
and of Slurm 24.11.5 (prolog/v2411, with that cluster's squeue and node records after all four had ended:
`squeue_v2411_between_polls`, `nodes_v2411_between_polls`): 1 `--gres=gpu:3` (2 s), 2 `-N 2 --gres=gpu:2`, 3
`--gres=shard:2`, 4 `--gres=mps:50`; recorded 2026-12-07 on scripts/slurm/cluster.sh's cluster, whose
PrologSlurmctld is that script (tests/fixtures/slurm/README.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from gpuledger.agents.slurm import (
    AgentState,
    JobState,
    RecordedAllocation,
    SlurmInputError,
    node_gpu_counts,
    parse_jobs,
    parse_recorded_allocation,
    translate,
)
from gpuledger.agents.slurm_agent import RECORD_MAX_AGE_S, AllocationRecords, SlurmAgent
from slurm_fixtures import load
from slurm_sink import JobEventSink

PROLOG = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "prolog"
SQUEUE, NODES = load("squeue_v2411_between_polls"), load("nodes_v2411_between_polls")
#: what each 24.11 job held: (node, GPU index, thousandths of the GPU)
HELD = {"1": [("gpu01", 0, 1000), ("gpu01", 1, 1000), ("gpu01", 2, 1000)],
        "2": [("gpu01", 3, 1000), ("gpu01", 4, 1000), ("gpu02", 0, 1000), ("gpu02", 1, 1000)],
        "3": [("gpu01", 5, 500)], "4": [("gpu04", 0, 500)]}
UNSEEN = "GPU indices not seen (the job ran between polls)"


def allocations(recorded=None) -> dict[str, tuple[str | None, list[tuple[str, int, int]]]]:
    """Each job's `allocated` event (reason, GPUs) from one poll of the 24.11 cluster after all four ended."""
    poll_ms = max(j.end_ms for j in parse_jobs(SQUEUE).jobs) + 2000
    result = translate(SQUEUE, AgentState(), cluster="gpuledger", poll_started_ms=poll_ms, node_gpus=node_gpu_counts(NODES),
                       recorded=recorded)
    return {e.job_id: (e.reason, [(g.node, g.gpu_index, g.share_milli) for g in e.gpus])
            for e in result.events if e.kind.value == "allocated"}


def test_records_of_each_version_read_as_squeue_shows_a_running_job():
    one, two, shard = (parse_recorded_allocation((PROLOG / "v2205" / f"{n}.0").read_text()) for n in (1, 2, 4))
    assert one == RecordedAllocation(1, 0, 1796644579000, ["gpu01"], ["gpu:a100:3(IDX:0-2)"])
    assert (two.nodes, two.gres_detail) == (["gpu02", "gpu03"], ["gpu:a100:8(IDX:0-7)"] * 2)  # one line, two nodes
    assert shard.gres_detail == ["shard:2(IDX:3)"]
    newer = parse_recorded_allocation((PROLOG / "v2411" / "2.0").read_text())
    assert (newer.raw_id, newer.attempt, newer.nodes) == (2, 0, ["gpu01", "gpu02"])
    assert newer.gres_detail == ["gpu:a100:2(IDX:3-4)", "gpu:a100:2(IDX:0-1)"]
    assert parse_recorded_allocation((PROLOG / "v2411" / "3.0").read_text()).gres_detail == [
        "shard:2(0/4,0/4,0/4,0/4,0/4,2/4,0/4,0/4)"]


def test_a_start_time_in_epoch_seconds_is_the_allocations_time():
    """The script asks scontrol with SLURM_TIME_FORMAT=%s: StartTime is then Slurm's start_time, which the
    events carry; a record with local times (as the recorded ones) falls back on allocated_at."""
    text = (PROLOG / "v2411" / "1.0").read_text()
    local = re.search(r"StartTime=(\S+)", text)[1]
    assert parse_recorded_allocation(text).allocated_ms == 1796644625000
    assert parse_recorded_allocation(text.replace(f"StartTime={local}", "StartTime=1796644626")).allocated_ms == 1796644626000


@pytest.mark.parametrize("text", ["", "allocated_at=1\n", "JobId=1 Restarts=0\n",
                                  "allocated_at=soon\nJobId=1 JobName=x\n Restarts=0\n"])
def test_anything_else_is_no_record(text):
    with pytest.raises(SlurmInputError, match="not a PrologSlurmctld record"):
        parse_recorded_allocation(text)


def test_without_records_part_of_a_node_gets_no_gpus_with_them_what_it_held(tmp_path):
    assert allocations() == {"1": (UNSEEN, []), "2": (UNSEEN, []), "3": (UNSEEN, []), "4": (UNSEEN, [])}
    records = AllocationRecords(PROLOG / "v2411")
    got = allocations(records.lookup)
    assert {job: gpus for job, (_, gpus) in got.items()} == HELD
    assert {reason for reason, _ in got.values()} == {f"{UNSEEN}; recorded at its allocation by PrologSlurmctld"}


@pytest.mark.parametrize("change, why", [
    ({"nodes": ["gpu03"], "gres_detail": ["gpu:a100:3(IDX:0-2)"]}, "another node"),
    ({"allocated_ms": 1796644625000 - 61_000}, "a minute before its start: another job of that id"),
    ({"attempt": 1}, "another attempt"),
])
def test_a_record_that_is_not_the_attempts_own_is_left_with_a_warning(change, why):
    own = parse_recorded_allocation((PROLOG / "v2411" / "1.0").read_text())
    wrong = RecordedAllocation(**{**own.__dict__, **change})
    poll_ms = max(j.end_ms for j in parse_jobs(SQUEUE).jobs) + 2000
    result = translate(SQUEUE, AgentState(), cluster="gpuledger", poll_started_ms=poll_ms, node_gpus=node_gpu_counts(NODES),
                       recorded=lambda raw_id, attempt: wrong if raw_id == 1 else None)
    (event,) = [e for e in result.events if e.job_id == "1" and e.kind.value == "allocated"]
    assert (event.reason, event.gpus) == (UNSEEN, []), why
    assert any("PrologSlurmctld record of job 1" in w and "not used" in w for w in result.warnings), result.warnings


def test_a_job_seen_running_keeps_its_indices_from_squeue():
    """The record is read only for an attempt whose indices no poll saw."""
    asked = []
    running = json.loads(json.dumps(SQUEUE))
    for job in running["jobs"]:
        job.update(job_state=["RUNNING"], gres_detail=["gpu:a100:3(IDX:5-7)"] if job["job_id"] == 1 else job["gres_detail"])
    result = translate(running, AgentState(), cluster="gpuledger", poll_started_ms=1796644626000,
                       node_gpus=node_gpu_counts(NODES), recorded=lambda *key: asked.append(key))
    (event,) = [e for e in result.events if e.job_id == "1" and e.kind.value == "allocated"]
    assert [g.gpu_index for g in event.gpus] == [5, 6, 7] and (1, 0) not in asked


def test_a_job_running_without_indices_in_squeue_takes_the_record_at_once():
    """squeue can show a job RUNNING before its gres_detail: without a record it is allocated no GPU until a
    poll shows them (and gets none if it ends first); with one, the recorded GPUs at once."""
    running = json.loads(json.dumps(SQUEUE))
    for job in running["jobs"]:
        job.update(job_state=["RUNNING"])
    records = AllocationRecords(PROLOG / "v2411")

    def allocated(recorded):
        result = translate(running, AgentState(), cluster="gpuledger", poll_started_ms=1796644626000,
                           node_gpus=node_gpu_counts(NODES), recorded=recorded)
        return {e.job_id: (e.reason, [(g.node, g.gpu_index, g.share_milli) for g in e.gpus])
                for e in result.events if e.kind.value == "allocated"}

    assert allocated(None)["2"] == ("GPU indices not in gres_detail", [])
    got = allocated(records.lookup)
    assert {job: gpus for job, (_, gpus) in got.items()} == HELD
    assert got["3"][0] == "GPU indices not in gres_detail; recorded at its allocation by PrologSlurmctld"


def test_an_attempt_started_and_requeued_between_two_polls_gets_its_recorded_gpus():
    """Job 1 pending at one poll; at the next, pending again with restart count 1 (it ran from 625 and was
    requeued at 627, both between the polls): with its record, attempt 0 is allocated its 3 GPUs at 625 and
    preempted at the requeue; without one (or with one from before the last poll), only `retried`."""
    def job1(restarts: int, submit: int) -> dict:
        view = json.loads(json.dumps(SQUEUE))
        view["jobs"] = [j for j in view["jobs"] if j["job_id"] == 1]
        view["jobs"][0].update(job_state=["PENDING"], restart_cnt=restarts, nodes="", gres_detail=[],
                               submit_time={"set": True, "infinite": False, "number": submit},
                               start_time={"set": True, "infinite": False, "number": 0})
        return view

    def polls(recorded):
        first = translate(job1(0, 1796644624), AgentState(), cluster="gpuledger", poll_started_ms=1796644624500,
                          node_gpus=node_gpu_counts(NODES), recorded=recorded)
        second = translate(job1(1, 1796644627), first.state, cluster="gpuledger", poll_started_ms=1796644630000,
                           node_gpus=node_gpu_counts(NODES), recorded=recorded)
        return [(e.kind.value, e.attempt, e.ts_ms, [g.gpu_index for g in e.gpus]) for e in second.events]

    assert polls(AllocationRecords(PROLOG / "v2411").lookup) == [
        ("allocated", 0, 1796644625000, [0, 1, 2]), ("started", 0, 1796644625000, []),
        ("preempted", 0, 1796644627000, []), ("retried", 1, 1796644627000, [])]
    assert polls(None) == [("retried", 1, 1796644627000, [])]
    own = parse_recorded_allocation((PROLOG / "v2411" / "1.0").read_text())
    earlier = RecordedAllocation(**{**own.__dict__, "allocated_ms": own.allocated_ms - 120_000})
    assert polls(lambda raw_id, attempt: earlier) == [("retried", 1, 1796644627000, [])]


class RecordedSlurm:
    def __call__(self, argv, timeout_s, env=None):
        if argv[0] == "squeue":
            return json.dumps(SQUEUE)
        if argv[0] == "sinfo":
            return json.dumps({"sinfo": []})  # grouped, as 24.11 writes it: the nodes come from scontrol
        if argv[:3] == ["scontrol", "show", "nodes"]:
            return json.dumps(NODES)
        if argv[:2] == ["scontrol", "show"]:
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        raise AssertionError(f"unexpected command {argv}")


def test_the_agent_uses_the_records_then_removes_them(tmp_path):
    records = tmp_path / "allocations"
    shutil.copytree(PROLOG / "v2411", records)
    (records / "7.0").write_text((PROLOG / "v2411" / "1.0").read_text().replace("JobId=1 ", "JobId=7 "))  # not polled yet
    (records / ".9.0.4242").write_text("allocated_at=1\n")  # a temporary file the script left
    os.utime(records / ".9.0.4242", (0, 0))
    sink = JobEventSink()
    agent = SlurmAgent(cluster="gpuledger", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=RecordedSlurm(),
                       clock=lambda: 1796644630, records=AllocationRecords(records))
    assert agent.poll_once()
    held = {e.job_id: [(g.node, g.gpu_index, g.share_milli) for g in e.gpus] for e in sink.events
            if e.kind.value == "allocated"}
    assert held == HELD
    # used (and the jobs ended): removed; a job no poll has seen keeps its record; a stale temporary file goes
    assert sorted(p.name for p in records.iterdir()) == ["7.0"]


def test_prune_keeps_what_a_later_poll_may_need(tmp_path):
    state = AgentState()
    raw = {"10": (10, 1, False), "11": (11, 0, True), "12": (12, 2, True)}  # job: raw id, attempt, allocated
    for job_id, (raw_id, attempt, allocated) in raw.items():
        state.jobs[job_id] = JobState(raw_id=raw_id, attempt=attempt, allocated=allocated)
    names = ["10.0", "10.1", "11.0", "12.1", "12.2", "13.0", "14.0", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    os.utime(tmp_path / "14.0", (0, 0))  # older than RECORD_MAX_AGE_S, never seen
    now = (tmp_path / "13.0").stat().st_mtime + 1
    assert AllocationRecords(tmp_path, clock=lambda: now).prune(state) == 5
    # 10.1: its attempt, not allocated yet; 13.0: a job no poll has seen, recent; notes.txt: not a record, recent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10.1", "13.0", "notes.txt"]
    assert RECORD_MAX_AGE_S >= 86400


def test_a_directory_it_cannot_read_or_change_costs_the_poll_nothing(tmp_path, caplog):
    missing = AllocationRecords(tmp_path / "none")
    assert missing.lookup(1, 0) is None and missing.prune(AgentState()) == 0
    (tmp_path / "1.0").mkdir()  # not a file: read fails
    assert AllocationRecords(tmp_path).lookup(1, 0) is None
    (tmp_path / "2.0").write_text("garbage")
    records = AllocationRecords(tmp_path)
    assert records.lookup(2, 0) is None and records.lookup(2, 0) is None
    assert sum("not used" in r.getMessage() for r in caplog.records) == 1  # said once

