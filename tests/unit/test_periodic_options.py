"""The periodic reports' command-line options and plots without a warehouse: a bad --as-of names the
flag, an option the report does not take is refused (not silently dropped), monthly and weekly share
the cluster idle as the ledger's [idle] policy says unless --idle-redistribution does, and names with
matplotlib mathtext pairs ("$...$") are drawn as text, not parsed; a bad count names its flag, and a
period outside the days a ClickHouse Date holds (1970-01-01 .. 2149-06-06), or a --month that an
--as-of contradicts, is refused before any query."""

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


@pytest.mark.parametrize("name,opts,message", [
    # before: OverflowError tracebacks (date arithmetic past year 1 or 9999)
    ("inventory", {"days": 10**6, "as_of": "2026-11-02"}, "the 1,000,000-day period ending 2026-11-02 would start "
                                                           "before 1970-01-01"),
    ("weekly", {"as_of": "0001-01-03"}, "as_of (--as-of) must be a UTC day from 1970-01-01 to 2149-06-06, got '0001-01-03'"),
    ("monthly", {"month": "9999-12"}, "month (--month) must be from 1970-01 to 2149-05, got '9999-12'"),
    # before: read silently from other days (a ClickHouse Date clamps to 1970-01-01 .. 2149-06-06)
    ("inventory", {"days": 30000, "as_of": "2026-11-02"}, "at most 20,760 days end on 2026-11-02"),
    ("weekly", {"as_of": "2200-01-01"}, "as_of (--as-of) must be a UTC day from 1970-01-01 to 2149-06-06"),
    ("weekly", {"as_of": "1970-01-03"}, "the 7-day period ending 1970-01-03 would start before 1970-01-01"),
    ("monthly", {"month": "1969-12"}, "month (--month) must be from 1970-01 to 2149-05"),
    ("monthly", {"month": "2026-1"}, "month (--month) must be YYYY-MM, got '2026-1'"),  # the flag named, as --as-of
])
def test_a_period_outside_the_warehouses_days_is_refused(name, opts, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pr.build_report(None, "db", name, **opts)  # refused before any query


def test_monthly_refuses_an_as_of_outside_its_month():
    """--month and --as-of both name the month: one that contradicts the other is an error, not ignored."""
    with pytest.raises(ValueError, match=re.escape("--as-of 2026-11-15 is not in --month 2026-10")):
        pr.build_report(None, "db", "monthly", month="2026-10", as_of="2026-11-15")


@pytest.mark.parametrize("name,opts,flag", [("inventory", {"days": 0}, "days (--days)"),
                                            ("weekly", {"top": 0}, "top (--top)"), ("monthly", {"top": -1}, "top (--top)")])
def test_a_bad_count_names_its_flag(name, opts, flag):
    """As --cards, --anomalies and --stretches do: "top must be ..." did not say which option."""
    with pytest.raises(ValueError, match=re.escape(f"{flag} must be a positive integer")):
        pr.build_report(None, "db", name, **opts, as_of="2026-11-02")
