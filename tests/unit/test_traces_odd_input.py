"""Trace input the published files do not have but a user's may: duplicate GenAI samples, a
non-positive --max-pods, odd v2023 rows, compressed CSVs, and a data directory whose earlier
GenAI result is stale. No broker, no engine."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gpuledger.config import Settings
from gpuledger.schemas.models import NodeTick
from gpuledger.traces import run as trace_run
from gpuledger.traces.genai import Sample, convert_genai, genai_ticks, read_genai_samples
from gpuledger.traces.readers import EPOCH_BASE_MS, TraceError
from gpuledger.traces.run import GENAI_DEFAULT_RESULT, main, replay_genai, replay_v2023
from gpuledger.traces.v2023 import read_nodes, read_pods

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn-t4,64000,262144,2,T4\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- GenAI duplicates
@pytest.mark.parametrize("dup_at", [0, 1])
def test_genai_duplicate_sample_keeps_the_first_and_every_tick_covers_time(dup_at):
    times = [0.0, 57.0, 114.0]
    samples = [Sample(1_000.0 + t, "a", 10.0 * (i + 1)) for i, t in enumerate(times)]
    samples.insert(dup_at + 1, Sample(samples[dup_at].ts_s, "a", 99.0))  # same pod, same timestamp
    ticks, median_ms, _ = genai_ticks(samples, [])
    assert [(t.ts_ms - EPOCH_BASE_MS, t.interval_ms, t.duty_pct) for t in ticks] == [
        (0, 57_000, 10.0), (57_000, 57_000, 20.0), (114_000, 57_000, 30.0)]
    assert sum(t.interval_ms for t in ticks) == 171_000  # held time is not under-counted
    emissions = list(convert_genai(samples, []).emissions)  # was: NodeTick interval_ms=0, a "bad settings" error
    assert [e.message.interval_ms for e in emissions if isinstance(e.message, NodeTick)] == [57_000] * 3


def test_genai_samples_within_one_millisecond_are_one_sample():
    ticks, _, _ = genai_ticks([Sample(10.0, "a", 1.0), Sample(10.0002, "a", 2.0), Sample(70.0, "a", 3.0)], [])
    assert [(t.ts_ms - EPOCH_BASE_MS, t.duty_pct) for t in ticks] == [(0, 1.0), (60_000, 3.0)]
    assert ticks[0].interval_ms == 60_000
    ticks, _, _ = genai_ticks([Sample(10.0, "a", 1.0), Sample(10.0012, "a", 2.0), Sample(70.0, "a", 3.0)], [])
    assert [t.interval_ms for t in ticks][:2] == [1, 59_999]  # 1.2 ms apart: two ticks, none of 0 ms


# --------------------------------------------------------------------------- --max-pods
@pytest.mark.parametrize("max_pods", [0, -1, -140])
def test_max_pods_must_be_positive(max_pods):
    duty = [Sample(0.0, "a", 1.0), Sample(0.0, "b", 1.0), Sample(57.0, "a", 1.0)]
    with pytest.raises(TraceError, match="max_pods must be a whole number >= 1"):
        genai_ticks(duty, [], max_pods=max_pods)
    with pytest.raises(TraceError, match="max_pods"):
        convert_genai(duty, [], max_pods=max_pods)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_cli_max_pods_must_be_positive(capsys, value):
    with pytest.raises(SystemExit) as exited:
        main(["replay-trace", "alibaba-genai", "--duty", "d.csv", "--memory", "m.csv", f"--max-pods={value}"])
    assert exited.value.code == 2
    assert "--max-pods: expected a whole number >= 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- v2023 odd rows
def test_v2023_pending_pod_with_a_scheduled_time_is_refused_with_its_line(tmp_path):
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n"
                                                    "p1,1000,1024,1,1000,,BE,Pending,10,900,20\n")
    with pytest.raises(TraceError, match=rf"{pods}:3: pod 'p1' is Pending but has a scheduled_time \(20\)"):
        read_pods(pods)


@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity"])
def test_v2023_infinite_number_is_refused_with_its_line(tmp_path, value):
    pods = write(tmp_path, "pods.csv", POD_HEADER + f"p0,1000,1024,1,1000,,LS,Running,0,{value},0\n")
    with pytest.raises(TraceError, match=rf"{pods}:2: deletion_time must be a finite number"):
        read_pods(pods)
    nodes = write(tmp_path, "nodes.csv", f"sn,cpu_milli,memory_mib,gpu,model\nn0,{value},1,2,T4\n")
    with pytest.raises(TraceError, match=rf"{nodes}:2: cpu_milli must be a finite number"):
        read_nodes(nodes)


def test_genai_infinite_timestamp_is_refused_with_its_line(tmp_path):
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n1,0,a\n2,inf,a\n")
    with pytest.raises(TraceError, match=rf"{duty}:3: timestamp_anon and value must be finite"):
        read_genai_samples(duty)


def test_gzipped_csv_is_read(tmp_path):
    csv_text = POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n"
    gz = tmp_path / "openb_pod_list_default.csv.gz"
    gz.write_bytes(gzip.compress(csv_text.encode()))
    assert [p.name for p in read_pods(gz)] == ["p0"]


def test_unreadable_bytes_name_the_file(tmp_path):
    not_gzip = tmp_path / "pods.csv.gz"
    not_gzip.write_bytes(b"plain text, not gzip")
    with pytest.raises(TraceError, match=rf"{not_gzip}: not a readable gzip file"):
        read_pods(not_gzip)
    binary = tmp_path / "pods.csv"
    binary.write_bytes(gzip.compress(POD_HEADER.encode()))  # a compressed file without .gz
    with pytest.raises(TraceError, match=rf"{binary}: not a UTF-8 CSV"):
        read_pods(binary)


# --------------------------------------------------------------------------- stale GenAI default figure
class Stop(Exception):
    pass


def test_a_new_replay_forgets_the_stale_genai_default_figure(tmp_path, monkeypatch):
    """The figure belongs to the warehouse the replay is about to replace: it goes before the first run."""
    import gpuledger.embedded.pipeline as pipeline

    settings = Settings(data_dir=tmp_path / "data")
    stale = settings.data_dir / GENAI_DEFAULT_RESULT
    seen = []

    def run_embedded(*_args, **_kwargs):
        seen.append(stale.exists())
        raise Stop

    monkeypatch.setattr(pipeline, "run_embedded", run_embedded)
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n1,0,a\n2,60,a\n")
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n")
    nodes = write(tmp_path, "nodes.csv", NODES)
    for replay in (lambda: replay_genai(settings, duty, duty, log=lambda _text: None),
                   lambda: replay_v2023(settings, pods, nodes, log=lambda _text: None)):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        stale.write_text(json.dumps({"ledger_allocated_idle_gpu_hours": 16.546, "execution": {}}))
        with pytest.raises(Stop):
            replay()
    assert seen == [False, False]


def test_summary_of_a_cluster_without_a_replay_is_an_error(tmp_path, monkeypatch):
    """`_summarize` refuses before computing anything (the warehouse part: tests/integration/test_embedded_faults.py)."""
    class Client:
        def query(self, sql, parameters):
            assert "job_attempts" in sql and parameters == {"cluster": "alibaba-genai"}
            return type("R", (), {"result_rows": [(0,)]})()

        def close(self):
            pass

    import gpuledger.warehouse as warehouse

    monkeypatch.setattr(warehouse, "connect", lambda _settings: Client())
    with pytest.raises(TraceError, match="no alibaba-genai replay in this data directory"):
        trace_run._summarize(Settings(data_dir=tmp_path), lambda *_: {}, "alibaba-genai")
