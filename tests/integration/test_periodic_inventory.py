"""Inventory on a small chDB filled by hand: a card that executed with no utilization sample (SM
activity not reported, e.g. MIG or vGPU) is listed as unknown, not as a card at 0 %, and neither it
nor its queue counts under the threshold; a card really at 5 % still does. A node is (cluster, node):
two clusters' node001 are two nodes, and each listed card names its cluster."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.schemas.models import UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, usage_rows
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "periodic_inventory"
T0 = int(dt.datetime(2026, 11, 2, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000


def rec(gpu, model, util, job, queue, m0=0, m1=600, cluster="c", node="n1"):
    g = (m1 - m0) * MIN
    return UsageRecord(record_id=f"{gpu}/{m0}", cluster=cluster, node=node, gpu_uuid=gpu, gpu_model=model,
                       start_ms=T0 + m0 * MIN, end_ms=T0 + m1 * MIN, state="executing", job_id=job, attempt=0,
                       tenant="t1", queue=queue, share_milli=1000, gpu_ms=g, util_pct=util, util_metric_pct=util,
                       energy_j=0.0, coefficient=1.0, coefficient_version="v1", effective_gpu_ms=g,
                       cost_micros=g // 1000, definition_version="d1")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('inventory') / 'chdb'}", database=DB))
    try:
        warehouse.migrate(c, DB)
        records = [rec("gpu-nosample", "H100", None, "j1", "q-mig"), rec("gpu-busy", "A100", 95.0, "j2", "q1"),
                   rec("gpu-lazy", "A100", 5.0, "j3", "q1")]
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n", records=records), Source("u", 0, 0)),
                              database=DB)
        yield c
    finally:
        c.close()  # one chDB directory per process


def test_cards_with_no_utilization_sample_are_unknown(client):
    r = pr.build_report(client, DB, "inventory", days=7)
    models = {c["gpu_model"]: c["hardware_utilization"] for c in r.section("Cards per GPU model and their utilization").rows}
    assert models["H100"] is None  # the model's hardware layer says unknown too
    assert [(c["gpu_uuid"], c["util_pct"]) for c in r.section("Cards under 20% utilization").rows] == [("gpu-lazy", 5.0)]
    assert r.summary["cards_under_threshold"] == 1 and r.summary["cards_without_utilization_sample"] == 1
    unknown = r.section("Cards with no utilization sample").rows
    assert [(c["gpu_uuid"], c["util_pct"], c["queues"]) for c in unknown] == [("gpu-nosample", None, "q-mig")]
    assert [q["queue"] for q in r.section("Queues holding the cards under 20%").rows] == ["q1"]
    assert "Cards with no utilization sample" in pr.render_report(r, "markdown")


def test_two_clusters_node001_are_two_nodes_and_cards_name_their_cluster(client):
    db = "periodic_inventory_clusters"  # its own database: the other test's figures stay as they are
    warehouse.migrate(client, db)
    records = [rec(f"gpu-{cl}-{i}", "A100", 5.0, "j1", "q1", cluster=cl, node="node001")
               for cl in ("c1", "c2") for i in (0, 1)]
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="node001", records=records),
                                                          Source("u", 0, 0)), database=db)
    r = pr.build_report(client, db, "inventory", days=7)
    # counted by node name alone, c1/node001 and c2/node001 were one node
    assert [(c["gpu_model"], c["cards"], c["nodes"]) for c in
            r.section("Cards per GPU model and their utilization").rows] == [("A100", 4, 2)]
    low = r.section("Cards under 20% utilization").rows
    assert [(c["cluster"], c["node"], c["gpu_uuid"]) for c in low] == [
        ("c1", "node001", "gpu-c1-0"), ("c1", "node001", "gpu-c1-1"),
        ("c2", "node001", "gpu-c2-0"), ("c2", "node001", "gpu-c2-1")]
    # each rendering shows the Cluster column
    assert "| Cluster | GPU UUID | Node |" in pr.render_report(r, "markdown")
    assert re.search(r"^c2 +gpu-c2-1 +node001 ", pr.render_report(r, "table"), re.M)
    assert "<th>Cluster</th><th>GPU UUID</th><th>Node</th>" in pr.render_report(r, "html")


def test_queues_are_per_cluster(client):
    """A queue is (cluster, queue), as in the reclaim suggestions: two clusters' `q1` are two rows in
    the per-queue sections, not one with both clusters' cards and GPU-hours added up."""
    from gpuledger.schemas.models import JobEvent
    from gpuledger.sink.rows import job_event_row

    db = "periodic_inventory_queues"
    warehouse.migrate(client, db)
    # c1's q1: two cards at 5 % for 10 h; c2's q1: one card at 5 % for 10 h
    records = [rec(f"gpu-{cl}-{i}", "A100", 5.0, f"j-{cl}", "q1", cluster=cl, node="node001")
               for cl, n in (("c1", 2), ("c2", 1)) for i in range(n)]
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="node001", records=records),
                                                          Source("u", 0, 0)), database=db)
    events = [JobEvent(event_id=f"{cl}-{kind}", ts_ms=T0 + minute * MIN, kind=kind, cluster=cl, job_id=f"j-{cl}",
                       attempt=0, tenant="t1", queue="q1", priority=0, requested_gpus=float(n),
                       gpus=[{"node": "node001", "gpu_uuid": f"gpu-{cl}-{i}", "share_milli": 1000} for i in range(n)])
              for cl, n in (("c1", 2), ("c2", 1))
              for kind, minute in (("submitted", 0), ("allocated", 0), ("started", 0), ("completed", 600))]
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(events)],
                          database=db)
    r = pr.build_report(client, db, "inventory", days=7)
    assert [(q["cluster"], q["queue"], q["low_util_cards"], q["held_gpu_hours"])
            for q in r.section("Queues holding the cards under 20%").rows] == [("c1", "q1", 2, 20.0), ("c2", "q1", 1, 10.0)]
    assert [(q["cluster"], q["queue"], q["attempts"], q["executed_gpu_hours"])
            for q in r.section("Requested vs used GPU-hours per queue").rows] == [("c1", "q1", 1, 20.0), ("c2", "q1", 1, 10.0)]
