"""The Kubernetes agent's disk spool is per cluster, as its state file is: with one shared spool
directory, a second cluster's agent on the same data volume died at start with a SpoolLocked
traceback. A second agent of the same cluster is refused with one line (exit 2); the shared spool
of earlier versions is taken over by the first agent to start."""

from __future__ import annotations

from types import SimpleNamespace

from gpuledger.agents.gpu_agent import spool_dir
from gpuledger.agents.kubernetes_agent import SPOOL_NAME, adopt_shared_spool, main, spool_name
from gpuledger.agents.spool import Spool


def settings_at(tmp_path):
    return SimpleNamespace(agent_spool_dir=None, data_dir=str(tmp_path))


def test_two_clusters_spool_apart(tmp_path):
    settings = settings_at(tmp_path)
    a, b = spool_dir(settings, spool_name("east")), spool_dir(settings, spool_name("west"))
    assert a != b
    with Spool(a, max_bytes=1 << 20), Spool(b, max_bytes=1 << 20):  # both held at once: no SpoolLocked
        pass


def test_the_shared_spool_of_before_is_taken_over_once(tmp_path):
    settings = settings_at(tmp_path)
    shared = spool_dir(settings, SPOOL_NAME)
    with Spool(shared, max_bytes=1 << 20) as old:
        old.append(b"an event not yet sent", key=b"route")
    adopt_shared_spool(settings, "east")
    own = spool_dir(settings, spool_name("east"))
    assert not shared.exists() and own.is_dir()
    with Spool(own, max_bytes=1 << 20) as spool:
        assert [r.value for r in spool.read(10)] == [b"an event not yet sent"]
    adopt_shared_spool(settings, "west")  # nothing left to take: west starts empty
    assert not spool_dir(settings, spool_name("west")).exists()


def test_a_second_agent_of_the_cluster_is_refused_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("GPULEDGER_AGENT_SPOOL_FSYNC", "never")
    held = spool_dir(settings_at(tmp_path), spool_name("east"))
    with Spool(held, max_bytes=1 << 20):  # the first agent of cluster east
        rc = main(["--cluster", "east", "--no-devices", "--api-server", "http://127.0.0.1:9"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "is in use by another process" in err and "another kubernetes agent running for cluster east" in err
