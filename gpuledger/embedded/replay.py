"""Topic dumps (JSON Lines) and replay of dumps or simulations into Kafka.

A dump line is one message of one data line:

    {"topic": "job-events", "key": "job-00001", "value": {...the message...}}

`topic` is the logical line name ("gpu-samples", "job-events", "scheduler-snapshots"); on replay
the configured topic prefix is prepended (a name that already carries the prefix is used as is).
`key` is a string or null; a null key on job-events is a lifecycle watermark, which is sent to
every partition of the topic, because each partition's consumer needs the promise.
A gpu-samples line is keyed by its value's `node`, as the agents key a node's ticks: the worker joins
them with the node's allocations, which it keys by node, so both must land on the same partition.
A null key there is filled in with the node; a key naming anything else is refused (DumpError, with
the file and line), since a tick on another node's partition is billed as unallocated, silently.

Publishing goes in event-time order, either as fast as possible or paced so that event time
runs `speedup` times faster than wall time. Clock and sleep are injectable (tests never sleep).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sized
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import orjson
from pydantic import TypeAdapter, ValidationError

from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES, LINE_SNAPSHOTS, LINES, Emission
from gpuledger.agents.simcluster import SimSpec, simulate
from gpuledger.config import Settings
from gpuledger.schemas.models import LifecycleMessage, NodeTick, SchedulerSnapshot
from gpuledger.schemas.wire import encode

_POLL_EVERY = 1000      # serve delivery callbacks regularly while producing flat out
_PROGRESS_EVERY = 1000


class DumpError(ValueError):
    """A dump file that cannot be read; the message names the file and the line."""


class DumpLine(NamedTuple):
    topic: str
    key: str | None
    value: dict[str, Any]


class Publisher(Protocol):
    """What replay needs of a publisher (agents.publisher.KafkaPublisher / ListPublisher)."""

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> None: ...

    def poll(self) -> Any: ...

    def flush(self, timeout: float = 30) -> int: ...


# --------------------------------------------------------------------------- dumps
def write_dump(emissions: Iterable[Emission], path: str | Path) -> int:
    """Write emissions as JSON Lines; returns the number of lines written."""
    n = 0
    with open(path, "wb") as f:
        for line, key, message in emissions:
            # Fragment embeds the wire encoding as is: the dump holds exactly what Kafka would.
            f.write(orjson.dumps({"topic": line, "key": key, "value": orjson.Fragment(encode(message))}))
            f.write(b"\n")
            n += 1
    return n


def parse_dump_line(raw: bytes | str, where: str = "<line>") -> DumpLine:
    """One dump line -> DumpLine, or DumpError saying what is wrong and where."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DumpError(f"{where}: malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise DumpError(f"{where}: expected a JSON object with topic, key, value; got {type(obj).__name__}")
    missing = [k for k in ("topic", "key", "value") if k not in obj]
    if missing:
        raise DumpError(f"{where}: missing field(s) {', '.join(missing)} (expected topic, key, value)")
    extra = sorted(set(obj) - {"topic", "key", "value"})
    if extra:
        raise DumpError(f"{where}: unexpected field(s) {', '.join(extra)} (expected topic, key, value)")
    topic, key, value = obj["topic"], obj["key"], obj["value"]
    if not isinstance(topic, str) or not topic:
        raise DumpError(f"{where}: topic must be a non-empty string, got {topic!r}")
    if key is not None and not isinstance(key, str):
        raise DumpError(f"{where}: key must be a string or null, got {type(key).__name__}")
    if not isinstance(value, dict):
        raise DumpError(f"{where}: value must be a JSON object, got {type(value).__name__}")
    ts = value.get("ts_ms")
    if ts is not None and (not isinstance(ts, int) or isinstance(ts, bool)):
        raise DumpError(f"{where}: value.ts_ms must be an integer (epoch milliseconds), got {ts!r}")
    return DumpLine(topic, key, value)


def read_dump(path: str | Path, prefix: str | None = None) -> list[DumpLine]:
    """Every line of a dump (blank lines skipped). Values are not schema-checked here: a dump may
    carry malformed messages on purpose (dead-letter tests); `validate_dump_line` checks one.
    With `prefix` (the topic prefix it will be replayed under), a topic that is none of the three
    lines is refused here, with its file and line (`publish` refuses it too, without them)."""
    lines = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                where = f"{path}:{lineno}"
                line = parse_dump_line(raw, where)
                if prefix is not None:
                    check_topic(line.topic, prefix, where)
                line = line._replace(key=sample_key(logical_line(line.topic, prefix or ""), line.key,
                                                    line.value.get("node"), where))
                lines.append(line)
    return lines


def check_topic(topic: str, prefix: str, where: str) -> None:
    """DumpError unless `topic` is one of the three lines (with or without `prefix`): Kafka would
    create any other topic and nothing would read it, so its messages would be lost silently."""
    if logical_line(topic, prefix) not in LINES:
        with_prefix = f", optionally prefixed with {prefix!r}" if prefix else ""
        raise DumpError(f"{where}: unknown topic {topic!r}; known: {', '.join(LINES)}{with_prefix}")


def sample_key(line: str, key: str | None, node: Any, where: str) -> str | None:
    """The key a message of logical line `line` is published with: a gpu-samples message goes
    under its node's name (the agents' key; the worker's join needs a node's ticks on the partition
    of the node's allocations, keyed by node), so a null key is filled in with `node`, and a key that
    is not `node` is refused with DumpError: which of the two is right cannot be told, and a tick
    published under the wrong key is billed as unallocated without a dead letter. Other lines, and a
    value without a string node (malformed: the worker dead-letters it), keep their key."""
    if line != LINE_SAMPLES or not isinstance(node, str) or not node:
        return key
    if key is None:
        return node
    if key != node:
        raise DumpError(f"{where}: gpu-samples key {key!r} is not the node of its value ({node!r}); "
                        "a node's ticks must be keyed by the node name (or null, filled in with it)")
    return key


def logical_line(topic: str, prefix: str = "") -> str:
    """The line name of a topic, without the prefix."""
    return topic[len(prefix):] if prefix and topic.startswith(prefix) else topic


_LINE_MODELS: dict[str, TypeAdapter[Any]] = {
    LINE_SAMPLES: TypeAdapter(NodeTick),
    LINE_JOB_EVENTS: TypeAdapter(LifecycleMessage),
    LINE_SNAPSHOTS: TypeAdapter(SchedulerSnapshot),
}


def validate_dump_line(line: DumpLine, prefix: str = "") -> None:
    """Check a dump line's value against the model of its line; raises DumpError."""
    name = logical_line(line.topic, prefix)
    adapter = _LINE_MODELS.get(name)
    if adapter is None:
        raise DumpError(f"unknown line {line.topic!r}; known: {', '.join(LINES)}")
    try:
        adapter.validate_python(line.value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "<root>"
        raise DumpError(f"{name}: schema violation at {where}: {first['msg']} ({exc.error_count()} in all)") from None


# --------------------------------------------------------------------------- publishing
class _Out(NamedTuple):
    line: str           # logical line name
    key: str | None
    ts_ms: int | None
    value: bytes


def _from_emission(e: Emission, prefix: str) -> _Out:
    line = logical_line(e.line, prefix)
    key = sample_key(line, e.key, getattr(e.message, "node", None), f"{line} emission")
    return _Out(line, key, getattr(e.message, "ts_ms", None), encode(e.message))


def _from_dump(d: DumpLine, prefix: str, where: str) -> _Out:
    line = logical_line(d.topic, prefix)
    key = sample_key(line, d.key, d.value.get("node"), where)
    return _Out(line, key, d.value.get("ts_ms"), orjson.dumps(d.value))


def _ordered_dump(lines: list[DumpLine], prefix: str) -> list[_Out]:
    """Stable sort by event time; a line without ts_ms keeps the time of the line before it,
    so it stays where the dump put it."""
    out, last = [], None
    for i, d in enumerate(lines, start=1):
        check_topic(d.topic, prefix, f"dump line {i}")
        o = _from_dump(d, prefix, f"dump line {i}")
        last = o.ts_ms if o.ts_ms is not None else last
        out.append(o._replace(ts_ms=last))
    # Lines before the first timestamp sort first (-1); sorted() is stable.
    return sorted(out, key=lambda o: -1 if o.ts_ms is None else o.ts_ms)


def _stream(items: Iterable[Emission] | Iterable[DumpLine], prefix: str) -> tuple[Iterator[_Out], int]:
    """Normalize the input: emissions stream through (already in event-time order); dump lines
    are sorted. Returns the messages and their count (0 when unknown)."""
    it = iter(items)
    first = next(it, None)
    if first is None:
        return iter(()), 0
    if isinstance(first, DumpLine):
        rest = [first, *it]
        if not all(isinstance(x, DumpLine) for x in rest):
            raise TypeError("publish: do not mix DumpLine and Emission items")
        ordered = _ordered_dump(rest, prefix)
        return iter(ordered), len(ordered)
    total = len(items) if isinstance(items, Sized) else 0

    def gen() -> Iterator[_Out]:
        yield _from_emission(first, prefix)  # type: ignore[arg-type]
        for e in it:
            if isinstance(e, DumpLine):
                raise TypeError("publish: do not mix DumpLine and Emission items")
            yield _from_emission(e, prefix)

    return gen(), total


def publish(
    emissions_or_lines: Iterable[Emission] | Iterable[DumpLine],
    publisher: Publisher,
    settings: Settings,
    *,
    speedup: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Publish messages in event-time order; returns the number of messages per line.

    Keyed messages go to `<prefix><line>` with their key (the partitioner picks the partition);
    a gpu-samples message's key is its node (see `sample_key`: null filled in, another refused);
    a job-events message with key None (a watermark) is sent once to each partition
    0..partitions_job_events-1 and counted once. With `speedup`, event time advances `speedup`
    times faster than `clock`. `progress(done, total)` is called every 1000 messages and at the
    end (total 0 when the input's length is unknown). Raises RuntimeError if the final flush
    leaves messages undelivered, or if the broker refused any (the publisher's `failed`, each
    logged with its reason): losing metering data is not a warning."""
    if speedup is not None and speedup <= 0:
        raise ValueError(f"speedup must be > 0 (or None for as fast as possible), got {speedup}")
    prefix = settings.topic_prefix
    failed_before = getattr(publisher, "failed", 0)  # refusals of this call only, on a reused publisher
    messages, total = _stream(emissions_or_lines, prefix)
    counts = {name: 0 for name in LINES}
    t0_event: int | None = None
    t0_wall = 0.0
    done = 0
    for m in messages:
        if speedup is not None and m.ts_ms is not None:
            if t0_event is None:
                t0_event, t0_wall = m.ts_ms, clock()
            due = t0_wall + (m.ts_ms - t0_event) / 1000 / speedup
            wait = due - clock()
            if wait > 0:
                publisher.poll()  # deliver what is queued while we wait anyway
                sleep(wait)
        topic = prefix + m.line  # m.line is prefix-free (see logical_line)
        if m.key is None and m.line == LINE_JOB_EVENTS:
            for p in range(settings.partitions_job_events):
                publisher.publish(topic, None, m.value, partition=p)
        else:
            publisher.publish(topic, m.key, m.value)
        counts[m.line] = counts.get(m.line, 0) + 1
        done += 1
        if done % _POLL_EVERY == 0:
            publisher.poll()
        if progress is not None and done % _PROGRESS_EVERY == 0:
            progress(done, total)
    left = publisher.flush()
    if progress is not None:
        progress(done, total or done)
    if left:
        raise RuntimeError(f"replay: {left} message(s) still undelivered after flush")
    # a refused message has left the queue too (flush does not count it), e.g. a watermark copy for a
    # partition the topic lacks: GPULEDGER_PARTITIONS_JOB_EVENTS above its real partition count
    refused = getattr(publisher, "failed", 0) - failed_before
    if refused:
        raise RuntimeError(f"replay: {refused} message(s) refused by the broker (the log says why, e.g. an unknown "
                           "partition: compare GPULEDGER_PARTITIONS_* with `gpuledger topics list`)")
    return counts


def publish_simulation(
    spec: SimSpec | None,
    publisher: Publisher,
    settings: Settings,
    speedup: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Run the simulator and publish its emissions as they are generated (no dump in between)."""
    return publish(simulate(spec or SimSpec()), publisher, settings, speedup=speedup, progress=progress)
