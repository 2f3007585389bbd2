"""The Slurm agent on Slurm output it must survive: bytes that are not UTF-8, GPUs on non-adjacent
sockets, job records it cannot read, the number objects of Slurm 23.02+ JSON, and a job submitted to
several partitions (tests/fixtures/slurm/README.md says where each fixture comes from)."""

from __future__ import annotations

import copy
import sys

import pytest

from gpuledger.agents.slurm import AgentState, SlurmInputError, build_snapshot, gpu_count, parse_jobs, translate
from gpuledger.agents.slurm_agent import SlurmAgent, run_command
from slurm_fixtures import FIXTURES, load

POLL_RUNNING_MS, POLL_PENDING_MS = 1796084022_300, 1796084039_800


def squeue(step: str) -> dict:
    return load(f"squeue_{step}")


# --------------------------------------------------------------------------- bytes that are not UTF-8
def test_run_command_replaces_bytes_that_are_not_utf8():
    out = run_command([sys.executable, "-c", r"import sys; sys.stdout.buffer.write(b'caf\xe9 ok')"], 10)
    assert out == "caf\ufffd ok"


class _Sink:
    def __init__(self):
        self.keys: list[str] = []

    def put(self, line, key, value, partition=None):
        if line == "job-events" and key:
            self.keys.append(key)


def test_a_job_name_that_is_not_utf8_does_not_stop_the_poll(tmp_path):
    """Real squeue output (Slurm 22.05.8) with a job named b'caf\\xe9' (sbatch -J $'caf\\xe9'), read
    through run_command as the agent does: every job is published, the poll counts as done."""
    recorded = {"squeue": FIXTURES / "squeue_het_raw_bytes.json", "sinfo": FIXTURES / "sinfo_running.json"}
    assert b"caf\xe9" in recorded["squeue"].read_bytes()

    def run(argv, timeout_s, env=None):
        if argv[0] == "scontrol":
            return ""
        script = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())"
        return run_command([sys.executable, "-c", script, str(recorded[argv[0]])], timeout_s, env)

    sink = _Sink()
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "state.json", sink=sink, partitions=1, run=run,
                       clock=lambda: 1796476870.0)
    assert agent.poll_once() and agent.failures == 0
    assert set(sink.keys) == {"1", "2", "3", "4", "5", "6", "7"}


# --------------------------------------------------------------------------- GPUs on sockets
@pytest.mark.parametrize("gres, gpus", [
    ("gpu:a100:8(S:0,2)", 8),                      # GPUs on sockets 0 and 2: the comma is inside (...)
    ("gpu:a100:4(S:0,2),gpu:t4:2(S:1)", 6),
    ("gpu:a100:4(S:0-1),gpu:v100:4(S:2,3),mps:100", 8),
    ("gpu:4,gpu:t4:2(S:0)", 6),
])
def test_gpu_count_of_gpus_on_non_adjacent_sockets(gres, gpus):
    assert gpu_count(gres) == gpus


def test_snapshot_quota_counts_gpus_on_non_adjacent_sockets():
    nodes = load("sinfo_running")
    nodes["nodes"][0]["gres"] = "gpu:a100:8(S:0,2)"
    snap = build_snapshot(squeue("running"), nodes, cluster="c", ts_ms=1)
    assert {q.queue: q.quota_gpus for q in snap.queues} == {"batch": 32, "prod": 32}


# --------------------------------------------------------------------------- records that cannot be read
def _unreadable(doc: dict, job_id: int) -> dict:
    doc = copy.deepcopy(doc)
    for job in doc["jobs"]:
        if job["job_id"] == job_id:
            job["nodes"] = "gpu[01-"  # not a hostlist
    return doc


def test_a_tracked_job_whose_record_cannot_be_read_is_not_gone():
    state = translate(squeue("running"), AgentState(), cluster="c", poll_started_ms=POLL_RUNNING_MS).state
    state = translate(squeue("pending"), state, cluster="c", poll_started_ms=POLL_PENDING_MS).state
    assert not state.jobs["7"].finished
    r = translate(_unreadable(squeue("pending"), 7), state, cluster="c", poll_started_ms=POLL_PENDING_MS + 5000)
    assert r.vanished == [] and any("hostlist" in w for w in r.warnings)
    assert "7" in r.state.jobs and not r.state.jobs["7"].finished
    # a finished job's unreadable record is not forgotten either (it would be published again)
    r = translate(_unreadable(squeue("pending"), 1), state, cluster="c", poll_started_ms=POLL_PENDING_MS + 5000)
    assert "1" in r.state.jobs
    # readable again: it carries on where it was, nothing closed on the way
    again = translate(squeue("pending"), r.state, cluster="c", poll_started_ms=POLL_PENDING_MS + 6000)
    assert again.events == [] and again.vanished == []


def test_a_record_without_a_readable_job_id_makes_no_job_gone():
    state = translate(squeue("pending"), AgentState(), cluster="c", poll_started_ms=POLL_PENDING_MS).state
    doc = squeue("pending")
    doc["jobs"] = [j for j in doc["jobs"] if j["job_id"] != 7] + [{"job_id": "seven", "job_state": "RUNNING"}]
    r = translate(doc, state, cluster="c", poll_started_ms=POLL_PENDING_MS + 5000)
    assert r.vanished == [] and "7" in r.state.jobs
    assert any("no job counts as gone" in w for w in r.warnings)


def test_output_of_which_no_record_can_be_read_fails_the_poll():
    doc = squeue("pending")
    for job in doc["jobs"]:
        job["submit_time"] = "yesterday"
    with pytest.raises(SlurmInputError, match=r"none of the 8 job records .* could be read"):
        parse_jobs(doc)
    assert parse_jobs({"jobs": []}).jobs == []  # an empty queue is fine


def test_number_objects_of_slurm_23_02_read_as_plain_numbers():
    """Slurm 23.02+ (openapi v0.0.39 on) writes times, priority and array task ids as
    {"set": true, "infinite": false, "number": N}, and v0.0.40 the exit code as an object: the
    derived fixture translates exactly as the recorded one it was made from."""
    plain = parse_jobs(squeue("pending")).jobs
    objects = parse_jobs(squeue("pending_v0039"))
    assert objects.warnings == [] and objects.jobs == plain
    assert {j.job_id: j.exit_code for j in plain}["5"] == 768  # exit 3, as a raw wait status
    signalled = {"job_id": 9, "job_state": "CANCELLED",
                 "exit_code": {"status": ["SIGNALED"], "return_code": {"set": False, "infinite": False, "number": 0},
                               "signal": {"id": {"set": True, "infinite": False, "number": 15}, "name": "TERM"}}}
    assert parse_jobs({"jobs": [signalled]}).jobs[0].exit_code == 15
    unset = {"job_id": 9, "job_state": "PENDING", "start_time": {"set": False, "infinite": False, "number": 0}}
    assert parse_jobs({"jobs": [unset]}).jobs[0].start_ms == 0
    # Slurm 23.11 on lists the base state and its flags: named as 22.05 named them (job_state_string's order)
    for listed, named in ((["RUNNING"], "RUNNING"), (["PENDING", "REQUEUED"], "REQUEUED"),
                          (["COMPLETED", "COMPLETING"], "COMPLETING"), (["RUNNING", "CONFIGURING"], "CONFIGURING"),
                          (["CANCELLED", "COMPLETING", "REQUEUED"], "COMPLETING"), (["RUNNING", "UPDATE_DB"], "RUNNING")):
        assert parse_jobs({"jobs": [{"job_id": 9, "job_state": listed}]}).jobs[0].state == named, listed
    # anything else is not read, and said so, rather than taken for no state
    with pytest.raises(SlurmInputError, match="job_state is"):
        parse_jobs({"jobs": [{"job_id": 9, "job_state": {"current": ["RUNNING"]}}]})


# --------------------------------------------------------------------------- several partitions
def _multi_partition_job(state: str, partition: str, start: int = 0, gres: tuple = (), nodes: str = "") -> dict:
    """Job 3, submitted with `-p prod,batch`: Slurm 22.05 lists both partitions while it pends,
    the one it runs in once it runs."""
    return {"job_id": 3, "job_state": state, "state_reason": "Resources" if state == "PENDING" else "None",
            "account": "teamc", "partition": partition, "priority": 100, "restart_cnt": 0,
            "submit_time": 1796084000, "start_time": start, "end_time": 0, "nodes": nodes, "gres_detail": list(gres),
            "exit_code": 0, "tres_req_str": "cpu=1,node=1,billing=1,gres/gpu=1", "array_job_id": 0,
            "array_task_id": None, "array_task_string": "", "last_sched_evaluation": 1796084000}


@pytest.mark.parametrize("runs_in", ["prod", "batch"])
def test_a_job_submitted_to_several_partitions_waits_in_the_first_listed(runs_in):
    """Its queue is one partition, never the list: the first listed while it waits (where the
    snapshot counts it), the one it runs in from its allocation on."""
    pending = {"jobs": [_multi_partition_job("PENDING", "prod,batch")]}
    first = translate(pending, AgentState(), cluster="c", poll_started_ms=1796084001_000)
    assert [(e.kind, e.queue) for e in first.events] == [("submitted", "prod"), ("queued", "prod")]
    sinfo = load("sinfo_running")
    snap = build_snapshot(pending, sinfo, cluster="c", ts_ms=1796084001_000)
    assert {q.queue: q.pending_jobs for q in snap.queues} == {"batch": 0, "prod": 1}
    running = {"jobs": [_multi_partition_job("RUNNING", runs_in, 1796084050, ["gpu:a100:1(IDX:0)"], "gpu01")]}
    later = translate(running, first.state, cluster="c", poll_started_ms=1796084060_000)
    assert [(e.kind, e.queue) for e in later.events] == [("allocated", runs_in), ("started", runs_in)]


@pytest.mark.parametrize("cluster", ["../../etc/east", " east", "x" * 129])
def test_a_cluster_name_the_settings_refuse_is_a_usage_error(cluster, capsys, tmp_path, monkeypatch):
    """`--cluster` is held to GPULEDGER_CLUSTER's rule before anything runs: '../../etc/east' named the
    spool DATA_DIR/spool/slurm-agent-.._.._etc_east and every event carried it."""
    from gpuledger.agents.slurm_agent import main

    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        main(["--cluster", cluster, "--once", "--print", "--metrics-port", "0"])
    assert exc.value.code == 2 and "--cluster" in capsys.readouterr().err
