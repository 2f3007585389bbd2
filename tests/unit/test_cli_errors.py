"""Every CLI error is one line, `gpuledger: error: ...`, exit code 2, the traceback only under -v:
unreachable broker or warehouse, unmigrated warehouse, unknown job, bad dates, bad settings. Runs the
real CLI (`main`) on the embedded engine (chDB); no broker is needed (the unreachable one is a closed port)."""

from __future__ import annotations

import os

import pytest

from gpuledger.cli import main


@pytest.fixture(scope="module")
def chdb_dir(tmp_path_factory):
    # one engine directory for the whole module: chDB opens one directory per process
    return tmp_path_factory.mktemp("cli") / "chdb"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("GPULEDGER_WAREHOUSE", "GPULEDGER_LEDGER_CONFIG", "GPULEDGER_DATABASE", "GPULEDGER_KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path / "data"))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuledger: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_unmigrated_warehouse_says_to_migrate(capsys, chdb_dir, monkeypatch):
    monkeypatch.setenv("GPULEDGER_DATABASE", "never_migrated")
    code, _, err = run(capsys, "report", "bills", "--warehouse", f"chdb:{chdb_dir}")
    one_line_error(code, err, "warehouse not migrated", "gpuledger migrate")
    # a directory that does not exist is not created by a report
    code, _, err = run(capsys, "report", "jobs", "--warehouse", f"chdb:{chdb_dir.parent / 'absent'}")
    one_line_error(code, err, "warehouse not migrated", "gpuledger migrate")
    assert not (chdb_dir.parent / "absent").exists()


def test_verbose_shows_the_traceback(capsys, chdb_dir, monkeypatch):
    monkeypatch.setenv("GPULEDGER_DATABASE", "never_migrated")
    code = main(["-v", "report", "bills", "--warehouse", f"chdb:{chdb_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("gpuledger: error: warehouse not migrated")


def test_unreachable_warehouse(capsys):
    code, _, err = run(capsys, "report", "bills", "--warehouse", "http://127.0.0.1:1")
    one_line_error(code, err, "cannot reach ClickHouse at http://127.0.0.1:1")
    code, _, err = run(capsys, "report", "bills", "--warehouse", "ftp://somewhere")
    one_line_error(code, err, "unknown warehouse")


def test_unreachable_broker(capsys, chdb_dir):
    code, _, err = run(capsys, "bills", "close", "--bootstrap", "127.0.0.1:1", "--warehouse", f"chdb:{chdb_dir}")
    one_line_error(code, err, "cannot reach the Kafka broker at 127.0.0.1:1")


@pytest.mark.parametrize("argv, flag", [
    (["report", "bills", "--from", "2024-13-01"], "--from"),
    (["report", "queues", "--to", "yesterday"], "--to"),
    (["bills", "show", "--day", "1/3/2024"], "--day"),
])
def test_bad_dates_name_the_flag(capsys, argv, flag):
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, f"{flag} must be a UTC day YYYY-MM-DD")


def test_from_after_to_and_a_filter_a_report_does_not_take(capsys):
    code, _, err = run(capsys, "report", "bills", "--from", "2024-03-02", "--to", "2024-03-01")
    one_line_error(code, err, "--from 2024-03-02 is after --to 2024-03-01")
    code, _, err = run(capsys, "report", "capacity", "--tenant", "alpha")
    one_line_error(code, err, "report capacity takes no --tenant")
    code, _, err = run(capsys, "report", "weekly", "--limit", "5")
    one_line_error(code, err, "report weekly takes no --limit")
    code, _, err = run(capsys, "report", "jobs", "--limit", "0")
    one_line_error(code, err, "--limit must be a positive number of rows, got 0")
    code, _, err = run(capsys, "report", "bills", "--busy-floor-pct", "5")
    one_line_error(code, err, "report bills takes no --busy-floor-pct")


def test_bad_settings(capsys, monkeypatch):
    monkeypatch.setenv("GPULEDGER_BILLS_CLOSE_GRACE_S", "-1")
    code, _, err = run(capsys, "bills", "list")
    one_line_error(code, err, "bad settings", "GPULEDGER_BILLS_CLOSE_GRACE_S")
    monkeypatch.delenv("GPULEDGER_BILLS_CLOSE_GRACE_S")
    monkeypatch.setenv("GPULEDGER_PARTITIONS_USAGE", "many")
    code, _, err = run(capsys, "topics", "list")
    one_line_error(code, err, "bad settings", "GPULEDGER_PARTITIONS_USAGE")


def test_bad_ledger_config(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(tmp_path / "nope.toml"))
    code, _, err = run(capsys, "report", "bills")
    one_line_error(code, err, "nope.toml", "not found")


def test_a_bad_setting_shows_the_value_given_but_never_a_secret(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPULEDGER_AGENT_INTERVAL_S", "-5")
    code, _, err = run(capsys, "coefficients", "list")
    one_line_error(code, err, "GPULEDGER_AGENT_INTERVAL_S", "greater than or equal to 0.001", "got '-5'")
    monkeypatch.delenv("GPULEDGER_AGENT_INTERVAL_S")
    monkeypatch.setenv("GPULEDGER_KAFKA_SECURITY_PROTOCOL", "tls")
    code, _, err = run(capsys, "coefficients", "list")
    line = one_line_error(code, err, "GPULEDGER_KAFKA_SECURITY_PROTOCOL: must be one of", "got 'tls'")
    assert "Value error" not in line
    monkeypatch.delenv("GPULEDGER_KAFKA_SECURITY_PROTOCOL")
    # a password file that cannot be read is named by its variable; a secret's value is never shown
    monkeypatch.setenv("GPULEDGER_CLICKHOUSE_PASSWORD_FILE", str(tmp_path / "absent"))
    code, _, err = run(capsys, "coefficients", "list")
    one_line_error(code, err, "GPULEDGER_CLICKHOUSE_PASSWORD_FILE", "absent")
    monkeypatch.delenv("GPULEDGER_CLICKHOUSE_PASSWORD_FILE")
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_PASSWORD", "hunter2")
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_PASSWORD_FILE", str(tmp_path))  # a directory: unread (the variable wins)
    monkeypatch.setenv("GPULEDGER_PARTITIONS_USAGE", "0")
    code, _, err = run(capsys, "coefficients", "list")
    assert "hunter2" not in err
    one_line_error(code, err, "GPULEDGER_PARTITIONS_USAGE", "got '0'")


@pytest.mark.parametrize("make", ["directory", "not_utf8", "unreadable", "empty_variable"])
def test_a_ledger_config_that_cannot_be_read_is_one_line_naming_it(capsys, monkeypatch, tmp_path, make):
    path = tmp_path / "ledger.toml"
    if make == "directory":
        path.mkdir()
    elif make == "not_utf8":
        path.write_bytes(b'definition_version = "caf\xe9"\n')
    elif make == "unreadable":
        path.write_text('definition_version = "x"\n')
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("running as root: every file is readable")
    if make == "empty_variable":  # `GPULEDGER_LEDGER_CONFIG=${X:-}`: unset, the bundled file, not "." (a directory)
        monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", "")
        code, out, err = run(capsys, "coefficients", "list", "--format", "csv")
        assert code == 0 and "A100-80GB" in out, err
        return
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(path))
    code, _, err = run(capsys, "coefficients", "list")
    one_line_error(code, err, f"ledger config {path}", {"directory": "Is a directory", "not_utf8": "UTF-8",
                                                      "unreadable": "ermission denied"}[make])


@pytest.mark.integration  # migrates and reads a real chDB
def test_migrated_warehouse_unknown_job_and_empty_reports(capsys, chdb_dir, monkeypatch):
    monkeypatch.setenv("GPULEDGER_DATABASE", "cli_ok")
    warehouse = f"chdb:{chdb_dir}"
    code, out, err = run(capsys, "migrate", "--warehouse", warehouse)
    assert code == 0, err
    code, _, err = run(capsys, "report", "job", "nope", "--warehouse", warehouse)
    one_line_error(code, err, "no job 'nope'")
    for report in ("bills", "jobs", "queues"):
        code, out, err = run(capsys, "report", report, "--warehouse", warehouse, "--tenant", "t", "--queue", "q",
                             "--cluster", "c", "--from", "2024-03-01", "--to", "2024-03-02", "--format", "json")
        assert (code, out, err) == (0, "[]\n", "")
    code, out, err = run(capsys, "report", "unmatched", "--warehouse", warehouse, "--busy-floor-pct", "5",
                         "--limit", "3", "--format", "json")
    assert (code, out, err) == (0, "[]\n", "")
    code, _, err = run(capsys, "report", "unmatched", "--warehouse", warehouse, "--busy-floor-pct", "nan")
    one_line_error(code, err, "busy_floor_pct must be a number of percent")
    code, out, err = run(capsys, "bills", "close", "--no-publish", "--warehouse", warehouse)
    assert code == 0 and '"bill_run_id": null' in out, err
    code, out, err = run(capsys, "bills", "audit", "--warehouse", warehouse, "--fail-on-duplicates")
    assert (code, out) == (0, "(no rows)\n")


@pytest.mark.parametrize("argv", [
    ["replay", "{tmp}", "--bootstrap", "127.0.0.1:1"],          # a directory for the dump
    ["simulate", "--hours", "0.01", "--dump", "{tmp}"],        # a directory for the output
    ["schemas", "export", "--output", "{tmp}/file"],           # a file where a directory goes
])
def test_a_path_that_is_the_wrong_kind_of_thing_is_one_line_naming_it(capsys, tmp_path, argv):
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    one_line_error(code, err, str(tmp_path))


def test_a_message_that_fails_its_schema_is_not_called_a_bad_setting(capsys):
    # the GPU agent's --node goes into every NodeTick; there is no GPULEDGER_NODE to blame
    code, _, err = run(capsys, "agent", "gpu", "--backend", "sim", "--once", "--print", "--node", " n")
    line = one_line_error(code, err, "NodeTick", "node", "leading/trailing whitespace")
    assert "bad settings" not in line and "GPULEDGER_" not in line
