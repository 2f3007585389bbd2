"""The pure part of the trace replays (gpuledger/traces/): reading the trace files and turning
them into the ledger's data lines. No broker, no engine."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES
from gpuledger.schemas.models import JobEvent, JobEventKind, LifecycleWatermark, NodeTick, SchedulerSnapshot
from gpuledger.traces.readers import EPOCH_BASE_MS, TraceError
from gpuledger.traces.v2023 import FirstFitPlacer, TraceNode, TracePod, convert_v2023, parse_gpu_spec, read_nodes, read_pods
from gpuledger.traces.genai import Sample, convert_genai, genai_ticks, read_genai_samples
from gpuledger.traces.run import main

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
n-cpu,32000,262144,0,
n-t4,64000,262144,2,T4
n-v100,96000,786432,8,V100M32
"""

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
PODS_CSV = POD_HEADER + """p-run-end,1000,1024,1,1000,,LS,Running,0,7200,0
p-share-a,1000,1024,1,460,,BE,Running,10,3000,20
p-share-b,1000,1024,1,500,T4,BE,Succeeded,30,4000,40
p-multi,1000,1024,4,1000,V100M32|V100M16,Burstable,Failed,100,5000,160
p-pending,1000,1024,1,1000,,BE,Pending,200,900,
p-cpu,1000,1024,0,0,,LS,Succeeded,300,600,300
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def small(tmp_path):
    return read_pods(write(tmp_path, "pods.csv", PODS_CSV)), read_nodes(write(tmp_path, "nodes.csv", NODES_CSV))


# --------------------------------------------------------------------------- reading
def test_read_nodes_and_pods(small):
    pods, nodes = small
    assert [n.name for n in nodes] == ["n-cpu", "n-t4", "n-v100"]
    assert nodes[0] == TraceNode("n-cpu", 32000, 262144, 0, "")
    assert nodes[2].gpus == 8 and nodes[2].model == "V100M32"
    by = {p.name: p for p in pods}
    assert by["p-multi"].gpu_spec == ("V100M16", "V100M32") and by["p-multi"].held_milli == 4000
    assert by["p-share-a"].held_milli == 460 and by["p-share-a"].is_gpu
    assert by["p-pending"].scheduled_s is None
    assert not by["p-cpu"].is_gpu


@pytest.mark.parametrize("text, expected", [("", ()), ("nan", ()), ("T4", ("T4",)), ("V100M32|V100M16", ("V100M16", "V100M32"))])
def test_parse_gpu_spec(text, expected):
    assert parse_gpu_spec(text) == expected


@pytest.mark.parametrize("row, message", [
    ("p,1,1,1,1000,,LS,Lost,0,10,0", "pod_phase must be one of"),
    ("p,1,1,1,1000,,LS,Running,10,20,5", "creation <= scheduled <= deletion"),
    ("p,1,1,1,2000,,LS,Running,0,10,0", "gpu_milli is the share of one GPU"),
    ("p,1,1,x,1000,,LS,Running,0,10,0", "num_gpu must be a number"),
    ("p,1,1,1,1000,,,Running,0,10,0", "qos is empty"),
])
def test_read_pods_names_the_bad_line(tmp_path, row, message):
    path = write(tmp_path, "pods.csv", POD_HEADER + row + "\n")
    with pytest.raises(TraceError, match=message) as err:
        read_pods(path)
    assert f"{path}:2" in str(err.value)


def test_read_rejects_missing_columns(tmp_path):
    with pytest.raises(TraceError, match="missing column.*scheduled_time"):
        read_pods(write(tmp_path, "pods.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"))
    with pytest.raises(TraceError, match="no such file"):
        read_nodes(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="GPU.*but no model"):
        read_nodes(write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,\n"))


def test_read_genai_samples_from_tar_gz_and_csv(tmp_path):
    text = "value,timestamp_anon,container_ip\n12.5,1000.0,aa\n0.0,1057.0,aa\n"
    csv_path = write(tmp_path, "duty.csv", text)
    tar_path = tmp_path / "duty.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo("duty.csv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    expected = [Sample(1000.0, "aa", 12.5), Sample(1057.0, "aa", 0.0)]
    assert read_genai_samples(csv_path) == expected
    assert read_genai_samples(tar_path) == expected
    # the memory file has its columns in another order
    mem = write(tmp_path, "mem.csv", "timestamp_anon,value,container_ip\n1000.0,2048.0,aa\n")
    assert read_genai_samples(mem) == [Sample(1000.0, "aa", 2048.0)]


# --------------------------------------------------------------------------- placement
def test_first_fit_packs_shares_and_respects_models():
    nodes = [TraceNode("a", 1, 1, 2, "T4"), TraceNode("b", 1, 1, 4, "V100M32")]
    placer = FirstFitPlacer("c", nodes)

    def pod(name, num, milli, spec=()):
        return TracePod(name, num, milli, spec, "LS", "Running", 0, 10, 0)

    first = placer.place(pod("s1", 1, 600))
    second = placer.place(pod("s2", 1, 400))       # fits next to s1 on the same GPU
    third = placer.place(pod("s3", 1, 500))        # does not: next GPU
    assert first[0].gpu_uuid == second[0].gpu_uuid != third[0].gpu_uuid
    assert [g.share_milli for g in first + second + third] == [600, 400, 500]
    multi = placer.place(pod("m", 2, 1000))        # node a has no 2 whole GPUs left: node b
    assert {g.node for g in multi} == {"b"} and len({g.gpu_uuid for g in multi}) == 2
    v100 = placer.place(pod("v", 1, 1000, ("V100M32",)))
    assert v100[0].node == "b"
    none_left = placer.place(pod("x", 3, 1000, ("V100M32",)))  # 2 of 4 V100 left: synthetic GPUs
    assert [g.node for g in none_left] == ["unplaced"] * 3 and placer.unplaced == ["x"]
    placer.release("m")
    again = placer.place(pod("y", 3, 1000, ("V100M32",)))
    assert {g.node for g in again} == {"b"}


# --------------------------------------------------------------------------- v2023 conversion
def ordered_ts(emissions) -> list[int]:
    ts = [e.message.ts_ms for e in emissions]
    assert ts == sorted(ts), "emissions must be in non-decreasing event time"
    return ts


def test_v2023_lines(small):
    pods, nodes = small
    replay = convert_v2023(pods, nodes)
    emissions = list(replay.emissions)
    assert len(emissions) == len(replay.emissions)
    ordered_ts(emissions)
    base = EPOCH_BASE_MS

    ticks = [e.message for e in emissions if e.line == LINE_SAMPLES]
    assert [t.node for t in ticks] == ["n-cpu", "n-t4", "n-v100"] and {t.ts_ms for t in ticks} == {base}
    assert [len(t.gpus) for t in ticks] == [0, 2, 8] and ticks[2].gpus[0].model == "V100M32"
    assert all(g.util_gpu_pct is None for t in ticks for g in t.gpus)  # the trace has no samples

    events: dict[str, list[JobEvent]] = {}
    for e in emissions:
        if isinstance(e.message, JobEvent):
            assert e.key == e.message.job_id
            events.setdefault(e.message.job_id, []).append(e.message)
    kinds = {job: [ev.kind.value for ev in evs] for job, evs in events.items()}
    assert kinds == {
        "p-run-end": ["submitted", "queued", "allocated", "started"],             # running when the trace ends
        "p-share-a": ["submitted", "queued", "allocated", "started", "cancelled"],  # deleted while Running
        "p-share-b": ["submitted", "queued", "allocated", "started", "completed"],
        "p-multi": ["submitted", "queued", "allocated", "started", "failed"],
        "p-pending": ["submitted", "queued", "cancelled"],                        # never scheduled, deleted
        "p-cpu": ["submitted", "queued", "allocated", "started", "completed"],
    }
    multi = {ev.kind: ev for ev in events["p-multi"]}
    assert multi[JobEventKind.submitted].ts_ms == base + 100_000
    assert multi[JobEventKind.submitted].reason == "gpu_spec=V100M16|V100M32"
    assert multi[JobEventKind.allocated].ts_ms == base + 160_000
    assert multi[JobEventKind.failed].ts_ms == base + 5_000_000
    assert multi[JobEventKind.allocated].queue == "Burstable" and multi[JobEventKind.allocated].requested_gpus == 4.0
    alloc = multi[JobEventKind.allocated].gpus
    assert len(alloc) == 4 and {g.node for g in alloc} == {"n-v100"} and {g.share_milli for g in alloc} == {1000}
    share_b = {ev.kind: ev for ev in events["p-share-b"]}[JobEventKind.allocated].gpus
    assert [(g.node, g.share_milli) for g in share_b] == [("n-t4", 500)]  # gpu_spec T4
    share_a = {ev.kind: ev for ev in events["p-share-a"]}[JobEventKind.allocated].gpus
    assert share_a[0].share_milli == 460
    assert {ev.kind: ev for ev in events["p-cpu"]}[JobEventKind.allocated].gpus == []
    assert events["p-share-a"][0].reason is None  # no gpu_spec

    marks = [e for e in emissions if isinstance(e.message, LifecycleWatermark)]
    assert all(e.key is None and e.line == LINE_JOB_EVENTS for e in marks)
    assert marks[-1].message.ts_ms == replay.trace_end_ms == base + 7_200_000 == emissions[-1].message.ts_ms

    snaps = [e.message for e in emissions if isinstance(e.message, SchedulerSnapshot)]
    assert [s.ts_ms for s in snaps] == [base, base + 3_600_000, base + 7_200_000]
    at0 = {q.queue: q for q in snaps[0].queues}
    assert [q.queue for q in snaps[0].queues] == ["LS", "Burstable", "BE"]  # by QoS priority
    assert at0["LS"].allocated_gpus == 1.0 and at0["BE"].pending_jobs == 0
    at1h = {q.queue: q for q in snaps[1].queues}
    # at 3600 s: p-run-end (1) on LS; p-share-b (0.5) on BE (p-share-a left at 3000); p-multi (4) on Burstable
    assert (at1h["LS"].allocated_gpus, at1h["BE"].allocated_gpus, at1h["Burstable"].allocated_gpus) == (1.0, 0.5, 4.0)
    at_end = {q.queue: q for q in snaps[2].queues}
    assert (at_end["LS"].allocated_gpus, at_end["BE"].allocated_gpus, at_end["Burstable"].allocated_gpus) == (1.0, 0.0, 0.0)
    assert all(q.quota_gpus == 10 for s in snaps for q in s.queues)


def test_v2023_snapshot_counts_pending(tmp_path):
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1,1,2,1000,,BE,Pending,0,7300,\nb,1,1,1,1000,,BE,Running,0,7300,3700\n"))
    nodes = read_nodes(write(tmp_path, "n.csv", NODES_CSV))
    snaps = [e.message for e in convert_v2023(pods, nodes).emissions if isinstance(e.message, SchedulerSnapshot)]
    be = [next(q for q in s.queues if q.queue == "BE") for s in snaps]
    # 0 s, 3600 s, 7200 s, and the end (7300 s): a leaves the queue when deleted; b, running at the end, keeps its GPU
    assert [(q.pending_jobs, q.pending_gpus, q.allocated_gpus) for q in be] == [(2, 3.0, 0.0), (2, 3.0, 0.0), (1, 2.0, 1.0), (0, 0.0, 1.0)]
    assert be[0].pending_by_priority[0].jobs == 2


def test_v2023_releases_before_allocations_at_the_same_instant(tmp_path):
    # a whole GPU freed at t=50 is taken at t=50 by the next pod: same GPU, release first in the stream
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1,1,1,1000,,LS,Succeeded,0,50,0\nb,1,1,1,1000,,LS,Running,10,100,50\n"))
    nodes = [TraceNode("only", 1, 1, 1, "T4")]
    emissions = list(convert_v2023(pods, nodes).emissions)
    gpu_events = [(e.message.job_id, e.message.kind.value) for e in emissions
                  if isinstance(e.message, JobEvent) and e.message.ts_ms == EPOCH_BASE_MS + 50_000]
    assert gpu_events == [("a", "completed"), ("b", "allocated"), ("b", "started")]
    allocs = [e.message.gpus[0].gpu_uuid for e in emissions if isinstance(e.message, JobEvent) and e.message.kind == JobEventKind.allocated]
    assert allocs[0] == allocs[1]


def test_inventory_tick_becomes_a_node_inventory_row_in_the_sink():
    from gpuledger.sink.rows import SAMPLES
    from gpuledger.sink.rows import Source, process_message
    from gpuledger.schemas.wire import encode

    tick = convert_v2023([TracePod("p", 0, 0, (), "LS", "Pending", 0, 1, None)], [TraceNode("n", 1, 1, 2, "T4")]).inventory_ticks[0]
    rows = process_message(SAMPLES, encode(tick), Source("gpu-samples", 0, 7))
    (row,) = rows["node_inventory"]
    assert row["node"] == "n" and row["gpu_count"] == 2 and row["gpu_models"] == ["T4", "T4"] and row["seen_ms"] == EPOCH_BASE_MS
    assert len(set(row["gpu_uuids"])) == 2 and row["kafka_offset"] == 7
    assert [r["gpu_model"] for r in rows["gpu_health"]] == ["T4", "T4"]


# --------------------------------------------------------------------------- genai conversion
def duty_samples():
    # pod a: 0, 57, 171 (a missed sample), then a 20-minute gap, 1500, 1557; pod b: 57, 114
    rows = [(0, "a", 10.0), (57, "a", 0.0), (57, "b", 50.0), (114, "b", 100.0), (171, "a", 20.0),
            (1500, "a", 0.0), (1557, "a", 5.0)]
    return [Sample(1_000_000.0 + t, pod, v) for t, pod, v in rows]


def test_genai_ticks_intervals_gaps_and_memory():
    memory = [Sample(1_000_000.0, "a", 1e9), Sample(1_000_060.0, "a", 2e9), Sample(1_000_114.0, "b", 3e9)]
    ticks, median_ms, pods = genai_ticks(duty_samples(), memory)
    assert median_ms == 57_000 and pods == ["a", "b"]
    a = [(t.ts_ms - EPOCH_BASE_MS, t.interval_ms, t.attempt, t.duty_pct, t.mem_bytes) for t in ticks if t.pod == "a"]
    assert a == [
        (0, 57_000, 0, 10.0, 1_000_000_000),
        (57_000, 114_000, 0, 0.0, 2_000_000_000),   # covers the missed sample; memory 3 s away
        (171_000, 57_000, 0, 20.0, None),          # next sample 22 min later: the stretch ends; no memory nearby
        (1_500_000, 57_000, 1, 0.0, None),
        (1_557_000, 57_000, 1, 5.0, None),         # last sample: the median interval
    ]
    b = [(t.ts_ms - EPOCH_BASE_MS, t.interval_ms, t.mem_bytes) for t in ticks if t.pod == "b"]
    assert b == [(57_000, 57_000, 3_000_000_000), (114_000, 57_000, 3_000_000_000)]
    only_first, _, pods = genai_ticks(duty_samples(), memory, max_pods=1)
    assert pods == ["a"] and {t.pod for t in only_first} == {"a"}


def test_convert_genai_lines():
    replay = convert_genai(duty_samples(), [], watermark_every_ms=60_000)
    emissions = list(replay.emissions)
    ordered_ts(emissions)
    ticks = [e.message for e in emissions if isinstance(e.message, NodeTick)]
    assert len(ticks) == 7 and {t.node for t in ticks} == {"a", "b"}
    assert all(len(t.gpus) == 1 and t.gpus[0].index == 0 for t in ticks)
    assert ticks[0].gpus[0].util_gpu_pct == 10.0
    events = [(e.message.job_id, e.message.attempt, e.message.kind.value, e.message.ts_ms - EPOCH_BASE_MS)
              for e in emissions if isinstance(e.message, JobEvent)]
    assert events == [
        ("a", 0, "allocated", 0), ("a", 0, "started", 0),
        ("b", 0, "allocated", 57_000), ("b", 0, "started", 57_000),
        ("b", 0, "completed", 171_000),
        ("a", 0, "completed", 228_000),
        ("a", 1, "allocated", 1_500_000), ("a", 1, "started", 1_500_000),
        ("a", 1, "completed", 1_614_000),
    ]
    alloc = next(e.message for e in emissions if isinstance(e.message, JobEvent) and e.message.kind == JobEventKind.allocated)
    assert alloc.gpus[0].node == "a" and alloc.gpus[0].share_milli == 1000 and alloc.gpus[0].gpu_uuid == ticks[0].gpus[0].gpu_uuid
    marks = [e.message.ts_ms for e in emissions if isinstance(e.message, LifecycleWatermark)]
    assert marks[-1] == replay.end_ms == EPOCH_BASE_MS + 1_614_000 and marks[0] == EPOCH_BASE_MS + 60_000
    assert [t.node for t in replay.inventory_ticks] == ["a", "b"]
    assert replay.counts == {"pods": 2, "ticks": 7, "attempts": 3, "events": 9, "watermarks": len(marks)}


def test_genai_clamps_duty_to_percent():
    ticks, _, _ = genai_ticks([Sample(0.0, "a", 100.4), Sample(57.0, "a", -1.0)], [])
    assert [t.duty_pct for t in ticks] == [100.0, 0.0]


# --------------------------------------------------------------------------- CLI edge
def test_cli_needs_the_trace_files(capsys, tmp_path):
    assert main(["replay-trace", "alibaba-v2023", "--data-dir", str(tmp_path)]) == 2
    assert "needs --pods" in capsys.readouterr().err
    assert main(["replay-trace", "alibaba-genai", "--duty", "x.tar.gz", "--data-dir", str(tmp_path)]) == 2
    assert "needs --duty" in capsys.readouterr().err
    assert main(["replay-trace", "alibaba-v2023", "--pods", str(tmp_path / "no.csv"), "--nodes", "n.csv",
                 "--data-dir", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay-trace", "alibaba-v2099"])


def test_register_cli_adds_the_subcommand():
    import argparse

    from gpuledger.traces.run import cmd_replay_trace, register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay-trace", "alibaba-genai", "--duty", "d", "--memory", "m", "--max-pods", "5"])
    assert args.func is cmd_replay_trace and args.trace == "alibaba-genai" and args.max_pods == 5
