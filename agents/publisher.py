"""Putting messages on Kafka: an idempotent confluent-kafka producer, and an in-memory twin for tests.

Losing metering data is a financial error, so `KafkaPublisher` never drops a message
silently: a full local queue is waited out (then `PublishError`), and a message the broker
finally refuses is logged with the reason, counted in `failed`, and handed to the optional
`on_delivery_failure` hook (e.g. a local spool)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from gpuledger.config import Settings
from gpuledger.topics import EVENT_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

#: Producer settings for metering data; keyword overrides win over them.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,   # retries never duplicate or reorder within a partition
    "acks": "all",
    "compression.type": "lz4",    # ticks are repetitive JSON: cheap CPU, large savings
    # Java-compatible key hashing: Faust (aiokafka) re-keys lifecycle events by node with
    # murmur2, and a node's samples must land in the same partition number as its allocations.
    "partitioner": "murmur2_random",
    "linger.ms": 50,              # a node's tick is one message; batch across partitions/ticks
    "batch.size": 1_000_000,
    "message.timeout.ms": 300_000,  # keep retrying for 5 min before a delivery counts as failed
}

_SECRET_MARKERS = ("password", "secret", "token", "key.pem", "ssl.key")

DeliveryFailure = Callable[[str, bytes | None, bytes | None, str], None]
#: Per-message delivery report: called with None when the broker has the message, else the error.
DeliveryReport = Callable[[Any], None]

#: Overrides for a producer that drains the agent's spool (agents/spool.py `Forwarder`): retry
#: forever. With a finite timeout a later message can be delivered after an earlier one timed
#: out, and re-sending the earlier one from the spool would reorder the node's ticks. The
#: forwarder bounds what is in flight, so an unreachable broker never grows this queue.
SPOOL_PRODUCER_OVERRIDES: dict[str, Any] = {"message.timeout.ms": 0}

#: Overrides for the scheduler agents' producers (Slurm, Kubernetes): a job event may be larger than
#: librdkafka's default 1 MB, since a job's `allocated` names each of its GPUs (gpuledger.topics,
#: EVENT_MAX_MESSAGE_BYTES; the job-events topic takes as much).
EVENT_PRODUCER_OVERRIDES: dict[str, Any] = {"message.max.bytes": EVENT_MAX_MESSAGE_BYTES}


#: Kafka error codes that refuse a message for its size (librdkafka's own `message.max.bytes` check at
#: `produce()`, or the broker's `MESSAGE_TOO_LARGE` / `RECORD_LIST_TOO_LARGE` in a delivery report):
#: sending the same bytes again can never succeed.
TOO_LARGE_CODES = frozenset({10, 18})


class PublishError(RuntimeError):
    """A message could not even be queued locally."""


def is_too_large(err: Any) -> bool:
    """Whether `err` (a delivery report's KafkaError, or the KafkaException `produce()` raised) refuses
    the message for its size. Anything else (an unreachable broker, authorization) may pass."""
    if err is not None and not callable(getattr(err, "code", None)) and getattr(err, "args", None):
        err = err.args[0]  # KafkaException(KafkaError)
    code = getattr(err, "code", None)
    try:
        return callable(code) and code() in TOO_LARGE_CODES
    except Exception:
        return False


def redacted(conf: dict[str, Any]) -> dict[str, Any]:
    """A client config safe to log: secret values replaced."""
    return {k: ("***" if any(m in k for m in _SECRET_MARKERS) else v) for k, v in conf.items()}


def _as_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class KafkaPublisher:
    """Idempotent, lz4-compressed Kafka producer.

    `overrides` are librdkafka keys; write them with underscores (`linger_ms=5`) or pass
    dotted keys through a dict (`**{"linger.ms": 5}`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        producer_factory: Callable[[dict[str, Any]], Any] | None = None,
        on_delivery_failure: DeliveryFailure | None = None,
        queue_full_timeout_s: float = 60.0,
        **overrides: Any,
    ):
        conf: dict[str, Any] = {**settings.kafka_client_config(), **PRODUCER_DEFAULTS}
        conf.update({k.replace("_", "."): v for k, v in overrides.items()})
        conf.setdefault("error_cb", self._on_error)
        conf.setdefault("logger", logging.getLogger("gpuledger.kafka"))  # librdkafka logs into logging, not stderr
        if producer_factory is None:
            from confluent_kafka import Producer as producer_factory
        self._conf_for_logs = redacted({k: v for k, v in conf.items() if not callable(v) and k != "logger"})
        self._producer = producer_factory(conf)
        self._on_failure = on_delivery_failure
        self._queue_full_timeout_s = queue_full_timeout_s
        self._closed = False
        self.produced = 0
        self.delivered = 0
        self.failed = 0
        self.fatal_error: str | None = None  # set once librdkafka reports a fatal error: make a new producer
        log.info("Kafka producer: %s", self._conf_for_logs)

    def __repr__(self) -> str:
        return f"KafkaPublisher({self._conf_for_logs})"

    # ------------------------------------------------------------------ callbacks
    def _on_error(self, err: Any) -> None:
        # Client-level errors (broker down, auth): librdkafka keeps retrying; make them visible.
        fatal = getattr(err, "fatal", None)
        if callable(fatal) and fatal():
            self.fatal_error = str(err)
            log.error("Kafka producer fatal error: %s", err)
            return
        log.warning("Kafka client error: %s", err)

    def _on_delivery(self, err: Any, msg: Any, report: DeliveryReport | None = None) -> None:
        if report is not None:
            try:
                report(err)
            except Exception:
                log.exception("delivery report callback raised")
        if err is None:
            self.delivered += 1
            return
        self.failed += 1
        topic = msg.topic()
        log.error("Kafka delivery failed for a message to %s (key %r): %s", topic, msg.key(), err)
        if self._on_failure is not None:
            try:
                self._on_failure(topic, msg.key(), msg.value(), str(err))
            except Exception:
                log.exception("on_delivery_failure hook raised")

    # ------------------------------------------------------------------ API
    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None,
                on_delivery: DeliveryReport | None = None) -> None:
        """Queue one message. `on_delivery(err)` is called from `poll`/`flush` with None once the
        broker has it, or with the error."""
        if self._closed:
            raise PublishError("publisher is closed")
        callback = self._on_delivery if on_delivery is None else (
            lambda err, msg: self._on_delivery(err, msg, on_delivery))
        kwargs: dict[str, Any] = {"key": _as_bytes(key), "value": value, "on_delivery": callback}
        if partition is not None:
            kwargs["partition"] = partition
        deadline: float | None = None
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:
                # Local queue full (broker slow or unreachable): serve delivery reports to make room.
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self._queue_full_timeout_s
                if now >= deadline:
                    raise PublishError(
                        f"local Kafka queue still full after {self._queue_full_timeout_s:.0f}s "
                        f"({len(self._producer)} messages waiting); is the broker reachable?"
                    ) from None
                self._producer.poll(0.1)
        self.produced += 1
        self._producer.poll(0)

    def poll(self, timeout: float = 0) -> int:
        """Serve delivery reports; returns how many were served."""
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 30) -> int:
        """Wait for outstanding messages; returns how many are still undelivered."""
        return self._producer.flush(timeout)

    @property
    def pending(self) -> int:
        return len(self._producer)

    def close(self, timeout: float = 30) -> int:
        """Flush and stop accepting messages; returns the count left undelivered (logged if any)."""
        if self._closed:
            return 0
        self._closed = True
        remaining = self.flush(timeout)
        if remaining:
            log.error("closing Kafka publisher with %d message(s) undelivered after %.0fs", remaining, timeout)
        return remaining

    def __enter__(self) -> KafkaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ListPublisher:
    """In-memory publisher with KafkaPublisher's methods: `messages` holds (topic, key, value, partition)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes | None, bytes, int | None]] = []
        self.produced = 0
        self.delivered = 0
        self.failed = 0
        self._closed = False

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None,
                on_delivery: DeliveryReport | None = None) -> None:
        if self._closed:
            raise PublishError("publisher is closed")
        self.messages.append((topic, _as_bytes(key), value, partition))
        self.produced += 1
        self.delivered += 1
        if on_delivery is not None:
            on_delivery(None)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 30) -> int:
        return 0

    @property
    def pending(self) -> int:
        return 0

    def close(self, timeout: float = 30) -> int:
        self._closed = True
        return 0

    def values(self, topic: str | None = None) -> list[bytes]:
        return [v for t, _, v, _ in self.messages if topic is None or t == topic]

    def __enter__(self) -> ListPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
