"""A damaged record in the spool's last (active) segment, found by a read or on open: the
intact records after it, in its segment or appended later, are read and acknowledged, and what
the damage cost (the damaged record) is counted once, with no sequence number used twice."""

from __future__ import annotations

from pathlib import Path

from gpuledger.agents.spool import Spool


def ticks(spool: Spool, first: int, last: int) -> list[int]:
    return [spool.append(f"tick-{i:03d}".encode(), "n1") for i in range(first, last + 1)]


def values(records) -> list[str]:
    return [r.value.decode() for r in records]


def damage(directory: Path, record: int, of: int) -> None:
    """Flip a byte in the value of record `record` (1-based) of the only segment's `of` equal-sized ones."""
    (seg,) = sorted(directory.glob("*.seg"))
    data = bytearray(seg.read_bytes())
    size = len(data) // of
    data[record * size - 1] ^= 0xFF
    seg.write_bytes(bytes(data))


def test_records_appended_after_corruption_in_the_active_segment_are_read_and_acknowledged(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        ticks(spool, 1, 5)
        damage(tmp_path, 3, of=5)
        assert values(spool.read(100)) == ["tick-001", "tick-002", "tick-004", "tick-005"]
        assert spool.corrupt == 1
        spool.ack(2)
        ticks(spool, 6, 10)  # the agent goes on sampling into the same spool
        got = spool.read(100)
        assert values(got) == [f"tick-{i:03d}" for i in range(6, 11)], "intact records after a corrupt one were lost"
        assert spool.corrupt == 1
        spool.ack(got[-1].seq)
        assert (spool.depth, spool.unread, spool.oldest_unacked_ms()) == (0, 0, None)
        ticks(spool, 11, 12)
        spool.rewind()  # a failed delivery: read again from the first unacknowledged record
        assert values(spool.read(100)) == ["tick-011", "tick-012"] and spool.corrupt == 1
    with Spool(tmp_path, fsync="never") as spool:  # a restart finds nothing damaged left to count again
        assert values(spool.read(100)) == ["tick-011", "tick-012"] and spool.corrupt == 1


def test_a_rewind_before_the_corruption_counts_it_once(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        ticks(spool, 1, 5)
        damage(tmp_path, 3, of=5)
        assert values(spool.read(100)) == ["tick-001", "tick-002", "tick-004", "tick-005"]
        ticks(spool, 6, 7)
        spool.rewind()  # nothing acknowledged yet
        assert values(spool.read(100)) == ["tick-001", "tick-002", "tick-004", "tick-005", "tick-006", "tick-007"]
        assert spool.corrupt == 1


def test_corruption_in_the_last_segment_found_on_open_is_counted_and_its_seqs_not_reused(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        ticks(spool, 1, 10)
    damage(tmp_path, 3, of=10)
    after = [f"tick-{i:03d}" for i in range(4, 11)]
    with Spool(tmp_path, fsync="never") as spool:
        assert values(spool.read(100)) == ["tick-001", "tick-002", *after]
        assert spool.corrupt == 1, "the corrupt record was not counted"
        assert spool.append(b"tick-011", "n1") == 11, "a sequence number of a lost record was used again"
        assert values(spool.read(100)) == ["tick-011"]
    with Spool(tmp_path, fsync="never") as spool:  # counted once, whatever the number of restarts
        assert values(spool.read(100)) == ["tick-001", "tick-002", *after, "tick-011"]
        assert spool.corrupt == 1
        assert spool.append(b"tick-012", "n1") == 12


def test_a_damaged_length_field_still_finds_the_records_after_it(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        ticks(spool, 1, 6)
    (seg,) = sorted(tmp_path.glob("*.seg"))
    data = bytearray(seg.read_bytes())
    size = len(data) // 6
    data[2 * size + 3] = 0x7F  # record 3's body_len: now far beyond the end of the file
    seg.write_bytes(bytes(data))
    with Spool(tmp_path, fsync="never") as spool:
        assert values(spool.read(100)) == ["tick-001", "tick-002", "tick-004", "tick-005", "tick-006"]
        assert spool.corrupt == 1 and spool.append(b"x") == 7


def test_a_torn_tail_is_not_counted_as_corruption(tmp_path: Path) -> None:
    with Spool(tmp_path, fsync="never") as spool:
        ticks(spool, 1, 3)
    (seg,) = sorted(tmp_path.glob("*.seg"))
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 3)  # the agent died while writing record 3
    with Spool(tmp_path, fsync="never") as spool:
        assert values(spool.read(100)) == ["tick-001", "tick-002"]
        assert spool.corrupt == 0 and spool.append(b"x") == 3
