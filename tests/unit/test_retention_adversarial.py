"""Retention settings that would delete what they are meant to keep (docs/retention.md).

A TTL is a ClickHouse Date, which ends on 2149-06-06 and wraps round to 1970 past it: a retention of
tens of thousands of days ("keep it for ever") gave TTL dates in 1970-1984, so every row was dropped as
it was written. The settings refuse retentions over MAX_RETENTION_DAYS (0 keeps rows for ever).

node_inventory is what report unmatched checks the allocations (job_events) against: it must be kept
as long as they are, or a retired node's allocations read as allocations on an unknown node."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from gpuledger.config import MAX_RETENTION_DAYS, Settings
from gpuledger.warehouse.retention import RETENTION, ttl_expression

#: the last day a ClickHouse Date holds
DATE_END = dt.date(2149, 6, 6)
FIELDS = ("retention_health_days", "retention_hourly_days", "retention_load_5m_days", "retention_usage_days",
          "retention_ops_days", "retention_bills_days")


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("days", [45_000, 50_000, 2**31])
def test_a_retention_past_clickhouse_dates_is_refused(tmp_path, field, days):
    with pytest.raises(ValidationError, match=f"{field}\n  Input should be less than or equal to {MAX_RETENTION_DAYS}"):
        Settings(data_dir=tmp_path, **{field: days})


@pytest.mark.parametrize("field", FIELDS)
def test_the_longest_retention_is_accepted(tmp_path, field):
    assert getattr(Settings(data_dir=tmp_path, **{field: MAX_RETENTION_DAYS}), field) == MAX_RETENTION_DAYS


def test_the_longest_retention_stays_within_clickhouse_dates():
    # rows of any day for the next 70 years, counted from the last day of their month
    month_end = dt.date(dt.date.today().year + 70, 12, 31)
    assert month_end + dt.timedelta(days=MAX_RETENTION_DAYS) < DATE_END


def test_no_ttl_is_made_past_the_longest_retention():
    assert ttl_expression("usage_raw", MAX_RETENTION_DAYS).endswith(f"toIntervalDay({MAX_RETENTION_DAYS})")
    with pytest.raises(ValueError, match="use 0 to keep usage_raw for ever"):
        ttl_expression("usage_raw", 50_000)


def test_node_inventory_is_kept_as_long_as_the_allocations_checked_against_it():
    assert RETENTION["node_inventory"].setting == RETENTION["job_events"].setting


# --------------------------------------------------------------------------- topics
class _Entry:
    def __init__(self, value):
        self.value = value


class _Future:
    def __init__(self, value=None):
        self.value = value

    def result(self, timeout=None):
        return self.value


class _Partition:
    replicas = [0]


class _Topic:
    def __init__(self, partitions: int):
        self.partitions = {i: _Partition() for i in range(partitions)}


class _Admin:
    """Every topic exists, kept a year and capped at 1 GiB a partition (set before, or the broker's default)."""

    def __init__(self, settings):
        self.topics = {n: _Topic(p) for n, p in settings.partitions().items()}
        self.configs = {n: {"cleanup.policy": "delete", "retention.ms": str(365 * 86_400_000),
                            "retention.bytes": str(2**30)} for n in self.topics}

    def list_topics(self, timeout=None):
        return type("Metadata", (), {"topics": self.topics})()

    def describe_configs(self, resources):
        return {r: _Future({k: _Entry(v) for k, v in self.configs[r.name].items()}) for r in resources}

    def incremental_alter_configs(self, resources):
        for r in resources:
            self.configs[r.name].update({e.name: e.value for e in r.incremental_configs})
        return {r: _Future() for r in resources}


def test_topics_are_kept_by_time_alone(tmp_path):
    from gpuledger.topics import topic_config, topic_kind

    s = Settings(data_dir=tmp_path, topic_prefix="t.")
    for name in s.partitions():
        if topic_kind(s, name) != "state":
            assert topic_config(s, name)["retention.bytes"] == "-1", name


def test_topics_create_lifts_a_size_cap_and_says_what_it_shortens(tmp_path, monkeypatch, caplog):
    """An input topic capped by size keeps less than the days a rebuild needs, whatever its retention.ms;
    a shorter retention.ms deletes records at once: `topics create` says so."""
    import gpuledger.topics as topics

    s = Settings(data_dir=tmp_path, topic_prefix="t.")
    admin = _Admin(s)
    monkeypatch.setattr(topics, "AdminClient", lambda config: admin)
    with caplog.at_level("WARNING", logger="gpuledger.topics"):
        assert set(topics.create_topics(s).values()) == {"updated"}
    samples = admin.configs[s.topics.gpu_samples]
    assert (samples["retention.ms"], samples["retention.bytes"]) == (str(70 * 86_400_000), "-1")
    assert (f"topic t.gpu-samples: retention.ms {365 * 86_400_000} -> {70 * 86_400_000}: the broker deletes its "
            "records older than 70 days") in caplog.text
    assert f"topic t.gpu-samples: retention.bytes {2**30} -> -1" in caplog.text
