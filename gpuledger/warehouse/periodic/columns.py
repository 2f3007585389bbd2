"""What a report column is for a reader: its header and how its values are written.

Every column has one unit, read from its name (the same names as the warehouse views):
`*cost*` and `*savings` are money in the ledger's currency, `*gpu_hours*` GPU-hours, `*_utilization`,
`*_share` and `used_to_requested` ratios written as percent, `*_pct` values already in percent,
`*_seconds` seconds. The summary and the tables use the same rules, so 0.8068 is "80.7%" everywhere.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Any

#: words written differently in a header than in a column name
_WORDS = {"gpu": "GPU", "gpus": "GPUs", "id": "ID", "uuid": "UUID", "util": "utilization", "ms": "(ms)"}
#: whole names whose header is not their words
_HEADERS = {
    "gpu_hours": "GPU-hours",
    "gpu": "GPU",
    "util_bucket": "Utilization bucket",
    "util_pct": "Utilization",
    "median_pct": "Median utilization",
    "threshold_pct": "Threshold",
    "used_to_requested": "Used / requested",
    "low_util_share": "Executing time under 30 % utilization",
    "balance_score": "Balance score (0-1)",
    "cards_under_threshold": "Cards under the threshold",
    "gap_gpu_hours": "Requested minus used GPU-hours",
    # GPU ID cards (gpuledger/warehouse/cards.py)
    "vbios_version": "VBIOS version",
    "avg_temperature_c": "Mean temperature (°C)",
    "max_temperature_c": "Max temperature (°C)",
    "avg_power_w": "Mean power (W)",
    "busy_hours_per_kwh": "Busy hours per kWh",
    "busy_hours_per_kwh_trend_pct_per_month": "Busy hours per kWh: trend (% per month)",
    "failures_per_gpu_year": "Down episodes per GPU-year",
    "observed_gpu_years": "GPU-years observed",
}


@dataclass(frozen=True)
class Column:
    """`unit`: money, gpu_hours, ratio (0..1, written as %), pct (0..100, written as %), seconds,
    score, number (a measured quantity: minutes, °C, W, fractional GPUs), day, time, count or text."""

    name: str
    unit: str

    def header(self, currency: str = "") -> str:
        if self.name in _HEADERS:
            text = _HEADERS[self.name]
        else:
            words = self.name.split("_")
            previous = words[-1] == "previous"
            words = words[:-1] if previous else words
            if self.unit == "gpu_hours":
                words = [w for w in words if w not in ("gpu", "hours")] + ["GPU-hours"]
            elif self.unit == "seconds":
                words = ([w for w in words if w not in ("gpu", "seconds")] + ["GPU-seconds"] if "gpu" in words
                         else [w for w in words if w != "seconds"] + ["(s)"])
            elif self.unit in ("day", "time"):
                words = words + ["(UTC)"]
            text = " ".join(_WORDS.get(w, w) for w in words)
            text = text[:1].upper() + text[1:]
            if previous:
                text += ", previous week"
        if self.unit == "money" and currency:
            text += f" ({currency})"
        return text

    @property
    def numeric(self) -> bool:
        return self.unit not in ("text", "day", "time")

    def format(self, value: Any) -> str:
        """The value as a reader sees it: rounded for reading, percent with one decimal, money with two."""
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return ""
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, dt.datetime):
            return value.strftime("%Y-%m-%d %H:%M:%S")
        if isinstance(value, dt.date):
            return value.isoformat()
        if not isinstance(value, (int, float)):
            return str(value)
        text = self._number(value)
        # a sum that nets to zero (0.30 closed less 0.10 and 0.20 of adjustments: -5.6e-17) is 0.00, not -0.00
        return text[1:] if text.startswith("-") and not any(d in text for d in "123456789") else text

    def _number(self, value: int | float) -> str:
        if self.unit == "ratio":
            return f"{value * 100:.1f}%"
        if self.unit == "pct":
            return f"{value:.1f}%"
        if self.unit == "money":
            return f"{value:,.2f}"
        if self.unit == "score":
            return f"{value:.2f}"
        if self.unit == "number":
            return f"{value:,.1f}"
        if isinstance(value, int):
            return f"{value:,}"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.2f}"


def column(name: str) -> Column:
    words = set(name.split("_"))
    if "cost" in words or name.endswith("savings"):
        unit = "money"
    elif "gpu_hours" in name:
        unit = "gpu_hours"
    elif name.endswith(("_utilization", "_share")) or name == "used_to_requested":
        unit = "ratio"
    elif name.endswith("_pct"):
        unit = "pct"
    elif name.endswith("_seconds"):
        unit = "seconds"
    elif name == "balance_score":
        unit = "score"
    elif name == "day" or name.endswith("_day"):
        unit = "day"
    elif name.endswith(("_start", "_at")):
        unit = "time"
    elif re.fullmatch(r"attempts?|failed_attempts|cards|nodes|gpus|slices|low_util_cards|offset_ms|repairs|xid_errors|"
                      r"waiting_priority|reports|hours_at_once", name):
        unit = "count"
    elif name.endswith("_rate"):
        unit = "ratio"
    elif name.endswith(("_minutes", "_c", "_w")) or name in ("gpus_freed", "waiting_gpus"):
        unit = "number"
    else:
        unit = "text"
    return Column(name, unit)


def axis_title(series: list[str], currency: str) -> str:
    """The y-axis title of a plot of these columns (they share one unit)."""
    unit = column(series[0]).unit
    if unit == "money":
        return f"Cost ({currency})" if currency else "Cost"
    if unit == "gpu_hours":
        return "GPU-hours"
    if unit in ("ratio", "pct"):
        return "Utilization (%)" if "util" in series[0] else "Share (%)"
    return column(series[0]).header(currency) if len(series) == 1 else ""
