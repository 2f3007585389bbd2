"""The Slurm agent's state file and spool are named by the cluster as the Kubernetes agent's spool is
(agents/gpu_agent.py `agent_file_name`): clusters named 'a b' and 'a_b' (both allowed by
gpuledger/config.py) keep apart; and a state file of the name an earlier version gave is never
silently dropped for an empty state (that would send the history again and leave open for ever the
jobs that left squeue meanwhile), nor taken when it says it is another cluster's."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import orjson
import pytest

from gpuledger.agents import publisher as publisher_module
from gpuledger.agents.gpu_agent import agent_file_name, file_safe, spool_dir
from gpuledger.agents.kubernetes_agent import spool_name
from gpuledger.agents.publisher import ListPublisher
from gpuledger.agents.slurm import AgentState
from gpuledger.agents.slurm_agent import (
    SlurmAgent,
    SpoolSink,
    adopt_earlier_spool,
    default_state_file,
    load_state,
    main,
    save_state,
    spool_path,
)
from gpuledger.agents.spool import Spool
from gpuledger.config import Settings


def settings_at(tmp_path, state_file=None):
    return SimpleNamespace(data_dir=str(tmp_path), agent_spool_dir=None, slurm_agent_state_file=state_file)


def earlier_state(tmp_path, name: str, watermark_ms: int, **extra) -> None:
    """A state file as an agent writes it (`extra`: e.g. the cluster this version records)."""
    (tmp_path / name).write_bytes(orjson.dumps({"version": 1, "watermark_ms": watermark_ms, "preemptions": [],
                                                "jobs": {}, **extra}))


# --------------------------------------------------------------------------- one rule for both agents
@pytest.mark.parametrize("name", ["east", "a_b", "a b", "a:b", "東京" * 40, "prod.east-1"])
def test_the_kubernetes_spool_names_stay_what_they_were(name):
    """agents/kubernetes_agent.py's spool_name before it used the shared helper, so its spools are found."""
    import hashlib

    if file_safe(name) == name:
        was = f"kubernetes-agent-{name}"
    else:
        was = f"kubernetes-agent-{file_safe(name)}-{hashlib.blake2b(name.encode(), digest_size=4).hexdigest()}"
    assert spool_name(name) == was == agent_file_name("kubernetes-agent", name)


def test_kubernetes_spools_on_disk_keep_their_names():
    # the directories agents of the previous version made for these clusters
    assert spool_name("a b") == "kubernetes-agent-a_b-7faae47c"
    assert spool_name("a:b") == "kubernetes-agent-a_b-78d6dbab"
    assert spool_name("east") == "kubernetes-agent-east"


# --------------------------------------------------------------------------- Slurm: apart
def test_clusters_whose_names_differ_only_in_unsafe_characters_have_their_own_state_file_and_spool(tmp_path):
    # before: 'a b', 'a:b' and 'a_b' all had DATA_DIR/slurm-agent-a_b.json and spool/slurm-agent-a_b
    settings = settings_at(tmp_path)
    files = [default_state_file(settings, c) for c in ("a b", "a:b", "a_b")]
    spools = [spool_path(settings, c) for c in ("a b", "a:b", "a_b")]
    assert len(set(files)) == 3 and len(set(spools)) == 3
    assert files[2] == tmp_path / "slurm-agent-a_b.json" and spools[2].name == "slurm-agent-a_b"  # safe: as before
    assert re.fullmatch(r"slurm-agent-a_b-[0-9a-f]{8}\.json", files[0].name)
    assert spools[0].name == files[0].stem
    with Spool(spools[0], max_bytes=1 << 20), Spool(spools[1], max_bytes=1 << 20), Spool(spools[2], max_bytes=1 << 20):
        pass  # before: the second agent's spool raised SpoolLocked
    assert default_state_file(settings_at(tmp_path, "/x/given.json"), "a b").as_posix() == "/x/given.json"


def test_the_agent_spools_and_saves_under_the_cluster_s_own_names(tmp_path, monkeypatch):
    monkeypatch.setattr(publisher_module, "KafkaPublisher", lambda *args, **kwargs: ListPublisher())  # no Kafka here
    settings = Settings(kafka_bootstrap="127.0.0.1:9", data_dir=tmp_path / "data", agent_spool_dir=tmp_path / "spool",
                        agent_spool_fsync="never")
    sinks = [SpoolSink(settings, c) for c in ("a b", "a_b")]   # before: the second raised SpoolLocked
    try:
        assert [s.spool.directory for s in sinks] == [spool_path(settings, "a b"), spool_path(settings, "a_b")]
    finally:
        for s in sinks:
            s.close(timeout=0)
    path = default_state_file(settings, "a b")
    agent = SlurmAgent(cluster="a b", state_file=path, sink=None, partitions=1)
    save_state(agent.state_file, AgentState(watermark_ms=5), agent.cluster)
    assert json.loads(path.read_text())["cluster"] == "a b"   # whose state it is: the next start can tell


# --------------------------------------------------------------------------- Slurm: the earlier name
def test_a_state_file_of_the_earlier_name_that_may_be_another_cluster_s_stops_the_agent(tmp_path, monkeypatch, capsys):
    # before: 'a b' read DATA_DIR/slurm-agent-a_b.json, which cluster 'a_b' writes too
    earlier_state(tmp_path, "slurm-agent-a_b.json", 1234)
    with pytest.raises(SystemExit) as stop:
        default_state_file(settings_at(tmp_path), "a b")
    message = str(stop.value)
    own = default_state_file(settings_at(tmp_path), "a_b").with_name(agent_file_name("slurm-agent", "a b") + ".json")
    assert str(tmp_path / "slurm-agent-a_b.json") in message and f"move it to {own}" in message
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))   # the command line stops the same way, before any poll
    with pytest.raises(SystemExit, match="may be this cluster's or another's"):
        main(["--cluster", "a b", "--once", "--print", "--metrics-port", "0"])
    assert (tmp_path / "slurm-agent-a_b.json").exists() and not own.exists()
    # what the message says to do: the state is read, nothing started afresh
    (tmp_path / "slurm-agent-a_b.json").rename(own)
    assert load_state(default_state_file(settings_at(tmp_path), "a b")).watermark_ms == 1234


def test_a_state_file_of_the_earlier_name_that_says_whose_it_is(tmp_path):
    settings = settings_at(tmp_path)
    earlier_state(tmp_path, "slurm-agent-a_b.json", 1234, cluster="a_b")   # cluster a_b's (this version)
    path = default_state_file(settings, "a b")
    assert path.name != "slurm-agent-a_b.json" and load_state(path).watermark_ms == 0   # a b never had one
    assert load_state(default_state_file(settings, "a_b")).watermark_ms == 1234         # a_b keeps its own
    earlier_state(tmp_path, "slurm-agent-a_b.json", 4321, cluster="a b")   # this cluster's: moved and read
    path = default_state_file(settings, "a b")
    assert load_state(path).watermark_ms == 4321 and not (tmp_path / "slurm-agent-a_b.json").exists()


def test_a_safe_cluster_name_keeps_its_state_file_written_before(tmp_path):
    earlier_state(tmp_path, "slurm-agent-a_b.json", 1234)   # no cluster recorded: an earlier version's
    assert load_state(default_state_file(settings_at(tmp_path), "a_b")).watermark_ms == 1234


def test_the_spool_of_the_earlier_name_is_taken_over_unless_in_use_or_another_s(tmp_path):
    settings = settings_at(tmp_path)
    before = spool_dir(settings, "slurm-agent-a_b")   # where 'a b' spooled before
    own = spool_path(settings, "a b")
    with Spool(before, max_bytes=1 << 20) as old:
        old.append(b"an event not yet sent", key=b"job-events\x1f\x1f7")
        adopt_earlier_spool(settings, "a b")   # held (by the agent of 'a_b', whose spool it also is): left there
        assert before.is_dir() and not own.exists()
    earlier_state(tmp_path, "slurm-agent-a_b.json", 1, cluster="a_b")
    adopt_earlier_spool(settings, "a b")       # the state of that name says it is a_b's: so is the spool
    assert before.is_dir() and not own.exists()
    (tmp_path / "slurm-agent-a_b.json").unlink()
    adopt_earlier_spool(settings, "a b")
    assert not before.exists()
    with Spool(own, max_bytes=1 << 20) as spool:
        assert [r.value for r in spool.read(10)] == [b"an event not yet sent"]
