"""A node is (cluster, node) on the operations dashboard (superset/build_bundle.py -> superset/bundle/): two
clusters may both have a node001. Each chart's SQL as Superset sends it (bench/queries.py chart_sql on the
bundle's files) runs on a chDB warehouse where c1/node001 runs at 90 % and 85 °C and c2/node001 at 10 % and
40 °C: the load and temperature series are one per cluster and node (by node alone they were one series at
50 % and 85 °C), the GPU tables name each GPU's cluster, and a Cluster filter reaches them. Likewise a job
is (cluster, job id): job "j" ran in both clusters, and the algorithm dashboard and the cockpit's costliest
jobs show two jobs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from bench.queries import BUNDLE, DATABASE, chart_sql
from gpuledger import warehouse
from gpuledger.schemas.models import GpuSample, NodeTick, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, sample_rows, usage_rows

from warehouse_helpers import migrated_warehouse

pytestmark = pytest.mark.integration  # the real engine (chDB)

M5 = 300_000
T0 = (int(time.time() * 1000) // 3_600_000 - 24) * 3_600_000  # a day ago, on the hour: inside every retention
#: cluster -> (its node001's GPU, utilization %, temperature °C)
FLEET = {"c1": ("GPU-c1-0", 90.0, 85.0), "c2": ("GPU-c2-0", 10.0, 40.0)}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def sql_of(stem: str) -> str:
    chart = load(BUNDLE / "charts" / f"{stem}.yaml")
    (dataset,) = [d for d in map(load, (BUNDLE / "datasets").rglob("*.yaml")) if d["uuid"] == chart["dataset_uuid"]]
    return chart_sql(chart, dataset)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with migrated_warehouse(tmp_path_factory.mktemp("operations-nodes"), DATABASE) as (c, _):
        for offset, (cluster, (gpu, util, temp)) in enumerate(FLEET.items()):
            record = UsageRecord(
                record_id=f"{gpu}/{T0}/0", cluster=cluster, node="node001", gpu_uuid=gpu, gpu_model="A100",
                start_ms=T0, end_ms=T0 + M5, state="executing", job_id="j", tenant="t", queue="q", share_milli=1000,
                gpu_ms=M5, util_pct=util, util_metric_pct=util, energy_j=0.0, coefficient=1.0, coefficient_version="v1",
                effective_gpu_ms=M5, cost_micros=M5 // 1000, definition_version="d1")
            warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="node001", records=[record]),
                                                             Source("u", 0, offset)), database=DATABASE)
            tick = NodeTick(cluster=cluster, node="node001", ts_ms=T0, interval_ms=60_000,
                            gpus=[GpuSample(gpu_uuid=gpu, index=0, model="A100", temperature_c=temp)])
            for table, rows in sample_rows(tick.model_dump_json().encode(), Source("s", 0, offset)).items():
                warehouse.insert_rows(c, table, rows, database=DATABASE)
        yield c


def rows(client, stem: str) -> list[dict]:
    return list(client.query(sql_of(stem)).named_results())


def test_load_and_temperature_series_are_one_per_cluster_and_node(client):
    load_rows = rows(client, "operations__gpu_load_by_node")
    assert {(r.get("cluster"), r["node"]): r["hardware_util_pct"] for r in load_rows} == {
        ("c1", "node001"): pytest.approx(90.0), ("c2", "node001"): pytest.approx(10.0)}
    temperature = rows(client, "operations__gpu_temperature")
    assert {(r.get("cluster"), r["node"]): r["max_temperature"] for r in temperature} == {
        ("c1", "node001"): pytest.approx(85.0), ("c2", "node001"): pytest.approx(40.0)}


def test_the_gpu_tables_name_each_gpus_cluster(client):
    assert sorted((r.get("cluster") or "", r["node"], r["gpu_uuid"]) for r in rows(client, "operations__gpus_now")) == [
        ("c1", "node001", "GPU-c1-0"), ("c2", "node001", "GPU-c2-0")]
    health = rows(client, "operations__gpu_health_record")
    assert sorted((r.get("cluster") or "", r["node"], r["max_temperature"]) for r in health) == [
        ("c1", "node001", pytest.approx(85.0)), ("c2", "node001", pytest.approx(40.0))]


def test_a_cluster_filter_reaches_the_node_charts_and_the_node_filter_follows_it():
    dash = load(BUNDLE / "dashboards" / "operations.yaml")
    ids = {v["meta"]["sliceName"]: v["meta"]["chartId"] for v in dash["position"].values()
           if isinstance(v, dict) and v.get("type") == "CHART"}
    filters = {f["name"]: f for f in dash["metadata"]["native_filter_configuration"]}
    assert "Cluster" in filters, sorted(filters)
    cluster = filters["Cluster"]
    assert cluster["targets"][0]["column"]["name"] == "cluster"
    node_charts = {ids[load(BUNDLE / "charts" / f"{stem}.yaml")["slice_name"]] for stem in (
        "operations__gpus_now", "operations__gpu_load_by_node", "operations__gpu_health_record",
        "operations__gpu_temperature")}
    assert node_charts <= set(cluster["chartsInScope"]) and not node_charts & set(cluster["scope"]["excluded"])
    assert filters["Node"]["cascadeParentIds"] == [cluster["id"]]


# --------------------------------------------------------------------------- a job is (cluster, job id)
def test_a_job_id_in_two_clusters_is_two_jobs_on_the_algorithm_dashboard(client):
    """Job "j" of tenant t ran 5 minutes in c1 and 5 in c2 (Slurm numbers jobs per cluster): the job list
    shows two jobs, each 0.0003 (by tenant and job id alone it was one job at 0.0006), and a Cluster
    filter reaches every chart, the Job filter listing the jobs of the clusters it picks (as the reports:
    an id in two clusters is two jobs)."""
    jobs = rows(client, "algorithm__job_list")
    assert sorted((r.get("cluster") or "", r["job_id"], r["cost_sum"]) for r in jobs) == [
        ("c1", "j", pytest.approx(0.0003)), ("c2", "j", pytest.approx(0.0003))]
    dash = load(BUNDLE / "dashboards" / "algorithm.yaml")
    charts = [v["meta"]["chartId"] for v in dash["position"].values() if isinstance(v, dict) and v.get("type") == "CHART"]
    filters = {f["name"]: f for f in dash["metadata"]["native_filter_configuration"]}
    assert "Cluster" in filters, sorted(filters)
    cluster = filters["Cluster"]
    assert sorted(cluster["chartsInScope"]) == sorted(charts) and not cluster["scope"]["excluded"]
    assert filters["Job"]["cascadeParentIds"] == [cluster["id"]]


def test_the_costliest_jobs_say_which_cluster_each_ran_in(client):
    top = rows(client, "cockpit__top_costly_jobs")
    assert sorted((r.get("cluster") or "", r["job_id"]) for r in top) == [("c1", "j"), ("c2", "j")]
