"""Shared fixtures. Integration tests get a real Tansu broker and a real chDB engine,
with per-test unique topic prefixes and data directories. A test without one of the
ENGINE_MARKERS that opens either fails (see `no_engine_unless_marked`)."""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path

import pytest

from gpuledger.embedded.broker import EmbeddedBroker
from gpuledger.config import Settings

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"

#: markers of the tests allowed to open the real broker or engine (everything else is a unit test)
ENGINE_MARKERS = ("integration", "docker", "chaos", "slurm", "superset")
ENGINE_FIXTURES = ("broker",)  # the session broker; `settings` and others reach it through this one


def _refuse(what: str):
    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"a unit test opened {what}: mark it with one of {ENGINE_MARKERS} "
                           "(or move it to tests/integration)")
    return refuse


def _engine_entry_points() -> list[tuple[object, str]]:
    """(module or class, attribute) of every way into chDB, ClickHouse or Kafka, including the
    names gpuledger modules imported with `from X import Y` (patched where they are bound)."""
    import clickhouse_connect
    import confluent_kafka
    import confluent_kafka.admin

    real = {id(confluent_kafka.Producer): "a Kafka producer", id(confluent_kafka.Consumer): "a Kafka consumer",
            id(confluent_kafka.admin.AdminClient): "a Kafka admin client"}
    points = [(clickhouse_connect, "get_client"), (EmbeddedBroker, "start"), (confluent_kafka, "Producer"),
              (confluent_kafka, "Consumer"), (confluent_kafka.admin, "AdminClient")]
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] in ("gpuledger", "agents", "streams"):
            points += [(module, attr) for attr, value in vars(module).items() if id(value) in real]
    return points


@pytest.fixture(autouse=True)
def no_engine_unless_marked(request, monkeypatch):
    """Unit tests run without the broker or the engine: opening either fails the test, so a test
    that needs them says so with a marker (and runs where those are)."""
    if any(request.node.get_closest_marker(m) for m in ENGINE_MARKERS):
        yield
        return
    used = [f for f in ENGINE_FIXTURES if f in request.fixturenames]
    if used:
        pytest.fail(f"unit test uses the {used[0]!r} fixture (the real broker): mark it with one of {ENGINE_MARKERS}")
    for owner, attr in _engine_entry_points():
        what = {"get_client": "ClickHouse/chDB", "start": "the embedded broker"}.get(attr, f"Kafka ({attr})")
        monkeypatch.setattr(owner, attr, _refuse(what))
    yield


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
