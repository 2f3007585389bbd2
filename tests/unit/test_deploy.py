"""The deployment files in deploy/ say what the code does: every command parses with the real
command line (the `gpuledger` CLI, then the agent's own parser), every GPULEDGER_* variable is a
setting the ledger reads and its value is valid, and the manifests are well-formed."""

from __future__ import annotations

import configparser
import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

from gpuledger.cli import AGENT_MODULES, build_parser
from gpuledger.config import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def parse_command(argv: list[str]) -> tuple[str, object]:
    """argv after the `gpuledger` executable -> (agent kind or command, its parsed arguments)."""
    args = build_parser().parse_args(argv)
    if args.command != "agent":
        return args.command, args
    module = importlib.import_module(f"gpuledger.agents.{AGENT_MODULES[args.kind]}")
    return args.kind, module.build_parser(Settings()).parse_args(args.agent_args)


def check_settings(env: dict[str, str], where: str) -> None:
    fields = Settings.model_fields
    overrides = {}
    for name, value in env.items():
        if not name.startswith("GPULEDGER_"):
            continue
        field = name.removeprefix("GPULEDGER_").lower()
        assert field in fields, f"{where}: {name} is not a setting (docs/configuration.md lists them)"
        if not field.endswith("_password_file"):  # a secret on the target host, not here
            overrides[field] = value
    Settings(**overrides)  # every value valid


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(path)
    return parser


def env_file(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return {k.strip(): v.strip() for k, v in pairs}


def test_there_are_units_and_manifests_for_every_agent_that_deploys():
    kinds = {parse_command(shlex.split(unit(u)["Service"]["ExecStart"])[1:])[0] for u in UNITS}
    assert kinds == {"gpu", "slurm", "bills"}
    timer = unit(DEPLOY / "systemd" / "gpuledger-bills-close.timer")["Timer"]
    assert timer["OnUnitActiveSec"] and (DEPLOY / "systemd" / "gpuledger-bills-close.service").exists()
    assert {p.name for p in MANIFESTS} >= {"gpu-agent-daemonset.yaml", "kubernetes-agent.yaml",
                                             "namespace-and-config.yaml"}


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_systemd_units_run_real_commands_with_real_settings(path):
    service = unit(path)["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/gpuledger")
    kind, args = parse_command(argv[1:])
    for extra in ("ExecStartPost",):
        if extra in service:
            parse_command(shlex.split(service[extra])[1:])
    env_path = service["EnvironmentFile"].lstrip("-")
    assert env_path == "/etc/gpuledger/gpuledger.env"
    env = env_file(DEPLOY / "systemd" / "gpuledger.env")
    for line in unit(path)["Service"].get("Environment", "").split("\n"):
        if line.strip():
            name, value = line.split("=", 1)
            env[name] = value
    check_settings(env, path.name)
    assert env["GPULEDGER_DATA_DIR"] == "/var/lib/gpuledger" and service["StateDirectory"] == "gpuledger"
    if kind == "slurm":
        assert str(args.state_file).startswith("/var/lib/gpuledger/")  # kept across restarts
    if kind == "bills":
        assert args.action == "close" and service["Type"] == "oneshot"
    else:
        assert service["Restart"] == "always"


def documents() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text()) if doc]


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def test_manifests_are_well_formed_and_namespaced():
    for name, doc in documents():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), name
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == "gpuledger", f"{name}: {doc['kind']} outside the namespace"


def test_manifest_commands_and_settings_match_the_cli():
    config_maps = {doc["metadata"]["name"]: doc["data"] for _, doc in documents() if doc["kind"] == "ConfigMap"}
    seen = set()
    for name, doc in documents():
        for container in containers(doc):
            env_names = {e["name"] for e in container.get("env", [])}
            # $(VAR) is expanded by the kubelet from the container's env: it must be defined there
            argv = []
            for arg in container["args"]:
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env_names, f"{name}: $({var}) is not in the container's env"
                argv.append(re.sub(r"\$\((\w+)\)", "x", arg))
            kind, _ = parse_command(argv)
            seen.add(kind)
            env = {e["name"]: e.get("value", "") for e in container.get("env", []) if "value" in e}
            for ref in container.get("envFrom", []):
                env.update(config_maps[ref["configMapRef"]["name"]])
            check_settings(env, f"{name}/{container['name']}")
    assert seen >= {"gpu", "kubernetes"}
