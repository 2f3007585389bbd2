"""Where a worker's CPU goes, sampled: one join pass (bench/join.py) with py-spy attached to the
`gpuledger worker` process for the measured window only, then the baseline on the same topic.

cProfile (`bench.join --profile`) times every Python call, which inflates the many small calls
of the accounting and cannot see inside pydantic-core or the time the cyclic collector takes
in the middle of an allocation. A sampling profiler does neither: py-spy reads the process's
stacks from outside (`--nonblocking`: without pausing it) a few hundred times a second. Each
sample is put in one part of the work by a ledger function on its stack (`PARTS`, in their
order), else in the Kafka shell, by the code running:

    .venv/bin/pip install 'py-spy>=0.4'     # or: make bench-profile (installs it and runs this)
    .venv/bin/python -m bench.spy            # prints the parts, writes $GPULEDGER_BENCH_DIR/spy.json

py-spy needs to be allowed to ptrace the worker (in a container: --cap-add SYS_PTRACE).
Each part's CPU per tick is its share of the samples times the worker's measured CPU per tick;
"ratio without it" is the join ratio the same pass would have had with that part costing nothing
and the rest unchanged (the worker was CPU-bound: it assumes time scales with CPU)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from bench.common import SIZES, say, workdir

#: (part, ledger function names): a sample belongs to the first part, in this order, one of whose
#: functions is anywhere on its stack (the order matters where they nest: on_node calls the others)
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("samples: validation (pydantic)", ("decode_metered_ticks",)),
    ("samples: accounting (join, attribution, segments)", ("NodeJoin.close_until",)),
    ("job events: routing", ("WorkerCore.on_lifecycle",)),
    ("samples and allocations: checks, buffering, outputs", ("WorkerCore.on_node",)),
    ("snapshots", ("WorkerCore.snapshot", "WorkerCore.covered_offsets")),
)
SHELL = "Kafka shell (Faust, mode, aiokafka, asyncio, metrics)"

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")


def frame_function(frame: str) -> tuple[str, str]:
    """(function, file) of one frame of py-spy's raw (collapsed) output: 'func (path:line)'."""
    m = _FRAME.match(frame.strip())
    return (m.group("func"), m.group("file")) if m else (frame.strip(), "")


#: first path parts of the ledger's own code, as py-spy names files (relative to sys.path)
LEDGER_DIRS = ("gpuledger", "streams", "schemas", "agents", "sql")


def shell_package(file: str) -> str:
    """What a frame outside the ledger's parts belongs to: a package (py-spy names a file relative
    to its sys.path entry: 'faust/topics.py'), the ledger's own code, or a stdlib module."""
    file = file.split("site-packages/", 1)[-1]
    top, sep, _ = file.partition("/")
    if not sep:
        return f"stdlib: {file}" if file else "native (no Python frame)"
    return f"ledger: {file}" if top in LEDGER_DIRS else top


def group_samples(lines) -> dict:
    """Samples of py-spy's raw output per part (PARTS, else the shell), and the shell's by package
    of the frame running. Lines: 'frame;frame;...;leaf COUNT'; a bare COUNT is time with no Python
    frame on the stack (native code between frames); blank lines are skipped."""
    parts: Counter[str] = Counter()
    shell: Counter[str] = Counter()
    total = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line: {line[:200]!r}")
        n = int(count)
        total += n
        if not stack:
            parts[SHELL] += n
            shell["native (no Python frame)"] += n
            continue
        frames = [frame_function(f) for f in stack.split(";")]
        functions = [function for function, _ in frames]
        part = next((name for name, names in PARTS if any(f in names for f in functions)), None)
        if part is None:
            parts[SHELL] += n
            shell[shell_package(frames[-1][1])] += n
        else:
            parts[part] += n
    return {"samples": total, "parts": dict(parts), "shell": dict(shell)}


def ratio_without(grouped: dict, join_ratio: float, parts) -> float:
    """The join ratio if these parts cost nothing and the rest the same."""
    rest = grouped["samples"] - sum(grouped["parts"].get(p, 0) for p in parts)
    return join_ratio * grouped["samples"] / rest if rest > 0 else float("inf")


def parts_per_tick(grouped: dict, worker_cpu_us_per_tick: float, join_ratio: float) -> list[dict]:
    """Each part's share of the samples, its CPU per tick, and the join ratio without it."""
    total = grouped["samples"]
    rows = []
    for name in [p for p, _ in PARTS] + [SHELL]:
        share = grouped["parts"].get(name, 0) / total if total else 0.0
        rows.append({"part": name, "share": share, "cpu_us_per_tick": share * worker_cpu_us_per_tick,
                     "ratio_without_it": ratio_without(grouped, join_ratio, [name])})
    return rows


def py_spy() -> str:
    """The py-spy executable: beside this Python's (a venv's bin/), else on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install 'py-spy>=0.4' (or make bench-profile)")
    return found


@contextmanager
def sampled(pids: list[int], out_dir: Path, rate_hz: int = 250):
    """py-spy recording each pid (raw collapsed stacks, one file each) while the block runs."""
    exe = py_spy()
    spies = []
    for i, pid in enumerate(pids):
        err = open(out_dir / f"spy{i}.err", "wb")
        spies.append((subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", str(rate_hz), "--format",
                                        "raw", "--nonblocking", "-o", str(out_dir / f"spy{i}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=err), err))
    try:
        yield
    finally:
        for proc, _ in spies:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for proc, err in spies:
            proc.wait(60)
            err.close()


def run(bootstrap: str, broker_pid: int | None = None) -> dict:
    from bench.join import baseline, make_batch, worker_pass

    out_dir = workdir() / "spy"
    out_dir.mkdir(exist_ok=True)
    for old in out_dir.glob("spy*"):
        old.unlink()
    py_spy()  # fail before the pass, not after it
    batch = make_batch(SIZES.join_nodes, SIZES.join_hours)
    one = worker_pass(bootstrap, batch, 1, "joinspy", broker_pid=broker_pid,
                      observe=lambda pids: sampled(pids, out_dir))
    base = baseline(one.pop("settings"), batch)
    raw = out_dir / "spy0.txt"
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing; see {out_dir / 'spy0.err'}")
    grouped = group_samples(raw.read_text().splitlines())
    ratio = one["samples_per_s"] / base["samples_per_s"]
    return {"pass": one, "baseline": base, "join_ratio": ratio,
            "baseline_cpu_us_per_tick": 1e6 * base["cpu_s"] / batch.ticks,
            "grouped": grouped, "parts": parts_per_tick(grouped, one["worker_cpu_us_per_tick"], ratio),
            "ratio_without_validation_and_accounting": ratio_without(grouped, ratio, [p for p, _ in PARTS[:2]]),
            "ratio_shell_alone": ratio_without(grouped, ratio, [p for p, _ in PARTS]),
            "raw_stacks": str(raw)}


def report(result: dict) -> str:
    one, grouped = result["pass"], result["grouped"]
    lines = [f"one worker: {one['samples_per_s']:,.0f} samples/s, {one['worker_cpu_us_per_tick']:.0f} us CPU per "
             f"8-GPU tick ({one['worker_cores_busy']:.2f} cores busy); baseline "
             f"{result['baseline']['samples_per_s']:,.0f} samples/s, {result['baseline_cpu_us_per_tick']:.0f} us "
             f"CPU per tick; join ratio {result['join_ratio']:.3f}; {grouped['samples']} stack samples",
             f"{'part':<55} {'share':>6} {'us/tick':>8} {'ratio without it':>17}"]
    for row in result["parts"]:
        lines.append(f"{row['part']:<55} {row['share']:6.1%} {row['cpu_us_per_tick']:8.1f} "
                     f"{row['ratio_without_it']:17.3f}")
    lines.append(f"join ratio with validation and accounting costing nothing: "
                 f"{result['ratio_without_validation_and_accounting']:.3f}; with every part but the shell costing "
                 f"nothing: {result['ratio_shell_alone']:.3f}")
    total = grouped["samples"] or 1
    lines.append("the shell, by the code running: " + ", ".join(
        f"{k} {v / total:.1%}" for k, v in sorted(grouped["shell"].items(), key=lambda kv: -kv[1])[:8]))
    return "\n".join(lines)


if __name__ == "__main__":
    from gpuledger.embedded.broker import EmbeddedBroker

    with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
        result = run(broker.bootstrap, broker_pid=broker.pid)
    result["pass"].pop("settings", None)
    path = workdir() / "spy.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    say(f"spy: {path}")
    print(report(result))
