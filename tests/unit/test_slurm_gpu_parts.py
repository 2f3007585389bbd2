"""Parts of GPUs: Slurm's sharding (`--gres=shard:K`) and CUDA MPS (`--gres=mps:K`), from real output of Slurm
22.05.8, 24.11.5 and 26.05.5 (tests/fixtures/slurm/README.md, `*shards*`, `*mps*`): 4 nodes with 8 GPUs and 32
shards (`Name=shard Count=32 File=…nvidia[0-7]`: 4 per GPU), or 800 MPS (100 per GPU), each. Jobs, shards / MPS:
1 `shard:2` / `mps:50`, 2 `shard:1` / `mps:25` (both on gpu01's GPU 0), 3 `--gres=gpu:2` (whole GPUs 1-2), 4
`-N 2` `shard:4` / `mps:100` (a whole GPU on each node), 5 `-n 2` `shard:3` / `mps:75`, 6 `shard:6` / `mps:150`
(more than a GPU has: pending), 7 `shard:1` / `mps:10` ending at once. 22.05 names the GPU only ('shard:2(IDX:0)'),
so its share comes from the node's parts over its GPUs; 24.11 on write each GPU's used/total ('shard:2(2/4,…)')."""

from __future__ import annotations

import json

import pytest

from gpuledger.agents.slurm import (
    AgentState,
    NodeGpus,
    _with,
    build_snapshot,
    gpus_held_by_no_job,
    node_gpu_counts,
    gpu_parts,
    parse_jobs,
    part_request_gpus,
    translate,
)
from slurm_fixtures import load

#: (squeue, node records) per recording: shards or MPS, Slurm version
RECORDINGS = {(kind, version): (f"squeue{tag}_{kind}", f"{'sinfo' if not tag else 'nodes' + tag}_{kind}")
              for kind in ("shards", "mps") for version, tag in (("22.05", ""), ("24.11", "_v2411"), ("26.05", "_v2605"))}
PARTS_PER_GPU = {"shards": {"shard": 4}, "mps": {"mps": 100}}
#: (node, GPU index, share in thousandths) per job
HELD = {"shards": {"1": [("gpu01", 0, 500)], "2": [("gpu01", 0, 250)], "3": [("gpu01", 1, 1000), ("gpu01", 2, 1000)],
                   "4": [("gpu01", 3, 1000), ("gpu02", 0, 1000)], "5": [("gpu01", 4, 750)], "7": []},
        "mps": {"1": [("gpu01", 0, 500)], "2": [("gpu01", 0, 250)], "3": [("gpu01", 1, 1000), ("gpu01", 2, 1000)],
                "4": [("gpu02", 0, 1000), ("gpu03", 0, 1000)], "5": [("gpu04", 0, 750)], "7": []}}


@pytest.mark.parametrize("recording", RECORDINGS)
def test_each_job_holds_its_parts_as_shares_of_their_gpu(recording):
    kind = recording[0]
    squeue_name, nodes_name = RECORDINGS[recording]
    squeue, nodes = load(squeue_name), load(nodes_name)
    node_gpus = node_gpu_counts(nodes)
    assert node_gpus.parts_per_gpu == {f"gpu0{n}": PARTS_PER_GPU[kind] for n in range(1, 5)}
    jobs = parse_jobs(squeue).jobs
    poll_ms = max(j.start_ms for j in jobs if j.state == "RUNNING") + 2000
    result = translate(squeue, AgentState(), cluster="c", poll_started_ms=poll_ms, node_gpus=node_gpus,
                       tiers={"batch": 1, "prod": 10})
    assert result.warnings == []
    allocated = {e.job_id: [(g.node, g.gpu_index, g.share_milli) for g in e.gpus]
                 for e in result.events if e.kind.value == "allocated"}
    assert allocated == HELD[kind]
    assert all(j.requested_gpus == 0 for j in jobs if j.job_id not in ("3",))  # parts are not GPUs
    # gpu01's GPU 0 is half job 1's, a quarter job 2's; the last quarter is nobody's (unallocated in the ledger)
    assert sum(share for held in allocated.values() for node, i, share in held if (node, i) == ("gpu01", 0)) == 750
    # GPUs held in parts are no GPUs held by no job
    assert gpus_held_by_no_job(nodes, parse_jobs(squeue)) == {}


@pytest.mark.parametrize("recording", RECORDINGS)
def test_the_queue_counts_the_parts_of_gpus(recording):
    squeue_name, nodes_name = RECORDINGS[recording]
    (batch,) = [q for q in build_snapshot(load(squeue_name), load(nodes_name), cluster="c", ts_ms=0,
                                          tiers={"batch": 1, "prod": 10}).queues if q.queue == "batch"]
    assert batch.allocated_gpus == 5.5  # 0.5 + 0.25 + 2 + 2 + 0.75
    # job 6 waits for 6 shards / 150 MPS: 1.5 GPUs of the partition's nodes (4 shards / 100 MPS a GPU)
    assert (batch.pending_jobs, batch.pending_gpus) == (1, 1.5)
    assert [(p.jobs, p.gpus) for p in batch.pending_by_priority] == [(1, 1.5)]


#: GPUs each job's request amounts to: 1 shard:2 / mps:50, 2 shard:1 / mps:25, 3 gpu:2, 4 two nodes of
#: shard:4 / mps:100, 5 shard:3 / mps:75, 6 shard:6 / mps:150 (pending), 7 shard:1 / mps:10
REQUESTED = {"shards": {"1": 0.5, "2": 0.25, "3": 2.0, "4": 2.0, "5": 0.75, "6": 1.5, "7": 0.25},
             "mps": {"1": 0.5, "2": 0.25, "3": 2.0, "4": 2.0, "5": 0.75, "6": 1.5, "7": 0.1}}


@pytest.mark.parametrize("recording", RECORDINGS)
def test_a_request_for_parts_counts_the_gpus_it_amounts_to(recording):
    """The queue wait of a job on shards or MPS is GPU-hours as any job's (its events' requested_gpus): its
    parts over the parts per GPU of its nodes, or, pending, of its partition's nodes."""
    kind = recording[0]
    squeue_name, nodes_name = RECORDINGS[recording]
    squeue, nodes = load(squeue_name), load(nodes_name)
    node_gpus = node_gpu_counts(nodes)
    assert all(node_gpus.partitions[n] == ("batch", "prod") for n in node_gpus)
    jobs = parse_jobs(squeue).jobs
    result = translate(squeue, AgentState(), cluster="c", node_gpus=node_gpus, tiers={"batch": 1, "prod": 10},
                       poll_started_ms=max(j.start_ms for j in jobs if j.state == "RUNNING") + 2000)
    asked = {}
    for event in result.events:
        assert asked.setdefault(event.job_id, event.requested_gpus) == event.requested_gpus  # on every event
    assert asked == REQUESTED[kind]
    # without sinfo's nodes the parts per GPU are not known: no GPU count, as before
    bare = translate(squeue, AgentState(), cluster="c", tiers={"batch": 1, "prod": 10},
                     poll_started_ms=max(j.start_ms for j in jobs if j.state == "RUNNING") + 2000)
    assert {e.job_id: e.requested_gpus for e in bare.events} == {"3": 2.0, **{j: 0.0 for j in "124567"}}


def test_parts_per_gpu_where_the_nodes_differ():
    """A pending request is counted against its partition's nodes that have that kind of part: exact where they
    all have as many per GPU, their GPUs over their parts where they differ; 0 where none has any."""
    job = parse_jobs({"jobs": [{"job_id": 9, "job_state": "PENDING", "partition": "mixed,other",
                                "tres_per_node": "gres:shard:4", "node_count": 1}]}).jobs[0]
    assert job.requested_parts == {"shard": 4.0} and job.requested_gpus == 0
    gpus = NodeGpus({"a": 8, "b": 8, "c": 4, "d": 8}, parts_per_gpu={"a": {"shard": 4}, "b": {"shard": 2},
                                                                       "d": {"shard": 8}},
                    partitions={"a": ["mixed"], "b": ["mixed", "other"], "c": ["mixed"], "d": ["other"]})
    # a: 8 GPUs × 4, b: 8 × 2 (c has no shards, d is not in the first partition): 16 GPUs over 48 shards
    assert part_request_gpus(job, gpus) == round(4 * 16 / 48, 6)
    assert part_request_gpus(_with(job, queue="other"), gpus) == round(4 * 16 / 80, 6)
    assert part_request_gpus(_with(job, queue="nowhere"), gpus) == 0.0
    assert part_request_gpus(_with(job, requested_parts={"mps": 50.0}), gpus) == 0.0  # no node has MPS
    assert part_request_gpus(_with(job, nodes=["b"]), gpus) == 2.0  # running on b: b's 2 a GPU


def test_gpu_parts_of_each_form():
    four = {"shard": 4, "mps": 100}
    assert gpu_parts("shard:2(2/4,0/4,0/4)") == [(0, 500)]
    assert gpu_parts("shard:a100:3(0/4,3/4)") == [(1, 750)]
    assert gpu_parts("mps:30(0/100,30/100)") == [(1, 300)]
    assert gpu_parts("shard:5(3/3,2/3)") == [(0, 1000), (1, 666)]  # rounded down: never more than a GPU
    assert gpu_parts("shard:2(IDX:0)", four) == [(0, 500)]
    assert gpu_parts("mps:25(IDX:3)", four) == [(3, 250)]
    assert gpu_parts("shard:2(IDX:0)") == []  # 22.05 without the node's parts per GPU: not known
    assert gpu_parts("mps:25(IDX:3)", {"shard": 4}) == []
    assert gpu_parts("shard:4(IDX:0-1)", four) == [(0, 500), (1, 500)]
    assert gpu_parts("shard:1(IDX:N/A)", four) == []
    assert gpu_parts("gpu:a100:2(IDX:0-1)", four) == []
    assert gpu_parts("gpu:mps100:2(IDX:0-1)", four) == []  # a GPU type named like a part
    assert gpu_parts("gpu:a100:1(IDX:0),shard:2(-/4,2/4)") == [(1, 500)]


@pytest.mark.parametrize("first_state", ["CONFIGURING", "RUNNING"])
def test_a_shard_job_first_seen_without_its_shards_gets_them_when_shown(first_state):
    """As a whole-GPU job: configuring without gres_detail, the allocation waits for it (at start_time);
    running without it, the job is allocated no GPU and gets its share once a poll shows it."""
    squeue, nodes = load("squeue_v2411_shards"), load("nodes_v2411_shards")
    node_gpus = node_gpu_counts(nodes)
    poll_ms = max(j.start_ms for j in parse_jobs(squeue).jobs if j.state == "RUNNING") + 2000
    early = json.loads(json.dumps(squeue))
    for job in early["jobs"]:
        if job["job_id"] == 1:
            job.update(job_state=[first_state], gres_detail=[])
    state, events = AgentState(), []
    for view in (early, squeue):
        result = translate(view, state, cluster="c", poll_started_ms=poll_ms, node_gpus=node_gpus,
                           tiers={"batch": 1, "prod": 10})
        state = result.state
        events += [e for e in result.events if e.job_id == "1" and e.kind.value == "allocated"]
    held = [[(g.node, g.gpu_index, g.share_milli) for g in e.gpus] for e in events]
    (start_ms,) = {j.start_ms for j in parse_jobs(squeue).jobs if j.job_id == "1"}
    if first_state == "CONFIGURING":
        assert held == [[("gpu01", 0, 500)]] and events[0].ts_ms == start_ms
    else:
        assert held == [[], [("gpu01", 0, 500)]] and events[0].reason == "GPU indices not in gres_detail"
