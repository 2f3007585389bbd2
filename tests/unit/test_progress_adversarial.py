"""The training loop's ProgressReporter (gpuledger/progress.py) under odd use, with fake producers (no
broker is opened; tests/integration/test_training_signals_adversarial.py has the real client):

- a report dropped (full queue, bad value) was tried again at the very next call, so while the broker
  was away every loop step paid for building and encoding a report (6.7 ms a step with 4,096 ranks) and
  `dropped` counted loop steps, not reports;
- a full queue: poll was called only after a report that was queued, so the queue never freed;
- the attempt defaulted to 0, so a requeued Slurm job (its script run again, SLURM_RESTART_COUNT=1)
  reported its second attempt as the first: steps went back within attempt 0 and the estimate from it
  was refused;
- every rank of a distributed job running the documented loop sent its own reports: the attempt's series
  interleaved 4 copies, and an estimate from it was refused (the 0-step intervals between the ranks'
  copies made its slow end 0);
- a count that went back (a restart from a checkpoint within the process) was sent as a rate of 0.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import orjson
import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.progress import ProgressReporter
from gpuledger.warehouse import estimate

LEDGER = Path(__file__).resolve().parents[1] / "fixtures" / "unit_ledger.toml"
T0 = int(dt.datetime(2026, 11, 2, tzinfo=dt.timezone.utc).timestamp() * 1000)
STEPS = [0, 100, 220, 300, 420, 500]  # the golden pilot (tests/integration/test_golden_estimate.py)


class FakeProducer:
    """confluent-kafka's produce/poll/flush; `capacity`: messages the queue holds until poll frees them
    (`expired` of them: as librdkafka frees a message only once its delivery report is served)."""

    def __init__(self, capacity: int | None = None):
        self.sent, self.produced, self.capacity, self.queued, self.expired = [], 0, capacity, [], False

    def produce(self, topic, key, value, on_delivery=None):
        self.produced += 1
        if self.capacity is not None and len(self.queued) >= self.capacity:
            raise BufferError("Local: Queue full")
        self.queued.append(on_delivery)
        self.sent.append((topic, key, orjson.loads(value)))

    def poll(self, _timeout):
        if self.expired:  # the broker is away: every queued message timed out; their reports served now
            for callback in self.queued:
                callback("Local: Message timed out", None)
            self.queued = []
        return 0

    def flush(self, _timeout):
        return 0


@pytest.fixture(autouse=True)
def no_scheduler_env(monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def test_a_dropped_report_waits_its_interval_like_a_sent_one():
    class Full(FakeProducer):
        def produce(self, *a, **k):
            self.produced += 1
            raise BufferError("Local: Queue full")

    now = [1000.0]
    full = Full()
    r = ProgressReporter("job-1", topic="t", producer=full, min_interval_s=10, clock=lambda: now[0])
    ranks = {k: 100.0 for k in range(4096)}
    for step in range(100):  # 100 steps of 0.1 s while the queue stays full: 10 s, one report's interval
        r.report(step=step, tokens=step * 4096, ranks=ranks)
        now[0] += 0.1
    # before: 100 reports built, encoded and tried (one per step), 100 counted dropped
    assert (full.produced, r.dropped, r.sent) == (1, 1, 0)
    now[0] = 1010.0
    r.report(step=100)
    assert (full.produced, r.dropped) == (2, 2)  # the next interval tries again
    # a bad value (NaN loss) is also tried once per interval, not at every step
    ok = FakeProducer()
    r = ProgressReporter("job-1", topic="t", producer=ok, min_interval_s=10, clock=lambda: now[0])
    for step in range(50):
        r.report(step=step, loss=float("nan"))
        now[0] += 0.1
    assert r.dropped == 1
    now[0] += 10
    assert r.report(step=200, loss=1.0) and r.sent == 1


def test_a_full_queue_is_freed_by_the_reporter():
    now = [1000.0]
    producer = FakeProducer(capacity=3)
    r = ProgressReporter("job-1", topic="t", producer=producer, min_interval_s=10, clock=lambda: now[0])
    for step in range(4):
        now[0] += 10
        r.report(step=step)
    assert (r.sent, r.dropped) == (3, 1)
    producer.expired = True  # the broker stays away: the three expire (freed when their reports are served)
    now[0] += 10
    r.report(step=4)  # still full: dropped, and its poll serves the expired messages' reports
    assert r.failed == 3
    producer.expired = False
    now[0] += 10
    # before: the queue stayed full for good (no poll after a drop), every later report dropped
    assert r.report(step=5) and r.sent == 4


def test_the_attempt_is_slurms_restart_count(monkeypatch):
    producer = FakeProducer()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the job requeued once: its script runs again
    r = ProgressReporter("1234", cluster="a", topic="t", producer=producer)
    assert r.report(step=800)
    assert producer.sent[-1][2]["attempt"] == 1  # before: 0, the first attempt's reports
    # given, the attempt is the loop's (Kubernetes: no variable says it)
    assert ProgressReporter("1234", attempt=3, topic="t", producer=producer).report(step=1)
    assert producer.sent[-1][2]["attempt"] == 3
    monkeypatch.setenv("SLURM_RESTART_COUNT", "")
    assert ProgressReporter("1234", topic="t", producer=producer).attempt == 0


def pilot_from(producer: FakeProducer) -> estimate.Pilot:
    reports = sorted((m["ts_ms"], m["step"], m.get("tokens"), m.get("epoch")) for _t, _k, m in producer.sent)
    return estimate.Pilot(job_id="pilot-1", attempt=0, reports=reports, gpus={"A100-80GB": 2.0},
                          power_w={"A100-80GB": 300.0}, cluster="c")


def test_only_rank_0_reports(monkeypatch):
    """Four ranks run the documented loop; each one's clock a few ms apart, in lock step."""
    producer = FakeProducer()
    now = [T0 / 1000]
    reporters = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))  # as torchrun sets it for each process
        reporters.append(ProgressReporter("pilot-1", cluster="c", topic="t", producer=producer,
                                          clock=lambda rank=rank: now[0] + rank * 0.002))
    for i, step in enumerate(STEPS):
        now[0] = T0 / 1000 + (i + 1) * 60
        for r in reporters:
            r.report(step=step, tokens=2048 * step)
    # before: 24 reports, every step 4 times 2 ms apart; the estimate refused ("slow intervals made no steps")
    assert len(producer.sent) == 6 and [r.active for r in reporters] == [True, False, False, False]
    e = estimate.estimate_run(pilot_from(producer), "steps", 60_000, load_ledger_config(LEDGER), at_ms=T0)
    assert (e.steps_per_s, e.cost_high) == (pytest.approx(5 / 3), pytest.approx(13.26))  # the golden pilot's
    # Slurm's task rank where RANK is unset; `rank=0` makes any process the reporter
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert not ProgressReporter("pilot-1", topic="t", producer=producer).report(step=1, force=True)
    assert ProgressReporter("pilot-1", topic="t", producer=producer, rank=0).report(step=1, force=True)


def test_a_count_that_goes_back_gives_no_rate():
    now = [1000.0]
    producer = FakeProducer()
    r = ProgressReporter("job-1", topic="t", producer=producer, min_interval_s=10, clock=lambda: now[0])
    r.report(step=1000, samples=64_000, tokens=4_096_000)
    now[0] += 10
    r.report(step=850, samples=54_400, tokens=3_481_600)  # restarted from the checkpoint of step 800
    msg = producer.sent[-1][2]
    # before: 0 samples/s and 0 tokens/s, a stall the job did not have
    assert (msg.get("samples_per_s"), msg.get("tokens_per_s"), msg.get("step_time_ms")) == (None, None, None)
    now[0] += 10
    r.report(step=950, samples=60_800, tokens=3_891_200)
    msg = producer.sent[-1][2]
    assert (msg.get("samples_per_s"), msg.get("tokens_per_s"), msg.get("step_time_ms")) == (640.0, 40_960.0, 100.0)
