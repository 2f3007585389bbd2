"""The embedded pipeline's guards that need no broker or engine: the data-directory lock, dump
lines on an unknown topic, messages the broker refused, non-finite demo hours, the SIGTERM handler
of the pipeline commands and the parent-death signal of child processes. (With the real Tansu and chDB:
tests/integration/test_embedded_faults.py.)"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from gpuledger.agents.publisher import ListPublisher
from gpuledger.cli import exit_on_sigterm, main
from gpuledger.config import Settings
from gpuledger.embedded.demo import load_dump
from gpuledger.embedded.pipeline import LOCK_FILE, PipelineError, hold_data_dir, run_embedded
from gpuledger.embedded.processes import settings_env
from gpuledger.embedded.replay import DumpError, DumpLine, publish, read_dump

GOOD = {"topic": "job-events", "key": None, "value": {"type": "watermark", "cluster": "c", "ts_ms": 5}}


def write_dump(path: Path, *rows: dict) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


# --------------------------------------------------------------------------- the data-directory lock
def test_a_data_directory_held_by_another_run_is_refused_before_anything_starts(tmp_path):
    data = tmp_path / "data"
    (data / "chdb").mkdir(parents=True)
    (data / "chdb" / "keep").write_text("another run's warehouse")
    with open(data / LOCK_FILE, "a+") as other:  # another open file = another holder, as another process would be
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("process 4242")
        other.flush()
        with pytest.raises(PipelineError, match=r"in use by process 4242 .*another --data-dir"):
            run_embedded(Settings(data_dir=data), [])
    assert (data / "chdb" / "keep").exists()  # nothing emptied


def test_hold_data_dir_is_reentrant_and_released(tmp_path):
    with hold_data_dir(tmp_path):
        with hold_data_dir(tmp_path):  # a GenAI replay's two runs inside its own hold
            pass
        with open(tmp_path / LOCK_FILE) as probe, pytest.raises(OSError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still held after the inner block
        assert (tmp_path / LOCK_FILE).read_text() == f"process {os.getpid()}"
    with open(tmp_path / LOCK_FILE) as probe:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released


# --------------------------------------------------------------------------- dump topics
def test_a_dump_line_on_an_unknown_topic_is_refused_with_file_and_line(tmp_path):
    dump = write_dump(tmp_path / "typo.jsonl", GOOD, {**GOOD, "topic": "gpu_samples"})
    with pytest.raises(DumpError) as err:
        read_dump(dump, "t1.")
    text = str(err.value)
    assert f"{dump}:2: unknown topic 'gpu_samples'" in text
    assert "gpu-samples, job-events, scheduler-snapshots" in text
    with pytest.raises(DumpError, match=r"typo.jsonl:2: unknown topic"):
        load_dump(dump, "")
    assert read_dump(write_dump(tmp_path / "ok.jsonl", {**GOOD, "topic": "t1.job-events"}), "t1.")  # prefixed: fine


def test_publish_refuses_an_unknown_topic_too():
    settings = Settings(topic_prefix="t1.")
    with pytest.raises(DumpError, match="dump line 2: unknown topic 'GPU-samples'"):
        publish([DumpLine("job-events", None, GOOD["value"]), DumpLine("GPU-samples", "n", {"ts_ms": 6})],
                ListPublisher(), settings)


def test_demo_and_replay_refuse_a_dump_with_an_unknown_topic(tmp_path, capsys):
    dump = write_dump(tmp_path / "typo.jsonl", GOOD, {**GOOD, "topic": "gpu_samples"})
    assert main(["replay", str(dump), "--bootstrap", "127.0.0.1:1"]) == 2
    assert f"{dump}:2: unknown topic 'gpu_samples'" in capsys.readouterr().err
    assert main(["demo", "--input", str(dump), "--data-dir", str(tmp_path / "data")]) == 2
    assert f"{dump}:2: unknown topic 'gpu_samples'" in capsys.readouterr().err


# --------------------------------------------------------------------------- demo --hours
@pytest.mark.parametrize("hours", ["inf", "nan", "-inf"])
def test_demo_refuses_non_finite_hours(tmp_path, capsys, hours):
    assert main(["demo", f"--hours={hours}", "--data-dir", str(tmp_path)]) == 2
    assert "invalid SimSpec: hours must be > 0 and finite" in capsys.readouterr().err


# --------------------------------------------------------------------------- signals
def test_sigterm_raises_system_exit_143_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        with exit_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this
    assert exited.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_child_started_dying_with_parent_stops_when_its_parent_is_killed(tmp_path):
    """The parent (a Python process that starts `sleep` as ChildProcess and EmbeddedBroker do) is
    SIGKILLed: no clean-up runs, yet the child gets SIGTERM from the kernel."""
    script = ("import subprocess, sys, time\n"
              "from gpuledger.embedded.processes import dying_with_parent\n"
              "child = subprocess.Popen(dying_with_parent(['sleep', '60']))\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(child):
            time.sleep(0.05)
        assert not alive(child), "the child outlived its SIGKILLed parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_process_starts_without_the_parents_fork_handlers(tmp_path):
    """ChildProcess starts its child without forking the parent's state into it (no preexec_fn): a
    parent's fork handlers do not run there. With them, a parent serving gRPC (the Kubernetes tests'
    fake kubelet) aborted the agent before it ran ("epoll_wait error: Bad file descriptor")."""
    marker = tmp_path / "fork-handler-ran"
    script = ("import os, sys\n"
              "from gpuledger.config import Settings\n"
              "from gpuledger.embedded.processes import ChildProcess\n"
              f"os.register_at_fork(after_in_child=lambda: open({str(marker)!r}, 'w').close())\n"
              "child = ChildProcess(Settings(), 'ok', command=[sys.executable, '-c', 'import sys; print(sys.argv[1])'])\n"
              "sys.exit(child.start().proc.wait())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), "the parent's fork handlers ran in the child"


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- refused deliveries
class _RefusingPublisher(ListPublisher):
    """The broker refuses every message to a partition from `refuse_from` on (e.g. a job-events
    topic with fewer partitions than GPULEDGER_PARTITIONS_JOB_EVENTS): counted in `failed` at
    delivery, as KafkaPublisher counts it; flush then leaves nothing in the queue."""

    def __init__(self, refuse_from: int):
        super().__init__()
        self.refuse_from = refuse_from

    def publish(self, topic, key, value, partition=None, on_delivery=None):
        if partition is not None and partition >= self.refuse_from:
            self.failed += 1
            return
        super().publish(topic, key, value, partition)


def test_publish_raises_when_the_broker_refused_messages():
    """A watermark for 4 partitions on a topic with 2: the 2 refused copies were only logged, and
    replay printed its counts and exited 0 as if the whole dump were on Kafka."""
    settings = Settings(partitions_job_events=4)
    publisher = _RefusingPublisher(refuse_from=2)
    with pytest.raises(RuntimeError, match=r"2 message\(s\) refused by the broker"):
        publish([DumpLine("job-events", None, GOOD["value"])], publisher, settings)
    assert len(publisher.messages) == 2  # what the broker took is still counted as delivered there


def test_publish_counts_only_this_runs_refusals():
    publisher = _RefusingPublisher(refuse_from=2)
    publisher.failed = 3  # an earlier publish on the same producer
    assert publish([DumpLine("job-events", None, GOOD["value"])], publisher, Settings(partitions_job_events=2)) \
        == {"gpu-samples": 0, "job-events": 1, "scheduler-snapshots": 0}



# --------------------------------------------------------------------------- child settings
def test_a_setting_unset_in_the_parent_is_unset_in_the_child(monkeypatch):
    """A child process reads its settings from the environment: a GPULEDGER_* variable the parent's
    settings do not use (None there, e.g. SASL credentials cleared for the embedded broker) must not
    reach it from the parent's own environment."""
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_USERNAME", "prod-user")
    monkeypatch.setenv("GPULEDGER_KAFKA_SASL_PASSWORD", "prod-secret")
    env = settings_env(Settings().model_copy(update={"kafka_sasl_username": None, "kafka_sasl_password": None}))
    assert "GPULEDGER_KAFKA_SASL_USERNAME" not in env and "GPULEDGER_KAFKA_SASL_PASSWORD" not in env
    assert env["GPULEDGER_KAFKA_SECURITY_PROTOCOL"] == "PLAINTEXT"
