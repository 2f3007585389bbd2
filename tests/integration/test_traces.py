"""The public traces through the real pipeline (Tansu, the Faust worker, the sink, chDB), with
every figure of the printed summary checked against an independent computation straight from
the trace files (plain csv/tarfile code written here, not gpuledger.traces).

Needs ../shared/traces (see README: where to get the traces); skips with a clear message
otherwise, except the synthetic pod list, which needs nothing."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from gpuledger.traces.run import main, replay_genai, replay_v2023

pytestmark = pytest.mark.integration

V2023_KEYS = {"pods", "gpu_pods", "nodes", "gpu_nodes", "gpus_total", "gpus_by_model", "phases", "never_scheduled",
              "sched_delay_s", "allocated_gpu_hours", "allocated_gpu_hours_by_qos", "allocated_gpu_hours_by_phase",
              "failed_share_of_gpu_hours", "peak_allocated_gpus", "gpu_spec_share_of_gpu_pods"}

#: The CI replays the first GENAI_CI_PODS pods of the GenAI trace (in order of first sample); see docs/traces.md.
GENAI_CI_PODS = 40


# --------------------------------------------------------------------------- independent figures
def linear_percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def expected_v2023(pods_csv: Path, nodes_csv: Path) -> dict:
    with open(pods_csv, newline="") as f:
        pods = list(csv.DictReader(f))
    with open(nodes_csv, newline="") as f:
        nodes = list(csv.DictReader(f))

    def held(p) -> int:  # thousandths of a GPU
        return int(p["num_gpu"]) * int(p["gpu_milli"])

    def spec(p) -> bool:
        return p["gpu_spec"].strip() not in ("", "nan")

    scheduled = [p for p in pods if p["scheduled_time"].strip()]
    delays = [int(p["scheduled_time"]) - int(p["creation_time"]) for p in scheduled]
    hours: dict[tuple[str, str], float] = defaultdict(float)
    deltas: dict[int, int] = defaultdict(int)
    for p in scheduled:
        if held(p):
            start, stop = int(p["scheduled_time"]), int(p["deletion_time"])
            hours[(p["qos"], p["pod_phase"])] += held(p) / 1000 * (stop - start) / 3600
            deltas[start] += held(p)
            deltas[stop] -= held(p)
    running, peak = 0, 0
    for t in sorted(deltas):
        running += deltas[t]
        peak = max(peak, running)
    total = sum(hours.values())
    by_model: Counter[str] = Counter()
    for n in nodes:
        if int(n["gpu"]):
            by_model[n["model"]] += int(n["gpu"])
    gpu_pods = [p for p in pods if held(p)]
    by_phase = {ph: sum(h for (_, phase), h in hours.items() if phase == ph) for ph in ("Running", "Succeeded", "Failed", "Pending")}
    return {
        "pods": len(pods),
        "gpu_pods": len(gpu_pods),
        "nodes": len(nodes),
        "gpu_nodes": sum(1 for n in nodes if int(n["gpu"])),
        "gpus_total": sum(int(n["gpu"]) for n in nodes),
        "gpus_by_model": dict(sorted(by_model.items())),
        "phases": {ph: sum(1 for p in pods if p["pod_phase"] == ph) for ph in ("Running", "Succeeded", "Failed", "Pending")},
        "never_scheduled": len(pods) - len(scheduled),
        "sched_delay_s": {"n": len(delays), "p50": linear_percentile(delays, 0.5), "p90": linear_percentile(delays, 0.9),
                          "p99": linear_percentile(delays, 0.99), "mean": statistics.fmean(delays)},
        "allocated_gpu_hours": total,
        "allocated_gpu_hours_by_qos": {q: sum(h for (qos, _), h in hours.items() if qos == q) for q in sorted({q for q, _ in hours})},
        "allocated_gpu_hours_by_phase": by_phase,
        "failed_share_of_gpu_hours": by_phase["Failed"] / total,
        "peak_allocated_gpus": peak / 1000,
        "gpu_spec_share_of_gpu_pods": sum(1 for p in gpu_pods if spec(p)) / len(gpu_pods),
    }


def read_trace_csv(path: Path) -> list[dict]:
    if path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(".csv"))
            text = tar.extractfile(member).read().decode()
    else:
        text = path.read_text()
    return list(csv.DictReader(io.StringIO(text)))


def expected_genai(duty_path: Path, max_pods: int | None = None, default_execution: dict | None = None,
                   memory_path: Path | None = None) -> dict:
    """The definitions of docs/traces.md: a sample holds its pod's GPU until the pod's next sample
    (the median sampling interval for a pod's last sample, and before a gap of more than 600 s).
    With `memory_path`: the time-weighted GPU memory of the samples whose pod has a memory sample
    at the same timestamp (99.999 % of them), and the span from the first sample to the end of the last.
    The ledger's idle line under the replay's definition counts exactly the zero-duty time; under
    `default_execution` a sample is idle when its duty is at or below the floor and its quiet
    stretch (within one attempt) began at least min_idle_s before it (docs/accounting.md)."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for row in read_trace_csv(duty_path):
        samples.setdefault(row["container_ip"], []).append((float(row["timestamp_anon"]), float(row["value"])))
    by_first_sample = sorted(samples, key=lambda pod: min(ts for ts, _ in samples[pod]))  # stable: ties in file order
    pods = by_first_sample[:max_pods] if max_pods else by_first_sample
    gaps = []
    for series in samples.values():
        series.sort()
        gaps += [b[0] - a[0] for a, b in zip(series, series[1:])]
    median = statistics.median(gaps)
    memory = {(row["container_ip"], float(row["timestamp_anon"])): float(row["value"])
              for row in (read_trace_csv(memory_path) if memory_path else [])}
    mem_s = mem_weighted = 0.0
    first_s, end_s = math.inf, -math.inf
    held_s = zero_s = weighted = default_idle_s = 0.0
    per_pod, attempts = [], 0
    floor = min_idle = None
    if default_execution:
        floor, min_idle = default_execution["util_floor_pct"], default_execution["min_idle_s"]
    for pod in pods:
        series = samples[pod]
        pod_s = pod_w = 0.0
        attempts += 1 + sum(1 for a, b in zip(series, series[1:]) if b[0] - a[0] > 600)
        quiet_since = None
        for k, (ts, duty) in enumerate(series):
            gap = series[k + 1][0] - ts if k + 1 < len(series) else None
            interval = median if gap is None or gap > 600 else gap
            pod_s += interval
            pod_w += duty * interval
            first_s, end_s = min(first_s, ts), max(end_s, ts + interval)
            if (pod, ts) in memory:
                mem_s += interval
                mem_weighted += memory[(pod, ts)] * interval
            zero_s += interval if duty == 0 else 0.0
            if floor is not None:
                quiet_since = (ts if quiet_since is None else quiet_since) if duty <= floor else None
                if quiet_since is not None and ts - quiet_since >= min_idle:
                    default_idle_s += interval
                if gap is not None and gap > 600:
                    quiet_since = None  # a new attempt starts a new stretch
        held_s += pod_s
        weighted += pod_w
        per_pod.append(pod_w / pod_s)
    return {
        "pods": len(pods),
        "gpus": len(pods),
        "attempts": attempts,
        "allocated_gpu_hours": held_s / 3600,
        "hardware_utilization_pct": weighted / held_s,
        "zero_duty_share_of_allocated": zero_s / held_s,
        "idle_allocation_gpu_hours": zero_s / 3600,
        "ledger_allocated_idle_gpu_hours": zero_s / 3600,
        **({"ledger_allocated_idle_gpu_hours_default_definition": default_idle_s / 3600} if default_execution else {}),
        "per_pod_utilization_pct": {f"p{int(q * 100)}": linear_percentile(per_pod, q) for q in (0.1, 0.5, 0.9)},
        "pods_under_20pct_utilization": sum(1 for u in per_pod if u < 20),
        **({"mem_used_gib_mean": mem_weighted / mem_s / 2**30, "span_hours": (end_s - first_s) / 3600} if memory_path else {}),
    }


def assert_matches(actual, expected, where: str = "summary") -> None:
    """Integers exactly, floats to the summary's rounding (3 decimals; shares 4)."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_matches(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, int) and not isinstance(expected, bool):
        assert actual == expected, f"{where}: {actual} != {expected}"
    else:
        assert actual == pytest.approx(expected, rel=1e-6, abs=6e-4), f"{where}: {actual} != {expected}"


def warehouse_rows(settings, sql: str) -> list[dict]:
    from gpuledger.warehouse import connect

    client = connect(settings)
    try:
        return list(client.query(sql).named_results())
    finally:
        client.close()


def expected_requested_gpu_seconds(pods_csv: Path) -> dict[str, float]:
    """Per queue (qos): GPUs asked for x (deletion - creation), the time from submission to the end of
    the pod whether it waited, ran or both; pods still running at the trace end are left out (their
    end is the observation's)."""
    with open(pods_csv, newline="") as f:
        pods = list(csv.DictReader(f))
    end = max(max(int(p["deletion_time"]), int(p["creation_time"]), int(p["scheduled_time"] or 0)) for p in pods)
    out: dict[str, float] = defaultdict(float)
    for p in pods:
        if p["pod_phase"] == "Running" and p["scheduled_time"].strip() and int(p["deletion_time"]) >= end:
            continue
        out[p["qos"]] += int(p["num_gpu"]) * int(p["gpu_milli"]) / 1000 * (int(p["deletion_time"]) - int(p["creation_time"]))
    return dict(out)


def capacity_rows(settings) -> list[dict]:
    from gpuledger.warehouse.reports import fetch
    from gpuledger.warehouse import connect

    client = connect(settings)
    try:
        return fetch(client, settings.database, "capacity")
    finally:
        client.close()


# --------------------------------------------------------------------------- the replays
def test_v2023_replay_reproduces_the_published_figures(traces_dir, make_settings, assert_conserved):
    pods_csv = traces_dir / "alibaba-v2023" / "openb_pod_list_default.csv"
    nodes_csv = traces_dir / "alibaba-v2023" / "openb_node_list_all_node.csv"
    settings = make_settings()
    summary = replay_v2023(settings, pods_csv, nodes_csv)
    assert_conserved(capacity_rows(settings))
    assert set(summary) == V2023_KEYS
    # the figures the trace's authors publish
    assert (summary["pods"], summary["nodes"], summary["gpus_total"]) == (8152, 1523, 6212)
    assert_matches(summary, expected_v2023(pods_csv, nodes_csv))


def test_v2023_any_pod_list_of_the_format_via_the_cli(tmp_path, make_settings, capsys, monkeypatch, assert_conserved):
    """Another pod list of the same format (the repository publishes gpuspec/gpushare/multigpu
    variants): GPU-model constraints, shares, multi-GPU pods, every phase, a pod that cannot be
    placed, pods still running at the end. Runs through `gpuledger replay-trace` itself."""
    pods_csv = tmp_path / "openb_pod_list_gpuspec_test.csv"
    pods_csv.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "p0,1000,1024,1,1000,,LS,Running,0,9000,0\n"
        "p1,1000,1024,1,460,T4,BE,Running,10,3000,20\n"
        "p2,1000,1024,1,500,T4,BE,Succeeded,30,4000,40\n"
        "p3,1000,1024,4,1000,V100M16|V100M32,Burstable,Failed,100,5000,160\n"
        "p4,1000,1024,8,1000,V100M32,Guaranteed,Running,120,9000,130\n"      # only 4 V100M32: synthetic GPUs
        "p5,1000,1024,1,1000,nan,BE,Pending,200,900,\n"
        "p6,1000,1024,0,0,,LS,Succeeded,300,600,300\n"
        "p7,1000,1024,2,1000,,LS,Failed,1000,8000,1500\n"
        "p8,1000,1024,1,250,G2|T4,BE,Running,1500,2500,1500\n"
    )
    nodes_csv = tmp_path / "nodes.csv"
    nodes_csv.write_text("sn,cpu_milli,memory_mib,gpu,model\ncpu-0,32000,262144,0,\nt4-0,64000,262144,2,T4\n"
                         "v100-0,96000,786432,4,V100M32\ng2-0,96000,786432,8,G2\n")
    settings = make_settings()
    for name, value in {"GPULEDGER_DATA_DIR": str(settings.data_dir), "GPULEDGER_TOPIC_PREFIX": settings.topic_prefix,
                        "GPULEDGER_WORKER_APP_ID": settings.worker_app_id, "GPULEDGER_PARTITIONS_GPU_SAMPLES": "2",
                        "GPULEDGER_PARTITIONS_JOB_EVENTS": "2", "GPULEDGER_PARTITIONS_USAGE": "2",
                        "GPULEDGER_WORKER_REBALANCE_TIMEOUT_S": "4"}.items():
        monkeypatch.setenv(name, value)
    assert main(["replay-trace", "alibaba-v2023", "--pods", str(pods_csv), "--nodes", str(nodes_csv)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == V2023_KEYS
    expected = expected_v2023(pods_csv, nodes_csv)
    assert_matches(summary, expected)
    assert summary["gpu_spec_share_of_gpu_pods"] == pytest.approx(5 / 8, abs=1e-4)
    assert summary["phases"] == {"Running": 4, "Succeeded": 2, "Failed": 2, "Pending": 1}
    assert summary["gpus_by_model"] == {"G2": 8, "T4": 2, "V100M32": 4}
    # p5 was deleted while Pending: its attempt ends then, and its 700 s wait for 1 GPU counts as requested
    (p5,) = warehouse_rows(settings, "SELECT ended_ms, outcome FROM job_attempts WHERE cluster = 'alibaba-v2023' AND job_id = 'p5'")
    assert (p5["ended_ms"], p5["outcome"]) == (1_672_531_200_000 + 900_000, "cancelled")  # trace time 0 = 2023-01-01
    requested = {r["queue"]: r["s"] for r in warehouse_rows(settings, """
        SELECT queue, sum(requested_gpu_seconds) AS s FROM queue_efficiency WHERE cluster = 'alibaba-v2023' GROUP BY queue""")}
    assert requested["BE"] == pytest.approx(expected_requested_gpu_seconds(pods_csv)["BE"], abs=1e-3)
    # the summary can be printed again from the warehouse alone
    assert main(["replay-trace", "alibaba-v2023", "--summary-only"]) == 0
    assert json.loads(capsys.readouterr().out) == summary
    assert_conserved(capacity_rows(settings))


def test_genai_replay_matches_the_samples(traces_dir, make_settings, assert_conserved):
    """A deterministic subset (the first GENAI_CI_PODS pods) keeps CI within minutes on 2 cores;
    the CLI replays all 143 pods by default (docs/traces.md has the full figures and timings)."""
    duty = traces_dir / "alibaba-genai" / "pod_gpu_duty_cycle_anon.tar.gz"
    memory = traces_dir / "alibaba-genai" / "pod_gpu_memory_used_bytes_anon.tar.gz"
    settings = make_settings()
    summary = replay_genai(settings, duty, memory, max_pods=GENAI_CI_PODS)
    assert_conserved(capacity_rows(settings))
    expected = expected_genai(duty, max_pods=GENAI_CI_PODS, default_execution=summary["default_execution"], memory_path=memory)
    assert_matches({k: summary[k] for k in expected}, expected)
    # the acceptance figure: the ledger's idle line under the zero-duty definition = the trace's idle
    assert summary["ledger_allocated_idle_gpu_hours"] == pytest.approx(summary["idle_allocation_gpu_hours"], rel=0.01)
    assert 0 < summary["ledger_allocated_idle_gpu_hours_default_definition"] <= summary["ledger_allocated_idle_gpu_hours"]
    assert summary["span_hours"] <= 22.9 and summary["mem_used_gib_mean"] > 0  # both checked above too
