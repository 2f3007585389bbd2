"""A GPU ID card names its nodes with their cluster (sql/0046; docs/gpu-cards.md, "Dashboards"): two clusters may
both have a node001. The operations dashboard's GPU ID cards chart, its SQL as Superset sends it (bench/queries.py
chart_sql on the bundle's files), runs on chDB where GPU-moved sat in c1/node001, then c2/node001: the card gave
"2 nodes" and nothing else, so the chart could not tell which clusters. It lists both, names where the card
was last seen, agrees with the full card (`gpuledger report gpu`), and the Cluster and Node filters reach it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.queries import BUNDLE, DATABASE, chart_sql
from gpuledger.warehouse import cards

from warehouse_helpers import migrated_warehouse

pytestmark = pytest.mark.integration  # the real engine (chDB)

COLS = ["gpu_uuid", "cluster", "node", "gpu_model", "serial", "board_part_number", "vbios_version",
        "first_seen_ms", "last_seen_ms", "reports"]
H = 3_600_000
SIGHTINGS = [
    ["GPU-moved", "c1", "node001", "A100", "S1", "", "1.0", 1 * H, 2 * H, 60],
    ["GPU-moved", "c1", "node001", "A100", "S1", "", "1.1", 2 * H, 3 * H, 60],  # VBIOS updated: a second row
    ["GPU-moved", "c2", "node001", "A100", "S1", "", "1.1", 5 * H, 6 * H, 60],
    ["GPU-stays", "c1", "node001", "A100", "S2", "", "1.0", 1 * H, 6 * H, 300],
]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("gpu-cards-cluster"), DATABASE) as (c, _):
        c.insert("gpu_sightings", SIGHTINGS, column_names=COLS, database=DATABASE)
        yield c


def chart_rows(client) -> dict[str, dict]:
    chart = load(BUNDLE / "charts" / "operations__gpu_cards.yaml")
    (dataset,) = [d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml")) if d["uuid"] == chart["dataset_uuid"]]
    return {r["gpu_uuid"]: r for r in client.query(chart_sql(chart, dataset)).named_results()}


def test_the_gpu_cards_chart_names_each_node_with_its_cluster(client):
    rows = chart_rows(client)
    moved = rows["GPU-moved"]
    assert moved["nodes"] == 2  # counted per (cluster, node) already; which two was not said
    assert moved.get("placements") == "c1/node001, c2/node001", \
        f"the card must say which clusters' node001 it sat in: {moved}"
    assert (moved["cluster"], moved["node"]) == ("c2", "node001")  # where it was last seen
    stays = rows["GPU-stays"]
    assert (stays["cluster"], stays["node"], stays["nodes"], stays["placements"]) == ("c1", "node001", 1, "c1/node001")


def test_the_view_lists_what_the_full_card_lists(client):
    card = cards.build_card(client, DATABASE, "GPU-moved")
    places = ", ".join(f"{p['cluster']}/{p['node']}" for p in card.section("Where it sat").rows)
    (view,) = client.query(f"SELECT placements, nodes FROM {DATABASE}.gpu_cards WHERE gpu_uuid = 'GPU-moved'").result_rows
    assert view == (places, card.summary["nodes"])


def test_the_cluster_and_node_filters_reach_the_gpu_cards_chart():
    dash = load(BUNDLE / "dashboards" / "operations.yaml")
    ids = {v["meta"]["sliceName"]: v["meta"]["chartId"] for v in dash["position"].values()
           if isinstance(v, dict) and v.get("type") == "CHART"}
    card_chart = ids[load(BUNDLE / "charts" / "operations__gpu_cards.yaml")["slice_name"]]
    filters = {f["name"]: f for f in dash["metadata"]["native_filter_configuration"]}
    for name in ("Cluster", "Node"):
        assert card_chart in filters[name]["chartsInScope"] and card_chart not in filters[name]["scope"]["excluded"]
