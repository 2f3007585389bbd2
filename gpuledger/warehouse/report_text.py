"""Report rows as people and programs read them: an aligned table, JSON Lines-free JSON or CSV.

Pure: rows in, text out (`render`); the queries that make the rows are in reports.py."""

from __future__ import annotations
import csv
import datetime as dt
import io
import math
import unicodedata
from typing import Any, Sequence
import orjson

FORMATS = ("table", "json", "csv")


#: values JSON and CSV take as they are (exact types: a subclass goes the long way)
_AS_IS = frozenset({str, int, bool, type(None)})


def _plain(value: Any) -> Any:
    if type(value) in _AS_IS:
        return value
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _columns(rows: Sequence[dict]) -> list[str]:
    cols = list(rows[0]) if rows else []
    seen = set(cols)
    for row in rows[1:]:
        if not seen.issuperset(row):
            added = [k for k in row if k not in seen]
            cols.extend(added)
            seen.update(added)
    return cols


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return _float_text(value) if math.isfinite(value) else ""
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float_text(value: float) -> str:
    text = f"{value:,.4f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


_NONE = type(None)


def _column_cells(column: list) -> tuple[list[str], bool]:
    """A column's cells as text (`_cell`) and whether it is numeric (right-aligned). A column of one
    type (and absent values) is written without a call per cell: a 45,000-job report has 1.2 M cells."""
    kinds = set(map(type, column)) - {_NONE}
    if kinds == {float}:
        return ["" if v is None or not math.isfinite(v) else _float_text(v) for v in column], True
    if kinds == {int}:
        return ["" if v is None else f"{v:,}" for v in column], True
    if kinds == {str}:
        return ["" if v is None else v for v in column], False
    numeric = all(_is_number(v) for v in column if v is not None)
    return [_cell(v) for v in column], numeric


def display_width(text: str) -> int:
    """The terminal columns `text` takes: two for an East Asian wide or fullwidth character (a tenant
    named in Chinese), none for a combining mark, one for the rest."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def pad_right(text: str, width: int) -> str:
    """`text` left-aligned in `width` terminal columns (str.ljust counts characters, not columns)."""
    return text + " " * (width - display_width(text))


def pad_left(text: str, width: int) -> str:
    return " " * (width - display_width(text)) + text


def _render_table(rows: Sequence[dict], cols: list[str], names: dict[str, str]) -> str:
    if not rows:
        return "(no rows)\n"
    cells, numeric = zip(*(_column_cells([row.get(c) for row in rows]) for c in cols))
    cols = [names.get(c, c) for c in cols]
    # a column of ASCII text (nearly all of them) is measured and padded by str's own methods
    ascii_only = [all(map(str.isascii, column)) and c.isascii() for c, column in zip(cols, cells)]
    widths = [max(len(c), *map(len, column)) if plain else max(map(display_width, (c, *column)))
              for c, column, plain in zip(cols, cells, ascii_only)]
    justify = [(str.rjust if num else str.ljust) if plain else (pad_left if num else pad_right)
               for num, plain in zip(numeric, ascii_only)]

    def line(values: Sequence[str]) -> str:
        return "  ".join([pad(v, w) for v, w, pad in zip(values, widths, justify)]).rstrip()

    out = [line(cols), "  ".join("-" * w for w in widths)]
    out.extend(map(line, zip(*cells)))
    return "\n".join(out) + "\n"


def _render_csv(rows: Sequence[dict], cols: list[str], names: dict[str, str]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([names.get(c, c) for c in cols])
    writer.writerows(["" if (v := row.get(c)) is None else _plain(v) for c in cols] for row in rows)
    return buf.getvalue()


def _utc_names(cols: Sequence[str]) -> dict[str, str]:
    """{column: label} of the day columns: `day` -> `day_utc`, `first_day` -> `first_day_utc`, ..."""
    return {key: f"{key}_utc" for key in cols if key == "day" or key.endswith("_day")}


def utc_labels(rows: Sequence[dict]) -> list[dict]:
    """Rows with every day column labelled as a UTC day: `day` -> `day_utc`, `first_day` ->
    `first_day_utc`, `corrects_day` -> `corrects_day_utc` (the same names in table, CSV and JSON)."""
    names = _utc_names(_columns(rows))
    return [{names.get(k, k): v for k, v in row.items()} for row in rows] if names else list(rows)


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
    cols = _columns(rows)
    names = _utc_names(cols) if utc_days else {}
    if fmt == "table":
        return _render_table(rows, cols, names) + _priced_by_default_note(rows)
    if fmt == "json":
        # orjson writes dates as ISO strings and NaN and infinities as null itself
        labelled = [{names.get(k, k): v for k, v in row.items()} for row in rows] if names else rows
        return orjson.dumps(labelled, option=orjson.OPT_INDENT_2).decode() + "\n"
    if fmt == "csv":
        return _render_csv(rows, cols, names)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
