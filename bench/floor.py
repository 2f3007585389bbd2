"""The Faust floor: what the worker's framework alone costs per tick, and so the highest join ratio
any Faust worker can reach on this machine (issue #13 point 6; docs/performance.md §1).

A Faust app built exactly as the worker's (`streams.app.new_ledger_app`: the same transport,
fetch wait, stream buffer and partitions) with one agent on gpu-samples that decodes each value
with orjson, as the baseline does, counts its GPU samples and does nothing else: no validation,
no join, no outputs, Faust acknowledging as usual. Measured as the worker is (bench/join.py): the
process is stopped while the batch's gpu-samples messages are published, and timed from SIGCONT
until it has seen them all (it writes the moment to a file). Its samples/s over the baseline's
is the ceiling of `join_ratio` for a worker on Faust, whatever its accounting and decoding cost.

    .venv/bin/python -m bench.floor          # a batch, then the floor and the baseline, join_repeats times
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import orjson

from gpuledger.config import Settings
from gpuledger.embedded.processes import ChildProcess
from gpuledger.schemas.lines import LINE_SAMPLES
from gpuledger.topics import create_topics

from bench.common import SIZES, bench_settings, median, say, workdir

#: where the floor process writes "messages seen, time" when it reaches a count it was told to
MARKS_ENV = "GPULEDGER_BENCH_FLOOR_MARKS"
REPORT_ENV = "GPULEDGER_BENCH_FLOOR_REPORT"


def floor_app(settings: Settings, marks: list[int], report: Path):
    """The worker's Faust app with one agent that only reads and parses gpu-samples."""
    from gpuledger.streams.app import new_ledger_app

    from bench.join import message_samples

    (settings.data_dir / "floor").mkdir(parents=True, exist_ok=True)
    app = new_ledger_app(settings, settings.worker_app_id, str(settings.data_dir / "floor"),
                         topic_partitions=settings.partitions_gpu_samples, stream_buffer_maxsize=256)
    samples_topic = app.topic(settings.topics.gpu_samples, partitions=settings.partitions_gpu_samples,
                              value_serializer="raw", key_serializer="raw")
    seen = {"messages": 0, "samples": 0}
    todo = sorted(marks)

    @app.agent(samples_topic, name="floor")
    async def floor(stream):
        async for value in stream:
            seen["samples"] += message_samples(orjson.loads(value))
            seen["messages"] += 1
            if todo and seen["messages"] >= todo[0]:
                todo.pop(0)
                with report.open("a") as f:
                    f.write(json.dumps({**seen, "t": time.time()}) + "\n")

    return app


def _reports(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _wait_report(path: Path, count: int, proc: ChildProcess, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.check_alive()
        done = [r for r in _reports(path) if r["messages"] >= count]
        if done:
            return done[0]
        time.sleep(0.05)
    raise TimeoutError(f"the floor did not see {count} messages within {timeout_s:.0f}s")


def floor_pass(bootstrap: str, batch, name: str) -> dict:
    """The floor over the batch's gpu-samples messages; returns samples/s and CPU per tick.
    `batch`: a bench.join Batch."""
    from bench.join import WARM_NODES, cpu_seconds, peak_rss_mb, publish, warmup_messages

    s = bench_settings(bootstrap, name)
    create_topics(s)
    warm = [m for m in warmup_messages(batch.start_ms, s.partitions_job_events) if m[0] == LINE_SAMPLES]
    samples = [m for m in batch.messages if m[0] == LINE_SAMPLES]
    assert len(warm) == WARM_NODES
    report = workdir() / f"{name}-floor.jsonl"
    report.unlink(missing_ok=True)
    log = workdir() / "logs" / f"{name}-floor.log"
    log.parent.mkdir(exist_ok=True)
    proc = ChildProcess(s, command=[sys.executable, "-m", "bench.floor", "--serve"], log_path=log,
                        extra_env={MARKS_ENV: f"{len(warm)},{len(warm) + len(samples)}", REPORT_ENV: str(report)})
    proc.start()
    try:
        publish(s, warm)
        _wait_report(report, len(warm), proc, timeout_s=120)
        time.sleep(1.0)
        proc.proc.send_signal(signal.SIGSTOP)
        try:
            publish(s, samples)
        finally:
            proc.proc.send_signal(signal.SIGCONT)
        t0, cpu0 = time.time(), cpu_seconds(proc.proc.pid)
        end = _wait_report(report, len(warm) + len(samples), proc, timeout_s=600)
        cpu = cpu_seconds(proc.proc.pid) - cpu0
        seconds = end["t"] - t0
        return {"samples": batch.samples, "seconds": seconds, "samples_per_s": batch.samples / seconds,
                "cpu_s": cpu, "cpu_us_per_tick": 1e6 * cpu / batch.ticks,
                "samples_per_cpu_s": batch.samples / cpu if cpu else float("nan"),
                "peak_rss_mb": peak_rss_mb(proc.proc.pid), "settings": s}
    finally:
        proc.stop()


def run(bootstrap: str, batch=None) -> dict:
    """Floor passes, each with its own baseline read of the same topic (medians over the repeats)."""
    from bench.join import baseline, make_batch

    batch = batch or make_batch(SIZES.join_nodes, SIZES.join_hours)
    floors, bases = [], []
    for rep in range(SIZES.join_repeats):
        floor = floor_pass(bootstrap, batch, f"floor{rep}")
        base = baseline(floor.pop("settings"), batch)
        base["cpu_us_per_tick"] = 1e6 * base["cpu_s"] / batch.ticks
        say(f"floor: Faust + orjson only: {floor['samples_per_s']:,.0f} samples/s ({floor['cpu_us_per_tick']:.0f} us "
            f"CPU/tick); baseline {base['samples_per_s']:,.0f} samples/s ({base['cpu_us_per_tick']:.0f} us "
            f"CPU/tick): ratio {floor['samples_per_s'] / base['samples_per_s']:.3f}")
        floors.append(floor)
        bases.append(base)
    return {
        "join_floor_ratio": median([f["samples_per_s"] / b["samples_per_s"] for f, b in zip(floors, bases)]),
        "join_floor_cpu_us_per_tick": median([f["cpu_us_per_tick"] for f in floors]),
        "join_floor_baseline_cpu_us_per_tick": median([b["cpu_us_per_tick"] for b in bases]),
        "join_floor_detail": {"floor_passes": floors, "baseline_passes": bases},
    }


def _serve() -> None:
    import faust

    marks = [int(x) for x in os.environ[MARKS_ENV].split(",")]
    app = floor_app(Settings(), marks, Path(os.environ[REPORT_ENV]))
    faust.Worker(app, loglevel="info", quiet=True).execute_from_commandline()


if __name__ == "__main__":
    if "--serve" in sys.argv:
        _serve()
    else:
        from gpuledger.embedded.broker import EmbeddedBroker

        with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
            for k, v in run(broker.bootstrap).items():
                print(k, v)
