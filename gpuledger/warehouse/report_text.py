"""Report rows as people and programs read them: an aligned table, JSON Lines-free JSON or CSV.

Pure: rows in, text out (`render`); the queries that make the rows are in reports.py."""

from __future__ import annotations
import csv
import datetime as dt
import io
import math
from typing import Any, Sequence
import orjson

FORMATS = ("table", "json", "csv")


def _plain(value: Any) -> Any:
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _columns(rows: Sequence[dict]) -> list[str]:
    cols = list(rows[0]) if rows else []
    for row in rows[1:]:
        cols.extend(k for k in row if k not in cols)
    return cols


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        text = f"{value:,.4f}".rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    return str(value)


def _render_table(rows: Sequence[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = _columns(rows)
    cells = [[_cell(row.get(c)) for c in cols] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float)) and not isinstance(row.get(c), bool) for row in rows if row.get(c) is not None)
        for c in cols
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(cols), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out) + "\n"


def _render_csv(rows: Sequence[dict]) -> str:
    if not rows:
        return ""
    cols = _columns(rows)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for row in rows:
        writer.writerow("" if row.get(c) is None else _plain(row.get(c)) for c in cols)
    return buf.getvalue()


def utc_labels(rows: Sequence[dict]) -> list[dict]:
    """Rows with every day column labelled as a UTC day: `day` -> `day_utc`, `first_day` ->
    `first_day_utc`, `corrects_day` -> `corrects_day_utc` (the same names in table, CSV and JSON)."""
    def name(key: str) -> str:
        return f"{key}_utc" if key == "day" or key.endswith("_day") else key

    return [{name(k): v for k, v in row.items()} for row in rows]


def _priced_by_default_note(rows: Sequence[dict]) -> str:
    """The footnote of a table whose rows hold GPU time priced under the [unpriced] policy (a GPU
    model without its own price or coefficient; docs/accounting.md). JSON and CSV carry the column."""
    hours = sum(r.get("priced_by_default_gpu_hours") or 0 for r in rows)
    if not hours:
        return ""
    return (f"\nNote: {hours:,.4f} GPU-hours in these rows were priced by default (GPU models without a price or "
            "coefficient of their own, billed under the ledger's [unpriced] policy); see column "
            "priced_by_default_gpu_hours.\n")


def render(rows: Sequence[dict], fmt: str = "table", *, utc_days: bool = False) -> str:
    """rows as `table` (aligned text, numbers right-aligned), `json` (an array of objects; numbers
    stay numbers, dates ISO strings, absent values null) or `csv` (header + rows, full precision).
    `utc_days` labels day columns as UTC days (`utc_labels`), as the CLI prints them."""
    if utc_days:
        rows = utc_labels(rows)
    if fmt == "table":
        return _render_table(rows) + _priced_by_default_note(rows)
    if fmt == "json":
        return orjson.dumps([{k: _plain(v) for k, v in row.items()} for row in rows], option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "csv":
        return _render_csv(rows)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
