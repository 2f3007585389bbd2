"""What a short fetch wait costs when there is nothing to read (docs/performance.md §1, flow control).

A worker and a sink with empty topics on the embedded broker (Tansu answers a waiting fetch only
when the wait ends, so each consumer polls once per `GPULEDGER_KAFKA_FETCH_MAX_WAIT_MS`); after a
warm-up, the cores each process keeps busy. Alone: `.venv/bin/python -m bench.idle [WAIT_MS ...]`
(default 100 20 100 20: alternated, so drift in the machine's load shows)."""

from __future__ import annotations

import sys
import time

from gpuledger.embedded.broker import EmbeddedBroker
from gpuledger.embedded.processes import ChildProcess
from gpuledger.topics import create_topics

from bench.common import bench_settings, say, workdir
from bench.join import cpu_seconds

WARMUP_S = 25.0
MEASURE_S = 20.0


def idle_cores(bootstrap: str, broker_pid: int, wait_ms: int) -> dict[str, float]:
    s = bench_settings(bootstrap, f"idle{wait_ms}", kafka_fetch_max_wait_ms=wait_ms)
    create_topics(s)
    procs = {"worker": ChildProcess(s, "worker"), "sink": ChildProcess(s, "sink")}
    try:
        for p in procs.values():
            p.start()
        time.sleep(WARMUP_S)
        pids = {name: p.proc.pid for name, p in procs.items()} | {"broker": broker_pid}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        time.sleep(MEASURE_S)
        for p in procs.values():
            p.check_alive()
        return {name: (cpu_seconds(pid) - before[name]) / MEASURE_S for name, pid in pids.items()}
    finally:
        for p in procs.values():
            p.stop()


def main(argv: list[str]) -> int:
    waits = [int(a) for a in argv] or [100, 20, 100, 20]
    with EmbeddedBroker(log_path=workdir() / "tansu-idle.log") as broker:
        for wait in waits:
            cores = idle_cores(broker.bootstrap, broker.pid, wait)
            say(f"idle, fetch wait {wait} ms: cores busy " + ", ".join(f"{k} {v:.3f}" for k, v in cores.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
