"""The wheel carries everything an installed gpuledger reads at run time (JSON Schemas, migrations, report templates,
ledger defaults, the Superset bundle, the PodResources proto), and builds without a setuptools
warning. Built from a copy of the packaged folders, so the checkout's build/ is left alone."""

import shutil
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: the checkout's folders that pyproject.toml packages (package-dir), and the files the build reads
PACKAGED = ["gpuledger", "agents", "streams", "schemas", "sql", "superset/bundle", "pyproject.toml", "README.md"]
#: checkout folder -> where its data files land in the wheel
DATA = {"schemas/json": "gpuledger/schemas/json", "sql": "gpuledger/sql", "superset/bundle": "gpuledger/superset_bundle",
        "gpuledger": "gpuledger", "agents/podresources": "gpuledger/agents/podresources"}
DATA_SUFFIXES = (".json", ".sql", ".yaml", ".toml", ".proto", ".j2")


def _copy_sources(to: Path) -> None:
    for name in PACKAGED:
        src, dst = ROOT / name, to / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def expected_data_files() -> set[str]:
    return {f"{wheel_dir}/{p.relative_to(ROOT / folder).as_posix()}"
            for folder, wheel_dir in DATA.items()
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in DATA_SUFFIXES and "__pycache__" not in p.parts}


def test_the_wheel_carries_schemas_migrations_defaults_and_the_superset_bundle(tmp_path):
    src, out = tmp_path / "src", tmp_path / "wheel"
    _copy_sources(src)
    # --no-build-isolation: the venv's setuptools, no download (pyproject's build-system floor applies to it too)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-3000:]
    warnings = [line.strip() for line in log.splitlines()
                if "warning" in line.lower() and "byte-compiling is disabled" not in line
                and "Location 'file:" not in line]  # pip's own notes on this machine's find-links
    assert not warnings, "the build warns:\n" + "\n".join(warnings)

    (wheel,) = out.glob("gpuledger-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(expected_data_files() - names)
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools] packages / package-data"
    for required in ("gpuledger/ledger_defaults.toml", "gpuledger/schemas/json/node_tick.json",
                     "gpuledger/sql/0001_usage.sql", "gpuledger/superset_bundle/metadata.yaml"):
        assert required in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "gpuledger = gpuledger.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # the installed code finds what the wheel carries (no checkout beside it)
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = subprocess.run([sys.executable, "-c", "from gpuledger.integrations.superset import DEFAULT_BUNDLE as b; "
                            "print(b); assert (b / 'metadata.yaml').is_file(), b"],
                           env={**os.environ, "PYTHONPATH": str(unpacked)}, cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == str(unpacked / "gpuledger" / "superset_bundle")
