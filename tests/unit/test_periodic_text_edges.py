"""Edges of the periodic reports without a warehouse: names in wide characters stay aligned in the
text table, a sum that nets to zero never reads "-0.00", a Markdown name shows what is stored (an `&`
is not read as an entity), a few minutes of data are not "0.0 h", two clusters' bars of one name say
their cluster, and the weekly anomalies list the worst stragglers first. Periods and options:
tests/unit/test_periodic_options.py."""

from __future__ import annotations

import re

import pytest

from gpuledger.warehouse.periodic.columns import column
from gpuledger.warehouse.periodic.model import Report, Section
from gpuledger.warehouse.periodic.render import render_report
from gpuledger.warehouse.report_text import display_width


def one_table(rows: list[dict], summary: dict | None = None) -> Report:
    return Report("monthly", "Monthly report 2026-11", "2026-11-01 .. 2026-11-30", summary=summary or {},
                  sections=[Section("Tenant cost composition", rows)], currency="USD")


def test_wide_names_keep_the_text_table_aligned():
    rows = [{"tenant": "算法组", "total_cost": 12.5}, {"tenant": "vision", "total_cost": 3.0}]
    lines = render_report(one_table(rows), "table").splitlines()
    table = lines[lines.index("== Tenant cost composition") + 1:]
    assert len({display_width(line) for line in table}) == 1, table  # numbers right-aligned to one edge


@pytest.mark.parametrize("name,value,text", [
    ("idle_cost", -(0.1 + 0.2) + 0.3, "0.00"),  # closed 0.30 less adjustments of 0.10 and 0.20
    ("idle_share", -1e-9, "0.0%"),
    ("idle_gpu_hours", -1e-12, "0.00"),
    ("util_pct", -0.01, "0.0%"),
    ("idle_cost", -0.005001, "-0.01"),  # a real credit keeps its sign
])
def test_nothing_reads_minus_zero(name, value, text):
    assert column(name).format(value) == text
    assert re.search(rf"\|\s*{re.escape(text)}\s*\|", render_report(one_table([{"tenant": "t", name: value}]), "markdown"))


def test_markdown_names_show_what_is_stored():
    rows = [{"tenant": "R&amp;D &lt;b&gt;", "total_cost": 1.0}]
    out = render_report(one_table(rows, {"tenant": "R&amp;D"}), "markdown")
    # escaped, a Markdown reader shows "R&amp;D <b>" as written, not "R&D <b>"
    assert r"| R\&amp;D \&lt;b\&gt; |" in out and r"**Tenant**: R\&amp;D" in out


@pytest.mark.parametrize("span_ms,amount", [(90_000, "2 min"), (20_000, "20 s"), (45 * 60_000, "45 min"),
                                            (63 * 60_000, "1.1 h")])
def test_a_short_span_of_data_is_not_written_as_zero_hours(span_ms, amount):
    """Before: "0.0 h of data in 7 days" for a few minutes of data, which reads as none."""
    from gpuledger.warehouse.periodic.model import Coverage

    nov_2 = 1_793_577_600_000
    cov = Coverage(7, nov_2, nov_2 + span_ms)
    assert cov.text().startswith(f"{amount} of data in 7 days (2026-11-02 00:00 .. ") and cov.partial


def test_plot_bars_of_two_clusters_same_name_say_their_cluster():
    """Two clusters' `q1` (or job 1001) are two bars: labelled c1/q1 and c2/q1, not q1 twice. A name
    that is one bar keeps its label."""
    from gpuledger.warehouse.periodic.charts import svg_plot
    from gpuledger.warehouse.periodic.model import Plot

    rows = [{"cluster": "c1", "queue": "q1", "held_gpu_hours": 2.0}, {"cluster": "c2", "queue": "q1", "held_gpu_hours": 1.0},
            {"cluster": "c2", "queue": "q2", "held_gpu_hours": 1.0}]
    svg = svg_plot(rows, Plot("bar", "queue", ["held_gpu_hours"]))
    assert ">c1/q1<" in svg and ">c2/q1<" in svg and ">q2<" in svg
    one = svg_plot(rows[:1] + rows[2:], Plot("bar", "queue", ["held_gpu_hours"]))
    assert ">q1<" in one and "c1/" not in one


def test_a_line_has_a_gap_where_a_row_has_no_value():
    """A missing value on a line plot (the forecast's history under its forecast weeks) is a gap, not
    a point at 0: the plot of [1, none, 3] was the plot of [1, 0, 3]."""
    from gpuledger.warehouse.periodic.charts import svg_plot
    from gpuledger.warehouse.periodic.model import Plot

    def plot(middle):
        rows = [{"day": f"2026-09-0{i + 1}", "demand_gpu_hours": v} for i, v in enumerate([1.0, middle, 3.0])]
        return svg_plot(rows, Plot("line", "day", ["demand_gpu_hours"]))

    assert plot(None) != plot(0.0)
    assert "<svg" in plot(None)


def test_weekly_lists_the_worst_stragglers_first(monkeypatch):
    """The weekly anomalies keep "the N largest of each kind": for stragglers the GPUs furthest below
    their attempt's median, not the first job ids in alphabetical order (a fake warehouse: pure logic)."""
    from gpuledger.warehouse.periodic import builders

    found = [{"cluster": "c", "job_id": f"a-{i}", "attempt": 0, "gpu": f"n/{i}", "util_pct": 70.0, "median_pct": 80.0}
             for i in range(3)] + [{"cluster": "c", "job_id": "z-1", "attempt": 0, "gpu": "n/9", "util_pct": 5.0,
                                    "median_pct": 90.0}]
    monkeypatch.setattr(builders, "query", lambda *a, **k: [])  # no GPU down
    monkeypatch.setattr(builders, "stragglers", lambda *a, **k: list(found))
    rows = builders.anomalies(None, "db", None, None, 0.3, [])
    assert [r["subject"] for r in rows] == ["z-1", "a-0", "a-1", "a-2"]
    kept = builders.capped(rows, 1, label="subject", sums=("gpu_hours", "cost"), kind="kind")
    assert [r["subject"] for r in kept] == ["z-1", "3 more"]
