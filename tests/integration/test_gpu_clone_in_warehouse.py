"""One GPU UUID reported by two nodes at once is visible in the warehouse, whatever the gpu-samples
partitioning (sql/0048; docs/reliability.md, "One GPU, one node"): the worker compares only the nodes of
one partition, so a clone on another partition said nothing. The sink's own row functions (health_rows,
inventory_row) write the ticks to chDB; the GPU ID cards chart (its SQL as Superset sends it) and
`gpuledger report inventory` must name the clone, and no GPU that moved, or two clusters' node009.

10 Nov 2026, 5-min ticks:
  GPU-clone   c1/node007 00:00-03:00; its clone c1/node012 01:00-01:30   -> flagged, hours 01:00
  GPU-xclone  c1/node001 and c2/node001 00:00-02:00 (a VM image in two clusters) -> flagged, hours 00:00-02:00
  GPU-moved   c1/node002 00:00-02:00, then c1/node003 05:00-07:00         -> not flagged
  GPU-renamed c1/old-name 09:00-10:05, then c1/new-name 10:20-11:00 (moved within an hour) -> not flagged
  GPU-back    c1/node004 00:00-01:00, c1/node005 03:00-04:00, c1/node004 06:00-07:00 -> not flagged
  GPU-a, GPU-b  c1/node009 and c2/node009 00:00-02:00 (two clusters' own GPUs)   -> not flagged
  GPU-unreadable-3  c1/node020 and c1/node021 00:00-00:30 (agents before 682a933 named an unreadable GPU by its
                    index alone)  -> flagged, saying to upgrade the agents
"""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from bench.queries import BUNDLE, DATABASE, chart_sql
from gpuledger import warehouse
from gpuledger.schemas.models import GpuSample, NodeTick
from gpuledger.sink.rows import Source, health_rows, inventory_row
from gpuledger.warehouse.periodic import commands as pr

from warehouse_helpers import migrated_warehouse

pytestmark = pytest.mark.integration  # the real engine (chDB)

D = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
STEP = 5 * 60_000


def hm(text: str) -> int:
    h, m = text.split(":")
    return D + int(h) * 3_600_000 + int(m) * 60_000


def ticks(cluster: str, node: str, gpu: str, start: str, end: str) -> list[NodeTick]:
    return [NodeTick(cluster=cluster, node=node, ts_ms=ts, interval_ms=STEP,
                     gpus=[GpuSample(gpu_uuid=gpu, index=0, model="A100-80GB", temperature_c=50, util_gpu_pct=50)])
            for ts in range(hm(start), hm(end) + 1, STEP)]


TICKS = (ticks("c1", "node007", "GPU-clone", "00:00", "03:00") + ticks("c1", "node012", "GPU-clone", "01:00", "01:30")
         + ticks("c1", "node001", "GPU-xclone", "00:00", "02:00") + ticks("c2", "node001", "GPU-xclone", "00:00", "02:00")
         + ticks("c1", "node002", "GPU-moved", "00:00", "02:00") + ticks("c1", "node003", "GPU-moved", "05:00", "07:00")
         + ticks("c1", "old-name", "GPU-renamed", "09:00", "10:05")
         + ticks("c1", "new-name", "GPU-renamed", "10:20", "11:00")
         + ticks("c1", "node004", "GPU-back", "00:00", "01:00") + ticks("c1", "node005", "GPU-back", "03:00", "04:00")
         + ticks("c1", "node004", "GPU-back", "06:00", "07:00")
         + ticks("c1", "node009", "GPU-a", "00:00", "02:00") + ticks("c2", "node009", "GPU-b", "00:00", "02:00")
         + ticks("c1", "node020", "GPU-unreadable-3", "00:00", "00:30")
         + ticks("c1", "node021", "GPU-unreadable-3", "00:00", "00:30"))

FLAGS = {
    "GPU-clone": "reported by 2 nodes at once: c1/node007, c1/node012 (cloned agent?)",
    "GPU-xclone": "reported by 2 nodes at once: c1/node001, c2/node001 (cloned agent?)",
    "GPU-unreadable-3": "reported by 2 nodes at once: c1/node020, c1/node021 "
                        "(an old agent's placeholder for an unreadable GPU: upgrade the agents)",
    **dict.fromkeys(["GPU-moved", "GPU-renamed", "GPU-back", "GPU-a", "GPU-b"], ""),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("gpu-clone"), DATABASE) as (c, _):
        for n, t in enumerate(TICKS):
            warehouse.insert_rows(c, "gpu_health", health_rows(t, Source("s", 0, n)), database=DATABASE)
            warehouse.insert_rows(c, "node_inventory", [inventory_row(t, Source("s", 0, n))], database=DATABASE)
        yield c


def load(path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_the_gpu_cards_chart_flags_a_gpu_two_nodes_report_at_once(client):
    chart = load(BUNDLE / "charts" / "operations__gpu_cards.yaml")
    (dataset,) = [d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml")) if d["uuid"] == chart["dataset_uuid"]]
    rows = {r["gpu_uuid"]: r for r in client.query(chart_sql(chart, dataset)).named_results()}
    assert {g: rows[g]["flag"] for g in FLAGS} == FLAGS
    # a move is still a move: both nodes are listed where it sat, without a flag
    assert rows["GPU-moved"]["placements"] == "c1/node002, c1/node003"
    metrics = {m["metric_name"]: m["expression"] for m in dataset["metrics"]}
    (counts,) = client.query(f"SELECT {metrics['at_once_count']}, {metrics['flagged_count']} "
                             f"FROM {DATABASE}.gpu_cards").result_rows
    assert counts == (3, 0)  # the dataset's counts: clones, and no card back from repair twice


def test_the_repair_flag_and_the_clone_flag_are_both_said(client):
    from gpuledger.warehouse import cards
    now = hm("12:00")
    for at in ("04:00", "04:30"):
        cards.record_repair(client, DATABASE, "GPU-clone", "reseated", hm(at), "alice", now_ms=now)
    (flag,) = client.query(f"SELECT flag FROM {DATABASE}.gpu_cards WHERE gpu_uuid = 'GPU-clone'").result_rows[0]
    assert flag == "suggest lower-priority work; " + FLAGS["GPU-clone"]
    # `gpuledger report gpu` says what the chart says
    assert cards.build_card(client, DATABASE, "GPU-clone").summary["flag"] == flag
    assert cards.build_card(client, DATABASE, "GPU-xclone").summary["flag"] == FLAGS["GPU-xclone"]
    assert cards.build_card(client, DATABASE, "GPU-moved").summary["flag"] == ""


def test_the_inventory_report_lists_the_gpus_two_nodes_report_at_once(client):
    r = pr.build_report(client, DATABASE, "inventory", days=7, as_of="2026-11-10")
    rows = r.section("GPUs reported by two nodes at once").rows
    hour = lambda text: dt.datetime.fromisoformat(f"2026-11-10T{text}")  # noqa: E731
    assert [(x["gpu_uuid"], x["placements"], x["hours_at_once"], x["first_hour_start"].replace(tzinfo=None),
             x["last_hour_start"].replace(tzinfo=None)) for x in rows] == [
        ("GPU-unreadable-3", "c1/node020, c1/node021", 1, hour("00:00"), hour("00:00")),
        ("GPU-xclone", "c1/node001, c2/node001", 3, hour("00:00"), hour("02:00")),
        ("GPU-clone", "c1/node007, c1/node012", 1, hour("01:00"), hour("01:00"))]
    assert r.summary["gpus_on_two_nodes_at_once"] == 3
    assert "| GPU UUID | Placements | Hours at once |" in pr.render_report(r, "markdown")
    # a period that ends before the clones reported has none
    before = pr.build_report(client, DATABASE, "inventory", days=7, as_of="2026-11-09")
    assert before.section("GPUs reported by two nodes at once").rows == []
    assert "gpus_on_two_nodes_at_once" not in before.summary
