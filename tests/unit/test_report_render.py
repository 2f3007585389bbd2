"""Rendering report rows: table for terminals, JSON and CSV for programs."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json

import pytest

from gpuledger.warehouse.reports import REPORTS
from gpuledger.warehouse.report_text import FORMATS, render

ROWS = [
    {"day": dt.date(2024, 3, 1), "tenant": "alpha", "compute_gpu_hours": 0.5, "total_cost_micros": 2_700_000, "ratio": 2 / 3},
    {"day": dt.date(2024, 3, 1), "tenant": "beta-long-name", "compute_gpu_hours": 12.25, "total_cost_micros": 600, "ratio": None},
]


def test_names():
    assert REPORTS == ("bills", "jobs", "queues", "utilization", "capacity", "unmatched", "alerts", "suggestions")
    assert FORMATS == ("table", "json", "csv")


def test_table_is_aligned_with_numbers_right_and_text_left():
    lines = render(ROWS, "table").splitlines()
    assert len(lines) == 4  # header, rule, two rows
    header, rule, first, second = lines
    assert header.split() == ["day", "tenant", "compute_gpu_hours", "total_cost_micros", "ratio"]
    # the rule's runs of dashes are the columns: (start, end) of each
    spans, i = [], 0
    while i < len(rule):
        if rule[i] == "-":
            j = i
            while j < len(rule) and rule[j] == "-":
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    assert len(spans) == 5

    def cell(line, col):
        a, b = spans[col]
        return line.ljust(len(rule))[a:b]

    # text columns left-aligned, number columns (header included) right-aligned
    assert cell(header, 1).startswith("tenant") and cell(first, 1).startswith("alpha ")
    assert cell(header, 3).endswith("total_cost_micros")
    assert cell(first, 3).endswith("2,700,000") and cell(second, 3).endswith(" 600")  # thousands separated
    assert cell(header, 4) == " ratio"
    assert cell(first, 2).endswith(" 0.5") and cell(second, 2).endswith(" 12.25")
    # floats show at most 4 decimals; an absent value is blank; dates ISO
    assert cell(first, 4) == "0.6667" and cell(second, 4).strip() == ""
    assert cell(first, 0) == "2024-03-01"
    assert all(line == line.rstrip() for line in lines)


def test_json_keeps_numbers_as_numbers():
    parsed = json.loads(render(ROWS, "json"))
    assert parsed[0] == {"day": "2024-03-01", "tenant": "alpha", "compute_gpu_hours": 0.5,
                         "total_cost_micros": 2700000, "ratio": 2 / 3}
    assert isinstance(parsed[0]["total_cost_micros"], int)
    assert parsed[1]["ratio"] is None
    assert json.loads(render([{"x": float("nan")}], "json")) == [{"x": None}]  # not the invalid NaN token


def test_csv_has_a_header_and_full_precision():
    reader = list(csv.reader(io.StringIO(render(ROWS, "csv"))))
    assert reader[0] == ["day", "tenant", "compute_gpu_hours", "total_cost_micros", "ratio"]
    assert reader[1] == ["2024-03-01", "alpha", "0.5", "2700000", repr(2 / 3)]
    assert reader[2][-1] == ""  # None
    assert render([{"name": 'a,"b"'}], "csv") == 'name\n"a,""b"""\n'


def test_rows_with_different_keys_share_one_header():
    rows = [{"a": 1}, {"a": 2, "b": "x"}]
    assert list(csv.reader(io.StringIO(render(rows, "csv")))) == [["a", "b"], ["1", ""], ["2", "x"]]
    assert render(rows, "table").splitlines()[0].split() == ["a", "b"]


def test_empty():
    assert render([], "table") == "(no rows)\n"
    assert json.loads(render([], "json")) == []
    assert render([], "csv") == ""


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        render(ROWS, "xml")


EDGE = [
    {"day": dt.date(2026, 1, 2), "at": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc), "x": float("inf"),
     "mixed": 1, "flag": True, "days": (dt.date(2026, 1, 1),), "neg": -0.0, "first_day": None},
    {"day": dt.date(2026, 1, 3), "at": dt.datetime(2026, 1, 3, 0, 0, 0, 250000), "x": -float("inf"),
     "mixed": 2.5, "flag": False, "days": [], "neg": -0.00001, "first_day": dt.date(2026, 1, 1)},
]


def test_every_kind_of_value_in_every_format():
    """The renderers' fast paths per column type and the general one give what the docstring says:
    dates ISO, infinities blank (table, CSV) or null (JSON), bools lower case, -0 as 0, day columns
    labelled UTC (utc_days)."""
    table = render(EDGE, "table", utc_days=True).splitlines()
    assert table[0].split() == ["day_utc", "at", "x", "mixed", "flag", "days", "neg", "first_day_utc"]
    assert table[2].split() == ["2026-01-02", "2026-01-02T03:04:05+00:00", "1", "true",
                                "(datetime.date(2026,", "1,", "1),)", "0"]
    assert table[3].split() == ["2026-01-03", "2026-01-03T00:00:00.250000", "2.5", "false", "[]", "0", "2026-01-01"]
    # a column of ints and floats is numeric: right-aligned under its header
    mixed = table[0].index("mixed") + len("mixed")
    assert table[2][:mixed].endswith(" 1") and table[3][:mixed].endswith("2.5")
    assert json.loads(render(EDGE, "json", utc_days=True)) == [
        {"day_utc": "2026-01-02", "at": "2026-01-02T03:04:05+00:00", "x": None, "mixed": 1, "flag": True,
         "days": ["2026-01-01"], "neg": -0.0, "first_day_utc": None},
        {"day_utc": "2026-01-03", "at": "2026-01-03T00:00:00.250000", "x": None, "mixed": 2.5, "flag": False,
         "days": [], "neg": -0.00001, "first_day_utc": "2026-01-01"}]
    assert list(csv.reader(io.StringIO(render(EDGE, "csv", utc_days=True)))) == [
        ["day_utc", "at", "x", "mixed", "flag", "days", "neg", "first_day_utc"],
        ["2026-01-02", "2026-01-02T03:04:05+00:00", "", "1", "True", "['2026-01-01']", "-0.0", ""],
        ["2026-01-03", "2026-01-03T00:00:00.250000", "", "2.5", "False", "[]", "-1e-05", "2026-01-01"]]
    # without utc_days the names stay
    assert list(json.loads(render(EDGE, "json"))[0]) == list(EDGE[0])


def _cells_at(line: str, starts: list[int]) -> list[int]:
    """The display column of each cell start in a rendered line (wide characters take two)."""
    import unicodedata

    cols, col = [], 0
    for i, ch in enumerate(line):
        if i in starts:
            cols.append(col)
        col += 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
    return cols


def test_wide_and_combining_characters_keep_the_table_aligned():
    """Tenant names in Chinese (the seeds' users) take two terminal columns per character, a combining
    accent none: the columns after them still start where the header's do."""
    rows = [{"tenant": "算法组", "queue": "q1"}, {"tenant": "ascii", "queue": "q2"}, {"tenant": "cafe\u0301", "queue": "q3"}]
    lines = render(rows, "table").splitlines()
    queue_at = [_cells_at(line, [line.rindex("q")])[0] for line in (lines[0], *lines[2:])]
    assert queue_at == [queue_at[0]] * 4, lines
