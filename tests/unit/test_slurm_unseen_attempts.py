"""A job no poll saw before it was requeued: submitted, started and requeued between two polls (the agent down a
while, or a requeue right after the start), so the first poll that lists it shows it at restart count 1. Its
first attempt held GPUs and must be billed: from sacct's rows (`--duplicates`, with Submit) and the GPUs of its
PrologSlurmctld record, as for a job requeued more than once between polls.

Real Slurm 22.05.8 data (tests/fixtures/slurm/README.md): job 4 of sacct_window_v2205.txt (`--gres=gpu:3`,
submitted …22, started …23 on gpu01 GPUs 5-7, requeued …25, run again …36-…42 on GPUs 0-2) with its records in
prolog/v2205_window; squeue's record of it after the requeue is job 7's of squeue_requeued.json (PENDING
BeginTime at restart count 1, submit_time = the requeue), given job 4's id, account, GPUs and times."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from gpuledger.agents.slurm import AgentState, translate
from gpuledger.agents.slurm_agent import AllocationRecords, SlurmAgent, parse_sacct
from slurm_sink import JobEventSink

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
RECORDS = AllocationRecords(FIXTURES / "prolog" / "v2205_window")
T = 1796645322  # job 4's submission
NODE_GPUS = {"gpu01": 8}
REQUEUED_ROW = next(line for line in (FIXTURES / "sacct_window_v2205.txt").read_text().splitlines()
                    if line.startswith("4|4|REQUEUED"))
#: what `sacct -j 4 --duplicates` answers while attempt 1 waits: the requeued attempt, then the pending one
SACCT_PENDING = REQUEUED_ROW + "\n4|4|PENDING|Unknown|Unknown|0:0|teama|batch|None assigned||1796645325\n"
LAST_POLL_MS = (T - 5) * 1000  # the poll before: job 4 not submitted yet


def squeue_job4(state: str = "PENDING") -> dict:
    job = copy.deepcopy(next(j for j in json.loads((FIXTURES / "squeue_requeued.json").read_text())["jobs"]
                             if j["job_id"] == 7))
    job.update(job_id=4, account="teama", submit_time=T + 3, restart_cnt=1,
               tres_req_str="cpu=1,mem=4000M,node=1,billing=1,gres/gpu=3", tres_per_node="gres:gpu:3")
    if state == "RUNNING":
        job.update(job_state="RUNNING", state_reason="None", start_time=T + 14, nodes="gpu01",
                   gres_detail=["gpu:a100:3(IDX:0-2)"], tres_alloc_str="cpu=1,mem=4000M,node=1,billing=1,gres/gpu=3")
    return {"jobs": [job]}


def polled_state(polled_ms: int = LAST_POLL_MS) -> AgentState:
    return AgentState(watermark_ms=polled_ms - 1000, polled_ms=polled_ms)


def poll(state: AgentState, at: int, squeue=None, **kw):
    return translate(squeue or squeue_job4(), state, cluster="c", poll_started_ms=(T + at) * 1000,
                     node_gpus=NODE_GPUS, recorded=RECORDS.lookup, **kw)


def summary(events) -> list[tuple[str, int, list[int]]]:
    return [(e.event_id.removeprefix("slurm:c:"), e.ts_ms // 1000 - T, [g.gpu_index for g in e.gpus]) for e in events]


def test_the_first_attempt_is_billed_from_sacct_and_its_record():
    without = poll(polled_state(), 30)
    assert without.needs_sacct == ["4"]  # the agent asks sacct and translates again
    r = poll(polled_state(), 30, accounting=parse_sacct(SACCT_PENDING))
    assert summary(r.events) == [
        ("4:0:submitted", 0, []),  # sacct's Submit of the first attempt, not squeue's submit_time (the requeue)
        ("4:0:allocated", 1, [5, 6, 7]), ("4:0:started", 1, []), ("4:0:preempted", 3, []), ("4:1:retried", 3, []),
        ("4:1:queued", 3, [])]  # BeginTime, from the requeue
    assert r.needs_sacct == [] and r.warnings == []
    assert "recorded at its allocation by PrologSlurmctld" in r.events[1].reason
    assert "from sacct: submitted and requeued between two polls" in r.events[3].reason
    assert [e.requested_gpus for e in r.events] == [3.0] * 6
    js = r.state.jobs["4"]
    assert (js.attempt, js.allocated, js.submitted) == (1, False, True)
    # attempt 1 runs: allocated from squeue, as any attempt; nothing of attempt 0 again
    running = poll(r.state, 38, squeue=squeue_job4("RUNNING"))
    assert summary(running.events) == [("4:1:allocated", 14, [0, 1, 2]), ("4:1:started", 14, [])]
    # 3 GPUs × 2 s for attempt 0, as sacct has it: Start …23 to End …25
    assert len(r.events[1].gpus) * (r.events[3].ts_ms - r.events[1].ts_ms) / 1000 == 6.0


def test_without_sacct_the_record_still_gives_the_first_attempt():
    """sacct failed (None) or has no row of it ({}): the record alone, allocated at its time and ended at the
    requeue (squeue's submit_time); `submitted` no later than that allocation."""
    for accounting in (None, {}):
        r = poll(polled_state(), 30, accounting=accounting)
        assert summary(r.events) == [
            ("4:0:submitted", 1, []), ("4:0:allocated", 1, [5, 6, 7]), ("4:0:started", 1, []),
            ("4:0:preempted", 3, []), ("4:1:retried", 3, []), ("4:1:queued", 3, [])]
        assert r.needs_sacct == (["4"] if accounting is None else [])
        assert any("submitted, started and requeued since the last poll" in w for w in r.warnings), r.warnings
    # and with neither: only `retried`, as before, and the warning says so
    r = translate(squeue_job4(), polled_state(), cluster="c", poll_started_ms=(T + 30) * 1000, node_gpus=NODE_GPUS,
                  accounting={})
    assert summary(r.events) == [("4:0:submitted", 3, []), ("4:1:retried", 3, []), ("4:1:queued", 3, [])]


def test_at_the_agents_first_poll_earlier_attempts_are_not_replayed():
    """No poll before: the job's earlier attempts may be from before the ledger existed; it starts at its
    restart count, as before."""
    r = poll(AgentState(), 30)
    assert summary(r.events) == [("4:1:submitted", 3, []), ("4:1:queued", 3, [])]
    assert r.needs_sacct == [] and r.warnings == []


class FakeSlurm:
    """squeue lists `jobs`; sacct answers SACCT_PENDING for `-j` and nothing for the recovery window."""

    def __init__(self):
        self.squeue: dict = {"jobs": []}
        self.sacct_calls: list[list[str]] = []

    def __call__(self, argv, timeout_s, env=None):
        if argv[0] == "squeue":
            return json.dumps(self.squeue)
        if argv[0] == "sinfo":
            return (FIXTURES / "sinfo_running.json").read_text()
        if argv[0] == "scontrol":
            return "MinJobAge=300\n" if "config" in argv else ""
        assert argv[0] == "sacct"
        self.sacct_calls.append(list(argv))
        if "-j" not in argv:
            return ""
        columns = argv[argv.index("-o") + 1].split(",")
        return "".join("|".join(line.split("|")[:len(columns)]) + "\n" for line in SACCT_PENDING.splitlines())


def test_the_agent_asks_sacct_for_a_job_first_seen_requeued(tmp_path):
    slurm, sink, clock = FakeSlurm(), JobEventSink(), [LAST_POLL_MS / 1000]
    # a copy: the agent removes the records it no longer needs
    records = AllocationRecords(Path(shutil.copytree(RECORDS.directory, tmp_path / "records")))
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0], records=records)
    assert agent.poll_once() and not sink.events
    slurm.squeue, clock[0] = squeue_job4(), T + 30.0
    assert agent.poll_once()
    ask = next(argv for argv in slurm.sacct_calls if "-j" in argv)
    assert ask[ask.index("-j") + 1] == "4" and ask[ask.index("-o") + 1].endswith(",Submit")
    ids = [e.event_id.removeprefix("slurm:c:") for e in sink.events]
    assert ids == ["4:0:submitted", "4:0:allocated", "4:0:started", "4:0:preempted", "4:1:retried", "4:1:queued"]
    assert [g.gpu_index for g in sink.events[1].gpus] == [5, 6, 7] and sink.events[0].ts_ms == T * 1000
    assert not (tmp_path / "records" / "4.0").exists()  # attempt 0 published: its record removed


def test_a_job_first_seen_ended_after_a_requeue_gets_both_attempts():
    """Seen only when its second attempt had ended too (COMPLETED at restart count 1, still in squeue): both
    attempts, each with the GPUs of its record, as sacct has them (3 GPUs × 2 s, then 3 × 6 s)."""
    done = squeue_job4("RUNNING")
    done["jobs"][0].update(job_state="COMPLETED", end_time=T + 20, gres_detail=[])
    rows = "\n".join(line for line in (FIXTURES / "sacct_window_v2205.txt").read_text().splitlines()
                     if line.startswith("4|4|"))
    r = poll(polled_state(), 30, squeue=done, accounting=parse_sacct(rows))
    assert summary(r.events) == [
        ("4:0:submitted", 0, []), ("4:0:allocated", 1, [5, 6, 7]), ("4:0:started", 1, []), ("4:0:preempted", 3, []),
        ("4:1:retried", 3, []), ("4:1:allocated", 14, [0, 1, 2]), ("4:1:started", 14, []), ("4:1:completed", 20, [])]
    assert r.state.jobs["4"].finished and r.warnings == []


def test_rows_of_an_older_job_with_the_same_id_are_not_its_attempts():
    """`sacct -j 4` lists every job numbered 4: one from before a controller reset (submitted a year before)
    is not this job's first attempt."""
    older = "4|4|COMPLETED|1765000100|1765000200|0:0|teamb|batch|gpu02|billing=1,cpu=1,gres/gpu=8,node=1|1765000000\n"
    r = poll(polled_state(), 30, accounting=parse_sacct(older + SACCT_PENDING))
    assert summary(r.events)[:4] == [("4:0:submitted", 0, []), ("4:0:allocated", 1, [5, 6, 7]),
                                     ("4:0:started", 1, []), ("4:0:preempted", 3, [])]
    assert r.warnings == []
