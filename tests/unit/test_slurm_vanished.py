"""Jobs that left squeue unfinished while the agent was down, closed from sacct
(agents/slurm.py close_vanished, agents/slurm_agent.py SlurmAgent._sacct): attempts requeued
meanwhile, heterogeneous jobs, and a sacct that fails."""

from __future__ import annotations

import copy
import json

from gpuledger.agents.slurm import AgentState, close_vanished, translate
from gpuledger.agents.slurm_agent import CommandFailed, SlurmAgent, parse_sacct
from slurm_sink import JobEventSink
from slurm_fixtures import FIXTURES, load

TIERS = {"batch": 1, "prod": 10}
POLL_MS = {"running": 1796084022_300, "pending": 1796084039_800, "requeued": 1796084042_100}


def squeue(step: str) -> dict:
    return load(f"squeue_{step}")


def seen_until_pending() -> AgentState:
    """The agent's state after the polls of squeue_running and squeue_pending: 6 and 7 running."""
    state = AgentState()
    for step in ("running", "pending"):
        state = translate(squeue(step), state, cluster="c", poll_started_ms=POLL_MS[step], tiers=TIERS).state
    return state


def summary(events) -> list[tuple[str, int]]:
    return [(e.event_id, e.ts_ms) for e in events]


# --------------------------------------------------------------------------- requeued while the agent was down
def test_an_attempt_requeued_while_the_agent_was_down_ends_and_the_next_one_opens():
    """Job 7 was requeued (sacct End 1796084040, the live recording's requeue time) and ran again
    while the agent was down: its first attempt is not billed through the pending gap."""
    state = seen_until_pending()
    rows = parse_sacct("7|7|REQUEUED|1796084037|1796084040|0:0|teamc|batch\n"
                       "7|7|COMPLETED|1796084161|1796084173|0:0|teamc|batch\n")
    events, after, warnings = close_vanished(["7"], state, rows, cluster="c", lost_at_ms=1796090000_000,
                                             promised_ms=state.watermark_ms)
    assert summary(events) == [("slurm:c:7:0:preempted", 1796084040_000), ("slurm:c:7:1:retried", 1796084040_000),
                               ("slurm:c:7:1:allocated", 1796084161_000), ("slurm:c:7:1:started", 1796084161_000),
                               ("slurm:c:7:1:completed", 1796084173_000)]
    assert events[0].reason.startswith("requeued (from sacct") and warnings == []
    assert after.jobs["7"].attempt == 1 and after.jobs["7"].finished
    assert [(p["job_id"], p["rule"]) for p in after.preemptions] == [("7", "requeue")]
    # the same end and retry as the live path gives when the agent sees the requeue (squeue_requeued)
    live = translate(squeue("requeued"), state, cluster="c", poll_started_ms=POLL_MS["requeued"], tiers=TIERS)
    assert [e for e in summary(live.events) if e[0].split(":")[-1] in ("preempted", "retried")] == summary(events[:2])


def test_a_preempted_attempt_from_sacct_is_a_partition_prio_requeue():
    state = seen_until_pending()
    rows = parse_sacct("6|6|PREEMPTED|1796084037|1796084050|0:0|teamb|batch\n"
                       "6|6|REQUEUED|1796084070|1796084080|0:0|teamb|batch\n"
                       "6|6|FAILED|1796084100|1796084110|3:0|teamb|batch\n")
    events, after, _ = close_vanished(["6"], state, rows, cluster="c", lost_at_ms=1796090000_000,
                                      promised_ms=state.watermark_ms)
    kinds = [(e.attempt, e.kind.value) for e in events]
    assert kinds == [(0, "preempted"), (1, "retried"), (1, "allocated"), (1, "started"), (1, "preempted"),
                     (2, "retried"), (2, "allocated"), (2, "started"), (2, "failed")]
    assert events[0].reason.startswith("requeued to reclaim resources") and events[-1].reason.startswith("exit 3")
    assert [p["rule"] for p in after.preemptions] == ["partition_prio/requeue", "requeue"]


# --------------------------------------------------------------------------- heterogeneous jobs
def test_het_job_components_match_sacct_by_their_own_job_id():
    """squeue lists a heterogeneous job's components under their own job ids (6 and 7, het_job_id 6:
    squeue_het_raw_bytes.json, recorded); sacct prints them 6+0 and 6+1 with JobIDRaw 6 and 7."""
    sacct = parse_sacct("6+0|6|CANCELLED by 0|1796476864|1796476882|0:0|teamc|batch\n"
                        "6+1|7|CANCELLED by 0|1796476864|1796476882|0:0|teamc|batch\n")
    assert sorted(sacct) == ["6", "7"] and sacct["7"][0].raw_id == "7"
    recorded = json.loads((FIXTURES / "squeue_het_raw_bytes.json").read_bytes().decode("utf-8", "replace"))
    state = translate(recorded, AgentState(), cluster="c", poll_started_ms=1796476870_000).state
    gone = copy.deepcopy(recorded)
    gone["jobs"] = [j for j in gone["jobs"] if j["job_id"] not in (6, 7)]
    r = translate(gone, state, cluster="c", poll_started_ms=1796476990_000)
    assert r.vanished == ["6", "7"]
    events, _, warnings = close_vanished(r.vanished, r.state, sacct, cluster="c", lost_at_ms=1796476990_000,
                                         promised_ms=r.promised_ms)
    assert summary(events) == [("slurm:c:6:0:cancelled", 1796476882_000), ("slurm:c:7:0:cancelled", 1796476882_000)]
    assert warnings == []


def test_array_tasks_keep_their_sacct_job_id():
    sacct = parse_sacct("3_1|3|COMPLETED|1796084016|1796084030|0:0|teamb|batch\n")
    assert list(sacct) == ["3_1"]


# --------------------------------------------------------------------------- sacct fails
class Slurm:
    """squeue_pending, then the same without job 6 (it left squeue while the agent was down);
    sacct fails while `sacct_error` is set."""

    def __init__(self):
        self.gone = False
        self.sacct_error: str | None = None

    def __call__(self, argv, timeout_s, env=None):
        if argv[0] == "squeue":
            doc = squeue("pending")
            if self.gone:
                doc["jobs"] = [j for j in doc["jobs"] if j["job_id"] != 6]
            return json.dumps(doc)
        if argv[0] == "sinfo":
            return (FIXTURES / "sinfo_pending.json").read_text()
        if argv[0] == "scontrol":
            return ""
        if self.sacct_error:
            raise CommandFailed(self.sacct_error)
        return (FIXTURES / "sacct_requeued_preempted.txt").read_text()


def test_a_failing_sacct_leaves_the_job_open_and_the_watermark_held(tmp_path):
    slurm, sink, clock = Slurm(), JobEventSink(), [POLL_MS["pending"] / 1000]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0])
    assert agent.poll_once()
    promised = sink.watermarks[-1]
    slurm.gone, slurm.sacct_error = True, "sacct timed out after 20s (is slurmctld up?)"
    for hour in (1, 2):  # slurmdbd unreachable for a while
        clock[0] += 3600
        sink.events.clear()
        assert agent.poll_once()
        assert [e for e in sink.events if e.job_id == "6"] == []
        assert not agent.state.jobs["6"].finished
        assert sink.watermarks[-1] == promised  # its outcome, still to come, is not behind the watermark
    slurm.sacct_error = None
    clock[0] += 60
    assert agent.poll_once()
    closed = [e for e in sink.events if e.job_id == "6"]
    assert summary(closed) == [("slurm:c:6:0:cancelled", 1796084040_000)] and "from sacct" in closed[0].reason
    assert closed[0].ts_ms >= promised and agent.state.jobs["6"].finished
    assert sink.watermarks[-1] == int(clock[0]) * 1000 - 1000  # moving again


def test_a_cluster_without_accounting_closes_the_job_as_lost(tmp_path):
    slurm, sink, clock = Slurm(), JobEventSink(), [POLL_MS["pending"] / 1000]
    agent = SlurmAgent(cluster="c", state_file=tmp_path / "s.json", sink=sink, partitions=1, run=slurm,
                       clock=lambda: clock[0])
    assert agent.poll_once()
    slurm.gone, slurm.sacct_error = True, "sacct -P ... exited 1: Slurm accounting storage is disabled"
    clock[0] += 3600
    assert agent.poll_once()
    lost = [e for e in sink.events if e.job_id == "6" and e.kind.value == "failed"]
    assert len(lost) == 1 and "no accounting record" in lost[0].reason and agent.state.jobs["6"].finished
