"""The GPU agent: one `NodeTick` per interval, on a grid shared by every node, keyed by node name
(sent one at a time, or GPULEDGER_AGENT_TICKS_PER_MESSAGE at a time as a `NodeTickBatch`).

Ticks fall on multiples of the interval since the Unix epoch, so samples from a thousand
nodes line up and the worker can join them without resampling. A tick that overran (slow
NVML, a stalled publish) skips the grid points it missed rather than publishing late
duplicates: each grid time is published at most once. For the same reason a clock stepped
backwards is waited out (grid times already taken are not sampled again), but in sleeps of at
most one interval, so sampling resumes on time once the clock is corrected.

    python -m gpuledger.agents.gpu_agent --backend nvml --once --print    # one tick as JSON, no Kafka
    python -m gpuledger.agents.gpu_agent --backend sim --sim-gpus 4xA100-80GB   # publish forever

Publishing goes through a local disk spool (agents/spool.py): each tick is written to disk
first and deleted once the broker has acknowledged it, so a broker outage or an agent crash
loses nothing (up to GPULEDGER_AGENT_SPOOL_MAX_BYTES; beyond that the oldest ticks are dropped
and counted). GPULEDGER_AGENT_METRICS_PORT serves Prometheus metrics (gpuledger/metrics.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from gpuledger.agents.backend import GpuBackend
from gpuledger.schemas.models import NodeTick, NodeTickBatch
from gpuledger.schemas.wire import encode, encode_node_ticks

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
#: A batch larger than this is sent as several messages: Kafka's default limit is 1 MB per message
#: (an 8-GPU tick is ~5.6 KB, so ~160 ticks fit).
MAX_MESSAGE_BYTES = 900_000
#: The most ticks one `NodeTickBatch` may hold: the wire model's own limit (`ticks` max_length), read
#: from it so that the agent's check and its batch splitting cannot drift from the schema.
MAX_TICKS_PER_MESSAGE: int = next(m.max_length for m in NodeTickBatch.model_fields["ticks"].metadata
                                  if hasattr(m, "max_length"))


class Publisher(Protocol):
    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> None: ...
    def poll(self, timeout: float = 0) -> int: ...


def build_tick(backend: GpuBackend, *, cluster: str, node: str, now_ms: int, interval_ms: int) -> NodeTick:
    """Measure every GPU of the node now: the pure-ish core of the agent (no Kafka, no clock)."""
    gpus = sorted(backend.sample(now_ms), key=lambda g: g.index)
    return NodeTick(cluster=cluster, node=node, ts_ms=now_ms, interval_ms=interval_ms, gpus=gpus)


def next_grid_ms(now_ms: int, interval_ms: int) -> int:
    """The first grid point at or after now_ms."""
    return -(-now_ms // interval_ms) * interval_ms


def run_agent(
    backend: GpuBackend,
    publisher: Publisher,
    topic: str,
    *,
    cluster: str,
    node: str,
    interval_s: float = DEFAULT_INTERVAL_S,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] = time.sleep,
    max_ticks: int | None = None,
    stop: threading.Event | None = None,
    metrics: Any = None,
    ticks_per_message: int = 1,
) -> int:
    """Sample one tick per grid point until `stop` is set or `max_ticks` were taken.

    Ticks are published `ticks_per_message` at a time: 1 sends each as a `NodeTick` as soon as it
    is taken; N sends a `NodeTickBatch` of N consecutive ticks (fewer messages for the brokers
    and workers, N - 1 intervals more latency); what is held when the agent stops goes out then.
    Returns the number of ticks published (handed to `publisher`: with the spool on, a
    `SpoolingPublisher`). `clock` (epoch seconds) and `sleep` are injectable; with a `stop`
    event and the default sleep, waits end as soon as stop is set. `metrics`: an
    `gpuledger.metrics.AgentMetrics` (optional)."""
    interval_ms = round(interval_s * 1000)
    if interval_ms <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")
    if ticks_per_message < 1:
        raise ValueError(f"ticks_per_message must be >= 1, got {ticks_per_message}")
    held: list[NodeTick] = []

    def send(ticks: list[NodeTick]) -> None:
        if len(ticks) > MAX_TICKS_PER_MESSAGE:  # more than one batch may hold: never lose them to a ValidationError
            for i in range(0, len(ticks), MAX_TICKS_PER_MESSAGE):
                send(ticks[i:i + MAX_TICKS_PER_MESSAGE])
            return
        value = encode_node_ticks(node, ticks)
        if len(value) > MAX_MESSAGE_BYTES and len(ticks) > 1:  # stay under the brokers' message size limit
            half = len(ticks) // 2
            send(ticks[:half])
            send(ticks[half:])
            return
        publisher.publish(topic, node, value)
        publisher.poll(0)

    if sleep is time.sleep and stop is not None:
        sleep = stop.wait
    published = 0
    skipped = 0
    last_read_ms = int(clock() * 1000)
    due_ms = next_grid_ms(last_read_ms, interval_ms)
    try:
        while (max_ticks is None or published + len(held) < max_ticks) and not (stop is not None and stop.is_set()):
            now_ms = int(clock() * 1000)
            if now_ms < last_read_ms - interval_ms:
                log.warning("clock went back by at least %d ms: no ticks until it reaches the next grid point %d again "
                            "(grid times already sampled are not sampled twice)", last_read_ms - now_ms, due_ms)
            last_read_ms = now_ms
            if now_ms < due_ms:
                # At most one interval per sleep, then re-read the clock: a sleep can end early, and a
                # clock stepped backwards may be corrected meanwhile (waiting out the whole step would
                # stop sampling for as long as the step, even after the correction).
                sleep(min(due_ms - now_ms, interval_ms) / 1000.0)
                continue
            latest_ms = now_ms // interval_ms * interval_ms
            if latest_ms > due_ms:
                missed = (latest_ms - due_ms) // interval_ms
                skipped += missed
                if metrics is not None:
                    metrics.ticks_skipped(missed)
                log.warning("agent fell behind by %d ms: skipping %d tick(s), %d so far", now_ms - due_ms, missed, skipped)
            tick_ms = latest_ms
            due_ms = tick_ms + interval_ms
            try:
                tick = build_tick(backend, cluster=cluster, node=node, now_ms=tick_ms, interval_ms=interval_ms)
            except Exception:
                # One bad read must not stop the metering; the gap shows in the ledger.
                log.exception("tick at %d failed to build; skipped", tick_ms)
                if metrics is not None:
                    metrics.tick_failed()
                continue
            if metrics is not None:
                metrics.tick_sampled(tick_ms)
            held.append(tick)
            if len(held) >= ticks_per_message:
                batch, held = held, []  # handed over once: a send that fails is not retried on stopping
                send(batch)
                published += len(batch)
    finally:
        # stopping, however (a stop, Ctrl-C's KeyboardInterrupt, an error): what was sampled goes out (into the
        # spool) rather than being lost with the process
        if held:
            send(held)
            published += len(held)
    return published


# --------------------------------------------------------------------------- spool
def file_safe(name: str) -> str:
    """`name` as the agents name files and directories by it: only [A-Za-z0-9._-], the rest as '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def agent_file_name(prefix: str, name: str) -> str:
    """`<prefix>-<name>` as an agent names a state file or spool by a cluster name: only the characters
    file_safe keeps, and a name file_safe changes also carries a digest of itself, so clusters whose
    names differ only in other characters ('a b', 'a_b', 'a:b') never share a file. A name of safe
    characters keeps `<prefix>-<name>` (existing files and spools are found)."""
    if file_safe(name) == name:
        return f"{prefix}-{name}"
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"{prefix}-{file_safe(name)}-{digest}"


def spool_dir(settings: Any, node: str) -> Path:
    """The node's spool directory: <GPULEDGER_AGENT_SPOOL_DIR or DATA_DIR/spool>/<node>."""
    base = settings.agent_spool_dir or Path(settings.data_dir) / "spool"
    return Path(base) / (file_safe(node) or "_")


def open_spooled_publisher(
    settings: Any,
    node: str,
    *,
    topic: str | None = None,
    metrics: Any = None,
    publisher_factory: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.time,
    window: int = 1000,
) -> Any:
    """A `SpoolingPublisher` for `run_agent`: the node's disk spool, drained by a forwarder
    thread through a KafkaPublisher that retries forever (`SPOOL_PRODUCER_OVERRIDES`).
    `close()` it at the end: undelivered ticks stay on disk for the next start."""
    from gpuledger.agents.spool import Forwarder, Spool, SpoolingPublisher

    if publisher_factory is None:
        from gpuledger.agents.publisher import SPOOL_PRODUCER_OVERRIDES, KafkaPublisher

        def publisher_factory() -> Any:
            return KafkaPublisher(settings, **SPOOL_PRODUCER_OVERRIDES)

    spool = Spool(spool_dir(settings, node), max_bytes=settings.agent_spool_max_bytes,
                  fsync=settings.agent_spool_fsync, clock=clock,
                  on_drop=metrics.spool_dropped if metrics is not None else None)
    try:
        forwarder = Forwarder(spool, publisher_factory(), topic or settings.topics.gpu_samples, window=window,
                              metrics=metrics, publisher_factory=publisher_factory)
    except Exception:
        spool.close()
        raise
    if metrics is not None:
        metrics.attach_spool(spool, forwarder)
    log.info("spool %s: %d tick(s) waiting, bound %d bytes, fsync %s", spool.directory, spool.depth,
             spool.max_bytes, spool.fsync)
    return SpoolingPublisher(spool, forwarder.start())


# --------------------------------------------------------------------------- command line
def make_backend(name: str, *, sim_gpus: str = "8xA100-80GB", seed: int = 0, node: str = "sim-node",
                 proc_root: str = "/proc") -> GpuBackend:
    """'nvml' (this node's GPUs) or 'sim' (simulated GPUs)."""
    if name == "nvml":
        from gpuledger.agents.nvml_backend import NvmlBackend
        return NvmlBackend(proc_root=proc_root, node=node)
    if name == "sim":
        from gpuledger.agents.sim_backend import SimBackend, parse_sim_models
        return SimBackend(parse_sim_models(sim_gpus), seed=seed, node=node)
    if name == "sim-slurm":  # simulated GPUs busy where real Slurm jobs run on this node (fake-GPU clusters)
        from gpuledger.agents.sim_backend import parse_sim_models
        from gpuledger.agents.slurm_sim_backend import SlurmSimBackend
        return SlurmSimBackend(parse_sim_models(sim_gpus), seed=seed, node=node, proc_root=proc_root)
    raise ValueError(f"unknown backend {name!r}: expected 'nvml', 'sim' or 'sim-slurm'")


def _bench(backend: GpuBackend, n: int, *, cluster: str, node: str, interval_ms: int,
           spool_fsync: str = "always") -> dict[str, Any]:
    """Cost of n back-to-back ticks: CPU and wall time per tick, device calls per tick; and the
    spool's share (append with `spool_fsync`, read back, acknowledge) in a temporary directory."""
    import tempfile

    from gpuledger.agents.spool import Spool

    cpu, wall, calls, size = [], [], [], 0
    spool_cpu, spool_wall = [], []
    base_ms = next_grid_ms(int(time.time() * 1000), interval_ms)
    with tempfile.TemporaryDirectory(prefix="gpuledger-bench-") as tmp, Spool(tmp, fsync=spool_fsync) as spool:
        for i in range(n):
            c0, w0 = time.process_time(), time.perf_counter()
            tick = build_tick(backend, cluster=cluster, node=node, now_ms=base_ms + i * interval_ms, interval_ms=interval_ms)
            value = encode(tick)
            size = len(value)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            calls.append(backend.calls_last_tick)
            c0, w0 = time.process_time(), time.perf_counter()
            spool.append(value, node)
            spool.ack(spool.read(1)[-1].seq)
            spool_cpu.append(time.process_time() - c0)
            spool_wall.append(time.perf_counter() - w0)
    return {
        "spool_fsync": spool_fsync,
        "spool_cpu_ms_per_tick_mean": round(1000 * sum(spool_cpu) / n, 3),
        "spool_wall_ms_per_tick_mean": round(1000 * sum(spool_wall) / n, 3),
        "ticks": n, "gpus": len(tick.gpus), "message_bytes": size,
        "cpu_ms_per_tick_mean": round(1000 * sum(cpu) / n, 3), "cpu_ms_per_tick_max": round(1000 * max(cpu), 3),
        "wall_ms_per_tick_mean": round(1000 * sum(wall) / n, 3), "wall_ms_per_tick_max": round(1000 * max(wall), 3),
        "calls_per_tick_mean": sum(calls) / n, "calls_per_tick_max": max(calls),
        "cpu_share_at_interval_pct": round(100 * (sum(cpu) / n) / (interval_ms / 1000), 4),
        "cpu_share_with_spool_at_interval_pct": round(100 * ((sum(cpu) + sum(spool_cpu)) / n) / (interval_ms / 1000), 4),
    }


def serve_ticks(backend: GpuBackend, settings: Any, *, cluster: str, node: str, interval_s: float,
                ticks_per_message: int, print_: bool, metrics_port: int, label: str) -> int:
    """Run an agent's tick loop until SIGTERM: ticks to stdout (`print_`), else through the node's
    disk spool (or straight to Kafka when the spool is off) with Prometheus metrics on
    `metrics_port`. Shared by every agent that publishes line 1 (NVML, dcgm). Returns the exit code."""
    stop = threading.Event()
    metrics = None
    if print_:
        publisher: Any = _StdoutPublisher()
    else:
        from gpuledger.metrics import AgentMetrics, start_metrics_server

        metrics = AgentMetrics(node, cluster)
        start_metrics_server(metrics_port)
        if settings.agent_spool_max_bytes > 0:
            from gpuledger.agents.spool import SpoolLocked
            try:
                publisher = open_spooled_publisher(settings, node, metrics=metrics)
            except SpoolLocked as exc:
                print(f"{label}: {exc} (is another agent running for node {node}?)", file=sys.stderr)
                return 2
        else:
            from gpuledger.agents.publisher import KafkaPublisher
            publisher = KafkaPublisher(settings)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # docker stop / systemd: finish cleanly
    try:
        run_agent(backend, publisher, settings.topics.gpu_samples, cluster=cluster, node=node,
                  interval_s=interval_s, stop=stop, metrics=metrics, ticks_per_message=ticks_per_message)
    except KeyboardInterrupt:
        stop.set()
    finally:
        if hasattr(publisher, "close"):
            publisher.close()
    return 0


def add_tick_options(p: argparse.ArgumentParser, settings: Any) -> None:
    """The options of every agent that publishes line 1 through `serve_ticks` (NVML, dcgm)."""
    p.add_argument("--cluster", default=settings.cluster)
    p.add_argument("--interval", type=float, default=settings.agent_interval_s, help="seconds between ticks (default %(default)s)")
    p.add_argument("--ticks-per-message", type=int, default=settings.agent_ticks_per_message,
                   help="ticks sent per message (a NodeTickBatch when > 1; default GPULEDGER_AGENT_TICKS_PER_MESSAGE=%(default)s)")
    p.add_argument("--once", action="store_true", help="take one tick now and exit")
    p.add_argument("--print", dest="print_", action="store_true", help="write ticks to stdout as JSON instead of Kafka")
    p.add_argument("--metrics-port", type=int, default=settings.agent_metrics_port,
                   help="serve Prometheus /metrics on this port (0: off; default GPULEDGER_AGENT_METRICS_PORT)")
    p.add_argument("--log-level", default="INFO")


def check_tick_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible values of `add_tick_options` (argparse exits with the message), then set up logging."""
    import math

    # the tick grid is in whole milliseconds: an interval that rounds to 0 ms divides by zero
    if not (math.isfinite(args.interval) and round(args.interval * 1000) >= 1):
        p.error(f"--interval must be a number of seconds of at least 0.001 (1 ms), got {args.interval!r}")
    if not 0 <= args.metrics_port <= 65535:
        p.error(f"--metrics-port must be within 0..65535 (0: off), got {args.metrics_port}")
    if not 1 <= args.ticks_per_message <= MAX_TICKS_PER_MESSAGE:
        p.error(f"--ticks-per-message must be within 1..{MAX_TICKS_PER_MESSAGE} (a NodeTickBatch's limit), "
                f"got {args.ticks_per_message}")
    from gpuledger.config import check_cluster_name

    try:  # every tick carries it: a name the wire refuses failed each tick with a traceback
        check_cluster_name(args.cluster)
    except ValueError as exc:
        p.error(f"--cluster {exc}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser(settings: Any) -> argparse.ArgumentParser:
    """The agent's command line (defaults from `settings`); deploy/ files are checked against it."""
    p = argparse.ArgumentParser(prog="gpuledger agent gpu", description="Sample this node's GPUs into NodeTicks.")
    p.add_argument("--backend", choices=("nvml", "sim", "sim-slurm"), default="nvml")
    p.add_argument("--node", default=socket.gethostname())
    add_tick_options(p, settings)
    p.add_argument("--bench", type=int, metavar="N", help="time N back-to-back ticks, print a JSON summary, exit")
    p.add_argument("--sim-gpus", default="8xA100-80GB", help="simulated GPUs, e.g. 4xA100-80GB,2xT4")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated backend")
    p.add_argument("--proc-root", default="/proc", help="host /proc (for container ids), e.g. /host/proc")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from gpuledger.config import load_settings

    settings = load_settings()
    p = build_parser(settings)
    args = p.parse_args(argv)
    if args.bench is not None and args.bench < 1:
        p.error("--bench needs at least 1 tick")
    check_tick_options(p, args)

    try:
        backend = make_backend(args.backend, sim_gpus=args.sim_gpus, seed=args.seed, node=args.node,
                               proc_root=args.proc_root)
    except Exception as exc:  # e.g. NvmlUnavailable, a bad --sim-gpus
        print(f"gpu agent: {exc}", file=sys.stderr)
        return 2
    interval_ms = round(args.interval * 1000)
    try:
        if args.bench:
            print(json.dumps(_bench(backend, args.bench, cluster=args.cluster, node=args.node, interval_ms=interval_ms,
                                    spool_fsync=settings.agent_spool_fsync)))
            return 0
        if args.once:
            now_ms = int(time.time() * 1000)
            tick = build_tick(backend, cluster=args.cluster, node=args.node,
                              now_ms=now_ms // interval_ms * interval_ms, interval_ms=interval_ms)
            if args.print_:
                sys.stdout.write(encode(tick).decode() + "\n")
                return 0
            from gpuledger.agents.publisher import KafkaPublisher
            with KafkaPublisher(settings) as pub:
                pub.publish(settings.topics.gpu_samples, args.node, encode(tick))
                # flush() counts what still waits; a tick the broker refused does not wait, it failed
                if pub.flush() or pub.failed:
                    print(f"gpu agent: the tick was not delivered to {settings.topics.gpu_samples} (reason in the log)",
                          file=sys.stderr)
                    return 1
                return 0

        return serve_ticks(backend, settings, cluster=args.cluster, node=args.node, interval_s=args.interval,
                           ticks_per_message=args.ticks_per_message, print_=args.print_,
                           metrics_port=args.metrics_port, label="gpu agent")
    finally:
        backend.close()


class _StdoutPublisher:
    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> None:
        sys.stdout.write(value.decode() + "\n")
        sys.stdout.flush()

    def poll(self, timeout: float = 0) -> int:
        return 0


if __name__ == "__main__":
    sys.exit(main())
