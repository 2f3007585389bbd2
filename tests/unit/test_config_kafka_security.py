"""GPULEDGER_KAFKA_SECURITY_PROTOCOL: any case, normalised to upper case (a lower-case sasl_ssl
dropped the SASL credentials), and nothing but the four protocols librdkafka knows."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from gpuledger.config import Settings


@pytest.mark.parametrize("value", ["sasl_ssl", "SASL_SSL", "Sasl_Plaintext", " sasl_ssl "])
def test_lower_case_sasl_keeps_the_credentials(value, monkeypatch):
    monkeypatch.setenv("GPULEDGER_KAFKA_SECURITY_PROTOCOL", value)
    conf = Settings(kafka_sasl_username="ledger", kafka_sasl_password="pw").kafka_client_config()
    assert conf["security.protocol"] == value.strip().upper()
    assert (conf["sasl.mechanism"], conf["sasl.username"], conf["sasl.password"]) == ("PLAIN", "ledger", "pw")


@pytest.mark.parametrize("value,upper", [("plaintext", "PLAINTEXT"), ("ssl", "SSL")])
def test_other_protocols_are_normalised_too(value, upper):
    conf = Settings(kafka_security_protocol=value, kafka_sasl_username="u").kafka_client_config()
    assert conf["security.protocol"] == upper and "sasl.username" not in conf


@pytest.mark.parametrize("value", ["SASL_TLS", "tls", "", "sasl"])
def test_an_unknown_protocol_is_refused_naming_it(value):
    with pytest.raises(ValidationError, match="must be one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL"):
        Settings(kafka_security_protocol=value)


def test_the_command_line_says_so_in_one_line(tmp_path):
    env = {"GPULEDGER_KAFKA_SECURITY_PROTOCOL": "sasl_tls", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "gpuledger.cli", "topics", "list"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPULEDGER_KAFKA_SECURITY_PROTOCOL" in lines[0] and "'sasl_tls'" in lines[0]
