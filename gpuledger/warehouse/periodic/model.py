"""The report model: a report is a summary and titled sections of rows, some with a plot. Rows keep
the warehouse's column names and raw numbers (tests and programs read them); how a column reads is
gpuledger.periodic.columns, how a report is written gpuledger.warehouse.periodic.render."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

HOUR_MS = 3_600_000


@dataclass
class Plot:
    """A plot of some rows: `kind` line, bar or stacked; `x` the category column; `series` the value
    columns (of one unit: the y axis has one title)."""

    kind: str
    x: str
    series: list[str]


@dataclass
class Section:
    title: str
    rows: list[dict]
    note: str = ""
    plot: Plot | None = None


@dataclass
class Coverage:
    """How much of the period has data: usage from `first_ms` to `last_ms` in a period of `days` days."""

    days: int
    first_ms: int | None = None
    last_ms: int | None = None

    @property
    def hours(self) -> float:
        return (self.last_ms - self.first_ms) / HOUR_MS if self.first_ms is not None and self.last_ms else 0.0

    @property
    def partial(self) -> bool:
        return 0 < self.hours < self.days * 24 * 0.95  # a few missing minutes at the edges are not a gap

    def text(self) -> str:
        """"6.0 h of data in 30 days (2026-11-02 00:00 .. 06:00 UTC)"; "45 min of data in 7 days (...)";
        "no data in 7 days"."""
        span = f"{self.days} day" + ("s" if self.days != 1 else "")
        if not self.hours:
            return f"no data in {span}"
        first = dt.datetime.fromtimestamp(self.first_ms / 1000, dt.timezone.utc)
        last = dt.datetime.fromtimestamp(self.last_ms / 1000, dt.timezone.utc)
        # under an hour in minutes (or seconds): "0.0 h of data" would read as none
        amount = (f"{self.hours * 3600:.0f} s" if self.hours < 1 / 60 else f"{self.hours * 60:.0f} min"
                  if self.hours < 1 else f"{self.hours:.1f} h" if self.hours < 10 else f"{self.hours:.0f} h"
                  if self.hours < 72 else f"{self.hours / 24:.1f} days")
        end = f"{last:%H:%M}" if last.date() == first.date() else f"{last:%Y-%m-%d %H:%M}"
        return f"{amount} of data in {span} ({first:%Y-%m-%d %H:%M} .. {end} UTC)"


@dataclass
class Report:
    name: str
    title: str
    period: str
    summary: dict[str, Any] = field(default_factory=dict)
    sections: list[Section] = field(default_factory=list)
    #: currency of every money figure (cost columns), shown in the header of every rendering
    currency: str = ""
    #: the currencies of the period's money where the builder read them; with several, `currency` is
    #: empty, money rows name theirs and totals are per currency
    currencies: list[str] = field(default_factory=list)
    #: the period's data coverage; None for the job report (its period is the job's own span)
    coverage: Coverage | None = None

    @property
    def units(self) -> str:
        """The header line that says what the figures are in."""
        money = f"Money in {self.currency}. " if self.currency else ""
        if len(self.currencies) > 1:
            money = f"Money in {', '.join(self.currencies)}: each figure in its row's currency, totals per currency. "
        return f"{money}Days are UTC days; GPU time in GPU-hours."

    def section(self, title: str) -> Section:
        for s in self.sections:
            if s.title == title:
                return s
        raise KeyError(title)
