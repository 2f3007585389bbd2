"""Fault injection on the real pipeline (Tansu + Faust worker + sink + chDB), `make chaos`.

The same simulated replay goes through the pipeline twice: once without faults (the reference),
once while, during the replay,
- the worker is killed with SIGKILL at least 5 times at random moments (and restarted),
- the sink is killed in the middle of a flush, once right after its insert into usage_raw and once
  right before it (GPULEDGER_SINK_FAULT_FILE makes it stop there so the kill lands there),
- the broker is frozen for 60 s (SIGSTOP, then SIGCONT),
- every client is cut off from the broker for 60 s (a TCP proxy in front of it closes all
  connections and refuses new ones),
- the warehouse is unavailable for 90 s (the sink's writer fails every write meanwhile), far longer
  than the sink's max.poll.interval (6 s here): the sink must pause its partitions and keep polling,
  never leave its group, and resume on its own;
- poison of every kind a hostile-producer review found (issue #12): a far-future tick before any
  watermark, events of an attempt never allocated, a `completed` before its `allocated`, 150
  schema-valid snapshots dated 1970 a month apart, a 1970 `failed` for a completed job, a 5 MB
  malformed message; each must come back as a dead letter (that fits its topic) and change nothing;
- after the run, a second writer inserts usage rows that are already there straight into usage_raw.
The bills (tenant_daily_bill, job_cost, capacity_daily) must equal the reference exactly — every
micro-unit — and usage_raw must hold every record once; after the second writer, the bills computed
from usage deduplicated by record_id must still equal the reference's.

GPULEDGER_CHAOS_SEED picks the moments (printed, so a failure can be replayed); the default is random.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpuledger.sink.loop import sink_topics

from gpuledger.agents.simcluster import SimSpec, simulate
from gpuledger.config import Settings
from gpuledger.embedded.replay import publish
from gpuledger.topics import create_topics
from sink_faults import CONTROL_ENV, sink_command

from .harness import (
    Poison,
    ReplayPublisher,
    Supervised,
    Tansu,
    TcpProxy,
    dedup_bills,
    read_bills,
    read_dead_letters,
    second_writer,
    wait_caught_up,
)

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

SPEC = SimSpec(hours=1.5, nodes=3, gpus_per_node=4, seed=11)
FAULT_S = 60.0
OUTAGE_S = 90.0  # the warehouse outage: far longer than the sink's max.poll.interval (6 s)
PACE_S = 150.0  # the chaos replay is spread over this much wall time, so faults hit it mid-stream


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    logs = tmp_path_factory.mktemp("chaos-broker")
    proxy_port = __import__("gpuledger.embedded.broker", fromlist=["free_port"]).free_port()
    broker = Tansu(proxy_port, logs / "tansu.log").start()
    proxy = TcpProxy(broker.port, proxy_port).start()
    try:
        yield broker, proxy
    finally:
        proxy.stop()
        broker.stop()


def make_settings(name: str, root: Path, bootstrap: str, **extra) -> Settings:
    return Settings(
        kafka_bootstrap=bootstrap,
        topic_prefix=f"{name}{uuid.uuid4().hex[:6]}.",
        worker_app_id=f"{name}{uuid.uuid4().hex[:6]}",
        data_dir=root / name,
        warehouse=f"chdb:{root / name / 'chdb'}",
        partitions_gpu_samples=2,
        partitions_job_events=2,
        partitions_usage=2,
        worker_rebalance_timeout_s=4.0,
        worker_snapshot_interval_s=1.0,
        sink_retry_max_s=5.0,
        **extra,
    )


def wait_done(settings: Settings, ends: dict, timeout_s: float) -> None:
    t = settings.topics
    wait_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations], ends,
                   timeout_s=timeout_s, say=say)
    wait_caught_up(settings, f"{settings.worker_app_id}-sink", sink_topics(settings), ends,
                   timeout_s=timeout_s, say=say)


def assert_same_bills(view: str, got: list[dict], expected: list[dict]) -> None:
    """Row for row: money (micros), GPU-time and counts exactly; energy (a sum of floats, whose last
    bits depend on the order the warehouse adds them in) to 1e-9 relative."""
    assert len(got) == len(expected), f"{view}: {len(got)} rows, the fault-free run has {len(expected)}"
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            if k.startswith("energy"):
                assert g[k] == pytest.approx(e[k], rel=1e-9), (view, k, g, e)
            else:
                assert g[k] == e[k], f"{view}.{k}: {g[k]!r} != {e[k]!r} in {e}"


def test_bills_survive_crashes_freezes_partitions_outages_and_poison(network, tmp_path):
    broker, proxy = network
    seed = int(os.environ.get("GPULEDGER_CHAOS_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    say(f"seed {seed} (set GPULEDGER_CHAOS_SEED={seed} to replay these moments)")
    bootstrap = f"127.0.0.1:{proxy.port}"
    emissions = list(simulate(SPEC))
    say(f"{len(emissions)} messages of {SPEC.hours} h on {SPEC.nodes} nodes x {SPEC.gpus_per_node} GPUs")

    # ------------------------------------------------------------------ reference, no faults
    ref = make_settings("ref", tmp_path, bootstrap)
    create_topics(ref)
    started = time.monotonic()
    worker = Supervised(ref, "worker", log_path=tmp_path / "ref-worker.log").start()
    sink = Supervised(ref, "sink", log_path=tmp_path / "ref-sink.log").start()
    try:
        publisher = ReplayPublisher(ref)
        publish(emissions, publisher, ref)
        wait_done(ref, publisher.ends, timeout_s=300)
    finally:
        worker.stop()
        sink.stop()
    assert worker.starts == 1 and sink.starts == 1, "the reference run must be fault-free"
    expected = read_bills(ref.embedded_warehouse_dir)
    say(f"reference done in {time.monotonic() - started:.0f}s: {expected['usage_raw']}")
    assert expected["tenant_daily_bill"] and expected["usage_raw"]["rows"] == expected["usage_raw"]["record_ids"]
    expected_dedup = dedup_bills(ref.embedded_warehouse_dir)

    # ------------------------------------------------------------------ the same replay, with faults
    control = tmp_path / "sink-fault"
    control.write_text("")
    chaos = make_settings("chaos", tmp_path, bootstrap)
    create_topics(chaos)
    started = time.monotonic()
    worker = Supervised(chaos, "worker", log_path=tmp_path / "chaos-worker.log").start()
    sink = Supervised(chaos, log_path=tmp_path / "chaos-sink.log", command=sink_command(),
                      extra_env={CONTROL_ENV: str(control)}).start()
    published: dict = {}
    publisher = ReplayPublisher(chaos)
    poison = Poison(emissions, chaos)
    poison.send_before()  # before the replay: no watermark yet
    say(f"poison sent before the replay: {sorted({k for *_, k in poison.before})}")

    # the last tenth of the replay is held back until the warehouse outage has begun, so that the
    # outage meets writes the sink must hold (and the sink's pause/poll/resume is exercised)
    cut = int(len(emissions) * 0.9)
    tail_go = threading.Event()

    def replay() -> None:
        counts = publish(emissions[:cut], publisher, chaos, speedup=SPEC.hours * 3600 / PACE_S)
        tail_go.wait()
        for line, n in publish(emissions[cut:], publisher, chaos).items():
            counts[line] = counts.get(line, 0) + n
        published.update(counts)

    publishing = threading.Thread(target=replay, name="replay", daemon=True)
    publishing.start()

    kills: list[float] = []
    stop_killing = threading.Event()
    kill_at = sorted(rng.uniform(5, 240) for _ in range(6))

    def kill_worker() -> None:
        for at in kill_at:
            if stop_killing.wait(max(0.0, started + at - time.monotonic())):
                return
            worker.kill()
            kills.append(time.monotonic() - started)
            say(f"worker killed (SIGKILL) at +{kills[-1]:.0f}s; restarting")

    killer = threading.Thread(target=kill_worker, name="killer", daemon=True)
    killer.start()

    def at(offset_s: float) -> None:
        time.sleep(max(0.0, started + offset_s - time.monotonic()))

    def kill_sink_mid_insert(mode: str) -> None:
        paused = Path(f"{control}.paused")
        control.write_text(mode)
        deadline = time.monotonic() + 90
        while not paused.exists():
            assert time.monotonic() < deadline, f"the sink never reached {mode}"
            time.sleep(0.1)
        sink.paused = True
        sink.kill()
        say(f"sink killed (SIGKILL) while paused {paused.read_text().strip()}")
        control.write_text("")
        paused.unlink()
        sink.paused = False

    try:
        at(12)
        kill_sink_mid_insert("pause-after-insert")
        at(24)
        kill_sink_mid_insert("pause-before-insert")
        at(30)
        poison.send_during()
        say(f"poison sent during the replay: {sorted({k for *_, k in poison.during})}")
        at(35)
        say("broker frozen (SIGSTOP)")
        broker.freeze()
        time.sleep(FAULT_S)
        broker.thaw()
        say("broker resumed (SIGCONT)")
        at(105)
        say("clients cut off from the broker")
        proxy.cut()
        time.sleep(FAULT_S)
        proxy.restore()
        say("clients reconnected")
        at(175)
        sink_starts = sink.starts
        sink_log = tmp_path / "chaos-sink.log"
        log_from = sink_log.stat().st_size
        say(f"warehouse unavailable for {OUTAGE_S:.0f}s")
        control.write_text("down")
        time.sleep(5)
        tail_go.set()
        say("the rest of the replay published")
        time.sleep(OUTAGE_S - 5)
        control.write_text("")
        say("warehouse back")
        time.sleep(10)
        with open(sink_log, "rb") as f:
            f.seek(log_from)
            outage_log = f.read().decode(errors="replace")
        killer.join(timeout=120)
        publishing.join(timeout=600)
        assert not publishing.is_alive(), "the replay did not finish"
        say(f"replay published {published}; worker started {worker.starts}x, sink {sink.starts}x; waiting ...")
        assert not publisher.errors, publisher.errors
        wait_done(chaos, publisher.ends, timeout_s=600)
    finally:
        tail_go.set()
        stop_killing.set()
        worker.stop()
        sink.stop()
        proxy.restore()
        broker.thaw()
    say(f"chaos run done in {time.monotonic() - started:.0f}s")

    assert len(kills) >= 5, kills
    assert worker.starts >= 6 and sink.starts >= 3
    # the outage did not cost the sink its group membership, nor its process
    assert sink.starts == sink_starts, "the sink exited during the warehouse outage"
    for sign in ("maximum poll interval", "leaving group", "Unknown member"):
        assert sign not in outage_log, f"the sink left its group during the outage: {sign!r} in its log"
    assert "partitions paused" in outage_log and "partitions resumed" in outage_log, outage_log[-3000:]

    # every poison came back as a dead letter with its reason, each fitting its topic
    assert not poison.errors, poison.errors
    from gpuledger.schemas.models import DeadLetter
    from gpuledger.schemas.wire import decode

    letters = [(len(v), decode(DeadLetter, v)) for v in read_dead_letters(chaos)]
    assert all(size <= chaos.dead_letter_max_bytes for size, _ in letters)
    reasons = [d.reason for _, d in letters]
    assert sum("before 2000" in r and "snapshot" in r for r in set(reasons)) >= 1
    assert len({(d.source_topic, d.offset) for _, d in letters if "before 2000" in d.reason and "snapshot" in d.reason}) == 150
    assert any("clock at receipt" in r for r in reasons), "far-future tick"
    assert any("never allocated" in r for r in reasons) and any("at or after the attempt's end" in r for r in reasons)
    assert any("before 2000" in r and "event" in r for r in reasons), "1970 failed event"
    assert any(d.original_size and d.original_size > 5_000_000 for _, d in letters), "5 MB message"
    say(f"{len(letters)} dead letters, every poison kind among them")

    got = read_bills(chaos.embedded_warehouse_dir)
    assert got["usage_raw"] == expected["usage_raw"], "usage_raw must hold every record exactly once"
    for view in ("tenant_daily_bill", "job_cost", "capacity_daily"):
        assert_same_bills(view, got[view], expected[view])
    assert got["job_events"] == expected["job_events"]

    # a second writer inserts usage rows that are already there: bills from usage deduplicated by
    # record_id still equal the reference to the micro-unit
    second_writer(chaos.embedded_warehouse_dir)
    after = dedup_bills(chaos.embedded_warehouse_dir)
    assert after["usage_raw"]["rows"] > expected["usage_raw"]["rows"], "the second writer inserted nothing"
    assert after["usage_raw"]["record_ids"] == expected["usage_raw"]["record_ids"]
    assert after["bills"] == expected_dedup["bills"]
    say(f"second writer: usage_raw {after['usage_raw']}; deduplicated bills equal the reference")
