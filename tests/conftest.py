"""Shared fixtures. Integration tests get a real Tansu broker and a real chDB engine,
with per-test unique topic prefixes and data directories."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from gpuledger.broker import EmbeddedBroker
from gpuledger.config import Settings

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """One Tansu broker for the whole test session (in-memory; topics are per test)."""
    log_path = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with EmbeddedBroker(log_path=log_path) as b:
        yield b


@pytest.fixture
def make_settings(tmp_path):
    """Settings factory: unique topic prefix and data dir per test; overrides as keywords."""

    def make(**overrides) -> Settings:
        values = dict(
            topic_prefix=f"t{uuid.uuid4().hex[:8]}.",
            data_dir=tmp_path / "data",
            worker_app_id=f"w{uuid.uuid4().hex[:8]}",
            partitions_gpu_samples=2,
            partitions_job_events=2,
            partitions_usage=2,
            worker_rebalance_timeout_s=4.0,  # Tansu holds a group join for about half of it
        )
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def settings(broker, make_settings) -> Settings:
    return make_settings(kafka_bootstrap=broker.bootstrap)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"public traces not found at {SHARED_TRACES} (see README: where to get the traces)")
    return SHARED_TRACES


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        import docker  # from testcontainers

        docker.from_env().ping()
        return True
    except Exception:
        return False


@pytest.fixture
def assert_conserved():
    """Checker of the capacity identity on capacity-report rows:
    capacity = down + unallocated + allocated_idle + executing, row by row."""

    def check(rows: list[dict], abs_tol: float = 1e-6) -> None:
        assert rows, "no capacity rows"
        for row in rows:
            parts = (row["down_gpu_seconds"] + row["unallocated_gpu_seconds"] + row["allocated_idle_gpu_seconds"]
                     + row["executing_gpu_seconds"])
            assert row["capacity_gpu_seconds"] == pytest.approx(parts, rel=1e-12, abs=abs_tol), row

    return check
