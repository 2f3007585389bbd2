"""Lists of the periodic reports that grow with the fleet, capped (periodic.builders.capped): the
weekly's anomalies per kind, the inventory's low-utilization cards and the job report's idle
stretches. The first rows as they come (most important first), then one row counting the rest and
summing the columns named."""

from __future__ import annotations

import pytest

from gpuledger.warehouse.periodic.builders import capped, longest_first_capped

NOTE = ("detail", "not listed: their total")


def row(kind: str, subject: str, gpu_hours=None, cost=None) -> dict:
    return {"kind": kind, "subject": subject, "detail": "", "gpu_hours": gpu_hours, "cost": cost}


def anomalies(rows: list[dict], limit: int) -> list[dict]:
    return capped(rows, limit, label="subject", sums=("gpu_hours", "cost"), kind="kind", note=NOTE)


def test_each_kind_keeps_its_largest_and_sums_the_rest():
    rows = ([row("GPU down", f"g{i}", gpu_hours=10.0 - i) for i in range(5)]
            + [row("Failed attempts", f"j{i}", cost=100.0 - i) for i in range(3)]
            + [row("Straggler", "s0")])
    out = anomalies(rows, 2)
    assert out == [row("GPU down", "g0", gpu_hours=10.0), row("GPU down", "g1", gpu_hours=9.0),
                   {"kind": "GPU down", "subject": "3 more", "detail": "not listed: their total",
                    "gpu_hours": pytest.approx(8.0 + 7.0 + 6.0), "cost": None},
                   row("Failed attempts", "j0", cost=100.0), row("Failed attempts", "j1", cost=99.0),
                   {"kind": "Failed attempts", "subject": "1 more", "detail": "not listed: their total",
                    "gpu_hours": None, "cost": pytest.approx(98.0)},
                   row("Straggler", "s0")]


def test_nothing_summed_when_every_row_fits():
    rows = [row("GPU down", f"g{i}", gpu_hours=1.0) for i in range(3)]
    assert anomalies(rows, 3) == rows and anomalies(rows, 20) == rows and anomalies([], 1) == []


def test_a_large_count_reads_with_separators():
    rows = [row("Failed attempts", f"j{i}", cost=1.0) for i in range(1_250)]
    out = anomalies(rows, 20)
    assert len(out) == 21 and out[-1]["subject"] == "1,230 more" and out[-1]["cost"] == pytest.approx(1_230.0)


def test_one_list_without_kinds_leaves_the_other_columns_empty():
    cards = [{"gpu_uuid": f"g{i}", "node": "n1", "gpu_model": "T4", "util_pct": i / 10, "up_gpu_hours": 24.0,
              "queues": "q1"} for i in range(7)]
    out = capped(cards, 4, label="gpu_uuid", sums=("up_gpu_hours",), note=("queues", "not listed"))
    assert out[:4] == cards[:4]
    assert out[4] == {"gpu_uuid": "3 more", "node": None, "gpu_model": None, "util_pct": None,
                      "up_gpu_hours": pytest.approx(72.0), "queues": "not listed"}
    assert len(out) == 5


def stretch(start: int, idle: float, gpu: str = "g0") -> dict:
    return {"attempt": 0, "node": "n1", "gpu_uuid": gpu, "stretch_start": start, "duration_seconds": idle,
            "idle_gpu_seconds": idle, "offset_ms": start}


def test_a_jobs_longest_idle_stretches_stay_in_time_order_and_the_rest_is_summed():
    stretches = [stretch(0, 30.0), stretch(10, 600.0), stretch(20, 5.0), stretch(30, 900.0), stretch(40, 60.0)]
    out = longest_first_capped(stretches, 2)
    assert out[:2] == [stretch(10, 600.0), stretch(30, 900.0)]  # the two longest, in time order
    assert out[2] == {"attempt": None, "node": None, "gpu_uuid": "3 more", "stretch_start": None,
                      "duration_seconds": None, "idle_gpu_seconds": pytest.approx(95.0), "offset_ms": None}
    assert len(out) == 3
    assert longest_first_capped(stretches, 5) == stretches  # all fit: as they came
    # equal idle time: the earlier ones are listed
    assert longest_first_capped([stretch(0, 1.0), stretch(1, 1.0), stretch(2, 1.0)], 2)[:2] == [
        stretch(0, 1.0), stretch(1, 1.0)]
