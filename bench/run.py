"""`make bench`: every benchmark, a table, and bench/results.json.

    .venv/bin/python -m bench.run                       # full run (~30 min on 2 cores)
    GPULEDGER_BENCH_QUICK=1 .venv/bin/python -m bench.run   # smoke run (~4 min), smaller sizes
    .venv/bin/python -m bench.run --only join,agent     # some stages (core, agent, join, profile, e2e, warehouse, footprint, sizing, queries, slurm, watch, kubernetes)

Sizes can be set one by one with GPULEDGER_BENCH_<NAME> (see bench/common.py: Sizes).
Scratch data (logs, profiles, chDB directories) goes to GPULEDGER_BENCH_DIR (default
$TMPDIR/gpuledger-bench); chDB directories are removed after use. docs/performance.md explains
every figure."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import QUICK, SIZES, load_average, say, workdir

RESULTS = Path(__file__).resolve().parent / "results.json"
STAGES = ("core", "agent", "join", "profile", "e2e", "warehouse", "footprint", "sizing", "queries", "slurm", "watch",
          "kubernetes")

#: (key, label, unit, format, target as (comparison, value) or None)
TABLE = [
    ("join_samples_per_s", "join: 1 Faust worker process", "samples/s", "{:,.0f}", (">=", 100_000)),
    ("join_baseline_samples_per_s", "join baseline: aiokafka + orjson", "samples/s", "{:,.0f}", None),
    ("join_ratio", "join / baseline", "ratio", "{:.3f}", (">=", 0.3)),
    ("join_cpu_ratio", "join / baseline per CPU-second", "ratio", "{:.3f}", None),
    ("join_worker_cpu_us_per_tick", "worker CPU per 8-GPU tick", "us", "{:,.0f}", None),
    ("join_floor_ratio", "Faust + orjson only / baseline (ceiling)", "ratio", "{:.3f}", None),
    ("join_floor_cpu_us_per_tick", "  its CPU per 8-GPU tick", "us", "{:,.0f}", None),
    ("core_samples_per_s", "pure core (no Kafka), per CPU-second", "samples/s", "{:,.0f}", None),
    ("core_us_per_tick", "pure core CPU per 8-GPU tick", "us", "{:,.0f}", None),
    ("scaleout_ratio", "2 workers / 1 worker", "ratio", "{:.2f}", (">=", 1.8)),
    ("usage_rows_per_gpu_hour_5s", "usage rows per GPU-hour at 5 s", "rows", "{:.1f}", ("<=", 70)),
    ("usage_rows_per_gpu_hour_5s_per_tick", "  the same, one record per tick", "rows", "{:.1f}", None),
    ("usage_rows_per_gpu_hour_5s_one_per_holder", "  one record per holder (estimate)", "rows", "{:.1f}", None),
    ("usage_raw_bytes_per_gpu_day", "usage_raw on disk per GPU-day", "bytes", "{:,.0f}", None),
    ("gpu_health_bytes_per_gpu_day", "gpu_health on disk per GPU-day", "bytes", "{:,.0f}", None),
    # bench/sizing.py: every table, one simulated day, times the days each holds under the default retention
    ("warehouse_bytes_per_gpu_at_retention", "warehouse per GPU, tables full", "bytes", "{:,.0f}", None),
    ("warehouse_kept_growth_bytes_per_gpu_day", "  growth of the tables kept for ever", "bytes/GPU-day", "{:,.0f}", None),
    ("agent_core_share_1hz_8gpu", "agent, 8 GPUs @ 1 s (in process)", "% of a core", "pct", ("<", 0.005)),
    ("agent_live_core_share_1hz_8gpu", "agent process incl. librdkafka", "% of a core", "pct", ("<", 0.005)),
    ("nvml_calls_per_tick", "NVML calls per tick (8 GPUs)", "calls", "{:.0f}", None),
    # bench/slurm.py: the Slurm agent's steady poll of the largest cluster over its default interval
    ("slurm_poll_core_share", "Slurm agent poll, largest cluster", "% of a core", "pct", None),
    # bench/watch.py: the watcher's usage messages of the largest cluster, one per node a minute
    ("watch_core_share", "watcher, largest cluster", "% of a core", "pct", None),
    # bench/kubernetes.py: the Kubernetes agent's state file per cycle that changed something, largest cluster
    ("kubernetes_state_bytes_ratio", "k8s agent state written: journal / whole", "ratio", "{:.5f}", None),
    ("writer_rows_per_s", "writer into chDB (ClickHouseWriter)", "rows/s", "{:,.0f}", None),
    ("writer_vs_columnar", "writer / columnar insert baseline", "ratio", "{:.2f}", None),
    ("bill_query_speedup_10m", "month bill: raw / MV at size 1", "x", "{:,.1f}", None),
    ("bill_query_speedup_100m", "month bill: raw / MV at size 2", "x", "{:,.1f}", None),
    ("e2e_latency_p50_s", "e2e from sample publication p50", "s", "{:.2f}", None),
    ("e2e_latency_p99_s", "e2e from sample publication p99", "s", "{:.2f}", None),
    ("e2e_pipeline_latency_p50_s", "e2e from closing watermark p50", "s", "{:.2f}", None),
    # bench/queries.py: every Superset chart's query and every report over N segment rows
    ("query_slowest_s", "slowest dashboard/report query", "s", "{:.3f}", ("<", 1.0)),
]


def _fmt(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{100 * value:.3f} %"
    return fmt.format(value)


def table(results: dict) -> str:
    lines = [f"{'figure':<40} {'value':>14}  {'unit':<12} {'target':<10} met"]
    for key, label, unit, fmt, target in TABLE:
        value = results.get(key)
        met, tgt = "", ""
        if target is not None:
            op, bound = target
            tgt = f"{op} {_fmt(bound, fmt)}"
            if value is not None:
                ok = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
                met = "yes" if ok else "NO"
        lines.append(f"{label:<40} {_fmt(value, fmt):>14}  {unit:<12} {tgt:<10} {met}")
    j = results.get("join_detail", {})
    if j:
        lines.append(f"  join workload: {j['ticks']:,} ticks of 8-GPU nodes at {j['interval_ms']} ms, "
                     f"{j['ticks_per_message']} ticks per message ({j['tick_bytes']:,.0f} B per tick)")
        twos = j.get("two_worker_passes")
        if twos:
            per_pass = ", ".join(f"{t['samples_per_s'] / o['samples_per_s']:.2f}"
                                 for o, t in zip(j["one_worker_passes"], twos))
            each = "; ".join(" + ".join(f"{c:.1f}" for c in t.get("worker_cpu_s_each", ())) for t in twos)
            lines.append(f"  2 workers / 1 per pass: {per_pass}; CPU s of the two workers per pass: {each}; "
                         f"nodes per gpu-samples partition: {[n for _, n in j.get('nodes_per_partition', [])]}")
    rows = results.get("footprint_scaling")
    if rows:
        lines.append("  footprint (5 s sampling, 60-s segments): GPUs | worker CPU us/sample | usage rows/GPU-h | "
                     "usage_raw B/GPU-day | gpu_health B/GPU-day")
        for r in rows:
            lines.append(f"    {r['gpus']:>6,} | {r['worker_cpu_us_per_sample']:>6.2f} | {r['usage_rows_per_gpu_hour']:>6.1f} | "
                         f"{r.get('usage_raw_bytes_per_gpu_day', 0):>10,.0f} | {r.get('gpu_health_bytes_per_gpu_day', 0):>10,.0f}")
    slurm = results.get("slurm_poll_detail")
    if slurm:
        lines.append(f"  Slurm agent, CPU s per poll (first / steady) every {slurm['interval_s']:g} s: " + "; ".join(
            f"{r['gpus']:,} GPUs {r['first_poll_s']:.2f} / {r['steady_poll_s']:.2f}" for r in slurm["sizes"]))
    watch = results.get("watch_detail")
    if watch:
        lines.append("  watcher, CPU per usage message / state snapshot: " + "; ".join(
            f"{r['gpus']:,} GPUs {r['us_per_usage_message']:,.0f} us / {r['snapshot_s']:.2f} s ({r['snapshot_bytes']:,} B)"
            for r in watch["sizes"]))
    k8s = results.get("kubernetes_state_detail")
    if k8s:
        lines.append("  k8s agent state file per changed cycle, journal / whole rewrite: " + "; ".join(
            f"{r['gpus']:,} GPUs {r['journal_bytes_per_cycle']:,} / {r['whole_bytes_per_cycle']:,} B, "
            f"{r['journal_cpu_s']:.3f} / {r['whole_cpu_s']:.3f} s CPU" for r in k8s["sizes"]))
    d = results.get("warehouse_detail", {})
    for key in ("bill_10m", "bill_100m"):
        if key in d:
            b = d[key]
            lines.append(f"  {key}: {b['raw_rows']:,} raw rows, MV {1000 * b['mv_query_s']:.1f} ms vs raw "
                         f"{1000 * b['raw_query_s']:,.0f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated stages of {', '.join(STAGES)}")
    p.add_argument("--output", default=str(RESULTS))
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.only.split(",")] if args.only else list(STAGES)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stage(s) {unknown}; choose from {STAGES}")

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "streams", "schemas", "agents", "gpuledger", "sql"],
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        rev, dirty = "?", False
    results: dict = {
        "meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": QUICK, "sizes": asdict(SIZES),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "git": rev + ("+dirty" if dirty else ""),
                 "load_average_before": load_average(), "stage_seconds": {}, "load_average_after_stage": {}},
    }
    say(f"{'QUICK' if QUICK else 'full'} run of {', '.join(stages)}; scratch in {workdir()}; load {load_average()}")
    t_all = time.monotonic()

    def stage(name: str, fn) -> None:
        if name not in stages:
            return
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:  # one broken stage must not lose the others' figures: reported, exit 1
            import traceback

            say(f"stage {name} FAILED: {exc!r}")
            results["meta"].setdefault("stage_errors", {})[name] = traceback.format_exc()[-4000:]
            return
        results.update(out)
        results["meta"]["stage_seconds"][name] = round(time.monotonic() - t0, 1)
        results["meta"]["load_average_after_stage"][name] = load_average()

    from bench import agent, core, e2e, footprint, join, warehouse

    stage("core", core.measure)
    needs_broker = {"agent", "join", "profile", "e2e"} & set(stages)
    if needs_broker:
        from gpuledger.embedded.broker import EmbeddedBroker

        with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
            stage("agent", lambda: agent.run(broker.bootstrap))
            stage("join", lambda: join.run(broker.bootstrap, scaleout=True, broker_pid=broker.pid))
            stage("profile", lambda: {"worker_profile": join.profile_worker(broker.bootstrap)})
            stage("e2e", lambda: e2e.run(broker.bootstrap))
    else:
        stage("agent", lambda: agent.run(None))
    if "warehouse" in stages:
        stage("warehouse", warehouse.run)
        w = results.get("warehouse_detail", {}).get("writer")
        if w:
            results["writer_vs_columnar"] = w["writer_vs_columnar"]
    stage("footprint", footprint.run)
    if "sizing" in stages:
        from bench import sizing

        stage("sizing", sizing.run)
    if "queries" in stages:
        from bench import queries

        stage("queries", queries.run)
    if "slurm" in stages:
        from bench import slurm

        stage("slurm", slurm.run)
    if "watch" in stages:
        from bench import watch

        stage("watch", watch.run)
    if "kubernetes" in stages:
        from bench import kubernetes

        stage("kubernetes", kubernetes.run)
    results["meta"]["total_seconds"] = round(time.monotonic() - t_all, 1)

    out = Path(args.output)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print()
    print(table(results))
    print()
    print(f"{'QUICK (smoke) sizes' if QUICK else 'full sizes'}; {os.cpu_count()} CPUs; load average before "
          f"{results['meta']['load_average_before']}; {results['meta']['total_seconds']:.0f} s; written to {out}")
    failed = results["meta"].get("stage_errors", {})
    if failed:
        print(f"FAILED stages (tracebacks in {out}, meta.stage_errors): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
