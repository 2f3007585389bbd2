"""`gpuledger topics create` against the Tansu broker: the configs it sets are the ones the broker
reports (DescribeConfigs), and a second run with other retention updates existing topics."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

import pytest

from gpuledger.topics import create_topics, topic_config, topic_kind

pytestmark = pytest.mark.integration


def described(settings, name: str) -> dict[str, str]:
    admin = AdminClient(settings.kafka_client_config())
    (future,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)]).values()
    return {k: e.value for k, e in future.result(timeout=10).items()}


def test_topics_are_created_with_their_configs_and_updated(broker, make_settings):
    settings = make_settings(kafka_bootstrap=broker.bootstrap, topic_retention_input_days=30,
                             bills_adjust_lookback_days=20)  # 30 days of input outlive 20 + 7 + the grace
    result = create_topics(settings)
    assert set(result.values()) == {"created"}
    for name in settings.partitions():
        have = described(settings, name)
        assert {k: have.get(k) for k in topic_config(settings, name)} == topic_config(settings, name), name
    assert create_topics(settings) == {name: "exists" for name in settings.partitions()}
    longer = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=settings.topic_prefix,
                           topic_retention_input_days=90)
    again = create_topics(longer)
    inputs = {n for n in longer.partitions() if topic_kind(longer, n) == "input"}
    assert longer.topics.gpu_samples in inputs and longer.topics.job_events in inputs
    assert {n for n, r in again.items() if r == "updated"} == inputs
    assert described(longer, longer.topics.gpu_samples)["retention.ms"] == str(90 * 86_400_000)


def test_existing_topics_keep_min_insync_within_their_replicas(broker, make_settings, caplog):
    """Topics made with one replica, then `topics create` with GPULEDGER_REPLICATION_FACTOR=3: no
    min.insync.replicas above the one replica they have (every acks=all write would be refused)."""
    settings = make_settings(kafka_bootstrap=broker.bootstrap, replication_factor=1)
    create_topics(settings)
    three = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=settings.topic_prefix, replication_factor=3)
    with caplog.at_level("WARNING", logger="gpuledger.topics"):
        create_topics(three)
    for name in three.partitions():
        assert described(three, name).get("min.insync.replicas") in (None, "1"), name
    assert "replica(s) but GPULEDGER_REPLICATION_FACTOR is 3" in caplog.text
