"""The agent's disk spool (agents/spool.py): bounded, oldest-first drops counted, order,
persistence across reopen, torn/corrupt tail recovery; and the forwarder that drains it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpuledger.agents.publisher import ListPublisher
from gpuledger.agents.spool import Forwarder, Spool, SpoolingPublisher, SpoolLocked


class Clock:
    def __init__(self, t: float = 1_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def values(records) -> list[bytes]:
    return [r.value for r in records]


def fill(spool: Spool, n: int, start: int = 0, size: int = 0) -> list[int]:
    return [spool.append(f"v{i:05d}".encode() + b"x" * size, key=b"node-1") for i in range(start, start + n)]


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("*.seg"))


# --------------------------------------------------------------------------- basics
def test_append_read_ack_in_order(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as s:
        seqs = fill(s, 5)
        assert seqs == [1, 2, 3, 4, 5] and (s.depth, s.unread) == (5, 5)
        first = s.read(2)
        assert [r.seq for r in first] == [1, 2] and values(first) == [b"v00000", b"v00001"]
        assert first[0].key == b"node-1"
        rest = s.read(100)
        assert [r.seq for r in rest] == [3, 4, 5] and s.read(10) == []
        s.ack(2)
        assert (s.depth, s.acked, s.unread) == (3, 2, 0)
        s.rewind()
        assert [r.seq for r in s.read(10)] == [3, 4, 5]
        s.ack(5)
        assert s.depth == 0 and s.oldest_unacked_ms() is None


def test_reads_continue_after_new_appends(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", segment_bytes=200) as s:
        got = []
        for i in range(50):
            s.append(b"%d" % i)
            if i % 3 == 0:
                got += values(s.read(2))
        got += values(s.read(1000))
        assert got == [b"%d" % i for i in range(50)]
        assert len(segments(tmp_path)) > 5


def test_fully_acked_segments_are_deleted(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", segment_bytes=256) as s:
        fill(s, 40, size=20)
        n = len(segments(tmp_path))
        s.ack(s.read(1000)[-1].seq)
        assert len(segments(tmp_path)) == 1 < n  # only the active segment stays
        assert s.depth == 0


def test_oldest_unacked_age(tmp_path: Path) -> None:
    clock = Clock(100.0)
    with Spool(tmp_path, fsync="never", clock=clock) as s:
        for i in range(3):
            s.append(b"x")
            clock.t += 5
        assert s.oldest_unacked_ms() == 100_000
        s.ack(1)
        assert s.oldest_unacked_ms() == 105_000


# --------------------------------------------------------------------------- bounded
def test_bounded_drops_oldest_segments_first_and_counts(tmp_path: Path) -> None:
    drops: list[int] = []
    with Spool(tmp_path, fsync="never", max_bytes=4096, segment_bytes=1024, on_drop=drops.append) as s:
        fill(s, 200, size=40)  # ~ 200 * 70 bytes: far over the bound
        assert s.bytes <= 4096
        assert s.dropped == sum(drops) > 0
        assert s.depth + s.dropped == 200
        left = s.read(1000)
        # what survives is the newest, contiguous and in order
        assert [r.seq for r in left] == list(range(200 - len(left) + 1, 201))
    with Spool(tmp_path, fsync="never", max_bytes=4096, segment_bytes=1024) as s:
        assert s.dropped == sum(drops)  # the counter survives a restart


def test_acked_records_are_not_counted_as_dropped(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", max_bytes=4096, segment_bytes=1024) as s:
        for i in range(40):  # 40 x 10 records, ~28 KB through a 4 KB spool, delivered as they go
            fill(s, 10, size=40, start=10 * i)
            s.ack(s.read(1000)[-1].seq)
        assert s.dropped == 0 and s.bytes <= 4096


def test_record_larger_than_the_spool_is_dropped_and_counted(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", max_bytes=100) as s:
        s.append(b"small")
        assert s.append(b"x" * 500) == 0
        assert s.dropped == 1 and values(s.read(10)) == [b"small"]
        assert s.append(b"next") == 2


def test_a_failing_disk_drops_and_counts_the_tick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuledger.agents.spool as spool_module

    with Spool(tmp_path, fsync="never") as s:
        s.append(b"before")
        real_write = os.write

        def full(fd: int, data: bytes) -> int:
            real_write(fd, data[:7])  # a partial write, then the disk is full
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(spool_module.os, "write", full)
        assert s.append(b"lost tick") == 0
        monkeypatch.setattr(spool_module.os, "write", real_write)
        assert s.dropped == 1
        assert s.append(b"after") == 2
        assert values(s.read(10)) == [b"before", b"after"]
    with Spool(tmp_path, fsync="never") as s:  # and the file on disk is consistent
        assert values(s.read(10)) == [b"before", b"after"]


def test_a_failed_segment_roll_drops_one_tick_and_later_appends_work(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuledger.agents.spool as spool_module

    real_open = os.open
    refuse = {"creates": 1}

    def disk_full_once(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(".seg") and flags & os.O_CREAT and refuse["creates"]:
            refuse["creates"] -= 1
            raise OSError(28, "No space left on device")
        return real_open(path, flags, *args)

    with Spool(tmp_path, fsync="never", segment_bytes=4096) as s:
        fill(s, 2, size=1500)  # the first segment has no room for a third
        monkeypatch.setattr(spool_module.os, "open", disk_full_once)
        assert s.append(b"lost tick" * 200) == 0 and s.dropped == 1
        # the spool must not hold on to a closed fd: its number is free for anyone to reuse
        bystander = real_open(__file__, os.O_RDONLY)
        try:
            assert fill(s, 3, start=2, size=1500) == [3, 4, 5]  # the disk has recovered
            os.fstat(bystander)  # still open: the spool did not close it
            assert os.readlink(f"/proc/self/fd/{bystander}") == __file__
        finally:
            os.close(bystander)
        assert s.dropped == 1
        assert [v[:6] for v in values(s.read(10))] == [b"v00000", b"v00001", b"v00002", b"v00003", b"v00004"]
    with Spool(tmp_path, fsync="never") as s:  # and the files on disk are consistent
        assert [r.seq for r in s.read(10)] == [1, 2, 3, 4, 5]


def test_a_failing_fsync_keeps_the_tick_logs_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import gpuledger.agents.spool as spool_module

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(spool_module.os, "fsync", eio)
    s = Spool(tmp_path, fsync="always", segment_bytes=4096)  # opening syncs the cursor file
    assert s.fsync_failures == 1
    # written but not synced: kept (and sent), only without the power-cut guarantee
    assert fill(s, 4, size=1500) == [1, 2, 3, 4]  # across segment rolls (old segment and directory syncs)
    assert s.dropped == 0 and s.fsync_failures > 4
    assert "cannot fsync" in caplog.text and "may not survive a power cut" in caplog.text
    s.close()  # syncs on close: logged, not raised, and the directory lock is released
    monkeypatch.undo()
    with Spool(tmp_path, fsync="always") as s:
        assert [r.seq for r in s.read(10)] == [1, 2, 3, 4] and s.fsync_failures == 0


def test_a_failing_fsync_does_not_stop_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuledger.agents.spool as spool_module
    from gpuledger.agents.gpu_agent import run_agent
    from gpuledger.agents.sim_backend import SimBackend

    with Spool(tmp_path, fsync="always") as s:
        def eio_from_the_third_tick(fd: int) -> None:
            if s.next_seq > 3:
                raise OSError(5, "Input/output error")

        monkeypatch.setattr(spool_module.os, "fsync", eio_from_the_third_tick)
        clock = Clock(1_800_000_000.0)

        def sleep(seconds: float) -> None:
            clock.t += seconds

        assert run_agent(SimBackend(["T4"]), SpoolingPublisher(s), "t", cluster="c", node="n", interval_s=5,
                         clock=clock, sleep=sleep, max_ticks=10) == 10
        assert s.depth == 10 and s.dropped == 0 and s.fsync_failures >= 8


def test_read_in_flight_segment_dropped_reader_moves_on(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never", max_bytes=2048, segment_bytes=512) as s:
        fill(s, 5, size=40)
        s.read(2)
        fill(s, 100, size=40, start=5)
        got = s.read(1000)
        assert got and [r.seq for r in got] == list(range(got[0].seq, got[0].seq + len(got)))
        assert got[-1].seq == 105 and got[0].seq > 3


# --------------------------------------------------------------------------- persistence
def test_reopen_keeps_unacked_and_cursor(tmp_path: Path) -> None:
    with Spool(tmp_path, segment_bytes=300) as s:
        fill(s, 30)
        s.read(12)
        s.ack(12)
    with Spool(tmp_path, segment_bytes=300) as s:
        assert (s.acked, s.depth) == (12, 18)
        got = s.read(1000)
        assert [r.seq for r in got] == list(range(13, 31))
        assert values(got) == [f"v{i:05d}".encode() for i in range(12, 30)]
        assert s.append(b"new") == 31  # sequence numbers continue


def test_unacked_reads_are_replayed_after_restart(tmp_path: Path) -> None:
    """Read but not acknowledged (the agent died with them in flight): sent again."""
    with Spool(tmp_path) as s:
        fill(s, 4)
        s.read(4)
        s.ack(1)
    with Spool(tmp_path) as s:
        assert [r.seq for r in s.read(10)] == [2, 3, 4]


def test_all_acked_reopen_starts_clean(tmp_path: Path) -> None:
    with Spool(tmp_path) as s:
        fill(s, 3)
        s.ack(3)
    with Spool(tmp_path) as s:
        assert s.depth == 0 and s.read(10) == [] and s.append(b"x") == 4


def test_one_process_per_spool(tmp_path: Path) -> None:
    with Spool(tmp_path):
        with pytest.raises(SpoolLocked):
            Spool(tmp_path)
    Spool(tmp_path).close()  # released on close


def test_unreadable_state_replays_everything(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Spool(tmp_path) as s:
        fill(s, 3)
        s.ack(2)
    (tmp_path / "cursor").write_bytes(b"\xff" * 128)
    with Spool(tmp_path) as s:
        assert [r.seq for r in s.read(10)] == [1, 2, 3]  # duplicates downstream, never a loss
    assert "unreadable" in caplog.text


def test_torn_cursor_write_falls_back_to_the_other_slot(tmp_path: Path) -> None:
    with Spool(tmp_path) as s:
        fill(s, 5)
        s.ack(2)
        s.ack(3)
    cursor = tmp_path / "cursor"
    data = bytearray(cursor.read_bytes())
    # spoil the slot written last (a torn write): the other, older slot is used
    last = max(range(2), key=lambda i: int.from_bytes(data[i * 64 + 24:i * 64 + 32], "little"))
    data[last * 64] ^= 0xFF
    cursor.write_bytes(bytes(data))
    with Spool(tmp_path) as s:
        assert 2 <= s.acked <= 3
        assert [r.seq for r in s.read(10)] == list(range(s.acked + 1, 6))  # maybe a duplicate, no loss


# --------------------------------------------------------------------------- torn / corrupt
def test_torn_tail_is_truncated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Spool(tmp_path) as s:
        fill(s, 5)
    seg = segments(tmp_path)[-1]
    good = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x30\x00\x00\x00\x99")  # half a header: the agent died mid-write
    with Spool(tmp_path) as s:
        assert values(s.read(10)) == [f"v{i:05d}".encode() for i in range(5)]
        assert seg.stat().st_size == good
        assert s.append(b"after") == 6
        assert values(s.read(10)) == [b"after"]
    assert "torn" in caplog.text


def test_torn_body_is_truncated(tmp_path: Path) -> None:
    with Spool(tmp_path) as s:
        fill(s, 3)
    seg = segments(tmp_path)[-1]
    os.truncate(seg, seg.stat().st_size - 2)  # last record lost its last bytes
    with Spool(tmp_path) as s:
        assert [r.seq for r in s.read(10)] == [1, 2]
        assert s.append(b"x") == 3  # the torn record was never acknowledged to anyone


def test_corrupt_tail_record_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Spool(tmp_path) as s:
        fill(s, 3)
    seg = segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF  # bit rot in the last record's value
    seg.write_bytes(bytes(data))
    with Spool(tmp_path) as s:
        assert [r.seq for r in s.read(10)] == [1, 2]
    assert "corrupt" in caplog.text


def test_corruption_in_an_old_segment_counts_the_lost_records(tmp_path: Path) -> None:
    with Spool(tmp_path, segment_bytes=200) as s:
        fill(s, 20)
    first = segments(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[40] ^= 0xFF  # inside the second record of the first segment
    first.write_bytes(bytes(data))
    with Spool(tmp_path, segment_bytes=200) as s:
        got = [r.seq for r in s.read(100)]
        assert got[0] == 1 and 2 not in got and got[-1] == 20
        assert s.corrupt == 20 - len(got)
        assert got == sorted(got)


# --------------------------------------------------------------------------- forwarder
class FlakyPublisher:
    """Collects messages; while `down`, deliveries fail when polled."""

    def __init__(self) -> None:
        self.down = False
        self.queue: list[tuple[bytes, Any]] = []
        self.delivered: list[bytes] = []

    def publish(self, topic, key, value, partition=None, on_delivery=None) -> None:
        self.queue.append((value, on_delivery))

    def poll(self, timeout: float = 0) -> int:
        if self.down:
            return 0
        n = len(self.queue)
        for value, cb in self.queue:
            self.delivered.append(value)
            cb(None)
        self.queue.clear()
        return n

    def fail_all(self, error: str = "Broker: topic authorization failed") -> None:
        for _, cb in self.queue:
            cb(error)
        self.queue.clear()


def test_forwarder_drains_in_order_and_acks(tmp_path: Path) -> None:
    pub = ListPublisher()
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, pub, "t", window=7, batch=3)
        sp = SpoolingPublisher(s, fwd)
        for i in range(20):
            sp.publish("t", "n", b"%d" % i)
        while fwd.pump():
            pass
        assert pub.values() == [b"%d" % i for i in range(20)]
        assert {k for _, k, _, _ in pub.messages} == {b"n"}
        assert (s.depth, fwd.delivered, fwd.inflight) == (0, 20, 0)
        with pytest.raises(ValueError):
            sp.publish("other-topic", "n", b"x")


def test_forwarder_window_bounds_what_is_in_flight(tmp_path: Path) -> None:
    pub = FlakyPublisher()
    pub.down = True
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, pub, "t", window=10, batch=4)
        fill(s, 100)
        for _ in range(5):
            fwd.pump()
        assert len(pub.queue) == 10 == fwd.inflight and s.depth == 100
        pub.down = False
        for _ in range(50):
            fwd.pump()
        assert pub.delivered == [f"v{i:05d}".encode() for i in range(100)] and s.depth == 0


def test_forwarder_failure_pauses_then_resends_in_order(tmp_path: Path) -> None:
    pub = FlakyPublisher()
    pub.down = True
    clock = Clock(0.0)
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, pub, "t", window=5, clock=clock)
        fill(s, 8)
        fwd.pump()
        pub.fail_all()
        assert fwd.pump() == 0 and fwd.failures == 5
        assert fwd.pump() == 0  # backing off
        clock.t += 1.5
        pub.down = False
        for _ in range(10):
            fwd.pump()
        assert pub.delivered == [f"v{i:05d}".encode() for i in range(8)]
        assert s.depth == 0 and fwd.resends == 5


def test_forwarder_replaces_a_fatally_failed_publisher(tmp_path: Path) -> None:
    made: list[Any] = []

    class Fatal(FlakyPublisher):
        fatal_error: str | None = None

        def close(self, timeout: float = 0) -> int:
            return len(self.queue)

    def factory() -> Fatal:
        made.append(Fatal())
        return made[-1]

    first = factory()
    first.down = True
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, first, "t", publisher_factory=factory)
        fill(s, 3)
        fwd.pump()
        first.fatal_error = "Broker: out of order sequence number"
        fwd.pump()
        assert len(made) == 2 and fwd.publisher is made[1]
        fwd.pump()
        assert made[1].delivered == [b"v00000", b"v00001", b"v00002"] and s.depth == 0


def test_forwarder_retries_a_replacement_producer_that_failed_to_start(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    made: list[Any] = []
    attempts = {"n": 0}

    class Fatal(FlakyPublisher):
        fatal_error: str | None = None

        def close(self, timeout: float = 0) -> int:
            return len(self.queue)

    def factory() -> Fatal:
        attempts["n"] += 1
        if attempts["n"] in (2, 3):  # the first two replacements fail (e.g. a certificate being rotated)
            raise RuntimeError("Failed to create producer: ssl.ca.location: No such file")
        made.append(Fatal())
        return made[-1]

    clock = Clock(0.0)
    first = factory()
    first.down = True
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, first, "t", publisher_factory=factory, clock=clock)
        fill(s, 3)
        fwd.pump()
        first.fatal_error = "Broker: out of order sequence number"
        assert fwd.pump() == 0  # no exception: no producer for now, the ticks wait in the spool
        assert (attempts["n"], fwd.producer_failures, s.depth) == (2, 1, 3)
        assert "cannot start a new producer" in caplog.text
        assert fwd.pump() == 0 and attempts["n"] == 2  # backing off (1 s)
        clock.t += 1.5
        assert fwd.pump() == 0 and (attempts["n"], fwd.producer_failures) == (3, 2)
        clock.t += 1.5
        assert fwd.pump() == 0 and attempts["n"] == 3  # the backoff doubled (2 s)
        clock.t += 1.0
        fwd.pump()
        assert attempts["n"] == 4 and fwd.publisher is made[1]
        fwd.pump()
        assert made[1].delivered == [b"v00000", b"v00001", b"v00002"] and s.depth == 0


def test_forwarder_thread_and_stop_keep_undelivered(tmp_path: Path) -> None:
    pub = FlakyPublisher()
    with Spool(tmp_path, fsync="never") as s:
        fwd = Forwarder(s, pub, "t").start()
        sp = SpoolingPublisher(s, fwd)
        for i in range(10):
            sp.publish("t", "n", b"%d" % i)
        assert fwd.wait_idle(5)
        pub.down = True
        for i in range(10, 15):
            sp.publish("t", "n", b"%d" % i)
        assert fwd.stop(flush_s=0.1) == 5
    with Spool(tmp_path, fsync="never") as s:  # the next run sends them
        assert values(s.read(10)) == [b"%d" % i for i in range(10, 15)]
