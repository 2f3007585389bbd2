"""An attempt whose GPU indices the Slurm agent never saw (it ran between two polls, or while the
agent was down) and that held every GPU of its nodes is given all of them (agents/slurm.py
`whole_node_detail`): its GPU count (squeue's tres_alloc_str, sacct's AllocTRES) equals the GPUs of
its nodes in sinfo. One that held part of a node still gets none: which indices is not known.

The squeue/sinfo output is the recorded one of tests/fixtures/slurm (4 nodes gpu01-gpu04 of 8 A100):
prod job 9 (`--gres=gpu:8`, all of gpu01) ran from …052 to …072; skipping the poll that saw it run
(`*_preempted.json`) is a poll interval longer than the job. The sacct rows are written as the agent
asks for them (`-P -n --duplicates -X`, epoch seconds) with the AllocTRES column it asks for now."""

from __future__ import annotations

import json

import pytest

from gpuledger.agents.slurm import (
    AgentState,
    close_vanished,
    node_gpu_counts,
    translate,
    whole_node_detail,
)
from gpuledger.agents.slurm_agent import SlurmAgent, parse_sacct
from gpuledger.schemas.models import JobEvent, JobEventKind
from slurm_sink import JobEventSink
from slurm_fixtures import FIXTURES, load

TIERS = {"batch": 1, "prod": 10}
POLL_MS = {"running": 1796084022_300, "pending": 1796084039_800, "requeued": 1796084042_100,
           "preempted": 1796084056_400, "rerun": 1796084074_900}
#: the polls of test_slurm.py without `preempted`: job 9 starts and ends between two of them
MISSED_JOB_9 = ["running", "pending", "requeued", "rerun"]
ALL_GPUS_OF_GPU01 = [("gpu01", i) for i in range(8)]


def squeue(step: str) -> dict:
    return load(f"squeue_{step}")


def sinfo(step: str) -> dict:
    return load(f"sinfo_{step}")


def gpus(event: JobEvent) -> list[tuple[str, int]]:
    return [(g.node, g.gpu_index) for g in event.gpus]


def gpu_seconds(events: list[JobEvent], job_id: str) -> float:
    """Allocated GPU-seconds of a job as the worker bills them: each `allocated` holds its GPUs until
    the attempt's next `allocated` or its end."""
    total, held = 0.0, None
    for e in sorted((e for e in events if e.job_id == job_id), key=lambda e: e.ts_ms):
        if held is not None and (e.kind == JobEventKind.allocated or e.kind in (
                JobEventKind.completed, JobEventKind.failed, JobEventKind.cancelled, JobEventKind.preempted)):
            total += len(held[0]) * (e.ts_ms - held[1]) / 1000
            held = None
        if e.kind == JobEventKind.allocated:
            held = (e.gpus, e.ts_ms)
    return total


def run_polls(steps: list[str], *, with_sinfo: bool) -> list[JobEvent]:
    state, events = AgentState(), []
    for step in steps:
        r = translate(squeue(step), state, cluster="c", poll_started_ms=POLL_MS[step], tiers=TIERS,
                      node_gpus=node_gpu_counts(sinfo(step)) if with_sinfo else None)
        events += r.events
        state = r.state
    return events


# --------------------------------------------------------------------------- the rule
def test_whole_nodes_are_told_from_the_gpu_count_and_part_of_a_node_is_not_guessed():
    counts = node_gpu_counts(sinfo("rerun"))
    assert counts == {"gpu01": 8, "gpu02": 8, "gpu03": 8, "gpu04": 8}  # by node name (every `hostname` is 'vm')
    assert whole_node_detail(["gpu01"], 8, counts) == ["gpu:8(IDX:0-7)"]
    assert whole_node_detail(["gpu01", "gpu02"], 16, counts) == ["gpu:8(IDX:0-7)", "gpu:8(IDX:0-7)"]
    assert whole_node_detail(["gpu01"], 3, counts) is None          # part of the node: which 3?
    assert whole_node_detail(["gpu01", "gpu02"], 8, counts) is None  # 8 of 16: 4 + 4, 8 + 0, ...?
    assert whole_node_detail(["gpu09"], 8, counts) is None          # a node sinfo does not list
    assert whole_node_detail(["gpu01", "gpu01"], 16, counts) is None
    assert whole_node_detail([], 8, counts) is None and whole_node_detail(["gpu01"], 0, counts) is None
    mixed = {"big": 8, "small": 4, "cpu1": 0}
    assert whole_node_detail(["big", "small", "cpu1"], 12, mixed) == ["gpu:8(IDX:0-7)", "gpu:4(IDX:0-3)", ""]


# --------------------------------------------------------------------------- live: ran between two polls
def test_a_job_that_held_a_whole_node_between_two_polls_is_billed_its_gpus():
    before = run_polls(MISSED_JOB_9, with_sinfo=False)   # what the agent did without sinfo's GPUs per node
    after = run_polls(MISSED_JOB_9, with_sinfo=True)
    alloc_before = next(e for e in before if e.event_id == "slurm:c:9:0:allocated")
    alloc_after = next(e for e in after if e.event_id == "slurm:c:9:0:allocated")
    assert gpus(alloc_before) == [] and gpu_seconds(before, "9") == 0.0
    assert gpus(alloc_after) == ALL_GPUS_OF_GPU01
    assert {g.container_id for g in alloc_after.gpus} == {"slurm-job-9"}
    assert alloc_after.ts_ms == 1796084052_000                    # its start_time, as before
    assert gpu_seconds(after, "9") == 160.0                        # sacct: gres/gpu=8 × Elapsed 20 s
    assert alloc_after.reason == ("GPU indices not seen (the job ran between polls); the job held all 8 GPUs of "
                                  "gpu01 (whole nodes: squeue's gres/gpu=8, their GPUs in sinfo)")
    # the same events, the same ids: only job 9's allocation carries GPUs now
    assert [e.event_id for e in before] == [e.event_id for e in after]
    changed = [a.event_id for a, b in zip(after, before) if a != b]
    assert changed == ["slurm:c:9:0:allocated"]


def test_a_job_that_held_part_of_a_node_between_two_polls_still_gets_no_gpu():
    after = run_polls(MISSED_JOB_9, with_sinfo=True)
    alloc = next(e for e in after if e.event_id == "slurm:c:5:0:allocated")  # 1 GPU of gpu01, exit 3
    assert gpus(alloc) == [] and alloc.reason == "GPU indices not seen (the job ran between polls)"


def test_the_live_path_with_gpu_indices_is_unchanged():
    steps = ["running", "pending", "requeued", "preempted", "rerun"]
    assert run_polls(steps, with_sinfo=True) == run_polls(steps, with_sinfo=False)


def test_replays_give_the_same_events():
    state = AgentState()
    for step in MISSED_JOB_9[:-1]:
        state = translate(squeue(step), state, cluster="c", poll_started_ms=POLL_MS[step], tiers=TIERS,
                          node_gpus=node_gpu_counts(sinfo(step))).state
    # an agent that crashed after spooling and reads its state file back emits the poll again
    read_back = AgentState.from_json(json.loads(json.dumps(state.to_json())))
    once, again = (translate(squeue("rerun"), s, cluster="c", poll_started_ms=POLL_MS["rerun"], tiers=TIERS,
                             node_gpus=node_gpu_counts(sinfo("rerun"))) for s in (state, read_back))
    assert once.events == again.events and once.state.to_json() == again.state.to_json()
    assert gpus(next(e for e in once.events if e.event_id == "slurm:c:9:0:allocated")) == ALL_GPUS_OF_GPU01


class FakeSlurm:
    """The recorded output, one step a poll; sacct answers `sacct` (only the columns asked for)."""

    def __init__(self, steps: list[str]):
        self.steps = list(steps)
        self.step = self.steps[0]
        self.drop: set[int] = set()
        self.sacct = ""
        self.sacct_argv: list[str] = []

    def __call__(self, argv, timeout_s, env=None):
        if argv[0] == "squeue":
            doc = squeue(self.step)
            doc["jobs"] = [j for j in doc["jobs"] if j["job_id"] not in self.drop]
            return json.dumps(doc)
        if argv[0] == "sinfo":
            return (FIXTURES / f"sinfo_{self.step}.json").read_text()
        if argv[0] == "scontrol":
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        assert argv[0] == "sacct"
        if "-j" in argv:  # the query for known jobs (not the one for jobs that came and went while no poll ran)
            self.sacct_argv = list(argv)
        columns = argv[argv.index("-o") + 1].split(",")
        return "".join("|".join(line.split("|")[:len(columns)]) + "\n" for line in self.sacct.splitlines())


def test_the_agent_reads_the_gpus_per_node_from_sinfo(tmp_path):
    slurm, sink = FakeSlurm(MISSED_JOB_9), JobEventSink()
    clock = [0.0]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0])
    for step in MISSED_JOB_9:
        slurm.step, clock[0] = step, POLL_MS[step] / 1000
        assert agent.poll_once()
    alloc = next(e for e in sink.events if e.event_id == "slurm:c:9:0:allocated")
    assert gpus(alloc) == ALL_GPUS_OF_GPU01 and gpu_seconds(sink.events, "9") == 160.0


# --------------------------------------------------------------------------- sacct: ran while the agent was down
#: job 8 (`-N 4 --gres=gpu:8`), seen PENDING, then ran and ended while the agent was down
SACCT_8 = "8|8|COMPLETED|1796084040|1796084052|0:0|teama|batch|gpu[01-04]|billing=4,cpu=4,gres/gpu=32,mem=16000M,node=4\n"


def close_8(sacct: str, node_gpus):
    state = translate(squeue("pending"), AgentState(), cluster="c", poll_started_ms=POLL_MS["pending"],
                      tiers=TIERS).state
    events, state, warnings = close_vanished(["8"], state, parse_sacct(sacct), cluster="c",
                                             lost_at_ms=1796090000_000, promised_ms=state.watermark_ms,
                                             node_gpus=node_gpus)
    return events, warnings


def test_a_job_that_held_whole_nodes_while_the_agent_was_down_is_billed_them_from_sacct():
    nodes = node_gpu_counts(sinfo("pending"))
    before, _ = close_8(SACCT_8, None)
    after, warnings = close_8(SACCT_8, nodes)
    assert [e.event_id for e in after] == [e.event_id for e in before] == [
        "slurm:c:8:0:allocated", "slurm:c:8:0:started", "slurm:c:8:0:completed"]
    assert gpus(before[0]) == [] and gpu_seconds(before, "8") == 0.0
    assert gpus(after[0]) == [(f"gpu0{n}", i) for n in range(1, 5) for i in range(8)]
    assert gpu_seconds(after, "8") == 384.0   # sacct: gres/gpu=32 × Elapsed 12 s
    assert after[0].reason == ("GPU indices not seen (the job ran while the agent was down); the job held all 32 "
                               "GPUs of gpu01, gpu02, gpu03, gpu04 (whole nodes: sacct's AllocTRES gres/gpu=32, "
                               "their GPUs in sinfo)")
    assert warnings == []


@pytest.mark.parametrize("sacct", [
    SACCT_8.replace("gres/gpu=32", "gres/gpu=16"),                     # 4 of each node's 8: which 4?
    SACCT_8.rsplit("|", 1)[0] + "\n",                                  # no AllocTRES (not asked: earlier agents)
    SACCT_8.replace("gres/gpu=32,", ""),                               # AccountingStorageTRES without gres/gpu
])
def test_part_of_a_node_or_no_gpu_count_in_sacct_still_gets_no_gpu(sacct):
    events, _ = close_8(sacct, node_gpu_counts(sinfo("pending")))
    assert gpus(events[0]) == [] and events[0].reason.startswith("GPU indices not seen (")
    assert "whole nodes" not in events[0].reason


def test_a_whole_node_job_shrunk_while_the_agent_was_down_keeps_the_node_it_kept():
    """sacct's RESIZING row (agents/slurm.py `_attempt_groups`): 2 whole nodes from …040, gpu01 alone
    from the resize at …046 to the end at …052."""
    sacct = ("8|8|RESIZING|1796084040|1796084046|0:0|teama|batch|gpu[01-02]|cpu=2,gres/gpu=16,node=2\n"
             "8|8|COMPLETED|1796084040|1796084052|0:0|teama|batch|gpu01|cpu=1,gres/gpu=8,node=1\n")
    events, _ = close_8(sacct, node_gpu_counts(sinfo("pending")))
    assert [(e.event_id.removeprefix("slurm:c:8:0:"), len(e.gpus)) for e in events] == [
        ("allocated", 16), ("started", 0), ("allocated:2", 8), ("started:resized:2", 0), ("completed", 0)]
    assert gpus(events[2]) == ALL_GPUS_OF_GPU01 and events[2].ts_ms == 1796084046_000
    assert gpu_seconds(events, "8") == 16 * 6 + 8 * 6


def test_the_agent_asks_sacct_for_alloctres_and_bills_the_whole_nodes(tmp_path):
    slurm, sink = FakeSlurm(["pending"]), JobEventSink()
    slurm.sacct = SACCT_8
    clock = [POLL_MS["pending"] / 1000]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0])
    assert agent.poll_once()
    slurm.drop, clock[0] = {8}, clock[0] + 3600   # job 8 ran and left squeue while the agent was down
    assert agent.poll_once()
    assert slurm.sacct_argv[slurm.sacct_argv.index("-o") + 1].endswith(",NodeList,AllocTRES,Submit")
    alloc = next(e for e in sink.events if e.event_id == "slurm:c:8:0:allocated")
    assert len(alloc.gpus) == 32 and gpu_seconds(sink.events, "8") == 384.0


# --------------------------------------------------------------------------- requeued twice between two polls
RV_SINFO = {"nodes": [{"name": f"rv0{n}", "gres": "gpu:a100:8", "partitions": ["batch"]} for n in range(1, 5)]}
T = 1796537000


def job_10(attempt: int, submit: int, start: int, gres: list[str]) -> dict:
    """An 8-GPU batch job on rv01 as Slurm 22.05's squeue writes it (tests/unit/test_slurm_requeue_resize.py's
    job 10, on a whole node)."""
    return {"job_id": 10, "job_state": "RUNNING", "state_reason": "None", "account": "teama", "partition": "batch",
            "priority": 10000, "restart_cnt": attempt, "submit_time": T + submit, "start_time": T + start,
            "end_time": T + start + 31536000, "nodes": "rv01", "gres_detail": gres, "exit_code": 0,
            "tres_req_str": "cpu=1,node=1,billing=1,gres/gpu=8", "tres_alloc_str": "cpu=1,node=1,billing=1,gres/gpu=8",
            "array_job_id": 0, "array_task_id": None, "array_task_string": "", "last_sched_evaluation": T + submit}


def test_an_attempt_that_ran_between_two_requeues_is_billed_its_whole_node():
    sacct = parse_sacct("10|10|REQUEUED|1796537183|1796537186|0:0|teama|batch|rv01|cpu=1,gres/gpu=8,node=1\n"
                        "10|10|REQUEUED|1796537198|1796537201|0:0|teama|batch|rv01|cpu=1,gres/gpu=8,node=1\n"
                        "10|10|RUNNING|1796537212|Unknown|0:0|teama|batch|rv01|cpu=1,gres/gpu=8,node=1\n")
    state = translate({"jobs": [job_10(0, 183, 183, ["gpu:a100:8(IDX:0-7)"])]}, AgentState(), cluster="c",
                      poll_started_ms=(T + 185) * 1000).state
    after = [translate({"jobs": [job_10(2, 201, 212, ["gpu:a100:8(IDX:0-7)"])]}, state, cluster="c",
                       poll_started_ms=(T + 217) * 1000, accounting=sacct, node_gpus=node_gpus).events
             for node_gpus in (None, node_gpu_counts(RV_SINFO))]
    for events, held in zip(after, (0, 8)):
        attempt_1 = next(e for e in events if e.event_id == "slurm:c:10:1:allocated")
        assert len(attempt_1.gpus) == held and attempt_1.ts_ms == (T + 198) * 1000
    assert gpus(next(e for e in after[1] if e.event_id == "slurm:c:10:1:allocated")) == [("rv01", i) for i in range(8)]
    assert [e.event_id for e in after[0]] == [e.event_id for e in after[1]]
