"""Test-only fault injection for the sink: a writer that fails or pauses on command.

In-process: `run_sink(settings, wrap_writer=fault_injecting(control_file))`. As a child process
(the chaos suite kills it at chosen points): `python tests/sink_faults.py` runs the sink like
`gpuledger sink`, with the control file named by GPULEDGER_TEST_SINK_FAULT_FILE.

The control file says what the next write does: `down` — it fails (the warehouse is
unavailable); `pause-before-insert` / `pause-after-insert` — the sink writes `<file>.paused` and
sleeps before or after inserting into usage_raw, so that a test can kill it there. Anything else
(or no file): pass through."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from gpuledger.sink.writer import Writer

log = logging.getLogger(__name__)

CONTROL_ENV = "GPULEDGER_TEST_SINK_FAULT_FILE"


class SimulatedOutage(ConnectionError):
    """Raised by `FaultInjectingWriter` while its control file says the warehouse is down."""


class FaultInjectingWriter:
    """Reads its control file before every write (see the module's docstring)."""

    def __init__(self, inner: Writer, control: Path):
        self.inner, self.control = inner, Path(control)

    def _mode(self) -> str:
        try:
            return self.control.read_text().strip()
        except OSError:
            return ""

    def _pause(self, where: str) -> None:
        Path(f"{self.control}.paused").write_text(f"{where} pid {os.getpid()}\n")
        log.warning("fault injection: paused %s; waiting to be killed", where)
        while self._mode().startswith("pause"):
            time.sleep(0.1)

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        mode = self._mode()
        if mode == "down":
            raise SimulatedOutage("fault injection: the warehouse is unavailable")
        if table == "usage_raw" and mode == "pause-before-insert":
            self._pause("before inserting into usage_raw")
        self.inner.write(table, rows, token=token)
        if table == "usage_raw" and mode == "pause-after-insert":
            self._pause("after inserting into usage_raw")


def fault_injecting(control: Path) -> Callable[[Writer], Writer]:
    return lambda writer: FaultInjectingWriter(writer, control)


def sink_command() -> list[str]:
    """The command line that runs the fault-injecting sink as a child (for ChildProcess(command=...))."""
    return [sys.executable, str(Path(__file__).resolve())]


def main() -> int:
    from gpuledger.config import Settings
    from gpuledger.sink.loop import run_sink

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stats = run_sink(Settings(), wrap_writer=fault_injecting(Path(os.environ[CONTROL_ENV])))
    print(json.dumps(stats, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
