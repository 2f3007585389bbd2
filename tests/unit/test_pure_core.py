"""The worker's core (streams/*.py but the Faust shell app.py) is pure: it imports nothing that does
I/O or reads settings, and reads no clock; the edge passes the time in (`now_ms`).

Two checks: every import statement of every core file is on an allow-list (the failure names the
file, line and import), and importing the core modules in a fresh interpreter loads none of the
I/O libraries, also not through another module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

STREAMS = Path(__file__).resolve().parents[2] / "streams"
SHELL = {"app.py"}  # the Faust shell: the I/O edge of the worker
CORE_FILES = sorted(p for p in STREAMS.glob("*.py") if p.name not in SHELL)

#: what a core module may import: pure standard-library modules, the wire format, the core itself
ALLOWED = {
    "__future__", "abc", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
    "fractions", "functools", "hashlib", "heapq", "itertools", "json", "logging", "math", "numbers",
    "operator", "re", "statistics", "struct", "types", "typing", "zlib",
    "orjson", "pydantic",
    "gpuledger.schemas", "gpuledger.streams",
}
#: core modules that are not pure themselves
FORBIDDEN_INSIDE = {"gpuledger.streams.app"}
#: builtins that read files, the terminal or any module (the imports above exclude the rest of the I/O)
FORBIDDEN_BUILTINS = {"open", "input", "__import__", "exec", "eval"}
#: datetime's wall-clock readers (datetime itself is allowed for date arithmetic); an injected clock
#: object with a now() of its own is fine
WALL_CLOCK = {"now", "utcnow", "today"}
#: libraries that must not be loaded, even transitively, by importing the core (not stdlib modules such as
#: socket: pydantic loads those for its own types without using them)
IO_MODULES = ["gpuledger.config", "pydantic_settings", "faust", "aiokafka", "confluent_kafka", "clickhouse_connect",
              "chdb", "gpuledger.warehouse", "gpuledger.sink", "gpuledger.embedded", "gpuledger.ledger_files",
              "gpuledger.streams.app", "tomli_w", "prometheus_client"]


PACKAGES = {"gpuledger", "gpuledger.streams", "gpuledger.schemas"}


def _allowed(module: str) -> bool:
    if any(module == f or module.startswith(f + ".") for f in FORBIDDEN_INSIDE):
        return False
    return any(module == a or module.startswith(a + ".") for a in ALLOWED)


def impurities(source: str, filename: str) -> list[str]:
    """Every import off the allow-list and every forbidden call in `source`, as 'file:line: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # relative imports stay inside gpuledger.streams
            base = node.module or "" if node.level == 0 else ".".join(filter(None, ["gpuledger.streams", node.module]))
            # `from <package> import <module>` is judged by the module it imports
            names = [f"{base}.{a.name}" for a in node.names] if base in PACKAGES else [base]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS:
                found.append(f"{filename}:{node.lineno}: calls {func.id}()")
            elif isinstance(func, ast.Attribute) and func.attr in WALL_CLOCK:
                owner = func.value
                owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if owner_name in ("datetime", "date"):
                    found.append(f"{filename}:{node.lineno}: calls {owner_name}.{func.attr}() (the wall clock: pass it in)")
            continue
        elif isinstance(node, ast.Attribute) and node.attr == "environ":
            found.append(f"{filename}:{node.lineno}: reads .environ")
            continue
        else:
            continue
        found += [f"{filename}:{node.lineno}: imports {name}" for name in names if not _allowed(name)]
    return found


def test_the_core_files_are_found():
    names = {p.name for p in CORE_FILES}
    assert {"core.py", "join.py", "pricing.py", "attribution.py", "checks.py"} <= names and "app.py" not in names


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_module_imports_nothing_impure(path: Path):
    found = impurities(path.read_text(), f"streams/{path.name}")
    assert not found, "the pure core does I/O or reads settings or the clock (pass it in from the edge):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("snippet, what", [
    ("import os", "imports os"),
    ("from pathlib import Path", "imports pathlib"),
    ("import time", "imports time"),
    ("from gpuledger.config import Settings", "imports gpuledger.config"),
    ("from gpuledger import config", "imports gpuledger.config"),
    ("import importlib.resources", "imports importlib.resources"),
    ("from gpuledger.streams import app", "imports gpuledger.streams.app"),
    ("from .app import build_app", "imports gpuledger.streams.app"),
    ("from confluent_kafka import Producer", "imports confluent_kafka"),
    ("from datetime import datetime\nx = datetime.now()", "calls datetime.now()"),
    ("import datetime\nx = datetime.date.today()", "calls date.today()"),
    ("data = open('ledger.toml').read()", "calls open()"),
])
def test_the_check_catches_impure_code(snippet: str, what: str):
    found = impurities(snippet, "streams/NAME.py")
    assert any(what in f for f in found), found
    assert all(f.startswith("streams/NAME.py:") for f in found)


def test_pure_imports_pass_the_check():
    ok = "from __future__ import annotations\nimport bisect\nimport orjson\nfrom . import join\n" \
         "from gpuledger.schemas.models import NodeTick\nfrom gpuledger.streams.pricing import LedgerConfig\n" \
         "from datetime import datetime, timezone\nday = datetime.fromtimestamp(0, tz=timezone.utc).date()\n" \
         "def judge(clock):\n    return clock.now()\n"
    assert impurities(ok, "streams/NAME.py") == []


def test_importing_the_core_loads_no_io_module():
    modules = [f"gpuledger.streams.{p.stem}" for p in CORE_FILES if p.stem != "__init__"]
    probe = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
             f"print('\\n'.join(m for m in {IO_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert not loaded, f"importing the core loads {loaded}"
