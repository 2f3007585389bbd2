"""Prices through the real pipeline (Tansu + Faust worker + sink + chDB): price history, a model
without a price (flagged rows, bill column, report footnote), an energy spike that is not believed,
`rebill --cost` beside the original rows; and cost sums at the extreme that do not wrap.

Ledger: tests/golden/ledger.toml with its prices as [[prices]] history and A100 2.40/h until 15 Nov,
3.60/h from 16 Nov. Every GPU draws 360 W (A100) or 600 W (H200) in 60-s ticks; 0.10/kWh x PUE 1.5:
  A100 tick until 15 Nov: 2.40/60 = 40,000 + 21,600 J = 0.006 kWh x 0.15 = 900 -> 40,900 micros
  A100 tick from 16 Nov:  3.60/60 = 60,000 + 900                              -> 60,900
  H200 tick (no price: `default`, 1.00/h): 16,666.67 + 36,000 J = 0.01 kWh x 0.15 = 1,500 -> 18,167
docs/accounting.md §4a-§4c works through the same numbers."""

from __future__ import annotations

import tomllib
from datetime import date, datetime, timezone
from pathlib import Path

import orjson
import pytest
import tomli_w

from gpuledger.schemas.lines import Emission
from gpuledger.cli import main
from gpuledger.warehouse.library import rebill, rebill_bill
from gpuledger.config import Settings
from gpuledger.embedded.pipeline import run_embedded
from gpuledger.warehouse.reports import fetch
from gpuledger.warehouse.report_text import render
from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick
from gpuledger.streams.pricing import MAX_RECORD_COST_MICROS, parse_ledger_config
from gpuledger.warehouse import connect, migrate

pytestmark = pytest.mark.integration

GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"
MIN = 60_000
POWER = {"A100-80GB": 360.0, "H200-141GB": 600.0}


def at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


T = at("2026-11-15T23:00")


def ledger_doc(**changes) -> dict:
    doc = tomllib.loads(GOLDEN_LEDGER.read_text())
    doc["definition_version"] = "prices-1"
    doc["prices"] = [
        {"model": "default", "valid_from": "2020-01-01", "depreciation_per_hour": 1.0, "maintenance_per_hour": 0.0},
        {"model": "A100-80GB", "valid_from": "2020-01-01", "depreciation_per_hour": 2.0, "maintenance_per_hour": 0.4},
        {"model": "A100-80GB", "valid_from": "2026-11-16", "depreciation_per_hour": 3.0, "maintenance_per_hour": 0.6},
    ]
    doc.update(changes)
    return doc


def build() -> list[Emission]:
    out: list[Emission] = []

    def event(ts, kind, job, tenant, gpus=()):
        out.append(Emission("job-events", job, JobEvent(
            event_id=f"{job}/{kind}", ts_ms=ts, kind=kind, cluster="prices", job_id=job, tenant=tenant, queue="q",
            requested_gpus=1.0, gpus=[GpuAssignment(node=n, gpu_uuid=g) for n, g in gpus])))

    # job a: one A100, 15 Nov 23:00 -> 16 Nov 01:00 (the price changes at midnight)
    event(T, "allocated", "a", "t-a", [("n1", "g-a")])
    event(T, "started", "a", "t-a")
    event(T + 120 * MIN, "completed", "a", "t-a")
    # job h: one H200 (no price, no coefficient), 16 Nov 00:00 -> 01:00
    event(T + 60 * MIN, "allocated", "h", "t-h", [("n1", "g-h")])
    event(T + 60 * MIN, "started", "h", "t-h")
    event(T + 120 * MIN, "completed", "h", "t-h")
    for k in range(120):
        ts = T + k * MIN
        gpus = []
        for index, (uuid, model) in enumerate([("g-a", "A100-80GB"), ("g-h", "H200-141GB")]):
            energy = POWER[model] * (ts - T + 3_600_000) / 1000
            if uuid == "g-a" and k == 30:
                energy += 1e20  # one absurd reading: neither this tick nor the next believes the counter
            gpus.append(GpuSample(gpu_uuid=uuid, index=index, model=model, util_gpu_pct=80.0, power_w=POWER[model],
                                  energy_j=energy))
        out.append(Emission("gpu-samples", "n1", NodeTick(cluster="prices", node="n1", ts_ms=ts, interval_ms=MIN,
                                                         gpus=gpus)))
        out.append(Emission("job-events", None, LifecycleWatermark(cluster="prices", ts_ms=ts)))
    out.append(Emission("job-events", None, LifecycleWatermark(cluster="prices", ts_ms=T + 122 * MIN)))
    order = {"job-events": 0, "gpu-samples": 1}
    return sorted(out, key=lambda e: (e.message.ts_ms, order[e.line], e.key is None))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    data = tmp_path_factory.mktemp("prices")
    config = data / "ledger.toml"
    config.write_text(tomli_w.dumps(ledger_doc()))
    settings = Settings(data_dir=data, ledger_config=config, worker_rebalance_timeout_s=4.0,
                        partitions_gpu_samples=1, partitions_job_events=1, partitions_usage=1)
    run_embedded(settings, build())
    return settings


def bills(client, settings) -> dict:
    return {(str(r["day"]), r["tenant"]): r for r in fetch(client, settings.database, "bills")}


def test_price_history_flags_and_the_energy_cap_through_the_pipeline(pipeline):
    client = connect(pipeline)
    try:
        b = bills(client, pipeline)
        assert b[("2026-11-15", "t-a")]["total_cost_micros"] == 60 * 40_900        # spike tick included: 40,900
        assert b[("2026-11-16", "t-a")]["total_cost_micros"] == 60 * 60_900        # the price valid from 16 Nov
        assert b[("2026-11-16", "t-h")]["total_cost_micros"] == 60 * 18_167        # the default price, flagged
        assert b[("2026-11-16", "t-h")]["priced_by_default_gpu_hours"] == pytest.approx(1.0)
        assert b[("2026-11-16", "t-a")]["priced_by_default_gpu_hours"] == 0
        assert "1.0000 GPU-hours in these rows were priced by default" in render(list(b.values()), "table")
        jobs = {r["job_id"]: r for r in fetch(client, pipeline.database, "jobs")}
        assert jobs["h"]["priced_by_default_gpu_hours"] == pytest.approx(1.0) and jobs["a"]["priced_by_default_gpu_hours"] == 0
        rows = client.query(
            "SELECT gpu_uuid, price_version, priced_by_default, count(), max(energy_j) FROM gpuledger.usage_raw "
            "GROUP BY gpu_uuid, price_version, priced_by_default ORDER BY gpu_uuid, price_version").result_rows
        assert [r[:4] for r in rows] == [
            ("g-a", "A100-80GB@2020-01-01", False, 60), ("g-a", "A100-80GB@2026-11-16", False, 60),
            ("g-h", "default@2020-01-01", True, 120)]  # unallocated before the job, too
        assert max(r[4] for r in rows) == pytest.approx(36_000.0)  # no record holds the 1e20 J reading
        recorded = client.query("SELECT version, depreciation_per_hour FROM gpuledger.prices FINAL ORDER BY version").result_rows
        assert recorded == [("A100-80GB@2020-01-01", 2.0), ("A100-80GB@2026-11-16", 3.0), ("default@2020-01-01", 1.0)]
    finally:
        client.close()


def test_rebill_cost_beside_the_original_rows(pipeline, capsys, monkeypatch):
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(pipeline.ledger_config))
    capsys.readouterr()
    assert main(["rebill", "--from", "2026-11-15", "--to", "2026-11-16", "--as-of", "2026-11-16", "--cost",
                 "--format", "json", "--data-dir", str(pipeline.data_dir)]) == 0
    out = {(r["day"], r["tenant"]): r for r in orjson.loads(capsys.readouterr().out)}
    # 15 Nov re-priced at the 16 Nov price: 3.60/h x 1 h + 0.36 kWh x 0.15 = 3.654
    assert (out[("2026-11-15", "t-a")]["original_cost_micros"], out[("2026-11-15", "t-a")]["total_cost_micros"]) == \
        (2_454_000, 3_654_000)
    assert out[("2026-11-16", "t-a")]["total_cost_micros"] == 3_654_000
    # the H200 at bill grain: 1.00 x 1 h + 0.6 kWh x 0.15 = 1.09 (the records rounded each tick: 1,090,020)
    h = out[("2026-11-16", "t-h")]
    assert (h["original_cost_micros"], h["total_cost_micros"], h["priced_by_default_gpu_hours"]) == (1_090_020, 1_090_000, 1.0)
    client = connect(pipeline)
    try:
        assert bills(client, pipeline)[("2026-11-15", "t-a")]["total_cost_micros"] == 2_454_000  # untouched
        # the same re-bill under the "zero" policy: the H200 costs nothing until it has a price, still flagged
        zero = parse_ledger_config(ledger_doc(unpriced={"policy": "zero"}, definition_version="prices-1-zero"))
        rid = rebill(client, pipeline.database, zero, date(2026, 11, 16), date(2026, 11, 16), date(2026, 11, 16), cost=True)
        again = {r["tenant"]: r for r in rebill_bill(client, pipeline.database, rid)}
        assert again["t-h"]["total_cost_micros"] == 0 and again["t-h"]["priced_by_default_gpu_hours"] == 1.0
        assert again["t-a"]["total_cost_micros"] == 3_654_000
        # without --cost the cost stays the original
        rid = rebill(client, pipeline.database, zero, date(2026, 11, 15), date(2026, 11, 15), date(2026, 11, 16))
        assert rebill_bill(client, pipeline.database, rid)[0]["total_cost_micros"] == 2_454_000
    finally:
        client.close()


def test_cost_sums_at_the_extreme_do_not_wrap(tmp_path):
    """400,000 records at the most one record can cost (5.2e13 micros): 2.08e19, beyond UInt64 (1.8e19)."""
    n = 400_000
    client = connect(Settings(data_dir=tmp_path))
    try:
        migrate(client, "gpuledger")
        client.command(
            "INSERT INTO gpuledger.usage_raw (schema_version, record_id, cluster, node, gpu_uuid, gpu_model, start_ms, "
            "end_ms, state, job_id, attempt, tenant, queue, share_milli, gpu_ms, energy_j, coefficient, "
            "coefficient_version, effective_gpu_ms, cost_micros, definition_version, kafka_topic, kafka_partition, "
            "kafka_offset) "
            f"SELECT 1, toString(number), 'c', 'n', concat('g', toString(number % 1000)), 'X', {at('2026-11-10T00:00')} "
            f"+ intDiv(number, 1000) * 3600000, 0, 'executing', 'big', 0, 'acme', 'q', 1000, 3600000, 0, 1, 'x', "
            f"3600000, {MAX_RECORD_COST_MICROS}, 'v', 't', 0, number FROM numbers({n})")
        expected = n * MAX_RECORD_COST_MICROS
        assert expected > 2**64
        total = client.query("SELECT sum(cost_micros) FROM gpuledger.usage_by_job_daily").result_rows[0][0]
        assert int(total) == expected
        # the bill views over the aggregate (sql/0015)
        bill = client.query("SELECT total_cost_micros, compute_cost_micros FROM gpuledger.tenant_daily_bill").result_rows
        assert sum(int(r[0]) for r in bill) == sum(int(r[1]) for r in bill) == expected
        (job,) = client.query("SELECT cost_micros FROM gpuledger.job_cost").result_rows
        assert int(job[0]) == expected
        capacity = client.query("SELECT sum(cost_micros) FROM gpuledger.usage_capacity_daily").result_rows[0][0]
        assert int(capacity) == expected
    finally:
        client.close()
