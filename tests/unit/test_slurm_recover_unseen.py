"""Jobs that came and left squeue while no poll ran (the agent down longer than MinJobAge) are recovered from
sacct's rows of that time (`sacct -S now-N --allusers ... Submit,ReqTRES`). Real output of Slurm 22.05.8
(tests/fixtures/slurm/sacct_window_v2205.txt, with the PrologSlurmctld records of the same jobs in
prolog/v2205_window; MinJobAge 10 s, 2026-12-07): 1 `--gres=gpu:2` 3 s, 2 `--gres=gpu:1` exit 2, array 3 (3_0 is
job 5, 3_1 job 3: scontrol lists both tasks under job 3), 4 `--gres=gpu:3` requeued after 2 s and run again
for 6 s. No poll saw any of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpuledger.agents.slurm import AgentState, JobState, recover_unseen
from gpuledger.agents.slurm_agent import (
    RECOVER_AFTER_S,
    RECOVER_MARGIN_S,
    RECOVER_RETRY_POLLS,
    AllocationRecords,
    SlurmAgent,
    parse_sacct,
)
from slurm_sink import JobEventSink

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
SACCT = (FIXTURES / "sacct_window_v2205.txt").read_text()
RECORDS = AllocationRecords(FIXTURES / "prolog" / "v2205_window")
T = 1796645322  # the jobs' submit time
NODE_GPUS = {"gpu01": 8}
#: per job: GPU-seconds held, and the GPUs of each attempt
EXPECTED = {"1": (6.0, [[0, 1]]), "2": (1.0, [[2]]), "3_0": (2.0, [[3]]), "3_1": (2.0, [[4]]),
            "4": (3 * 2 + 3 * 6.0, [[5, 6, 7], [0, 1, 2]])}


def held(events) -> dict[str, tuple[float, list[list[int]]]]:
    """GPU-seconds and GPUs per job: each attempt from its `allocated` to its end."""
    out: dict[str, tuple[float, list[list[int]]]] = {}
    start: dict[tuple[str, int], tuple[int, int]] = {}
    for e in events:
        key = (e.job_id, e.attempt)
        if e.kind.value == "allocated":
            start[key] = (e.ts_ms, len(e.gpus))
            seconds, gpus = out.get(e.job_id, (0.0, []))
            out[e.job_id] = (seconds, gpus + [[g.gpu_index for g in e.gpus]])
        elif e.kind.value in ("completed", "failed", "cancelled", "preempted") and key in start:
            t0, n = start.pop(key)
            seconds, gpus = out[e.job_id]
            out[e.job_id] = (seconds + n * (e.ts_ms - t0) / 1000, gpus)
    return out


def recover(state=None, known=(), recorded=RECORDS.lookup, **kw):
    return recover_unseen(parse_sacct(SACCT), state or AgentState(), known, cluster="c", lost_at_ms=(T + 60) * 1000,
                          promised_ms=(T - 5) * 1000, node_gpus=NODE_GPUS, recorded=recorded, **kw)


def test_every_job_that_came_and_went_is_billed_as_sacct_has_it():
    events, state, warnings, unfinished = recover()
    assert held(events) == EXPECTED and not warnings and not unfinished
    submitted = {e.job_id: (e.ts_ms, e.requested_gpus, e.tenant, e.queue) for e in events if e.kind.value == "submitted"}
    assert submitted == {"1": (T * 1000, 2.0, "teama", "batch"), "2": (T * 1000, 1.0, "teamb", "batch"),
                         "3_0": (T * 1000, 1.0, "teamc", "batch"), "3_1": (T * 1000, 1.0, "teamc", "batch"),
                         "4": (T * 1000, 3.0, "teama", "batch")}
    outcomes = [(e.job_id, e.attempt, e.kind.value) for e in events
                if e.kind.value in ("completed", "failed", "preempted", "retried")]
    assert outcomes == [("1", 0, "completed"), ("2", 0, "failed"), ("3_0", 0, "completed"), ("3_1", 0, "completed"),
                        ("4", 0, "preempted"), ("4", 1, "retried"), ("4", 1, "completed")]
    assert {e.event_id for e in events if e.job_id == "3_1"} >= {"slurm:c:3_1:0:allocated"}
    assert all(js.finished for js in state.jobs.values()) and sorted(state.jobs) == sorted(EXPECTED)
    # ids as the live path gives them: published again (a later recovery), the worker drops them
    again, _, _, _ = recover()
    assert [e.event_id for e in again] == [e.event_id for e in events]


def test_without_records_part_of_a_node_gets_no_gpus():
    events, _, _, _ = recover(recorded=None)
    assert {job: seconds for job, (seconds, _) in held(events).items()} == {job: 0.0 for job in EXPECTED}


def test_known_jobs_and_unfinished_rows_are_left():
    state = AgentState(jobs={"2": JobState(raw_id=2, submitted=True)})
    running = SACCT.replace("1|1|COMPLETED|1796645323|1796645326|", "1|1|RUNNING|1796645323|Unknown|")
    events, _, warnings, unfinished = recover_unseen(parse_sacct(running), state, {"3_0"}, cluster="c", lost_at_ms=0,
                                                     promised_ms=0, node_gpus=NODE_GPUS, recorded=RECORDS.lookup,
                                                     known_raw={3})
    assert sorted({e.job_id for e in events}) == ["4"]  # 2: in the state; 3_0: known; 3_1 (raw 3): unreadable in squeue
    assert unfinished == ["1"] and not warnings  # 1: sacct has no end yet
    remainder = SACCT + "3_[2-9]|3|PENDING|Unknown|Unknown|0:0|teamc|batch|None assigned||1796645322|gres/gpu=1\n"
    events, _, _, _ = recover_unseen(parse_sacct(remainder), AgentState(), set(), cluster="c", lost_at_ms=0, promised_ms=0)
    assert "3_[2-9]" not in {e.job_id for e in events}


class Slurm:
    """squeue empty (the jobs left it), sacct answering the window's rows; `fail` makes sacct fail."""

    def __init__(self, sacct: str = SACCT):
        self.sacct_calls: list[list[str]] = []
        self.fail = False
        self.sacct = sacct

    def __call__(self, argv, timeout_s, env=None):
        from gpuledger.agents.slurm_agent import CommandFailed
        if argv[0] == "squeue":
            return json.dumps({"jobs": []})
        if argv[0] == "sinfo":
            return json.dumps({"nodes": [{"name": "gpu01", "gres": "gpu:a100:8", "partitions": ["batch"]}]})
        if argv[:2] == ["scontrol", "show"]:
            return "PartitionName=batch PriorityTier=1\n"
        if argv[0] == "sacct":
            self.sacct_calls.append(list(argv))
            if self.fail:
                raise CommandFailed("sacct: error: slurmdbd: connection refused")
            return self.sacct
        raise AssertionError(f"unexpected command {argv}")


def test_the_agent_asks_sacct_after_polls_stopped_and_only_then(tmp_path):
    slurm, sink, clock = Slurm(), JobEventSink(), [T - 10.0]
    records = AllocationRecords(tmp_path / "allocations")  # a copy: the agent removes the records it has used
    shutil.copytree(FIXTURES / "prolog" / "v2205_window", records.directory)
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0], records=records)
    assert agent.poll_once()  # the first poll: nothing before it to recover
    clock[0] += RECOVER_AFTER_S - 1
    assert agent.poll_once() and slurm.sacct_calls == []  # polls kept going
    # the agent stops; the jobs come and go; it starts again from its state file 600 s later
    clock[0] += 600
    slurm.fail = True
    restarted = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                           clock=lambda: clock[0], records=records)
    watermark = restarted.state.watermark_ms
    assert restarted.poll_once()  # sacct fails: nothing recovered, the watermark waits, asked again next poll
    assert restarted.state.watermark_ms == watermark and restarted.state.recover_from_ms
    argv = slurm.sacct_calls[-1]
    assert argv[argv.index("-S") + 1] == f"now-{600 + RECOVER_MARGIN_S}" and "--allusers" in argv
    assert argv[argv.index("-o") + 1].endswith(",Submit,ReqTRES")
    slurm.fail, clock[0] = False, clock[0] + 10
    assert restarted.poll_once()
    assert held(sink.events) == EXPECTED
    assert restarted.state.recover_from_ms == 0 and restarted.state.watermark_ms > watermark
    assert list(records.directory.iterdir()) == []  # every record used, then removed
    calls = len(slurm.sacct_calls)
    clock[0] += 10
    assert restarted.poll_once() and len(slurm.sacct_calls) == calls  # done: not asked again


def test_a_gap_of_minjobage_is_enough_where_it_is_short(tmp_path):
    """A job stays in squeue MinJobAge seconds after it ends: with 10 s (scontrol show config, as 22.05 prints it),
    a 12-s gap between two polls may have lost one, so sacct is asked; MinJobAge is read once."""
    class ShortMinJobAge(Slurm):
        def __call__(self, argv, timeout_s, env=None):
            if argv[:3] == ["scontrol", "show", "config"]:
                self.config_reads = getattr(self, "config_reads", 0) + 1
                return "Configuration data as of 2026-12-07T12:00:00\nMinJobAge               = 10 sec\n"
            return super().__call__(argv, timeout_s, env)

    slurm, clock = ShortMinJobAge(), [T - 10.0]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=JobEventSink(), partitions=1, run=slurm,
                       clock=lambda: clock[0])
    for step in (0, 9, 9):
        clock[0] += step
        assert agent.poll_once()
    assert slurm.sacct_calls == []
    clock[0] += 12
    assert agent.poll_once() and len(slurm.sacct_calls) == 1 and slurm.config_reads == 1


def test_a_job_sacct_has_not_seen_end_is_asked_again_then_given_up(tmp_path, caplog):
    """slurmdbd gets a job's end late when it was away: job 1 unfinished in sacct while gone from squeue. The
    others are recovered at once, job 1 when sacct has its end; the watermark waits meanwhile. One that never
    ends in sacct is given up after RECOVER_RETRY_POLLS polls."""
    running = SACCT.replace("1|1|COMPLETED|1796645323|1796645326|", "1|1|RUNNING|1796645323|Unknown|")
    slurm, sink, clock = Slurm(running), JobEventSink(), [T - 10.0]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0])
    assert agent.poll_once()
    clock[0] += 600
    assert agent.poll_once()
    watermark = agent.state.watermark_ms
    assert {e.job_id for e in sink.events if e.kind.value == "submitted"} == {"2", "3_0", "3_1", "4"}
    assert agent.state.recover_waiting == ["1"]
    clock[0] += 10
    assert agent.poll_once() and agent.state.watermark_ms == watermark  # still unfinished: waits
    slurm.sacct, clock[0] = SACCT, clock[0] + 10  # the end reached slurmdbd
    before = len(sink.events)
    assert agent.poll_once()
    assert {e.job_id for e in sink.events[before:] if e.job_id} == {"1"}  # only job 1, the others not again
    assert held(sink.events)["1"] == (0.0, [[]])  # no record given: part of a node, no GPUs (as before)
    assert agent.state.recover_from_ms == 0 and agent.state.watermark_ms > watermark

    slurm2, sink2, clock2 = Slurm(running), JobEventSink(), [T - 10.0]
    agent2 = SlurmAgent(cluster="c", state_file=tmp_path / "s2.json", sink=sink2, partitions=1, run=slurm2,
                        clock=lambda: clock2[0])
    assert agent2.poll_once()
    clock2[0] += 600
    for _ in range(RECOVER_RETRY_POLLS + 1):
        assert agent2.poll_once()
        clock2[0] += 10
    assert agent2.state.recover_from_ms == 0 and agent2.state.recover_waiting == []
    assert any("unfinished in sacct but gone from squeue" in r.getMessage() for r in caplog.records)
