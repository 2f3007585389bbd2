"""Adversarial cases of the agents' delivery path (agents/spool.py, agents/publisher.py), no broker:

- a record larger than the producer's or the broker's message limit must not hold back every
  record after it for ever (before: resent every backoff, nothing after it was ever delivered);
- a clean stop sends what the agent spooled on its way down (before: the last ticks stayed on
  disk until a next start, if any);
- a damaged record costs that record, not the intact records after it in its segment (before: a
  flipped bit in the 10th record of an 8 MiB segment cost the 2,123 records after it);
- an agent killed at any write, sync, open, close or delete (appending, rolling a segment, writing
  the cursor, acknowledging, keeping the records after a damaged one) loses nothing it spooled and
  keeps the order; resends are at-least-once duplicates (guards: these held before too, except
  while keeping the records after a damaged one, which did not exist)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from gpuledger.agents.gpu_agent import open_spooled_publisher, run_agent
from gpuledger.agents.publisher import ListPublisher, is_too_large
from gpuledger.agents.sim_backend import SimBackend
from gpuledger.agents.spool import Forwarder, Spool


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def pump_until_idle(fwd: Forwarder, clock: Clock, steps: int = 200) -> None:
    for _ in range(steps):
        fwd.pump()
        if fwd.idle:
            return
        clock.t += 31.0  # past any backoff


# --------------------------------------------------------------------------- too large to send
class ProducerLimit(ListPublisher):
    """librdkafka's own check at produce(): a message over `message.max.bytes` raises at once."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.refused = 0

    def publish(self, topic, key, value, partition=None, on_delivery=None) -> None:
        if len(value) > self.limit:
            self.refused += 1
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        super().publish(topic, key, value, partition, on_delivery)


class BrokerLimit:
    """A broker that refuses a whole produce batch (everything queued since the last poll) when one
    record in it is over its `max.message.bytes`: MESSAGE_TOO_LARGE for each of them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.queue: list[tuple[bytes, Any]] = []
        self.delivered: list[bytes] = []
        self.batches_refused = 0

    def publish(self, topic, key, value, partition=None, on_delivery=None) -> None:
        self.queue.append((value, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        batch, self.queue = self.queue, []
        if any(len(v) > self.limit for v, _ in batch):
            self.batches_refused += 1
            for _, cb in batch:
                cb(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            return len(batch)
        for v, cb in batch:
            self.delivered.append(v)
            cb(None)
        return len(batch)


def small(i: int) -> bytes:
    return b"tick-%03d" % i + b"." * 400


def test_is_too_large_reads_delivery_reports_and_produce_exceptions() -> None:
    assert is_too_large(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    assert is_too_large(KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    assert is_too_large(KafkaError(KafkaError.RECORD_LIST_TOO_LARGE))
    assert not is_too_large(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert not is_too_large(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    assert not is_too_large(RuntimeError("local Kafka queue still full"))
    assert not is_too_large(None)


def test_a_record_the_producer_refuses_for_its_size_is_dropped_counted_and_the_rest_delivered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dropped: list[int] = []
    pub = ProducerLimit(limit=1000)
    clock = Clock()
    with Spool(tmp_path, fsync="never", on_drop=dropped.append) as spool:
        fwd = Forwarder(spool, pub, "t", window=10, clock=clock)
        for i in range(3):
            spool.append(small(i), "node-1")
        spool.append(b"{" + b"x" * 1_200_000 + b"}", "node-1")  # e.g. the `allocated` of a 2,000-node job
        for i in range(3, 6):
            spool.append(small(i), "node-1")
        pump_until_idle(fwd, clock)
        # before: delivered 3 of 6, the big record refused again at every backoff, for ever
        assert pub.values() == [small(i) for i in range(6)], "records behind a too-large one were held back"
        assert (spool.depth, spool.dropped, dropped, fwd.unsendable, pub.refused) == (0, 1, [1], 1, 1)
        assert "seq 4 (key b'node-1', 1200002 bytes) cannot be sent" in caplog.text
    with Spool(tmp_path, fsync="never") as spool:  # counted for good, nothing left to resend
        assert (spool.depth, spool.dropped) == (0, 1)


def test_a_batch_the_broker_refuses_for_one_large_record_loses_only_that_record(tmp_path: Path) -> None:
    broker = BrokerLimit(limit=1000)
    clock = Clock()
    with Spool(tmp_path, fsync="never") as spool:
        fwd = Forwarder(spool, broker, "t", window=10, clock=clock)
        for i in range(5):
            spool.append(small(i), "node-1")
        spool.append(b"y" * 5000, "node-1")
        for i in range(5, 9):
            spool.append(small(i), "node-1")
        pump_until_idle(fwd, clock)
        # before: the whole window was refused again and again, nothing delivered
        assert broker.delivered == [small(i) for i in range(9)], "good records refused with the big one were lost"
        assert (spool.depth, spool.dropped, fwd.unsendable) == (0, 1, 1)
        for i in range(9, 30):  # and sending in windows again afterwards
            spool.append(small(i), "node-1")
        refused = broker.batches_refused
        pump_until_idle(fwd, clock)
        assert broker.delivered == [small(i) for i in range(30)] and broker.batches_refused == refused


def test_a_broker_refusing_everything_drops_nothing(tmp_path: Path) -> None:
    """An error that is not about the record's size (authorization) is retried, never dropped."""

    class Denied(BrokerLimit):
        def poll(self, timeout: float = 0) -> int:
            batch, self.queue = self.queue, []
            for _, cb in batch:
                cb(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
            return len(batch)

    clock = Clock()
    with Spool(tmp_path, fsync="never") as spool:
        fwd = Forwarder(spool, Denied(limit=1000), "t", window=10, clock=clock)
        for i in range(5):
            spool.append(small(i), "node-1")
        pump_until_idle(fwd, clock, steps=20)
        assert (spool.depth, spool.dropped) == (5, 0) and fwd.resends > 0


# --------------------------------------------------------------------------- a clean stop
def test_stop_sends_what_was_spooled_after_the_last_pump(tmp_path: Path) -> None:
    pub = ListPublisher()
    with Spool(tmp_path, fsync="never") as spool:
        fwd = Forwarder(spool, pub, "t")
        for i in range(3):  # spooled on the way down, after the forwarder thread last read the spool
            spool.append(small(i), "node-1")
        assert fwd.stop(flush_s=5) == 0  # before: 3, left on disk for a next start that may never come
        assert pub.values() == [small(i) for i in range(3)] and spool.depth == 0


def test_a_stopped_agent_delivers_the_ticks_it_held_for_a_batch(tmp_path: Path) -> None:
    """`serve_ticks` on SIGTERM: run_agent spools the ticks it held for a NodeTickBatch, then closes
    the publisher. With the broker there, every sampled tick is delivered."""
    settings = SimpleNamespace(agent_spool_dir=tmp_path, data_dir=tmp_path, agent_spool_max_bytes=1 << 26,
                               agent_spool_fsync="never", topics=SimpleNamespace(gpu_samples="t"))
    made: list[ListPublisher] = []

    def factory() -> ListPublisher:
        made.append(ListPublisher())
        return made[-1]

    for attempt in range(5):  # before: the held ticks stayed in the spool in about 19 runs of 20
        publisher = open_spooled_publisher(settings, f"n{attempt}", publisher_factory=factory)
        t = [1_767_225_600.0]
        n = run_agent(SimBackend(["A100-80GB"] * 2, node=f"n{attempt}"), publisher, "t", cluster="c",
                      node=f"n{attempt}", interval_s=1.0, clock=lambda: t[0],
                      sleep=lambda s: t.__setitem__(0, t[0] + s), max_ticks=7, ticks_per_message=5)
        assert n == 7
        assert publisher.close() == 0, "ticks held for a batch stayed in the spool on a clean stop"
        assert len(made[-1].messages) == 2


# --------------------------------------------------------------------------- damage on disk
VALUE = 3_894  # with the key and header, a 3.9 KB tick: an 8-GPU node


def tick(i: int) -> bytes:
    return b"%06d" % i + b"x" * VALUE


def record_size() -> int:
    return 26 + len(b"node-1") + len(tick(0))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_bit_costs_one_record_not_the_rest_of_its_segment(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    with Spool(tmp_path, fsync="never") as spool:  # the default bound: 8 MiB segments
        for i in range(1, 2501):
            spool.append(tick(i), "node-1")
    first = sorted(tmp_path.glob("*.seg"))[0]
    flip(first, 9 * record_size() + 100)  # inside record 10's value
    with Spool(tmp_path, fsync="never") as spool:
        got = spool.read(10_000, max_bytes=1 << 30)
        # before: 376 records readable, 2,124 counted corrupt (the whole rest of the 8 MiB segment)
        assert [r.seq for r in got] == [s for s in range(1, 2501) if s != 10]
        assert [r.value for r in got[9:11]] == [tick(11), tick(12)]
        assert spool.corrupt == 1
        assert "corrupt record at byte" in caplog.text and "intact records 11..2133 after it kept" in caplog.text
        assert spool.append(tick(2501), "node-1") == 2501
    with Spool(tmp_path, fsync="never") as spool:  # counted once; the copy is an ordinary segment now
        assert spool.corrupt == 1 and spool.depth == 2500
        assert [r.seq for r in spool.read(10_000, max_bytes=1 << 30)][-2:] == [2500, 2501]


def test_damage_met_by_a_read_keeps_the_intact_records_after_it(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", segment_bytes=8 * record_size()) as spool:
        for i in range(1, 21):
            spool.append(tick(i), "node-1")
        segs = sorted(tmp_path.glob("*.seg"))
        assert len(segs) == 3
        flip(segs[1], 2 * record_size() + 50)  # record 11, in the middle segment, while the agent runs
        got = spool.read(100, max_bytes=1 << 30)
        assert [r.seq for r in got] == [s for s in range(1, 21) if s != 11]  # before: 12..16 lost as well
        assert spool.corrupt == 1
        spool.rewind()  # nothing acknowledged: read again, the damage is not counted twice
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [r.seq for r in got] and spool.corrupt == 1
        spool.ack(20)
        assert spool.depth == 0
    with Spool(tmp_path, fsync="never") as spool:
        assert (spool.corrupt, spool.depth, spool.next_seq) == (1, 0, 21)


def test_damage_in_the_active_segment_met_by_a_read_then_appends_go_on(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        for i in range(1, 6):
            spool.append(tick(i), "node-1")
        (seg,) = tmp_path.glob("*.seg")
        flip(seg, 1 * record_size() + 50)  # record 2
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [1, 3, 4, 5]
        for i in range(6, 9):  # the writer goes on after the kept records, not into the cut segment
            assert spool.append(tick(i), "node-1") == i
        assert [r.value for r in spool.read(100, max_bytes=1 << 30)] == [tick(i) for i in range(6, 9)]
    with Spool(tmp_path, fsync="never") as spool:
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [1, 3, 4, 5, 6, 7, 8]
        assert spool.corrupt == 1


def test_a_crash_between_the_copy_and_the_cut_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        for i in range(1, 31):
            spool.append(tick(i), "node-1")
        spool.ack(3)
    (seg,) = tmp_path.glob("*.seg")
    flip(seg, 9 * record_size() + 100)  # record 10
    # an agent that dies right after copying the intact records, before cutting the damaged segment
    crash = ("import os, sys; from gpuledger.agents.spool import Spool\n"
             "os.truncate = lambda *a: os._exit(9)\n"
             f"Spool({str(tmp_path)!r}, fsync='never')\n")
    assert subprocess.run([sys.executable, "-c", crash], timeout=60).returncode == 9
    assert len(list(tmp_path.glob("*.seg"))) == 2
    with Spool(tmp_path, fsync="never") as spool:
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [s for s in range(4, 31) if s != 10]
        assert spool.corrupt == 1
    with Spool(tmp_path, fsync="never") as spool:
        assert spool.depth == 26 and spool.corrupt == 1


def test_intact_records_that_cannot_be_copied_are_counted_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        for i in range(1, 11):
            spool.append(tick(i), "node-1")
    (seg,) = tmp_path.glob("*.seg")
    flip(seg, 2 * record_size() + 100)  # record 3
    real_open = os.open

    def full_disk(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full_disk)
    with Spool(tmp_path, fsync="never") as spool:  # the agent starts all the same
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [1, 2]
        assert spool.corrupt == 8 and spool.append(tick(11), "node-1") == 11
    assert "cannot save the intact records 4..10" in caplog.text
    assert not list(tmp_path.glob("*.tmp"))


def test_the_seq_of_a_damaged_last_record_is_not_given_out_again(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        for i in range(1, 11):
            spool.append(tick(i), "node-1")
    (seg,) = tmp_path.glob("*.seg")
    flip(seg, 7 * record_size() + 100)  # record 8
    flip(seg, 9 * record_size() + 100)  # record 10, the last one
    with Spool(tmp_path, fsync="never") as spool:
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [1, 2, 3, 4, 5, 6, 7, 9]
        assert spool.corrupt == 2
        assert spool.append(tick(11), "node-1") == 11  # 10 may have been sent before the damage
        assert [r.seq for r in spool.read(100, max_bytes=1 << 30)] == [11]


def test_a_zeroed_stretch_longer_than_a_few_records_is_stepped_over(tmp_path: Path) -> None:
    """A power cut with fsync=interval can leave a zero-filled hole (unwritten blocks) in a segment."""
    small_record = 26 + len(b"n") + 20
    with Spool(tmp_path, fsync="never") as spool:
        for i in range(1, 201):
            spool.append(b"%020d" % i, "n")
    (seg,) = tmp_path.glob("*.seg")
    data = bytearray(seg.read_bytes())
    hole = slice(50 * small_record + 7, 50 * small_record + 7 + 1024)  # ~22 records of zeros
    data[hole] = bytes(1024)
    seg.write_bytes(bytes(data))
    with Spool(tmp_path, fsync="never") as spool:
        got = [r.seq for r in spool.read(1000)]
        assert got[:50] == list(range(1, 51)) and got[-1] == 200
        assert len(got) + spool.corrupt == 200 and spool.corrupt <= 23


# --------------------------------------------------------------------------- a crash at any point
CHILD = r'''
import os, sys
from pathlib import Path
from gpuledger.agents.spool import Forwarder, Spool

spool_dir, root, func, k, n = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
salvage_only = n == 0
appended = open(root / "appended", "a")


class Broker:
    """Appends each message to a file (one write), then acknowledges it: a crash between the two
    leaves a message the broker has and the spool does not know it has."""

    def __init__(self):
        self.fd = os.open(root / "broker", os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def publish(self, topic, key, value, partition=None, on_delivery=None):
        os.write(self.fd, value + b"\n")
        on_delivery(None)

    def poll(self, timeout=0):
        return 0


calls = 0
owner = Path if func == "unlink" else os
real = getattr(owner, func)


def dying(*args, **kwargs):
    global calls
    calls += 1
    if calls == k:
        os._exit(9)  # the agent dies here: no clean-up, no close
    return real(*args, **kwargs)


setattr(owner, func, dying)
if salvage_only:  # only open the spool: the crash hits its recovery
    Spool(spool_dir, fsync="interval", segment_bytes=120)
    sys.exit(0)
with Spool(spool_dir, fsync="interval", segment_bytes=120) as spool:
    fwd = Forwarder(spool, Broker(), "t", window=4, batch=3)
    for i in range(n):
        value = b"v%05d" % i
        if spool.append(value, "node"):
            appended.write(value.decode() + "\n")
            appended.flush()
        if i % 3 == 2:
            fwd.pump()
    while fwd.pump():
        pass
'''


def drain(spool_dir: Path, root: Path) -> int:
    class Broker:
        def publish(self, topic, key, value, partition=None, on_delivery=None):
            with open(root / "broker", "ab") as f:
                f.write(value + b"\n")
            on_delivery(None)

        def poll(self, timeout: float = 0) -> int:
            return 0

    with Spool(spool_dir, fsync="interval", segment_bytes=120) as spool:
        fwd = Forwarder(spool, Broker(), "t", window=4, batch=3)
        while fwd.pump():
            pass
        return spool.depth


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("func", ["write", "pwrite", "fsync", "open", "close", "unlink"])
def test_a_crash_at_any_call_loses_nothing_spooled_and_keeps_the_order(tmp_path: Path, func: str) -> None:
    """The agent dies at the k-th call of `func` (appending, rolling a segment, writing the cursor,
    deleting delivered segments, acknowledging); the next agent drains the spool. Every message whose
    append returned reaches the broker, first copies in order; resends are at-least-once duplicates."""
    crashed = 0
    for k in (1, 2, 3, 5, 8, 13, 21):
        root = tmp_path / f"{func}-{k}"
        root.mkdir()
        child = subprocess.run([sys.executable, "-c", CHILD, str(root / "spool"), str(root), func, str(k), "40"],
                               timeout=60, stderr=subprocess.DEVNULL)
        crashed += child.returncode == 9
        assert drain(root / "spool", root) == 0
        got, appended = lines(root / "broker"), lines(root / "appended")
        first = list(dict.fromkeys(got))
        assert not set(appended) - set(got), f"{func} #{k}: lost {sorted(set(appended) - set(got))[:5]}"
        assert first == sorted(first), f"{func} #{k}: out of order"
    assert crashed, f"no crash point of {func} was reached"


@pytest.mark.parametrize("func", ["open", "write", "fsync", "replace", "close", "truncate"])
def test_a_crash_while_keeping_the_records_after_a_damaged_one_loses_none_of_them(tmp_path: Path, func: str) -> None:
    crashed = 0
    for k in (1, 2, 3, 4, 6):
        root = tmp_path / f"{func}-{k}"
        with Spool(root / "spool", fsync="never") as spool:  # one segment of 30 records
            for i in range(30):
                spool.append(b"v%05d" % i, "node")
            spool.ack(2)
        (seg,) = (root / "spool").glob("*.seg")
        flip(seg, 9 * (26 + 4 + 6) + 30)  # record 10 (v00009)
        child = subprocess.run([sys.executable, "-c", CHILD, str(root / "spool"), str(root), func, str(k), "0"],
                               timeout=60, stderr=subprocess.DEVNULL)
        crashed += child.returncode == 9
        assert drain(root / "spool", root) == 0
        got = lines(root / "broker")
        assert got == [f"v{i:05d}" for i in range(2, 30) if i != 9], f"{func} #{k}"
        with Spool(root / "spool", fsync="never") as spool:
            assert spool.corrupt >= 1 and spool.depth == 0
    assert crashed, f"no crash point of {func} was reached"


def test_a_too_large_record_resent_after_another_failure_is_counted_once(tmp_path: Path) -> None:
    """The window holds a record the producer refuses for its size and, before it, one the broker
    refuses for another reason: the resend after the backoff reads the big record again."""

    class Both(ProducerLimit):
        def __init__(self) -> None:
            super().__init__(limit=1000)
            self.queued: list[Any] = []
            self.deny = True

        def publish(self, topic, key, value, partition=None, on_delivery=None) -> None:
            if len(value) > self.limit:
                self.refused += 1
                raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            self.queued.append((topic, key, value, on_delivery))

        def poll(self, timeout: float = 0) -> int:
            batch, self.queued = self.queued, []
            for topic, key, value, cb in batch:
                if self.deny:
                    cb(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
                else:
                    ListPublisher.publish(self, topic, key, value, on_delivery=cb)
            return len(batch)

    pub = Both()
    clock = Clock()
    with Spool(tmp_path, fsync="never") as spool:
        fwd = Forwarder(spool, pub, "t", window=10, clock=clock)
        spool.append(small(0), "node-1")
        spool.append(b"z" * 5000, "node-1")
        spool.append(small(1), "node-1")
        fwd.pump()
        fwd.pump()  # the authorization failure resolves: rewind
        pub.deny = False
        pump_until_idle(fwd, clock)
        assert pub.values() == [small(0), small(1)]
        assert (spool.dropped, fwd.unsendable, spool.depth) == (1, 1, 0)
