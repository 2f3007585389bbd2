"""Writing a report: aligned text for a terminal, Markdown, or one self-contained HTML page (Jinja2
templates in templates/, matplotlib plots inline as SVG, inline CSS, no script, nothing fetched)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from gpuledger.warehouse.periodic.charts import svg_plot
from gpuledger.warehouse.periodic.columns import column
from gpuledger.warehouse.periodic.model import Report
from gpuledger.warehouse.report_text import display_width, pad_left, pad_right

if TYPE_CHECKING:
    import jinja2

FORMATS = ("table", "markdown", "html")


@dataclass
class Table:
    """A section's rows as a reader sees them: headers, cells as text, which columns are numbers."""

    headers: list[str]
    numeric: list[bool]
    rows: list[list[str]]


def table(rows: list[dict], currency: str) -> Table:
    names: list[str] = []
    for row in rows:
        names.extend(k for k in row if k not in names)
    cols = [column(n) for n in names]
    return Table([c.header(currency) for c in cols], [c.numeric for c in cols],
                 [[c.format(r.get(c.name)) for c in cols] for r in rows])


def summary(report: Report) -> list[tuple[str, str]]:
    """(header, value) of the summary figures, written like the same columns in the tables."""
    return [(column(k).header(report.currency), column(k).format(v) or "n/a") for k, v in report.summary.items()]


def markdown_escape(text: str) -> str:
    """Names (tenants, jobs, queues) as literal text: Markdown's markup characters escaped."""
    # `&` too: "R&amp;D" would read as "R&D" (an entity), not as the name stored
    return re.sub(r"([\\`*_\[\]<>|#~&])", r"\\\1", str(text)).replace("\n", " ")


@cache
def _templates() -> jinja2.Environment:
    import jinja2  # here, not at the top: every `gpuledger report` loads this module's FORMATS

    env = jinja2.Environment(loader=jinja2.PackageLoader("gpuledger.warehouse.periodic", "templates"),
                             autoescape=jinja2.select_autoescape(["html.j2"]), trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["md"] = markdown_escape
    return env


def _sections(report: Report, plots: bool) -> list[dict]:
    from markupsafe import Markup

    out = []
    for s in report.sections:
        svg = svg_plot(s.rows, s.plot, report.currency) if plots and s.plot and s.rows else ""
        out.append({"title": s.title, "note": s.note, "table": table(s.rows, report.currency), "svg": Markup(svg)})
    return out


def _context(report: Report, plots: bool = False) -> dict:
    return {"report": report, "summary": summary(report), "sections": _sections(report, plots),
            "coverage": report.coverage.text() if report.coverage else "",
            "partial": bool(report.coverage and report.coverage.partial)}


def _text_table(t: Table) -> str:
    if not t.rows:
        return "(no rows)"
    # in terminal columns: a tenant named in Chinese takes two per character
    widths = [max(display_width(h), *(display_width(r[i]) for r in t.rows)) for i, h in enumerate(t.headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(pad_left(c, w) if n else pad_right(c, w) for c, w, n in zip(cells, widths, t.numeric)).rstrip()

    return "\n".join([line(t.headers), "  ".join("-" * w for w in widths), *(line(r) for r in t.rows)])


def _render_text(report: Report) -> str:
    ctx = _context(report)
    out = [f"{report.title} — {report.period}", report.units]
    if ctx["coverage"]:
        out.append(f"Data: {ctx['coverage']}" + (" (partial period)" if ctx["partial"] else ""))
    out.append("")
    out += [f"  {k}: {v}" for k, v in ctx["summary"]]
    for s in ctx["sections"]:
        out += ["", f"== {s['title']}" + (f"  ({s['note']})" if s["note"] else ""), _text_table(s["table"])]
    return "\n".join(out) + "\n"


def render_report(report: Report, fmt: str = "table") -> str:
    """`table` (aligned text), `markdown` (GitHub tables) or `html` (one self-contained page with plots)."""
    if fmt == "table":
        return _render_text(report)
    if fmt == "markdown":
        return _templates().get_template("report.md.j2").render(_context(report))
    if fmt == "html":
        return _templates().get_template("report.html.j2").render(_context(report, plots=True))
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
