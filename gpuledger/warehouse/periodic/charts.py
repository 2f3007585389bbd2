"""Report plots drawn with matplotlib (Agg, headless) as inline SVG: titled axes with units, round
ticks from matplotlib's locators, percent axes as percent, money with thousands separators."""

from __future__ import annotations

import io
import math
from collections import Counter
from typing import Sequence

from gpuledger.warehouse.periodic.columns import axis_title, column
from gpuledger.warehouse.periodic.model import Plot

_MAX_LABEL = 24  # characters of an x tick label; job ids and GPU names can be long


def _value(row: dict, key: str, missing: float = 0.0) -> float:
    """The number to draw; `missing` where the row has none (a line breaks at NaN, a bar is 0)."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else missing


def svg_plot(rows: Sequence[dict], plot: Plot, currency: str = "", width_in: float = 9.0,
             height_in: float = 3.6) -> str:
    """An inline <svg>: grouped bars, stacked bars or lines of `plot.series` over the `plot.x` categories."""
    if not rows:
        return ""
    import matplotlib

    matplotlib.use("Agg")  # no display; the same on a server, in CI and on a laptop
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter, StrMethodFormatter

    x_col = column(plot.x)
    shown = [x_col.format(r.get(plot.x)) for r in rows]
    # two clusters' q1 (or job 1001) are two bars: a name on several bars says its cluster
    repeated = {n for n, count in Counter(shown).items() if count > 1}
    labels = [(f"{r['cluster']}/{n}" if n in repeated and r.get("cluster") else n)[:_MAX_LABEL]
              for n, r in zip(shown, rows)]
    missing = math.nan if plot.kind == "line" else 0.0  # a line with no value there has a gap, not a drop to 0
    values = [[_value(r, s, missing) for r in rows] for s in plot.series]
    unit = column(plot.series[0]).unit
    if unit == "pct":  # percent values (0..100) drawn on the same axis as ratios
        values = [[v / 100 for v in vs] for vs in values]
    positions = range(len(rows))
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "gpuledger", "font.family": "sans-serif",
                         "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
                         # names are text: "$...$" in a job id would be read as mathtext (and may not parse)
                         "text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(width_in, height_in), layout="constrained")
        names = [column(s).header() for s in plot.series]
        if plot.kind == "line":
            for name, vs in zip(names, values):
                ax.plot(list(positions), vs, marker="o", label=name)
        elif plot.kind == "stacked":
            bottom = [0.0] * len(rows)
            for name, vs in zip(names, values):
                ax.bar(list(positions), vs, 0.7, bottom=bottom, label=name)
                bottom = [b + v for b, v in zip(bottom, vs)]
        else:
            width = 0.8 / len(values)
            for j, (name, vs) in enumerate(zip(names, values)):
                ax.bar([p - 0.4 + width * (j + 0.5) for p in positions], vs, width, label=name)
        step = max(1, len(rows) // 20)  # at most ~20 category labels
        ax.set_xticks(list(positions)[::step], labels[::step], rotation=30 if len(rows) > 4 else 0, ha="right"
                      if len(rows) > 4 else "center")
        ax.set_xlabel(x_col.header(currency))
        ax.set_ylabel(axis_title(plot.series, currency))
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        if unit in ("ratio", "pct"):
            ax.set_ylim(0, max(1.0, max((v for vs in values for v in vs if not math.isnan(v)), default=0.0) * 1.05))
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1, decimals=0))
        else:
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,g}"))  # 12.5, 1,000, 0.25: no trailing zeros
        ax.grid(axis="y", color="#ddd")
        ax.set_axisbelow(True)
        if len(plot.series) > 1:
            ax.legend(loc="upper left", bbox_to_anchor=(0, 1.18), ncols=len(plot.series), frameon=False)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # inline: without the XML prolog and DOCTYPE
