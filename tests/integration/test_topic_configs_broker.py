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


def test_changed_partition_settings_are_refused_before_any_topic_changes(broker, make_settings):
    """GPULEDGER_PARTITIONS_USAGE raised after the topics exist, with a longer input retention in the
    same run: the error names the topic and the setting, and the input topics (before usage in the
    list) keep their retention. The first mismatch used to stop the run after updating those."""
    settings = make_settings(kafka_bootstrap=broker.bootstrap, partitions_usage=2)
    create_topics(settings)
    changed = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=settings.topic_prefix, partitions_usage=3,
                            topic_retention_input_days=90)
    with pytest.raises(RuntimeError, match=rf"topic {settings.topics.usage} has 2 partitions, "
                                           r"GPULEDGER_PARTITIONS_USAGE says 3"):
        create_topics(changed)
    assert described(changed, changed.topics.gpu_samples)["retention.ms"] == \
        topic_config(settings, settings.topics.gpu_samples)["retention.ms"]


def test_check_topics_names_missing_topics_and_disagreeing_counts(broker, make_settings):
    """What a replay or the worker can check before it writes or reads (gpuledger.topics.check_topics)."""
    from gpuledger.topics import check_topics

    settings = make_settings(kafka_bootstrap=broker.bootstrap)
    inputs = [settings.topics.gpu_samples, settings.topics.job_events, settings.topics.scheduler_snapshots]
    with pytest.raises(RuntimeError, match=rf"{settings.topics.gpu_samples}, .* missing \(run `gpuledger topics create"):
        check_topics(settings, inputs)
    create_topics(settings)
    check_topics(settings)
    check_topics(settings, inputs)
    more = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=settings.topic_prefix, partitions_job_events=4)
    with pytest.raises(RuntimeError) as err:
        check_topics(more, inputs)
    assert str(err.value) == f"topic {more.topics.job_events} has 2 partitions, GPULEDGER_PARTITIONS_JOB_EVENTS says 4"
