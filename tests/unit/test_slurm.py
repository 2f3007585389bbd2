"""The Slurm agent's pure core (agents/slurm.py) and its poll step (agents/slurm_agent.py) on
recorded real Slurm 22.05 output (tests/fixtures/slurm/README.md says how it was recorded)."""

from __future__ import annotations

import copy
import json

import pytest

from gpuledger.agents.slurm import (
    REQUEUE_WAIT_POLLS,
    AgentState,
    SacctRow,
    SlurmInputError,
    build_snapshot,
    close_vanished,
    decode_exit_code,
    describe_exit,
    expand_hostlist,
    gpu_count,
    gpu_indices,
    partition_tiers,
    tres_gpus,
    translate,
)
from gpuledger.agents.slurm_agent import CommandFailed, PrintSink, SlurmAgent, load_state, parse_sacct, save_state
from gpuledger.schemas.models import JobEvent, LifecycleWatermark, SchedulerSnapshot
from gpuledger.schemas.wire import decode
from slurm_fixtures import FIXTURES, load

STEPS = ["running", "pending", "requeued", "preempted", "rerun"]
TIERS = {"batch": 1, "prod": 10}
#: agent clock at each recorded poll: a little after the latest Slurm timestamp in it
POLL_MS = {"running": 1796084022_300, "pending": 1796084039_800, "requeued": 1796084042_100,
           "preempted": 1796084056_400, "rerun": 1796084074_900}


def squeue(step: str) -> dict:
    return load(f"squeue_{step}")


def sinfo(step: str) -> dict:
    return load(f"sinfo_{step}")


def run_steps(steps=STEPS, state: AgentState | None = None, round_trip: bool = False):
    state = state or AgentState()
    results = {}
    for step in steps:
        if round_trip:  # what an agent restarted between polls reads back from its state file
            state = AgentState.from_json(json.loads(json.dumps(state.to_json())))
        r = translate(squeue(step), state, cluster="c", poll_started_ms=POLL_MS[step], tiers=TIERS)
        results[step] = r
        state = r.state
    return results, state


def ids(result) -> list[str]:
    return [e.event_id for e in result.events]


def _with_stale_requeue(doc: dict) -> dict:
    """squeue_requeued as squeue can show it for a moment: job 7's new restart count with its old
    submit_time (seen on a real cluster: the requeue 4 s after it, its submit_time not yet moved)."""
    doc = copy.deepcopy(doc)
    job = next(j for j in doc["jobs"] if str(j["job_id"]) == "7")
    old = 1796084036
    job["submit_time"] = {**job["submit_time"], "number": old} if isinstance(job["submit_time"], dict) else old
    return doc


def test_a_requeue_shown_before_its_new_submit_time_waits_for_it():
    _, state = run_steps(["running", "pending"])
    promised = state.watermark_ms
    stale = translate(_with_stale_requeue(squeue("requeued")), state, cluster="c",
                      poll_started_ms=POLL_MS["requeued"], tiers=TIERS)
    assert not [e for e in stale.events if e.job_id == "7"]  # no guess at the requeue time
    assert stale.watermark.ts_ms == promised                  # and nothing promised past it
    later = translate(squeue("requeued"), stale.state, cluster="c", poll_started_ms=POLL_MS["requeued"] + 1000,
                      tiers=TIERS)
    by_id = {e.event_id: e for e in later.events}
    assert by_id["slurm:c:7:0:preempted"].ts_ms == 1796084040_000  # sacct: End 00:14:00
    assert by_id["slurm:c:7:1:retried"].ts_ms == 1796084040_000


def test_a_requeue_whose_submit_time_never_moves_ends_at_the_poll_that_first_saw_it():
    _, state = run_steps(["running", "pending"])
    promised = state.watermark_ms
    doc = _with_stale_requeue(squeue("requeued"))
    for n in range(REQUEUE_WAIT_POLLS + 1):
        r = translate(doc, state, cluster="c", poll_started_ms=POLL_MS["requeued"] + 1000 * n, tiers=TIERS)
        state = r.state
        ends = [e for e in r.events if e.event_id == "slurm:c:7:0:preempted"]
        if n < REQUEUE_WAIT_POLLS:
            assert not ends and r.watermark.ts_ms == promised
            assert r.needs_sacct == ["7"]  # sacct's row of the attempt ends at the requeue: asked
    # the requeue happened by the first poll that saw it (not at the watermark promised before: that
    # billed the attempt less than it held); late rather than never, never behind the watermark
    assert [e.ts_ms for e in ends] == [POLL_MS["requeued"]] and POLL_MS["requeued"] > promised
    (retried,) = [e for e in r.events if e.event_id == "slurm:c:7:1:retried"]
    assert retried.ts_ms == POLL_MS["requeued"]  # never before the requeue (squeue's stale submit_time was)


# --------------------------------------------------------------------------- a finished job requeued
def _job_42(state: str, attempt: int, submit: int, start: int = 0, end: int = 0, gres: tuple = (),
            nodes: str = "", reason: str = "None") -> dict:
    """A hand-made squeue record of batch job 42 (2 GPUs), as Slurm 22.05 writes one."""
    return {"job_id": 42, "job_state": state, "state_reason": reason, "account": "teama", "partition": "batch",
            "priority": 100, "restart_cnt": attempt, "submit_time": submit, "start_time": start, "end_time": end,
            "nodes": nodes, "gres_detail": list(gres), "exit_code": 0,
            "tres_req_str": "cpu=1,node=1,billing=1,gres/gpu=2", "array_job_id": 0, "array_task_id": None,
            "array_task_string": "", "last_sched_evaluation": submit}


T42 = 1796090000
#: (agent clock in s, the record) of each poll: attempt 0 runs and completes, `scontrol requeue 42`
#: (Slurm: PENDING, restart_cnt 1, submit_time = the requeue time), attempt 1 runs and completes
REQUEUED_AFTER_IT_FINISHED = [
    (T42 + 5, _job_42("RUNNING", 0, T42, T42 + 1, T42 + 1000, ["gpu:a100:2(IDX:0-1)"], "gpu01")),
    (T42 + 20, _job_42("COMPLETED", 0, T42, T42 + 1, T42 + 15, [], "gpu01")),
    (T42 + 30, _job_42("PENDING", 1, T42 + 25, reason="BeginTime")),
    (T42 + 60, _job_42("RUNNING", 1, T42 + 25, T42 + 50, T42 + 2000, ["gpu:a100:2(IDX:2-3)"], "gpu01")),
    (T42 + 90, _job_42("COMPLETED", 1, T42 + 25, T42 + 50, T42 + 85, [], "gpu01")),
]


def test_a_job_requeued_after_it_finished_gets_its_next_attempt():
    """`scontrol requeue` of a finished batch job (or RequeueExit) keeps its id and runs it again:
    the new attempt is retried, allocated its GPUs and ended; the old one keeps its outcome."""
    state, polls = AgentState(), []
    for now, record in REQUEUED_AFTER_IT_FINISHED:
        state = AgentState.from_json(json.loads(json.dumps(state.to_json())))  # through the state file
        r = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000)
        polls.append([(e.event_id.removeprefix("slurm:c:42:"), e.ts_ms // 1000 - T42) for e in r.events])
        state = r.state
    assert polls[1] == [("0:completed", 15)]
    assert polls[2] == [("1:retried", 25), ("1:queued", 25)]  # no `preempted`: attempt 0 had its outcome
    assert polls[3] == [("1:allocated", 50), ("1:started", 50)]
    assert polls[4] == [("1:completed", 85)]
    assert state.jobs["42"].finished and state.jobs["42"].attempt == 1
    again = translate({"jobs": [REQUEUED_AFTER_IT_FINISHED[-1][1]]}, state, cluster="c",
                      poll_started_ms=(T42 + 95) * 1000)
    assert again.events == []


def test_a_finished_job_requeue_shown_before_its_new_submit_time_waits_for_it():
    state = AgentState()
    for now, record in REQUEUED_AFTER_IT_FINISHED[:2]:
        state = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000).state
    promised = state.watermark_ms
    stale = translate({"jobs": [_job_42("PENDING", 1, T42, reason="BeginTime")]}, state, cluster="c",
                      poll_started_ms=(T42 + 29) * 1000)
    assert stale.events == [] and stale.watermark.ts_ms == promised  # no retry before attempt 0's end
    now, record = REQUEUED_AFTER_IT_FINISHED[2]
    r = translate({"jobs": [record]}, stale.state, cluster="c", poll_started_ms=now * 1000)
    assert [(e.event_id, e.ts_ms) for e in r.events][0] == ("slurm:c:42:1:retried", (T42 + 25) * 1000)


def test_a_finished_job_requeued_between_two_polls_gets_its_next_attempt():
    """Requeued, run and finished again between two polls: retried, the allocation without GPU
    indices (not seen), the outcome."""
    state = AgentState()
    for now, record in REQUEUED_AFTER_IT_FINISHED[:2]:
        state = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000).state
    now, record = REQUEUED_AFTER_IT_FINISHED[-1]
    r = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000)
    assert [e.event_id.removeprefix("slurm:c:42:") for e in r.events] == [
        "1:retried", "1:allocated", "1:started", "1:completed"]


def test_a_forgotten_finished_job_that_reappears_requeued_gets_only_its_new_attempt():
    """A finished job that left squeue is forgotten; should it come back requeued (Slurm purges a
    job before it can be requeued, so this takes squeue output that hid it), the new attempt is
    published as a job first seen, and nothing of attempt 0 again."""
    state = AgentState()
    for now, record in REQUEUED_AFTER_IT_FINISHED[:2]:
        state = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000).state
    state = translate({"jobs": []}, state, cluster="c", poll_started_ms=(T42 + 22) * 1000).state
    assert "42" not in state.jobs
    emitted = []
    for now, record in REQUEUED_AFTER_IT_FINISHED[2:]:
        r = translate({"jobs": [record]}, state, cluster="c", poll_started_ms=now * 1000)
        emitted += [e.event_id.removeprefix("slurm:c:42:") for e in r.events]
        state = r.state
    assert emitted == ["1:submitted", "1:queued", "1:allocated", "1:started", "1:completed"]

# --------------------------------------------------------------------------- parsers
@pytest.mark.parametrize("expr, names", [
    ("gpu01", ["gpu01"]),
    ("gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"]),
    ("gpu[01-02,07]", ["gpu01", "gpu02", "gpu07"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("a1,b[1-2]", ["a1", "b1", "b2"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu[01-02],cpu[1,3]-ib", ["gpu01", "gpu02", "cpu1-ib", "cpu3-ib"]),
    ("", []),
    ("(null)", []),
])
def test_expand_hostlist(expr, names):
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize("expr", ["gpu[01-", "gpu01]", "gpu[03-01]", "gpu[a-b]", "gpu[1,,2]"])
def test_expand_hostlist_rejects_nonsense(expr):
    with pytest.raises(SlurmInputError):
        expand_hostlist(expr)


@pytest.mark.parametrize("detail, indices", [
    ("gpu:a100:3(IDX:0-2)", [0, 1, 2]),
    ("gpu:a100:1(IDX:5)", [5]),
    ("gpu:2(IDX:0,3)", [0, 3]),
    ("gpu:a100:2(IDX:0-1),gpu:v100:1(IDX:4)", [0, 1, 4]),
    ("gpu:a100:8(IDX:0-7)", list(range(8))),
    ("gpu:a100:0(IDX:N/A)", []),
    ("mps:100(0/100,0/100)", []),
    ("", []),
])
def test_gpu_indices(detail, indices):
    assert gpu_indices(detail) == indices


@pytest.mark.parametrize("raw, decoded, text", [
    (0, (0, None), "exit 0"), (768, (3, None), "exit 3"), (256, (1, None), "exit 1"),
    (15, (None, 15), "signal 15"), (9, (None, 9), "signal 9"), (None, (None, None), None),
])
def test_exit_codes_are_raw_wait_statuses(raw, decoded, text):
    assert decode_exit_code(raw) == decoded
    assert describe_exit(raw) == text


def test_gpu_counts_from_gres_and_tres():
    assert gpu_count("gpu:a100:8") == 8
    assert gpu_count("gpu:4,gpu:t4:2(S:0)") == 6
    assert gpu_count("gpu") == 1
    assert gpu_count("") == 0 and gpu_count("mps:100") == 0
    assert tres_gpus("cpu=4,node=4,billing=4,gres/gpu=32") == 32
    assert tres_gpus("cpu=1,gres/gpu:a100=2,gres/gpu:v100=1") == 3
    assert tres_gpus("cpu=1") == 0


def test_partition_tiers_from_scontrol():
    text = ("PartitionName=batch AllowGroups=ALL Default=YES PriorityJobFactor=1 PriorityTier=1 Nodes=gpu[01-04]\n"
            "PartitionName=prod AllowGroups=ALL Default=NO PriorityJobFactor=1 PriorityTier=10 Nodes=gpu[01-04]\n")
    assert partition_tiers(text) == {"batch": 1, "prod": 10}


# --------------------------------------------------------------------------- translation
def test_running_jobs_multi_node_and_array():
    r = translate(squeue("running"), AgentState(), cluster="c", poll_started_ms=POLL_MS["running"], tiers=TIERS)
    assert not r.warnings and not r.vanished
    by_id = {e.event_id: e for e in r.events}
    assert set(by_id) == {f"slurm:c:{j}:0:{k}" for j in ("1", "2", "3_0", "3_1")
                          for k in ("submitted", "allocated", "started")}
    multi = by_id["slurm:c:2:0:allocated"]
    assert [(g.node, g.gpu_index) for g in multi.gpus] == [("gpu01", 3), ("gpu01", 4), ("gpu02", 0), ("gpu02", 1)]
    assert {g.container_id for g in multi.gpus} == {"slurm-job-2"}
    assert multi.ts_ms == 1796084016_000 and multi.tenant == "teamb" and multi.queue == "batch"
    assert multi.requested_gpus == 4
    task = by_id["slurm:c:3_0:0:allocated"]
    assert task.job_id == "3_0" and [(g.node, g.gpu_index) for g in task.gpus] == [("gpu01", 5)]
    assert task.aliases == {"slurm_job_id": "4", "container_id": "slurm-job-4", "slurm_array_job_id": "3",
                            "slurm_array_task_id": "0", "slurm_priority": "4294901757"}
    # priority/basic hands out uint32 priorities; the ledger stores Int32
    assert task.priority == 2**31 - 1
    assert r.watermark == LifecycleWatermark(cluster="c", ts_ms=1796084021_000)


def test_the_whole_recorded_sequence():
    results, state = run_steps()
    pending = results["pending"]
    by_id = {e.event_id: e for e in pending.events}
    for job, ts in (("1", 1796084032_000), ("2", 1796084031_000), ("3_0", 1796084026_000), ("3_1", 1796084026_000)):
        assert by_id[f"slurm:c:{job}:0:completed"].ts_ms == ts  # Slurm's end_time, not the poll
    failed = by_id["slurm:c:5:0:failed"]
    assert failed.reason == "exit 3" and failed.ts_ms == 1796084039_000
    # job 5 ran between two polls: its GPU indices were never visible
    assert by_id["slurm:c:5:0:allocated"].gpus == []
    assert "between polls" in by_id["slurm:c:5:0:allocated"].reason
    queued = by_id["slurm:c:8:0:queued"]
    assert queued.reason == "Resources" and queued.requested_gpus == 32

    requeued = {e.event_id: e for e in results["requeued"].events}
    assert requeued["slurm:c:6:0:cancelled"].reason == "signal 15"
    end7 = requeued["slurm:c:7:0:preempted"]
    assert end7.reason == "requeued" and end7.ts_ms == 1796084040_000  # sacct: End 00:14:00
    retry7 = requeued["slurm:c:7:1:retried"]
    assert retry7.attempt == 1 and retry7.ts_ms == 1796084040_000
    assert len(requeued["slurm:c:8:0:allocated"].gpus) == 32

    preempted = {e.event_id: e for e in results["preempted"].events}
    end8 = preempted["slurm:c:8:0:preempted"]
    assert end8.ts_ms == 1796084052_000 and end8.reason == "requeued to reclaim resources for job 9"
    assert preempted["slurm:c:9:0:allocated"].queue == "prod"
    # kept for the next snapshot (the agent clears them once one carried them)
    assert results["preempted"].state.preemptions == [
        {"job_id": "7", "by_job_id": None, "queue": "batch", "rule": "requeue"},
        {"job_id": "8", "by_job_id": "9", "queue": "batch", "rule": "partition_prio/requeue"}]

    rerun = {e.event_id: e for e in results["rerun"].events}
    again = rerun["slurm:c:8:1:allocated"]
    assert again.attempt == 1 and again.ts_ms == 1796084073_000 and len(again.gpus) == 32
    assert rerun["slurm:c:9:0:completed"].ts_ms == 1796084072_000

    every = [e for r in results.values() for e in r.events]
    assert len({e.event_id for e in every}) == len(every)  # each event once over the whole run
    for r in results.values():
        for e in r.events:
            assert decode(JobEvent, e.model_dump_json().encode()) == e
    marks = [r.watermark.ts_ms for r in results.values()]
    assert marks == sorted(marks)
    assert all(e.ts_ms >= prev for r, prev in zip(list(results.values())[1:], marks)
               for e in r.events if e.kind != "submitted" and e.kind != "queued")


def test_a_poll_leaves_the_state_it_was_given_as_it_was():
    """translate works on AgentState.copy(): the caller's state (kept when a poll fails) is untouched,
    and the copy is what copy.deepcopy gives."""
    _, state = run_steps(STEPS[:3])
    before = copy.deepcopy(state)
    copied = state.copy()
    assert copied == before and copied.to_json() == before.to_json()
    translate(squeue("preempted"), state, cluster="c", poll_started_ms=POLL_MS["preempted"], tiers=TIERS)
    assert state == before
    copied.jobs["8"].nodes.append("elsewhere")
    copied.preemptions.append({"job_id": "x"})
    copied.jobs["8"].attempt += 5
    assert state == before  # nothing of the copy is shared but immutable values


def test_a_job_states_only_mutable_field_is_its_node_list():
    """AgentState.copy copies JobState's node list and shares the rest: every other field must hold
    an immutable value (a new list or dict field needs copying there too)."""
    import dataclasses
    import typing

    from gpuledger.agents.slurm import JobState

    hints = typing.get_type_hints(JobState)
    immutable = (int, bool, str, int | None, tuple[str, ...] | None)  # a tuple of strings is immutable too (gres_detail)
    mutable = {f.name for f in dataclasses.fields(JobState) if hints[f.name] not in immutable}
    assert mutable == {"nodes"}


def test_translation_is_deterministic():
    a, _ = run_steps()
    b, _ = run_steps()
    assert [ids(a[s]) for s in STEPS] == [ids(b[s]) for s in STEPS]
    assert [a[s].events for s in STEPS] == [b[s].events for s in STEPS]


def test_restart_between_every_poll_changes_nothing():
    plain, _ = run_steps()
    restarted, _ = run_steps(round_trip=True)
    assert [plain[s].events for s in STEPS] == [restarted[s].events for s in STEPS]
    assert [plain[s].watermark for s in STEPS] == [restarted[s].watermark for s in STEPS]


def test_a_repeated_poll_emits_nothing_new():
    results, state = run_steps(STEPS[:3])
    again = translate(squeue("requeued"), state, cluster="c", poll_started_ms=POLL_MS["requeued"] + 1000, tiers=TIERS)
    assert again.events == []
    assert again.watermark.ts_ms == results["requeued"].watermark.ts_ms + 1000


def test_an_agent_that_lost_its_state_re_emits_the_same_ids():
    """Starting from nothing at a later poll: whatever is re-emitted carries the ids already used,
    so the ledger drops it as duplicates."""
    results, _ = run_steps()
    before = {i for r in results.values() for i in ids(r)}
    fresh = translate(squeue("rerun"), AgentState(), cluster="c", poll_started_ms=POLL_MS["rerun"], tiers=TIERS)
    # the attempt-1 run of 8 and the finished jobs: same ids as the first time round
    assert {"slurm:c:8:1:allocated", "slurm:c:9:0:completed", "slurm:c:5:0:failed"} <= set(ids(fresh)) & before


def test_watermark_stays_below_a_completing_job_and_never_goes_back():
    data = squeue("running")
    completing = copy.deepcopy(data)
    for job in completing["jobs"]:
        if job["job_id"] == 1:
            job["job_state"], job["end_time"] = "COMPLETING", 1796084018
    r = translate(completing, AgentState(), cluster="c", poll_started_ms=POLL_MS["running"], tiers=TIERS)
    assert r.watermark.ts_ms == 1796084018_000
    assert "slurm:c:1:0:completed" not in ids(r)  # the outcome is not known yet
    later = translate(squeue("pending"), r.state, cluster="c", poll_started_ms=POLL_MS["pending"], tiers=TIERS)
    assert "slurm:c:1:0:completed" in ids(later)
    # a poll whose clock is behind the last watermark does not pull it back
    back = translate(squeue("pending"), later.state, cluster="c", poll_started_ms=POLL_MS["running"], tiers=TIERS)
    assert back.watermark.ts_ms == later.watermark.ts_ms


def test_bad_records_are_skipped_with_a_reason():
    data = squeue("running")
    data["jobs"].append({"job_id": "x", "job_state": "RUNNING"})
    data["jobs"].append("nonsense")
    data["jobs"].append({"job_id": 99, "job_state": "RUNNING", "nodes": "gpu[01-", "gres_detail": []})
    r = translate(data, AgentState(), cluster="c", poll_started_ms=POLL_MS["running"])
    assert len(r.warnings) == 3 and any("hostlist" in w for w in r.warnings)
    assert len(r.events) == 12  # the four good jobs still translate


@pytest.mark.parametrize("output", [{}, {"jobs": "x"}, [], {"jobs": [], "errors": [{"error": "boom"}]}])
def test_unusable_output_is_an_input_error(output):
    with pytest.raises(SlurmInputError):
        translate(output, AgentState(), cluster="c", poll_started_ms=1)


def test_state_file_version_is_checked():
    with pytest.raises(SlurmInputError):
        AgentState.from_json({"version": 99})


def test_vanished_jobs_close_from_sacct_or_as_lost():
    _, state = run_steps(STEPS[:2])      # 6 and 7 running, 8 pending
    sacct = parse_sacct((FIXTURES / "sacct_requeued_preempted.txt").read_text())
    assert [r.state for r in sacct["6"]] == ["CANCELLED"]
    gone = copy.deepcopy(squeue("pending"))
    gone["jobs"] = [j for j in gone["jobs"] if j["job_id"] not in (6, 8)]
    r = translate(gone, state, cluster="c", poll_started_ms=POLL_MS["requeued"], tiers=TIERS)
    assert r.vanished == ["6", "8"]
    del sacct["8"]  # sacct knows nothing of 8 (e.g. slurmdbd was down too)
    events, state2, warnings = close_vanished(r.vanished, r.state, sacct, cluster="c", lost_at_ms=1796084042_000,
                                              promised_ms=r.promised_ms)
    by_job = {e.job_id: e for e in events}
    assert by_job["6"].kind == "cancelled" and by_job["6"].ts_ms == 1796084040_000
    assert "from sacct" in by_job["6"].reason
    assert by_job["8"].kind == "failed" and by_job["8"].ts_ms == 1796084042_000 and "lost" in by_job["8"].reason
    assert len(warnings) == 1
    assert state2.jobs["6"].finished and state2.jobs["8"].finished
    # a job that was pending when the agent went down and ran entirely while it was down: allocated
    # (no GPU indices) before its end, so the worker accepts the sequence
    _, state = run_steps(STEPS[:1])
    pending = translate(squeue("pending"), state, cluster="c", poll_started_ms=POLL_MS["pending"], tiers=TIERS)
    sacct8 = {"8": [SacctRow("8", "8", "COMPLETED", 1796084040, 1796084100, "0:0", "teama", "batch")]}
    events, _, _ = close_vanished(["8"], pending.state, sacct8, cluster="c", lost_at_ms=1796084200_000,
                                promised_ms=pending.promised_ms)
    assert [(e.kind, e.ts_ms) for e in events] == [("allocated", 1796084040_000), ("started", 1796084040_000),
                                                   ("completed", 1796084100_000)]


def test_snapshots_from_recorded_output():
    _, state = run_steps(STEPS[:4])
    snap = build_snapshot(squeue("preempted"), sinfo("preempted"), cluster="c", ts_ms=1796084056_000, tiers=TIERS,
                          preemptions=state.preemptions)
    assert decode(SchedulerSnapshot, snap.model_dump_json().encode()) == snap
    q = {s.queue: s for s in snap.queues}
    assert q["batch"].quota_gpus == 32 and q["prod"].quota_gpus == 32  # the partitions share the 4 nodes
    assert q["prod"].allocated_gpus == 8 and q["prod"].priority == 10
    assert q["batch"].allocated_gpus == 0
    assert q["batch"].pending_jobs == 2 and q["batch"].pending_gpus == 34  # 7 (2 GPUs) and 8 (32) requeued
    assert [(p.job_id, p.by_job_id) for p in snap.preemptions] == [("7", None), ("8", "9")]
    running = build_snapshot(squeue("running"), sinfo("running"), cluster="c", ts_ms=1)
    assert {s.queue: s.allocated_gpus for s in running.queues} == {"batch": 9, "prod": 0}
    with pytest.raises(SlurmInputError):
        build_snapshot(squeue("running"), {"nope": 1}, cluster="c", ts_ms=1)


# --------------------------------------------------------------------------- the poll step
class FakeSlurm:
    """Answers the agent's commands from the fixtures; `down` makes them fail like a timeout."""

    def __init__(self):
        self.step = "running"
        self.down = False
        self.garbage = False
        self.calls: list[list[str]] = []

    def __call__(self, argv, timeout_s, env=None):
        self.calls.append(list(argv))
        if self.down:
            raise CommandFailed(f"{argv[0]} timed out after {timeout_s:.0f}s (is slurmctld up?)")
        if argv[0] == "squeue":
            return "{not json" if self.garbage else (FIXTURES / f"squeue_{self.step}.json").read_text()
        if argv[0] == "sinfo":
            return (FIXTURES / f"sinfo_{self.step}.json").read_text()
        if argv[0] == "scontrol":
            return "PartitionName=batch PriorityTier=1\nPartitionName=prod PriorityTier=10\n"
        if argv[0] == "sacct":
            return (FIXTURES / "sacct_requeued_preempted.txt").read_text()
        raise AssertionError(argv)


class ListSink:
    def __init__(self):
        self.messages = []

    def put(self, line, key, value, partition=None):
        self.messages.append((line, key, partition, value))

    def close(self, timeout=0):
        return 0


def make_agent(tmp_path, slurm, sink, clock_ms):
    return SlurmAgent(cluster="c", state_file=tmp_path / "state.json", sink=sink, partitions=3, run=slurm,
                      clock=lambda: clock_ms[0] / 1000)


def test_poll_publishes_events_watermarks_on_every_partition_and_a_snapshot(tmp_path):
    slurm, sink, clock = FakeSlurm(), ListSink(), [POLL_MS["running"]]
    agent = make_agent(tmp_path, slurm, sink, clock)
    assert agent.poll_once()
    events = [m for m in sink.messages if m[0] == "job-events" and m[1] is not None]
    marks = [m for m in sink.messages if m[0] == "job-events" and m[1] is None]
    snaps = [m for m in sink.messages if m[0] == "scheduler-snapshots"]
    assert len(events) == 12 and [m[2] for m in marks] == [0, 1, 2] and len(snaps) == 1
    assert {m[1] for m in events} == {"1", "2", "3_0", "3_1"}  # keyed by canonical job id
    assert snaps[0][1] == "c"
    assert decode(LifecycleWatermark, marks[0][3]).ts_ms == 1796084021_000
    assert sink.messages.index(marks[0]) > max(sink.messages.index(m) for m in events)  # events first
    assert load_state(tmp_path / "state.json").watermark_ms == 1796084021_000


def test_a_restarted_agent_neither_loses_nor_repeats(tmp_path):
    slurm, clock = FakeSlurm(), [0]
    seen: list[str] = []
    for i, step in enumerate(STEPS):
        sink = ListSink()
        agent = make_agent(tmp_path, slurm, sink, clock)  # a new agent process for every poll
        slurm.step, clock[0] = step, POLL_MS[step]
        assert agent.poll_once()
        seen += [decode(JobEvent, m[3]).event_id for m in sink.messages if m[0] == "job-events" and m[1]]
    reference, _ = run_steps()
    assert seen == [i for s in STEPS for i in ids(reference[s])]


def test_a_failing_or_garbled_slurm_is_counted_and_survived(tmp_path):
    slurm, sink, clock = FakeSlurm(), ListSink(), [POLL_MS["running"]]
    agent = make_agent(tmp_path, slurm, sink, clock)
    slurm.down = True
    assert not agent.poll_once()
    slurm.down, slurm.garbage = False, True
    assert not agent.poll_once()
    assert agent.failures == 2 and sink.messages == [] and not (tmp_path / "state.json").exists()
    slurm.garbage = False
    assert agent.poll_once() and len(sink.messages) == 16
    assert agent.stats() == {"watermark_timestamp_seconds": 1796084021, "events_published": 12, "jobs_tracked": 4,
                             "polls": 1, "poll_failures": 2,
                             "state_bytes_written": (tmp_path / "state.json").stat().st_size, "gpus_held_by_no_job": 0}


def test_a_poll_runs_with_the_cyclic_collector_paused_and_restores_it(tmp_path):
    """slurm_agent.gc_paused: off while the poll reads and works out Slurm's output (bench/slurm.py:
    0.6 s a poll at 100,000 GPUs against 1.0 s with it on), back as it was afterwards, also when the
    poll fails."""
    import gc

    slurm, sink, clock = FakeSlurm(), ListSink(), [POLL_MS["running"]]
    seen: list[bool] = []

    def run(argv, timeout_s, env=None):
        seen.append(gc.isenabled())
        return slurm(argv, timeout_s, env)

    agent = make_agent(tmp_path, run, sink, clock)
    assert gc.isenabled()
    assert agent.poll_once() and seen and not any(seen) and gc.isenabled()
    slurm.down = True
    assert not agent.poll_once() and gc.isenabled()
    gc.disable()
    try:
        slurm.down = False
        assert agent.poll_once() and not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def test_state_file_is_replaced_atomically(tmp_path):
    path = tmp_path / "s" / "state.json"
    _, state = run_steps(STEPS[:2])
    save_state(path, state)
    assert load_state(path).to_json() == state.to_json()
    assert not path.with_name("state.json.tmp").exists()
    path.write_text("{broken")
    with pytest.raises(SystemExit, match="cannot read state file"):
        load_state(path)


def test_print_sink_writes_replayable_dump_lines(capsys):
    import io

    out = io.StringIO()
    sink = PrintSink(out)
    sink.put("job-events", None, b'{"a":1}', partition=0)
    sink.put("job-events", None, b'{"a":1}', partition=1)   # a broadcast watermark is printed once
    sink.put("job-events", "7", b'{"b":2}')
    from gpuledger.embedded.replay import parse_dump_line
    lines = [parse_dump_line(line) for line in out.getvalue().splitlines()]
    assert [(d.topic, d.key) for d in lines] == [("job-events", None), ("job-events", "7")]


def test_a_configuring_job_without_gpu_indices_waits_and_holds_the_watermark():
    data = squeue("running")
    configuring = copy.deepcopy(data)
    for job in configuring["jobs"]:
        if job["job_id"] == 1:
            job["job_state"], job["gres_detail"] = "CONFIGURING", []
    r = translate(configuring, AgentState(), cluster="c", poll_started_ms=POLL_MS["running"], tiers=TIERS)
    assert "slurm:c:1:0:allocated" not in ids(r) and "slurm:c:1:0:submitted" in ids(r)
    assert r.watermark.ts_ms == 1796084016_000  # the start the allocation will carry
    later = translate(data, r.state, cluster="c", poll_started_ms=POLL_MS["running"] + 2000, tiers=TIERS)
    alloc = {e.event_id: e for e in later.events}["slurm:c:1:0:allocated"]
    assert alloc.ts_ms == 1796084016_000 and len(alloc.gpus) == 3
    assert alloc.ts_ms >= r.watermark.ts_ms  # not late


def test_a_pending_reason_change_is_a_further_queued_event():
    fresh = copy.deepcopy(squeue("pending"))
    for job in fresh["jobs"]:
        if job["job_id"] == 8:
            job["state_reason"] = "None"  # just submitted: the scheduler has not looked at it yet
    first = translate(fresh, AgentState(), cluster="c", poll_started_ms=POLL_MS["pending"] - 1000, tiers=TIERS)
    queued = {e.event_id: e for e in first.events}["slurm:c:8:0:queued"]
    assert queued.reason is None and queued.ts_ms == 1796084036_000
    second = translate(squeue("pending"), first.state, cluster="c", poll_started_ms=POLL_MS["pending"], tiers=TIERS)
    assert ids(second) == ["slurm:c:8:0:queued:2"]
    assert second.events[0].reason == "Resources"
    assert second.events[0].ts_ms == max(1796084039_000, first.watermark.ts_ms)  # not late
    again = translate(squeue("pending"), second.state, cluster="c", poll_started_ms=POLL_MS["pending"] + 1000)
    assert again.events == []
    # after a requeue the new attempt waits for its BeginTime
    results, _ = run_steps()
    assert {e.event_id: e.reason for e in results["requeued"].events}["slurm:c:7:1:queued"] == "BeginTime"
