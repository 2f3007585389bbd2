"""Valid but odd progress reports against the training-signal views (sql/0049 over sql/0042 and sql/0047),
on chDB with the golden pilot of test_golden_estimate.py (2 A100-80GB x 10 min from T0 at 8,000 micros a
GPU-minute; reports a minute apart), and the ProgressReporter against a real Kafka client whose broker
is away.

- Two reports of one attempt at the same ts_ms with different steps: taken in no order, and the one 0 ms
  after the other left out of its window (150 steps in the windows for 200 made).
- A report without a token count between, before or after reports with one: read as 0 tokens (the next
  report's change was its whole count), and the token span priced at the whole span's cost.
- A full client queue: the reporter stopped calling poll, so the queue never freed (every later report
  dropped, even with the broker back).
"""

from __future__ import annotations

import time

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.progress import ProgressReporter
from gpuledger.schemas.models import JobProgress, UsageBatch
from gpuledger.sink.rows import PROGRESS, Source, process_message, usage_rows

from test_golden_estimate import MIN, T0, usage

pytestmark = pytest.mark.integration  # the real engine (chDB), a real Kafka client

DB = "ledger_training_adversarial"
TOKENS_PER_STEP = 4096


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('odd') / 'chdb'}", database=DB))
    try:
        yield c
    finally:
        c.close()


def pilot(client, name: str, reports: list[dict]) -> str:
    """A new database with the golden pilot's usage and these reports (job pilot-1, cluster c, attempt 0)
    through the sink's own conversion."""
    warehouse.migrate(client, name)
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=usage()), Source("u", 0, 0)),
                          database=name)
    rows = [process_message(PROGRESS, JobProgress(cluster="c", job_id="pilot-1", attempt=0, **r).model_dump_json()
                            .encode(), Source("p", 0, i))["job_progress"][0] for i, r in enumerate(reports)]
    warehouse.insert_rows(client, "job_progress", rows, database=name)
    return name


def one(client, sql: str) -> dict:
    (row,) = list(client.query(sql).named_results())
    return row


def test_two_reports_at_the_same_millisecond_keep_their_steps(client):
    # steps 0, 100, 150, 200 at 1, 2, 2, 3 min: a forced report in the millisecond of the one before
    db = pilot(client, "odd_ties", [dict(ts_ms=T0 + MIN, step=0), dict(ts_ms=T0 + 2 * MIN, step=100),
                                    dict(ts_ms=T0 + 2 * MIN, step=150), dict(ts_ms=T0 + 3 * MIN, step=200)])
    deltas = client.query(f"SELECT step, d_ms, d_step FROM {db}.job_progress_deltas ORDER BY ts_ms, step").result_rows
    assert deltas == [(0, 0, 0), (100, 60_000, 100), (150, 0, 50), (200, 60_000, 50)]
    w = one(client, f"SELECT sum(steps) AS steps, sum(seconds) AS seconds, sum(reports) AS reports "
                    f"FROM {db}.job_progress_windows")
    # before: 150 steps (the 50 of the report 0 ms after the one before it left out), or 250 in the other order
    assert (w["steps"], w["seconds"], w["reports"]) == (200, 120.0, 3)
    assert one(client, f"SELECT steps FROM {db}.job_training_signals")["steps"] == 200


def reports_without_tokens_at(*missing: int) -> list[dict]:
    """Steps 0..500 at 1..6 min, 4,096 tokens a step; the reports at these indexes give no token count."""
    return [dict(ts_ms=T0 + (i + 1) * MIN, step=s, tokens=None if i in missing else TOKENS_PER_STEP * s)
            for i, s in enumerate(range(0, 600, 100))]


def test_a_report_without_tokens_between_two_with_them(client):
    db = pilot(client, "odd_tokens_between", reports_without_tokens_at(2))
    w = one(client, f"SELECT sum(steps) AS steps, sum(tokens_per_s * seconds) AS tokens, "
                    f"max(tokens_per_s) AS rate FROM {db}.job_progress_windows")
    # 500 steps x 4,096 = 2,048,000 tokens in 300 s; before: 2,457,600 (the fourth report's whole count
    # of 1,228,800 taken as made in its minute)
    assert w["steps"] == 500
    assert w["tokens"] == pytest.approx(2_048_000)
    assert w["rate"] == pytest.approx(2_048_000 / 300)
    s = one(client, f"SELECT tokens, cost_per_million_tokens FROM {db}.job_training_signals")
    assert s["tokens"] == 2_048_000
    # 5 GPU-minutes x 2 GPUs x 8,000 micros = 0.08 over 2.048 M tokens
    assert s["cost_per_million_tokens"] == pytest.approx(0.08 / 2.048)


@pytest.mark.parametrize("missing", [0, 5], ids=["first", "last"])
def test_a_first_or_last_report_without_tokens(client, missing):
    db = pilot(client, f"odd_tokens_edge_{missing}", reports_without_tokens_at(missing))
    s = one(client, f"SELECT steps, tokens, span_cost, cost_per_step, cost_per_million_tokens "
                    f"FROM {db}.job_training_signals")
    # the steps' span (1..6 min) costs 0.08 for 500 steps; tokens are counted over 4 minutes (400 steps,
    # 1,638,400 tokens) that cost 4 x 2 x 8,000 = 0.064: 0.0390625 per million, as for the whole run.
    # Before: the 4 minutes' tokens priced at the 5 minutes' cost, 0.08 / 1.6384 = 0.0488 (+25 %)
    assert (s["steps"], s["tokens"], s["span_cost"]) == (500, 1_638_400, pytest.approx(0.08))
    assert s["cost_per_step"] == pytest.approx(0.08 / 500)
    assert s["cost_per_million_tokens"] == pytest.approx(0.064 / 1.6384)
    w = one(client, f"SELECT sum(tokens_per_s * seconds) AS tokens, max(tokens_per_s) AS rate "
                    f"FROM {db}.job_progress_windows")
    # 1,638,400 tokens in the 240 s between the reports that count them: 6,826.7 a second (before, for
    # the first one missing: 2,048,000 counted, its whole count taken as made in the first minute)
    assert w["rate"] == pytest.approx(1_638_400 / 240)


def test_a_full_queue_frees_once_its_reports_expire(monkeypatch):
    """A real librdkafka producer with its broker away: once its queue is full, only poll frees it (the
    delivery reports of expired messages are served there). The reporter called poll only after a report
    it had queued, so after the first full queue it dropped every report for good."""
    from confluent_kafka import Producer

    for name in ("RANK", "SLURM_PROCID", "SLURM_RESTART_COUNT"):  # this process reports (rank 0)
        monkeypatch.delenv(name, raising=False)
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 3,
                         "message.timeout.ms": 300, "log_level": 0, "reconnect.backoff.max.ms": 1000})
    now = [1_000.0]
    reporter = ProgressReporter("job-1", topic="t.job-progress", producer=producer, min_interval_s=10,
                                clock=lambda: now[0])
    for step in range(4):
        now[0] += 10
        reporter.report(step=step)
    assert (reporter.sent, reporter.dropped) == (3, 1)  # the fourth found the queue full
    deadline = time.monotonic() + 10
    while reporter.failed < 3 and time.monotonic() < deadline:  # the three expire: served by the drop's poll
        time.sleep(0.2)
        now[0] += 10
        reporter.report(step=4)
    assert reporter.failed >= 3
    now[0] += 10
    assert reporter.report(step=5), "the queue never freed: every report dropped for good"
    assert reporter.close(0) >= 0
