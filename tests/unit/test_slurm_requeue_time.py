"""When a requeued attempt ended, and whose sacct rows are a job's own: two cases a review recorded on a real
Slurm 22.05.8 cluster (tests/fixtures/slurm/README.md).

- A job whose processes take KillWait (30 s) to die after `scontrol requeue`: squeue keeps the old
  submit_time through the COMPLETING phase and then moves it to the phase's end, 30 s after the requeue.
  The attempt was billed to then (or, at short poll intervals, to the watermark promised before the
  requeue, with `retried` before the attempt's own allocation).
- A job id used again (MaxJobId wraps): `sacct -j N --duplicates` lists every job that had the id, and the
  old job's rows were taken for the new job's first attempt: closed from sacct, the new job was billed no
  GPU time, with a phantom requeue and attempt 1."""

from __future__ import annotations

from gpuledger.agents.slurm import AgentState, JobState, close_vanished, translate
from gpuledger.agents.slurm_agent import parse_sacct
from slurm_fixtures import FIXTURES, load

REQUEUE_S = 1796681795  # `scontrol requeue 13`; sacct: REQUEUED, Start 1796681791, End 1796681795
KILLWAIT_SACCT = ("13|13|REQUEUED|1796681791|1796681795|0:0|teama|batch|gpu04|billing=1,cpu=1,gres/gpu=2,node=1|"
                  "1796681790\n")


def killwait(moment: str) -> dict:
    return load(f"squeue_requeue_killwait_{moment}")


def polls(moments_at, accounting=None):
    """The agent's events of job 13 over polls (moment, poll start in s); sacct's rows given when asked."""
    state, events, asked = AgentState(), [], []
    for moment, at_s in moments_at:
        r = translate(killwait(moment), state, cluster="c", poll_started_ms=at_s * 1000)
        if r.needs_sacct and accounting is not None:  # the agent asks sacct and translates again
            asked.append(r.needs_sacct)
            r = translate(killwait(moment), state, cluster="c", poll_started_ms=at_s * 1000, accounting=accounting)
        state = r.state
        events += [e for e in r.events if e.job_id == "13"]
    return {e.event_id.removeprefix("slurm:c:13:"): e.ts_ms // 1000 for e in events}, asked


def test_the_recording_shows_submit_time_moving_at_the_end_of_completing():
    (running,) = killwait("running")["jobs"]
    (completing,) = killwait("completing")["jobs"]
    (pending,) = killwait("pending")["jobs"]
    assert (running["job_state"], running["restart_cnt"], running["start_time"]) == ("RUNNING", 0, 1796681791)
    assert (completing["job_state"], completing["restart_cnt"]) == ("COMPLETING", 1)
    assert completing["submit_time"] == running["submit_time"] == 1796681790  # still the old one
    assert (pending["job_state"], pending["submit_time"]) == ("PENDING", 1796681825)  # 30 s after the requeue


def test_a_requeue_seen_while_completing_ends_at_sacct_s_row():
    # polls every 10 s: the first after the requeue sees it COMPLETING with the old submit_time and asks
    # sacct, whose row of attempt 0 ends at the requeue itself
    times, asked = polls([("running", 1796681794), ("completing", 1796681804)], accounting=parse_sacct(KILLWAIT_SACCT))
    assert asked == [["13"]]
    assert times["0:allocated"] == 1796681791
    assert times["0:preempted"] == REQUEUE_S  # 2 GPUs x 4 s, as sacct bills it (it was 2 x 34 s)
    assert times["1:retried"] == REQUEUE_S


def test_without_sacct_a_requeue_ends_at_the_first_poll_that_saw_it():
    # no accounting storage: waits for the new submit_time (30 s later), then takes the earlier bound
    times, _ = polls([("running", 1796681794), ("completing", 1796681804), ("completing", 1796681814),
                      ("completing", 1796681824), ("pending", 1796681834)], accounting={})
    assert times["0:preempted"] == 1796681804  # by that poll; squeue's new submit_time (…825) is later
    assert times["1:retried"] == 1796681825  # back in the queue when its processes were gone
    # polls every second, COMPLETING longer than the wait: at the first poll that saw it, not at the
    # watermark promised before the requeue (the attempt billed less than it held), and `retried` never
    # before the attempt's own allocation (squeue's stale submit_time, 1796681790)
    times, _ = polls([("running", 1796681794)] + [("completing", 1796681796 + i) for i in range(12)], accounting={})
    assert times["0:preempted"] == 1796681796
    assert times["1:retried"] == 1796681796 and times["1:retried"] >= times["0:allocated"]


def test_sacct_rows_of_another_job_with_the_same_id_are_left_out():
    rows = parse_sacct((FIXTURES / "sacct_id_reused.txt").read_text())
    assert [(r.job_id, r.submit_s) for r in rows["5"]][-1] == ("5", 1796682001)
    assert len(rows["5"]) > 1  # the old job's rows first (het job 5+0/5+1 of teamb, done at 1796681673)
    # the new job 5 (teama, 2 GPUs on gpu03) seen running, then the agent down while it ended
    state = AgentState(watermark_ms=1796682004000, polled_ms=1796682005000)
    state.jobs["5"] = JobState(raw_id=5, submitted=True, attempt=0, allocated=True, alloc_start_ms=1796682001000,
                               nodes=["gpu03"], gres_detail=("gpu:a100:2(IDX:0-1)",), allocations=1, queue="batch",
                               tenant="teama", first_submit_ms=1796682001000)
    events, state, _ = close_vanished(["5"], state, rows, cluster="c", lost_at_ms=1796682050000,
                                      promised_ms=1796682004000)
    assert [(e.event_id.removeprefix("slurm:c:5:"), e.ts_ms // 1000) for e in events] == [("0:completed", 1796682021)]
    # a state file from before the first submission was kept: as before, every row is the job's
    old = JobState.from_json({k: v for k, v in state.jobs["5"].to_json().items() if k != "first_submit_ms"})
    assert old.first_submit_ms == 0


def test_the_first_submission_is_kept_when_a_job_is_first_seen():
    r = translate(killwait("running"), AgentState(), cluster="c", poll_started_ms=1796681794000)
    assert r.state.jobs["13"].first_submit_ms == 1796681790000
