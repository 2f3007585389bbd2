"""Money, rankings and GPUs on the dashboards (superset/build_bundle.py -> superset/bundle/), each chart's SQL
as Superset sends it (bench/queries.py chart_sql on the bundle's files) under its dashboard's native filters
at their defaults, on a real chDB warehouse. 1 GPU-hour costs 3,600 micros (0.0036).

* Money of two currencies is never added: job j ran an hour under each of definitions d1 and d1b (USD)
  and d2 (EUR). The algorithm view's cost charts (job list, cost by attempt and GPU model, cost by bill
  line) read job_cost_by_attempt, which added all three into one 0.0108 labelled "Cost (USD)"; under the
  view's Currency filter (one currency, the ledger's unless picked, as the cockpit's) they show 0.0072
  USD, or 0.0036 EUR.
* The costliest jobs are whole jobs of one currency: job_cost has a row per definition version, and the
  cockpit's Top-10 ranked those rows. Job j cost 0.0036 under d1 and 0.0036 under d1b (both USD), ten
  jobs k0..k9 0.0042..0.0047 each: the rows ranked k9..k0 and left j out; the whole j (0.0072) is first.
  Its 0.0036 under d2 (EUR) is a row of its own, never added to the USD.
* A GPU is (cluster, node, GPU): the job-GPU charts grouped by the `gpu` label (node/8 characters of the
  UUID) alone, so job j's GPUs in c1 and c2 on node n1 reported as GPU-unreadable-0 (the old agents'
  placeholder, the same on every node: docs/gpu-cards.md) were one bar at 50 % (90 % and 10 %) and 2
  executing GPU-hours; split by cluster they are two bars, 90 % and 10 %, 1 GPU-hour each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.queries import BUNDLE, DATABASE, chart_sql
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration  # the real engine (chDB)

H = 3_600_000
MIN = 60_000
T0 = 1_709_251_200_000  # 2024-03-01 00:00 UTC


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def datasets() -> dict[str, dict]:
    return {d["uuid"]: d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml"))}


def default_filters(dash_key: str, chart: dict, ds: dict, picked: dict[str, list[str]] | None = None) -> str:
    """The WHERE the dashboard's native filters put on `chart` at their defaults (Superset's extraFormData),
    `picked` replacing a filter's values (by column); a calculated column by its expression."""
    dash = load(BUNDLE / "dashboards" / f"{dash_key}.yaml")
    (chart_id,) = [n["meta"]["chartId"] for n in dash["position"].values()
                   if isinstance(n, dict) and n.get("type") == "CHART" and n["meta"]["uuid"] == chart["uuid"]]
    columns = {c["column_name"]: c for c in ds["columns"]}
    conds = []
    for flt in dash["metadata"]["native_filter_configuration"]:
        if chart_id not in flt["chartsInScope"]:
            continue
        for f in flt["defaultDataMask"]["extraFormData"].get("filters", []):
            assert f["op"] == "IN"
            values = (picked or {}).get(f["col"], f["val"])
            conds.append(f"{columns[f['col']]['expression'] or f['col']} IN ({', '.join(map(repr, values))})")
    return " AND ".join(conds) or "1"


def chart_rows(client, stem: str, picked: dict[str, list[str]] | None = None, row_limit: int | None = None,
               where: str = "1") -> list[dict]:
    """The chart's rows as its dashboard opens (filters at their defaults, or `picked`), and `where`."""
    chart = load(BUNDLE / "charts" / f"{stem}.yaml")
    if row_limit:
        chart["params"]["row_limit"] = row_limit
    ds = datasets()[chart["dataset_uuid"]]
    table = f"{DATABASE}.{ds['table_name']}"
    sql = chart_sql(chart, ds).replace(f"FROM {table}",
                                       f"FROM {table} WHERE {where} AND {default_filters(stem.split('__')[0], chart, ds, picked)}", 1)
    return list(client.query(sql).named_results())


def record(cluster: str, gpu: str, start: int, minutes: int, job: str, version: str, util: float | None = None):
    rec = usage_record(cluster, gpu, start, start + minutes * MIN, "executing", job=job, tenant="t1")
    return rec.model_copy(update={"record_id": f"{cluster}/{gpu}/{start}/0", "definition_version": version,
                                  "util_pct": util, "util_metric_pct": util})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("currency-ranks"), DATABASE) as (c, _):
        c.insert("definitions", [[v, f"f-{v}", json.dumps({"currency": cur})]
                                 for v, cur in (("d1", "USD"), ("d1b", "USD"), ("d2", "EUR"))],
                 column_names=["definition_version", "fingerprint", "content"], database=DATABASE)
        put_usage(c, DATABASE, [
            # job j: an hour under each of d1 (USD), d1b (USD) and d2 (EUR), on one GPU of c1
            record("c1", "GPU-j", T0, 60, "j", "d1"), record("c1", "GPU-j", T0 + H, 60, "j", "d1b"),
            record("c1", "GPU-j", T0 + 2 * H, 60, "j", "d2"),
            # jobs k0..k9: 70..79 minutes under d1, each costlier than one of j's parts, cheaper than j
            *(record("c1", f"GPU-k{i}", T0, 70 + i, f"k{i}", "d1") for i in range(10)),
            # job g: one hour in each cluster on n1's GPU-unreadable-0, at 90 % in c1 and 10 % in c2
            record("c1", "GPU-unreadable-0", T0, 60, "g", "d1", util=90.0),
            record("c2", "GPU-unreadable-0", T0, 60, "g", "d1", util=10.0),
        ], 0)
        yield c


# --------------------------------------------------------------------------- 1. no two currencies in one total
ALGORITHM_MONEY = ("algorithm__job_list", "algorithm__job_cost_by_model_attempt", "algorithm__job_cost_by_line")


@pytest.mark.parametrize("stem", ALGORITHM_MONEY)
def test_the_algorithm_views_cost_is_one_currency(client, stem):
    chart = load(BUNDLE / "charts" / f"{stem}.yaml")
    assert "cost_sum" in (chart["params"].get("metrics") or [chart["params"].get("metric")])
    job_j = "job_id = 'j'"  # the Job filter picking j
    # as the dashboard opens: the ledger's currency (USD) only, j's d1 and d1b hours, not 0.0108 of both currencies
    opened = chart_rows(client, stem, where=job_j)
    assert sum(r["cost_sum"] for r in opened) == pytest.approx(0.0072)
    assert {r.get("currency", "USD") for r in opened} == {"USD"}
    eur = chart_rows(client, stem, {"currency": ["EUR"]}, where=job_j)
    assert sum(r["cost_sum"] for r in eur) == pytest.approx(0.0036)
    # no fixed symbol on money that may be another currency
    params = chart["params"]
    assert not params.get("currency_format") and "USD" not in str(params.get("y_axis_title", ""))


def test_the_algorithm_views_currency_filter_holds_one_currency_and_reaches_its_money():
    dash = load(BUNDLE / "dashboards" / "algorithm.yaml")
    (flt,) = [f for f in dash["metadata"]["native_filter_configuration"] if f["name"] == "Currency"]
    assert flt["controlValues"]["enableEmptyFilter"] and not flt["controlValues"]["multiSelect"]
    ids = {n["meta"]["uuid"]: n["meta"]["chartId"] for n in dash["position"].values()
           if isinstance(n, dict) and n.get("type") == "CHART"}
    for stem in ALGORITHM_MONEY:
        assert ids[load(BUNDLE / "charts" / f"{stem}.yaml")["uuid"]] in flt["chartsInScope"], stem
    ds = {d["table_name"]: d for d in datasets().values()}["job_cost_by_attempt"]
    assert all(m["currency"] is None and "USD" not in m["verbose_name"] for m in ds["metrics"])


# --------------------------------------------------------------------------- 2. the costliest whole jobs
def test_the_top_costly_jobs_are_whole_jobs_of_one_currency(client):
    top = chart_rows(client, "cockpit__top_costly_jobs")
    ranked = [(r["job_id"], r["cost_sum"]) for r in top]
    assert ranked == [("j", pytest.approx(0.0072)), *((f"k{i}", pytest.approx((70 + i) * 60e-6)) for i in range(9, 0, -1))]
    (j,) = [r for r in top if r["job_id"] == "j"]
    assert (j["cluster"], j["currency"], j["job_attempts"], j["job_gpu_hours"]) == ("c1", "USD", 1, pytest.approx(2.0))
    # whatever the filter picks, a job's money of two currencies is two rows
    every = chart_rows(client, "cockpit__top_costly_jobs", {"currency": ["USD", "EUR"]}, row_limit=100)
    assert sorted((r["currency"], r["cost_sum"]) for r in every if r["job_id"] == "j") == [
        ("EUR", pytest.approx(0.0036)), ("USD", pytest.approx(0.0072))]


# --------------------------------------------------------------------------- 3. a GPU is (cluster, node, GPU)
def test_the_job_gpu_charts_keep_two_clusters_gpus_apart(client):
    balance = chart_rows(client, "algorithm__job_gpu_balance")
    gpu_time = chart_rows(client, "algorithm__job_gpu_time")
    label = "n1/unreadab"  # the view's label: node / 8 characters of the UUID
    assert {(r["gpu"], r.get("cluster")): r["util_pct"] for r in balance if r["gpu"] == label} == {
        (label, "c1"): pytest.approx(90.0), (label, "c2"): pytest.approx(10.0)}
    assert {(r["gpu"], r.get("cluster")): r["executing_hours"] for r in gpu_time if r["gpu"] == label} == {
        (label, "c1"): pytest.approx(1.0), (label, "c2"): pytest.approx(1.0)}
    # side by side: a stack would pile the two clusters' bars of one label into one
    assert not load(BUNDLE / "charts" / "algorithm__job_gpu_time.yaml")["params"]["stack"]
