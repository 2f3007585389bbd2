"""The worker's and the watcher's start check against the Tansu broker: before Faust starts, every topic
the process reads or writes must exist with its configured partition count. Faust would subscribe
anyway (a producer makes a missing topic with the broker's default count; a count that disagrees
bills ticks as unallocated or never closes them, silently), so the check exits 78 (a restart does
not help) naming each problem and `gpuledger topics create`, and 75 (restart me) when the broker
cannot be reached."""

from __future__ import annotations

import logging
import socket
import subprocess

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from gpuledger.embedded.processes import ChildProcess
from gpuledger.streams.app import check_worker_topics, exit_unless_topics_ready, worker_topics
from gpuledger.topics import create_topics
from gpuledger.watch import check_watch_topics, watch_topics

pytestmark = pytest.mark.integration

CHECKS = {"worker": check_worker_topics, "watch": check_watch_topics}


def create_all_but(settings, missing: str) -> None:
    """Every topic of the ledger with its configured count, except `missing`."""
    admin = AdminClient(settings.kafka_client_config())
    futures = admin.create_topics([NewTopic(name, num_partitions=n, replication_factor=1)
                                   for name, n in settings.partitions().items() if name != missing])
    for future in futures.values():
        future.result(timeout=30)


def start_check(settings, process: str, caplog, timeout_s: float = 30.0) -> int | None:
    """The exit status the process's start check asks for (None: it lets Faust start); its log in caplog."""
    with caplog.at_level(logging.CRITICAL, logger="gpuledger.streams.app"):
        try:
            exit_unless_topics_ready(CHECKS[process], settings, process, timeout_s=timeout_s)
        except SystemExit as exc:
            return exc.code
    return None


@pytest.mark.parametrize("process, attr", [
    ("worker", "gpu_samples"), ("worker", "usage"), ("worker", "worker_state"),
    ("watch", "scheduler_snapshots"), ("watch", "alerts"), ("watch", "watch_state"),
])
def test_a_missing_topic_stops_the_process_with_78(broker, make_settings, caplog, process, attr):
    settings = make_settings(kafka_bootstrap=broker.bootstrap)
    missing = getattr(settings.topics, attr)
    create_all_but(settings, missing)
    assert start_check(settings, process, caplog) == 78
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert f"topic(s) {missing} missing" in line
    assert "gpuledger topics create" in line and "status 78" in line


@pytest.mark.parametrize("process, setting, disagrees, ignored", [
    # each process is stopped by a count of a topic it uses, and not by one of a topic it does not use
    ("worker", "partitions_gpu_samples", "GPULEDGER_PARTITIONS_GPU_SAMPLES", "partitions_scheduler_snapshots"),
    ("watch", "partitions_usage", "GPULEDGER_PARTITIONS_USAGE", "partitions_gpu_samples"),
])
def test_a_partition_count_that_disagrees_stops_the_process_with_78(broker, make_settings, caplog, process, setting,
                                                                     disagrees, ignored):
    made = make_settings(kafka_bootstrap=broker.bootstrap)
    create_topics(made)
    other = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=made.topic_prefix, **{setting: 3})
    assert start_check(other, process, caplog) == 78
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert f"has 2 partitions, {disagrees} says 3" in line
    assert "gpuledger topics create" in line
    caplog.clear()
    unused = make_settings(kafka_bootstrap=broker.bootstrap, topic_prefix=made.topic_prefix, **{ignored: 3})
    assert start_check(unused, process, caplog) is None, caplog.text


@pytest.mark.parametrize("process", ["worker", "watch"])
def test_created_topics_pass_the_check(broker, make_settings, caplog, process):
    settings = make_settings(kafka_bootstrap=broker.bootstrap)
    assert start_check(settings, process, caplog) == 78  # nothing created yet
    caplog.clear()
    create_topics(settings)
    assert start_check(settings, process, caplog) is None, caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]


def test_each_process_checks_the_topics_it_uses(make_settings):
    """The worker's and the watcher's lists: every topic either reads or writes, and the other's only
    where they share it (usage, lifecycle-accepted: the worker writes, the watcher reads)."""
    settings = make_settings()
    t = settings.topics
    assert set(worker_topics(settings)) & set(watch_topics(settings)) == {t.usage, t.lifecycle_accepted}
    assert set(worker_topics(settings)) | set(watch_topics(settings)) <= set(settings.partitions())
    assert t.bills not in worker_topics(settings) + watch_topics(settings)  # the sink's, not theirs


@pytest.mark.parametrize("process", ["worker", "watch"])
def test_an_unreachable_broker_is_75_not_78(make_settings, caplog, process):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    settings = make_settings(kafka_bootstrap=f"127.0.0.1:{port}")
    assert start_check(settings, process, caplog, timeout_s=2.0) == 75
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert f"cannot list the topics on 127.0.0.1:{port}" in line and "status 75" in line


@pytest.mark.parametrize("process", ["worker", "watch"])
def test_the_command_exits_78_before_faust_starts(broker, make_settings, tmp_path, process):
    """`gpuledger worker` / `gpuledger watch` themselves: with no topics they used to start Faust and run."""
    settings = make_settings(kafka_bootstrap=broker.bootstrap)
    log_path = tmp_path / f"{process}.log"
    with ChildProcess(settings, process, log_path=log_path) as child:
        try:
            status = child.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            status = None  # still running: stopped by the context manager
    assert status == 78, log_path.read_text()[-2000:]
    text = log_path.read_text()
    assert f"{settings.topics.gpu_samples if process == 'worker' else settings.topics.usage}" in text
    assert "gpuledger topics create" in text
