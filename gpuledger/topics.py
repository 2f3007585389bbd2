"""`gpuledger topics create|list`: the ledger's topics, created explicitly (never auto-created)."""

from __future__ import annotations

import logging

from confluent_kafka.admin import AdminClient, NewTopic

from gpuledger.config import Settings

log = logging.getLogger(__name__)


def create_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic of the ledger with its configured partition count.

    Returns topic -> 'created' | 'exists'. An existing topic with a different partition
    count is an error: co-partitioning of gpu-samples and node-allocations depends on it."""
    admin = AdminClient(settings.kafka_client_config())
    wanted = settings.partitions()
    existing = admin.list_topics(timeout=timeout_s).topics
    result: dict[str, str] = {}
    to_create = []
    for name, partitions in wanted.items():
        if name in existing:
            have = len(existing[name].partitions)
            if have != partitions:
                raise RuntimeError(f"topic {name} exists with {have} partitions, configuration says {partitions}")
            result[name] = "exists"
        else:
            config = {"cleanup.policy": "compact"} if name == settings.topics.worker_state else {}
            to_create.append(NewTopic(name, num_partitions=partitions, replication_factor=settings.replication_factor,
                                      config=config))
    if to_create:
        for name, future in admin.create_topics(to_create, operation_timeout=timeout_s).items():
            try:
                future.result()
                result[name] = "created"
            except Exception as exc:  # a concurrent creator may have won the race
                if "TOPIC_ALREADY_EXISTS" in str(exc):
                    result[name] = "exists"
                else:
                    raise RuntimeError(f"could not create topic {name}: {exc}") from exc
    return result


def list_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, int]:
    admin = AdminClient(settings.kafka_client_config())
    return {name: len(meta.partitions) for name, meta in admin.list_topics(timeout=timeout_s).topics.items()}
