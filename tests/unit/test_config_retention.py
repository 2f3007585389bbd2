"""The retention settings refuse a window that a close run's adjustment lookback outlives
(docs/retention.md, "Money tables"): the closed rows of every day it may still adjust must be kept."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuledger.config import Settings


def test_a_bills_retention_within_the_lookback_is_refused():
    with pytest.raises(ValidationError, match="GPULEDGER_RETENTION_BILLS_DAYS=30 must be 0 or more than "
                                              "GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS \\+ 7 = 69"):
        Settings(retention_bills_days=30)
    with pytest.raises(ValidationError, match="RETENTION_BILLS_DAYS=69"):
        Settings(retention_bills_days=69)
    with pytest.raises(ValidationError, match="RETENTION_BILLS_DAYS=17 .* = 17"):
        Settings(retention_bills_days=17, bills_adjust_lookback_days=10)


def test_a_bills_retention_past_the_lookback_or_none_is_accepted():
    assert Settings(retention_bills_days=70).retention_bills_days == 70
    assert Settings(retention_bills_days=0).retention_bills_days == 0
    assert Settings(retention_bills_days=18, bills_adjust_lookback_days=10).retention_bills_days == 18
