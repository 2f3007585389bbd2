"""A GPU card's history reaches as far back as its health and usage (docs/gpu-cards.md), on real chDB.

sql/0020 back-filled `gpu_sightings` from `gpu_health`, which keeps 14 days of samples, so on a
warehouse upgraded through it a GPU's sightings start at most 14 days before the upgrade, while
`gpu_health_hourly` (730 days) and `usage_raw` (7 years) hold older months. The card lists every
month its health or usage has, and its Xid total is the hourly table's, as the `gpu_cards` view's
and the fleet's (cards.build_card); sql/0036 back-fills the sightings from the hourly table, so
first seen and age follow (and keeps a stored sighting's exact tick within its first hour).
"""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.warehouse import cards, migrations

from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

OLD, YOUNG = "GPU-old-1", "GPU-young-1"
COLS = ["cluster", "node", "gpu_uuid", "gpu_model", "ts_ms", "interval_ms", "health", "down_reason",
        "temperature_c", "xid_errors"]
SIGHTING_COLS = ["gpu_uuid", "cluster", "node", "gpu_model", "serial", "board_part_number", "vbios_version",
                 "first_seen_ms", "last_seen_ms", "reports"]


def at(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp() * 1000)


def utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc)


def ticks(gpu: str, day: str, xids: list[int]) -> list[list]:
    """Five 60-s ticks from 00:10 of `day` on node n1; the third carries `xids`."""
    return [["c", "n1", gpu, "A100", at(f"{day}T00:10") + m * 60_000, 60_000, "ok", "", 50.0, xids if m == 2 else []]
            for m in range(5)]


# 1 Xid in Sep, 2 in Oct, 1 in Nov
OLD_TICKS = ticks(OLD, "2026-09-10", [79]) + ticks(OLD, "2026-10-05", [48, 79]) + ticks(OLD, "2026-11-20", [13]) \
    + ticks(OLD, "2026-11-30", [])
DOWN = usage_record("c", OLD, at("2026-10-05T00:12"), at("2026-10-05T00:15"), "down")  # 180 s


def card_view_fleet(client, database: str, gpu: str):
    card = cards.build_card(client, database, gpu)
    (view,) = client.query(f"SELECT first_seen, xid_errors, down_seconds FROM {database}.gpu_cards "
                           f"WHERE gpu_uuid = '{gpu}'").result_rows
    (fleet,) = [g for g in cards.fleet_rows(client, database) if g["gpu_uuid"] == gpu]
    return card, view, fleet


def test_card_months_and_xid_errors_reach_past_the_sightings(tmp_path):
    """Sightings from 20 Nov only (as 0020's back-fill leaves an old GPU); health from Sep, usage from Aug."""
    db = "card_months"
    with migrated_warehouse(tmp_path, db) as (client, _):
        client.insert("gpu_health", OLD_TICKS, column_names=COLS, database=db)  # -> gpu_health_hourly
        client.insert("gpu_sightings", [[OLD, "c", "n1", "A100", "", "", "", at("2026-11-20T00:10"),
                                         at("2026-11-30T00:14"), 10]], column_names=SIGHTING_COLS, database=db)
        # usage outlives health: a job on it in August (30 min), and the October down record
        job = usage_record("c", OLD, at("2026-08-30T10:00"), at("2026-08-30T10:30"), "executing", "j1", "t1")
        put_usage(client, db, [job, DOWN], 0)
        card, view, fleet = card_view_fleet(client, db, OLD)
        months = card.section("By month").rows
        assert [m["month"] for m in months] == ["2026-08", "2026-09", "2026-10", "2026-11"]
        assert [m["xid_errors"] for m in months] == [0, 1, 2, 1]
        assert [m["down_seconds"] for m in months] == [0, 0, 180, 0]
        assert months[0]["allocated_gpu_hours"] == pytest.approx(0.5)
        s = card.summary
        # the summary, its months, the dashboards' view and the fleet report agree
        assert s["xid_errors"] == sum(m["xid_errors"] for m in months) == view[1] == fleet["xid_errors"] == 4
        assert s["down_seconds"] == sum(m["down_seconds"] for m in months) == view[2] == 180


def test_upgrade_back_fills_sightings_from_the_hourly_health(tmp_path):
    """A warehouse upgraded through 0020 after September and October's samples expired from gpu_health."""
    db = "card_upgrade"
    client = warehouse_before("0020", db, prefix="card-history-")
    try:
        client.insert("gpu_health", OLD_TICKS + ticks(YOUNG, "2026-11-25", []), column_names=COLS, database=db)
        # gpu_health's 14-day retention; gpu_health_hourly keeps them
        client.command(f"ALTER TABLE {db}.gpu_health DELETE WHERE ts_ms < {at('2026-11-16T00:00')} "
                       "SETTINGS mutations_sync = 2")
        put_usage(client, db, [DOWN], 0)
        migrations.migrate(client, db)

        def sightings() -> dict:
            rows = client.query(f"SELECT gpu_uuid, min(first_seen_ms), max(last_seen_ms), sum(reports) "
                                f"FROM {db}.gpu_sightings GROUP BY gpu_uuid ORDER BY gpu_uuid").result_rows
            return {r[0]: tuple(r[1:]) for r in rows}

        before = sightings()
        # the old GPU from its first hour (its ticks expired: the hour is what is known) to its last
        # tick; the young one keeps its first tick (00:10), stored by 0020 within its first hour.
        # reports: 0020's ten and five samples, none added
        assert before == {OLD: (at("2026-09-10T00:00"), at("2026-11-30T00:14"), 10),
                          YOUNG: (at("2026-11-25T00:10"), at("2026-11-25T00:14"), 5)}
        card, view, fleet = card_view_fleet(client, db, OLD)
        assert card.summary["first_seen_at"] == utc("2026-09-10T00:00")
        assert view[0] == utc("2026-09-10T00:00").replace(tzinfo=None)  # the view's DateTime comes back naive
        assert card.period.startswith("2026-09-10 00:00")
        assert [m["month"] for m in card.section("By month").rows] == ["2026-09", "2026-10", "2026-11"]
        assert card.summary["xid_errors"] == view[1] == fleet["xid_errors"] == 4
        assert fleet["observed_ms"] == at("2026-11-30T00:14") - at("2026-09-10T00:00")
        # the file run again (an interrupted migration is rerun) changes nothing
        (mg,) = [m for m in migrations.load_migrations() if m.version == "0036"]
        for statement in mg.statements():
            client.command(statement)
        assert sightings() == before
    finally:
        client.close()


def test_tenants_served_count_a_job_id_of_two_clusters_twice(tmp_path):
    """A GPU moved from cluster a to cluster b served job "1001" in each: Slurm numbers jobs per cluster, so
    these are two jobs (the card said 1)."""
    db = "card_two_clusters"
    with migrated_warehouse(tmp_path, db) as (client, _):
        client.insert("gpu_sightings", [[OLD, c, "n1", "A100", "", "", "", at(f"2026-11-{d}T00:00"),
                                         at(f"2026-11-{d}T12:00"), 1] for c, d in (("a", "10"), ("b", "20"))],
                      column_names=SIGHTING_COLS, database=db)
        put_usage(client, db, [usage_record("a", OLD, at("2026-11-10T01:00"), at("2026-11-10T02:00"), "executing",
                                            "1001", "t1"),
                               usage_record("b", OLD, at("2026-11-20T01:00"), at("2026-11-20T03:00"), "executing",
                                            "1001", "t1")], 0)
        (tenant,) = cards.build_card(client, db, OLD).section("Tenants served").rows
        assert (tenant["tenant"], tenant["jobs"], tenant["gpu_hours"]) == ("t1", 2, pytest.approx(3.0))
