"""The Superset bundle's GPU-card and carbon charts (superset/build_bundle.py -> superset/bundle/): each
chart's dataset is in the bundle with the columns the chart reads, and the operations dashboard's GPU
filter reaches the card charts, which is how a GPU links to its card there (docs/gpu-cards.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

BUNDLE = Path(__file__).resolve().parents[2] / "superset" / "bundle"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def datasets() -> dict[str, dict]:
    return {d["uuid"]: d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml"))}


@pytest.mark.parametrize("chart, dataset", [
    ("operations__gpu_cards", "gpu_cards"),
    ("operations__gpu_card_monthly", "gpu_card_monthly"),
    ("cockpit__tenant_carbon", "tenant_daily_carbon"),
])
def test_chart_reads_columns_and_metrics_its_dataset_has(datasets, chart, dataset):
    c = load(BUNDLE / "charts" / f"{chart}.yaml")
    ds = datasets[c["dataset_uuid"]]
    assert ds["table_name"] == dataset
    columns = {col["column_name"] for col in ds["columns"]}
    metrics = {m["metric_name"] for m in ds["metrics"]}
    params = c["params"]
    used_columns = set(params.get("all_columns") or []) | set(params.get("groupby") or [])
    used_columns |= {params["x_axis"]} if params.get("x_axis") else set()
    used_metrics = set(params.get("metrics") or [])
    assert used_columns <= columns, used_columns - columns
    assert used_metrics <= metrics, used_metrics - metrics
    assert "gpu_uuid" in columns or dataset == "tenant_daily_carbon"


def test_the_gpu_filter_of_operations_picks_the_card():
    dash = load(BUNDLE / "dashboards" / "operations.yaml")
    ids = {v["meta"]["sliceName"]: v["meta"]["chartId"] for v in dash["position"].values()
           if isinstance(v, dict) and v.get("type") == "CHART"}
    card_ids = {i for name, i in ids.items() if name.startswith("GPU ID card")}
    assert len(card_ids) == 2
    (gpu_filter,) = [f for f in dash["metadata"]["native_filter_configuration"]
                     if f["targets"][0]["column"]["name"] == "gpu_uuid"]
    assert card_ids <= set(gpu_filter["chartsInScope"])
    assert not card_ids & set(gpu_filter["scope"]["excluded"])
