"""Golden GPU ID card and carbon bill (issue #15 point 6), worked by hand, on a real chDB filled through
the sink's own row functions (health_rows, inventory_row, usage_rows) and the migrations' views.

The card (docs/gpu-cards.md) — GPU-card-1, an A100 of cluster "golden", 60-s ticks on 10 Nov 2026:
  00:00 .. 00:09 on node n1: ticks 00:00-00:04 ok (60 C, 400 W, util 80 %), Xid 79 at 00:05, down 00:05-00:09
  repaired 01:00 ("replaced HBM"), VBIOS updated 92.00.45.00.05 -> 92.00.45.00.06
  02:00 .. 02:04 on node n2: ok (50 C, 300 W, util 60 %)
  repaired again 03:00 -> back from repair twice: "suggest lower-priority work"
  first seen 00:00:00, last seen 02:04:00 (the last tick's time), nodes 2;
  down time: records 00:05-00:08 and 00:08-00:10 (one segment cut at a window, and a duplicate copy
  of the first that the deduplication drops) = 180 s + 120 s = 300 s in one episode;
  temperature in Nov: ticks with a reading: 5 x 60 C + 5 x 50 C -> mean 55 C, max 60 C.

The carbon bill (docs/carbon.md) — PUE 1.5 ([power] of tests/golden/ledger.toml; [carbon] names no pue),
default intensity 500 g/kWh; series for zone "golden": 200 g/kWh from 10 Nov 00:00, 700 from 02:00 then
corrected to 600 by a second load (the later load wins, both stay stored):
  job j1 (t1) on card-1 00:00-00:05, 120,000 J = 0.0333.. kWh x 1.5 x 200 = 10 g    -> 0.010 kg
  job j2 (t2) on card-1 02:00-02:05,  90,000 J = 0.025 kWh    x 1.5 x 600 = 22.5 g  -> 0.0225 kg
  job j3 (t3) on card-2 09 Nov 23:00-23:06, 36,000 J = 0.01 kWh, before any series: x 1.5 x 500 = 7.5 g -> 0.0075 kg
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import GpuHealth, GpuSample, NodeTick, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, health_rows, inventory_row, usage_rows
from gpuledger.warehouse import cards, carbon, reports

pytestmark = pytest.mark.integration

DB = "ledger_cards"
GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"
MIN = 60_000
CARD, OTHER = "GPU-card-1", "GPU-card-2"


def at(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


D = at("2026-11-10T00:00")
IDENT1 = dict(serial="1321020012345", board_part_number="692-2G506-0210-002", vbios_version="92.00.45.00.05")
IDENT1_AFTER = {**IDENT1, "vbios_version": "92.00.45.00.06"}


def tick(node: str, ts: int, *gpus: GpuSample) -> NodeTick:
    return NodeTick(cluster="golden", node=node, ts_ms=ts, interval_ms=MIN, gpus=list(gpus))


def ok(uuid: str, temp: float, power: float, util: float, ident: dict) -> GpuSample:
    return GpuSample(gpu_uuid=uuid, index=0, model="A100-80GB", temperature_c=temp, power_w=power,
                     util_gpu_pct=util, **ident)


def down(uuid: str, xids: list[int], ident: dict) -> GpuSample:
    return GpuSample(gpu_uuid=uuid, index=0, model="A100-80GB", health=GpuHealth.down, down_reason="xid 79",
                     xid_errors=xids, **ident)


TICKS = (
    [tick("n1", D + i * MIN, ok(CARD, 60, 400, 80, IDENT1)) for i in range(5)]
    + [tick("n1", D + i * MIN, down(CARD, [79] if i == 5 else [], IDENT1)) for i in range(5, 10)]
    + [tick("n2", D + 120 * MIN + i * MIN, ok(CARD, 50, 300, 60, IDENT1_AFTER)) for i in range(5)]
    # card-2: an older agent (no identity), seen 09 Nov 23:00 .. 23:05 on n3
    + [tick("n3", D - 60 * MIN + i * MIN, ok(OTHER, 40, 100, 50, {})) for i in range(6)]
)


def rec(gpu: str, start: int, end: int, state: str, job: str = "", tenant: str = "", energy: float = 0.0,
        util: float | None = None) -> UsageRecord:
    ms = end - start
    return UsageRecord(record_id=f"{gpu}/{start}/{state}", cluster="golden", node="n", gpu_uuid=gpu,
                       gpu_model="A100-80GB", start_ms=start, end_ms=end, state=state, job_id=job,
                       tenant=tenant, queue="q" if job else "", share_milli=1000, gpu_ms=ms, util_pct=util,
                       energy_j=energy, coefficient=1.0, coefficient_version="v1", effective_gpu_ms=ms,
                       cost_micros=ms // 1000, definition_version="golden-1")


USAGE = [
    rec(CARD, D, D + 5 * MIN, "executing", "j1", "t1", 120_000.0, 80.0),
    rec(CARD, D + 5 * MIN, D + 8 * MIN, "down"),
    rec(CARD, D + 5 * MIN, D + 8 * MIN, "down"),  # a redelivered copy: same record id, counted once
    rec(CARD, D + 8 * MIN, D + 10 * MIN, "down"),
    rec(CARD, D + 120 * MIN, D + 125 * MIN, "executing", "j2", "t2", 90_000.0, 60.0),
    rec(OTHER, D - 60 * MIN, D - 54 * MIN, "executing", "j3", "t3", 36_000.0, 50.0),
]
INTENSITY_1 = "zone,valid_from,gco2e_per_kwh\ngolden,2026-11-10T00:00Z,200\ngolden,2026-11-10T02:00Z,700\n"
INTENSITY_2 = "cluster,valid_from,gco2e_per_kwh,note\ngolden,2026-11-10T02:00:00+00:00,600,corrected\n"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("cards") / "chdb"
    c = warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))
    try:
        warehouse.migrate(c, DB)
        for n, t in enumerate(TICKS):
            warehouse.insert_rows(c, "gpu_health", health_rows(t, Source("s", 0, n)), database=DB)
            warehouse.insert_rows(c, "node_inventory", [inventory_row(t, Source("s", 0, n))], database=DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=USAGE), Source("u", 0, 0)),
                              database=DB)
        now = at("2026-11-11T00:00")
        cards.record_repair(c, DB, CARD, "replaced HBM", at("2026-11-10T01:00"), "alice", now_ms=now)
        cards.record_repair(c, DB, CARD, "reseated, new thermal pads", at("2026-11-10T03:00"), "bob", now_ms=now)
        ledger = load_ledger_config(GOLDEN_LEDGER)
        assert carbon.record_definition(c, DB, ledger.carbon)
        assert not carbon.record_definition(c, DB, ledger.carbon)  # unchanged: not recorded twice
        carbon.load_intensity(c, DB, carbon.parse_intensity_csv(INTENSITY_1, "a.csv"), "a.csv", "ops")
        carbon.load_intensity(c, DB, carbon.parse_intensity_csv(INTENSITY_2, "b.csv"), "b.csv", "ops")
        yield c
    finally:
        c.close()  # one chDB directory per process


def test_card_over_a_repair(client):
    card = cards.build_card(client, DB, CARD)
    s = card.summary
    assert s["first_seen_at"] == dt.datetime(2026, 11, 10, 0, 0, tzinfo=dt.timezone.utc)
    assert s["last_seen_at"] == dt.datetime(2026, 11, 10, 2, 4, tzinfo=dt.timezone.utc)
    assert (s["serial"], s["board_part_number"], s["vbios_version"]) == (
        "1321020012345", "692-2G506-0210-002", "92.00.45.00.06")  # the newest VBIOS, read after the repair
    assert s["vendor_batch"] == "692-2G506-0210-002 / 1321020"
    assert s["nodes"] == 2 and s["down_seconds"] == 300 and s["down_episodes"] == 1
    assert s["xid_errors"] == 1 and s["repairs"] == 2
    assert s["flag"] == "suggest lower-priority work"
    places = card.section("Where it sat").rows
    assert [(p["node"], p["first_seen_at"].strftime("%H:%M"), p["last_seen_at"].strftime("%H:%M")) for p in places] == [
        ("n1", "00:00", "00:09"), ("n2", "02:00", "02:04")]
    repairs = card.section("Repairs").rows
    assert [(r["repaired_at"].strftime("%H:%M"), r["note"], r["recorded_by"]) for r in repairs] == [
        ("01:00", "replaced HBM", "alice"), ("03:00", "reseated, new thermal pads", "bob")]
    (nov,) = card.section("By month").rows
    assert nov["month"] == "2026-11" and nov["avg_temperature_c"] == pytest.approx(55.0)
    assert nov["max_temperature_c"] == 60 and nov["down_seconds"] == 300
    # busy hours per kWh: (5 min x 0.8 + 5 min x 0.6) = 7 busy minutes = 420,000 ms over 210,000 J -> 2.0
    assert nov["busy_hours_per_kwh"] == pytest.approx(2.0)
    assert s["busy_hours_per_kwh_trend_pct_per_month"] is None  # one month: no trend
    xids = card.section("Xid errors").rows
    assert [(x["seen_at"].strftime("%H:%M"), x["xid_codes"], x["health"]) for x in xids] == [("00:05", "79", "down")]
    # the dashboards' one-row-per-GPU view says the same
    (row,) = client.query(f"SELECT nodes, repairs, flag, down_seconds, xid_errors, max_temperature_c, vbios_version "
                          f"FROM {DB}.gpu_cards WHERE gpu_uuid = '{CARD}'").result_rows
    assert row == (2, 2, "suggest lower-priority work", 300, 1, 60, "92.00.45.00.06")
    tenants = card.section("Tenants served").rows
    assert [(t["tenant"], t["jobs"], round(t["gpu_hours"], 6)) for t in tenants] == [
        ("t1", 1, round(5 / 60, 6)), ("t2", 1, round(5 / 60, 6))]


def test_card_renderings_and_unknown_gpu(client):
    card = cards.build_card(client, DB, CARD)
    data = json.loads(cards.render_card(card, "json"))
    assert data["summary"]["flag"] == "suggest lower-priority work" and data["summary"]["repairs"] == 2
    html = cards.render_card(card, "html")
    assert "GPU ID card" in html and "replaced HBM" in html and "<svg" in html and "<script" not in html
    text = cards.render_card(card, "table")
    assert "suggest lower-priority work" in text and "n2" in text
    with pytest.raises(ValueError, match="no GPU GPU-nope"):
        cards.build_card(client, DB, "GPU-nope")
    with pytest.raises(ValueError, match="never seen"):
        cards.record_repair(client, DB, "GPU-nope", "x", D, "alice")
    with pytest.raises(ValueError, match="future"):
        cards.record_repair(client, DB, CARD, "x", D + 10 * 86_400_000, "alice", now_ms=D)


def test_fleet_failure_rates(client):
    fleet = cards.build_fleet(client, DB)
    (model,) = fleet.section("By model").rows
    # card-1 failed (one down episode, two repairs), card-2 did not: 1 of 2
    assert (model["gpu_model"], model["gpus"], model["failed_gpus"], model["failed_gpu_share"]) == ("A100-80GB", 2, 1, 0.5)
    # observed: card-1 00:00 -> 02:04 = 124 min, card-2 23:00 -> 23:05 = 5 min; 1 episode / 129 min in years
    assert model["failures_per_gpu_year"] == pytest.approx(1 / (129 * MIN / cards.YEAR_MS))
    batches = {r["vendor_batch"]: r for r in fleet.section("By vendor batch").rows}
    assert set(batches) == {"692-2G506-0210-002 / 1321020", "unknown"}
    assert batches["unknown"]["failed_gpus"] == 0 and batches["692-2G506-0210-002 / 1321020"]["flagged_gpus"] == 1
    assert [r["age"] for r in fleet.section("By age").rows] == ["under 1 year"]
    assert [r["gpu_uuid"] for r in fleet.sections[-1].rows] == [CARD]


def test_carbon_bill_over_an_intensity_change(client):
    bills = {(r["day"].isoformat(), r["tenant"]): r for r in reports.fetch(client, DB, "bills")}
    assert bills[("2026-11-10", "t1")]["co2e_kg"] == pytest.approx(0.010)   # 200 g/kWh
    assert bills[("2026-11-10", "t2")]["co2e_kg"] == pytest.approx(0.0225)  # 600 g/kWh (the corrected load)
    assert bills[("2026-11-09", "t3")]["co2e_kg"] == pytest.approx(0.0075)  # before any series: default 500
    assert {r["carbon_version"] for r in bills.values()} == {"carbon-golden"}
    jobs = {r["job_id"]: r["co2e_kg"] for r in reports.fetch(client, DB, "jobs")}
    assert jobs == pytest.approx({"j1": 0.010, "j2": 0.0225, "j3": 0.0075})
    # the sibling view of tenant_daily_bill agrees with the report
    view = {(str(r[0]), r[1]): r[2] for r in client.query(
        f"SELECT day, tenant, co2e_kg FROM {DB}.tenant_daily_carbon").result_rows}
    assert view == pytest.approx({("2026-11-10", "t1"): 0.010, ("2026-11-10", "t2"): 0.0225,
                                  ("2026-11-09", "t3"): 0.0075})
    # history kept: both loads of 02:00 are stored, the later one applies
    stored = client.query(f"SELECT gco2e_per_kwh FROM {DB}.carbon_intensity WHERE valid_from_ms = {D + 120 * MIN} "
                          "ORDER BY loaded_at").result_rows
    assert [r[0] for r in stored] == [700.0, 600.0]
