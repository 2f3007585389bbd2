"""Approvals are per cluster (sql/0044; docs/planning.md, "Approvals"): Slurm numbers jobs per cluster, so
job `llm-1` of cluster c1 and `llm-1` of cluster c2 are two jobs. Approving c1's must not read, on the
approvals topic (a scheduler admission hook's input) or in approvals_current, as approval of c2's
640 GPU-hour run. Real broker (Tansu) and engine (chDB)."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.cli import main
from gpuledger.schemas.models import ApprovalDecision, JobProgress, UsageRecord
from gpuledger.schemas.wire import decode
from gpuledger.sink.rows import Source, progress_row
from gpuledger.topics import create_topics
from gpuledger.warehouse import estimate, migrations

from test_sink import read_topic
from warehouse_helpers import put_usage, warehouse_before

pytestmark = pytest.mark.integration

MIN = 60_000
LEDGER = Path(__file__).resolve().parents[1] / "fixtures" / "unit_ledger.toml"


def pilot(client, database: str, cluster: str, gpus: int, t0: int, offset: int) -> None:
    """Job llm-1 attempt 0 of `cluster` on `gpus` A100s for 8 minutes, 100 steps a minute."""
    put_usage(client, database, [UsageRecord(
        record_id=f"{cluster}/g{g}/{m}", cluster=cluster, node="n1", gpu_uuid=f"{cluster}-gpu-{g}",
        gpu_model="A100-80GB", start_ms=t0 + m * MIN, end_ms=t0 + (m + 1) * MIN, state="executing", job_id="llm-1",
        attempt=0, tenant="alpha", queue="train", share_milli=1000, gpu_ms=MIN, util_pct=95.0, energy_j=24_000.0,
        coefficient=2.3, coefficient_version="A100-80GB@2020-01-01", effective_gpu_ms=round(2.3 * MIN),
        cost_micros=8_000, definition_version="d") for g in range(gpus) for m in range(8)], offset)
    rows = [progress_row(JobProgress(ts_ms=t0 + (i + 1) * MIN, cluster=cluster, job_id="llm-1", attempt=0,
                                     step=i * 100), Source("t.progress", 0, offset * 100 + i)) for i in range(6)]
    warehouse.insert_rows(client, "job_progress", rows, database=database)


def test_approving_one_clusters_job_leaves_the_same_job_id_of_another_cluster_pending(settings, monkeypatch, capfd):
    create_topics(settings)
    t0 = (int(time.time()) - 3600) * 1000 // MIN * MIN
    client = warehouse.connect(settings)
    try:
        warehouse.migrate(client, settings.database)
        pilot(client, settings.database, "c1", 4, t0, 1)
        pilot(client, settings.database, "c2", 64, t0, 2)
    finally:
        client.close()
    monkeypatch.setenv("GPULEDGER_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(LEDGER))
    common = ["--data-dir", str(settings.data_dir), "--bootstrap", settings.kafka_bootstrap]
    for cluster in ("c1", "c2"):
        assert main(["estimate", "llm-1", "--cluster", cluster, "--target-steps", "60000", "--threshold", "10",
                     *common]) == 0
    capfd.readouterr()

    assert main(["approvals", "list", "--format", "csv", *common]) == 0
    listed = list(csv.DictReader(io.StringIO(capfd.readouterr().out)))
    assert sorted((r.get("cluster"), r["job_id"], r["status"]) for r in listed) == [
        ("c1", "llm-1", "pending"), ("c2", "llm-1", "pending")], "the list tells the two llm-1 apart"
    ids = {r["cluster"]: r["approval_id"] for r in listed}
    assert float(next(r for r in listed if r["cluster"] == "c2")["gpu_hours"]) == pytest.approx(640.0, rel=1e-6)

    assert main(["approvals", "approve", ids["c1"], "--by", "alice", *common]) == 0
    assert f"{ids['c1']}\tc1\tllm-1\tapproved\talice" in capfd.readouterr().out

    # what an admission hook reads: the latest message under "<cluster>/<job id>"
    latest = {}
    for m in read_topic(settings, settings.topics.approvals):
        latest[m.key()] = decode(ApprovalDecision, m.value())
    assert set(latest) == {b"c1/llm-1", b"c2/llm-1"}
    assert (latest[b"c1/llm-1"].status, latest[b"c1/llm-1"].cluster) == ("approved", "c1")
    assert (latest[b"c2/llm-1"].status, latest[b"c2/llm-1"].cluster) == ("pending", "c2"), \
        "approving c1's llm-1 must leave c2's pending on the topic"
    assert latest[b"c2/llm-1"].approval_id == ids["c2"] and latest[b"c2/llm-1"].attempt == 0

    client = warehouse.connect(settings)
    try:
        current = {r["cluster"]: r for r in client.query(
            f"SELECT * FROM {settings.database}.approvals_current").named_results()}
    finally:
        client.close()
    assert {c: (r["approval_id"], r["status"]) for c, r in current.items()} == {
        "c1": (ids["c1"], "approved"), "c2": (ids["c2"], "pending")}


DB = "gpuledger_apr_old"


def test_an_approval_recorded_before_0044_gets_its_cluster_from_its_estimate():
    client = warehouse_before("0044", DB, prefix="approvals-old-")
    try:
        old = {"approval_id": "apr-old", "job_id": "llm-1", "status": "pending", "ts_ms": 1_000, "decided_by": "",
               "note": "", "target": "steps=60000", "cost_micros": 21_888_000, "cost_low_micros": 20_000_000,
               "cost_high_micros": 25_000_000, "threshold_micros": 10_000_000, "currency": "USD", "gpu_hours": 40.0,
               "wall_hours": 10.0, "estimate": json.dumps({"job_id": "llm-1", "attempt": 2, "cluster": "c1"})}
        warehouse.insert_rows(client, "approvals", [old], database=DB)
        assert migrations.migrate(client, DB)[0] == "0044"

        def current():
            return list(client.query(f"SELECT cluster, job_id, attempt, status FROM {DB}.approvals_current")
                        .named_results())

        assert current() == [{"cluster": "c1", "job_id": "llm-1", "attempt": 2, "status": "pending"}]
        row = estimate.decide(client, DB, "apr-old", "approved", "alice", "", 2_000)
        assert (row["cluster"], row["attempt"]) == ("c1", 2)
        assert estimate.message_key(row) == b"c1/llm-1"
        assert estimate.decision_message(row).cluster == "c1"
        assert current() == [{"cluster": "c1", "job_id": "llm-1", "attempt": 2, "status": "approved"}]
        # an old message (no cluster, no attempt) still decodes
        message = estimate.decision_message(row).model_dump(mode="json", exclude={"cluster", "attempt"})
        assert decode(ApprovalDecision, json.dumps(message).encode()).cluster == ""
    finally:
        client.close()
