"""Line 4 end to end on the real broker (Tansu) and engine (chDB): a training loop's ProgressReporter
publishes, the sink stores job_progress (garbage goes to dead letters), `gpuledger estimate` prices the
full run from it and records it as awaiting approval, `gpuledger approvals approve` keeps the decision,
and the approvals topic carries both rows for a scheduler admission hook."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.cli import main
from gpuledger.progress import ProgressReporter
from gpuledger.schemas.models import ApprovalDecision, DeadLetter, UsageBatch, UsageRecord
from gpuledger.schemas.wire import decode, encode
from gpuledger.topics import create_topics

from test_sink import read_topic, run_until_caught_up

pytestmark = pytest.mark.integration

MIN = 60_000
LEDGER = Path(__file__).resolve().parents[1] / "fixtures" / "unit_ledger.toml"


def usage(t0_ms: int) -> UsageBatch:
    return UsageBatch(node="n1", records=[UsageRecord(
        record_id=f"g{g}/{m}", cluster="c1", node="n1", gpu_uuid=f"gpu-{g}", gpu_model="A100-80GB",
        start_ms=t0_ms + m * MIN, end_ms=t0_ms + (m + 1) * MIN, state="executing", job_id="llm-1", attempt=0,
        tenant="alpha", queue="train", share_milli=1000, gpu_ms=MIN, util_pct=95.0, energy_j=24_000.0,
        coefficient=2.3, coefficient_version="A100-80GB@2020-01-01", effective_gpu_ms=round(2.3 * MIN),
        cost_micros=8_000, definition_version="d") for g in range(4) for m in range(8)])


def test_progress_to_estimate_to_approval(settings, monkeypatch, capfd):
    create_topics(settings)
    t0 = (int(time.time()) - 3600) * 1000 // MIN * MIN
    now = [t0 / 1000]
    reporter = ProgressReporter("llm-1", attempt=0, cluster="c1", bootstrap=settings.kafka_bootstrap,
                                topic=settings.topics.job_progress, min_interval_s=30, clock=lambda: now[0])
    for step in range(0, 701):  # a loop calling every step, 0.6 s a step: one report a minute is sent
        now[0] = t0 / 1000 + 60 + step * 0.6
        reporter.report(step=step, tokens=step * 4096, loss=3.0 - step / 1000,
                        ranks={0: 600.0, 1: 600.0, 2: 610.0, 3: 780.0})
    assert reporter.close(10) == 0 and reporter.dropped == 0
    assert reporter.sent == 15  # steps 0, 50, 100, ... 700 (every 30 s)
    producer = Producer(settings.kafka_client_config())
    producer.produce(settings.topics.job_progress, b'{"job_id": "llm-1", "step": "many"}')  # a dead letter
    producer.produce(settings.topics.usage, encode(usage(t0)), key=b"n1")
    assert producer.flush(10) == 0

    stats = run_until_caught_up(settings)
    assert stats["rows"]["job_progress"] == 15 and stats["dead_letters"] == 1
    letters = [decode(DeadLetter, m.value()) for m in read_topic(settings, settings.topics.dead_letters)]
    assert [d.source_topic for d in letters] == [settings.topics.job_progress]

    monkeypatch.setenv("GPULEDGER_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(LEDGER))
    common = ["--data-dir", str(settings.data_dir), "--bootstrap", settings.kafka_bootstrap]
    # 700 steps in 420 s = 5/3 steps/s; 60,000 steps = 10 h on 4 GPUs = 40 GPU-hours, 400 W each
    assert main(["estimate", "llm-1", "--target-steps", "60000", "--threshold", "10", *common]) == 0
    out = capfd.readouterr().out
    assert "awaiting approval" in out and "4 x A100-80GB" in out
    client = warehouse.connect(settings)
    try:
        (pending,) = list(client.query(f"SELECT * FROM {settings.database}.approvals_current").named_results())
    finally:
        client.close()
    # 40 GPU-h x 0.48 = 19.20 + 16 kWh x 0.12 x 1.4 = 2.688 -> 21.888 (tests/fixtures/unit_ledger.toml)
    assert pending["status"] == "pending" and pending["estimated_cost"] == pytest.approx(21.888, rel=1e-3)
    assert pending["gpu_hours"] == pytest.approx(40.0, rel=1e-6)
    assert main(["approvals", "approve", pending["approval_id"], "--by", "alice", "--note", "ok", *common]) == 0
    assert main(["approvals", "reject", pending["approval_id"], "--by", "bob", *common]) == 2  # already decided
    raw = read_topic(settings, settings.topics.approvals)
    assert [m.key() for m in raw] == [b"c1/llm-1", b"c1/llm-1"]  # "<cluster>/<job id>": job ids are per cluster
    messages = [decode(ApprovalDecision, m.value()) for m in raw]
    assert [(m.status, m.by, m.cluster, m.job_id) for m in messages] == [("pending", "", "c1", "llm-1"),
                                                                        ("approved", "alice", "c1", "llm-1")]
    assert all(m.approval_id == pending["approval_id"] for m in messages)
