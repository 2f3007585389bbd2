"""Running the ledger's long-lived parts as child processes and knowing when they are done.

Used by `gpuledger demo` and by the integration tests: the Faust worker runs in its own
process (as in production), and "done" means its consumer group has committed every
input partition up to the end offset."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from gpuledger.config import Settings


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment that gives a child process the same Settings (GPULEDGER_* variables)."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        if value is None:  # unset here, so unset there: not the value this process's environment has
            env.pop(f"GPULEDGER_{name.upper()}", None)
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"GPULEDGER_{name.upper()}"] = str(value)
    return env


#: the child's first step: ask the kernel for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG = 1,
#: kept across exec), stop if the parent is already gone, then become the command. A small interpreter of
#: its own instead of Popen's preexec_fn: with preexec_fn, Popen forks the whole parent and runs its fork
#: handlers in the child, and a parent serving gRPC (the Kubernetes tests' kubelet) then aborts the child
#: before exec ("epoll_wait error: Bad file descriptor", SIGABRT)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "try:\n"
                    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
                    "except (OSError, AttributeError):\n"
                    "    pass\n"
                    "if os.getppid() != int(sys.argv[1]):\n"
                    "    sys.exit(143)\n"
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` to run so that the child gets SIGTERM when this process dies, even by SIGKILL (Linux prctl
    PR_SET_PDEATHSIG, set by a short-lived interpreter that then execs `argv`: same pid), so no broker or
    worker outlives a killed demo. `argv` itself off Linux and from a thread other than the main one (the
    signal follows the thread that started the child)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class ChildProcess:
    """A `gpuledger <args>` child process; stopped with SIGTERM (then SIGKILL) on exit, and
    sent SIGTERM when this process dies (`dying_with_parent`).

    `command` replaces `python -m gpuledger.cli` (a test's own entry point); `extra_env` is added
    to the environment that carries the settings."""

    def __init__(self, settings: Settings, *args: str, log_path: Path | None = None,
                 command: Sequence[str] | None = None, extra_env: Mapping[str, str] | None = None):
        self.settings = settings
        self.args = args
        self.log_path = log_path
        self.command = list(command) if command else [sys.executable, "-m", "gpuledger.cli"]
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ChildProcess":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(dying_with_parent([*self.command, *self.args]),
                                         env={**settings_env(self.settings), **self.extra_env},
                                         stdout=out, stderr=subprocess.STDOUT)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy
        return self

    def check_alive(self) -> None:
        if self.proc and self.proc.poll() is not None:
            raise RuntimeError(f"gpuledger {' '.join(self.args)} exited with {self.proc.returncode}"
                               + (f"; see {self.log_path}" if self.log_path else ""))

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if not self.proc:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ChildProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def group_lag(settings: Settings, group: str, topics: list[str],
              known_ends: dict[tuple[str, int], int] | None = None) -> int:
    """Messages not yet committed by `group` on `topics` (sum over partitions).

    A partition's end is its high watermark, or the end the caller knows it delivered there when
    that is larger (`known_ends`: (topic, partition) -> offset after the last acknowledged
    message): after faults, Tansu's ListOffsets can report a high watermark behind the log."""
    consumer = Consumer({**settings.kafka_client_config(), "group.id": group, "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=10)
        partitions = [TopicPartition(t, p) for t in topics for p in metadata.topics[t].partitions]
        committed = consumer.committed(partitions, timeout=10)
        lag = 0
        for tp in committed:
            _, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)
            high = max(high, (known_ends or {}).get((tp.topic, tp.partition), 0))
            lag += max(0, high - max(tp.offset, 0))
        return lag
    finally:
        consumer.close()


def wait_until_caught_up(settings: Settings, group: str, topics: list[str], *, timeout_s: float = 600,
                         stable_s: float = 3.0, alive: ChildProcess | None = None, progress=None,
                         known_ends: dict[tuple[str, int], int] | None = None) -> None:
    """Block until `group` has no lag on `topics` for `stable_s` seconds in a row (see `group_lag`
    for `known_ends`)."""
    deadline = time.monotonic() + timeout_s
    zero_since = None
    while time.monotonic() < deadline:
        if alive:
            alive.check_alive()
        lag = group_lag(settings, group, topics, known_ends)
        if progress:
            progress(lag)
        if lag == 0:
            zero_since = zero_since or time.monotonic()
            if time.monotonic() - zero_since >= stable_s:
                return
        else:
            zero_since = None
        time.sleep(0.5)
    raise TimeoutError(f"consumer group {group} still lags on {topics} after {timeout_s:.0f}s")


def read_topic(settings: Settings, topic: str, timeout_s: float = 30.0) -> list[tuple[bytes | None, bytes]]:
    """Every (key, value) in `topic` up to its current end, read by assignment (no group)."""
    return [(key, value) for _, key, value in read_topic_records(settings, topic, timeout_s)]


def read_topic_records(settings: Settings, topic: str,
                       timeout_s: float = 30.0) -> list[tuple[int, bytes | None, bytes]]:
    """Every (partition, key, value) in `topic` up to its current end, read by assignment (no group)."""
    consumer = Consumer({**settings.kafka_client_config(), "group.id": "gpuledger-reader", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        ends = {}
        for p in metadata.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        out: list[tuple[int, bytes | None, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            out.append((msg.partition(), msg.key(), msg.value()))
            if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                ends.pop(msg.partition(), None)
        if ends:
            raise TimeoutError(f"could not read {topic} to its end within {timeout_s:.0f}s")
        return out
    finally:
        consumer.close()
