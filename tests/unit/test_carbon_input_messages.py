"""The carbon intensity input's time errors name what was wrong where it was given: the CSV's
valid_from column on its line, or the caller's own option (gpuledger/warehouse/carbon.py)."""

from __future__ import annotations

import pytest

from gpuledger.warehouse.carbon import CarbonInputError, parse_intensity_csv, parse_time_ms


def test_a_bad_time_names_the_place_it_was_given():
    # before: "--since: valid_from must be ...", naming the CSV's column whatever the caller was
    with pytest.raises(CarbonInputError) as exc:
        parse_time_ms("yesterday", "--since")
    assert str(exc.value) == "--since must be an ISO date or time (e.g. 2026-11-10T06:00Z), got 'yesterday'"
    assert parse_time_ms(" 2026-11-10T06:00Z ", "--since") == 1_794_290_400_000


def test_a_bad_csv_time_still_names_its_line_and_column():
    with pytest.raises(CarbonInputError) as exc:
        parse_intensity_csv("zone,valid_from,gco2e_per_kwh\nUS-NY,2026-11-10,300\nUS-NY,soon,310\n", "grid.csv")
    assert str(exc.value) == ("grid.csv, line 3: valid_from must be an ISO date or time (e.g. 2026-11-10T06:00Z), "
                              "got 'soon'")
