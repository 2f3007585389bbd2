"""A Slurm job suspended and resumed (`scontrol suspend` / `scontrol resume`): agents/slurm.py on
what a real Slurm 22.05 cluster showed (scripts/slurm/cluster.sh, 2026-12-06): job 1 on gpu01 with 2
GPUs started at …131; suspended at …134, squeue showed SUSPENDED with `suspend_time` …134 and the
same gres_detail; resumed at …138, RUNNING again with `suspend_time` …138 (the field holds the last
suspend or resume). The records are hand-made from those (the fields the agent reads).

Was: the suspended time stayed `executing` until the samples had shown the GPUs quiet for
[execution] min_idle_s (300 s by default), so a job suspended for 5 minutes paid them as compute."""

from __future__ import annotations

from dataclasses import replace

from gpuledger.agents.slurm import AgentState, JobState, close_vanished, translate
from gpuledger.agents.slurm_agent import parse_sacct
from gpuledger.schemas.models import GpuSample, JobEventKind, NodeTick
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.router import LifecycleRouter
from test_execution import FIXTURE_LEDGER

T = 1796558000


def record(state: str, suspend: int = 0, end: int = 0, pre_sus: int | None = None) -> dict:
    """`pre_sus`: pre_sus_time, the run time before the last suspend (slurmctld adds to it at each suspend);
    None: left out, as in the records above (the agent then infers no suspend it did not see)."""
    rec = {"job_id": 1, "job_state": state, "state_reason": "None", "account": "teama", "partition": "batch",
           "priority": 10000, "restart_cnt": 0, "submit_time": T + 131, "start_time": T + 131,
           "end_time": T + (end or 131 + 31536000), "suspend_time": T + suspend if suspend else 0,
           "nodes": "gpu01", "gres_detail": ["gpu:a100:2(IDX:0-1)"], "exit_code": 0,
           "tres_req_str": "cpu=1,node=1,billing=1,gres/gpu=2", "array_job_id": 0, "array_task_id": None,
           "array_task_string": "", "last_sched_evaluation": T + 131}
    if pre_sus is not None:
        rec["pre_sus_time"] = pre_sus
    return rec


def poll(rec: dict, state: AgentState, at: int):
    return translate({"jobs": [rec]}, state, cluster="c", poll_started_ms=(T + at) * 1000)


def summary(events) -> list[tuple[str, int]]:
    return [(e.event_id.removeprefix("slurm:c:"), e.ts_ms // 1000 - T) for e in events]


def test_a_suspend_interrupts_the_attempt_and_a_resume_starts_it_again():
    running = poll(record("RUNNING"), AgentState(), 132)
    suspended = poll(record("SUSPENDED", suspend=134), running.state, 136)
    again = poll(record("SUSPENDED", suspend=134), suspended.state, 137)      # no news: nothing again
    resumed = poll(record("RUNNING", suspend=138), again.state, 140)
    suspended2 = poll(record("SUSPENDED", suspend=150), resumed.state, 151)  # a second time
    done = poll(record("COMPLETED", suspend=150, end=160), suspended2.state, 161)
    assert summary(running.events) == [("1:0:submitted", 131), ("1:0:allocated", 131), ("1:0:started", 131)]
    assert summary(suspended.events) == [("1:0:interrupted:1", 134)]
    assert again.events == []
    assert summary(resumed.events) == [("1:0:started:2", 138)]
    assert summary(suspended2.events) == [("1:0:interrupted:2", 150)]
    assert summary(done.events) == [("1:0:completed", 160)]
    assert [e.reason for e in suspended.events + resumed.events] == ["suspended (scontrol suspend)",
                                                                    "resumed (scontrol resume)"]


def test_a_job_first_seen_suspended_is_allocated_then_interrupted():
    seen = poll(record("SUSPENDED", suspend=134), AgentState(), 136)
    assert [e.kind for e in seen.events] == [JobEventKind.submitted, JobEventKind.allocated, JobEventKind.started,
                                             JobEventKind.interrupted]
    assert summary(seen.events)[-1] == ("1:0:interrupted:1", 134)


def test_a_state_file_from_before_reads_as_not_suspended():
    js = JobState.from_json({"raw_id": 1, "submitted": True, "allocated": True, "alloc_start_ms": (T + 131) * 1000,
                             "nodes": ["gpu01"]})
    assert (js.suspended, js.suspensions) == (False, 0)


def billed_by_state(polls, util_at) -> dict[str, int]:
    """Job 1's GPU-ms per state through the router and the node join under the default [execution] (`both`,
    min_idle_s 300): the events of `polls` ((record, poll time) in order), one-second ticks at `util_at(s)` %."""
    state, events = AgentState(), []
    for rec, at in polls:
        result = poll(rec, state, at)
        state, events = result.state, events + result.events
    router, join = LifecycleRouter(), NodeJoin(node="gpu01")
    for event in events:
        assert router.sequence_problem(event) is None, event.event_id
        for change in router.route(event):
            join.add_change(change)
    for s in range(131, 143):
        join.add_tick(NodeTick(cluster="c", node="gpu01", ts_ms=(T + s) * 1000, interval_ms=1000, gpus=[
            GpuSample(gpu_uuid=f"GPU-{i}", index=i, model="A100-80GB", util_gpu_pct=util_at(s), power_w=100.0)
            for i in range(2)]))
    ledger = replace(FIXTURE_LEDGER, definitions=replace(FIXTURE_LEDGER.definitions, execution_source="both",
                                                         execution_min_idle_s=300.0))
    by_state: dict[str, int] = {}
    for r in join.close_until((T + 143) * 1000, ledger):
        if r["job_id"] == "1":
            by_state[r["state"]] = by_state.get(r["state"], 0) + r["gpu_ms"]
    return by_state


def test_the_suspended_time_is_billed_allocated_but_idle_from_the_suspend():
    """The GPUs report 0 % while suspended; the 4 s of the suspend are idle at once, the rest executing."""
    polls = ((record("RUNNING"), 132), (record("SUSPENDED", suspend=134), 136),
             (record("RUNNING", suspend=138), 140), (record("COMPLETED", suspend=138, end=142), 143))
    assert billed_by_state(polls, lambda s: 0.0 if 134 <= s < 138 else 90.0) == {
        "executing": 2 * 7_000, "allocated_idle": 2 * 4_000}


# --------------------------------------------------------------------------- a suspend and resume between two polls
def test_a_suspend_and_resume_between_two_polls_is_told_by_slurms_counts():
    """Suspended at …134 (pre_sus_time 3: it ran 3 s), resumed at …138 (suspend_time), both between the polls
    at …132 and …140: (138 − 131) − 3 = 4 s suspended, so `interrupted` at …134 and `started` at …138."""
    running = poll(record("RUNNING", pre_sus=0), AgentState(), 132)
    after = poll(record("RUNNING", suspend=138, pre_sus=3), running.state, 140)
    assert summary(after.events) == [("1:0:interrupted:1", 134), ("1:0:started:2", 138)]
    assert "suspended and resumed between two polls (4 s" in after.events[0].reason
    assert poll(record("RUNNING", suspend=138, pre_sus=3), after.state, 141).events == []  # told once


def test_two_unseen_suspends_are_one_stretch_of_their_sum_and_seen_ones_are_not_told_twice():
    # seen: suspended at 134 (ran 3 s), resumed at 138
    state = poll(record("RUNNING", pre_sus=0), AgentState(), 132).state
    state = poll(record("SUSPENDED", suspend=134, pre_sus=3), state, 136).state
    resumed = poll(record("RUNNING", suspend=138, pre_sus=3), state, 140)
    assert summary(resumed.events) == [("1:0:started:2", 138)]
    # unseen, twice: ran 138-142 and 144-146 (pre_sus_time 3 + 4 + 2), resumed last at 149: suspended 2 + 3 s
    twice = poll(record("RUNNING", suspend=149, pre_sus=9), resumed.state, 151)
    assert summary(twice.events) == [("1:0:interrupted:2", 144), ("1:0:started:3", 149)]


def test_no_suspend_is_inferred_without_pre_sus_time_or_before_the_promise():
    state = poll(record("RUNNING"), AgentState(), 132).state
    assert poll(record("RUNNING", suspend=138), state, 140).events == []  # the field not in the record
    # from a state file of before, with suspends seen: what was told is not known, so nothing is inferred
    old = AgentState.from_json({**AgentState().to_json(), "jobs": {"1": {
        "raw_id": 1, "submitted": True, "allocated": True, "alloc_start_ms": (T + 131) * 1000, "nodes": ["gpu01"],
        "suspensions": 1}}})
    assert old.jobs["1"].suspended_ms is None
    assert poll(record("RUNNING", suspend=150, pre_sus=9), old, 152).events == []
    # the last poll promised …136: the part before it is not told again as suspended (events stay in order)
    state = poll(record("RUNNING", pre_sus=0), AgentState(), 137).state
    late = poll(record("RUNNING", suspend=138, pre_sus=3), state, 140)
    assert summary(late.events) == [("1:0:interrupted:1", 136), ("1:0:started:2", 138)]


def test_a_job_first_seen_after_a_suspend_and_resume_is_allocated_then_interrupted_then_started():
    seen = poll(record("RUNNING", suspend=138, pre_sus=3), AgentState(), 140)
    assert summary(seen.events) == [("1:0:submitted", 131), ("1:0:allocated", 131), ("1:0:started", 131),
                                    ("1:0:interrupted:1", 134), ("1:0:started:2", 138)]


def test_the_unseen_suspended_time_is_billed_allocated_but_idle():
    """The GPUs busy throughout (a suspended job's GPU memory and clocks can stay up; the simulated GPUs of
    `make slurm-check` do): the 4 s told by pre_sus_time are idle, not executing."""
    polls = ((record("RUNNING", pre_sus=0), 132), (record("RUNNING", suspend=138, pre_sus=3), 140),
             (record("COMPLETED", suspend=138, end=142, pre_sus=3), 143))
    assert billed_by_state(polls, lambda s: 90.0) == {"executing": 2 * 7_000, "allocated_idle": 2 * 4_000}


def test_a_job_that_ended_after_an_unseen_suspend_is_told_it_before_its_end():
    running = poll(record("RUNNING", pre_sus=0), AgentState(), 132)
    done = poll(record("COMPLETED", suspend=138, end=142, pre_sus=3), running.state, 143)
    assert summary(done.events) == [("1:0:interrupted:1", 134), ("1:0:started:2", 138), ("1:0:completed", 142)]
    first_seen_done = poll(record("COMPLETED", suspend=138, end=142, pre_sus=3), AgentState(), 143)
    assert summary(first_seen_done.events)[-3:] == [("1:0:interrupted:1", 134), ("1:0:started:2", 138),
                                                    ("1:0:completed", 142)]


# --------------------------------------------------------------------------- killed while suspended
# slurmctld dates the end of a job killed while suspended at the suspend (end_time = suspend_time, and sacct's End;
# job_mgr.c), though its GPUs stay allocated until then (GresUsed; seen on the 22.05 cluster of cluster.sh:
# suspended at …098, cancelled 5 s later, end_time …098, sacct Elapsed 7 s, Suspended 0).
def test_a_job_seen_suspended_then_cancelled_ends_at_the_watermark_not_below_it():
    """Polls at …136 and …146 saw it suspended (watermark …145): its end at …134 would be a late event, and one
    the worker rejects once the suspend is more than its retention back (a day by default)."""
    state = AgentState()
    for rec, at in ((record("RUNNING", pre_sus=0), 132), (record("SUSPENDED", suspend=134, pre_sus=3), 136),
                    (record("SUSPENDED", suspend=134, pre_sus=3), 146)):
        state = poll(rec, state, at).state
    assert state.watermark_ms == (T + 145) * 1000
    ended = poll(record("CANCELLED", suspend=134, end=134, pre_sus=3), state, 150)
    assert summary(ended.events) == [("1:0:cancelled", 145)] and ended.warnings == []
    assert "ended while suspended: Slurm dates the end at the suspend" in ended.events[0].reason


def test_a_job_seen_suspended_then_cancelled_holds_its_gpus_idle_until_the_watermark():
    polls = ((record("RUNNING", pre_sus=0), 132), (record("SUSPENDED", suspend=134, pre_sus=3), 136),
             (record("SUSPENDED", suspend=134, pre_sus=3), 139), (record("CANCELLED", suspend=134, end=134, pre_sus=3), 142))
    assert billed_by_state(polls, lambda s: 0.0 if s >= 134 else 90.0) == {
        "executing": 2 * 3_000, "allocated_idle": 2 * 4_000}


def test_a_job_suspended_and_cancelled_between_two_polls_ends_at_the_suspend_as_sacct_says():
    """No poll saw it suspended: nothing was promised past the suspend, so it ends there, as in sacct (Elapsed 3 s,
    Suspended 0); pre_sus_time counts its whole run, so no unseen suspend is told either."""
    running = poll(record("RUNNING", pre_sus=0), AgentState(), 132)
    ended = poll(record("CANCELLED", suspend=134, end=134, pre_sus=3), running.state, 140)
    assert summary(ended.events) == [("1:0:cancelled", 134)] and ended.warnings == []
    polls = ((record("RUNNING", pre_sus=0), 132), (record("CANCELLED", suspend=134, end=134, pre_sus=3), 140))
    assert billed_by_state(polls, lambda s: 90.0) == {"executing": 2 * 3_000}


def test_a_job_last_seen_suspended_closed_from_sacct_ends_at_the_watermark():
    """Seen suspended, then cancelled and gone from squeue while the agent was down: sacct's End is the suspend."""
    state = AgentState()
    for rec, at in ((record("RUNNING", pre_sus=0), 132), (record("SUSPENDED", suspend=134, pre_sus=3), 146)):
        state = poll(rec, state, at).state
    left = translate({"jobs": []}, state, cluster="c", poll_started_ms=(T + 900) * 1000)
    assert left.vanished == ["1"]
    rows = parse_sacct(f"1|1|CANCELLED by 0|{T + 131}|{T + 134}|0:15|teama|batch\n")
    events, after, warnings = close_vanished(left.vanished, left.state, rows, cluster="c",
                                             lost_at_ms=(T + 900) * 1000, promised_ms=left.promised_ms)
    assert summary(events) == [("1:0:cancelled", 145)] and warnings == []
    assert "from sacct" in events[0].reason and "ended while suspended" in events[0].reason
    assert after.jobs["1"].finished
