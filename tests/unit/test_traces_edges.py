"""Trace rows at the edges of the converters' rules: a pod scheduled and deleted in the same second,
a Running pod never scheduled, a pod deleted while Pending, GenAI rows without a usable number, and
--max-pods on a re-sorted file. No broker, no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuledger.schemas.models import JobEvent, JobEventKind, NodeTick
from gpuledger.traces.genai import Sample, convert_genai, genai_ticks, read_genai_samples
from gpuledger.traces.readers import EPOCH_BASE_MS, TraceError
from gpuledger.traces.v2023 import TraceNode, convert_v2023, read_pods

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def job_events(replay) -> list[JobEvent]:
    return [e.message for e in replay.emissions if isinstance(e.message, JobEvent)]


# --------------------------------------------------------------------------- v2023
def test_v2023_pod_scheduled_and_deleted_in_the_same_second_frees_its_gpu(tmp_path):
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1,1,1,1000,,BE,Failed,100,100,100\n"
                                                           "b,1,1,1,1000,,LS,Running,200,900,200\n"
                                                           "c,1,1,1,1000,,LS,Succeeded,1000,2000,1000\n"))
    replay = convert_v2023(pods, [TraceNode("only", 1, 1, 1, "T4")])
    assert replay.unplaced_pods == []
    allocs = {ev.job_id: [g.node for g in ev.gpus] for ev in job_events(replay) if ev.kind == JobEventKind.allocated}
    assert allocs == {"a": ["only"], "b": ["only"], "c": ["only"]}
    a = [ev.kind.value for ev in job_events(replay) if ev.job_id == "a"]
    assert a == ["submitted", "queued", "allocated", "started", "failed"]  # its own events keep their order


def test_v2023_zero_length_pod_does_not_block_pods_placed_in_the_same_second(tmp_path):
    # a (zero length) and b both take a GPU at 100 on a 1-GPU node: a is freed at once, so b fits
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "a,1,1,1,1000,,BE,Failed,100,100,100\n"
                                                           "b,1,1,1,1000,,LS,Running,50,900,100\n"))
    replay = convert_v2023(pods, [TraceNode("only", 1, 1, 1, "T4")])
    assert replay.unplaced_pods == []


def test_v2023_running_pod_without_a_scheduled_time_is_refused_with_its_line(tmp_path):
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,3600,0\n"
                                                    "p1,1000,1024,1,500,,BE,Running,100,2000,\n")
    with pytest.raises(TraceError, match=rf"{pods}:3: pod 'p1' is Running but has no scheduled_time"):
        read_pods(pods)


def test_v2023_pod_deleted_while_pending_is_cancelled_at_its_deletion(tmp_path):
    pods = read_pods(write(tmp_path, "p.csv", POD_HEADER + "run,1,1,1,1000,,LS,Succeeded,0,7200,0\n"
                                                           "wait,1,1,1,1000,,BE,Pending,0,3600,\n"
                                                           "cpu,1,1,0,0,,BE,Pending,10,10,\n"))
    replay = convert_v2023(pods, [TraceNode("only", 1, 1, 2, "T4")])
    wait = [(ev.kind.value, ev.ts_ms - EPOCH_BASE_MS, ev.reason, ev.gpus) for ev in job_events(replay) if ev.job_id == "wait"]
    assert wait == [("submitted", 0, None, []), ("queued", 0, None, []), ("cancelled", 3_600_000, "deleted while Pending", [])]
    # deleted in the second it was created: the cancel still comes after its own submitted/queued
    assert [ev.kind.value for ev in job_events(replay) if ev.job_id == "cpu"] == ["submitted", "queued", "cancelled"]


# --------------------------------------------------------------------------- GenAI
def test_genai_nan_rows_are_counted_and_do_not_stretch_the_sample_before(tmp_path, capsys):
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n"
                                       "80.0,1000.0,a\n" "nan,1057.0,a\n" "nan,1114.0,a\n" "0.0,1171.0,a\n" "0.0,1228.0,a\n"
                                       "5.0,nan,a\n")
    memory = write(tmp_path, "mem.csv", "value,timestamp_anon,container_ip\n" "1e9,1000.0,a\n" "nan,1057.0,a\n" "-5,1114.0,a\n")
    duty_samples, memory_samples = read_genai_samples(duty), read_genai_samples(memory)
    err = capsys.readouterr().err
    assert f"{duty}: skipped 1 row(s) with a NaN timestamp_anon (first at line 7)" in err
    assert f"{duty}: 2 row(s) with a NaN value (first at line 3)" in err
    assert f"{memory}: 1 row(s) with a NaN value (first at line 3)" in err
    ticks, _, _ = genai_ticks(duty_samples, memory_samples)
    assert "1 memory sample(s) are negative" in capsys.readouterr().err
    assert [(t.ts_ms - EPOCH_BASE_MS, t.interval_ms, t.duty_pct, t.mem_bytes) for t in ticks] == [
        (0, 57_000, 80.0, 1_000_000_000),  # measured for one slot, not stretched over the two without a value
        (57_000, 57_000, None, None),      # held, unmeasured
        (114_000, 57_000, None, None),
        (171_000, 57_000, 0.0, None),
        (228_000, 57_000, 0.0, None),
    ]
    util = [e.message.gpus[0].util_gpu_pct for e in convert_genai(duty_samples, memory_samples).emissions
            if isinstance(e.message, NodeTick)]
    assert util == [80.0, None, None, 0.0, 0.0]


def test_genai_file_of_nan_values_only_has_no_samples(tmp_path):
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\nnan,1000.0,a\nnan,1057.0,a\n")
    with pytest.raises(TraceError, match="no samples"):
        read_genai_samples(duty)


def test_max_pods_takes_pods_in_order_of_their_first_sample():
    # grouped by pod (a re-sorted file): 'late' comes first in the file, 'early' samples first
    duty = [Sample(2000.0, "late", 1.0), Sample(2057.0, "late", 1.0), Sample(1000.0, "early", 2.0),
            Sample(1057.0, "early", 2.0), Sample(2000.0, "early", 2.0)]
    assert genai_ticks(duty, [], max_pods=1)[2] == ["early"]
    assert genai_ticks(duty, [])[2] == ["early", "late"]
    assert genai_ticks(list(reversed(duty)), [], max_pods=1)[2] == ["early"]
    # the same first sample: file order decides
    tied = [Sample(0.0, "b", 1.0), Sample(0.0, "a", 1.0), Sample(57.0, "a", 1.0)]
    assert genai_ticks(tied, [], max_pods=1)[2] == ["b"]
