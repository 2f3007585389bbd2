"""Running a replay through the embedded pipeline (`gpuledger replay-trace`): progress while publishing and draining, the summaries, the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuledger.embedded.pipeline import Stage, hold_data_dir
from gpuledger.embedded.processes import group_lag
from gpuledger.traces.genai import check_genai_files, convert_genai, read_genai_samples
from gpuledger.traces.readers import CLUSTER_GENAI, CLUSTER_V2023, TRACES, Emissions, TraceError, say
from gpuledger.traces.summary import genai_summary, has_replay, v2023_summary
from gpuledger.traces.v2023 import convert_v2023, read_nodes, read_pods



# =========================================================================== running a replay
def _progress(emissions: Emissions, label: str, log: Callable[[str], None]) -> Callable[[int, int], None]:
    started = time.monotonic()
    span = max(1, emissions.end_ms - emissions.start_ms)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - last[0] < 2.0:
            return
        last[0] = now
        position = (emissions.last_ts_ms - emissions.start_ms) / 86_400_000
        rate = done / max(1e-6, now - started)
        log(f"[replay-trace] {label}: published {done}/{total} messages ({100 * done / max(1, total):.0f}%), "
            f"event time day {position:.2f} of {span / 86_400_000:.2f}, {rate:.0f} msg/s")

    return progress


class DrainReporter:
    """Progress while the worker and the sink drain what was published: `run_embedded` reports
    its stages to `on_stage`; while it waits on a consumer group, a thread logs that group's lag
    every few seconds (run_embedded itself says nothing while it waits)."""

    def __init__(self, log: Callable[[str], None], every_s: float = 5.0):
        self.log = log
        self.every_s = every_s
        self.stage: Stage | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_stage(self, stage: Stage) -> None:
        self.stage = stage
        if stage.name == "done":
            self.stop()
        elif stage.group and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="replay-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.every_s):
            stage = self.stage
            try:
                lag = group_lag(stage.settings, stage.group, list(stage.topics))
            except Exception:  # the broker is going away, or the group is rebalancing: ask later
                continue
            if not self._stop.is_set():
                self.log(f"[replay-trace] {stage.name}: {lag} message(s) still to process ({time.monotonic() - started:.0f}s)")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def _summarize(settings, fn: Callable[[Any, str], dict], cluster: str) -> dict:
    """`fn`'s summary of `cluster`; TraceError when the warehouse holds no replay of it (a data
    directory re-used by another replay or a demo would otherwise give an all-zero summary)."""
    from gpuledger.warehouse import connect

    client = connect(settings)
    try:
        if not has_replay(client, cluster):
            raise TraceError(f"no {cluster} replay in this data directory ({Path(settings.data_dir).resolve()}): "
                             f"replay it first (gpuledger replay-trace {cluster} ...)")
        return fn(client, cluster)
    finally:
        client.close()


#: In the data directory while a replay runs: one stopped (SIGTERM) or failed leaves it, so that
#: `--summary-only` does not print a partial warehouse's figures as the trace's.
REPLAY_UNFINISHED = "replay-unfinished.txt"


def unfinished_replay(settings) -> str | None:
    """The trace of a replay in this data directory that did not finish, or None."""
    path = Path(settings.data_dir) / REPLAY_UNFINISHED
    return path.read_text().strip() if path.exists() else None


def forget_genai_default(settings) -> None:
    """Remove the GenAI default-definition figure: a new replay replaces the warehouse it belongs to."""
    (Path(settings.data_dir) / GENAI_DEFAULT_RESULT).unlink(missing_ok=True)


def replay_v2023(settings, pods_path: str | Path, nodes_path: str | Path, *, log: Callable[[str], None] = say) -> dict:
    """Convert, push through the embedded pipeline (the sink stores the node inventory), summarize."""
    from gpuledger.embedded.pipeline import run_embedded

    t0 = time.monotonic()
    pods, nodes = read_pods(pods_path), read_nodes(nodes_path)
    replay = convert_v2023(pods, nodes)
    log(f"[replay-trace] alibaba-v2023: {len(pods)} pods, {len(nodes)} nodes -> {len(replay.emissions)} messages "
        f"{replay.counts} in {time.monotonic() - t0:.1f}s; {len(replay.unplaced_pods)} pod(s) found no room in first-fit "
        "placement (synthetic GPUs)")
    drain = DrainReporter(log)
    try:
        with hold_data_dir(settings.data_dir):
            forget_genai_default(settings)
            unfinished = Path(settings.data_dir) / REPLAY_UNFINISHED
            unfinished.write_text(replay.cluster)
            run = run_embedded(settings, replay.emissions, progress=_progress(replay.emissions, "alibaba-v2023", log),
                               log=log, on_stage=drain.on_stage)
            unfinished.unlink()
    finally:
        drain.stop()
    summary = _summarize(settings, v2023_summary, replay.cluster)
    log(f"[replay-trace] alibaba-v2023: pipeline {run.seconds:.0f}s, total {time.monotonic() - t0:.0f}s")
    return summary


#: The definition under which the ledger's idle line counts what the summary's
#: `idle_allocation_gpu_hours` counts: held time at zero duty cycle, no minimum quiet stretch.
GENAI_EXECUTION = {"source": "both", "util_floor_pct": 0.0, "min_idle_s": 0.0}
#: Where the replay under the default definition keeps its figure (inside the data directory).
GENAI_DEFAULT_RESULT = "genai-default-definition.json"


def replay_genai(settings, duty_path: str | Path, memory_path: str | Path, *, max_pods: int | None = None,
                 log: Callable[[str], None] = say) -> dict:
    """Replay the GenAI trace twice through the real pipeline: first under the ledger's default
    execution definition (into DATA_DIR/default-definition, keeping only its idle figure), then under
    GENAI_EXECUTION into DATA_DIR, whose warehouse the summary reads."""
    from gpuledger.ledger_files import load_ledger_config, write_ledger_variant

    t0 = time.monotonic()
    duty, memory = read_genai_samples(duty_path), read_genai_samples(memory_path)
    check_genai_files(duty, memory, duty_path, memory_path)
    replay = convert_genai(duty, memory, max_pods=max_pods)
    log(f"[replay-trace] alibaba-genai: {len(duty)} duty / {len(memory)} memory samples -> {len(replay.emissions)} "
        f"messages {replay.counts} in {time.monotonic() - t0:.1f}s")
    default_settings = settings.model_copy(update={"data_dir": Path(settings.data_dir) / "default-definition"})
    default = load_ledger_config(settings.ledger_config).definitions
    with hold_data_dir(settings.data_dir):  # both runs: no other replay or demo empties it in between
        # written under the lock: a replay that is refused must not replace the config of the one running
        zero_duty_config = write_ledger_variant(settings.ledger_config, Path(settings.data_dir) / "ledger-zero-duty.toml",
                                                suffix="zero-duty", execution=GENAI_EXECUTION)
        forget_genai_default(settings)
        unfinished = Path(settings.data_dir) / REPLAY_UNFINISHED
        unfinished.write_text(replay.cluster)
        _replay_genai_runs(settings, default_settings, zero_duty_config, default, replay, log)
        unfinished.unlink()
        summary = genai_summary_with_default(settings)
    log(f"[replay-trace] alibaba-genai: total {time.monotonic() - t0:.0f}s")
    return summary


def _replay_genai_runs(settings, default_settings, zero_duty_config, default, replay, log) -> None:
    from gpuledger.embedded.pipeline import run_embedded

    for label, run_settings in (("default definition", default_settings),
                                ("zero-duty definition", settings.model_copy(update={"ledger_config": zero_duty_config}))):
        log(f"[replay-trace] alibaba-genai: replay under the {label}")
        drain = DrainReporter(log)
        try:
            run = run_embedded(run_settings, replay.emissions, progress=_progress(replay.emissions, "alibaba-genai", log),
                               log=log, on_stage=drain.on_stage)
        finally:
            drain.stop()
        log(f"[replay-trace] alibaba-genai: pipeline {run.seconds:.0f}s")
        if run_settings is default_settings:
            idle = _summarize(default_settings, genai_summary, replay.cluster)["ledger_allocated_idle_gpu_hours"]
            (Path(settings.data_dir) / GENAI_DEFAULT_RESULT).write_text(json.dumps({
                "ledger_allocated_idle_gpu_hours": idle,
                "execution": {"source": default.execution_source, "util_floor_pct": default.execution_util_floor_pct,
                              "min_idle_s": default.execution_min_idle_s}}))


def genai_summary_with_default(settings) -> dict:
    """The GenAI summary (under GENAI_EXECUTION) with the idle figure of the default definition beside it."""
    summary = _summarize(settings, genai_summary, CLUSTER_GENAI)
    summary["execution"] = GENAI_EXECUTION
    path = Path(settings.data_dir) / GENAI_DEFAULT_RESULT
    if path.exists():
        default = json.loads(path.read_text())
        summary["ledger_allocated_idle_gpu_hours_default_definition"] = default["ledger_allocated_idle_gpu_hours"]
        summary["default_execution"] = default["execution"]
    return summary


# =========================================================================== CLI
def _settings(args):
    from gpuledger.config import Settings

    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = Path(args.data_dir)
    return Settings(**overrides)


#: The options of each trace that belong to the other one.
OTHER_TRACE_OPTIONS = {CLUSTER_V2023: ("duty", "memory", "max_pods"), CLUSTER_GENAI: ("pods", "nodes")}


def cmd_replay_trace(args) -> int:
    settings = _settings(args)
    try:
        # an option of the other trace is a mistake (e.g. --max-pods on v2023 would replay all 149 days)
        for option in OTHER_TRACE_OPTIONS[args.trace]:
            if getattr(args, option) is not None:
                raise TraceError(f"--{option.replace('_', '-')} does not apply to {args.trace}")
        if args.summary_only and (unfinished := unfinished_replay(settings)):
            raise TraceError(f"the last replay in {Path(settings.data_dir).resolve()} ({unfinished}) did not finish "
                             "(stopped or failed): its tables are partial; replay the trace again")
        if args.trace == "alibaba-v2023":
            missing = [f for f in ("pods", "nodes") if not getattr(args, f)]
            if missing and not args.summary_only:
                raise TraceError("alibaba-v2023 needs --pods PODS.csv and --nodes NODES.csv")
            summary = (_summarize(settings, v2023_summary, CLUSTER_V2023) if args.summary_only
                       else replay_v2023(settings, args.pods, args.nodes))
        else:
            missing = [f for f in ("duty", "memory") if not getattr(args, f)]
            if missing and not args.summary_only:
                raise TraceError("alibaba-genai needs --duty DUTY.tar.gz|csv and --memory MEM.tar.gz|csv")
            summary = (genai_summary_with_default(settings) if args.summary_only
                       else replay_genai(settings, args.duty, args.memory, max_pods=args.max_pods))
    except TraceError as exc:
        print(f"replay-trace: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add `replay-trace` to the gpuledger CLI (called from gpuledger/cli.py's build_parser)."""
    help_text = "replay a public GPU trace (alibaba-v2023, alibaba-genai) through the embedded pipeline and print a JSON summary"
    p = subparsers.add_parser("replay-trace", help=help_text, description=help_text + ". Traces: docs/traces.md.")
    p.set_defaults(func=cmd_replay_trace)
    p.add_argument("trace", choices=TRACES)
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--pods", help="alibaba-v2023: pod list CSV (openb_pod_list_*.csv)")
    p.add_argument("--nodes", help="alibaba-v2023: node list CSV (openb_node_list_all_node.csv)")
    p.add_argument("--duty", help="alibaba-genai: pod_gpu_duty_cycle_anon.tar.gz (or the CSV inside)")
    p.add_argument("--memory", help="alibaba-genai: pod_gpu_memory_used_bytes_anon.tar.gz (or the CSV inside)")
    p.add_argument("--max-pods", type=positive_int, help="alibaba-genai: replay only the first N pods (in order of first sample)")
    p.add_argument("--summary-only", action="store_true",
                   help="do not replay: print the summary of the replay already in the data directory")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m gpuledger.traces.run replay-trace ...` (the same as `gpuledger replay-trace ...`)."""
    parser = argparse.ArgumentParser(prog="gpuledger")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from gpuledger.cli import exit_on_sigterm

    with exit_on_sigterm():
        return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
