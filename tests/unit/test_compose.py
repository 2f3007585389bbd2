"""docker-compose.yml and the Dockerfile against the code, without Docker: every GPULEDGER_*
variable is a Settings field, every ledger command parses with the real CLI parser, the topics
the stack configures are the ones the code uses, and the services start in a workable order."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from gpuledger.cli import build_parser
from gpuledger.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

INFRA_SERVICES = {"kafka", "clickhouse", "superset"}
LEDGER_SERVICES = {"topics", "migrate", "agents", "worker", "sink", "dashboards"}
ONE_SHOT_SERVICES = {"topics", "migrate", "dashboards"}
# topic names (after the prefix) the worker, sink, agents and replay use
EXPECTED_TOPICS = {"gpu-samples", "job-events", "scheduler-snapshots", "node-allocations", "usage", "dead-letters",
                   "late-events", "worker-state", "lifecycle-accepted", "bills",
                   "job-progress", "approvals",  # line 4 (training progress) and pilot-run approvals (docs/planning.md)
                   "alerts", "reclaim-suggestions", "watch-state"}  # the watcher (docs/alerts.md)

_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value) -> str:
    """Compose-style `${NAME:-default}` / `${NAME-default}` / `${NAME}`, resolved to the default
    (the shell's environment is ignored so the test does not depend on who runs it); `$$` is `$`."""
    text = str(value)
    text = _VARIABLE.sub(lambda m: m.group(2) or "", text)
    return text.replace("$$", "$")


def environment(service: dict) -> dict[str, str]:
    """A service's environment as a dict, interpolated (compose allows a map or a KEY=VALUE list)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: interpolate(value) for key, value in env.items()}


def ledger_values(service: dict) -> dict[str, str]:
    """GPULEDGER_* variables of a service as Settings keyword arguments."""
    return {key[len("GPULEDGER_"):].lower(): value
            for key, value in environment(service).items() if key.startswith("GPULEDGER_")}


def command(service: dict) -> list[str]:
    cmd = service.get("command")
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    # safe_load resolves the `<<: *ledger` merge keys, as compose does
    return yaml.safe_load(COMPOSE.read_text())["services"]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# --------------------------------------------------------------------------- services
def test_required_services_exist(services):
    missing = (INFRA_SERVICES | LEDGER_SERVICES) - set(services)
    assert not missing, f"docker-compose.yml lacks services {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(LEDGER_SERVICES))
def test_ledger_services_run_the_project_image(services, name):
    service = services[name]
    build = service.get("build")
    context = build.get("context") if isinstance(build, dict) else build
    assert context in (".", "./"), f"{name}: must build the project's Dockerfile (build context '.')"
    assert service.get("image") == services["worker"].get("image"), f"{name}: all ledger services share one image"


def test_every_gpuledger_variable_is_a_settings_field(services):
    unknown = {
        f"{name}: {key}"
        for name, service in services.items()
        for key in environment(service)
        if key.startswith("GPULEDGER_") and key[len("GPULEDGER_"):].lower() not in Settings.model_fields
    }
    assert not unknown, f"GPULEDGER_* variables that no Settings field reads: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(LEDGER_SERVICES))
def test_ledger_settings_validate(services, name):
    Settings(**ledger_values(services[name]))  # raises on a bad value (e.g. a non-integer partition count)


def test_ledger_services_share_one_environment(services):
    # producers, worker and sink must agree on bootstrap, prefix and partition counts
    envs = {name: ledger_values(services[name]) for name in LEDGER_SERVICES}
    reference = envs["worker"]
    for name, values in envs.items():
        assert values == reference, f"{name}'s GPULEDGER_* environment differs from the worker's"


@pytest.mark.parametrize("name", sorted(LEDGER_SERVICES))
def test_ledger_command_parses(services, name):
    argv = command(services[name])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports a bad command line by exiting
        pytest.fail(f"{name}: `gpuledger {' '.join(argv)}` does not parse (exit {exc.code})")
    assert args.command == argv[0]


def test_service_commands_are_the_intended_ones(services):
    assert command(services["topics"])[:2] == ["topics", "create"]
    assert command(services["migrate"])[:1] == ["migrate"]
    assert command(services["worker"])[:1] == ["worker"]
    agents = build_parser().parse_args(command(services["agents"]))
    # the simulated cluster publishing live: to Kafka (no dump), paced at 60x event time
    assert agents.command == "simulate" and agents.dump is None and agents.speedup == 60
    sink = build_parser().parse_args(command(services["sink"]))
    assert sink.command == "sink" and not sink.until_caught_up, "the demo sink keeps running"


# --------------------------------------------------------------------------- Kafka and topics
def test_kafka_auto_create_is_disabled(services):
    env = environment(services["kafka"])
    assert env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "").lower() == "false"


def test_topics_are_the_ones_the_code_expects(services):
    values = ledger_values(services["topics"])
    settings = Settings(**values)
    prefix = settings.topic_prefix
    partitions = settings.partitions()
    assert set(partitions) == {prefix + topic for topic in EXPECTED_TOPICS}
    # the names the code derives from the same prefix (what worker, sink and agents use)
    t = settings.topics
    assert {t.gpu_samples, t.job_events, t.scheduler_snapshots, t.node_allocations, t.usage, t.dead_letters,
            t.late_events, t.worker_state, t.lifecycle_accepted, t.bills, t.job_progress, t.approvals, t.alerts,
            t.reclaim_suggestions, t.watch_state} == set(partitions)
    assert partitions[t.node_allocations] == partitions[t.gpu_samples], "node-allocations is co-partitioned with gpu-samples"
    assert settings.replication_factor == 1, "the demo stack has a single broker"


def test_worker_and_sink_share_the_advertised_bootstrap(services):
    worker = ledger_values(services["worker"])["kafka_bootstrap"]
    sink = ledger_values(services["sink"])["kafka_bootstrap"]
    assert worker == sink, f"worker uses {worker}, sink uses {sink}"
    advertised = {
        listener.split("://", 1)[1]
        for listener in environment(services["kafka"])["KAFKA_ADVERTISED_LISTENERS"].split(",")
    }
    for server in worker.split(","):
        assert server in advertised, f"{server} is not a listener the broker advertises ({sorted(advertised)})"
        assert server.split(":")[0] in services, f"{server}: host is not a compose service"


def test_warehouse_is_the_clickhouse_service_with_its_credentials(services):
    values = ledger_values(services["sink"])
    assert values["warehouse"] == "http://clickhouse:8123"
    clickhouse = environment(services["clickhouse"])
    assert values["clickhouse_user"] == clickhouse["CLICKHOUSE_USER"]
    assert values["clickhouse_password"] == clickhouse["CLICKHOUSE_PASSWORD"]
    assert "healthcheck" in services["clickhouse"]


# --------------------------------------------------------------------------- start order
def depends(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short form: only "started"
        return {name: "service_started" for name in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def test_start_order(services):
    assert depends(services["topics"]).get("kafka") == "service_healthy"
    assert depends(services["migrate"]).get("clickhouse") == "service_healthy"
    for name in ("agents", "worker", "sink"):
        assert depends(services[name]).get("topics") == "service_completed_successfully", name
    assert depends(services["sink"]).get("migrate") == "service_completed_successfully"


def test_conditions_can_be_met(services):
    for name, service in services.items():
        for target, condition in depends(service).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no healthcheck"
            if condition == "service_completed_successfully":
                # a restart policy would restart a one-shot that exited 0 and the condition is never met
                assert str(services[target].get("restart", "no")) == "no", f"{target} is one-shot: restart must be 'no'"


def test_one_shot_services_do_not_restart(services):
    for name in ONE_SHOT_SERVICES:
        assert str(services[name].get("restart", "no")) == "no"


# --------------------------------------------------------------------------- Dockerfile
def test_dockerfile_installs_the_package_with_the_gpuledger_entrypoint():
    instructions = dockerfile_instructions()
    stages = [args for word, args in instructions if word == "FROM"]
    assert stages and all(s.split()[0] == "python:3.11-slim" for s in stages), stages

    runs = " && ".join(args for word, args in instructions if word == "RUN")
    # the package is built/installed from the source tree as a regular (non-editable) install
    assert re.search(r"pip (install|wheel)\b[^&;|]*\s\.(\s|$)", runs), "no `pip install .` / `pip wheel .`"
    assert not re.search(r"pip install\b[^&;|]*\s(-e|--editable)\b", runs), "the image must not use an editable install"

    entrypoints = [json.loads(args) for word, args in instructions if word == "ENTRYPOINT"]
    assert entrypoints and entrypoints[-1] == ["gpuledger"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "gpuledger" in scripts, "the entrypoint must be a console script of the package"


def test_dockerfile_environment_is_settings_fields():
    for word, args in dockerfile_instructions():
        if word == "ENV":
            for name in re.findall(r"(GPULEDGER_\w+)=", args):
                assert name[len("GPULEDGER_"):].lower() in Settings.model_fields, name


def test_dockerignore_keeps_local_state_out():
    ignored = {line.strip().rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()}
    assert {".git", ".venv", ".gpuledger"} <= ignored
