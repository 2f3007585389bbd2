"""The ledger's acceptance rules, pure: one module that the worker and the sink both import, so
they accept and reject by the same rules (docs/reliability.md, "Bad input").

- a tick's GPU list: no GPU twice, no two GPUs at one index, no more memory used than the GPU has;
- the time window: nothing before 2000-01-01; nothing more than `max_ahead_ms` ahead of the
  lifecycle watermark, nor ahead of the receiving process's wall clock (`now_ms`, passed in by the
  caller: the judgement also holds before the first watermark); a GPU sample no more than
  `clock_ahead_ms` ahead of that clock (a node's clock out of sync, docs/reliability.md), and a
  lifecycle event or watermark neither (`watermark_problem`: a promise about events still to come);
- values that cannot be stored: integers outside their ClickHouse column's range (sql/*.sql),
  floats that are not finite or absurdly large (a lifecycle event's too: `event_values_problem`);
- dead letters that fit their topic: an oversized original is cut, with its size and SHA-256 kept.

No I/O and no clock here: every time is given by the caller.
"""

from __future__ import annotations

import hashlib
import math

import orjson

#: Nothing the ledger meters happened before 2000-01-01T00:00:00Z.
MIN_EVENT_MS = 946_684_800_000
DAY_MS = 86_400_000

#: Integer columns narrower than Int64, by name (the same name has the same type in every table).
INT_RANGES: dict[str, tuple[int, int]] = {
    "schema_version": (0, 2**8 - 1),
    "attempt": (0, 2**32 - 1),
    "pending_jobs": (0, 2**32 - 1),
    "pending_jobs_by_priority": (0, 2**32 - 1),
    "pending_priorities": (-(2**31), 2**31 - 1),
    "priority": (-(2**31), 2**31 - 1),
    "queue_priority": (-(2**31), 2**31 - 1),
    "share_milli": (0, 2**16 - 1),
    "gpu_share_milli": (0, 2**16 - 1),
    "gpu_count": (0, 2**16 - 1),
    "kafka_partition": (-(2**31), 2**31 - 1),
    "xid_errors": (0, 2**32 - 1),  # gpu_health: Array(UInt32); the schema bounds no Xid code
    "job_attempts": (0, 2**32 - 1),  # reclaim_suggestions (sql/0019), unbounded in the schema too
    "waiting_jobs": (0, 2**32 - 1),
    "waiting_priority": (-(2**31), 2**31 - 1),
}
INT64 = (-(2**63), 2**63 - 1)
#: Floats above this are no GPU count, power, energy or price the ledger can mean (and sums of them
#: would lose every digit that matters).
MAX_FLOAT = 1e15


#: how far a GPU sample, lifecycle event or watermark may be ahead of the receiving process's clock
#: (GPULEDGER_MAX_CLOCK_AHEAD_S)
CLOCK_AHEAD_MS = 300_000
#: how far any input may be ahead of the lifecycle watermark or the clock (GPULEDGER_WORKER_MAX_AHEAD_S)
MAX_AHEAD_MS = 7 * DAY_MS


def time_problem(what: str, ts_ms: int, watermark_ms: int, max_ahead_ms: int, now_ms: int | None = None,
                 clock_ahead_ms: int | None = None) -> str | None:
    """The time window: the reason `ts_ms` is unusable, or None. `watermark_ms` 0 means none yet;
    `now_ms` None means no wall-clock judgement (tools replaying recorded data). `clock_ahead_ms`: how
    far ahead of `now_ms` is allowed (None: `max_ahead_ms`); GPU samples are held to the node's
    clock being in sync, since the worker holds a tick until the watermark reaches it (a node a day
    ahead would stall its partition for that day)."""
    if ts_ms < MIN_EVENT_MS:
        return f"absurd timestamp: {what} ts_ms={ts_ms} is before 2000-01-01"
    if watermark_ms and ts_ms > watermark_ms + max_ahead_ms:
        return (f"absurd timestamp: {what} ts_ms={ts_ms} is {(ts_ms - watermark_ms) / DAY_MS:.1f} days ahead of the "
                f"lifecycle watermark {watermark_ms} (at most {max_ahead_ms / DAY_MS:g} allowed)")
    if now_ms is not None and clock_ahead_ms is not None and ts_ms > now_ms + clock_ahead_ms:
        return (f"clock ahead: {what} ts_ms={ts_ms} is {(ts_ms - now_ms) / 1000:.0f} s ahead of the clock at "
                f"receipt {now_ms} (at most {clock_ahead_ms / 1000:g} s allowed): is the node's clock in sync (NTP)?")
    if now_ms is not None and ts_ms > now_ms + max_ahead_ms:
        return (f"absurd timestamp: {what} ts_ms={ts_ms} is {(ts_ms - now_ms) / DAY_MS:.1f} days ahead of the "
                f"clock at receipt {now_ms} (at most {max_ahead_ms / DAY_MS:g} allowed)")
    return None


def watermark_problem(cluster: str, ts_ms: int, max_ahead_ms: int, now_ms: int | None,
                      clock_ahead_ms: int = CLOCK_AHEAD_MS) -> str | None:
    """Why a lifecycle watermark is unusable, or None. A watermark promises that every event of its
    cluster before `ts_ms` has been published, so one ahead of the clock at receipt promises what has
    not happened yet: accepted, it closed every tick of every node at once, for good (the clock never
    goes back), so every allocation change after it came late (docs/reliability.md, "Bad input").
    Held to the scheduler agent's clock being in sync, as GPU samples are (`clock_ahead_ms`); never
    judged by the partition's watermark (a watermark is what moves it: a cluster back after a long
    outage would be refused for ever)."""
    return time_problem(f"watermark of cluster {cluster}", ts_ms, 0, max_ahead_ms, now_ms, clock_ahead_ms)


def tick_gpus_problem(tick) -> str | None:
    """Why a tick's GPU list is unusable, or None: a GPU listed twice (its time would count twice), two
    GPUs at one device index (an allocation by index would name either) or more memory used than the
    GPU has. `tick`: a NodeTick or MeteredTick."""
    seen: set[str] = set()
    indexes: set[int] = set()
    for gpu in tick.gpus:
        if gpu.gpu_uuid in seen:
            return f"inconsistent tick: {tick.node} ts_ms={tick.ts_ms} lists GPU {gpu.gpu_uuid} twice"
        seen.add(gpu.gpu_uuid)
        if gpu.index is not None:
            if gpu.index in indexes:
                return f"inconsistent tick: {tick.node} ts_ms={tick.ts_ms} lists two GPUs at index {gpu.index}"
            indexes.add(gpu.index)
        used, total = gpu.mem_used_bytes, gpu.mem_total_bytes
        if used is not None and total is not None and used > total:
            return f"inconsistent tick: {tick.node} GPU {gpu.gpu_uuid} uses {used} bytes of {total}"
    return None


def _value_problem(table: str, column: str, value) -> str | None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        lo, hi = INT_RANGES.get(column, INT64)
        if not lo <= value <= hi:
            return f"value cannot be stored: {table}.{column}={value} is outside [{lo}, {hi}]"
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            return f"value cannot be stored: {table}.{column}={value} is not a finite number up to {MAX_FLOAT:g}"
        return None
    if isinstance(value, (list, tuple)):
        for v in value:
            problem = _value_problem(table, column, v)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for v in value.values():
            problem = _value_problem(table, column, v)
            if problem:
                return problem
    return None


def rows_problem(rows_by_table: dict[str, list[dict]]) -> str | None:
    """The first value of one message's rows that its column cannot hold, or None."""
    for table, rows in rows_by_table.items():
        for row in rows:
            for column, value in row.items():
                problem = _value_problem(table, column, value)
                if problem:
                    return problem
    return None


def event_values_problem(event) -> str | None:
    """The first number of a lifecycle event (a JobEvent) that its `job_events` column cannot hold, or
    None. Judged by the worker before the event is routed: the sink refuses such an event, and its
    attempt in a usage record made the sink refuse the node's whole usage batch (every job's GPU
    time of that window), after the worker had billed it."""
    return rows_problem({"job_events": [{"attempt": event.attempt, "priority": event.priority,
                                         "requested_gpus": event.requested_gpus}]})


#: Room left under the topic's message size for the letter's own fields and Kafka's overhead.
LETTER_OVERHEAD = 8 * 1024
MAX_REASON = 4096


def dead_letter(topic: str, partition: int, offset: int, raw: bytes | None, reason: str, *, seen_ms: int,
                max_bytes: int) -> bytes:
    """A DeadLetter that fits in `max_bytes`: an original too large is cut (its size and SHA-256
    kept, so it can be found and compared), the reason too (a parser may quote the whole input).
    An original that is not valid UTF-8 is kept exactly too: `original_hex` (with its SHA-256)
    beside the readable `original` (decoded with replacement characters), each in half the room."""
    # imported here: gpuledger.config reads this module's defaults, and a report command line must not
    # pay for the wire models (tests/unit/test_cli_startup.py)
    from gpuledger.schemas.models import DeadLetter
    from gpuledger.schemas.wire import encode

    raw = raw or b""
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON] + f"... ({len(reason)} characters)"
    room = max(0, max_bytes - LETTER_OVERHEAD - len(reason.encode()) * 2)
    try:
        text, exact = raw.decode("utf-8"), None
    except UnicodeDecodeError:
        text, exact = raw.decode("utf-8", "replace"), raw
        room //= 2
    fields = {}
    # JSON escaping can grow text up to 6x (\uXXXX): measure the encoded form, not the bytes
    if len(raw) > room or len(orjson.dumps(text)) > room:
        fields = {"original_size": len(raw), "original_sha256": hashlib.sha256(raw).hexdigest()}
        cut = room // 6 if len(orjson.dumps(text[: room])) > room else room
        text = text[:cut]
        if exact is not None:
            exact = raw[: room // 2]  # hex: 2 characters per byte
    if exact is not None:
        fields["original_hex"] = exact.hex()
        fields["original_sha256"] = hashlib.sha256(raw).hexdigest()
    letter = DeadLetter(source_topic=topic, partition=partition, offset=offset, reason=reason, original=text,
                        seen_ms=seen_ms, **fields)
    return encode(letter)
