"""Each GPU its own bar, and money of each row's currency, on the dashboards (superset/build_bundle.py ->
superset/bundle/): each chart's SQL as Superset sends it (bench/queries.py chart_sql on the bundle's files)
under its dashboard's native filters at their defaults, on a real chDB warehouse. 1 GPU-hour costs 3,600
micros (0.0036); definition d1 is priced in USD, d2 in EUR.

* GPU labels (sql/0050): the algorithm dashboard's per-GPU charts group by `gpu`, which was node + '/' + 8
  characters of the UUID. Job g ran an hour on each of c1/n1's GPU-unreadable-0 (90 %) and
  GPU-unreadable-1 (10 %), the old agents' placeholders: one bar "n1/unreadab" at 50 % and 2 executing
  GPU-hours. Now two bars, 90 % and 10 %, 1 GPU-hour each, labelled by the whole UUID; a GPU whose short
  label no other GPU of its node shares keeps it (job s's GPU-5f2c1a9b-...: "n1/5f2c1a9b").
* Money of datasets whose rows span definition versions: an hour of job w's idle time and an hour of
  unallocated time under each of d1 and d2 on c2, and two reclaim suggestions, 1.5 USD and 2.5 EUR. The
  idle cost, unallocated cost and named idle cost metrics were labelled "(USD)" with a USD symbol whatever
  the rows' currencies, and idle_waste_daily added both versions into one row (0.0072). Each now groups by
  a `currency` column (0.0036 USD and 0.0036 EUR; 1.5 USD and 2.5 EUR) and carries no fixed symbol. The
  cockpit's Currency filter still leaves the GPU-hour charts of those datasets alone: they count both hours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.queries import BUNDLE, DATABASE, chart_sql
from gpuledger.warehouse.periodic import commands as pr
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration  # the real engine (chDB)

H = 3_600_000
T0 = 1_709_251_200_000  # 2024-03-01 00:00 UTC
NVIDIA = "GPU-5f2c1a9b-7d3e-4a51-9c2b-1e8f0a6d4c3b"


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def datasets() -> dict[str, dict]:
    return {d["table_name"]: d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml"))}


def chart_rows(client, stem: str, where: str = "1") -> list[dict]:
    """The chart's rows as its dashboard opens (native filters at their defaults) and `where`."""
    chart = load(BUNDLE / "charts" / f"{stem}.yaml")
    (ds,) = [d for d in datasets().values() if d["uuid"] == chart["dataset_uuid"]]
    dash = load(BUNDLE / "dashboards" / f"{stem.split('__')[0]}.yaml")
    (chart_id,) = [n["meta"]["chartId"] for n in dash["position"].values()
                   if isinstance(n, dict) and n.get("type") == "CHART" and n["meta"]["uuid"] == chart["uuid"]]
    expression = {c["column_name"]: c["expression"] or c["column_name"] for c in ds["columns"]}
    conds = [where] + [f"{expression[f['col']]} IN ({', '.join(map(repr, f['val']))})"
                       for flt in dash["metadata"]["native_filter_configuration"] if chart_id in flt["chartsInScope"]
                       for f in flt["defaultDataMask"]["extraFormData"].get("filters", [])]
    table = f"{DATABASE}.{ds['table_name']}"
    sql = chart_sql(chart, ds).replace(f"FROM {table}", f"FROM {table} WHERE {' AND '.join(conds)}", 1)
    return list(client.query(sql).named_results())


def record(cluster: str, gpu: str, hour: int, state: str, version: str, job: str = "", util: float | None = None):
    rec = usage_record(cluster, gpu, T0 + hour * H, T0 + (hour + 1) * H, state, job=job, tenant="t1" if job else "")
    return rec.model_copy(update={"record_id": f"{cluster}/{gpu}/{hour}", "definition_version": version,
                                  "util_pct": util, "util_metric_pct": util})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("gpu-labels"), DATABASE) as (c, _):
        c.insert("definitions", [[v, f"f-{v}", json.dumps({"currency": cur})] for v, cur in (("d1", "USD"), ("d2", "EUR"))],
                 column_names=["definition_version", "fingerprint", "content"], database=DATABASE)
        put_usage(c, DATABASE, [
            record("c1", "GPU-unreadable-0", 0, "executing", "d1", job="g", util=90.0),
            record("c1", "GPU-unreadable-1", 0, "executing", "d1", job="g", util=10.0),
            record("c1", NVIDIA, 0, "executing", "d1", job="s", util=70.0),
            # c2: job w idle an hour under each definition; a GPU unallocated an hour under each
            record("c2", "GPU-w", 0, "allocated_idle", "d1", job="w"),
            record("c2", "GPU-w", 1, "allocated_idle", "d2", job="w"),
            record("c2", "GPU-free", 0, "unallocated", "d1"), record("c2", "GPU-free", 1, "unallocated", "d2"),
        ], 0)
        c.insert("reclaim_suggestions", [[f"s-{cur}", "r1/reclaim.v1", "c2", "q", "open", T0, micros, cur, "m"]
                                         for cur, micros in (("USD", 1_500_000), ("EUR", 2_500_000))],
                 column_names=["suggestion_id", "definition_version", "cluster", "queue", "status", "opened_at_ms",
                               "idle_cost_micros", "currency", "message"], database=DATABASE)
        yield c


# --------------------------------------------------------------------------- 1. every GPU its own bar
def test_two_gpus_of_one_node_with_one_short_label_are_two_bars(client):
    balance = chart_rows(client, "algorithm__job_gpu_balance", "job_id = 'g'")
    assert {(r.get("cluster"), r["gpu"]): r["util_pct"] for r in balance} == {
        ("c1", "n1/GPU-unreadable-0"): pytest.approx(90.0), ("c1", "n1/GPU-unreadable-1"): pytest.approx(10.0)}
    gpu_time = chart_rows(client, "algorithm__job_gpu_time", "job_id = 'g'")
    assert {(r.get("cluster"), r["gpu"]): r["executing_hours"] for r in gpu_time} == {
        ("c1", "n1/GPU-unreadable-0"): pytest.approx(1.0), ("c1", "n1/GPU-unreadable-1"): pytest.approx(1.0)}


def test_the_job_report_lists_each_gpu_by_the_same_label(client):
    report = pr.build_report(client, DATABASE, "job", job_id="g")
    assert {r["gpu"]: r["util_pct"] for r in report.section("Balance across GPUs").rows} == {
        "n1/GPU-unreadable-0": pytest.approx(90.0), "n1/GPU-unreadable-1": pytest.approx(10.0)}


def test_a_gpu_whose_short_label_is_its_own_keeps_it(client):
    (row,) = chart_rows(client, "algorithm__job_gpu_balance", "job_id = 's'")
    assert (row["gpu"], row["util_pct"]) == ("n1/5f2c1a9b", pytest.approx(70.0))
    # with no Job filter the chart groups every job's rows by label: still one bar per GPU
    labels = [(r.get("cluster"), r["gpu"]) for r in chart_rows(client, "algorithm__job_gpu_balance")]
    assert len(labels) == len(set(labels)) == 4, labels


# --------------------------------------------------------------------------- 2. money of each row's currency
MONEY = {  # dataset -> (metric, the sums per currency it must give)
    "idle_waste_daily": ("idle_cost_sum", {"USD": 0.0036, "EUR": 0.0036}),
    "capacity_daily": ("unallocated_cost_sum", {"USD": 0.0036, "EUR": 0.0036}),
    "reclaim_suggestions_latest": ("named_idle_cost", {"USD": 1.5, "EUR": 2.5}),
}


@pytest.mark.parametrize("name", sorted(MONEY))
def test_money_of_rows_spanning_currencies_says_each_rows_currency(client, name):
    metric, want = MONEY[name]
    ds = datasets()[name]
    (m,) = [x for x in ds["metrics"] if x["metric_name"] == metric]
    assert m["currency"] is None and "USD" not in m["verbose_name"], m  # no fixed symbol
    assert all("USD" not in (c["verbose_name"] or "") for c in ds["columns"])
    # as a chart grouping the metric by the dataset's currency column sends it
    chart = {"params": {"viz_type": "table", "query_mode": "aggregate", "groupby": ["currency"], "metrics": [metric]}}
    got = {r["currency"]: r[metric] for r in client.query(chart_sql(chart, ds)).named_results()}
    assert got == pytest.approx(want)


def test_the_cockpits_currency_filter_leaves_gpu_hours_of_every_currency(client):
    """idle_waste_daily and capacity_daily now have a currency column; their cockpit charts show GPU-hours,
    which the Currency filter (USD at its default) must not cut to one currency's."""
    idle = chart_rows(client, "cockpit__idle_waste_by_queue", "cluster = 'c2'")
    assert sum(r["idle_gpu_hours_sum"] for r in idle) == pytest.approx(2.0)
    unallocated = chart_rows(client, "cockpit__cluster_idle_by_model", "cluster = 'c2'")
    assert sum(r["unallocated_gpu_hours"] for r in unallocated) == pytest.approx(2.0)
