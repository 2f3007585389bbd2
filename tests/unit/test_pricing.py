from datetime import datetime, timedelta, timezone

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config

DAY = 86_400_000


def doc(**extra):
    d = {
        "definition_version": "v1",
        "prices": {"default": {"depreciation_per_hour": 1.0, "maintenance_per_hour": 0.0}},
        "power": {"electricity_price_per_kwh": 0.1, "pue": 1.5},
        "coefficients": [
            {"model": "A", "coefficient": 2.0, "valid_from": "2026-01-01"},
            {"model": "A", "coefficient": 2.5, "valid_from": "2026-06-01"},
        ],
    }
    d.update(extra)
    return d


def test_coefficient_history_picks_entry_valid_at_time():
    cfg = parse_ledger_config(doc())
    jan = 1_767_225_600_000  # 2026-01-01
    assert cfg.coefficient_at("A", jan + DAY).coefficient == 2.0
    assert cfg.coefficient_at("A", jan + 200 * DAY).version == "A@2026-06-01"
    # before its first entry: the earliest default (flagged priced-by-default downstream), never an
    # error — this runs in the worker, where an exception would stop the metering
    early = cfg.coefficient_at("A", jan - DAY)
    assert (early.model, early.coefficient) == ("default", 1.0)  # no default entry: the baseline's 1.0


def test_interval_cost_fixed_plus_measured_energy():
    cfg = parse_ledger_config(doc())
    # 1 h at 1.0/h + 3.6e6 J = 1 kWh x 0.1 x 1.5 = 0.15 -> 1.15
    assert cfg.interval_cost_micros("any", 3_600_000, 3_600_000.0) == 1_150_000


def test_bad_configs_have_clear_errors(tmp_path):
    with pytest.raises(LedgerConfigError, match="missing key 'definition_version'"):
        parse_ledger_config({k: v for k, v in doc().items() if k != "definition_version"})
    with pytest.raises(LedgerConfigError, match=r"prices.default"):
        parse_ledger_config(doc(prices={"X": {"depreciation_per_hour": 1, "maintenance_per_hour": 0}}))
    with pytest.raises(LedgerConfigError, match=r"coefficients\[0\].coefficient must be a number > 0"):
        parse_ledger_config(doc(coefficients=[{"model": "A", "coefficient": 0, "valid_from": "2026-01-01"}]))
    with pytest.raises(LedgerConfigError, match="valid_from"):
        parse_ledger_config(doc(coefficients=[{"model": "A", "coefficient": 1, "valid_from": "soon"}]))
    with pytest.raises(LedgerConfigError, match="not found"):
        load_ledger_config(tmp_path / "nope.toml")


def test_bundled_defaults_load():
    cfg = load_ledger_config()
    assert cfg.reference_cost_per_gpu_hour() > 0
    assert cfg.coefficient_at(cfg.baseline_model, 1_800_000_000_000).coefficient == 1.0


def _a100_prices(*valid_froms):
    return [{"model": "default", "valid_from": "2020-01-01", "depreciation_per_hour": 1.0, "maintenance_per_hour": 0.0},
            *({"model": "A100-80GB", "valid_from": v, "depreciation_per_hour": 1.0 + i, "maintenance_per_hour": 0.0}
              for i, v in enumerate(valid_froms))]


def test_valid_from_is_a_whole_utc_date():
    # an entry's id is MODEL@DAY and the warehouse's valid_from is a Date: a TOML datetime at another
    # time than midnight UTC would give two entries of one day one id (and one cost in the worker's caches)
    noon = datetime(2026, 11, 2, 12, tzinfo=timezone.utc)
    with pytest.raises(LedgerConfigError, match=r"prices\[2\] \(model 'A100-80GB'\): valid_from must be a UTC date.*"
                                                r"2026-11-02T12:00:00\+00:00"):
        parse_ledger_config(doc(prices=_a100_prices("2026-11-01", noon)))
    with pytest.raises(LedgerConfigError, match=r"coefficients\[1\] \(model 'A'\): valid_from must be a UTC date"):
        parse_ledger_config(doc(coefficients=[{"model": "A", "coefficient": 2.0, "valid_from": "2026-01-01"},
                                              {"model": "A", "coefficient": 4.0, "valid_from": noon}]))
    # midnight UTC is the day (a local datetime reads as UTC); midnight elsewhere is not a UTC day
    with pytest.raises(LedgerConfigError, match="valid_from must be a UTC date"):
        parse_ledger_config(doc(prices=_a100_prices(datetime(2026, 11, 2, tzinfo=timezone(timedelta(hours=2))))))
    cfg = parse_ledger_config(doc(prices=_a100_prices(datetime(2026, 11, 2, tzinfo=timezone.utc)),
                                  coefficients=[{"model": "A", "coefficient": 2.0, "valid_from": datetime(2026, 1, 1)}]))
    assert cfg.price_history["A100-80GB"][0].version == "A100-80GB@2026-11-02"
    assert cfg.coefficients["A"][0].version == "A@2026-01-01"


def test_two_entries_of_one_model_on_one_day_are_refused():
    with pytest.raises(LedgerConfigError, match=r"prices\[2\]: A100-80GB@2026-11-02 is listed twice \(prices\[1\]"):
        parse_ledger_config(doc(prices=_a100_prices("2026-11-02", datetime(2026, 11, 2, tzinfo=timezone.utc))))
    with pytest.raises(LedgerConfigError, match=r"coefficients\[1\]: A@2026-01-01 is listed twice \(coefficients\[0\]"):
        parse_ledger_config(doc(coefficients=[{"model": "A", "coefficient": 2.0, "valid_from": "2026-01-01"},
                                              {"model": "A", "coefficient": 4.0, "valid_from": "2026-01-01"}]))



def test_valid_from_is_within_the_warehouse_date_range():
    # the warehouse keeps valid_from as a Date (1970-01-01 .. 2149-06-06); before, 1969-12-01 loaded (the
    # workers priced with it) and `gpuledger migrate` then failed in sync_library with "Unable to create
    # native array for column `valid_from`: error", after recording the definition version
    for bad in ("1969-12-31", "2149-06-07", datetime(1900, 1, 1, tzinfo=timezone.utc)):
        with pytest.raises(LedgerConfigError, match=r"prices\[1\] \(model 'A100-80GB'\): valid_from must be within "
                                                    r"1970-01-01 and 2149-06-06"):
            parse_ledger_config(doc(prices=_a100_prices(bad)))
        with pytest.raises(LedgerConfigError, match=r"coefficients\[0\] \(model 'A'\): valid_from must be within"):
            parse_ledger_config(doc(coefficients=[{"model": "A", "coefficient": 2.0, "valid_from": bad}]))
    cfg = parse_ledger_config(doc(prices=_a100_prices("1970-01-01", "2149-06-06")))
    assert [e.version for e in cfg.price_history["A100-80GB"]] == ["A100-80GB@1970-01-01", "A100-80GB@2149-06-06"]


def test_reference_cost_is_the_price_valid_now_not_a_future_entry():
    # a price agreed in advance (valid from 2099) is history to come: the jobs report's opportunity cost
    # takes the entry valid at the time the edge passes (before, only the latest: 2.0/h instead of 1.0/h)
    prices = [*_a100_prices("2020-01-01"),
              {"model": "A100-80GB", "valid_from": "2099-01-01", "depreciation_per_hour": 2.0, "maintenance_per_hour": 0.0}]
    cfg = parse_ledger_config(doc(prices=prices, reference_model="A100-80GB"))
    now_ms = int(datetime.now(timezone.utc).timestamp() * 1000)
    assert cfg.reference_cost_per_gpu_hour(at_ms=now_ms) == 1.0
    assert cfg.reference_cost_per_gpu_hour(at_ms=4_070_908_800_000) == 2.0  # 2099-01-01
    assert cfg.reference_cost_per_gpu_hour() == 2.0  # no time given: the latest entry, as before
    assert cfg.price("A100-80GB", now_ms).depreciation_per_hour == 1.0
