"""A job requeued twice between two polls, and a running job resized (`scontrol update NumNodes=1`):
agents/slurm.py on what a real Slurm 22.05 cluster showed in a review (4 nodes rv01-rv04 of 8
`a100` GPUs). The times and node lists are the review's: slurmctld's log (`Requeuing JobId=10` at
…187 and …201, `set nodes to rv01 for JobId=15` at …387) and slurmdbd's job records, which sacct
prints one row each (`--duplicates -X`):

    job 10 (2 GPUs)  REQUEUED   start …183 end …186  rv01      (attempt 0)
                     REQUEUED   start …198 end …201  rv01      (attempt 1)
                     COMPLETED  start …212 end …272  rv01      (attempt 2; RUNNING, no end, while it ran)
    job 15 (2 × 4)   RESIZING   start …383 end …387  rv[01-02] (restart count 0 throughout)
                     COMPLETED  start …383 end …423  rv01

The squeue records are hand-made from those (the fields the agent reads), as Slurm 22.05 writes them."""

from __future__ import annotations

import json

from gpuledger.agents.slurm import AgentState, JobState, close_vanished, translate
from gpuledger.agents.slurm_agent import CommandFailed, SlurmAgent, parse_sacct
from gpuledger.schemas.models import JobEvent, JobEventKind
from slurm_sink import JobEventSink
from gpuledger.streams.router import LifecycleRouter

T = 1796537000


def record(job_id: int, state: str, attempt: int, submit: int, start: int, nodes: str, gres: list[str],
           gpus_per_node: int, node_count: int, end: int = 0, resize: int = 0) -> dict:
    return {"job_id": job_id, "job_state": state, "state_reason": "None", "account": "teama", "partition": "batch",
            "priority": 10000, "restart_cnt": attempt, "submit_time": T + submit, "start_time": T + start,
            "end_time": T + end if end else T + start + 31536000, "resize_time": T + resize if resize else 0,
            "nodes": nodes, "gres_detail": gres, "exit_code": 0,
            "tres_req_str": f"cpu={node_count},node={node_count},billing={node_count},gres/gpu={gpus_per_node * node_count}",
            "array_job_id": 0, "array_task_id": None, "array_task_string": "", "last_sched_evaluation": T + submit}


#: after a resize the job runs on: `started` again (an `allocated` alone is a set not running yet)
RESTARTED = ("15:0:started:resized:2", 387, [])


def poll(records: list[dict], state: AgentState, at: int, **kw):
    return translate({"jobs": records}, state, cluster="review", poll_started_ms=(T + at) * 1000, **kw)


def summary(events) -> list[tuple[str, int, list[tuple[str, int]]]]:
    return [(e.event_id.removeprefix("slurm:review:"), e.ts_ms // 1000 - T, [(g.node, g.gpu_index) for g in e.gpus])
            for e in events]


def gpu_seconds(events: list[JobEvent]) -> dict[int, float]:
    """GPU-seconds per attempt as the worker bills them: each `allocated` holds its GPUs until the
    next `allocated` of the attempt or its end."""
    out: dict[int, float] = {}
    held: dict[int, tuple[int, int]] = {}
    for e in sorted(events, key=lambda e: e.ts_ms):
        if e.kind == JobEventKind.allocated or e.kind in (JobEventKind.preempted, JobEventKind.completed):
            if e.attempt in held:
                n, since = held.pop(e.attempt)
                out[e.attempt] = out.get(e.attempt, 0.0) + n * (e.ts_ms - since) / 1000
            if e.kind == JobEventKind.allocated:
                held[e.attempt] = (len(e.gpus), e.ts_ms)
    return out


# --------------------------------------------------------------------------- D1: requeued twice between two polls
JOB10_RUNNING = record(10, "RUNNING", 0, 183, 183, "rv01", ["gpu:a100:2(IDX:0-1)"], 2, 1)
JOB10_AFTER = record(10, "RUNNING", 2, 201, 212, "rv01", ["gpu:a100:2(IDX:0-1)"], 2, 1)
SACCT10 = ("10|10|REQUEUED|1796537183|1796537186|0:0|teama|batch|rv01\n"
           "10|10|REQUEUED|1796537198|1796537201|0:0|teama|batch|rv01\n"
           "10|10|RUNNING|1796537212|Unknown|0:0|teama|batch|rv01\n")


def test_a_job_requeued_twice_between_two_polls_closes_each_attempt_at_its_sacct_end():
    """Attempt 0 ends at its own requeue (sacct End …186), not the second one (…201, squeue's
    submit_time); attempt 1, which ran 3 s, is allocated, started and ended from its row."""
    state = poll([JOB10_RUNNING], AgentState(), 185).state
    without = poll([JOB10_AFTER], state, 217)
    assert without.needs_sacct == ["10"]  # the agent asks sacct and translates again
    assert ("10:0:preempted", 201, []) in summary(without.events)  # what it falls back to without sacct
    assert any("requeued 2 times" in w for w in without.warnings)
    r = poll([JOB10_AFTER], state, 217, accounting=parse_sacct(SACCT10))
    assert summary(r.events) == [
        ("10:0:preempted", 186, []), ("10:1:retried", 186, []),
        ("10:1:allocated", 198, []), ("10:1:started", 198, []), ("10:1:preempted", 201, []), ("10:2:retried", 201, []),
        ("10:2:allocated", 212, [("rv01", 0), ("rv01", 1)]), ("10:2:started", 212, [])]
    assert r.needs_sacct == [] and r.warnings == []
    assert "GPU indices not seen" in r.events[2].reason and "from sacct" in r.events[0].reason
    assert gpu_seconds(poll([JOB10_RUNNING], AgentState(), 185).events + r.events)[0] == 6.0  # sacct: 2 GPUs × 3 s
    assert r.state.jobs["10"].attempt == 2 and r.state.jobs["10"].allocated
    assert [p["rule"] for p in r.state.preemptions] == ["requeue", "requeue"]


class Slurm:
    """squeue shows job 10 as `records` says; sacct answers SACCT10 or fails."""

    def __init__(self):
        self.records = [JOB10_RUNNING]
        self.sacct_error: str | None = None
        self.sacct_calls: list[list[str]] = []

    def __call__(self, argv, timeout_s, env=None):
        if argv[0] == "squeue":
            return json.dumps({"jobs": self.records})
        if argv[0] == "sinfo":
            return json.dumps({"nodes": []})
        if argv[0] == "scontrol":
            return ""
        self.sacct_calls.append(list(argv))
        if self.sacct_error:
            raise CommandFailed(self.sacct_error)
        return SACCT10


def test_the_agent_asks_sacct_for_a_job_requeued_twice_and_falls_back_without_it(tmp_path):
    for sacct_error, attempt0_end in ((None, 186), ("sacct timed out after 20s (is slurmctld up?)", 201)):
        slurm, sink, clock = Slurm(), JobEventSink(), [T + 185.0]
        agent = SlurmAgent(cluster="review", state_file=tmp_path / f"s{attempt0_end}.json", sink=sink, partitions=1,
                           run=slurm, clock=lambda: clock[0])
        assert agent.poll_once() and slurm.sacct_calls == []
        slurm.records, slurm.sacct_error, clock[0] = [JOB10_AFTER], sacct_error, T + 217.0
        assert agent.poll_once()
        assert slurm.sacct_calls and slurm.sacct_calls[0][slurm.sacct_calls[0].index("-j") + 1] == "10"
        ends = {e.attempt: e.ts_ms // 1000 - T for e in sink.events if e.kind == JobEventKind.preempted}
        assert ends[0] == attempt0_end
        assert (1 in ends) == (sacct_error is None)  # without sacct attempt 1 is only retried, as before


# --------------------------------------------------------------------------- D2: a running job resized
JOB15_RUNNING = record(15, "RUNNING", 0, 383, 383, "rv[01-02]", ["gpu:a100:4(IDX:0-3)", "gpu:a100:4(IDX:0-3)"], 4, 2)
JOB15_SHRUNK = record(15, "RUNNING", 0, 383, 383, "rv01", ["gpu:a100:4(IDX:0-3)"], 4, 1, resize=387)
JOB15_DONE = record(15, "COMPLETED", 0, 383, 383, "rv01", [], 4, 1, end=423, resize=387)
SACCT15 = ("15|15|RESIZING|1796537383|1796537387|0:0|teama|batch|rv[01-02]\n"
           "15|15|COMPLETED|1796537383|1796537423|0:0|teama|batch|rv01\n")
RV01 = [("rv01", i) for i in range(4)]
BOTH = RV01 + [("rv02", i) for i in range(4)]


def test_a_resize_in_sacct_is_no_new_attempt():
    """The RESIZING row is the same attempt (Slurm's restart count stays 0): the GPUs of the node it
    kept from the resize on, 8 GPUs × 4 s + 4 × 36 s = 176 GPU-s (was: `preempted` at the resize
    and an attempt 1 with no GPUs, 32 GPU-s)."""
    seen = poll([JOB15_RUNNING], AgentState(), 385)
    gone = poll([], seen.state, 440)
    assert gone.vanished == ["15"]
    rows = parse_sacct(SACCT15)
    assert [(r.state, r.nodes) for r in rows["15"]] == [("RESIZING", "rv[01-02]"), ("COMPLETED", "rv01")]
    events, after, warnings = close_vanished(gone.vanished, gone.state, rows, cluster="review", lost_at_ms=(T + 440) * 1000,
                                             promised_ms=gone.promised_ms)
    assert summary(events) == [("15:0:allocated:2", 387, RV01), RESTARTED, ("15:0:completed", 423, [])]
    assert warnings == [] and after.jobs["15"].attempt == 0 and after.preemptions == []
    assert gpu_seconds(seen.events + events) == {0: 176.0}
    # a state file from before the GPU sets were kept: no GPUs to keep, but still no invented attempt
    old = AgentState.from_json({**gone.state.to_json(), "jobs": {"15": {
        k: v for k, v in gone.state.jobs["15"].to_json().items() if k not in ("gres_detail", "allocations")}}})
    events, _, _ = close_vanished(["15"], old, rows, cluster="review", lost_at_ms=(T + 440) * 1000,
                                  promised_ms=gone.promised_ms)
    assert summary(events) == [("15:0:completed", 423, [])]


def test_a_running_job_shrunk_gets_a_second_allocated_at_its_resize_time():
    """squeue shows the shrunk job's new node list, gres_detail and resize_time: the attempt's GPUs
    are replaced then, and the node it left (rv02) stops billing it (was: 8 GPUs to the end, 320 GPU-s)."""
    first = poll([JOB15_RUNNING], AgentState(), 385)
    assert first.state.jobs["15"].gres_detail == ("gpu:a100:4(IDX:0-3)",) * 2
    state = AgentState.from_json(json.loads(json.dumps(first.state.to_json())))  # through the state file
    shrunk = poll([JOB15_SHRUNK], state, 389)
    assert summary(shrunk.events) == [("15:0:allocated:2", 387, RV01), RESTARTED]
    assert "resized" in shrunk.events[0].reason
    again = poll([JOB15_SHRUNK], AgentState.from_json(json.loads(json.dumps(shrunk.state.to_json()))), 391)
    assert again.events == []  # seen once
    done = poll([JOB15_DONE], again.state, 425)
    assert summary(done.events) == [("15:0:completed", 423, [])]
    events = first.events + shrunk.events + done.events
    assert gpu_seconds(events) == {0: 176.0}
    router = LifecycleRouter()
    changes = [(c.node, c.ts_ms // 1000 - T, len(c.gpus), c.kind.value)
               for e in events if router.sequence_problem(e) is None for c in router.route(e)]
    assert ("rv02", 387, 0, "allocated") in changes  # the released node is told
    assert ("rv02", 423, 0, "completed") not in changes and ("rv01", 423, 4, "completed") in changes


def test_a_job_shrunk_and_ended_between_two_polls_stops_billing_the_released_node_at_its_resize_time():
    """Resized at 387 and ended at 423 between the polls at 385 and 425: squeue lists the ended job on
    rv01 with its resize_time and no GPUs. Was: rv02's 4 GPUs billed to the end, 320 GPU-s for 176."""
    first = poll([JOB15_RUNNING], AgentState(), 385)
    done = poll([JOB15_DONE], first.state, 425)
    assert summary(done.events) == [("15:0:allocated:2", 387, RV01), RESTARTED, ("15:0:completed", 423, [])]
    assert gpu_seconds(first.events + done.events) == {0: 176.0}
    assert poll([JOB15_DONE], done.state, 427).events == []  # seen once
    # a job that was not resized ends as before: no second `allocated`
    plain = poll([record(16, "RUNNING", 0, 383, 383, "rv[03-04]", ["gpu:a100:4(IDX:0-3)"] * 2, 4, 2)], AgentState(), 385)
    ended = poll([record(16, "COMPLETED", 0, 383, 383, "rv[03-04]", [], 4, 2, end=423)], plain.state, 425)
    assert summary(ended.events) == [("16:0:completed", 423, [])]


def test_a_state_file_from_before_gpu_sets_were_kept_loads_and_emits_nothing_new():
    state = poll([JOB15_RUNNING], AgentState(), 385).state
    legacy = {k: v for k, v in state.jobs["15"].to_json().items() if k not in ("gres_detail", "allocations")}
    old = AgentState.from_json({**state.to_json(), "jobs": {"15": legacy}})
    assert old.jobs["15"] == JobState(**{**legacy, "gres_detail": None})
    r = poll([JOB15_RUNNING], old, 387)
    assert r.events == [] and r.state.jobs["15"].gres_detail == ("gpu:a100:4(IDX:0-3)",) * 2
    assert summary(poll([JOB15_SHRUNK], old, 389).events) == [("15:0:allocated:2", 387, RV01), RESTARTED]


def test_the_gpus_a_running_job_keeps_after_a_resize_are_billed_executing():
    """Through the router and rv01's node join at 90 % busy: the job ran on its 4 kept GPUs from the
    resize (387) to its end (423). An `allocated` alone is a set not running yet: 144 of those 160
    GPU-s were billed allocated-but-idle before the agent sent `started` again after the resize."""
    from dataclasses import replace

    from test_execution import FIXTURE_LEDGER

    from gpuledger.schemas.models import GpuSample, NodeTick
    from gpuledger.streams.join import NodeJoin

    first = poll([JOB15_RUNNING], AgentState(), 385)
    shrunk = poll([JOB15_SHRUNK], first.state, 389)
    done = poll([JOB15_DONE], shrunk.state, 425)
    router, join = LifecycleRouter(), NodeJoin(node="rv01")
    for event in first.events + shrunk.events + done.events:
        assert router.sequence_problem(event) is None, event.event_id
        for change in router.route(event):
            if change.node == "rv01":
                join.add_change(change)
    for s in range(383, 423):
        join.add_tick(NodeTick(cluster="review", node="rv01", ts_ms=(T + s) * 1000, interval_ms=1000, gpus=[
            GpuSample(gpu_uuid=f"GPU-{i}", index=i, model="A100-80GB", util_gpu_pct=90.0, power_w=300.0)
            for i in range(4)]))
    ledger = replace(FIXTURE_LEDGER, definitions=replace(FIXTURE_LEDGER.definitions, execution_source="both",
                                                         execution_min_idle_s=300.0))
    by_state: dict[str, int] = {}
    for r in join.close_until((T + 423) * 1000, ledger):
        by_state[r["state"]] = by_state.get(r["state"], 0) + r["gpu_ms"]
    assert by_state == {"executing": 4 * 40_000}
