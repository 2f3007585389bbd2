"""Trace input the published files do not have but a user's may: duplicate GenAI samples, a
non-positive --max-pods, odd v2023 rows, compressed CSVs, malformed CSV rows, swapped GenAI files,
options of the other trace, and a data directory whose earlier GenAI result is stale or whose last
replay did not finish. No broker, no engine."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gpuledger.config import Settings
from gpuledger.schemas.models import NodeTick
from gpuledger.traces import run as trace_run
from gpuledger.traces.genai import Sample, check_genai_files, convert_genai, genai_ticks, read_genai_samples
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
    memory = write(tmp_path, "mem.csv", "value,timestamp_anon,container_ip\n2e9,0,a\n2e9,60,a\n")
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n")
    nodes = write(tmp_path, "nodes.csv", NODES)
    for replay in (lambda: replay_genai(settings, duty, memory, log=lambda _text: None),
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


# --------------------------------------------------------------------------- malformed CSV rows
def test_truncated_pod_row_is_refused_not_read_as_never_scheduled(tmp_path):
    """A line cut short (a partial download) lost its scheduled_time: it was read as a Succeeded pod
    that was never scheduled, its 5,000 s of GPU time gone without a word."""
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Succeeded,0,5000\n")
    with pytest.raises(TraceError, match=rf"{pods}:2: 10 field\(s\), the header has 11"):
        read_pods(pods)


def test_row_with_an_extra_field_is_refused_with_its_line(tmp_path):
    # an unquoted comma inside gpu_spec shifts every later column; after a blank line, the line number is still right
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n\n"
                                                    "p1,1000,1024,2,1000,V100M16,V100M32,LS,Running,0,90,0\n")
    with pytest.raises(TraceError, match=rf"{pods}:4: 12 field\(s\), the header has 11"):
        read_pods(pods)
    nodes = write(tmp_path, "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,T4,extra\n")
    with pytest.raises(TraceError, match=rf"{nodes}:2: 6 field\(s\), the header has 5"):
        read_nodes(nodes)


def test_bad_value_after_a_blank_line_names_its_own_line(tmp_path):
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n\n"
                                                    "p1,1000,1024,x,1000,,LS,Running,0,90,0\n")
    with pytest.raises(TraceError, match=rf"{pods}:4: num_gpu must be a number"):
        read_pods(pods)


def test_quoted_field_with_a_comma_is_one_field(tmp_path):
    pods = write(tmp_path, "pods.csv", POD_HEADER + 'p0,1000,1024,1,1000,"V100M16|V100M32",LS,Running,0,90,0\n'
                                                    '"p,1",1000,1024,1,500,,BE,Succeeded,0,90,0\n')
    assert [(p.name, p.gpu_spec) for p in read_pods(pods)] == [("p0", ("V100M16", "V100M32")), ("p,1", ())]


def test_csv_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Spreadsheet programs save UTF-8 CSVs with a byte order mark: it was taken into the first column's name."""
    pods = tmp_path / "pods.csv"
    pods.write_bytes(b"\xef\xbb\xbf" + (POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n").encode())
    assert [p.name for p in read_pods(pods)] == ["p0"]


def test_empty_file_says_so(tmp_path):
    with pytest.raises(TraceError, match=rf"{tmp_path / 'nodes.csv'}: empty file, expected a CSV header with sn, "):
        read_nodes(write(tmp_path, "nodes.csv", ""))


# --------------------------------------------------------------------------- GenAI files swapped
DUTY_CSV = "value,timestamp_anon,container_ip\n12.5,1000.0,a\n0.0,1057.0,a\n99.7,1114.0,a\n"
MEMORY_CSV = "timestamp_anon,value,container_ip\n1000.0,33879490560.0,a\n1057.0,0.0,a\n1114.0,23497801728.0,a\n"


def test_genai_files_swapped_are_refused(tmp_path, monkeypatch):
    """--duty and --memory take files of the same columns: swapped, every GPU was 100 % busy (bytes
    clamped to 100 %) with no memory in use, and no error."""
    import gpuledger.embedded.pipeline as pipeline

    def run_embedded(*_args, **_kwargs):
        raise Stop  # the replay went ahead

    monkeypatch.setattr(pipeline, "run_embedded", run_embedded)
    duty, memory = write(tmp_path, "duty.csv", DUTY_CSV), write(tmp_path, "mem.csv", MEMORY_CSV)
    duty_samples, memory_samples = read_genai_samples(duty), read_genai_samples(memory)
    check_genai_files(duty_samples, memory_samples, duty, memory)  # the right way round
    with pytest.raises(TraceError, match=rf"{memory}: 2 of 3 duty-cycle values are above 100 .*--memory"):
        check_genai_files(memory_samples, duty_samples, memory, duty)
    with pytest.raises(TraceError, match=rf"{duty}: no GPU memory value above 100 bytes .*--duty"):
        check_genai_files(duty_samples, duty_samples, duty, duty)
    assert main(["replay-trace", "alibaba-genai", "--duty", str(memory), "--memory", str(duty),
                 "--data-dir", str(tmp_path / "data")]) == 2
    assert not (tmp_path / "data").exists()  # refused before anything was written


def test_genai_duty_outside_0_to_100_is_counted(tmp_path, capsys):
    duty = write(tmp_path, "duty.csv", DUTY_CSV + "100.4,1171.0,a\n-1,1228.0,a\n")
    check_genai_files(read_genai_samples(duty), read_genai_samples(write(tmp_path, "mem.csv", MEMORY_CSV)), duty, "mem.csv")
    assert f"{duty}: 2 duty-cycle value(s) outside 0-100 clamped (first: 100.4)" in capsys.readouterr().err


def test_genai_empty_fields_are_read_as_nan(tmp_path, capsys):
    """pandas writes NaN as an empty field: such a file was refused ("must be numbers, got ''"), while
    the same rows with "nan" replay. Empty is missing, as NaN is."""
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n80.0,1000.0,a\n,1057.0,a\n0.0,1114.0,a\n5.0,,a\n")
    samples = read_genai_samples(duty)
    err = capsys.readouterr().err
    assert f"{duty}: skipped 1 row(s) with a NaN timestamp_anon (first at line 5)" in err
    assert f"{duty}: 1 row(s) with a NaN value (first at line 3)" in err
    ticks, _, _ = genai_ticks(samples, [])
    assert [(t.ts_ms - EPOCH_BASE_MS, t.duty_pct) for t in ticks] == [(0, 80.0), (57_000, None), (114_000, 0.0)]


@pytest.mark.parametrize("trace, other", [("alibaba-v2023", ["--max-pods", "5"]), ("alibaba-v2023", ["--duty", "d.csv"]),
                                          ("alibaba-genai", ["--nodes", "n.csv"])])
def test_cli_refuses_options_of_the_other_trace(tmp_path, capsys, trace, other):
    """`--max-pods 5` on v2023 was ignored: the full 149 days replayed instead of a quick subset."""
    files = ["--pods", "p.csv", "--nodes", "n.csv"] if trace == "alibaba-v2023" else ["--duty", "d.csv", "--memory", "m.csv"]
    assert main(["replay-trace", trace, *files, *other, "--data-dir", str(tmp_path)]) == 2
    assert f"{other[0]} does not apply to {trace}" in capsys.readouterr().err


def test_a_folder_given_for_a_file_is_named_as_such(tmp_path, capsys):
    """`--pods ../shared/traces/alibaba-v2023` (the folder): "no such file", though it exists."""
    assert main(["replay-trace", "alibaba-v2023", "--pods", str(tmp_path), "--nodes", "n.csv", "--data-dir", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a folder, expected a trace file" in capsys.readouterr().err


def test_a_genai_replay_refused_by_the_lock_leaves_the_running_replays_config_alone(tmp_path):
    """The zero-duty config was written before the data directory was locked: a second replay (with
    another ledger config) that is then refused had already replaced the one the first replay's
    second run was about to read."""
    import fcntl

    from gpuledger.embedded.pipeline import LOCK_FILE, PipelineError

    settings = Settings(data_dir=tmp_path / "data")
    settings.data_dir.mkdir()
    config = settings.data_dir / "ledger-zero-duty.toml"
    config.write_text("# the running replay's\n")
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n1,0,a\n2,60,a\n")
    memory = write(tmp_path, "mem.csv", "value,timestamp_anon,container_ip\n2e9,0,a\n2e9,60,a\n")
    with open(settings.data_dir / LOCK_FILE, "a+") as held:  # another process's replay holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(PipelineError, match="is in use by"):
            replay_genai(settings, duty, memory, log=lambda _text: None)
    assert config.read_text() == "# the running replay's\n"


@pytest.mark.parametrize("trace", ["alibaba-v2023", "alibaba-genai"])
def test_summary_only_after_a_stopped_replay_is_refused(tmp_path, monkeypatch, capsys, trace):
    """A replay stopped half way (SIGTERM, exit 143) leaves a partial warehouse: --summary-only printed
    its figures (a fraction of the GPU-hours) as the trace's, with exit status 0."""
    import gpuledger.embedded.pipeline as pipeline

    def run_embedded(*_args, **_kwargs):
        raise SystemExit(143)  # what SIGTERM raises in the middle of the run

    monkeypatch.setattr(pipeline, "run_embedded", run_embedded)
    monkeypatch.setattr(trace_run, "_summarize", lambda *_args: {"allocated_gpu_hours": 12.5})  # what is there
    duty = write(tmp_path, "duty.csv", "value,timestamp_anon,container_ip\n1,0,a\n2,60,a\n")
    memory = write(tmp_path, "mem.csv", "value,timestamp_anon,container_ip\n2e9,0,a\n2e9,60,a\n")
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,90,0\n")
    nodes = write(tmp_path, "nodes.csv", NODES)
    files = ["--pods", str(pods), "--nodes", str(nodes)] if trace == "alibaba-v2023" else ["--duty", str(duty), "--memory", str(memory)]
    data = ["--data-dir", str(tmp_path / "data")]
    with pytest.raises(SystemExit):
        main(["replay-trace", trace, *files, *data])
    assert main(["replay-trace", trace, "--summary-only", *data]) == 2
    assert f"the last replay in {tmp_path / 'data'} ({trace}) did not finish" in capsys.readouterr().err


def test_a_nan_number_is_called_nan_not_empty(tmp_path):
    pods = write(tmp_path, "pods.csv", POD_HEADER + "p0,1000,1024,1,1000,,LS,Running,0,nan,0\n")
    with pytest.raises(TraceError, match=rf"{pods}:2: deletion_time is NaN \(a number is needed\)"):
        read_pods(pods)


def test_an_unbalanced_quote_is_a_trace_error_with_its_line(tmp_path):
    """A stray quote makes the rest of a large file one field: csv's own error (a traceback) named
    neither the file nor the line."""
    rows = "".join(f"p{i},1000,1024,1,1000,,LS,Running,0,90,0\n" for i in range(4000))
    pods = write(tmp_path, "pods.csv", POD_HEADER + 'q,1000,1024,1,1000,"T4,LS,Running,0,90,0\n' + rows)
    with pytest.raises(TraceError, match=rf"{pods}:\d+: not a readable CSV \(field larger than field limit"):
        read_pods(pods)
