"""The input topics' retention covers every day a close run may still adjust (docs/retention.md,
"Topics"): a replay of them is the only way to rebuild such a day, so a shorter retention is refused."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from gpuledger.config import Settings
from gpuledger.topics import DAY_MS, topic_config
from gpuledger.warehouse.bills import last_due_day


@pytest.mark.parametrize("hour", [0, 5, 6, 7, 23])
def test_default_input_retention_keeps_the_oldest_day_a_close_run_adjusts(tmp_path, hour):
    s = Settings(data_dir=tmp_path)
    now = dt.datetime(2026, 12, 6, hour, 59, tzinfo=dt.timezone.utc)
    now_ms = int(now.timestamp() * 1000)
    last_closed = last_due_day(now_ms, s.bills_close_grace_s)  # the data is current: horizon = now
    oldest = last_closed - dt.timedelta(days=s.bills_adjust_lookback_days - 1)  # bills.py: the adjusted window
    oldest_start_ms = int(dt.datetime.combine(oldest, dt.time(), dt.timezone.utc).timestamp() * 1000)
    kept_from_ms = now_ms - int(topic_config(s, s.topics.gpu_samples)["retention.ms"])
    assert kept_from_ms < oldest_start_ms - DAY_MS, (
        f"input kept from {kept_from_ms} but a close run still adjusts the day starting {oldest_start_ms}")


def test_an_input_retention_within_the_adjustment_window_is_refused():
    with pytest.raises(ValidationError, match="GPULEDGER_TOPIC_RETENTION_INPUT_DAYS=1 must be more than "
                                              "GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS \\+ 7 \\+ "
                                              "GPULEDGER_BILLS_CLOSE_GRACE_S in days = 69.25"):
        Settings(topic_retention_input_days=1)
    with pytest.raises(ValidationError, match="TOPIC_RETENTION_INPUT_DAYS=62 "):
        Settings(topic_retention_input_days=62)
    with pytest.raises(ValidationError, match="TOPIC_RETENTION_INPUT_DAYS=69.25 .* = 69.25"):
        Settings(topic_retention_input_days=69.25)
    # a longer look-back or grace needs a longer retention
    with pytest.raises(ValidationError, match="TOPIC_RETENTION_INPUT_DAYS=70 .* = 98"):
        Settings(bills_adjust_lookback_days=90, bills_close_grace_s=86_400)


def test_an_input_retention_past_the_adjustment_window_is_accepted():
    assert Settings().topic_retention_input_days == 70
    assert Settings(topic_retention_input_days=69.3).topic_retention_input_days == 69.3
    assert Settings(topic_retention_input_days=18, bills_adjust_lookback_days=10,
                    bills_close_grace_s=0).topic_retention_input_days == 18
