"""The configs `gpuledger topics create` sets (gpuledger/topics.py): every topic has a retention class,
input topics outlive the adjustment window, min.insync.replicas where the replication factor allows it."""

from __future__ import annotations

import pytest

from gpuledger.config import Settings
from gpuledger.topics import DAY_MS, min_insync_replicas, topic_config


@pytest.fixture
def settings(tmp_path):
    # 40 days of input outlive a 30-day adjustment look-back (30 + 7 + the 6 h grace)
    return Settings(data_dir=tmp_path, topic_prefix="t.", topic_retention_input_days=40, bills_adjust_lookback_days=30,
                    topic_retention_output_days=3, topic_retention_diagnostics_days=9)


def test_every_topic_gets_a_retention(settings):
    for name in settings.partitions():
        config = topic_config(settings, name)
        assert config["retention.ms"], name
        assert config["cleanup.policy"] in ("delete", "compact"), name


def test_retention_by_kind(settings):
    t = settings.topics
    assert topic_config(settings, t.gpu_samples)["retention.ms"] == str(40 * DAY_MS)
    assert topic_config(settings, t.job_events)["retention.ms"] == str(40 * DAY_MS)
    assert topic_config(settings, t.usage)["retention.ms"] == str(3 * DAY_MS)
    assert topic_config(settings, t.dead_letters)["retention.ms"] == str(9 * DAY_MS)
    # state snapshots: the latest per key, and records up to 16 MiB (Kafka's default is 1 MB; the
    # watcher's state is ~2 MB at 100,000 GPUs)
    for name in (t.worker_state, t.watch_state):
        assert topic_config(settings, name) == {"cleanup.policy": "compact", "retention.ms": "-1",
                                                "max.message.bytes": str(16 * 1024 * 1024)}


def test_unknown_topic_is_refused(settings):
    with pytest.raises(ValueError, match="no retention class"):
        topic_config(settings, "t.something-new")


@pytest.mark.parametrize("rf,isr", [(1, None), (2, None), (3, 2), (4, 3), (5, 3)])
def test_min_insync_replicas(rf, isr):
    assert min_insync_replicas(rf) == isr


def test_min_insync_set_with_three_replicas(tmp_path):
    s = Settings(data_dir=tmp_path, replication_factor=3)
    assert all(topic_config(s, n)["min.insync.replicas"] == "2" for n in s.partitions())
    s1 = Settings(data_dir=tmp_path, replication_factor=1)
    assert all("min.insync.replicas" not in topic_config(s1, n) for n in s1.partitions())


class _Partition:
    def __init__(self, replicas):
        self.replicas = replicas


class _Topic:
    def __init__(self, partitions: int, replicas: int):
        self.partitions = {i: _Partition(list(range(replicas))) for i in range(partitions)}


class _Future:
    def __init__(self, value=None):
        self.value = value

    def result(self, timeout=None):
        return self.value


class _FakeAdmin:
    """Every topic exists with its configured partitions and `replicas` replicas, no config set."""

    def __init__(self, settings, replicas: int):
        self.topics = {n: _Topic(p, replicas) for n, p in settings.partitions().items()}
        self.altered: dict[str, dict[str, str]] = {}

    def list_topics(self, timeout=None):
        return type("Metadata", (), {"topics": self.topics})()

    def describe_configs(self, resources):
        return {r: _Future({}) for r in resources}

    def incremental_alter_configs(self, resources):
        for r in resources:
            self.altered[r.name] = {e.name: e.value for e in r.incremental_configs}
        return {r: _Future() for r in resources}


@pytest.mark.parametrize("replicas", [1, 2])
def test_existing_topic_min_insync_follows_its_real_replicas(tmp_path, monkeypatch, caplog, replicas):
    """GPULEDGER_REPLICATION_FACTOR=3 on topics made with fewer replicas must not set
    min.insync.replicas=2 on them (that refuses every acks=all write): it follows the topic, with a warning."""
    import gpuledger.topics as topics

    s = Settings(data_dir=tmp_path, topic_prefix="t.", replication_factor=3)
    admin = _FakeAdmin(s, replicas)
    monkeypatch.setattr(topics, "AdminClient", lambda config: admin)
    with caplog.at_level("WARNING", logger="gpuledger.topics"):
        result = topics.create_topics(s)
    assert set(result.values()) == {"updated"}
    for name in s.partitions():
        assert "min.insync.replicas" not in admin.altered[name], name
    assert f"topic {s.topics.gpu_samples} has {replicas} replica(s) but GPULEDGER_REPLICATION_FACTOR is 3" in caplog.text


def test_existing_topic_with_configured_replicas_gets_min_insync(tmp_path, monkeypatch, caplog):
    import gpuledger.topics as topics

    s = Settings(data_dir=tmp_path, topic_prefix="t.", replication_factor=3)
    admin = _FakeAdmin(s, 3)
    monkeypatch.setattr(topics, "AdminClient", lambda config: admin)
    with caplog.at_level("WARNING", logger="gpuledger.topics"):
        topics.create_topics(s)
    assert all(admin.altered[n]["min.insync.replicas"] == "2" for n in s.partitions())
    assert "replica(s) but" not in caplog.text


def test_topic_config_for_real_replicas(tmp_path):
    s = Settings(data_dir=tmp_path, replication_factor=3)
    name = s.topics.gpu_samples
    assert "min.insync.replicas" not in topic_config(s, name, replicas=1)
    assert topic_config(s, name, replicas=5)["min.insync.replicas"] == "3"


def test_partition_counts_that_disagree_are_all_named_with_their_setting_before_anything_changes(tmp_path, monkeypatch):
    """GPULEDGER_PARTITIONS_* changed after the topics exist: one error names every topic that
    disagrees and the setting it follows, and no topic's configs were changed before it (the
    first mismatch used to stop the run half-way, after altering the topics before it)."""
    import gpuledger.topics as topics

    before = Settings(data_dir=tmp_path, topic_prefix="t.", partitions_gpu_samples=4, partitions_job_events=2)
    admin = _FakeAdmin(before, 1)
    monkeypatch.setattr(topics, "AdminClient", lambda config: admin)
    now = Settings(data_dir=tmp_path, topic_prefix="t.", partitions_gpu_samples=8, partitions_job_events=2)
    with pytest.raises(RuntimeError) as err:
        topics.create_topics(now)
    text = str(err.value)
    assert "topic t.gpu-samples has 4 partitions, GPULEDGER_PARTITIONS_GPU_SAMPLES says 8" in text
    assert "topic t.node-allocations has 4 partitions, GPULEDGER_PARTITIONS_GPU_SAMPLES says 8" in text
    assert ("topic t.worker-state has 6 partitions, GPULEDGER_PARTITIONS_GPU_SAMPLES + "
            "GPULEDGER_PARTITIONS_JOB_EVENTS says 10") in text
    assert "job-events" not in text
    assert admin.altered == {}


def test_every_partition_setting_names_a_topic_and_a_real_setting(tmp_path):
    from gpuledger.topics import PARTITION_SETTINGS

    s = Settings(data_dir=tmp_path)
    for attr, variables in PARTITION_SETTINGS.items():
        assert hasattr(s.topics, attr), attr
        for variable in variables.split(" + "):
            assert variable.removeprefix("GPULEDGER_").lower() in Settings.model_fields, variable
