"""bench/footprint.py `rows_breakdown` (usage records per GPU-hour split by cause) and `rows_one_per_holder`
(the same records regrouped one per holder), on records made by hand."""

from __future__ import annotations

import pytest

from bench.footprint import rows_breakdown, rows_one_per_holder

W = 60_000


def rec(gpu: str, start_s: int, state: str = "unallocated", job: str | None = None) -> dict:
    r = {"gpu_uuid": gpu, "start_ms": start_s * 1000, "state": state}
    if job:
        r.update(job_id=job, attempt=0)
    return r


def test_windows_cuts_and_shared_slots_are_told_apart():
    records = [
        rec("A", 0),                                          # window 0: one record
        rec("A", 60, "executing", "j1"), rec("A", 90),        # window 1: cut by a holder change
        rec("A", 120, "executing", "j1"), rec("A", 150, "allocated_idle", "j1"),  # window 2: state cut
        rec("B", 0, "executing", "j2"), rec("B", 0, "executing", "j3"), rec("B", 0),  # 3 slots, one segment
    ]
    got = rows_breakdown(records, gpu_hours=2.0, window_ms=W)
    assert got["windows"] == pytest.approx(4 / 2.0)
    assert got["cuts_by_kind"] == {"holder": pytest.approx(0.5), "state": pytest.approx(0.5)}
    assert got["cuts"] == pytest.approx(1.0)
    assert got["shared_slots"] == pytest.approx(2 / 2.0)
    # the parts add up to every record
    assert (got["windows"] + got["cuts"] + got["shared_slots"]) * 2.0 == pytest.approx(len(records))


def test_one_per_holder_merges_state_changes_and_states_but_not_holder_changes():
    records = [
        rec("A", 0),                                                               # window 0: 1 row
        rec("A", 60, "executing", "j1"), rec("A", 90),                             # window 1: holder change, 2
        rec("A", 120, "executing", "j1"), rec("A", 150, "allocated_idle", "j1"),   # window 2: state change, 1
        rec("B", 0, "executing", "j2"), rec("B", 0, "allocated_idle", "j2"),       # shared: j2 and j3 both
        rec("B", 0, "executing", "j3"), rec("B", 0, "allocated_idle", "j3"), rec("B", 0),  # states, and free: 3
        rec("B", 30, "executing", "j2"), rec("B", 30, "executing", "j3"), rec("B", 30),    # same holders: merged
        rec("B", 60, "executing", "j2"), rec("B", 60),                             # window 1 starts anew: 2
    ]
    assert rows_one_per_holder(records, gpu_hours=2.0, window_ms=W) == pytest.approx((1 + 2 + 1 + 3 + 2) / 2.0)
