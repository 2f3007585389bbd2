"""`gpuledger demo` end to end on a small cluster: the capacity identity holds on every row,
capacity equals GPUs x simulated time, and no process is left behind."""

import os
import socket
from pathlib import Path

import pytest

from gpuledger.cli import main
from gpuledger.config import Settings
from gpuledger.embedded.demo import DEMO_REPORTS, load_dump, run_demo
from gpuledger.embedded.replay import read_dump
from gpuledger.warehouse.reports import fetch
from gpuledger.warehouse import connect

pytestmark = pytest.mark.integration


def children() -> set[int]:
    """PIDs of live (non-zombie) child processes of this process, from /proc."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.add(int(stat.parent.name))
    return pids


def test_demo_conserves_capacity_and_leaves_no_process(tmp_path, capsys, assert_conserved):
    settings = Settings(data_dir=tmp_path / "data", worker_rebalance_timeout_s=4.0, partitions_gpu_samples=2,
                        partitions_job_events=2, partitions_usage=2)
    children_before = children()
    assert run_demo(settings, hours=0.5, nodes=2, seed=3) == 0
    out = capsys.readouterr().out
    assert "Tenant bills" in out and "Queue efficiency" in out and "utilization layers" in out
    assert not children() - children_before

    client = connect(settings)  # the demo released the chDB directory
    try:
        capacity = fetch(client, settings.database, "capacity")
        bills = fetch(client, settings.database, "bills")
        layers = fetch(client, settings.database, "utilization")
    finally:
        client.close()
    assert_conserved(capacity)
    assert sum(r["capacity_gpu_seconds"] for r in capacity) == pytest.approx(2 * 8 * 1800)
    assert bills and sum(r["total_cost_micros"] for r in bills) > 0
    for row in layers:
        for key in ("scheduling_utilization", "execution_utilization", "hardware_utilization"):
            assert 0 <= row[key] <= 1


def test_demo_over_your_own_dump_prints_the_demos_reports(tmp_path, capsys, monkeypatch, assert_conserved):
    """`gpuledger demo --input DUMP`: a topic dump (here one `gpuledger simulate --dump` wrote) through
    the same pipeline, the same reports printed; the warehouse holds exactly the dump's GPU-time.
    A production metrics port in the environment, already taken here, does not reach the demo's worker."""
    dump = tmp_path / "mine.jsonl"
    assert main(["simulate", "--hours", "0.25", "--nodes", "1", "--dump", str(dump)]) == 0
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    for name, value in [("PARTITIONS_GPU_SAMPLES", "2"), ("PARTITIONS_JOB_EVENTS", "2"), ("PARTITIONS_USAGE", "2"),
                        ("WORKER_REBALANCE_TIMEOUT_S", "4"), ("WORKER_METRICS_PORT", port), ("SINK_METRICS_PORT", port)]:
        monkeypatch.setenv(f"GPULEDGER_{name}", value)
    data = tmp_path / "data"
    capsys.readouterr()

    with taken:
        assert main(["demo", "--input", str(dump), "--data-dir", str(data)]) == 0
    captured = capsys.readouterr()
    assert f"replaying {len(read_dump(dump))} messages from {dump}" in captured.err
    for _, title, _, _ in DEMO_REPORTS:
        assert f"== {title} ==" in captured.out

    settings = Settings(data_dir=data)
    client = connect(settings)
    try:
        capacity = fetch(client, settings.database, "capacity")
    finally:
        client.close()
    assert_conserved(capacity)
    assert sum(r["capacity_gpu_seconds"] for r in capacity) == pytest.approx(1 * 8 * 900)


def test_demo_input_without_a_watermark_says_nothing_will_be_billed(tmp_path, capsys):
    dump = tmp_path / "no-watermarks.jsonl"
    dump.write_text('{"topic": "job-events", "key": "j1", "value": {"type": "job_event", "ts_ms": 1}}\n')
    assert main(["demo", "--input", str(tmp_path / "absent.jsonl"), "--data-dir", str(tmp_path)]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    assert [line.key for line in load_dump(dump, "")] == ["j1"]
    assert "has no lifecycle watermark" in capsys.readouterr().err
