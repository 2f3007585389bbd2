"""Every CLI error is one line, `gpuledger: error: ...`, exit code 2, the traceback only under -v:
unreachable broker or warehouse, unmigrated warehouse, unknown job, bad dates, bad settings. Runs the
real CLI (`main`) on the embedded engine (chDB); no broker is needed (the unreachable one is a closed port)."""

from __future__ import annotations

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
