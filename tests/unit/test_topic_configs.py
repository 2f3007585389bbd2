"""The configs `gpuledger topics create` sets (gpuledger/topics.py): every topic has a retention class,
input topics outlive the adjustment window, min.insync.replicas where the replication factor allows it."""

from __future__ import annotations

import pytest

from gpuledger.config import Settings
from gpuledger.topics import DAY_MS, min_insync_replicas, topic_config


@pytest.fixture
def settings(tmp_path):
    return Settings(data_dir=tmp_path, topic_prefix="t.", topic_retention_input_days=40,
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
