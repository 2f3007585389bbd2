"""The sink's Kafka loop (`run_sink`, continuous: no `until_caught_up`) over fakes of the Kafka client and
the warehouse client (the real ones: tests/integration/test_sink*.py), for what a real broker will not
stage on demand: offsets without messages, a rebalance at a chosen moment of a warehouse outage.

First case: a pending range read again after a crash whose last offsets hold no messages any more
(compacted, offsets without messages), on a partition where nothing new comes. The range may be
written only once its rest is proved a gap; the consumer having every message of a partition whose
end is past the range proves it (as with `until_caught_up`). The continuous sink never looked: the
range's rows stayed out of the warehouse and its offsets uncommitted until some later message came
to that partition, on a quiet one never."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from confluent_kafka import TopicPartition

from gpuledger.config import Settings
from gpuledger.schemas.models import JobEvent
from gpuledger.schemas.wire import encode
from gpuledger.sink import loop
from gpuledger.sink.batching import BatchingSink

T = 1709254800000


class Message:
    def __init__(self, topic, partition, offset, value):
        self._t, self._p, self._o, self._v = topic, partition, offset, value

    def error(self):
        return None

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def value(self):
        return self._v

    def key(self):
        return b"job-1"

    def headers(self):
        return []


class Consumer:
    """One partition with data: `log` (offset -> value), its end offset `END`, past the last message."""

    log: dict[int, bytes] = {}
    END = 0
    TOPIC = ""
    commits: list = []
    topics: list[str] = []

    def __init__(self, _config):
        self.position_at = 0
        self.on_assign = None

    def list_topics(self, topic=None, timeout=None):
        class Meta:
            pass

        meta = Meta()
        meta.topics = {}
        for t in self.topics:
            m = Meta()
            m.error, m.partitions = None, {0: None}
            meta.topics[t] = m
        return meta

    def subscribe(self, topics, on_assign=None, on_revoke=None):
        self.on_assign = on_assign

    def consume(self, num_messages=1, timeout=None):
        if self.on_assign is not None:
            assign, self.on_assign = self.on_assign, None
            assign(self, [TopicPartition(t, 0) for t in self.topics])
        out = [Message(self.TOPIC, 0, o, v) for o, v in sorted(self.log.items()) if o >= self.position_at]
        if out:
            self.position_at = self.END  # every message read: librdkafka's position is past the gap
        else:
            time.sleep(min(timeout or 0, 0.05))
        return out

    def assignment(self):
        return [TopicPartition(t, 0) for t in self.topics]

    def position(self, tps):
        return [TopicPartition(tp.topic, tp.partition, self.position_at if tp.topic == self.TOPIC else 0)
                for tp in tps]

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, self.END if tp.topic == self.TOPIC else 0

    def committed(self, tps, timeout=None):
        return [TopicPartition(tp.topic, tp.partition, -1001) for tp in tps]

    def commit(self, offsets=None, asynchronous=True):
        self.commits.extend((tp.topic, tp.partition, tp.offset) for tp in offsets)

    def pause(self, tps):
        pass

    def resume(self, tps):
        pass

    def seek(self, tp):
        pass

    def close(self):
        pass


class Producer:
    def __init__(self, _config):
        pass

    def produce(self, *a, **kw):
        raise AssertionError("no dead letter expected")

    def poll(self, _timeout=0):
        return 0

    def flush(self, _timeout=None):
        return 0


class Client:
    """The warehouse: progress rows (sink_progress) and the blocks inserted, with their tokens."""

    def __init__(self, progress_rows):
        self.progress = list(progress_rows)
        self.blocks: list[tuple[str, list, str | None]] = []

    def insert(self, table, data, column_names=None, database=None, settings=None):
        rows = [dict(zip(column_names, values)) for values in data]
        if table == "sink_progress":
            self.progress.extend(rows)
        else:
            self.blocks.append((table, rows, (settings or {}).get("insert_deduplication_token")))

    def query(self, sql, parameters=None):
        assert "sink_progress" in sql, sql
        latest = {}
        for r in sorted(self.progress, key=lambda r: r["seq"]):
            latest[(r["topic"], r["partition"])] = r

        class Result:
            def named_results(self):
                return iter(latest.values())

        return Result()


def test_a_continuous_sink_writes_a_pending_range_whose_rest_is_past_the_partitions_end(monkeypatch, tmp_path):
    settings = Settings(topic_prefix="g.", data_dir=tmp_path, worker_app_id="w")
    topic = settings.topics.lifecycle_accepted
    group = "w-sink"
    # the sink died after recording [0, 5) pending; offsets 3 and 4 hold no messages any more
    pending = {**BatchingSink._row((topic, 0), 0, 0, 5, "pending", {}), "consumer": group}
    client = Client([pending])
    events = [JobEvent(event_id=f"e{i}", ts_ms=T + i, kind="submitted", cluster="c1", job_id="job-1",
                       tenant="alpha", queue="train", requested_gpus=1) for i in range(3)]
    Consumer.log = {i: encode(e) for i, e in enumerate(events)}
    Consumer.END, Consumer.TOPIC, Consumer.commits = 5, topic, []
    Consumer.topics = loop.sink_topics(settings)
    monkeypatch.setattr(loop, "Consumer", Consumer)
    monkeypatch.setattr(loop, "Producer", Producer)

    stop = threading.Event()
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(run_sink_stats=loop.run_sink(
        settings, stop=stop, client=client, idle_s=0.2, batch_interval_s=0.2)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not Consumer.commits:
        time.sleep(0.05)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert [(table, [r["event_id"] for r in rows], token) for table, rows, token in client.blocks] == [
        ("job_events", ["e0", "e1", "e2"], f"{topic}/0/e0/0-5/job_events")], "the pending range was never written"
    assert (topic, 0, 5) in Consumer.commits


class RebalancingConsumer(Consumer):
    """Partitions 0 and 1 of one topic, two messages each. While the sink waits out the warehouse (its
    partitions paused, polling on), one poll brings a rebalance that revokes partition 1, and a message
    of each partition fetched before the pause (offset 2 of partition 1 first). Seeking a partition no
    longer assigned is refused, as librdkafka does."""

    def __init__(self, config):
        super().__init__(config)
        self.assigned = [(t, p) for t in self.topics for p in ((0, 1) if t == self.TOPIC else (0,))]
        self.positions = {key: 0 for key in self.assigned}
        self.paused: set = set()
        self.rebalanced = False

    def list_topics(self, topic=None, timeout=None):
        meta = super().list_topics(topic, timeout)
        meta.topics[self.TOPIC].partitions = {0: None, 1: None}
        return meta

    def consume(self, num_messages=1, timeout=None):
        if self.on_assign is not None:
            assign, self.on_assign = self.on_assign, None
            assign(self, [TopicPartition(t, p) for t, p in self.assigned])
        if self.paused and not self.rebalanced:
            self.rebalanced = True
            self.assigned.remove((self.TOPIC, 1))
            self.on_revoke(self, [TopicPartition(self.TOPIC, 1)])
            out = [Message(self.TOPIC, p, 2, self.log[(p, 2)]) for p in (1, 0)]
            self.positions[(self.TOPIC, 0)] = 3
            return out
        out = []
        for key in self.assigned:
            if key in self.paused or key[0] != self.TOPIC:
                continue
            for offset in range(self.positions[key], 3 if self.rebalanced else 2):
                out.append(Message(key[0], key[1], offset, self.log[(key[1], offset)]))
            self.positions[key] = max(self.positions[key], 3 if self.rebalanced else 2)
        if not out:
            time.sleep(min(timeout or 0, 0.05))
        return out

    def subscribe(self, topics, on_assign=None, on_revoke=None):
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def assignment(self):
        return [TopicPartition(t, p) for t, p in self.assigned]

    def pause(self, tps):
        self.paused |= {(tp.topic, tp.partition) for tp in tps}

    def resume(self, tps):
        self.paused -= {(tp.topic, tp.partition) for tp in tps}

    def seek(self, tp):
        from confluent_kafka import KafkaError, KafkaException

        if (tp.topic, tp.partition) not in self.assigned:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
        self.positions[(tp.topic, tp.partition)] = tp.offset

    def position(self, tps):
        return [TopicPartition(tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), 0)) for tp in tps]

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, 3 if tp.topic == self.TOPIC else 0


class DownOnceClient(Client):
    down = 1

    def insert(self, table, data, column_names=None, database=None, settings=None):
        if self.down:
            self.down -= 1
            raise ConnectionError("warehouse down")
        super().insert(table, data, column_names, database, settings)


def test_a_rebalance_while_the_sink_waits_out_the_warehouse(monkeypatch, tmp_path):
    """Partition 1, revoked during the wait, is its new owner's: none of its block is recorded or
    inserted here (it was, under a range the new owner never loaded: stored twice). Partition 0's message
    read during the wait is read again after the resume: the refused seek of partition 1 came first and
    left it unread, so it was skipped as if it were a gap and recorded done, never written."""
    settings = Settings(topic_prefix="g.", data_dir=tmp_path, worker_app_id="w")
    topic = settings.topics.lifecycle_accepted
    client = DownOnceClient([])
    RebalancingConsumer.log = {(p, i): encode(JobEvent(
        event_id=f"e{p}-{i}", ts_ms=T + i, kind="submitted", cluster="c1", job_id="job-1", tenant="alpha",
        queue="train", requested_gpus=1)) for p in (0, 1) for i in range(3)}
    RebalancingConsumer.TOPIC, RebalancingConsumer.commits = topic, []
    RebalancingConsumer.topics = loop.sink_topics(settings)
    monkeypatch.setattr(loop, "Consumer", RebalancingConsumer)
    monkeypatch.setattr(loop, "Producer", Producer)

    stop = threading.Event()
    thread = threading.Thread(target=lambda: loop.run_sink(settings, stop=stop, client=client, batch_interval_s=0.1),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (topic, 0, 3) not in RebalancingConsumer.commits:
        time.sleep(0.05)
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    stored = sorted(r["event_id"] for table, rows, _token in client.blocks for r in rows)
    assert stored == ["e0-0", "e0-1", "e0-2"]
    assert {(r["partition"], r["phase"]) for r in client.progress} == {(0, "pending"), (0, "done")}
    assert not any(p == 1 for _t, p, _o in RebalancingConsumer.commits)


class HangingClose:
    """A consumer whose close() waits for a group coordinator that never answers, as librdkafka's did once
    in CI against Tansu (over 10 minutes in `consumer.close()`)."""

    def __init__(self):
        self.release = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.release.wait(60)
        self.closed = True


def test_a_consumer_that_never_closes_holds_the_sink_only_for_the_close_timeout(caplog):
    consumer = HangingClose()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gpuledger.sink.loop"):
        assert loop.close_consumer(consumer, timeout_s=0.2) is False
    assert time.monotonic() - started < 5
    assert "did not close within" in caplog.text
    consumer.release.set()


def test_a_consumer_that_closes_is_closed_and_its_error_raised():
    class Refusing:
        def close(self) -> None:
            raise RuntimeError("Consumer closed")

    consumer = HangingClose()
    consumer.release.set()
    assert loop.close_consumer(consumer, timeout_s=5) is True and consumer.closed
    with pytest.raises(RuntimeError, match="Consumer closed"):
        loop.close_consumer(Refusing(), timeout_s=5)
