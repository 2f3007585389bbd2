"""Dumps and replay: round trip, event-time order, watermark broadcast, pacing, clear errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from gpuledger.agents.simcluster import SimSpec, simulate
from gpuledger.config import Settings
from gpuledger.embedded.replay import (
    DumpError,
    DumpLine,
    publish,
    publish_simulation,
    read_dump,
    validate_dump_line,
    write_dump,
)
from gpuledger.schemas.wire import decode_lifecycle, encode

TINY = SimSpec(nodes=1, gpus_per_node=4, hours=0.5, seed=5)


class FakePublisher:
    """Records (topic, key, value, partition); `undelivered` is what flush reports as left over."""

    def __init__(self, undelivered: int = 0) -> None:
        self.sent: list[tuple[str, str | bytes | None, bytes, int | None]] = []
        self.polls = 0
        self.flushes = 0
        self.undelivered = undelivered

    def publish(self, topic, key, value, partition=None):
        self.sent.append((topic, key, value, partition))

    def poll(self):
        self.polls += 1
        return 0

    def flush(self, timeout=30):
        self.flushes += 1
        return self.undelivered


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def settings() -> Settings:
    return Settings(topic_prefix="t1.", partitions_job_events=3)


def line(topic: str, key: str | None, value: dict) -> bytes:
    return orjson.dumps({"topic": topic, "key": key, "value": value})


# --------------------------------------------------------------------------- dumps
def test_dump_round_trip(tmp_path: Path):
    emissions = list(simulate(TINY))
    path = tmp_path / "dump.jsonl"
    assert write_dump(emissions, path) == len(emissions)
    lines = read_dump(path)
    assert len(lines) == len(emissions)
    for e, d in zip(emissions, lines):
        assert (d.topic, d.key) == (e.line, e.key)
        assert d.value == e.message.model_dump(mode="json", exclude_none=True)
        assert orjson.dumps(d.value) == encode(e.message)  # the dump holds the exact wire bytes
        validate_dump_line(d)


def test_read_dump_skips_blank_lines(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(line("job-events", None, {"type": "watermark", "cluster": "c", "ts_ms": 5}) + b"\n\n   \n")
    assert read_dump(path) == [DumpLine("job-events", None, {"type": "watermark", "cluster": "c", "ts_ms": 5})]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"topic": "gpu-samples", "key": "n1", "value": {', "malformed JSON"),
        (b'["gpu-samples", "n1", {}]', "expected a JSON object"),
        (b'{"topic": "gpu-samples", "value": {}}', "missing field(s) key"),
        (b'{"topic": "gpu-samples", "key": 7, "value": {}}', "key must be a string or null"),
        (b'{"topic": "", "key": null, "value": {}}', "topic must be a non-empty string"),
        (b'{"topic": "job-events", "key": null, "value": "x"}', "value must be a JSON object"),
        (b'{"topic": "job-events", "key": null, "value": {"ts_ms": "soon"}}', "value.ts_ms must be an integer"),
        (b'{"topic": "job-events", "key": null, "value": {}, "extra": 1}', "unexpected field(s) extra"),
    ],
)
def test_bad_line_is_reported_with_its_line_number(tmp_path: Path, bad: bytes, message: str):
    good = line("job-events", None, {"type": "watermark", "cluster": "c", "ts_ms": 5})
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good + b"\n" + good + b"\n" + bad + b"\n" + good + b"\n")
    with pytest.raises(DumpError) as err:
        read_dump(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


def test_validate_dump_line_names_the_violation():
    with pytest.raises(DumpError, match="job-events: schema violation"):
        validate_dump_line(DumpLine("job-events", "j", {"type": "job_event", "ts_ms": 1}))
    with pytest.raises(DumpError, match="unknown line"):
        validate_dump_line(DumpLine("other", None, {}))
    validate_dump_line(DumpLine("t1.job-events", None, {"type": "watermark", "cluster": "c", "ts_ms": 1}), "t1.")


# --------------------------------------------------------------------------- publishing
def test_publish_simulation_prefixes_keys_and_broadcasts_watermarks(settings: Settings):
    emissions = list(simulate(TINY))
    pub = FakePublisher()
    counts = publish(emissions, pub, settings)

    expected = Counter(e.line for e in emissions)
    assert counts == dict(expected)
    watermarks = [e for e in emissions if e.key is None]
    assert len(pub.sent) == len(emissions) + len(watermarks) * (settings.partitions_job_events - 1)
    assert {t for t, *_ in pub.sent} == {"t1.gpu-samples", "t1.job-events", "t1.scheduler-snapshots"}
    assert pub.flushes == 1

    by_partition: dict[int, list[int]] = {}
    for topic, key, value, partition in pub.sent:
        if key is None:
            assert topic == "t1.job-events"
            wm = decode_lifecycle(value)
            by_partition.setdefault(partition, []).append(wm.ts_ms)
        else:
            assert partition is None  # keyed: the partitioner decides
    assert sorted(by_partition) == [0, 1, 2]
    assert all(ts == [w.message.ts_ms for w in watermarks] for ts in by_partition.values())

    # order on the wire = event-time order of the emissions
    sent_keyed = [(t, k, v) for t, k, v, p in pub.sent if p in (None, 0)]
    assert sent_keyed == [(f"t1.{e.line}", e.key, encode(e.message)) for e in emissions]


def test_publish_dump_sorts_by_event_time_stably(settings: Settings, tmp_path: Path):
    rows = [
        line("gpu-samples", "n1", {"ts_ms": 30, "i": 0}),
        line("job-events", "j1", {"ts_ms": 10, "i": 1}),
        line("t1.job-events", "j2", {"ts_ms": 30, "i": 2}),  # already prefixed: used as is
        line("scheduler-snapshots", "c", {"ts_ms": 20, "i": 3}),
        line("job-events", "j1", {"ts_ms": 10, "i": 4}),
        line("job-events", None, {"type": "watermark", "cluster": "c", "ts_ms": 31, "i": 5}),
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    pub = FakePublisher()
    counts = publish(read_dump(path), pub, settings)
    order = [orjson.loads(v)["i"] for _, _, v, p in pub.sent if p in (None, 0)]
    assert order == [1, 4, 3, 0, 2, 5]
    assert [t for t, *_ in pub.sent][:5] == [
        "t1.job-events", "t1.job-events", "t1.scheduler-snapshots", "t1.gpu-samples", "t1.job-events",
    ]
    assert [p for *_, p in pub.sent][-3:] == [0, 1, 2]
    assert counts == {"gpu-samples": 1, "job-events": 4, "scheduler-snapshots": 1}


def test_pacing_follows_event_time_with_a_fake_clock(settings: Settings):
    clock = FakeClock()
    base = 1_000_000
    rows = [DumpLine("job-events", f"j{i}", {"ts_ms": base + dt}) for i, dt in enumerate((0, 0, 10_000, 25_000, 40_000))]
    sent_at: list[float] = []

    class TimedPublisher(FakePublisher):
        def publish(self, topic, key, value, partition=None):
            sent_at.append(clock.now)
            super().publish(topic, key, value, partition)

    publish(rows, TimedPublisher(), settings, speedup=10, clock=clock, sleep=clock.sleep)
    # event time runs 10x faster than the clock: 10 s of event time = 1 s of wall time
    assert [round(t - 100.0, 6) for t in sent_at] == [0.0, 0.0, 1.0, 2.5, 4.0]
    assert sum(clock.slept) == pytest.approx(4.0)

    fast = FakeClock()
    publish(rows, FakePublisher(), settings, clock=fast, sleep=fast.sleep)
    assert fast.slept == []  # speedup None: as fast as possible


def test_pacing_does_not_sleep_when_behind(settings: Settings):
    clock = FakeClock()
    rows = [DumpLine("job-events", "j", {"ts_ms": t}) for t in (0, 1000, 2000)]

    def slow_sleep(seconds: float) -> None:
        clock.slept.append(seconds)
        clock.now += seconds + 5  # oversleeps: the next messages are late and go at once

    publish(rows, FakePublisher(), settings, speedup=1, clock=clock, sleep=slow_sleep)
    assert len(clock.slept) == 1


def test_undelivered_messages_raise(settings: Settings):
    with pytest.raises(RuntimeError, match="3 message\\(s\\) still undelivered"):
        publish([DumpLine("job-events", "j", {"ts_ms": 1})], FakePublisher(undelivered=3), settings)


def test_bad_speedup_is_rejected(settings: Settings):
    with pytest.raises(ValueError, match="speedup must be > 0"):
        publish([], FakePublisher(), settings, speedup=0)


def test_publish_simulation_reports_progress(settings: Settings):
    seen: list[tuple[int, int]] = []
    pub = FakePublisher()
    counts = publish_simulation(TINY, pub, settings, progress=lambda done, total: seen.append((done, total)))
    n = sum(counts.values())
    assert counts == dict(Counter(e.line for e in simulate(TINY)))
    assert seen[-1] == (n, n)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))


def test_empty_input_publishes_nothing(settings: Settings):
    pub = FakePublisher()
    assert publish([], pub, settings) == {"gpu-samples": 0, "job-events": 0, "scheduler-snapshots": 0}
    assert pub.sent == [] and pub.flushes == 1
