"""The whole pipeline against real servers in containers: Apache Kafka (KRaft, topic auto-creation
off) and ClickHouse, driven through the `gpuledger` command line exactly as an operator would,
configured only by GPULEDGER_* environment variables.

Skipped where no Docker engine runs (testcontainers needs one)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.docker


def docker_available() -> bool:
    # The same check as tests/conftest.py's docker_available(). Not imported from there: pytest
    # imports every conftest.py under the module name `conftest`, so `from conftest import ...`
    # would pick up whichever one was loaded last once a test folder gets its own conftest.py.
    if not shutil.which("docker"):
        return False
    try:
        import docker  # installed with testcontainers

        docker.from_env().ping()
        return True
    except Exception:
        return False


if not docker_available():
    pytest.skip("needs a running Docker engine (testcontainers starts Kafka and ClickHouse); none is reachable "
                "here — the docker CLI is missing or its daemon is not running", allow_module_level=True)

try:  # testcontainers >= 4.14 moved the modules under `community`; the old paths warn
    from testcontainers.community.clickhouse import ClickHouseContainer
    from testcontainers.community.kafka import KafkaContainer
except ImportError:  # pragma: no cover - older testcontainers
    from testcontainers.clickhouse import ClickHouseContainer
    from testcontainers.kafka import KafkaContainer

from gpuledger.config import Settings
from gpuledger.processes import ChildProcess, settings_env, wait_until_caught_up

KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"   # what KafkaContainer is built for; KRaft from 7.0
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:25.8"
CLI_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kafka_bootstrap():
    container = KafkaContainer(KAFKA_IMAGE).with_kraft().with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
    container.start(timeout=120)  # the default 30 s is tight on a cold CI machine
    try:
        yield container.get_bootstrap_server()
    finally:
        container.stop()


@pytest.fixture(scope="module")
def clickhouse():
    password = uuid.uuid4().hex
    with ClickHouseContainer(CLICKHOUSE_IMAGE, username="ledger", password=password) as container:
        url = f"http://{container.get_container_host_ip()}:{container.get_exposed_port(8123)}"
        yield url, "ledger", password


@pytest.fixture
def settings(kafka_bootstrap, clickhouse, tmp_path) -> Settings:
    url, user, password = clickhouse
    run_id = uuid.uuid4().hex[:8]
    return Settings(
        kafka_bootstrap=kafka_bootstrap,
        topic_prefix=f"t{run_id}.",
        worker_app_id=f"w{run_id}",
        partitions_gpu_samples=2,
        partitions_job_events=2,
        partitions_usage=2,
        warehouse=url,
        database=f"ledger_{run_id}",
        clickhouse_user=user,
        clickhouse_password=password,
        data_dir=tmp_path / "data",
    )


def gpuledger(settings: Settings, *args: str) -> str:
    """Run `gpuledger ARGS` in a child process configured by GPULEDGER_* variables; its stdout."""
    proc = subprocess.run([sys.executable, "-m", "gpuledger.cli", *args], env=settings_env(settings),
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"gpuledger {' '.join(args)} exited with {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def report(settings: Settings, name: str) -> list[dict]:
    return json.loads(gpuledger(settings, "report", name, "--format", "json"))


def test_simulated_cluster_through_kafka_and_clickhouse(settings, tmp_path):
    created = gpuledger(settings, "topics", "create")
    for topic in settings.partitions():
        assert topic in created
    gpuledger(settings, "migrate")

    t = settings.topics
    with ChildProcess(settings, "worker", log_path=tmp_path / "worker.log") as worker:
        gpuledger(settings, "simulate", "--hours", "0.25", "--nodes", "1")
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=300, alive=worker)
    gpuledger(settings, "sink", "--until-caught-up")

    capacity = report(settings, "capacity")
    assert capacity, "no capacity rows: nothing reached ClickHouse"
    for row in capacity:
        parts = (row["down_gpu_seconds"] + row["unallocated_gpu_seconds"]
                 + row["allocated_idle_gpu_seconds"] + row["executing_gpu_seconds"])
        # capacity = down + unallocated + allocated (idle + executing), per day/cluster/model
        assert row["capacity_gpu_seconds"] == pytest.approx(parts, abs=1e-3), row
        assert row["capacity_gpu_seconds"] > 0, row

    bills = report(settings, "bills")
    assert bills, "no tenant bill rows"
    assert sum(row["total_gpu_hours"] for row in bills) > 0, bills
