"""How the periodic reports read, on reports made by hand (no warehouse): human headers with units,
percent written one way in the summary and the tables, one unit per column, Markdown-escaped names,
the period's data coverage, plots with titled axes and round ticks. The reports built from a real
chDB: tests/integration/test_periodic_reports.py."""

from __future__ import annotations

import re

import pytest

from gpuledger.warehouse.periodic.charts import svg_plot
from gpuledger.warehouse.periodic.columns import column
from gpuledger.warehouse.periodic.model import Coverage, Plot, Report, Section
from gpuledger.warehouse.periodic.render import render_report

H = 3_600_000
NOV_2 = 1_793_577_600_000  # 2026-11-02 00:00 UTC


def report() -> Report:
    tenants = [
        {"tenant": "team|a_b*", "compute_cost": 54.3, "idle_cost": 13.57, "failed_retry_cost": 0.0, "total_cost": 67.87,
         "effective_gpu_hours": 12.339622222222221, "idle_share": 0.8068},
        {"tenant": "beta", "compute_cost": 27.2, "idle_cost": 1.0, "failed_retry_cost": 2.5, "total_cost": 30.7,
         "effective_gpu_hours": 1234.5, "idle_share": None},
    ]
    trend = [{"day": "2026-11-02", "scheduling_utilization": 0.8068, "execution_utilization": 0.5,
              "hardware_utilization": 0.25}]
    return Report("monthly", "Monthly report 2026-11", "2026-11-01 .. 2026-11-30",
                  summary={"total_cost": 98.57, "scheduling_utilization": 0.8068},
                  sections=[Section("Three utilization layers per day", trend, "", Plot("line", "day", [
                      "scheduling_utilization", "execution_utilization", "hardware_utilization"])),
                            Section("Tenant cost composition", tenants, "",
                                    Plot("stacked", "tenant", ["compute_cost", "idle_cost", "failed_retry_cost"]))],
                  currency="EUR", coverage=Coverage(30, NOV_2, NOV_2 + 6 * H))


def test_headers_say_what_and_in_which_unit():
    assert column("compute_cost").header("EUR") == "Compute cost (EUR)"
    assert column("idle_gpu_hours_previous").header() == "Idle GPU-hours, previous week"
    assert column("idle_gpu_seconds").header() == "Idle GPU-seconds"
    assert column("first_day").header() == "First day (UTC)"
    assert column("job_id").header() == "Job ID"
    for fmt in ("table", "markdown", "html"):
        out = render_report(report(), fmt)
        assert "Compute cost (EUR)" in out and "Effective GPU-hours" in out and "Idle share" in out, fmt
        assert "compute_cost" not in out and "idle_share" not in out, fmt  # no raw column names


@pytest.mark.parametrize("fmt", ["table", "markdown", "html"])
def test_percent_and_money_read_the_same_everywhere(fmt):
    out = render_report(report(), fmt)
    assert out.count("80.7%") == 3, out  # summary, trend table, tenant table
    assert "0.8068" not in out
    assert "12.34" in out and "12.3396" not in out  # rounded for reading
    assert "1,234.50" not in out and "1,234" in out  # large hours without decimals
    assert "67.87" in out and "98.57" in out  # money with two decimals


def test_markdown_escapes_names():
    out = render_report(report(), "markdown")
    assert r"| team\|a\_b\* |" in out
    html = render_report(report(), "html")
    assert "team|a_b*" in html  # HTML escapes with entities (autoescape), not backslashes


def test_the_period_says_how_much_of_it_has_data():
    cov = Coverage(30, NOV_2, NOV_2 + 6 * H)
    assert cov.partial and cov.text() == "6.0 h of data in 30 days (2026-11-02 00:00 .. 06:00 UTC)"
    assert not Coverage(7, NOV_2, NOV_2 + 7 * 24 * H).partial
    assert Coverage(7).text() == "no data in 7 days" and not Coverage(7).partial
    for fmt in ("table", "markdown", "html"):
        out = render_report(report(), fmt)
        assert "6.0 h of data in 30 days" in out and "partial period" in out, fmt


def _y_ticks(svg: str) -> list[str]:
    return re.findall(r'<g id="ytick_\d+">.*?<text[^>]*>([^<]*)</text>', svg, re.S)


def test_plots_have_titled_axes_and_round_ticks():
    r = report()
    cost = svg_plot(r.sections[1].rows, r.sections[1].plot, "EUR")
    assert "Cost (EUR)" in cost and ">Tenant<" in cost
    ticks = _y_ticks(cost)
    assert ticks[0] == "0" and len(ticks) >= 3
    steps = {float(b.replace(",", "")) - float(a.replace(",", "")) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 and steps.pop() in (1, 2, 2.5, 5, 10, 20, 25, 50, 100), ticks  # 0, 20, 40 ... not 54.3
    layers = svg_plot(r.sections[0].rows, r.sections[0].plot, "EUR")
    assert "Utilization (%)" in layers and ">Day (UTC)<" in layers
    assert _y_ticks(layers)[-1] == "100%" and "Scheduling utilization" in layers


def test_html_is_one_self_contained_page():
    out = render_report(report(), "html")
    assert out.startswith("<!DOCTYPE html>") and out.count("<svg") == 2
    assert "<script" not in out and not re.search(r"(src|href)=['\"]?https?:", out)
