"""Credentials come from the environment or from secret files and never show in reprs, dumps or logs."""

from __future__ import annotations

import logging

import pytest

from gpuledger.config import Settings

SECRET = "s3cr3t-Pa55"


def test_passwords_from_files_when_the_variables_are_unset(tmp_path, monkeypatch):
    (tmp_path / "kafka").write_text(SECRET + "\n")
    (tmp_path / "ch").write_text("ch-" + SECRET)
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_PASSWORD_FILE", str(tmp_path / "kafka"))
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_PASSWORD_FILE", str(tmp_path / "ch"))
    monkeypatch.setenv("GPULEDGER_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_USERNAME", "ledger")
    s = Settings()
    assert s.kafka_sasl_password.get_secret_value() == SECRET  # trailing newline dropped
    assert s.clickhouse_password.get_secret_value() == "ch-" + SECRET
    assert s.kafka_client_config()["sasl.password"] == SECRET  # only the client gets the value


def test_the_variable_wins_over_the_file(tmp_path, monkeypatch):
    (tmp_path / "ch").write_text("from-file")
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_PASSWORD_FILE", str(tmp_path / "ch"))
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_PASSWORD", "from-env")
    assert Settings().clickhouse_password.get_secret_value() == "from-env"


def test_an_unreadable_secret_file_stops_the_process_with_its_name(tmp_path):
    with pytest.raises(ValueError, match="GPULEDGER_CLICKHOUSE_PASSWORD_FILE"):
        Settings(clickhouse_password_file=tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")  # named, as a missing file is, not a bare codec error
    with pytest.raises(ValueError, match=r"GPULEDGER_CLICKHOUSE_PASSWORD_FILE: .*binary is not UTF-8 text"):
        Settings(clickhouse_password_file=tmp_path / "binary")


def test_secrets_never_show_in_reprs_dumps_or_logs(caplog):
    s = Settings(kafka_sasl_password=SECRET, clickhouse_password=SECRET, kafka_security_protocol="SASL_SSL")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("gpuledger.test").warning("settings: %s / %r", s, s)
        logging.getLogger("gpuledger.test").warning("dump: %s", s.model_dump())
        logging.getLogger("gpuledger.test").warning("json: %s", s.model_dump_json())
    for text in (repr(s), str(s), str(s.model_dump()), s.model_dump_json(), caplog.text):
        assert SECRET not in text
    assert "**********" in caplog.text


def test_faust_credentials_carry_the_password_without_showing_it():
    from gpuledger.streams.app import faust_broker_credentials

    s = Settings(kafka_sasl_password=SECRET, kafka_sasl_username="ledger", kafka_security_protocol="SASL_PLAINTEXT")
    creds = faust_broker_credentials(s)
    assert creds.password == SECRET and SECRET not in repr(creds)
