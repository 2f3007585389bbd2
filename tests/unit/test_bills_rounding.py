"""The rounding rule of docs/accounting.md §4 ("Rounding, exactly"), checked on the real join and
attribution: a tick split by allocation changes into stretches gets one rounded cost per stretch, so
the tick's records can add up to a micro-unit more or less than the tick unsplit."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, NodeTick
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.router import LifecycleRouter
from gpuledger.ledger_files import load_ledger_config

GOLDEN = load_ledger_config(Path(__file__).resolve().parents[1] / "golden" / "ledger.toml")
T0 = 1_762_732_800_000  # 2025-11-10T00:00Z, on a minute


def records_of_one_tick(changes_at_s: list[tuple[str, int]]) -> list[dict]:
    router, join = LifecycleRouter(), NodeJoin(node="n1")
    for n, (kind, at_s) in enumerate(changes_at_s):
        event = JobEvent(event_id=f"e{n}", ts_ms=T0 + at_s * 1000, kind=kind, cluster="c", job_id="j", attempt=0,
                         tenant="t", queue="q",
                         gpus=[GpuAssignment(node="n1", gpu_uuid="A")] if kind == "allocated" else [])
        for change in router.route(event):
            join.add_change(change)
    tick = NodeTick(cluster="c", node="n1", ts_ms=T0, interval_ms=60_000,
                    gpus=[GpuSample(gpu_uuid="A", index=0, model="A100-80GB", power_w=360.0, util_gpu_pct=80.0)])
    assert join.add_tick(tick).status == "accepted"
    return join.close_until(T0 + 60_000, GOLDEN)


@pytest.mark.parametrize("changes, costs", [
    ([], [40_900]),                                                         # one stretch: the whole tick
    ([("allocated", 20), ("started", 40)], [13_633, 13_633, 13_633]),       # 3 x 13,633.33: 40,899
    ([("allocated", 25), ("started", 35)], [17_042, 6_817, 17_042]),        # 17,041.67 + 6,816.67 + 17,041.67: 40,901
])
def test_one_rounded_cost_per_stretch(changes, costs):
    records = records_of_one_tick(changes)
    assert [r["cost_micros"] for r in records] == costs
    assert sum(r["gpu_ms"] for r in records) == 60_000
