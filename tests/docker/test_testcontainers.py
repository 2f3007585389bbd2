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
from gpuledger.embedded.processes import ChildProcess, settings_env, wait_until_caught_up

KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"   # what KafkaContainer is built for; KRaft from 7.0
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:25.8"
CLI_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kafka_container():
    container = KafkaContainer(KAFKA_IMAGE).with_kraft().with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
    container.start(timeout=120)  # the default 30 s is tight on a cold CI machine
    try:
        yield container
    finally:
        container.stop()


@pytest.fixture(scope="module")
def kafka_bootstrap(kafka_container):
    return kafka_container.get_bootstrap_server()


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


def bills_exact(settings: Settings) -> list[tuple]:
    """The tenant bills as exact micro-units, for comparing two runs row by row."""
    return sorted((r["day"], r["tenant"], r["compute_cost_micros"], r["idle_cost_micros"], r["failed_retry_cost_micros"])
                  for r in report(settings, "bills"))


def run_pipeline(settings: Settings, dump, tmp_path, during=None) -> None:
    """Topics, migrations, the dump replayed, worker and sink as child processes until everything is
    consumed; `during()` runs while they work (the fault)."""
    from gpuledger.sink.loop import sink_topics

    gpuledger(settings, "topics", "create")
    gpuledger(settings, "migrate")
    t = settings.topics
    with ChildProcess(settings, "worker", log_path=tmp_path / f"{settings.worker_app_id}-worker.log") as worker, \
            ChildProcess(settings, "sink", log_path=tmp_path / f"{settings.worker_app_id}-sink.log"):
        gpuledger(settings, "replay", str(dump), "--quiet")
        if during:
            during()
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=600, alive=worker)
        wait_until_caught_up(settings, f"{settings.worker_app_id}-sink", sink_topics(settings), timeout_s=600)


def test_broker_restart_mid_replay_changes_no_bill(settings, tmp_path, kafka_container):
    """Apache Kafka keeps its log on disk (unlike the in-memory Tansu), so here the broker itself
    is restarted while the worker and sink are busy; the bills must equal a run without restart."""
    import time

    dump = tmp_path / "sim.jsonl"
    gpuledger(settings, "simulate", "--hours", "1", "--nodes", "2", "--dump", str(dump))
    run_pipeline(settings, dump, tmp_path)
    reference = bills_exact(settings)
    assert reference

    run_id = uuid.uuid4().hex[:8]
    again = settings.model_copy(update={"topic_prefix": f"r{run_id}.", "worker_app_id": f"r{run_id}",
                                        "database": f"ledger_r{run_id}", "data_dir": tmp_path / "restart"})
    bootstrap = kafka_container.get_bootstrap_server()

    def restart_broker() -> None:
        time.sleep(3)  # let the worker and sink get going
        kafka_container.get_wrapped_container().restart(timeout=30)
        assert kafka_container.get_bootstrap_server() == bootstrap, "the broker came back on another port"

    run_pipeline(again, dump, tmp_path, during=restart_broker)
    assert bills_exact(again) == reference
