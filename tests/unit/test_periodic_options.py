"""The periodic reports' command-line options and plots without a warehouse: a bad --as-of names the
flag, an option the report does not take is refused (not silently dropped), monthly and weekly share
the cluster idle as the ledger's [idle] policy says unless --idle-redistribution does, and names with
matplotlib mathtext pairs ("$...$") are drawn as text, not parsed."""

from __future__ import annotations

import re

import pytest

from gpuledger.cli import build_parser
from gpuledger.ledger_files import write_ledger_variant
from gpuledger.warehouse.periodic import commands as pr
from gpuledger.warehouse.periodic.charts import svg_plot
from gpuledger.warehouse.periodic.model import Plot
from gpuledger.warehouse.periodic.queries import period_end


def args(*argv: str):
    return build_parser("report").parse_args(["report", *argv])


@pytest.fixture(autouse=True)
def bundled_ledger(monkeypatch, tmp_path):
    monkeypatch.delenv("GPULEDGER_LEDGER_CONFIG", raising=False)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path / "data"))


@pytest.mark.parametrize("value", ["2026/11/02", "2026-11-31", "yesterday"])
def test_bad_as_of_names_the_flag_and_the_format(value):
    with pytest.raises(ValueError, match=re.escape(f"as_of (--as-of) must be a UTC day YYYY-MM-DD, got {value!r}")):
        period_end(None, "db", value)


@pytest.mark.parametrize("argv,flag", [
    (["weekly", "--month", "2026-10"], "--month"),
    (["monthly", "--days", "7"], "--days"),
    (["job", "job-1", "--as-of", "2026-01-01"], "--as-of"),
    (["inventory", "--anomalies", "3"], "--anomalies"),
    (["weekly", "job-1"], "JOB_ID"),
    (["inventory", "--idle-redistribution", "even"], "--idle-redistribution"),
    (["monthly", "--by", "day"], "--by"),
    (["forecast", "--top", "3"], "--top"),
])
def test_options_the_report_does_not_take_are_refused(argv, flag):
    with pytest.raises(ValueError, match=f"report {argv[0]} takes no {flag} "):
        pr.report_options(argv[0], args(*argv))


def test_options_the_report_takes():
    assert pr.report_options("weekly", args("weekly", "--as-of", "2026-11-02", "--top", "3")) == {
        "as_of": "2026-11-02", "top": 3, "anomalies_per_kind": None, "idle_redistribution": None,
        "ledger_idle_redistribution": "none"}
    assert pr.report_options("job", args("job", "job-1", "--stretches", "5")) == {
        "job_id": "job-1", "stretches_listed": 5}


def test_monthly_and_weekly_share_cluster_idle_as_the_ledger_does(monkeypatch, tmp_path):
    ledger = write_ledger_variant(None, tmp_path / "ledger.toml", suffix="even", idle={"redistribution": "even"})
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(ledger))
    for name in ("monthly", "weekly"):
        # each version's recorded policy, the ledger's where none is recorded; the flag for every row
        got = pr.report_options(name, args(name))
        assert (got["idle_redistribution"], got["ledger_idle_redistribution"]) == (None, "even")
        got = pr.report_options(name, args(name, "--idle-redistribution", "usage"))
        assert (got["idle_redistribution"], got["ledger_idle_redistribution"]) == ("usage", "even")


@pytest.mark.parametrize("name", ["sweep_$a_b_c$", "run$\\x$", "train$lr=1e-4$"])
def test_plot_labels_with_dollar_pairs_are_text(name):
    rows = [{"job_id": name, "cost": 2.0}, {"job_id": "plain", "cost": 1.0}]
    svg = svg_plot(rows, Plot("bar", "job_id", ["cost"]), "USD")
    assert name.replace("<", "&lt;") in svg  # drawn as written (svg.fonttype none keeps text as text)


def test_an_unknown_currency_is_filled_from_every_row_of_the_period():
    """Rows kept from a longer list (the top jobs) take the one currency of the whole list, and none
    where the whole list knows two, even when the rows kept know only one."""
    from gpuledger.warehouse.periodic.queries import fill_unknown_currency

    kept = [{"currency": ""}, {"currency": "EUR"}]
    assert [r["currency"] for r in fill_unknown_currency([dict(r) for r in kept])] == ["EUR", "EUR"]
    assert [r["currency"] for r in fill_unknown_currency([dict(r) for r in kept], {"EUR", "USD", ""})] == ["", "EUR"]
    assert [r["currency"] for r in fill_unknown_currency([{"currency": ""}], {"USD", ""})] == ["USD"]
