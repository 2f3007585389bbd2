"""The sink's dead letters are in their topic before the block holding their message is recorded done
(a sink that dies first re-handles the block and sends them again), and gpu_health rows of a tick an agent
sent again are dropped before the insert. Pure logic: a fake producer, a fake warehouse, progress in memory."""

from __future__ import annotations

import pytest

from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.letters import DeadLetterOutbox, UndeliveredLetters
from gpuledger.sink.progress import MemoryProgress
from gpuledger.sink.rows import Source

SAMPLES = "p.gpu-samples"
KEY = (SAMPLES, 0)


class Crash(BaseException):
    """The process dies here."""


class FakeProducer:
    """Queues what it is given; `flush` delivers it while `up`, else leaves it queued (or, with
    `refuse`, reports a delivery error, as librdkafka does once message.timeout.ms has passed)."""

    def __init__(self):
        self.queue, self.topic = [], []
        self.up, self.refuse = True, False

    def produce(self, topic, key=None, value=None, on_delivery=None):
        self.queue.append((topic, value, on_delivery))

    def poll(self, _t=0):
        return 0

    def flush(self, _t=0):
        if self.up or self.refuse:
            for topic, value, report in self.queue:
                if self.up:
                    self.topic.append(value)
                report("Broker: refused" if not self.up else None, None)
            self.queue = []
        return len(self.queue)


class RefusingWarehouse:
    """Takes blocks by token like ClickHouse; refuses (Code 53) any block holding a row marked poison."""

    def __init__(self):
        self.rows: dict[str, list[dict]] = {}
        self.tokens: set[str] = set()

    def write(self, table, rows, token=None):
        if any(r.get("poison") for r in rows):
            raise Exception("Code: 53. DB::Exception: Type mismatch in column. (TYPE_MISMATCH)")
        if token not in self.tokens:
            self.tokens.add(token)
            self.rows.setdefault(table, []).extend(rows)


def health(offset, ts_ms, gpu="GPU-1", node="n1", poison=False):
    return {"gpu_health": [{"cluster": "c", "node": node, "gpu_uuid": gpu, "ts_ms": ts_ms, "kafka_offset": offset,
                            "poison": poison}]}


def sink_with_letters(wh, progress, producer, **kw):
    outbox = DeadLetterOutbox(producer, "p.dead-letters", wait_s=0)
    sink = BatchingSink(wh, progress, confirm_letters=outbox.confirm, backoff_s=0.5, backoff_max_s=2.0,
                        on_poison=lambda key, offset, table, rows, reason, message_key:
                        outbox.send(message_key, f"{offset}".encode()),
                        **kw)
    return sink, outbox


def test_the_outbox_resends_letters_whose_delivery_failed_until_they_are_in():
    producer = FakeProducer()
    outbox = DeadLetterOutbox(producer, "p.dead-letters", wait_s=0)
    producer.up, producer.refuse = False, True
    outbox.send(b"k", b"letter")
    with pytest.raises(UndeliveredLetters, match="1 dead letters not yet delivered.*refused"):
        outbox.confirm()
    producer.refuse = False
    with pytest.raises(UndeliveredLetters, match="still in flight"):
        outbox.confirm()  # sent again, not delivered yet
    producer.up = True
    outbox.confirm()
    assert producer.topic == [b"letter"] and outbox.outstanding == 0 and outbox.resent == 1
    outbox.confirm()  # nothing out: nothing to wait for


def test_a_refused_blocks_dead_letter_is_delivered_before_the_block_is_recorded_done():
    """The dead-letter broker is down: the sink waits (through its polling sleep) and records the block done
    only once the letter is in; the done row never comes first."""
    wh, progress, producer = RefusingWarehouse(), MemoryProgress(), FakeProducer()
    producer.up = False
    waits = []

    def sleep(delay):
        waits.append(delay)
        assert [r["phase"] for r in progress.rows] == ["pending"], "done recorded before the letter was delivered"
        producer.up = len(waits) >= 3  # the broker is back after three waits

    sink, outbox = sink_with_letters(wh, progress, producer, sleep=sleep)
    for offset in range(3):
        sink.add(health(offset, 1000 * offset, poison=offset == 1), Source(SAMPLES, 0, offset))
    written, offsets = sink.flush()
    assert waits == [0.5, 1.0, 2.0] and producer.topic == [b"1"]
    assert [r["phase"] for r in progress.rows] == ["pending", "done"] and offsets == {KEY: 3}
    assert sorted(r["kafka_offset"] for r in wh.rows["gpu_health"]) == [0, 2]


def test_a_sink_that_dies_before_its_letters_are_delivered_sends_them_again_after_a_restart():
    wh, progress, producer = RefusingWarehouse(), MemoryProgress(), FakeProducer()
    producer.up = False

    def die(_delay):
        raise Crash()  # the sink is killed (or stopped) while it waits for the dead-letter broker

    messages = [(offset, health(offset, 1000 * offset, poison=offset == 1)) for offset in range(3)]
    sink, _ = sink_with_letters(wh, progress, producer, sleep=die)
    with pytest.raises(Crash):
        for offset, rows in messages:
            sink.add(rows, Source(SAMPLES, 0, offset))
        sink.flush()
    assert producer.topic == [] and [r["phase"] for r in progress.rows] == ["pending"]

    producer = FakeProducer()  # a new process, a new producer; the broker is back
    restarted, outbox = sink_with_letters(wh, progress, producer)
    restarted.assign([KEY])
    for offset, rows in messages:  # from the last committed offset
        assert restarted.add(rows, Source(SAMPLES, 0, offset))
    restarted.flush()
    assert producer.topic == [b"1"] and outbox.outstanding == 0
    assert sorted(r["kafka_offset"] for r in wh.rows["gpu_health"]) == [0, 2]


def test_the_letter_of_the_message_that_completes_a_pending_range_goes_out_before_its_done_row():
    """After a crash the last message of a pending range flushes the range from `add`; its dead letter
    (an undecodable message) must be handed out before that flush confirms and records done."""
    wh, progress, producer = RefusingWarehouse(), MemoryProgress(), FakeProducer()
    sink, outbox = sink_with_letters(wh, progress, producer)
    progress.save([BatchingSink._row(KEY, 0, 0, 2, "pending", {})])  # the crashed sink's pending range [0, 2)
    sink.assign([KEY])
    sink.add(health(0, 0), Source(SAMPLES, 0, 0))
    assert sink.add({}, Source(SAMPLES, 0, 1), letter=lambda: outbox.send(None, b"undecodable"))
    assert producer.topic == [b"undecodable"] and progress.rows[-1]["phase"] == "done"


def test_health_rows_of_a_tick_already_stored_or_twice_in_a_block_are_dropped_and_counted():
    wh = RefusingWarehouse()
    stored = {("c", "n1", "GPU-1", 1000)}  # what the warehouse holds from earlier messages
    asked = []

    def lookup(rows, key, start, end):
        asked.append((key, start, end))
        return stored

    sink = BatchingSink(wh, MemoryProgress(), stored_health=lookup)
    messages = [health(0, 1000),  # resent after an agent crash: stored already
                health(1, 2000), health(2, 2000),  # a delivery-failure rewind: twice in one block
                health(3, 500),  # older than what is stored, never seen: a real sample
                health(4, 2000, gpu="GPU-2"), health(5, 2000, node="n2", gpu="GPU-3")]  # same time, others
    for offset, rows in enumerate(messages):
        sink.add(rows, Source(SAMPLES, 0, offset))
    written, _ = sink.flush()
    assert asked == [(KEY, 0, 6)]  # the block's own range does not count as stored (a rebuilt block)
    assert [(r["gpu_uuid"], r["ts_ms"], r["kafka_offset"]) for r in wh.rows["gpu_health"]] == [
        ("GPU-1", 2000, 1), ("GPU-1", 500, 3), ("GPU-2", 2000, 4), ("GPU-3", 2000, 5)]
    assert written == {"gpu_health": 4} and sink.duplicate_health == 2
