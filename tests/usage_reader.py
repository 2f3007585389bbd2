"""Reading the worker's usage records back from Kafka in the integration tests."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, TopicPartition

from gpuledger.schemas.models import UsageBatch
from gpuledger.schemas.wire import decode


def usage_until(settings, gpu_ms: int, timeout_s: float = 30.0) -> list:
    """The usage records, read from the start until they hold `gpu_ms` or the time is up. Not up to
    the high watermark: Tansu's ListOffsets can report one behind the log (embedded/processes.py
    `group_lag`), two messages short of what the worker had seen acknowledged."""
    consumer = Consumer({**settings.kafka_client_config(), "group.id": "test-reader", "enable.auto.commit": False})
    consumer.assign([TopicPartition(settings.topics.usage, p, 0) for p in range(settings.partitions_usage)])
    records, deadline = [], time.monotonic() + timeout_s
    try:
        while sum(r.gpu_ms for r in records) < gpu_ms and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                records += decode(UsageBatch, msg.value()).records
        return records
    finally:
        consumer.close()
