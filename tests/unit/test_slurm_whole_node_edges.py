"""Edges of the whole-node inference (agents/slurm.py `whole_node_detail`, `node_gpu_counts`,
`_unseen_gpus`): real Slurm output shapes where an attempt whose GPU indices were never seen must not
be given GPUs it did not hold. Doubtful cases get no GPUs and a reason.

Jobs start from the recorded job 9 of tests/fixtures/slurm (`--gres=gpu:8` on gpu01, COMPLETED between
two polls); sinfo nodes carry the fields Slurm 22.05's `sinfo --json` writes (`boot_time`,
`slurmd_start_time` as epoch seconds; 23.02's number objects read the same)."""

from __future__ import annotations

import pytest

from gpuledger.agents.slurm import (
    AgentState,
    close_vanished,
    node_gpu_counts,
    tres_gpus,
    translate,
    whole_node_detail,
)
from gpuledger.agents.slurm_agent import parse_sacct
from slurm_fixtures import load

JOB_9 = next(j for j in load("squeue_rerun")["jobs"] if j["job_id"] == 9)
START_S, END_S = JOB_9["start_time"], JOB_9["end_time"]


def node(name: str, gres: str = "gpu:a100:8", **times) -> dict:
    return {"name": name, "gres": gres, "partitions": ["batch", "prod"], **times}


def first_poll(job: dict, nodes: list[dict]):
    """The agent's first sight of `job` (already ended): its `allocated` event."""
    r = translate({"jobs": [job]}, AgentState(), cluster="c", poll_started_ms=(END_S + 5) * 1000,
                  node_gpus=node_gpu_counts({"nodes": nodes}))
    return next(e for e in r.events if e.kind.value == "allocated")


def held(event) -> list[tuple[str, int]]:
    return [(g.node, g.gpu_index) for g in event.gpus]


# --------------------------------------------------------------------------- resized between two polls
def test_a_job_resized_between_two_polls_is_not_given_the_nodes_it_ended_on_from_its_start():
    """`scontrol update JobId=9 NumNodes=ALL` with an expand job: Slurm moves gpu02 (and its 8 GPUs,
    held by the other job until then) into job 9 at resize_time and rewrites its tres_alloc_str; squeue
    keeps start_time. 16 = 8 + 8 matched, and job 9 was billed gpu02 from its start."""
    expanded = {**JOB_9, "nodes": "gpu[01-02]", "resize_time": START_S + 10,
                "tres_alloc_str": "cpu=2,node=2,billing=2,gres/gpu=16", "tres_req_str": "cpu=2,node=2,billing=2,gres/gpu=16"}
    alloc = first_poll(expanded, [node("gpu01"), node("gpu02")])
    assert held(alloc) == []
    assert alloc.reason == "GPU indices not seen (the job ran between polls; resized since its start)"
    # never resized: still the whole node, as before
    assert len(held(first_poll(JOB_9, [node("gpu01")]))) == 8


# --------------------------------------------------------------------------- sinfo gres shapes
@pytest.mark.parametrize("gres, gpus", [
    ("gpu:no_consume:8", 8),        # every job on the node gets "all 8": two jobs would both be billed them
    ("gpu:a100:no_consume:8", 8),
    ("gpu:a100:1K", 1),             # a count with a suffix (1024), read as 1 before
])
def test_a_node_whose_gpus_cannot_be_told_exactly_is_not_inferred(gres, gpus):
    job = {**JOB_9, "tres_alloc_str": f"cpu=1,node=1,gres/gpu={gpus}", "tres_req_str": f"cpu=1,node=1,gres/gpu={gpus}"}
    assert "gpu01" not in node_gpu_counts({"nodes": [node("gpu01", gres)]})
    alloc = first_poll(job, [node("gpu01", gres)])
    assert held(alloc) == [] and alloc.reason == "GPU indices not seen (the job ran between polls)"


@pytest.mark.parametrize("gres, count", [
    ("gpu:a100:8(S:0-1)", 8), ("gpu:8", 8), ("gpu:a100:4,gpu:v100:2", 6), ("gpu:a100:4(S:0),gpu:v100:2(S:0,1)", 6),
    ("gpu:a100:8,shard:32", 8), ("gpu:a100:8(S:0-1),mps:800", 8), ("gpu:1g.5gb:7(S:0)", 7),
    ("gpu:nvidia_a100_3g.20gb:2,gpu:nvidia_a100_1g.5gb:1", 3), ("(null)", 0), ("", 0),
])
def test_real_gres_strings_give_their_gpus(gres, count):
    assert node_gpu_counts({"nodes": [node("n1", gres)]}) == {"n1": count}


def test_a_node_listed_twice_with_different_gpus_is_not_known():
    """22.05 lists a node once with its partitions (tests/fixtures/slurm/sinfo_rerun.json); twice with
    one count is harmless, twice with two counts says neither is sure (the last one won before)."""
    assert node_gpu_counts({"nodes": [node("gpu01"), node("gpu01")]}) == {"gpu01": 8}
    job = {**JOB_9, "tres_alloc_str": "cpu=1,node=1,gres/gpu=4", "tres_req_str": "cpu=1,node=1,gres/gpu=4"}
    twice = [node("gpu01", "gpu:a100:8"), node("gpu01", "gpu:a100:4")]
    assert node_gpu_counts({"nodes": twice}) == {}
    assert held(first_poll(job, twice)) == []


# --------------------------------------------------------------------------- GPUs changed since the job ran
#: job 9 ran while the agent was down; gpu01 then lost 4 GPUs: gres.conf now has 4, slurmd restarted
SACCT_9 = f"9|9|COMPLETED|{START_S}|{END_S}|0:0|teama|prod|gpu01|billing=1,cpu=1,gres/gpu=4,node=1\n"


def close_9(nodes: list[dict]):
    state = translate({"jobs": [{**JOB_9, "job_state": "PENDING", "nodes": "", "start_time": 0, "end_time": 0,
                                 "tres_alloc_str": ""}]},
                      AgentState(), cluster="c", poll_started_ms=(START_S - 5) * 1000).state
    events, _, _ = close_vanished(["9"], state, parse_sacct(SACCT_9), cluster="c", lost_at_ms=(END_S + 3600) * 1000,
                                  promised_ms=state.watermark_ms, node_gpus=node_gpu_counts({"nodes": nodes}))
    return next(e for e in events if e.kind.value == "allocated")


@pytest.mark.parametrize("times", [
    {"slurmd_start_time": END_S + 600},
    {"boot_time": END_S + 600, "slurmd_start_time": END_S + 660},
    {"slurmd_start_time": {"set": True, "infinite": False, "number": END_S + 600}},   # 23.02 (v0.0.39)
])
def test_a_node_restarted_after_the_job_started_is_not_inferred_with_its_new_gpus(times):
    """It held 4 of gpu01's 8 then (which 4 is not known); gpu01 shows 4 now: 4 == 4 gave it 0-3."""
    alloc = close_9([node("gpu01", "gpu:a100:4", **times)])
    assert held(alloc) == [] and alloc.reason == "GPU indices not seen (the job ran while the agent was down)"


def test_a_node_restarted_before_the_job_started_still_is():
    alloc = close_9([node("gpu01", "gpu:a100:4", boot_time=START_S - 86400, slurmd_start_time=START_S - 60)])
    assert held(alloc) == [("gpu01", i) for i in range(4)]
    assert whole_node_detail(["gpu01"], 4, node_gpu_counts({"nodes": [node("gpu01", "gpu:a100:4",
                             slurmd_start_time=START_S + 1)]}), START_S * 1000) is None


# --------------------------------------------------------------------------- tres strings
@pytest.mark.parametrize("tres, gpus", [
    ("cpu=4,node=1,billing=4,gres/gpu=8,gres/gpu:a100=8", 8.0),     # typed and untyped: not counted twice
    ("billing=8,cpu=8,gres/gpu:a100=8,gres/gpu=8,mem=64G,node=1", 8.0),
    ("cpu=2,gres/gpu:a100=4,gres/gpu:v100=2,node=1", 6.0),          # typed only (AccountingStorageTRES)
    ("cpu=1,gres/shard=4,node=1", 0.0), ("cpu=1,gres/mps=100,node=1", 0.0),
    ("cpu=1,gres/gpumem=40G,gres/gpuutil=90,gres/gpu=1,node=1", 1.0),
])
def test_tres_gpu_counts(tres, gpus):
    assert tres_gpus(tres) == gpus
