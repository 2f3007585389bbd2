"""`gpuledger forecast run --band/--horizon`: a band outside (0, 1) or a horizon under one whole day is
refused with a message saying so, by the library entry points (fit_forecast, forecast_rows,
run_forecast before it reads anything) and so by the CLI, instead of a stored run labelled "8000%" or
"every demand series is shorter than a forecast needs"."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger import warehouse
from gpuledger.cli import main
from gpuledger.warehouse import forecast

WEEKS = [(100.0 if i % 7 < 5 else 40.0) for i in range(28)]


@pytest.mark.parametrize("horizon", [0, -5, 2.5, "7"])
def test_a_horizon_under_one_whole_day_is_refused(horizon):
    with pytest.raises(ValueError, match=r"horizon \(--horizon\) is a whole number of days, at least 1"):
        forecast.fit_forecast(WEEKS, horizon=horizon)


@pytest.mark.parametrize("band", [80.0, 1.0, 0.0, -0.2, float("nan")])
def test_a_band_outside_0_1_is_refused(band):
    with pytest.raises(ValueError, match=r"band \(--band\) is its coverage, between 0 and 1"):
        forecast.fit_forecast(WEEKS, alpha=1 - band)


def test_good_options_still_fit():
    f = forecast.fit_forecast(WEEKS, horizon=1, alpha=1 - 0.95)
    assert len(f.mean) == 1 and f.method.endswith("95%")


def test_forecast_rows_and_run_forecast_refuse_before_anything():
    series = {("A100", "q"): {dt.date(2026, 1, 1) + dt.timedelta(days=i): v for i, v in enumerate(WEEKS)}}
    with pytest.raises(ValueError, match="horizon"):  # not skipped as "too short"
        forecast.forecast_rows(series, {}, horizon=0)
    with pytest.raises(ValueError, match="got 80"):  # checked before the warehouse is read: no client needed
        forecast.run_forecast(None, "db", alpha=1 - 80)


@pytest.mark.parametrize("holdout", [0, -3, 1.5])
def test_a_backtest_holdout_under_one_whole_day_is_refused_as_such(holdout):
    # not as a bad --horizon (the holdout is the forecast's horizon inside), nor an IndexError
    with pytest.raises(ValueError, match=r"holdout \(--holdout\) is a whole number of days, at least 1"):
        forecast.backtest(WEEKS, holdout=holdout)


@pytest.mark.parametrize("argv, message", [
    (["--band", "80"], "the band (--band) is its coverage, between 0 and 1 (0.8 for 80 %), got 80"),
    (["--horizon", "0"], "the horizon (--horizon) is a whole number of days, at least 1, got 0"),
    (["--horizon", "-5"], "got -5"),
])
def test_the_cli_says_what_is_wrong(monkeypatch, capsys, argv, message):
    class Unread:  # the warehouse is never read
        def close(self):
            pass

    monkeypatch.setattr(warehouse, "connect", lambda settings: Unread())
    assert main(["forecast", "run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuledger: error: ") and message in err


def test_backtest_without_a_pod_list_says_so(capsys):
    # it ended in "TypeError: expected str, bytes or os.PathLike object, not NoneType" and a traceback
    assert main(["forecast", "backtest"]) == 2
    assert "usage: gpuledger forecast backtest --pods FILE" in capsys.readouterr().err


def test_backtest_uses_the_band_it_is_given(monkeypatch, capsys):
    # --band was read but not passed on: every backtest measured the 80 % band's coverage
    import json

    from gpuledger.traces import v2023

    # 50 days: one pod a day holding 1 + (day % 7) GPUs for 10 h, with a little noise in its length
    pods = [v2023.TracePod(f"p{d}", 1 + d % 7, 1000, (), "LS", "Succeeded", creation_s=d * 86400,
                           scheduled_s=d * 86400, deletion_s=d * 86400 + 36000 + (d * 7919) % 5400) for d in range(50)]
    monkeypatch.setattr(v2023, "read_pods", lambda path: pods)
    series = forecast.trace_daily_demand(pods)["*"][:-1]
    for band in (0.2, 0.99):
        assert main(["forecast", "backtest", "--pods", "x.csv", "--band", str(band), "--holdout", "14",
                     "--total-only", "--format", "json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["method"].endswith(f"{band:.0%}")
        assert row["band_coverage"] == forecast.backtest(series, 14, alpha=1 - band)["band_coverage"]
    assert main(["forecast", "backtest", "--pods", "x.csv", "--band", "95"]) == 2
    assert "the band (--band) is its coverage, between 0 and 1" in capsys.readouterr().err
