"""The agent's local disk spool: every tick is written here first and deleted once Kafka has it.

Why one file: the on-disk format, the queue that writes it and the forwarder that drains it share
one set of invariants (sequence numbers, cursor, segment rotation); split, each half would have to
restate them.

Losing metering data is a financial error, so the agent never hands a tick straight to
Kafka. `Spool` is a bounded, crash-safe, append-only queue on disk; `Forwarder` drains it in
order through a `KafkaPublisher` and advances the spool's read cursor only on delivery
acknowledgements. While the broker is unreachable the spool grows on disk (not in
librdkafka's memory); on reconnect it is replayed in order. A restarted agent finds the spool
where it left it.

On disk (one directory per agent, locked with flock so two agents never share it):

    00000000000000000001.seg   segment files, named by the sequence number of their first record
    00000000000000004097.seg
    cursor                     the read cursor and counters: acked, dropped, corrupt
    lock

The cursor file holds two 40-byte slots `<acked u64><dropped u64><corrupt u64><generation u64>
<crc32 u32>` (+ padding), written alternately in place: a torn write can only spoil the slot
being written, and the other one is still valid. Writing it is one `pwrite` per acknowledged
batch (no rename, no new inode), so the spool costs little CPU per tick.

A record is `<body_len u32><crc32 u32><seq u64><appended_ms i64><key_len u16>` + key + value;
the CRC covers everything after itself. Sequence numbers are consecutive across segments and
restarts. On open every segment is scanned; the first record that is torn (a crash in the
middle of a write) or fails its CRC ends its segment, which is truncated there, so a torn tail
costs at most the record being written when the agent died. The intact records after a damaged
one (found by their seq and CRC) are first copied, verbatim, into segments of their own named by
their first seq (`<name>.tmp`, synced, renamed), so the damage costs the damaged records only;
those are counted in `corrupt` and their sequence numbers are not given out again. A damaged
record met by a read is handled the same way, and appends go on after the copies or in a new
segment.

Bounded: when an append would take the spool over `max_bytes`, whole segments are deleted,
oldest first; the unacknowledged records in them are counted in `dropped` (persisted in
the cursor file, logged). Delivery is at-least-once: the cursor file is written after deliveries
are acknowledged, so a crash between the two replays a few records. The worker recognises a
second copy of a tick by (node, ts_ms), pending or already closed, and drops it as a silent
duplicate (counted, not dead-lettered; streams/join.py `NodeJoin.add_tick`), so a replayed tick is
never counted twice.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from gpuledger.agents.publisher import is_too_large

log = logging.getLogger(__name__)

_DROPPED = object()  # a forwarder entry's state: the record can never be sent and was counted as dropped

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES = ("always", "interval", "never")

_HEADER = struct.Struct("<IIQqH")  # body_len, crc32, seq, appended_ms, key_len
_CRC_FROM = 8  # the CRC covers the header from seq on, then the body
_SEGMENT_SUFFIX = ".seg"
_TMP_SUFFIX = ".tmp"
_CURSOR = "cursor"
_SLOT = struct.Struct("<QQQQI")
_SLOT_SIZE = 64
MAX_KEY_BYTES = 0xFFFF
_CHUNK = 256 * 1024

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def take_over_spool(earlier: Path, own: Path) -> bool:
    """Rename an earlier version's spool directory `earlier` to `own` (an agent's spool of a new name),
    under its lock, so that what it holds unsent is sent by the agent that now owns it (its records
    name their own topics and keys). False, logged, when another agent holds it or took it first,
    or the volume refuses: it then waits there."""
    try:
        with open(earlier / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # released when closed, after the rename
            os.rename(earlier, own)
    except OSError as exc:
        log.warning("could not take over the spool %s: %s", earlier, exc)
        return False
    log.warning("took over the spool %s of an earlier version as %s", earlier, own)
    return True


class SpoolLocked(RuntimeError):
    """Another process holds this spool directory."""


class SpoolRefused(RuntimeError):
    """The spool could not write a message (disk full or failing; `Spool.append` returned 0). A
    scheduler agent must not record it as published: its state file would say it was sent."""


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    appended_ms: int
    key: bytes
    value: bytes


@dataclass(slots=True)
class _Segment:
    first_seq: int     # from the file name
    path: Path
    size: int = 0      # valid bytes
    last_seq: int = 0  # last valid record (first_seq - 1 when empty)
    first_ms: int = 0  # append time of its first record (0 when empty)
    cut_to: int = 0    # on open: the last seq the bytes cut away at a damaged record held (0: nothing cut)
    salvaged: list["_Segment"] = field(default_factory=list)  # on open: segments of the intact records after it

    @property
    def count(self) -> int:
        return self.last_seq - self.first_seq + 1


def _segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{_SEGMENT_SUFFIX}"


def _encode(seq: int, appended_ms: int, key: bytes, value: bytes) -> bytes:
    tail = struct.pack("<QqH", seq, appended_ms, len(key)) + key + value
    return struct.pack("<II", len(key) + len(value), zlib.crc32(tail)) + tail


@dataclass(slots=True)
class _Run:
    """Consecutive intact records found after a damaged one: data[start:end] of the damaged bytes."""
    start: int
    end: int
    first_seq: int
    last_seq: int
    first_ms: int


#: How many damaged records in a row the search for the next intact one steps over.
_SEARCH_AHEAD = 64


def _after_damage(data: bytes, pos: int, last: int) -> tuple[list[_Run], int]:
    """What data[pos:], the bytes from a torn or corrupt record on, still holds, where `last` is the
    record before it: the runs of intact consecutive records after the damage (each can be copied
    verbatim into a segment of its own), and the last sequence number the bytes held (`last` when they
    hold no complete record: a torn tail). A record whose length field is damaged too is stepped over
    by finding the next intact one by its seq."""
    runs: list[_Run] = []
    while pos < len(data):
        record, nxt, why = _parse(data, pos)
        if record is not None and record.seq > last:
            if runs and runs[-1].end == pos and runs[-1].last_seq == record.seq - 1:
                runs[-1].end, runs[-1].last_seq = nxt, record.seq
            else:
                runs.append(_Run(pos, nxt, record.seq, record.seq, record.appended_ms))
            last, pos = record.seq, nxt
            continue
        if why == "corrupt":
            last += 1  # a whole record is there, only damaged
        found = []
        for seq in range(last + 1, last + 1 + _SEARCH_AHEAD):  # the next intact record, damaged ones on
            at = data.find(struct.pack("<Q", seq), pos + 1)
            while at != -1 and (at < _CRC_FROM or _parse(data, at - _CRC_FROM)[0] is None):
                at = data.find(struct.pack("<Q", seq), at + 1)
            if at != -1:
                found.append((at - _CRC_FROM, seq))
        if not found:
            break
        pos, seq = min(found)
        last = seq - 1  # what lies between was damaged
    return runs, last


def _parse(buf: bytes | memoryview, pos: int) -> tuple[Record | None, int, str | None]:
    """One record at buf[pos:]: (record, next position, None), or (None, pos, why) when the
    bytes there are incomplete ("torn") or fail the checksum ("corrupt")."""
    end_header = pos + _HEADER.size
    if end_header > len(buf):
        return None, pos, "torn"
    body_len, crc, seq, appended_ms, key_len = _HEADER.unpack_from(buf, pos)
    end = end_header + body_len
    if key_len > body_len:
        return None, pos, "corrupt"
    if end > len(buf):
        return None, pos, "torn"
    if zlib.crc32(buf[pos + _CRC_FROM:end]) != crc:
        return None, pos, "corrupt"
    key = bytes(buf[end_header:end_header + key_len])
    value = bytes(buf[end_header + key_len:end])
    return Record(seq, appended_ms, key, value), end, None


class Spool:
    """A bounded on-disk FIFO of (key, value) records with a persisted read cursor.

    Thread-safe: the agent appends from its sampling thread while a `Forwarder` reads and
    acknowledges from its own. `clock` (epoch seconds) stamps records (for the age metric).

    fsync: "always" syncs every append (a tick survives power loss once `append` returns),
    "interval" at most every `fsync_interval_s`, "never" leaves it to the OS (survives a
    process crash, not a power cut). A failed fsync is logged and counted in `fsync_failures`,
    never raised: the record is written (the OS holds it, it is read and sent as usual), it
    only lacks the power-cut guarantee."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        segment_bytes: int | None = None,
        fsync: FsyncPolicy = "always",
        fsync_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        on_drop: Callable[[int], Any] | None = None,
    ):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        # Dropping works on whole segments: keep them small against the bound.
        self.segment_bytes = segment_bytes or max(4096, min(max_bytes // 16, 8 * 1024 * 1024))
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s
        self.clock = clock
        self.on_drop = on_drop
        self._lock = threading.RLock()
        self._closed = False
        self.fsync_failures = 0  # in this process; see `_fsync`
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SpoolLocked(f"spool {self.directory} is in use by another process") from None
            raise
        self._generation = 0
        self._cursor_fd = -1
        self.acked, self.dropped, self.corrupt = self._load_state()
        self._cursor_fd = os.open(self.directory / _CURSOR, os.O_RDWR | os.O_CREAT, 0o644)
        self._segments: list[_Segment] = self._recover()
        last = self._segments[-1].last_seq if self._segments else 0
        self._next_seq = max(last, self.acked, self._seen_seq) + 1
        self._read_seq = self.acked + 1
        self._read_at: tuple[int, int] | None = None  # (segment first_seq, byte offset) of _read_seq
        self._wfd: int | None = None
        self._rfd: tuple[int, int] | None = None      # (segment first_seq, fd)
        self._last_sync = 0.0
        self._oldest: tuple[int, int] | None = None   # (acked, append ms of the record after it)
        if self._segments and self.depth:
            log.info("spool %s: %d record(s), %d bytes waiting from an earlier run", self.directory, self.depth, self.bytes)

    # ------------------------------------------------------------------ open / recover
    def _load_state(self) -> tuple[int, int, int]:
        path = self.directory / _CURSOR
        if not path.exists():
            return 0, 0, 0
        data = path.read_bytes()
        best = None
        for i in range(2):
            raw = data[i * _SLOT_SIZE:i * _SLOT_SIZE + _SLOT.size]
            if len(raw) < _SLOT.size:
                continue
            acked, dropped, corrupt, generation, crc = _SLOT.unpack(raw)
            if zlib.crc32(raw[:-4]) == crc and (best is None or generation > best[3]):
                best = (acked, dropped, corrupt, generation)
        if best is None:
            # Replaying everything still on disk is safe (duplicates are rejected downstream).
            log.error("spool %s: unreadable cursor file; replaying every record on disk", self.directory)
            return 0, 0, 0
        self._generation = best[3]
        return best[0], best[1], best[2]

    def _recover(self) -> list[_Segment]:
        for tmp in self.directory.glob("*" + _SEGMENT_SUFFIX + _TMP_SUFFIX):
            tmp.unlink(missing_ok=True)  # a salvage (`_salvage`) interrupted before its rename
        segments = []
        for path in sorted(self.directory.glob("*" + _SEGMENT_SUFFIX)):
            try:
                first = int(path.name[: -len(_SEGMENT_SUFFIX)])
            except ValueError:
                log.warning("spool %s: ignoring stray file %s", self.directory, path.name)
                continue
            segments.append(self._scan(_Segment(first, path, last_seq=first - 1)))
        damaged = [seg for seg in segments if seg.cut_to]
        segments = sorted(segments + [run for seg in damaged for run in seg.salvaged], key=lambda s: s.first_seq)
        # Records cut away now (a corrupt middle) are counted once: those of an earlier open or of a read
        # (`_skip_corrupt` cuts its segment too) were counted then. What a damaged segment held ends where
        # the next segment after its cut bytes begins (for the last segment, at what those bytes held);
        # what of it is not in a segment now (the intact records after the damage are) is lost.
        for seg in damaged:
            nxt = next((s for s in segments if s.first_seq > seg.cut_to), None)
            end = nxt.first_seq - 1 if nxt is not None else seg.cut_to
            kept_after = sum(max(0, s.last_seq - max(s.first_seq - 1, self.acked))
                             for s in segments if seg.last_seq < s.first_seq <= end)
            lost = end - max(seg.last_seq, self.acked) - kept_after
            if lost > 0:
                self.corrupt += lost
                log.error("spool %s: %d record(s) lost to corruption after seq %d%s", self.directory, lost,
                          seg.last_seq, f"; {kept_after} intact record(s) after the damage kept" if kept_after else "")
        self._seen_seq = max([s.cut_to for s in segments] + [0])  # never reuse a seq that may have been sent
        kept = []
        for seg in segments:
            if seg.size == 0 or seg.last_seq <= self.acked:
                seg.path.unlink(missing_ok=True)  # empty, or everything in it was delivered
            else:
                kept.append(seg)
        self._write_state(sync=True)
        return kept

    def _scan(self, seg: _Segment) -> _Segment:
        data = seg.path.read_bytes()
        pos, expected = 0, seg.first_seq
        while pos < len(data):
            record, nxt, why = _parse(data, pos)
            if record is None or record.seq != expected:
                why = why or f"sequence {record.seq if record else '?'} where {expected} was expected"
                runs, seg.cut_to = _after_damage(data, pos, expected - 1)
                if why == "torn" and seg.cut_to >= expected:
                    why = "damaged"  # whole records follow it: not a tail torn by a crash
                # the intact records after the damage go to segments of their own before the cut
                seg.salvaged = self._salvage(data, [r for r in runs if r.last_seq > self.acked])
                log.error("spool %s: %s record at byte %d of %s; truncating %d byte(s)%s",
                          self.directory, why, pos, seg.path.name, len(data) - pos,
                          "".join(f"; intact records {r.first_seq}..{r.last_seq} after it kept in {r.path.name}"
                                  for r in seg.salvaged))
                os.truncate(seg.path, pos)
                break
            if pos == 0:
                seg.first_ms = record.appended_ms
            seg.last_seq, pos, expected = record.seq, nxt, expected + 1
        seg.size = pos
        return seg

    def _salvage(self, data: bytes, runs: list[_Run]) -> list[_Segment]:
        """Copy each run of intact records (found after a damaged one) into a segment of its own, named
        by its first seq, before the damaged segment is cut: written to a temporary name, synced, renamed,
        so a crash leaves either the whole copy or none. A copy already there was made by an earlier
        open or read that stopped before its cut (the scan of the directory has it): it is kept as it
        is. A copy that cannot be written (disk full) is logged; its records are lost with the cut."""
        made = []
        for run in runs:
            path = self.directory / _segment_name(run.first_seq)
            if path.exists():
                continue
            tmp = path.with_name(path.name + _TMP_SUFFIX)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    chunk = memoryview(data)[run.start:run.end]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
                    self._fsync(fd, tmp.name)
                finally:
                    self._close_quietly(fd)
                os.replace(tmp, path)
            except OSError as exc:
                log.error("spool %s: cannot save the intact records %d..%d after a damaged one: %s; they are lost",
                          self.directory, run.first_seq, run.last_seq, exc)
                tmp.unlink(missing_ok=True)
                continue
            made.append(_Segment(run.first_seq, path, size=run.end - run.start, last_seq=run.last_seq,
                                 first_ms=run.first_ms))
        if made:
            self._sync_dir()  # the copies' names are durable before the damaged segment is cut
        return made

    # ------------------------------------------------------------------ state file
    def _write_state(self, sync: bool) -> None:
        self._generation += 1
        body = struct.pack("<QQQQ", self.acked, self.dropped, self.corrupt, self._generation)
        os.pwrite(self._cursor_fd, body + struct.pack("<I", zlib.crc32(body)), (self._generation % 2) * _SLOT_SIZE)
        if sync:
            self._fsync(self._cursor_fd, _CURSOR)

    def _fsync(self, fd: int, what: str) -> bool:
        """fsync `fd`; a failure is logged and counted, not raised. The data is written (the OS
        holds it: it survives an agent crash and is read back as usual), it may just not survive
        a power cut; dropping it would lose a tick that can still be delivered."""
        try:
            os.fsync(fd)
            return True
        except OSError as exc:
            self._fsync_failed(what, exc)
            return False

    def _fsync_failed(self, what: str, exc: OSError) -> None:
        self.fsync_failures += 1
        log.error("spool %s: cannot fsync %s: %s; what was written stays in the spool but may not survive "
                  "a power cut (%d fsync failure(s) so far)", self.directory, what, exc, self.fsync_failures)

    # ------------------------------------------------------------------ write side
    def append(self, value: bytes, key: bytes | str | None = None) -> int:
        """Write one record; returns its sequence number, or 0 when it was dropped and counted
        (larger than the whole spool, or the disk refused it). Durable per the fsync policy
        when it returns."""
        key_b = key.encode() if isinstance(key, str) else (key or b"")
        if len(key_b) > MAX_KEY_BYTES:
            raise ValueError(f"key longer than {MAX_KEY_BYTES} bytes")
        with self._lock:
            self._check_open()
            now_ms = int(self.clock() * 1000)
            seq = self._next_seq
            blob = _encode(seq, now_ms, key_b, value)
            if len(blob) > self.max_bytes:
                # Cannot ever fit: count it as dropped rather than emptying the whole spool for it.
                self._count_dropped(1, f"record of {len(blob)} bytes is larger than the spool ({self.max_bytes})")
                return 0
            active = self._segments[-1] if self._segments else None
            try:
                # A segment cut at a damaged record (on open, or by a read) ends there: the next seq
                # does not follow its last record, and a seq gap inside a segment would read as corruption.
                if (active is None or (active.size and active.size + len(blob) > self.segment_bytes)
                        or active.last_seq != seq - 1):
                    active = self._roll(seq)
                elif self._wfd is None:  # reopened: go on writing the last segment
                    self._wfd = os.open(active.path, os.O_WRONLY | os.O_APPEND)
                self._make_room(len(blob))
                written = os.write(self._wfd, blob)  # one write per record: a crash tears at most this one
                if written != len(blob):
                    raise OSError(errno.ENOSPC, f"short write ({written} of {len(blob)} bytes)")
            except OSError as exc:
                # The disk is full or failing: this tick is lost. Count it, keep the spool consistent.
                if active is not None and self._wfd is not None:
                    try:
                        os.truncate(active.path, active.size)
                    except OSError:
                        pass
                self._count_dropped(1, f"cannot write the spool: {exc}")
                return 0
            if active.size == 0:
                active.first_ms = now_ms
            active.size += len(blob)
            active.last_seq = seq
            self._next_seq = seq + 1
            self._sync_after_write(active)  # a failed fsync keeps the tick (logged, counted): it is written
            return seq

    def _roll(self, first_seq: int) -> _Segment:
        seg = _Segment(first_seq, self.directory / _segment_name(first_seq), last_seq=first_seq - 1)
        # Open the new segment before letting go of the old one: when the open fails (disk full,
        # no inodes, EMFILE) `_wfd` still holds a live fd and the next append tries again. A
        # closed fd kept here would fail every later write (EBADF) or, once the number is reused,
        # write into and close someone else's file.
        new_fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        old_fd, self._wfd = self._wfd, new_fd
        self._segments.append(seg)
        if old_fd is not None:
            if self.fsync != "never":
                self._fsync(old_fd, "a full segment")
            self._close_quietly(old_fd)
        if self.fsync != "never":
            self._sync_dir()
        return seg

    def _close_quietly(self, fd: int) -> None:
        """Close an fd we are done with. Linux releases the fd even when close reports an error,
        so there is nothing to retry: log it and go on (the data was written before)."""
        try:
            os.close(fd)
        except OSError as exc:
            log.error("spool %s: closing a file: %s", self.directory, exc)

    def _make_room(self, need: int) -> None:
        """Delete the oldest segments (never the active one) until `need` more bytes fit."""
        total = self.bytes
        while total + need > self.max_bytes and len(self._segments) > 1:
            seg = self._segments.pop(0)
            lost = seg.last_seq - max(seg.first_seq - 1, self.acked)
            total -= seg.size
            self._close_reader_if(seg.first_seq)
            seg.path.unlink(missing_ok=True)
            if lost > 0:
                self.acked = max(self.acked, seg.last_seq)  # nothing before the next segment is left to send
                self._count_dropped(lost, f"spool full ({self.max_bytes} bytes): dropped the oldest segment "
                                          f"(seq {seg.first_seq}..{seg.last_seq})")
            if self._read_seq <= seg.last_seq:
                self._read_seq, self._read_at = seg.last_seq + 1, None

    def count_dropped(self, n: int, why: str) -> None:
        """Count `n` records as lost (persisted, logged at ERROR with `why`, `on_drop`): for records
        the spool holds but that can never be delivered (the forwarder's unsendable ones)."""
        with self._lock:
            self._count_dropped(n, why)

    def _count_dropped(self, n: int, why: str) -> None:
        self.dropped += n
        log.error("spool %s: %s; %d record(s) lost, %d in total", self.directory, why, n, self.dropped)
        try:
            self._write_state(sync=self.fsync != "never")
        except OSError as exc:
            log.error("spool %s: cannot write the cursor file: %s", self.directory, exc)
        if self.on_drop is not None:
            self.on_drop(n)

    def _sync_after_write(self, seg: _Segment) -> None:
        if self._wfd is None:
            return
        if self.fsync == "always":
            self._fsync(self._wfd, seg.path.name)
        elif self.fsync == "interval":
            now = time.monotonic()
            if now - self._last_sync >= self.fsync_interval_s:
                self._last_sync = now  # after a failure too: a failing disk is retried each interval, not each tick
                self._fsync(self._wfd, seg.path.name)

    def _sync_dir(self) -> None:
        """Make a new segment's directory entry durable (best effort, like `_fsync`)."""
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError as exc:
            self._fsync_failed("the spool directory", exc)
            return
        try:
            self._fsync(fd, "the spool directory")
        finally:
            self._close_quietly(fd)

    # ------------------------------------------------------------------ read side
    def read(self, max_records: int = 100, max_bytes: int = 1 << 20) -> list[Record]:
        """The next records after the read position (at least one if any is waiting), in order.

        Reading removes nothing: `ack(seq)` once they are delivered, or `rewind()` to read the
        unacknowledged ones again."""
        out: list[Record] = []
        size = 0
        with self._lock:
            self._check_open()
            while len(out) < max_records and size < max_bytes:
                seg = self._segment_for(self._read_seq)
                if seg is None:
                    break
                if self._read_at is None or self._read_at[0] != seg.first_seq:
                    self._read_at = (seg.first_seq, self._offset_of(seg, self._read_seq))
                off = self._read_at[1]
                fd = self._reader(seg)
                chunk = os.pread(fd, min(seg.size - off, max(_CHUNK, max_bytes - size)), off)
                pos, skipped = 0, False
                while len(out) < max_records and size < max_bytes and pos < len(chunk):
                    record, nxt, why = _parse(chunk, pos)
                    if record is None and why == "torn" and pos == 0 and len(chunk) >= _HEADER.size:
                        # a single record larger than the chunk: read exactly that record (never past
                        # the segment's end: a damaged length field may say up to 4 GiB)
                        chunk = os.pread(fd, min(_HEADER.size + _HEADER.unpack_from(chunk, 0)[0], seg.size - off), off)
                        record, nxt, why = _parse(chunk, 0)
                    if record is None and why == "torn" and pos > 0:
                        break  # the chunk ended inside a record: read on from there
                    if record is None or record.seq != self._read_seq:
                        self._skip_corrupt(seg, off + pos)
                        skipped = True
                        break
                    out.append(record)
                    size += len(record.value)
                    pos = nxt
                    self._read_seq = record.seq + 1
                if not skipped:
                    self._read_at = (seg.first_seq, off + pos)  # kept at a segment's end: appends go on there
                    if pos == 0:
                        break  # no progress (cannot happen with a consistent index; never spin)
        return out

    def _segment_for(self, seq: int) -> _Segment | None:
        for seg in self._segments:
            if seg.last_seq >= seq:
                if seq < seg.first_seq:
                    self._read_seq = seg.first_seq  # a gap (dropped or corrupt): go on after it
                return seg
        return None

    def _offset_of(self, seg: _Segment, seq: int) -> int:
        if seq <= seg.first_seq:
            return 0
        data = os.pread(self._reader(seg), seg.size, 0)
        pos = 0
        while pos < len(data):
            record, nxt, _ = _parse(data, pos)
            if record is None or record.seq >= seq:
                break
            pos = nxt
        return pos

    def _reader(self, seg: _Segment) -> int:
        if self._rfd is None or self._rfd[0] != seg.first_seq:
            self._close_reader_if(None)
            self._rfd = (seg.first_seq, os.open(seg.path, os.O_RDONLY))
        return self._rfd[1]

    def _close_reader_if(self, first_seq: int | None) -> None:
        if self._rfd is not None and (first_seq is None or self._rfd[0] == first_seq):
            fd, self._rfd = self._rfd[1], None  # forget it first: never keep a closed fd
            self._close_quietly(fd)

    def _skip_corrupt(self, seg: _Segment, at: int) -> None:
        """The record at byte `at` of `seg` (seq `_read_seq`) is damaged: the intact records after it
        are copied into segments of their own (`_salvage`), the segment is cut there, and what is in
        neither is counted lost. Cut, disk and index agree: a rewind or a restart finds no corruption to
        count again, and appends go on after the copies or in a new segment (`append`), where reads find
        them."""
        data = os.pread(self._reader(seg), seg.size - at, at)
        runs, _ = _after_damage(data, 0, self._read_seq - 1)
        runs = [r for r in runs if r.last_seq <= seg.last_seq]
        salvaged = self._salvage(data, runs)
        lost = seg.last_seq - self._read_seq + 1 - sum(s.count for s in salvaged)
        log.error("spool %s: corrupt record at seq %d in %s; skipping %d record(s)%s",
                  self.directory, self._read_seq, seg.path.name, lost,
                  "".join(f"; intact records {s.first_seq}..{s.last_seq} after it kept in {s.path.name}"
                          for s in salvaged))
        self.corrupt += lost
        if salvaged and seg is self._segments[-1] and self._wfd is not None:
            # appends go on in the last copy (its last record is the last one written), not after the cut
            fd, self._wfd = self._wfd, None
            self._close_quietly(fd)
        try:
            os.truncate(seg.path, at)
        except OSError as exc:  # the index is cut all the same; a restart finds the damage and cuts it then
            log.error("spool %s: cannot truncate %s: %s", self.directory, seg.path.name, exc)
        else:
            seg.size = at
        seg.last_seq = self._read_seq - 1
        i = self._segments.index(seg) + 1
        self._segments[i:i] = salvaged
        self._read_at = None  # `_segment_for` steps over the gap to the next record there is
        self._write_state(sync=False)

    def ack(self, seq: int) -> None:
        """Every record up to and including `seq` is delivered: advance and persist the cursor,
        delete segments with nothing left to send."""
        with self._lock:
            self._check_open()
            if seq <= self.acked:
                return
            self.acked = max(self.acked, min(seq, self._next_seq - 1))
            while len(self._segments) > 1 and self._segments[0].last_seq <= self.acked:
                seg = self._segments.pop(0)
                self._close_reader_if(seg.first_seq)
                seg.path.unlink(missing_ok=True)
            self._write_state(sync=False)  # a stale cursor after a power cut only means duplicates

    def rewind(self) -> None:
        """Read again from the first unacknowledged record (after failed deliveries)."""
        with self._lock:
            self._read_seq, self._read_at = self.acked + 1, None

    # ------------------------------------------------------------------ state
    @property
    def depth(self) -> int:
        """Records not yet acknowledged."""
        with self._lock:
            return sum(max(0, s.last_seq - max(s.first_seq - 1, self.acked)) for s in self._segments)

    @property
    def bytes(self) -> int:
        """Bytes on disk in segment files (acknowledged records included until their segment goes)."""
        with self._lock:
            return sum(s.size for s in self._segments)

    @property
    def unread(self) -> int:
        """Records not yet handed out by `read`."""
        with self._lock:
            return sum(max(0, s.last_seq - max(s.first_seq, self._read_seq) + 1) for s in self._segments)

    def oldest_unacked_ms(self) -> int | None:
        """Append time of the oldest unacknowledged record (None when none is waiting)."""
        with self._lock:
            if self._oldest is not None and self._oldest[0] == self.acked:
                return self._oldest[1]
            for seg in self._segments:
                if seg.last_seq > self.acked:
                    if seg.first_seq > self.acked:
                        ms = seg.first_ms
                    else:
                        off = self._offset_of(seg, self.acked + 1)
                        record, _, _ = _parse(os.pread(self._reader(seg), _CHUNK, off), 0)
                        ms = record.appended_ms if record else seg.first_ms
                    self._oldest = (self.acked, ms)
                    return ms
            return None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("spool is closed")

    def close(self) -> None:
        """Sync, persist the cursor and release the directory. A failing disk is logged, not
        raised: the files and the lock are released all the same."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._wfd is not None:
                    fd, self._wfd = self._wfd, None
                    if self.fsync != "never":
                        self._fsync(fd, "the last segment")
                    self._close_quietly(fd)
                self._close_reader_if(None)
                self._write_state(sync=self.fsync != "never")
            except OSError as exc:
                # The cursor on disk stays at its last write: the next start resends a few ticks (no loss).
                log.error("spool %s: cannot write the cursor file on close: %s", self.directory, exc)
            finally:
                self._close_quietly(self._cursor_fd)
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                self._close_quietly(self._lock_fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- the drain
class Forwarder:
    """Drains a `Spool` into Kafka, in order, acknowledging records only on delivery.

    At most `window` records are in flight (handed to the producer, not yet acknowledged), so
    librdkafka's queue stays bounded whatever the outage; the rest waits on disk. Use a producer
    with `message.timeout.ms=0` (retry forever, `SPOOL_PRODUCER_OVERRIDES`): with a finite
    timeout a later message can succeed after an earlier one timed out, and re-sending the
    earlier one would put it behind its successor — the worker would then reject it as late.
    When a delivery fails anyway (a non-retriable broker error) the forwarder stops sending,
    waits for everything in flight to resolve, then re-reads from the first unacknowledged
    record after a backoff (1 s doubling to `max_backoff_s`). A producer that failed fatally is
    replaced through `publisher_factory`; when that fails too (counted in `producer_failures`),
    it is tried again after the same backoff while the records wait in the spool.

    A record refused for its size (larger than the producer's or the broker's message limit) can
    never be sent, and resending it for ever would hold back every record after it: it is dropped,
    logged and counted in the spool's `dropped` (`unsendable`). The client's own refusal at
    `produce()` is that record's alone; a broker's refusal may be of a whole batch, so the records
    up to it are first resent one at a time, and only one refused on its own is dropped.

    `stop()` sends what the spool still holds (the last ticks, spooled as the agent stopped) for up
    to `flush_s` while the broker takes them; what it cannot send stays for the next start.

    Single-threaded by design: `pump()` does one non-blocking step; `start()` runs it in a
    daemon thread that polls the producer while deliveries are outstanding."""

    def __init__(
        self,
        spool: Spool,
        publisher: Any,
        topic: str,
        *,
        window: int = 1000,
        batch: int = 500,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: Any = None,
        publisher_factory: Callable[[], Any] | None = None,
    ):
        self.spool = spool
        self._publisher_factory = publisher_factory
        self.publisher = publisher
        self.topic = topic
        self.window = window
        self.batch = batch
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.metrics = metrics
        # [seq, None | True | _DROPPED | error, refused for its size, key, value bytes]
        self._inflight: collections.deque[list[Any]] = collections.deque()
        self._isolate_until = 0  # resend one record at a time up to this seq (after a broker's size refusal)
        self._dropped_seqs: set[int] = set()  # dropped but not acknowledged yet: a resend skips them, uncounted
        self._failing = False
        self._backoff_s = 0.0
        self._resume_at = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.failures = 0
        self.resends = 0
        self.producer_failures = 0  # replacement producers that could not be made
        self.unsendable = 0  # records dropped because no broker takes them (too large)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def wake(self) -> None:
        self._wake.set()

    def _delivery(self, entry: list[Any]) -> Callable[[Any], None]:
        def done(err: Any) -> None:
            if err is None:
                entry[1] = True
                return
            entry[1] = str(err) or "delivery failed"
            entry[2] = is_too_large(err)
            self.failures += 1
            if self.metrics is not None:
                self.metrics.delivery_failed()
        return done

    def _drop(self, entry: list[Any], why: str) -> None:
        """The record of `entry` can never be sent: count it as dropped (the spool's `dropped`, logged
        there with the reason) and let the acknowledgement move past it."""
        entry[1] = _DROPPED
        if entry[0] in self._dropped_seqs:  # read again after a rewind: counted the first time
            return
        self._dropped_seqs.add(entry[0])
        self.unsendable += 1
        key = entry[3]
        self.spool.count_dropped(1, f"record seq {entry[0]} (key {key!r}, {entry[4]} bytes) cannot be sent "
                                    f"and is dropped: {why}")

    def _settle(self) -> None:
        """Acknowledge the delivered prefix; after a failure, rewind once nothing is in flight."""
        inflight = self._inflight
        if (self._isolate_until and len(inflight) == 1 and inflight[0][2]
                and inflight[0][1] not in (None, True, _DROPPED)):
            # sent on its own and still refused for its size: this record can never be sent
            self._drop(inflight[0], f"refused on its own by the broker ({inflight[0][1]})")
        last_ok, n = None, 0
        while inflight and (inflight[0][1] is True or inflight[0][1] is _DROPPED):
            entry = inflight.popleft()
            last_ok = entry[0]
            n += entry[1] is True
        if last_ok is not None:
            self.spool.ack(last_ok)
            self.delivered += n
            if self._dropped_seqs:
                self._dropped_seqs = {seq for seq in self._dropped_seqs if seq > last_ok}
            if self.metrics is not None and n:
                self.metrics.published(n)
            if self._isolate_until and last_ok >= self._isolate_until:
                self._isolate_until = 0
                log.warning("spool forwarder: past the records refused for their size; sending in windows again")
        if not self._failing:
            failed = next((e for e in inflight if e[1] is not _DROPPED and e[1] not in (None, True)), None)
            if failed is None:
                if last_ok is not None:
                    self._backoff_s = 0.0
                return
            self._failing = True
            log.error("spool forwarder: delivery of seq %d failed (%s); pausing", failed[0], failed[1])
        if all(e[1] is not None for e in inflight):
            # Everything in flight has resolved: start again from the first unacknowledged record.
            too_large = [e[0] for e in inflight if e[2]]
            if too_large:
                # The broker refused a batch for its size: it may be one record's fault, or only the
                # batch's. Resend one at a time up to it, so that only a record refused alone is dropped.
                self._isolate_until = max(self._isolate_until, *too_large)
                log.warning("spool forwarder: the broker refused seq %d for its size; resending one record at a "
                            "time up to it", max(too_large))
            self.resends += len(inflight)
            inflight.clear()
            self.spool.rewind()
            self._backoff_s = min(self.max_backoff_s, max(1.0, self._backoff_s * 2))
            self._resume_at = self.clock() + self._backoff_s
            self._failing = False
            log.warning("spool forwarder: resending from seq %d in %.0fs", self.spool.acked + 1, self._backoff_s)

    def _usable_publisher(self) -> bool:
        """A fatal producer error (e.g. the idempotent producer lost its sequence) makes the
        producer useless: drop it and resend from the first unacknowledged record through a new
        one. Returns False while there is no producer (making one failed; retried after a backoff)."""
        if self.publisher is not None:
            error = getattr(self.publisher, "fatal_error", None)
            if error is None or self._publisher_factory is None:
                return True
            log.error("spool forwarder: fatal producer error (%s); starting a new producer", error)
            old, self.publisher = self.publisher, None
            try:
                old.close(0)
            except Exception:
                log.exception("closing the failed producer")
            self._inflight.clear()
            self.spool.rewind()
        if self._publisher_factory is None or self.clock() < self._resume_at:
            return False
        try:
            self.publisher = self._publisher_factory()
        except Exception as exc:
            # e.g. a certificate being rotated: the ticks wait in the spool, try again later
            self.producer_failures += 1
            self._backoff_s = min(self.max_backoff_s, max(1.0, self._backoff_s * 2))
            self._resume_at = self.clock() + self._backoff_s
            log.error("spool forwarder: cannot start a new producer (%s); retrying in %.0fs, %d failure(s) so far",
                      exc, self._backoff_s, self.producer_failures)
            return False
        return True

    def pump(self) -> int:
        """Serve delivery reports, acknowledge, and hand more records to the producer; returns
        how many were handed over."""
        if not self._usable_publisher():
            return 0
        self.publisher.poll(0)
        self._settle()
        sent, dropped = 0, False
        if self._failing or self.clock() < self._resume_at:
            return 0
        window = 1 if self._isolate_until else self.window
        while len(self._inflight) < window:
            records = self.spool.read(min(self.batch, window - len(self._inflight)))
            if not records:
                break
            for rec in records:
                entry = [rec.seq, None, False, rec.key, len(rec.value)]
                self._inflight.append(entry)
                if rec.seq in self._dropped_seqs:  # dropped before a rewind: not sent, not counted again
                    entry[1] = _DROPPED
                    dropped = True
                    continue
                try:
                    self.publisher.publish(self.topic, rec.key or None, rec.value, on_delivery=self._delivery(entry))
                except Exception as exc:  # PublishError (queue full, closed), a fatal producer
                    if is_too_large(exc):  # the client refuses this record for its size: it never will take it
                        self._drop(entry, f"larger than the producer's message limit ({exc})")
                        dropped = True
                        continue
                    entry[1] = f"not queued: {exc}"
                    self._settle()
                    return sent
                sent += 1
        if sent or dropped:
            self.publisher.poll(0)
            self._settle()
        return sent

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing left in the spool."""
        return not self._inflight and self.spool.depth == 0

    # ------------------------------------------------------------------ thread
    def run(self, poll_s: float = 0.05, idle_s: float = 1.0) -> None:
        while not self._stop.is_set():
            try:
                self.pump()
            except Exception:
                log.exception("spool forwarder step failed; retrying")
                self._stop.wait(1.0)
                continue
            if self._inflight:
                self.publisher.poll(poll_s)  # blocks until a delivery report or poll_s
            else:
                wait = idle_s
                if self._resume_at:
                    wait = max(0.0, min(idle_s, self._resume_at - self.clock()))
                self._wake.wait(wait)
                self._wake.clear()

    def start(self) -> Forwarder:
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="spool-forwarder", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_s: float = 10.0, close_publisher: bool = False) -> int:
        """Stop the thread; for up to `flush_s`, send what the spool still holds (the last records,
        spooled as the agent stopped, which the thread may not have read yet) and wait for their
        deliveries, until a delivery fails; acknowledge what arrived (and close the publisher if
        asked). Returns the records still waiting in the spool (kept for the next start)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        deadline = time.monotonic() + flush_s
        while time.monotonic() < deadline:
            unread = self.spool.unread
            try:
                self.pump()
            except Exception:
                log.exception("spool forwarder: sending the spool's last records failed; they stay in the spool")
                break
            if self._failing or self.publisher is None:
                break
            if not self._inflight and self.spool.unread in (0, unread):
                break  # all sent and acknowledged, or nothing more can go now (backing off): the rest waits on disk
            if self._inflight:
                self.publisher.poll(0.05)
        self._settle()
        if close_publisher and self.publisher is not None and hasattr(self.publisher, "close"):
            try:
                self.publisher.close(0)  # what is still in flight stays in the spool
            except Exception:
                log.exception("closing the producer")
            self._settle()
        left = self.spool.depth
        if left:
            log.info("spool forwarder stopped: %d tick(s) stay in the spool for the next start", left)
        return left

    def wait_idle(self, timeout_s: float) -> bool:
        """For tests and shutdown: wait until the spool is drained."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle:
                return True
            self._wake.set()
            time.sleep(0.02)
        return self.idle


class SpoolingPublisher:
    """What `run_agent` publishes into when the spool is on: append to the spool, wake the
    forwarder. The topic is the forwarder's (the agent has one)."""

    def __init__(self, spool: Spool, forwarder: Forwarder | None = None):
        self.spool = spool
        self.forwarder = forwarder

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> int:
        """Returns the record's seq, 0 when the spool dropped it (counted and logged there). The GPU
        agent carries on without that tick (docs/reliability.md); a scheduler agent must not save its
        state over it (agents/kubernetes_agent.py `SpooledRoutes`)."""
        if self.forwarder is not None and topic != self.forwarder.topic:
            raise ValueError(f"spooled agent publishes to {self.forwarder.topic}, not {topic}")
        seq = self.spool.append(value, key)
        if self.forwarder is not None:
            self.forwarder.wake()
        return seq

    def poll(self, timeout: float = 0) -> int:
        return 0

    def close(self, timeout: float = 10.0) -> int:
        """Stop the forwarder (up to `timeout` for deliveries in flight), close its producer and
        the spool; returns the ticks left in the spool."""
        left = self.forwarder.stop(flush_s=timeout, close_publisher=True) if self.forwarder is not None else self.spool.depth
        self.spool.close()
        return left
