"""Join throughput through real `gpuledger worker` processes on Tansu, against a raw aiokafka
consumer (orjson decoding) of the same gpu-samples topic in the same run; scale-out 1 -> 2 workers.

Method (per pass, fresh topics and consumer group):
1. the worker(s) start and join the group; a warm-up (one tick of 32 warm-up nodes, spread over
   every partition, and a lifecycle watermark that closes it) goes through, and we wait until
   the group has no lag and every worker logged its partition assignment;
2. the workers are paused (SIGSTOP), the measured batch (simulated 8-GPU nodes, as many on every
   gpu-samples partition (`balanced_node_names`), sampled every `join_interval_ms`, each node's
   ticks `join_ticks_per_message` to a message as an agent with GPULEDGER_AGENT_TICKS_PER_MESSAGE
   sends them; lifecycle events; watermarks every 10 s of event time, later than the warm-up) is
   published, the workers resume (SIGCONT) at t0;
3. the end is the CreateTime of the last usage message of the batch (read back after the group's
   lag is 0, checked complete by conservation: the batch's usage gpu_ms = ticks x GPUs x interval).
   Throughput = batch GPU samples / (end - t0). Startup and group join are outside the window.
The baseline reads the same topic (warm-up + batch) by assignment, from the first message it
receives to the last, decoding every value with orjson (and counting its GPU samples).
The floor (bench/floor.py) reads it through a Faust app built as the worker's that only parses:
the highest ratio a worker on Faust could reach.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass

import orjson
from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer, TopicPartition

from gpuledger.agents.publisher import KafkaPublisher
from gpuledger.agents.simcluster import DEFAULT_START_MS, SimSpec, batch_ticks, simulate
from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES
from gpuledger.config import Settings
from gpuledger.embedded.processes import ChildProcess, group_lag, settings_env
from gpuledger.schemas.models import GpuSample, LifecycleWatermark, NodeTick
from gpuledger.schemas.wire import encode
from gpuledger.topics import create_topics

from bench import floor
from bench.common import SAMPLE_PARTITIONS, SIZES, bench_settings, median, say, workdir

INTERVAL_MS = SIZES.join_interval_ms
WARM_NODES = 32


@dataclass
class Batch:
    """Pre-encoded messages of one simulated run: (logical line, key, value, partition or None)."""

    messages: list[tuple[str, bytes | None, bytes, int | None]]
    ticks: int
    samples: int
    start_ms: int
    nodes: tuple[str, ...] = ()

    @property
    def counts(self) -> Counter:
        return Counter(m[0] for m in self.messages)


def sample_partition(node: str, partitions: int = SAMPLE_PARTITIONS) -> int:
    """The gpu-samples partition of a node's messages: murmur2 of the key, as the ledger's publisher
    (librdkafka murmur2_random) and Faust's producer (aiokafka's DefaultPartitioner) both place it."""
    return (murmur2(node.encode()) & 0x7FFFFFFF) % partitions


def balanced_node_names(nodes: int, partitions: int = SAMPLE_PARTITIONS, cluster: str = "sim") -> tuple[str, ...]:
    """`nodes` names "<cluster>-nodeNN", the first ones in order that fill every partition evenly
    (counts differ by at most one). The simulator's own first 48 names hash 5, 4, 10, 8, 7,
    5, 4, 5 to the 8 partitions: two workers (even / odd partitions) would get 26 and 22 nodes, which
    caps the two-worker speed-up at 48 / 26 = 1.85 whatever the worker does. A real fleet's
    thousands of nodes spread near evenly; the benchmark's 48 are made to, so that the scale-out
    figure measures the worker rather than the hash of 48 names."""
    base, extra = divmod(nodes, partitions)  # every partition gets `base`, `extra` of them one more
    per_partition = [0] * partitions
    names: list[str] = []
    k = 0
    while len(names) < nodes:
        name = f"{cluster}-node{k:02d}"
        p = sample_partition(name, partitions)
        if per_partition[p] < base or (per_partition[p] == base and extra > 0):
            extra -= per_partition[p] == base
            per_partition[p] += 1
            names.append(name)
        k += 1
    return tuple(names)


def make_batch(nodes: int, hours: float, job_partitions: int = 4, start_ms: int = DEFAULT_START_MS) -> Batch:
    """The measured batch: `nodes` simulated 8-GPU nodes, spread evenly over the gpu-samples partitions."""
    messages, ticks, samples = [], 0, 0
    names = balanced_node_names(nodes)
    spec = SimSpec(nodes=nodes, hours=hours, start_ms=start_ms, sample_interval_ms=INTERVAL_MS, node_names=names)
    for e in batch_ticks(simulate(spec), SIZES.join_ticks_per_message):
        if e.line == LINE_SAMPLES:
            node_ticks = getattr(e.message, "ticks", [e.message])
            ticks += len(node_ticks)
            samples += sum(len(t.gpus) for t in node_ticks)
            messages.append((e.line, e.key.encode(), encode(e.message), None))
        elif e.line == LINE_JOB_EVENTS:
            value = encode(e.message)
            if e.key is None:  # a lifecycle watermark: to every job-events partition
                messages.extend((e.line, None, value, p) for p in range(job_partitions))
            else:
                messages.append((e.line, e.key.encode(), value, None))
    return Batch(messages, ticks, samples, start_ms, names)


def warmup_messages(start_ms: int, job_partitions: int) -> list:
    """One 1-GPU tick per warm-up node before the batch, and the watermark that closes it. The warm-up
    nodes' cluster sends no watermark of its own: the watermark is the batch's cluster's, since the
    worker closes ticks only as far as every cluster that sends watermarks has promised (a "warm"
    cluster's one watermark would hold the batch back for a day, docs/accounting.md §1)."""
    ts = start_ms - 2 * INTERVAL_MS
    out = []
    for i in range(WARM_NODES):
        tick = NodeTick(cluster="warm", node=f"warm-{i:02d}", ts_ms=ts, interval_ms=INTERVAL_MS,
                        gpus=[GpuSample(gpu_uuid=f"GPU-warm-{i:02d}", index=0, model="A100-80GB", power_w=100.0)])
        out.append((LINE_SAMPLES, tick.node.encode(), encode(tick), None))
    mark = encode(LifecycleWatermark(cluster=SimSpec().cluster, ts_ms=ts + INTERVAL_MS))
    out.extend((LINE_JOB_EVENTS, None, mark, p) for p in range(job_partitions))
    return out


def publish(settings: Settings, messages: list) -> float:
    """Publish through the ledger's own producer (murmur2, lz4, idempotent); returns seconds."""
    t0 = time.perf_counter()
    with KafkaPublisher(settings) as pub:
        for line, key, value, partition in messages:
            pub.publish(settings.topic_prefix + line, key, value, partition=partition)
        if pub.flush(60):
            raise RuntimeError("benchmark publish left messages undelivered")
    return time.perf_counter() - t0


def end_offsets(settings: Settings, topic: str) -> dict[int, int]:
    c = Consumer({**settings.kafka_client_config(), "group.id": "bench-offsets"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def read_usage_since(settings: Settings, starts: dict[int, int], timeout_s: float = 60) -> list[tuple[int, bytes]]:
    """(CreateTime ms, value) of every usage message after `starts`, up to the current end."""
    topic = settings.topics.usage
    ends = end_offsets(settings, topic)
    todo = {p: e for p, e in ends.items() if e > starts.get(p, 0)}
    c = Consumer({**settings.kafka_client_config(), "group.id": "bench-reader", "enable.auto.commit": False})
    out = []
    try:
        c.assign([TopicPartition(topic, p, starts.get(p, 0)) for p in todo])
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            for msg in c.consume(1000, 0.5):
                if msg.error():
                    continue
                out.append((msg.timestamp()[1], msg.value()))
                if msg.offset() + 1 >= todo.get(msg.partition(), 0):
                    todo.pop(msg.partition(), None)
        if todo:
            raise TimeoutError(f"could not read {topic} to its end")
        return out
    finally:
        c.close()


def _usage_gpu_ms(values, skip_cluster: str = "warm") -> int:
    total = 0
    for value in values:
        batch = orjson.loads(value)
        total += sum(r["gpu_ms"] for r in batch["records"] if r["cluster"] != skip_cluster)
    return total


def _assigned(log_path) -> bool:
    """Faust (info level) logs its assignment table once it has partitions."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return False
    return bool(re.search(r"Assigned partitions|New assignments found|assigned", text, re.I))


def _wait_lag_zero(settings: Settings, workers: list[ChildProcess], timeout_s: float, poll_s: float = 0.5) -> float:
    t = settings.topics
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in workers:
            w.check_alive()
        try:
            if group_lag(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations]) == 0:
                return time.time()
        except Exception:  # the coordinator may be busy with a join: ask again
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"worker group {settings.worker_app_id} still lags after {timeout_s:.0f}s")


class ProfiledWorker(ChildProcess):
    """`gpuledger worker` under cProfile; the stats file is written when it exits on SIGTERM."""

    def __init__(self, settings: Settings, *args: str, log_path=None, profile_path=None):
        super().__init__(settings, *args, log_path=log_path)
        self.profile_path = profile_path

    def start(self) -> "ProfiledWorker":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", str(self.profile_path),
                                      "-m", "gpuledger.cli", *self.args],
                                     env=settings_env(self.settings), stdout=out, stderr=subprocess.STDOUT)
        return self


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (Linux /proc), seconds; 0 when unknown."""
    if not pid:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def peak_rss_mb(pid: int | None) -> float:
    """The most resident memory a process has had (Linux /proc VmHWM), MB; 0 when unknown."""
    try:
        line = next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration, ValueError, TypeError):
        return 0.0


def worker_pass(bootstrap: str, batch: Batch, workers: int, name: str, profile_path=None,
                broker_pid: int | None = None, observe=None) -> dict:
    """Samples/s of `workers` worker processes over the batch (see the module docstring).
    With `profile_path`, the (single) worker runs under cProfile (slower: not a throughput figure).
    `observe(pids)`: a context manager entered from SIGCONT until the lag is 0 (bench/spy.py)."""
    s = bench_settings(bootstrap, name)
    create_topics(s)
    logs = workdir() / "logs"
    logs.mkdir(exist_ok=True)
    if profile_path is not None:
        procs = [ProfiledWorker(s, "worker", "--loglevel", "info", log_path=logs / f"{name}-worker0.log",
                                profile_path=profile_path)]
    else:
        procs = [ChildProcess(s, "worker", "--loglevel", "info", log_path=logs / f"{name}-worker{i}.log")
                 for i in range(workers)]
    for p in procs:
        if p.log_path.exists():
            p.log_path.unlink()
    try:
        for p in procs:
            p.start()
        t_start = time.monotonic()
        publish(s, warmup_messages(batch.start_ms, s.partitions_job_events))
        _wait_lag_zero(s, procs, timeout_s=120)
        # every worker must hold partitions before the measured window (no rebalance inside it)
        while not all(_assigned(p.log_path) for p in procs):
            if time.monotonic() - t_start > 120:
                raise TimeoutError("workers did not all get partitions")
            time.sleep(0.5)
        time.sleep(1.0)
        _wait_lag_zero(s, procs, timeout_s=60)
        join_s = time.monotonic() - t_start
        starts = end_offsets(s, s.topics.usage)
        for p in procs:
            p.proc.send_signal(signal.SIGSTOP)
        try:
            publish_s = publish(s, batch.messages)
        finally:
            for p in procs:
                p.proc.send_signal(signal.SIGCONT)
        t0 = time.time()
        cpu0 = [cpu_seconds(p.proc.pid) for p in procs] + [cpu_seconds(broker_pid)]
        with observe([p.proc.pid for p in procs]) if observe else nullcontext():
            lag_zero_at = _wait_lag_zero(s, procs, timeout_s=1800, poll_s=1.0)
        expected = batch.samples * INTERVAL_MS
        for _ in range(20):
            usage = read_usage_since(s, starts)
            got = _usage_gpu_ms(v for _, v in usage)
            if got >= expected:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"usage output incomplete: {got} of {expected} GPU-ms")
        end = max(ts for ts, _ in usage) / 1000.0
        seconds = end - t0
        # CPU used from t0 until the lag check saw 0 (a little after `end`)
        cpu1 = [cpu_seconds(p.proc.pid) for p in procs] + [cpu_seconds(broker_pid)]
        window = lag_zero_at - t0
        worker_cpu = sum(cpu1[:-1]) - sum(cpu0[:-1])
        broker_cpu = cpu1[-1] - cpu0[-1]
        return {
            "workers": workers,
            "samples": batch.samples,
            "ticks": batch.ticks,
            "seconds": seconds,
            "samples_per_s": batch.samples / seconds,
            "ticks_per_s": batch.ticks / seconds,
            "usage_messages": len(usage),
            "usage_gpu_ms_conserved": got == expected,
            "startup_and_join_s": join_s,
            "publish_s": publish_s,
            "lag_zero_after_s": window,
            "worker_cpu_s": worker_cpu,
            "worker_cpu_s_each": [round(b - a, 2) for a, b in zip(cpu0[:-1], cpu1[:-1])],
            "worker_cpu_us_per_tick": 1e6 * worker_cpu / batch.ticks,
            "samples_per_cpu_s": batch.samples / worker_cpu if worker_cpu else float("nan"),
            "worker_cores_busy": worker_cpu / window,
            "broker_cpu_s": broker_cpu,
            "broker_cores_busy": broker_cpu / window,
            "worker_peak_rss_mb": max(peak_rss_mb(p.proc.pid) for p in procs),
            "settings": s,
        }
    finally:
        for p in procs:
            p.stop()


def message_samples(message: dict) -> int:
    """GPU samples in a parsed gpu-samples message (a NodeTick or a NodeTickBatch)."""
    return sum(len(t["gpus"]) for t in message["ticks"]) if "ticks" in message else len(message["gpus"])


async def _aiokafka_read(bootstrap: str, topic: str, expected: int) -> tuple[float, int, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition as ATP

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer.topics()
            parts = consumer.partitions_for_topic(topic) or set()
        consumer.assign([ATP(topic, p) for p in sorted(parts)])
        await consumer.seek_to_beginning()
        n, gpus, first, cpu0 = 0, 0, None, 0.0
        while n < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=2000)
            for records in batches.values():
                if first is None:
                    first, cpu0 = time.perf_counter(), time.process_time()
                for r in records:
                    gpus += message_samples(orjson.loads(r.value))
                    n += 1
        return time.perf_counter() - first, time.process_time() - cpu0, n, gpus
    finally:
        await consumer.stop()


def baseline(settings: Settings, batch: Batch) -> dict:
    """Raw aiokafka + orjson over the pass's gpu-samples topic (warm-up and batch)."""
    expected = batch.counts[LINE_SAMPLES] + WARM_NODES  # messages
    seconds, cpu, n, gpus = asyncio.run(_aiokafka_read(settings.kafka_bootstrap, settings.topics.gpu_samples, expected))
    return {"messages": n, "samples": gpus, "seconds": seconds, "samples_per_s": gpus / seconds,
            "messages_per_s": n / seconds, "cpu_s": cpu, "samples_per_cpu_s": gpus / cpu if cpu else float("nan")}


def run(bootstrap: str, scaleout: bool = True, broker_pid: int | None = None) -> dict:
    """1-worker passes (and 2-worker passes, interleaved 1,2,1,2,... so that drifting load on a
    shared machine hits both alike), each with its own baseline read of the same topic."""
    say(f"join: simulating {SIZES.join_nodes} nodes x 8 GPUs x {SIZES.join_hours} h at {INTERVAL_MS} ms ticks, "
        f"{SIZES.join_ticks_per_message} ticks per message ...")
    batch = make_batch(SIZES.join_nodes, SIZES.join_hours)
    avg_bytes = sum(len(v) for line, _, v, _ in batch.messages if line == LINE_SAMPLES) / batch.ticks
    say(f"join: batch = {batch.ticks} ticks ({batch.samples} GPU samples, {avg_bytes:.0f} B/tick), {dict(batch.counts)}")
    ones, twos, bases = [], [], []
    for rep in range(SIZES.join_repeats):
        one = worker_pass(bootstrap, batch, 1, f"join1r{rep}", broker_pid=broker_pid)
        base = baseline(one.pop("settings"), batch)
        say(f"join: 1 worker: {one['samples_per_s']:,.0f} samples/s over {one['seconds']:.1f} s "
            f"({one['worker_cores_busy']:.2f} cores busy, {one['worker_cpu_us_per_tick']:,.0f} us CPU/tick, "
            f"peak {one['worker_peak_rss_mb']:,.0f} MB); "
            f"baseline {base['samples_per_s']:,.0f} samples/s ({base['messages_per_s']:,.0f} msg/s)")
        ones.append(one)
        bases.append(base)
        if scaleout:
            two = worker_pass(bootstrap, batch, 2, f"join2r{rep}", broker_pid=broker_pid)
            two.pop("settings")
            say(f"join: 2 workers: {two['samples_per_s']:,.0f} samples/s over {two['seconds']:.1f} s "
                f"({two['worker_cores_busy']:.2f} cores busy)")
            twos.append(two)

    def med(rows, key):
        return median([r[key] for r in rows])

    out = {
        "join_samples_per_s": med(ones, "samples_per_s"),
        "join_baseline_samples_per_s": med(bases, "samples_per_s"),
        "join_ratio": median([o["samples_per_s"] / b["samples_per_s"] for o, b in zip(ones, bases)]),
        "join_samples_per_cpu_s": med(ones, "samples_per_cpu_s"),
        "join_baseline_samples_per_cpu_s": med(bases, "samples_per_cpu_s"),
        "join_cpu_ratio": median([o["samples_per_cpu_s"] / b["samples_per_cpu_s"] for o, b in zip(ones, bases)]),
        "join_worker_cpu_us_per_tick": med(ones, "worker_cpu_us_per_tick"),
        "join_worker_peak_rss_mb": med(ones, "worker_peak_rss_mb"),
        "join_detail": {"one_worker_passes": ones, "baseline_passes": bases, "tick_bytes": avg_bytes,
                        "gpus_per_tick": 8, "ticks": batch.ticks, "samples": batch.samples, "cpus": os.cpu_count(),
                        "interval_ms": INTERVAL_MS, "ticks_per_message": SIZES.join_ticks_per_message,
                        "messages": dict(batch.counts),
                        "nodes_per_partition": sorted(Counter(map(sample_partition, batch.nodes)).items())},
    }
    out.update(floor.run(bootstrap, batch))  # the same batch through a Faust app that only parses it
    if scaleout:
        out["scaleout_samples_per_s_1"] = out["join_samples_per_s"]
        out["scaleout_samples_per_s_2"] = med(twos, "samples_per_s")
        out["scaleout_ratio"] = median([t["samples_per_s"] / o["samples_per_s"] for o, t in zip(ones, twos)])
        out["join_detail"]["two_worker_passes"] = twos
    return out


def profile_worker(bootstrap: str, batch: Batch | None = None, top: int = 30) -> dict:
    """One worker pass under cProfile: the top functions by own time, and by cumulative time."""
    import io
    import pstats

    batch = batch or make_batch(SIZES.profile_nodes, SIZES.profile_hours)
    path = workdir() / "worker.prof"
    if path.exists():
        path.unlink()
    result = worker_pass(bootstrap, batch, 1, "joinprof", profile_path=path)
    result.pop("settings")
    for _ in range(60):
        if path.exists():
            break
        time.sleep(0.5)
    texts = {}
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(str(path), stream=out).sort_stats(key).print_stats(top)
        texts[key] = _trim(out.getvalue())
    return {"profiled_pass": result, "profile_path": str(path), "by_package": by_package(path),
            "by_tottime": texts["tottime"], "by_cumulative": texts["cumulative"]}


def by_package(path) -> dict[str, float]:
    """Own (tottime) seconds of a profile grouped by where the code lives: the ledger's modules,
    each third-party package, the stdlib's asyncio, builtins by name; idle waiting (epoll) apart."""
    import pstats
    from collections import Counter

    groups: Counter[str] = Counter()
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(str(path)).stats.items():
        if "site-packages/" in filename:
            key = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        elif "/work/main/" in filename or "gpuledger" in filename:
            key = "ledger: " + filename.rsplit("/", 2)[-2] + "/" + filename.rsplit("/", 1)[-1]
        elif filename == "~":
            key = "idle (epoll wait)" if "epoll" in name else "builtin: " + name
        elif "/asyncio/" in filename:
            key = "asyncio"
        else:
            key = "stdlib: " + filename.rsplit("/", 1)[-1]
        groups[key] += tottime
    return {k: round(v, 3) for k, v in groups.most_common(30)}


def _trim(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("ncalls")), 0)
    site = re.compile(r"\S*/site-packages/")
    return "\n".join(site.sub("", line.replace("/work/main/", "")).rstrip() for line in lines[start:] if line.strip())


if __name__ == "__main__":
    from gpuledger.embedded.broker import EmbeddedBroker

    with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
        if "--profile" in sys.argv:
            prof = profile_worker(broker.bootstrap)
            print(prof["by_tottime"])
            print(prof["by_cumulative"])
            print(prof["profiled_pass"])
        else:
            result = run(broker.bootstrap, scaleout="--no-scaleout" not in sys.argv, broker_pid=broker.pid)
            for k, v in result.items():
                print(k, v)
