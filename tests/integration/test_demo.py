"""`gpuledger demo` end to end on a small cluster: the capacity identity holds on every row,
capacity equals GPUs x simulated time, and no process is left behind."""

import os
from pathlib import Path

import pytest

from gpuledger.config import Settings
from gpuledger.demo import run_demo
from gpuledger.reports import fetch
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
