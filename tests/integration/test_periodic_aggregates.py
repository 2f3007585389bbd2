"""The periodic reports' aggregate reads (sql/0030 usage_gpu_daily; the fleet's down episodes counted
in the engine from gpu_down_records) against the same figures worked out in Python from the usage
records themselves, on random records: several days, GPUs moving between nodes' queues, null and
zero utilization, down records that touch, overlap or stand apart, and a replayed (duplicate) down
record, which the fleet counts once. Half the records are written before sql/0030 (its back-fill), half
after (its materialized view)."""

from __future__ import annotations

import datetime as dt
import random
from collections import defaultdict

import pytest
from warehouse_helpers import warehouse_before

from gpuledger.warehouse import cards
from gpuledger.warehouse.migrations import migrate
from gpuledger.warehouse.periodic import commands as pr
from gpuledger.warehouse.periodic import queries as pr_queries

pytestmark = pytest.mark.integration

DB = "periodic_agg"
DAY0 = dt.date(2026, 11, 1)
T0 = int(dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
COLS = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms", "state",
        "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "util_pct", "energy_j", "coefficient",
        "coefficient_version", "effective_gpu_ms", "cost_micros", "definition_version", "kafka_topic",
        "kafka_partition", "kafka_offset"]


def random_records(seed: int) -> list[dict]:
    rnd = random.Random(seed)
    gpus = {f"gpu-{i}": (f"n{i // 4}", rnd.choice(["A100-80GB", "T4"])) for i in range(12)}
    out = []
    for gpu, (node, model) in gpus.items():
        minute = 0
        while minute < 3 * 1440:  # three days, stretches of 5 to 300 minutes
            length = rnd.randint(5, 300)
            state = rnd.choice(["executing", "executing", "allocated_idle", "unallocated", "down"])
            held = state in ("executing", "allocated_idle")
            util = None if state != "executing" or rnd.random() < 0.2 else rnd.choice([0.0, rnd.uniform(0, 100)])
            for m in range(minute, minute + length, 60):  # cut at most every hour, as segments are
                end = min(m + 60, minute + length)
                gap = MIN * rnd.choice([0, 0, 0, 1]) if state == "down" else 0  # down records apart now and then
                out.append({"gpu": gpu, "node": node, "model": model, "start": T0 + m * MIN + gap,
                            "end": T0 + end * MIN, "state": state, "queue": rnd.choice(["q1", "q2"]) if held else "",
                            "util": util, "id": f"{gpu}/{m}"})
            minute += length
    return out


def insert(client, records: list[dict], database: str = DB) -> None:
    rows = [[1, r["id"], "c", r["node"], r["gpu"], r["model"], r["start"], r["end"], r["state"],
             f"job-{r['queue']}" if r["queue"] else "", 0, "t" if r["queue"] else "", r["queue"], 1000, r["end"] - r["start"],
             r["util"], 0.0, 1.0, "v", r["end"] - r["start"], 0, "d", "usage", 0, i] for i, r in enumerate(records)]
    client.insert("usage_raw", rows, column_names=COLS, database=database)


@pytest.fixture(scope="module")
def client():
    c = warehouse_before("0030", DB, prefix="periodic-agg-")  # a warehouse from before usage_gpu_daily
    records = random_records(13)
    insert(c, records[: len(records) // 2])
    assert "0030" in migrate(c, DB)  # back-fills from the rows above
    insert(c, records[len(records) // 2:])  # through the materialized view
    insert(c, [next(r for r in records if r["state"] == "down")])  # one down record delivered twice
    sightings = sorted({(r["gpu"], r["node"], r["model"]) for r in records})
    c.insert("gpu_sightings", [[g, "c", n, m, "", "", "", T0, T0 + 3 * 86_400_000, 1] for g, n, m in sightings],
             column_names=["gpu_uuid", "cluster", "node", "gpu_model", "serial", "board_part_number", "vbios_version",
                           "first_seen_ms", "last_seen_ms", "reports"], database=DB)
    yield c, records


def test_inventory_and_weekly_down_from_the_daily_aggregate(client):
    c, records = client
    last = DAY0 + dt.timedelta(days=2)
    inv = pr.build_report(c, DB, "inventory", days=2, as_of=last)  # the last two of the three days
    start_ms = T0 + 86_400_000
    period = [r for r in records if start_ms <= r["start"] < start_ms + 2 * 86_400_000]
    per_gpu = defaultdict(lambda: {"w": 0.0, "up": 0, "queues": set()})
    for r in period:
        g, ms = per_gpu[r["gpu"]], r["end"] - r["start"]
        if r["state"] != "down":
            g["up"] += ms
        if r["state"] == "executing" and r["util"] is not None:
            g["w"] += r["util"] * ms
        if r["queue"]:
            g["queues"].add(r["queue"])
    low = {gpu: g["w"] / g["up"] for gpu, g in per_gpu.items() if g["up"] > 0 and g["w"] / g["up"] < 20}
    rows = inv.section("Cards under 20% utilization").rows
    assert {r["gpu_uuid"]: r["util_pct"] for r in rows} == pytest.approx(low)
    assert {r["gpu_uuid"]: r["queues"] for r in rows} == {g: " ".join(sorted(per_gpu[g]["queues"])) for g in low}
    held = defaultdict(int)
    for r in period:
        if r["gpu"] in low and r["queue"]:
            held[r["queue"]] += r["end"] - r["start"]
    queues = inv.section("Queues holding the cards under 20%").rows
    assert {q["queue"]: q["held_gpu_hours"] for q in queues} == pytest.approx({q: ms / 3.6e6 for q, ms in held.items()})
    capacity = defaultdict(int)
    for r in period:
        capacity[r["model"]] += r["end"] - r["start"]
    models = inv.section("Cards per GPU model and their utilization").rows
    assert {m["gpu_model"]: m["capacity_gpu_hours"] for m in models} == pytest.approx(
        {m: ms / 3.6e6 for m, ms in capacity.items()})

    week = pr.build_report(c, DB, "weekly", as_of=last)
    down = defaultdict(int)
    for r in records:
        if r["state"] == "down" and r["start"] < start_ms + 2 * 86_400_000:  # the week ends on `last`
            down[r["gpu"]] += r["end"] - r["start"]
    dup = next(r for r in records if r["state"] == "down")
    down[dup["gpu"]] += dup["end"] - dup["start"]  # the weekly report sums what was delivered, as before
    rows = [a for a in week.section("Anomalies").rows if a["kind"] == "GPU down"]
    assert {a["subject"].split()[-1]: a["gpu_hours"] for a in rows} == pytest.approx(
        {g: ms / 3.6e6 for g, ms in down.items()})


def test_fleet_down_episodes_counted_in_the_engine(client):
    c, records = client
    spans = defaultdict(list)
    for r in records:
        if r["state"] == "down":
            spans[r["gpu"]].append((r["start"], r["end"]))
    fleet = {g["gpu_uuid"]: g["down_episodes"] for g in cards.fleet_rows(c, DB)}
    expected = {g: cards.down_episodes(spans.get(g, ())) for g in fleet}
    assert fleet == expected
    assert sum(expected.values()) > len(expected)  # episodes apart and episodes of several records both occur


def test_stragglers_equal_the_window_query_over_job_gpu_balance(client):
    c, _ = client
    old = """
        SELECT cluster, job_id, attempt, gpu, util_pct, median_pct FROM (
            SELECT toString(cluster) AS cluster, job_id, attempt, gpu, mean_util_pct AS util_pct,
                   median(mean_util_pct) OVER (PARTITION BY cluster, job_id, attempt) AS median_pct,
                   count() OVER (PARTITION BY cluster, job_id, attempt) AS gpus
            FROM {db}.job_gpu_balance WHERE util_gpu_ms > 0 {cond})
        WHERE gpus > 1 AND util_pct < median_pct * 0.8 ORDER BY job_id, cluster, attempt, util_pct"""
    day = DAY0 + dt.timedelta(days=1)
    in_day = (" AND toDate(fromUnixTimestamp64Milli(last_end_ms, 'UTC')) >= '2026-11-02'"
              " AND toDate(fromUnixTimestamp64Milli(first_start_ms, 'UTC')) <= '2026-11-02'")
    for kwargs, cond in (({}, ""), ({"start": day, "end": day}, in_day), ({"job_id": "job-q1"}, " AND job_id = 'job-q1'")):
        expected = list(c.query(old.format(db=DB, cond=cond)).named_results())
        assert expected, kwargs  # the random attempts (one per queue) have GPUs under 0.8 x their median
        assert pr_queries.stragglers(c, DB, **kwargs) == expected


@pytest.mark.parametrize("first,last", [(0, 2), (0, 6), (1, 1), (1, 2), (0, 0), (2, 9), (-3, 0), (4, 6), (-5, -1)])
def test_coverage_equals_the_span_of_the_periods_records(client, first, last):
    """The period's first start and last end (the first from its first hour's records, the last from
    gpu_latest when no usage follows the period) equal the span of the records whose day is in the period."""
    c, records = client
    start, end = DAY0 + dt.timedelta(days=first), DAY0 + dt.timedelta(days=last)
    inside = [r for r in records if start <= dt.datetime.fromtimestamp(r["start"] / 1000, dt.timezone.utc).date() <= end]
    got = pr_queries.coverage(c, DB, start, end)
    assert got.days == last - first + 1
    if inside:
        assert (got.first_ms, got.last_ms) == (min(r["start"] for r in inside), max(r["end"] for r in inside))
    else:
        assert (got.first_ms, got.last_ms) == (None, None)


def test_coverage_first_start_inside_its_hour(client):
    """A first record starting well into its hour, another GPU's in the same hour, a record ending past
    midnight: the exact first start and last end (a database of its own in the module's engine)."""
    def rec(gpu, start_s, end_s):
        return {"gpu": gpu, "node": "n1", "model": "T4", "start": T0 + start_s * 1000, "end": T0 + end_s * 1000,
                "state": "unallocated", "queue": "", "util": None, "id": f"{gpu}/{start_s}"}

    records = [rec("g1", 37 * 60 + 12, 40 * 60), rec("g2", 59 * 60 + 59, 61 * 60), rec("g1", 5 * 3600, 6 * 3600),
               rec("g2", 86_400 - 30, 86_400 + 90), rec("g1", 86_400 + 7 * 3600 + 5, 86_400 + 7 * 3600 + 65)]
    c, db = client[0], "periodic_cov"
    migrate(c, db)
    insert(c, records, db)
    for (first, last), expected in (((0, 0), (37 * 60 + 12, 86_400 + 90)),
                                    ((0, 1), (37 * 60 + 12, 86_400 + 7 * 3600 + 65)),
                                    ((1, 3), (86_400 + 7 * 3600 + 5, 86_400 + 7 * 3600 + 65))):
        got = pr_queries.coverage(c, db, DAY0 + dt.timedelta(days=first), DAY0 + dt.timedelta(days=last))
        assert (got.first_ms, got.last_ms) == (T0 + expected[0] * 1000, T0 + expected[1] * 1000), (first, last)
