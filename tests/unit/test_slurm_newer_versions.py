"""The Slurm agent on real output of Slurm 24.11.5 (data_parser v0.0.42; Debian trixie), 26.05.5 (v0.0.45;
Debian testing, forky), 23.11.11 (v0.0.40), 25.05.8 (v0.0.43) and 25.11.7 (v0.0.44; all three built from SchedMD's source), each
recorded in a chroot (tests/fixtures/slurm/README.md, `*_v2411_*.json`, `*_v2605_*.json`, `*_v2311_*.json`,
`*_v2505_*.json`, `*_v2511_*.json`; scripts/slurm/newer_slurm.sh record), and 23.02.8 (v0.0.39, from source, recorded with
slurmdbd: without it its squeue --json fails; job_state a plain string, `*_v2302_*.json`): squeue lists job_state as [base, flags...], numbers and
exit codes as objects, and `sinfo --json` groups the nodes ({"sinfo": [...]}) so the agent reads them with
`scontrol show nodes --json`. The same story on both: 1 (2 GPUs) completes, 2 exits 3, 3 is cancelled, array 4
(4_0-4_2, 1 GPU each), 5 on gpu[02-03] (4 GPUs each, srun), a 2-GPU job requeued with `scontrol requeue` and run
again, the whole cluster (4 × 8 GPUs) pending, then running, then requeued by prod job 10 (8 GPUs) and run again.
The array's tasks take job ids of their own when they start, so the last two jobs' ids differ: 8 and 9 in the
24.11 recording, 6 and 7 in the others."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from gpuledger.agents.slurm import (
    AgentState,
    SlurmInputError,
    build_snapshot,
    gpus_held_by_no_job,
    gres_request_gpus,
    node_gpu_counts,
    parse_jobs,
    translate,
)
from gpuledger.agents.slurm_agent import SlurmAgent
from slurm_fixtures import load
from slurm_sink import JobEventSink

TIERS = {"batch": 1, "prod": 10}


@dataclass(frozen=True)
class Recording:
    tag: str  # the fixtures' version tag
    #: the recorded moments, and the watermark the agent published at each (poll start less its 1-s margin)
    moments: dict[str, int]
    requeued: str  # the job requeued by hand
    whole: str  # the whole-cluster job

    def load(self, kind: str, moment: str) -> dict:
        return load(f"{kind}_{self.tag}_{moment}")


RECORDINGS = {
    "23.02": Recording("v2302", {"running": 1796634530000, "changed": 1796634534000, "whole": 1796634607000,
                                 "preempted": 1796634609000, "done": 1796634632000}, requeued="6", whole="7"),
    "23.11": Recording("v2311", {"running": 1796632413000, "changed": 1796632417000, "whole": 1796632492000,
                                 "preempted": 1796632496000, "done": 1796632515000}, requeued="6", whole="7"),
    "24.11": Recording("v2411", {"running": 1796594292000, "changed": 1796594297000, "whole": 1796594370000,
                                 "preempted": 1796594372000, "done": 1796594395000}, requeued="8", whole="9"),
    "26.05": Recording("v2605", {"running": 1796606125000, "changed": 1796606129000, "whole": 1796606199000,
                                 "preempted": 1796606202000, "done": 1796606226000}, requeued="6", whole="7"),
    "25.05": Recording("v2505", {"running": 1796644050000, "changed": 1796644054000, "whole": 1796644128000,
                                 "preempted": 1796644130000, "done": 1796644154000}, requeued="6", whole="7"),
    "25.11": Recording("v2511", {"running": 1796632533000, "changed": 1796632538000, "whole": 1796632608000,
                                 "preempted": 1796632611000, "done": 1796632632000}, requeued="6", whole="7"),
}
V2411 = RECORDINGS["24.11"]


@pytest.mark.parametrize("version", RECORDINGS)
def test_list_valued_states_numbers_and_exit_objects_read_as_slurm_22_05_wrote_them(version):
    rec = RECORDINGS[version]
    jobs = {j.job_id: j for j in parse_jobs(rec.load("squeue", "changed")).jobs}
    assert {k: j.state for k, j in jobs.items()} == {
        "1": "RUNNING", "2": "FAILED", "3": "CANCELLED", "4_0": "RUNNING", "4_1": "RUNNING", "4_2": "RUNNING",
        "5": "RUNNING", rec.requeued: "PENDING", rec.whole: "PENDING"}
    assert (jobs["2"].exit_code, jobs["3"].exit_code) == (3 << 8, 15)  # exit 3; SIGTERM
    assert jobs[rec.requeued].attempt == 1 and jobs[rec.requeued].reason == "BeginTime"
    assert jobs["5"].nodes == ["gpu02", "gpu03"] and jobs["5"].gres_detail == ["gpu:a100:4(IDX:0-3)"] * 2
    assert (jobs["4_1"].array_job_id, jobs["4_1"].array_task_id) == (4, 1)


@pytest.mark.parametrize("version", RECORDINGS)
def test_the_recorded_story_gives_each_attempt_its_outcome_reason_and_gpus(version):
    rec = RECORDINGS[version]
    requeued, whole = rec.requeued, rec.whole
    state, events, snapshots = AgentState(), [], {}
    for moment, watermark_ms in rec.moments.items():
        squeue, nodes = rec.load("squeue", moment), rec.load("nodes", moment)
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
        ("2", 0): ("failed", "exit 3"), ("3", 0): ("cancelled", "signal 15"), (requeued, 0): ("preempted", "requeued"),
        ("1", 0): ("completed", None), ("4_0", 0): ("completed", None), ("4_1", 0): ("completed", None),
        ("4_2", 0): ("completed", None), ("5", 0): ("completed", None), (requeued, 1): ("completed", None),
        (whole, 0): ("preempted", "requeued to reclaim resources for job 10"), ("10", 0): ("completed", None),
        (whole, 1): ("completed", None)}
    gpus = {(j, a): n for j, a, k, _, n in events if k == "allocated"}
    assert gpus == {("1", 0): 2, ("2", 0): 1, ("3", 0): 2, ("4_0", 0): 1, ("4_1", 0): 1, ("4_2", 0): 1,
                    ("5", 0): 8, (requeued, 0): 2, (whole, 0): 32, ("10", 0): 8, (whole, 1): 32,
                    (requeued, 1): 0}  # ran between two recorded moments: 2 of a node's 8, indices not seen
    # the whole-cluster job's rerun also ran between two moments: `-N 4 --gres=gpu:8` is every GPU of its 4
    # nodes (whole nodes), read from its per-node request: no accounting, so its TRES strings carry no GPUs
    assert snapshots["running"] == {"batch": (32.0, 18.0, 1, 32.0), "prod": (32.0, 0.0, 0, 0.0)}
    assert snapshots["whole"]["batch"] == (32.0, 32.0, 0, 0.0)


def test_slurm_23_02_without_accounting_fails_the_poll_and_takes_no_job_for_gone():
    """23.02's `squeue --json` on a cluster without slurmdbd (recorded: eight jobs submitted, `--gpus-per-task`)
    lists one job and an error ("loading QOS for parser failed"): the poll fails instead of reading a partial
    list, so the seven jobs it leaves out do not end."""
    squeue = load("squeue_v2302_no_accounting")
    assert len(squeue["jobs"]) == 1 and squeue["meta"]["plugins"]["accounting_storage"] == "accounting_storage/none"
    with pytest.raises(SlurmInputError, match="squeue reported errors.*slurmdb_qos_get"):
        translate(squeue, AgentState(), cluster="gpuledger", poll_started_ms=1796634470000, tiers=TIERS)


def _whole_jobs_requeue(rec: Recording, **prod_job) -> tuple[str | None, str | None]:
    """The recorded story to its `preempted` moment, prod job 10 changed by `prod_job` (times in seconds as
    Slurm writes them, added to the recorded ones): the whole-cluster job's requeue reason and preemptor."""
    state = AgentState()
    for moment in ("running", "changed", "whole", "preempted"):
        squeue = rec.load("squeue", moment)
        for job in squeue["jobs"]:
            if job["job_id"] == 10:
                for key, delta_s in prod_job.items():
                    job[key]["number"] += delta_s
        result = translate(squeue, state, cluster="gpuledger", poll_started_ms=rec.moments[moment] + 1000, tiers=TIERS,
                           node_gpus=node_gpu_counts(rec.load("nodes", moment)))
        state = result.state
    (ended,) = [e for e in result.events if e.job_id == rec.whole and e.kind.value == "preempted"]
    (fired,) = [p for p in state.preemptions if p["job_id"] == rec.whole]
    return ended.reason, fired["by_job_id"]


def test_the_preemptor_is_named_when_it_starts_after_the_requeue():
    """Slurm 23.11 started prod job 10 2 s after it requeued the whole-cluster job 7 (its submit_time, the
    requeue time): the victim's processes end first (KillWait). The other versions started it in the same second.
    A job submitted after the requeue did not cause it, nor did one that started more than 40 s after it."""
    v2311 = RECORDINGS["23.11"]
    assert _whole_jobs_requeue(v2311) == ("requeued to reclaim resources for job 10", "10")
    assert _whole_jobs_requeue(v2311, start_time=30) == ("requeued to reclaim resources for job 10", "10")
    assert _whole_jobs_requeue(v2311, start_time=45) == ("requeued", None)
    assert _whole_jobs_requeue(v2311, submit_time=2) == ("requeued", None)
    for version in ("25.05", "25.11"):
        assert _whole_jobs_requeue(RECORDINGS[version]) == ("requeued to reclaim resources for job 10", "10")


def test_a_requeue_waits_for_a_preemptor_that_has_not_started_yet():
    """A poll in the 2 s between 23.11's requeue of job 7 and prod job 10's start sees job 7 pending again and
    job 10 still pending: the requeue is told at the next poll, with its preemptor, and the watermark waits at
    the requeue's time meanwhile. 40 s after the requeue, or with no job of a higher tier pending, it is told
    at once (`requeued`, no preemptor)."""
    rec = RECORDINGS["23.11"]

    def poll(squeue, state, at_ms):
        return translate(squeue, state, cluster="gpuledger", poll_started_ms=at_ms, tiers=TIERS,
                         node_gpus=node_gpu_counts(rec.load("nodes", "preempted")))

    state = AgentState()
    for moment in ("running", "changed", "whole"):
        state = poll(rec.load("squeue", moment), state, rec.moments[moment] + 1000).state
    preempted = rec.load("squeue", "preempted")
    (victim,) = [j for j in preempted["jobs"] if j["job_id"] == 7]
    requeue_ms = victim["submit_time"]["number"] * 1000
    between = rec.load("squeue", "preempted")
    for job in between["jobs"]:
        if job["job_id"] == 10:  # as squeue showed it before it started
            job.update(job_state=["PENDING"], state_reason="Resources", nodes="", gres_detail=[])
            job["start_time"]["number"] = 0

    def told(result):
        return [(e.reason, [p["by_job_id"] for p in result.state.preemptions if p["job_id"] == "7"])
                for e in result.events if e.job_id == "7" and e.kind.value == "preempted"]

    waiting = poll(between, state, requeue_ms + 1000)
    assert told(waiting) == [] and waiting.watermark.ts_ms == requeue_ms
    assert told(poll(preempted, waiting.state, rec.moments["preempted"] + 1000)) == [
        ("requeued to reclaim resources for job 10", ["10"])]
    assert told(poll(between, state, requeue_ms + 41_000)) == [("requeued", [None])]
    for job in between["jobs"]:
        if job["job_id"] == 10:  # a batch job: the same tier as job 7's, so not its preemptor
            job["partition"] = "batch"
    assert told(poll(between, state, requeue_ms + 1000)) == [("requeued", [None])]


def test_a_job_between_polls_that_asked_gpus_per_job_is_inferred_as_whole_nodes_too():
    """Job 9's rerun, recorded with `-N 4 --gres=gpu:8`, as if submitted `-N 4 --gpus=32` (tres_per_job):
    its 32 GPUs are every GPU of its 4 nodes either way. As `--gpus=16` its count is 16: part of its nodes,
    which is never inferred (tests/unit/test_slurm_whole_node.py)."""
    state = AgentState()
    for moment in ("preempted", "done"):
        squeue = V2411.load("squeue", moment)
        for job in squeue["jobs"]:
            if job["job_id"] == 9:
                job.update(tres_per_node="", tres_per_job="gres/gpu:32")
        result = translate(squeue, state, cluster="gpuledger", poll_started_ms=V2411.moments[moment] + 1000, tiers=TIERS,
                           node_gpus=node_gpu_counts(V2411.load("nodes", moment)))
        state = result.state
    (rerun,) = [e for e in result.events if e.job_id == "9" and e.kind.value == "allocated"]
    assert rerun.attempt == 1 and len(rerun.gpus) == 32
    squeue = V2411.load("squeue", "done")
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
    """squeue, sinfo (grouped, as 24.11 and 26.05 write it) and scontrol show nodes of one recorded moment."""

    def __init__(self, rec: Recording):
        self.rec, self.asked = rec, []

    def __call__(self, argv, timeout_s, env=None):
        self.asked.append(" ".join(argv[:3]))
        if argv[0] == "squeue":
            return json.dumps(self.rec.load("squeue", "running"))
        if argv[0] == "sinfo":
            return json.dumps(self.rec.load("sinfo", "running"))
        if argv[:3] == ["scontrol", "show", "nodes"]:
            return json.dumps(self.rec.load("nodes", "running"))
        if argv[:2] == ["scontrol", "show"]:
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        raise AssertionError(f"unexpected command {argv}")


@pytest.mark.parametrize("version", RECORDINGS)
def test_the_agent_reads_the_nodes_with_scontrol_once_sinfo_groups_them(tmp_path, version):
    rec = RECORDINGS[version]
    slurm, sink = RecordedSlurm(rec), JobEventSink()
    agent = SlurmAgent(cluster="gpuledger", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: rec.moments["running"] / 1000 + 1)
    assert agent.poll_once() and agent.poll_once()
    assert [a for a in slurm.asked if a.startswith(("sinfo", "scontrol show nodes"))] == [
        "sinfo --json", "scontrol show nodes", "scontrol show nodes"]  # sinfo asked once
    assert len([e for e in sink.events if e.kind.value == "allocated"]) == 8
