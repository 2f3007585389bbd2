"""A Slurm job suspended and resumed (`scontrol suspend` / `scontrol resume`): agents/slurm.py on
what a real Slurm 22.05 cluster showed (scripts/slurm/cluster.sh, 2026-12-06): job 1 on gpu01 with 2
GPUs started at …131; suspended at …134, squeue showed SUSPENDED with `suspend_time` …134 and the
same gres_detail; resumed at …138, RUNNING again with `suspend_time` …138 (the field holds the last
suspend or resume). The records are hand-made from those (the fields the agent reads).

Was: the suspended time stayed `executing` until the samples had shown the GPUs quiet for
[execution] min_idle_s (300 s by default), so a job suspended for 5 minutes paid them as compute."""

from __future__ import annotations

from dataclasses import replace

from gpuledger.agents.slurm import AgentState, JobState, translate
from gpuledger.schemas.models import GpuSample, JobEventKind, NodeTick
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.router import LifecycleRouter
from test_execution import FIXTURE_LEDGER

T = 1796558000


def record(state: str, suspend: int = 0, end: int = 0) -> dict:
    return {"job_id": 1, "job_state": state, "state_reason": "None", "account": "teama", "partition": "batch",
            "priority": 10000, "restart_cnt": 0, "submit_time": T + 131, "start_time": T + 131,
            "end_time": T + (end or 131 + 31536000), "suspend_time": T + suspend if suspend else 0,
            "nodes": "gpu01", "gres_detail": ["gpu:a100:2(IDX:0-1)"], "exit_code": 0,
            "tres_req_str": "cpu=1,node=1,billing=1,gres/gpu=2", "array_job_id": 0, "array_task_id": None,
            "array_task_string": "", "last_sched_evaluation": T + 131}


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


def test_the_suspended_time_is_billed_allocated_but_idle_from_the_suspend():
    """Through the router and the node join under the default [execution] (`both`, min_idle_s 300): the
    GPUs report 0 % while suspended; the 4 s of the suspend are idle at once, the rest executing."""
    state, events = AgentState(), []
    for rec, at in ((record("RUNNING"), 132), (record("SUSPENDED", suspend=134), 136),
                    (record("RUNNING", suspend=138), 140), (record("COMPLETED", suspend=138, end=142), 143)):
        result = poll(rec, state, at)
        state, events = result.state, events + result.events
    router, join = LifecycleRouter(), NodeJoin(node="gpu01")
    for event in events:
        assert router.sequence_problem(event) is None, event.event_id
        for change in router.route(event):
            join.add_change(change)
    for s in range(131, 143):  # one-second ticks; 0 % from the suspend to the resume
        util = 0.0 if 134 <= s < 138 else 90.0
        join.add_tick(NodeTick(cluster="c", node="gpu01", ts_ms=(T + s) * 1000, interval_ms=1000, gpus=[
            GpuSample(gpu_uuid=f"GPU-{i}", index=i, model="A100-80GB", util_gpu_pct=util, power_w=100.0)
            for i in range(2)]))
    ledger = replace(FIXTURE_LEDGER, definitions=replace(FIXTURE_LEDGER.definitions, execution_source="both",
                                                         execution_min_idle_s=300.0))
    records = join.close_until((T + 143) * 1000, ledger)
    by_state: dict[str, int] = {}
    for r in records:
        if r["job_id"] == "1":
            by_state[r["state"]] = by_state.get(r["state"], 0) + r["gpu_ms"]
    assert by_state == {"executing": 2 * 7_000, "allocated_idle": 2 * 4_000}
