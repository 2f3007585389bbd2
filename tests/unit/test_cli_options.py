"""`gpuledger report` options a table, storage or card report does not take (JOB_ID, the periodic
reports' --days/--as-of/--month/--top/..., --by outside utilization, --idle-redistribution outside
bills) are refused before the warehouse is read, worded as the periodic reports refuse theirs, not
silently dropped; --output writes every report; `bills audit --cluster` audits that cluster only; and
the small ones: an empty --by, a zero --coefficient and a bad rebill --as-of each say what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuledger.cli import main

H = 3600_000
T0 = 1_709_251_200_000  # 2024-03-01 00:00 UTC


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("GPULEDGER_WAREHOUSE", "GPULEDGER_LEDGER_CONFIG", "GPULEDGER_DATABASE", "GPULEDGER_KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path / "data"))


def one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gpuledger: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["jobs", "j1"], "JOB_ID"),
    (["jobs", "--top", "1"], "--top"),
    (["bills", "--as-of", "2024-03-01"], "--as-of"),
    (["bills", "--month", "2024-02"], "--month"),
    (["queues", "--days", "7"], "--days"),
    (["capacity", "--cards", "3"], "--cards"),
    (["unmatched", "--anomalies", "2"], "--anomalies"),
    (["alerts", "--stretches", "2"], "--stretches"),
    (["jobs", "--by", "tenant"], "--by"),
    (["jobs", "--idle-redistribution", "even"], "--idle-redistribution"),
    (["suggestions", "--idle-redistribution", "even"], "--idle-redistribution"),
    (["storage", "--top", "3"], "--top"),
    (["gpu-fleet", "--as-of", "2024-03-01"], "--as-of"),
])
def test_an_option_the_report_does_not_take_is_refused(capsys, argv, flag):
    # refused before the warehouse is opened (a unit test cannot open it)
    line = one_line_error(capsys, ["report", *argv])
    assert f"report {argv[0]} takes no {flag} (it takes " in line, line


def test_the_refusal_says_what_the_report_takes(capsys):
    line = one_line_error(capsys, ["report", "jobs", "j1", "--top", "1"])
    assert line == ("gpuledger: error: report jobs takes no JOB_ID, --top (it takes --tenant, --queue, --cluster, "
                    "--from, --to, --limit); `report job JOB_ID` is one job's report")
    line = one_line_error(capsys, ["report", "bills", "--by", "tenant"])
    assert line.endswith("(it takes --tenant, --queue, --cluster, --from, --to, --limit, --idle-redistribution)"), line
    line = one_line_error(capsys, ["report", "storage", "--days", "3"])
    assert line.endswith("report storage takes no --days (it takes no options)"), line


@pytest.mark.parametrize("by", ["", " , "])
def test_an_empty_by_is_refused_not_the_default_grouping(capsys, by):
    line = one_line_error(capsys, ["report", "utilization", "--by", by])
    assert "--by needs at least one of day,cluster" in line and f"got {by!r}" in line, line


def test_a_zero_coefficient_is_refused_as_such(capsys, monkeypatch, tmp_path):
    ledger = tmp_path / "ledger.toml"
    shutil.copy(Path(__file__).resolve().parents[2] / "gpuledger" / "ledger_defaults.toml", ledger)
    before = ledger.read_text()
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(ledger))
    line = one_line_error(capsys, ["coefficients", "add", "--model", "A100", "--coefficient", "0",
                                   "--valid-from", "2024-01-01"])
    assert "a coefficient must be > 0, got 0.0" in line, line
    assert ledger.read_text() == before


@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_an_infinite_coefficient_leaves_the_ledger_file_as_it_was(capsys, monkeypatch, tmp_path, value):
    # it was written, `coefficient = inf`, and then refused on reading: every worker and report stopped
    ledger = tmp_path / "ledger.toml"
    shutil.copy(Path(__file__).resolve().parents[2] / "gpuledger" / "ledger_defaults.toml", ledger)
    before = ledger.read_text()
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(ledger))
    line = one_line_error(capsys, ["coefficients", "add", "--model", "A100", "--coefficient", value,
                                   "--valid-from", "2024-01-01"])
    assert "--coefficient must be a finite number > 0, got inf" in line, line
    assert ledger.read_text() == before


@pytest.mark.parametrize("argv, flag", [
    (["--from", "2024-03-01", "--to", "2024-03-02", "--as-of", "x"], "--as-of"),
    (["--from", "March", "--to", "2024-03-02", "--as-of", "2024-03-01"], "--from"),
])
def test_rebill_names_the_bad_date_flag(capsys, argv, flag):
    line = one_line_error(capsys, ["rebill", *argv])
    assert f"{flag} must be a UTC day YYYY-MM-DD" in line, line


@pytest.fixture(scope="module")
def warehouse_with_a_duplicate(tmp_path_factory):
    """A migrated chDB (one directory for the module: chDB opens one per process) with usage on c1 and c2,
    c2's record written twice (a duplicate in cluster c2 only)."""
    from warehouse_helpers import migrated_warehouse, put_usage, usage_record

    path = tmp_path_factory.mktemp("cli-options")
    with migrated_warehouse(path, "cli_options") as (client, settings):
        records = [usage_record("c1", "g1", T0, T0 + H, "executing", job="j1", tenant="t1"),
                   usage_record("c1", "g3", T0, T0 + H, "executing", job="j2", tenant="t2"),
                   usage_record("c2", "g9", T0, T0 + H, "executing", job="k1", tenant="t1")]
        put_usage(client, "cli_options", records, 0)
        put_usage(client, "cli_options", [records[2]], 1)
        yield ["--warehouse", settings.warehouse]


@pytest.fixture
def warehouse_args(warehouse_with_a_duplicate, monkeypatch):
    monkeypatch.setenv("GPULEDGER_DATABASE", "cli_options")
    return warehouse_with_a_duplicate


@pytest.mark.integration  # reads a real chDB
def test_output_writes_a_table_report_to_the_file(capsys, tmp_path, warehouse_args):
    assert main(["report", "bills", "--format", "csv", *warehouse_args]) == 0
    printed = capsys.readouterr().out
    target = tmp_path / "bills.csv"
    assert main(["report", "bills", "--format", "csv", "--output", str(target), *warehouse_args]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"wrote {target}\n")
    assert target.read_text() == printed and "c1" in printed


@pytest.mark.integration  # reads a real chDB
def test_bills_audit_cluster_audits_that_cluster_only(capsys, warehouse_args):
    def audit(*argv):
        code = main(["bills", "audit", "--fail-on-duplicates", "--format", "json", *argv, *warehouse_args])
        return code, {r["source_table"]: r["duplicates"] for r in json.loads(capsys.readouterr().out)}

    assert audit() == (1, {"usage_raw": 1, "usage_by_job_daily": 1, "usage_capacity_daily": 1})
    assert audit("--cluster", "c1") == (0, {"usage_raw": 0, "usage_by_job_daily": 0, "usage_capacity_daily": 0})
    assert audit("--cluster", "c2") == (1, {"usage_raw": 1, "usage_by_job_daily": 1, "usage_capacity_daily": 1})
    assert audit("--cluster", "c3") == (0, {})


def _readme_report_filters():
    """(reports, filter flags) of each `gpuledger report NAMES [...]` in README.md."""
    import re

    from gpuledger.cli import REPORT_FILTER_FLAGS

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for names, rest in re.findall(r"`gpuledger report ([a-z{},\\|-]+) ([^`]*)`", text):
        reports = re.split(r"[{},|\\]+", names)
        yield [r for r in reports if r], [f for f in re.findall(r"--[a-z-]+", rest) if f in REPORT_FILTER_FLAGS.values()]


def test_the_readme_lists_only_the_filters_each_report_takes():
    from gpuledger.cli import REPORT_FILTER_FLAGS
    from gpuledger.warehouse.reports import REPORT_FILTERS

    flag_name = {flag: name for name, flag in REPORT_FILTER_FLAGS.items()}
    rows = [(reports, flags) for reports, flags in _readme_report_filters() if flags]
    assert {"alerts", "suggestions", "capacity", "bills"} <= {r for reports, _ in rows for r in reports}, rows
    wrong = [f"{r} {f}" for reports, flags in rows for r in reports for f in flags
             if flag_name[f] not in REPORT_FILTERS.get(r, ())]
    assert not wrong, f"README.md lists filters these reports do not take: {wrong}"


@pytest.mark.parametrize("flag, name", [("--tenant", "tenant"), ("--queue", "queue"), ("--cluster", "cluster")])
def test_the_filter_help_names_the_reports_that_take_it(flag, name):
    from gpuledger.cli import build_parser
    from gpuledger.warehouse.reports import REPORT_FILTERS

    report = build_parser("report")._subparsers._group_actions[0].choices["report"]
    help_text = next(a.help for a in report._actions if flag in a.option_strings)
    named = set(help_text.split(":")[0].replace(" ", "").split(","))
    assert named == {r for r, filters in REPORT_FILTERS.items() if name in filters}, help_text


@pytest.mark.parametrize("argv, flag", [
    (["tail", "alerts", "--max", "0"], "--max"),          # printed one message and exited
    (["tail", "alerts", "--max", "-2"], "--max"),
    (["tail", "alerts", "--idle-timeout", "nan"], "--idle-timeout"),  # never timed out
    (["tail", "alerts", "--idle-timeout", "-1"], "--idle-timeout"),
    (["simulate", "--speedup", "0"], "--speedup"),         # refused only after the broker was contacted
    (["simulate", "--speedup", "inf"], "--speedup"),
    (["replay", "dump.jsonl", "--speedup", "-3"], "--speedup"),
])
def test_an_impossible_number_is_a_usage_error_before_anything_is_opened(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--bootstrap", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}:" in err and "Kafka" not in err, err


@pytest.mark.parametrize("argv, flag", [
    (["report", "bills", "--data-dir", ""], "--data-dir"),
    (["report", "bills", "--warehouse", ""], "--warehouse"),
    (["agent", "--data-dir", "", "gpu", "--backend", "sim", "--once", "--print"], "--data-dir"),
    (["agent", "--bootstrap", "", "gpu", "--backend", "sim", "--once", "--print"], "--bootstrap"),
])
def test_an_empty_override_is_refused_not_ignored(capsys, argv, flag):
    # `--data-dir "$DIR"` with DIR unset ran on GPULEDGER_DATA_DIR or ./.gpuledger without a word
    line = one_line_error(capsys, argv)
    assert f"{flag} must not be empty" in line


@pytest.mark.parametrize("argv, message", [
    # reversed days audited nothing and `--fail-on-duplicates` passed
    (["audit", "--from", "2024-03-05", "--to", "2024-03-01", "--fail-on-duplicates"],
     "--from 2024-03-05 is after --to 2024-03-01"),
    (["audit", "--day", "2024-03-01"], "bills audit takes no --day (it takes --cluster, --from, --to"),  # audited every day
    (["list", "--cluster", "c1"], "bills list takes no --cluster"),
    (["show", "--day", "2024-03-01", "--from", "2024-03-01"], "bills show takes no --from"),
    (["close", "--limit", "3"], "bills close takes no --limit"),
    (["publish", "--run", "r1", "--fail-on-duplicates"], "bills publish takes no --fail-on-duplicates"),
])
def test_a_bills_option_its_action_does_not_take_is_refused(capsys, argv, message):
    line = one_line_error(capsys, ["bills", *argv, "--bootstrap", "127.0.0.1:1"])
    assert message in line, line


def test_the_jobs_reports_opportunity_cost_is_the_price_valid_now(monkeypatch, tmp_path):
    """A price agreed in advance (A100-80GB from 2099) is not today's: the jobs report's opportunity cost of
    waiting took the latest entry, 4.0/h instead of 0.48/h (the warehouse's reading is replaced: the
    filters the command builds are what is checked)."""
    from gpuledger import warehouse
    from gpuledger.warehouse import reports

    ledger = tmp_path / "ledger.toml"
    defaults = (Path(__file__).resolve().parents[2] / "gpuledger" / "ledger_defaults.toml").read_text()
    ledger.write_text(defaults + '\n[[prices]]\nmodel = "A100-80GB"\nvalid_from = "2099-01-01"\n'
                                 'depreciation_per_hour = 3.95\nmaintenance_per_hour = 0.05\n')
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(ledger))
    seen: dict = {}

    class NoWarehouse:
        def close(self):
            pass

    monkeypatch.setattr(warehouse, "connect_readonly", lambda settings: NoWarehouse())
    monkeypatch.setattr(reports, "fetch", lambda client, db, name, **filters: seen.update(filters) or [])
    assert main(["report", "jobs", "--format", "json"]) == 0
    assert seen["reference_cost_per_gpu_hour"] == pytest.approx(0.48)
