"""Dates (and zones) of the intensity CSV that the ledger cannot mean (gpuledger/warehouse/carbon.py,
docs/carbon.md "Loading intensity"); the figures they gave: tests/integration/test_carbon_load_ties.py.

Fixed (each test failed before):
- a valid_from with its year mistyped (2206 for 2026) was loaded: the value never applied, the one it stood
  for was missing; one before 1970 was loaded too. Both are refused with the line named, as other bad lines;
  a forecast hours or days ahead is kept;
- a series named by a zone that another cluster is mapped to was refused when a cluster of that name is
  mapped elsewhere ("would never be read"), although the other cluster reads it.
Checked, not defects (pinned here): a bare number (epoch seconds or ms) is no ISO time and is refused, so it
is never read as 1970; one instant written in two ways is one time given twice; a time without an offset
is UTC whatever the process's time zone.
"""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest

from gpuledger.warehouse.carbon import CarbonInputError, parse_intensity_csv

HEADER = "zone,valid_from,gco2e_per_kwh\n"
NOW = int(dt.datetime(2026, 12, 6, 12, tzinfo=dt.timezone.utc).timestamp() * 1000)
DAY = 86_400_000


def ms(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).timestamp() * 1000)


@pytest.mark.parametrize("line, shown", [
    ("z,2206-01-01T00:00Z,300", "'2206-01-01T00:00Z' (2206-01-01 UTC)"),
    ("z,2028-01-01,300", "'2028-01-01' (2028-01-01 UTC)"),
    ("z,1926-01-01,300", "'1926-01-01' (1926-01-01 UTC)"),
    ("z,1969-12-31T23:59:59.999Z,300", "'1969-12-31T23:59:59.999Z' (1969-12-31 UTC)"),
    ("z,0001-01-01T00:00+01:00,300", "'0001-01-01T00:00+01:00' (0001-01-01 UTC)"),
])
def test_a_date_the_ledger_cannot_mean_is_refused_with_its_line(line, shown):
    text = HEADER + "z,2026-11-10T00:00Z,200\n" + line + "\n"
    with pytest.raises(CarbonInputError) as exc:
        parse_intensity_csv(text, "grid.csv", now_ms=NOW)
    assert str(exc.value) == ("grid.csv, line 3: valid_from must be within 1970-01-01 and a year after now "
                              f"(2026-12-06), got {shown}: a typo of the year?")


def test_the_clock_is_now_by_default():
    with pytest.raises(CarbonInputError, match="line 2: valid_from must be within 1970-01-01 and a year after now"):
        parse_intensity_csv(HEADER + "z,2206-01-01,300\n", "grid.csv")


def test_the_epoch_a_forecast_and_a_year_ahead_are_kept():
    text = HEADER + "z,1970-01-01,480\nz,2026-12-08T06:00Z,210\nz,2027-12-07T12:00Z,190\n"
    assert [r["valid_from_ms"] for r in parse_intensity_csv(text, "grid.csv", now_ms=NOW)] == [
        0, NOW + DAY + 18 * 3_600_000, NOW + 366 * DAY]


@pytest.mark.parametrize("number", ["1767225600", "1767225600000", "1.7672256e9"])
def test_an_epoch_number_is_no_time(number):
    with pytest.raises(CarbonInputError, match=rf"grid.csv, line 2: valid_from must be an ISO date or time .* got '{number}'"):
        parse_intensity_csv(HEADER + f"z,{number},200\n", "grid.csv", now_ms=NOW)


def test_one_instant_written_two_ways_is_given_twice():
    text = HEADER + "z,2026-01-01T00:00:00Z,200\nz,2026-01-01 01:00:00+01:00,210\n"
    with pytest.raises(CarbonInputError, match=r"line 3: z from 2026-01-01 01:00:00\+01:00 is given twice \(first on line 2\)"):
        parse_intensity_csv(text, "grid.csv", now_ms=NOW)


def test_a_time_without_offset_is_utc_in_any_time_zone(monkeypatch):
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        rows = parse_intensity_csv(HEADER + "z,2026-11-10T06:00,200\nz,2026-11-11,210\n", "grid.csv", now_ms=NOW)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert [r["valid_from_ms"] for r in rows] == [ms("2026-11-10T06:00+00:00"), ms("2026-11-11T00:00+00:00")]
    assert os.environ.get("TZ") is None


def test_a_zone_another_cluster_takes_is_read_though_a_cluster_of_its_name_is_mapped():
    zones = {"gpu-b": "gpu-a", "gpu-a": "DE"}  # gpu-b takes series gpu-a; cluster gpu-a takes DE
    text = "zone,valid_from,gco2e_per_kwh\ngpu-a,2026-11-10,300\nDE,2026-11-10,350\n"
    assert [r["zone"] for r in parse_intensity_csv(text, "grid.csv", zones, now_ms=NOW)] == ["gpu-a", "DE"]
    with pytest.raises(CarbonInputError, match="line 2: cluster gpu-b takes the intensity of zone gpu-a"):
        parse_intensity_csv("zone,valid_from,gco2e_per_kwh\ngpu-b,2026-11-10,300\n", "grid.csv", zones, now_ms=NOW)
