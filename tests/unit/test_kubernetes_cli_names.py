"""The Kubernetes agent's command line and the names it derives from the cluster: `--cluster` and
`--device-endpoint` are held to the rules GPULEDGER_CLUSTER and GPULEDGER_KUBERNETES_DEVICE_ENDPOINT
are (gpuledger/config.py), two clusters never share a spool, and without the spool a message too
large for Kafka is dropped and logged, not the end of the agent."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import orjson
import pytest

from confluent_kafka import KafkaError, KafkaException

from gpuledger.agents import kubernetes_agent
from gpuledger.agents import publisher as publisher_module
from gpuledger.agents.gpu_agent import spool_dir
from gpuledger.agents.kubernetes_agent import adopt_shared_spool, main, open_publisher, spool_name
from gpuledger.agents.publisher import KafkaPublisher, ListPublisher
from gpuledger.agents.spool import Spool
from gpuledger.config import load_settings
from gpuledger.topics import EVENT_MAX_MESSAGE_BYTES


@pytest.fixture
def started(tmp_path, monkeypatch):
    """main() up to the point where the agent would start watching: returns the agents it built."""
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    agents = []
    monkeypatch.setattr(kubernetes_agent.KubernetesAgent, "run", lambda self, watchers, stop: agents.append(self))
    monkeypatch.setattr(kubernetes_agent, "open_publisher", lambda settings, cluster, metrics=None: ListPublisher())
    return agents


BASE = ["--no-devices", "--api-server", "http://127.0.0.1:9", "--print", "--metrics-port", "0"]


@pytest.mark.parametrize("cluster", ["../../etc/east", "a\\b", " east", "east\n", "", "x" * 129])
def test_a_cluster_name_the_settings_refuse_is_refused_on_the_command_line(started, tmp_path, capsys, cluster):
    # before: '../../etc/east' ran, its state file DATA_DIR/kubernetes-agent-../../etc/east.json outside the data dir
    assert main(["--cluster", cluster, *BASE]) == 2
    err = capsys.readouterr().err
    assert "--cluster" in err and "without / or \\" in err
    assert started == []


PUBLISHING = ["--no-devices", "--api-server", "http://127.0.0.1:9", "--metrics-port", "0"]


def test_a_good_cluster_name_runs(started, tmp_path):
    assert main(["--cluster", "prod east:1", *PUBLISHING]) == 0
    assert started[0].state_file.path.parent == tmp_path


@pytest.mark.parametrize("cluster", ["a b", "a:b", "東京" * 40])
def test_the_state_file_is_named_with_safe_characters_and_a_digest(started, tmp_path, cluster):
    # before: DATA_DIR/kubernetes-agent-<cluster>.json as it is: 80 CJK characters are 240 bytes, and the
    # name (with '.journal') was over the file system's 255: OSError ENAMETOOLONG at the start
    assert main(["--cluster", cluster, *PUBLISHING]) == 0
    path = started[0].state_file.path
    assert path.parent == tmp_path and path.name == f"{spool_name(cluster)}.json"
    assert re.fullmatch(r"kubernetes-agent-[A-Za-z0-9._-]+-[0-9a-f]{8}\.json", path.name)
    assert main(["--cluster", "a_b", *PUBLISHING]) == 0
    assert started[-1].state_file.path.name == "kubernetes-agent-a_b.json"   # a safe name keeps its file


def test_the_state_file_of_an_unsafe_name_before_is_still_read(started, tmp_path):
    before = tmp_path / "kubernetes-agent-a b.json"
    before.write_bytes(orjson.dumps({"version": 1, "watermark_ms": 1234, "pods": {}, "jobs": {}, "local_queues": {}}))
    assert main(["--cluster", "a b", *PUBLISHING]) == 0
    assert started[0].state_file.path == before and started[0].core.watermark_ms == 1234


def test_print_does_not_touch_the_state_of_the_publishing_agent(started, tmp_path):
    # before: a look with --print loaded and then saved DATA_DIR/kubernetes-agent-east.json, the
    # publishing agent's: rewritten under another generation, the running agent's journal lines were
    # not read at its next start, which then sent again or never sent what they covered
    assert main(["--cluster", "east", *BASE]) == 0
    assert started[0].state_file is None
    assert main(["--cluster", "east", *BASE, "--state-file", str(tmp_path / "look.json")]) == 0
    assert started[1].state_file.path == tmp_path / "look.json"


@pytest.mark.parametrize("endpoint", ["http://{nod}:9478/pod-resources", "{host_ip}:9478", "http://{host_ip"])
def test_a_device_endpoint_the_settings_refuse_is_refused_on_the_command_line(started, capsys, endpoint):
    # before: it ran, and every lookup failed (KeyError / ValueError) and was swallowed: pods sent without GPUs
    assert main(["--cluster", "east", "--api-server", "http://127.0.0.1:9", "--print", "--metrics-port", "0",
                 "--device-endpoint", endpoint]) == 2
    err = capsys.readouterr().err
    assert "--device-endpoint" in err and "{node} and/or {host_ip}" in err
    assert started == []


def settings_at(tmp_path):
    return SimpleNamespace(agent_spool_dir=None, data_dir=str(tmp_path))


def test_clusters_whose_names_differ_only_in_unsafe_characters_spool_apart(tmp_path):
    # before: 'a b' and 'a_b' both spooled into spool/kubernetes-agent-a_b; the second agent died on SpoolLocked
    settings = settings_at(tmp_path)
    a, b, c = (spool_dir(settings, spool_name(name)) for name in ("a b", "a_b", "a:b"))
    assert len({a, b, c}) == 3
    assert b.name == "kubernetes-agent-a_b"   # a name of safe characters keeps its spool
    with Spool(a, max_bytes=1 << 20), Spool(b, max_bytes=1 << 20), Spool(c, max_bytes=1 << 20):
        pass


def test_the_spool_of_an_unsafe_name_before_is_taken_over_unless_in_use(tmp_path):
    settings = settings_at(tmp_path)
    before = spool_dir(settings, "kubernetes-agent-a b")   # where 'a b' spooled before
    with Spool(before, max_bytes=1 << 20) as old:
        old.append(b"an event not yet sent", key=b"route")
        adopt_shared_spool(settings, "a b")   # held (by the agent of 'a_b', whose spool it also is): left there
        assert before.is_dir() and not spool_dir(settings, spool_name("a b")).exists()
    adopt_shared_spool(settings, "a b")
    own = spool_dir(settings, spool_name("a b"))
    assert not before.exists()
    with Spool(own, max_bytes=1 << 20) as spool:
        assert [r.value for r in spool.read(10)] == [b"an event not yet sent"]


class ProducerWithLimit:
    """confluent_kafka.Producer's produce() as librdkafka checks `message.max.bytes` (its conf's, else the
    default 1,000,000): a larger message raises at once. (A unit test opens no Kafka; the check is librdkafka's.)"""

    def __init__(self, conf: dict):
        self.queued: list[bytes] = []
        self.limit = int(conf.get("message.max.bytes", 1_000_000))

    def produce(self, topic, key=None, value=b"", on_delivery=None, **kwargs) -> None:
        if len(value) > self.limit:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        self.queued.append(value)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return 0


def test_without_the_spool_a_message_too_large_for_kafka_is_dropped_and_logged(monkeypatch, caplog):
    monkeypatch.setenv("GPULEDGER_AGENT_SPOOL_MAX_BYTES", "0")
    monkeypatch.setattr(publisher_module, "KafkaPublisher",
                        lambda settings, **kw: KafkaPublisher(settings, producer_factory=ProducerWithLimit, **kw))
    publisher = open_publisher(load_settings(), "east")
    too_large = EVENT_MAX_MESSAGE_BYTES + 1
    with caplog.at_level(logging.ERROR):
        # before: KafkaException(MSG_SIZE_TOO_LARGE) out of publish, and the agent stopped
        publisher.publish("gpuledger.job-events", "default/job/huge", b"x" * too_large)
    publisher.publish("gpuledger.job-events", "default/job/small", b"{}")   # the next one goes on
    # over Kafka's default 1 MB (a JobSet's allocation on ~10,000 GPUs): the agent's producer takes it
    publisher.publish("gpuledger.job-events", "default/job/big", b"x" * 2_000_000)
    assert publisher.unsendable == 1 and publisher.produced == 2
    assert any("default/job/huge" in r.getMessage() and f"{too_large} bytes" in r.getMessage() for r in caplog.records)
    publisher.close(0.1)


def test_a_state_file_that_cannot_be_read_is_one_line(started, tmp_path, capsys):
    # before: a traceback (IsADirectoryError / PermissionError out of main)
    (tmp_path / "state").mkdir()
    assert main(["--cluster", "east", *BASE, "--state-file", str(tmp_path / "state")]) == 2
    assert "unreadable state file" in capsys.readouterr().err and started == []
