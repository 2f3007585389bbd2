"""Agent cost: CPU per tick of an 8-GPU node with the simulated NVML backend, at 1 s sampling.

Two figures:
- in process: `build_tick` (the simulated backend's sampling + the NodeTick model) and
  `encode`, then the ledger's publisher (an in-memory ListPublisher), over many back-to-back
  ticks; CPU per tick / 1 s interval = share of one core. This is our own code's cost.
- live: `gpuledger agent gpu --backend sim --interval 1` as a child process publishing to the
  broker through the real (librdkafka) publisher; its utime+stime over a window of whole
  seconds after start-up / the window = share of one core, Kafka client threads included.
NVML calls per tick: the backend's `calls_last_tick` (the sim counts what NVML would be asked).
"""

from __future__ import annotations

import time

from gpuledger.agents.gpu_agent import build_tick, next_grid_ms
from gpuledger.agents.publisher import ListPublisher
from gpuledger.agents.sim_backend import SimBackend, SimProcess, parse_sim_models
from gpuledger.embedded.processes import ChildProcess
from gpuledger.schemas.wire import encode
from gpuledger.topics import create_topics

from bench.common import SIZES, bench_settings, say, workdir
from bench.join import cpu_seconds

INTERVAL_MS = 1000


def in_process(ticks: int) -> dict:
    backend = SimBackend(parse_sim_models("8xA100-80GB"), seed=1, node="bench-node")
    for i in range(8):  # busy GPUs with two containers each: every field and process filled in
        backend.set_gpu(i, util_pct=70.0, processes=[SimProcess(pid=100 + 2 * i, container_id=f"c{i}a", sm_util_pct=40.0,
                                                                 mem_used_bytes=20 << 30),
                                                      SimProcess(pid=101 + 2 * i, container_id=f"c{i}b", sm_util_pct=30.0,
                                                                 mem_used_bytes=10 << 30)])
    pub = ListPublisher()
    base = next_grid_ms(int(time.time() * 1000), INTERVAL_MS)
    calls, size = [], 0
    for i in range(min(50, ticks)):  # warm-up
        pub.publish("t", "bench-node", encode(build_tick(backend, cluster="c", node="bench-node",
                                                         now_ms=base - (100 - i) * INTERVAL_MS, interval_ms=INTERVAL_MS)))
    pub.messages.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(ticks):
        tick = build_tick(backend, cluster="c", node="bench-node", now_ms=base + i * INTERVAL_MS, interval_ms=INTERVAL_MS)
        raw = encode(tick)
        pub.publish("t", "bench-node", raw)
        calls.append(backend.calls_last_tick)
        size = len(raw)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    per_tick = cpu / ticks
    return {
        "ticks": ticks, "gpus": 8, "message_bytes": size,
        "cpu_ms_per_tick": 1000 * per_tick, "wall_ms_per_tick": 1000 * wall / ticks,
        "core_share_at_1hz": per_tick / (INTERVAL_MS / 1000),
        "nvml_calls_per_tick": sum(calls) / len(calls), "nvml_calls_per_tick_max": max(calls),
    }


def live(bootstrap: str, seconds: float) -> dict:
    s = bench_settings(bootstrap, "agent")
    create_topics(s)
    logs = workdir() / "logs"
    logs.mkdir(exist_ok=True)
    with ChildProcess(s, "agent", "--bootstrap", bootstrap, "gpu", "--backend", "sim", "--sim-gpus", "8xA100-80GB",
                      "--interval", "1", "--node", "bench-node", "--log-level", "WARNING",
                      log_path=logs / "agent.log") as agent:
        time.sleep(4.0)  # imports, producer connect, first ticks
        agent.check_alive()
        c0, w0 = cpu_seconds(agent.proc.pid), time.monotonic()
        time.sleep(seconds)
        agent.check_alive()
        c1, w1 = cpu_seconds(agent.proc.pid), time.monotonic()
    window = w1 - w0
    return {"window_s": window, "cpu_s": c1 - c0, "core_share": (c1 - c0) / window,
            "cpu_ms_per_tick": 1000 * (c1 - c0) / window, "clock_tick_resolution_s": 0.01}


def run(bootstrap: str | None) -> dict:
    say(f"agent: {SIZES.agent_ticks} in-process ticks of an 8-GPU node ...")
    inproc = in_process(SIZES.agent_ticks)
    out = {
        "agent_core_share_1hz_8gpu": inproc["core_share_at_1hz"],
        "agent_cpu_ms_per_tick": inproc["cpu_ms_per_tick"],
        "nvml_calls_per_tick": inproc["nvml_calls_per_tick"],
        "agent_detail": {"in_process": inproc},
    }
    if bootstrap:
        say(f"agent: live agent process at 1 s for {SIZES.agent_live_s:.0f} s ...")
        lv = live(bootstrap, SIZES.agent_live_s)
        out["agent_live_core_share_1hz_8gpu"] = lv["core_share"]
        out["agent_detail"]["live_process"] = lv
    return out


if __name__ == "__main__":
    from gpuledger.embedded.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        for k, v in run(broker.bootstrap).items():
            print(k, v)
