"""The agent's tick building and scheduling (sim backend, injected clock), and its publishers."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from gpuledger.agents.backend import GpuBackend
from gpuledger.agents.gpu_agent import build_tick, main, next_grid_ms, run_agent
from gpuledger.agents.publisher import KafkaPublisher, ListPublisher, PublishError, redacted
from gpuledger.agents.sim_backend import SimBackend, SimProcess, parse_sim_models
from gpuledger.config import Settings
from gpuledger.schemas.models import GpuHealth, NodeTick
from gpuledger.schemas.wire import decode, decode_node_ticks, encode

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "agent_tick.json"
CID_1 = "1" * 64
CID_2 = "2" * 64
GiB = 1 << 30


class FakeClock:
    """Epoch-seconds clock; sleeping advances it instead of waiting."""

    def __init__(self, t: float):
        self.t = t
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.t += seconds


def busy_node(seed: int = 7) -> SimBackend:
    sim = SimBackend(["A100-80GB", "A100-80GB", "T4"], seed=seed, node="node-a")
    sim.set_gpu(0, processes=[SimProcess(101, CID_1, sm_util_pct=60, mem_used_bytes=20 * GiB),
                              SimProcess(202, CID_2, sm_util_pct=25, mem_used_bytes=10 * GiB)])
    sim.set_gpu(1, util_pct=40, processes=[SimProcess(303, CID_1, mem_used_bytes=GiB)])
    sim.set_down(2, "drained for repair")
    return sim


# --------------------------------------------------------------------------- build_tick / sim
def test_sim_backend_satisfies_the_interface() -> None:
    assert isinstance(SimBackend(["T4"]), GpuBackend)


def test_build_tick_is_a_valid_node_tick() -> None:
    sim = busy_node()
    tick = build_tick(sim, cluster="c1", node="node-a", now_ms=1_700_000_000_000, interval_ms=5_000)
    assert decode(NodeTick, encode(tick)) == tick
    g0, g1, g2 = tick.gpus
    assert [g.index for g in tick.gpus] == [0, 1, 2]
    assert [(p.pid, p.container_id, p.sm_util_pct) for p in g0.processes] == [(101, CID_1, 60.0), (202, CID_2, 25.0)]
    assert 83 <= g0.util_gpu_pct <= 87 and g0.mem_used_bytes == 30 * GiB
    assert g1.processes[0].sm_util_pct == g1.util_gpu_pct  # unset share: all of the GPU's busy time
    assert (g2.health, g2.down_reason, g2.util_gpu_pct) == (GpuHealth.down, "drained for repair", None)
    assert sim.calls_last_tick == 4  # one per GPU plus the event poll


def test_sim_is_deterministic_per_seed_and_node() -> None:
    a = build_tick(busy_node(seed=1), cluster="c", node="n", now_ms=0, interval_ms=5_000)
    b = build_tick(busy_node(seed=1), cluster="c", node="n", now_ms=0, interval_ms=5_000)
    c = build_tick(busy_node(seed=2), cluster="c", node="n", now_ms=0, interval_ms=5_000)
    assert a == b and a != c
    assert SimBackend(["T4"], node="x").uuids != SimBackend(["T4"], node="y").uuids


def test_sim_energy_integrates_power_over_time() -> None:
    sim = SimBackend(["H100-80GB"], seed=3, jitter_pct=0)
    sim.set_gpu(0, util_pct=50)
    (g0,) = sim.sample(0)
    (g1,) = sim.sample(10_000)
    assert g0.power_w == g1.power_w == pytest.approx(70 + 630 * 0.5)
    assert g1.energy_j - g0.energy_j == pytest.approx(g1.power_w * 10, abs=1e-3)


def test_sim_xids() -> None:
    sim = SimBackend(["A100-80GB", "A100-80GB"])
    sim.inject_xid(0, 13)
    sim.inject_xid(1, 79)
    g0, g1 = sim.sample(0)
    assert (g0.health, g0.xid_errors) == (GpuHealth.ok, [13])
    assert (g1.health, g1.down_reason, g1.xid_errors) == (GpuHealth.down, "xid 79: GPU fell off the bus", [79])
    g0, g1 = sim.sample(5_000)
    assert g0.xid_errors == [] and g1.health == GpuHealth.down
    sim.set_up(1)
    assert sim.sample(10_000)[1].health == GpuHealth.ok


def test_parse_sim_models() -> None:
    assert parse_sim_models("2xA100-80GB, T4") == ["A100-80GB", "A100-80GB", "T4"]
    with pytest.raises(ValueError, match="NxMODEL"):
        parse_sim_models("0xT4")
    with pytest.raises(ValueError):
        parse_sim_models(" , ")


# --------------------------------------------------------------------------- golden
def test_golden_agent_tick() -> None:
    """Two ticks of a fixed simulated node. GPULEDGER_UPDATE_GOLDEN=1 rewrites the file."""
    sim = busy_node(seed=7)
    ticks = [build_tick(sim, cluster="golden", node="node-a", now_ms=1_767_225_600_000 + i * 5_000, interval_ms=5_000)
             for i in range(2)]
    actual = [orjson.loads(encode(t)) for t in ticks]
    if os.environ.get("GPULEDGER_UPDATE_GOLDEN") == "1":
        GOLDEN.write_bytes(orjson.dumps(actual, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
    assert GOLDEN.exists(), f"{GOLDEN} missing: run with GPULEDGER_UPDATE_GOLDEN=1 to create it"
    expected = orjson.loads(GOLDEN.read_bytes())
    assert actual == expected, "agent output changed; if intended, rerun with GPULEDGER_UPDATE_GOLDEN=1 and review the diff"


# --------------------------------------------------------------------------- run_agent
def test_ticks_on_the_interval_grid_keyed_by_node() -> None:
    clock = FakeClock(1_000_012.3)
    pub = ListPublisher()
    n = run_agent(SimBackend(["T4"]), pub, "gpuledger.gpu-samples", cluster="c", node="node-7",
                  interval_s=5, clock=clock, sleep=clock.sleep, max_ticks=3)
    assert n == 3
    ticks = [decode(NodeTick, v) for v in pub.values()]
    assert [t.ts_ms for t in ticks] == [1_000_015_000, 1_000_020_000, 1_000_025_000]
    assert all(t.interval_ms == 5_000 and t.node == "node-7" for t in ticks)
    assert {(topic, key, part) for topic, key, _, part in pub.messages} == {("gpuledger.gpu-samples", b"node-7", None)}
    assert clock.sleeps == pytest.approx([2.7, 5.0, 5.0])  # never slept for real


def test_on_the_grid_publishes_at_once_and_interval_is_configurable() -> None:
    clock = FakeClock(60.0)
    pub = ListPublisher()
    run_agent(SimBackend(["T4"]), pub, "t", cluster="c", node="n", interval_s=10,
              clock=clock, sleep=clock.sleep, max_ticks=2)
    assert [decode(NodeTick, v).ts_ms for v in pub.values()] == [60_000, 70_000]
    assert next_grid_ms(60_001, 10_000) == 70_000 and next_grid_ms(60_000, 10_000) == 60_000


def test_ticks_per_message_sends_batches_and_the_rest_on_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(60.0)
    pub = ListPublisher()
    n = run_agent(SimBackend(["T4", "T4"]), pub, "t", cluster="c", node="n", interval_s=1,
                  clock=clock, sleep=clock.sleep, max_ticks=7, ticks_per_message=3)
    assert n == 7
    messages = [decode_node_ticks(v) for v in pub.values()]
    assert [len(m) for m in messages] == [3, 3, 1]  # the last, partial one goes out when the agent stops
    assert [t.ts_ms for m in messages for t in m] == [60_000 + 1000 * i for i in range(7)]
    assert b'"tick_batch"' in pub.values()[0] and b'"tick_batch"' not in pub.values()[2]  # one tick: a NodeTick
    # a batch over the message size limit goes out as several messages, every tick in order
    from gpuledger.agents import gpu_agent

    monkeypatch.setattr(gpu_agent, "MAX_MESSAGE_BYTES", len(pub.values()[0]) // 2)
    pub = ListPublisher()
    assert run_agent(SimBackend(["T4", "T4"]), pub, "t", cluster="c", node="n", interval_s=1, clock=clock,
                     sleep=clock.sleep, max_ticks=6, ticks_per_message=6) == 6
    sizes = [len(decode_node_ticks(v)) for v in pub.values()]
    assert len(sizes) > 1 and sum(sizes) == 6 and all(len(v) <= gpu_agent.MAX_MESSAGE_BYTES for v in pub.values()[:-1])
    stamps = [t.ts_ms for v in pub.values() for t in decode_node_ticks(v)]
    assert stamps == [stamps[0] + 1000 * i for i in range(6)]
    with pytest.raises(ValueError, match="ticks_per_message"):
        run_agent(SimBackend(["T4"]), pub, "t", cluster="c", node="n", ticks_per_message=0, max_ticks=1)


class _NoGpus:
    """A node with no GPUs: the smallest valid tick (cheap enough to take 10001 of them)."""

    calls_last_tick = 0

    def sample(self, now_ms: int) -> list:
        return []

    def close(self) -> None:
        pass


def test_a_batch_longer_than_a_node_tick_batch_may_hold_is_split_not_lost() -> None:
    """More held ticks than NodeTickBatch.ticks allows (max_length) used to raise a ValidationError in
    send(): the agent died and every held tick was lost. They now go out as several batches."""
    from gpuledger.agents.gpu_agent import MAX_TICKS_PER_MESSAGE

    n = MAX_TICKS_PER_MESSAGE + 1
    clock = FakeClock(60.0)
    pub = ListPublisher()
    published = run_agent(_NoGpus(), pub, "t", cluster="c", node="n", interval_s=1, clock=clock,
                          sleep=clock.sleep, max_ticks=n, ticks_per_message=n)
    assert published == n
    sizes = [len(decode_node_ticks(v)) for v in pub.values()]
    assert sum(sizes) == n and max(sizes) <= MAX_TICKS_PER_MESSAGE and len(sizes) >= 2, sizes
    assert [t.ts_ms for v in pub.values() for t in decode_node_ticks(v)] == [60_000 + 1000 * i for i in range(n)]


class SlowBackend:
    """Wraps a backend; its n-th sample takes `delays[n]` seconds of (fake) time."""

    def __init__(self, inner: GpuBackend, clock: FakeClock, delays: list[float]):
        self.inner, self.clock, self.delays = inner, clock, delays
        self.calls_last_tick = 0

    def sample(self, now_ms: int):
        self.clock.t += self.delays.pop(0) if self.delays else 0.0
        return self.inner.sample(now_ms)

    def close(self) -> None:
        pass


class CountingMetrics:
    """What run_agent reports to its `metrics` (gpuledger.metrics.AgentMetrics), recorded."""

    def __init__(self) -> None:
        self.sampled: list[int] = []
        self.skipped: list[int] = []
        self.failed = 0

    def tick_sampled(self, ts_ms: int) -> None:
        self.sampled.append(ts_ms)

    def ticks_skipped(self, n: int) -> None:
        self.skipped.append(n)

    def tick_failed(self) -> None:
        self.failed += 1


def test_overrun_skips_missed_grid_points_and_never_double_publishes() -> None:
    clock = FakeClock(100.0)
    backend = SlowBackend(SimBackend(["T4"]), clock, delays=[12.0, 0.5, 0.0])
    pub = ListPublisher()
    metrics = CountingMetrics()
    run_agent(backend, pub, "t", cluster="c", node="n", interval_s=5, clock=clock, sleep=clock.sleep, max_ticks=3,
              metrics=metrics)
    stamps = [decode(NodeTick, v).ts_ms for v in pub.values()]
    # tick at 100 s took until 112 s: 105 s is skipped (counted), not published late; 110 s is taken at 112 s.
    assert stamps == [100_000, 110_000, 115_000]
    assert len(set(stamps)) == len(stamps)
    assert metrics.skipped == [1] and metrics.sampled == stamps


def test_clock_stepped_back_sleeps_one_interval_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    true_time = {"t": 100.0}
    sleeps: list[float] = []

    class SteppedClock:
        """The node's clock: steps back an hour at 112 s (true time), corrected at 114 s."""

        def __call__(self) -> float:
            t = true_time["t"]
            return t - 3600.0 if 112.0 <= t < 114.0 else t

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        true_time["t"] += seconds

    class TwoSecondSample(SimBackend):  # sampling takes 2 s of true time
        def sample(self, now_ms: int):
            true_time["t"] += 2.0
            return super().sample(now_ms)

    pub = ListPublisher()
    with caplog.at_level(logging.WARNING, logger="gpuledger.agents.gpu_agent"):
        run_agent(TwoSecondSample(["T4"]), pub, "t", cluster="c", node="n", interval_s=5, clock=SteppedClock(),
                  sleep=sleep, max_ticks=5)
    assert max(sleeps) <= 5.0  # not the hour of the step
    # the grid goes on where it was: no tick missed once the clock is right, none sampled twice
    assert [decode(NodeTick, v).ts_ms for v in pub.values()] == [100_000, 105_000, 110_000, 115_000, 120_000]
    assert "clock went back by at least 3598000 ms" in caplog.text  # an hour, less the 2 s of sampling


def test_stop_event_and_failed_tick_is_skipped() -> None:
    import threading

    clock = FakeClock(0.0)
    stop = threading.Event()

    class Flaky(SimBackend):
        n = 0

        def sample(self, now_ms: int):
            self.n += 1
            if self.n == 2:
                raise RuntimeError("device hiccup")
            if self.n == 3:
                stop.set()
            return super().sample(now_ms)

    pub = ListPublisher()
    metrics = CountingMetrics()
    n = run_agent(Flaky(["T4"]), pub, "t", cluster="c", node="n", interval_s=5,
                  clock=clock, sleep=clock.sleep, stop=stop, metrics=metrics)
    assert n == 2
    assert [decode(NodeTick, v).ts_ms for v in pub.values()] == [0, 10_000]
    assert metrics.failed == 1 and metrics.skipped == []  # a failed tick is counted as failed, not as skipped


def test_bad_interval() -> None:
    with pytest.raises(ValueError):
        run_agent(SimBackend(["T4"]), ListPublisher(), "t", cluster="c", node="n", interval_s=0)


def test_main_once_print(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "sim", "--sim-gpus", "2xL40S", "--once", "--print", "--node", "n9",
                 "--cluster", "c9", "--interval", "10"]) == 0
    tick = decode(NodeTick, capsys.readouterr().out.strip().encode())
    assert (tick.cluster, tick.node, tick.interval_ms, len(tick.gpus)) == ("c9", "n9", 10_000, 2)
    assert tick.ts_ms % 10_000 == 0


def test_main_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "sim", "--sim-gpus", "4xH100-80GB", "--bench", "5"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["ticks"] == 5 and out["gpus"] == 4 and out["calls_per_tick_max"] == 5


def test_main_bad_sim_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "sim", "--sim-gpus", "0xT4", "--once", "--print"]) == 2
    assert "NxMODEL" in capsys.readouterr().err


# --------------------------------------------------------------------------- publishers
class FakeProducer:
    def __init__(self, conf: dict[str, Any], *, buffer_errors: int = 0):
        self.conf = conf
        self.buffer_errors = buffer_errors
        self.produced: list[dict[str, Any]] = []
        self.polls: list[float] = []
        self.pending: list[tuple[Any, Any]] = []

    def produce(self, topic: str, **kw: Any) -> None:
        if self.buffer_errors:
            self.buffer_errors -= 1
            raise BufferError("Local: Queue full")
        self.produced.append({"topic": topic, **kw})
        self.pending.append((topic, kw))

    def poll(self, timeout: float = 0) -> int:
        self.polls.append(timeout)
        return 0

    def deliver(self, error: str | None = None) -> None:
        topic, kw = self.pending.pop(0)
        msg = SimpleNamespace(topic=lambda: topic, key=lambda: kw["key"], value=lambda: kw["value"])
        kw["on_delivery"](error, msg)  # librdkafka passes a KafkaError; str() is all we use

    def flush(self, timeout: float = 30) -> int:
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending)


def kafka(settings: Settings | None = None, **kw: Any) -> tuple[KafkaPublisher, FakeProducer]:
    made: list[FakeProducer] = []
    buffer_errors = kw.pop("buffer_errors", 0)

    def factory(conf: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(conf, buffer_errors=buffer_errors))
        return made[0]

    pub = KafkaPublisher(settings or Settings(kafka_bootstrap="broker:9092"), producer_factory=factory, **kw)
    return pub, made[0]


def test_kafka_publisher_config() -> None:
    pub, prod = kafka(linger_ms=5, **{"client.id": "agent-1"})
    conf = prod.conf
    assert conf["bootstrap.servers"] == "broker:9092"
    assert (conf["enable.idempotence"], conf["acks"], conf["compression.type"]) == (True, "all", "lz4")
    assert conf["linger.ms"] == 5 and conf["client.id"] == "agent-1"
    assert callable(conf["error_cb"])


def test_kafka_publisher_publish_and_delivery_counters(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[tuple] = []
    pub, prod = kafka(on_delivery_failure=lambda *a: failures.append(a))
    with pub:
        pub.publish("t", "node-1", b"v1")
        pub.publish("t", b"node-2", b"v2", partition=3)
        assert [(m["key"], m["value"], m.get("partition")) for m in prod.produced] == [
            (b"node-1", b"v1", None), (b"node-2", b"v2", 3)]
        prod.deliver()
        prod.deliver("Broker: Not enough in-sync replicas")
        assert (pub.produced, pub.delivered, pub.failed) == (2, 1, 1)
    assert failures == [("t", b"node-2", b"v2", "Broker: Not enough in-sync replicas")]
    assert "Not enough in-sync replicas" in caplog.text
    with pytest.raises(PublishError, match="closed"):
        pub.publish("t", "k", b"v")


def test_kafka_publisher_waits_out_a_full_queue() -> None:
    pub, prod = kafka(buffer_errors=3)
    pub.publish("t", "k", b"v")
    assert len(prod.produced) == 1 and prod.polls[:3] == [0.1, 0.1, 0.1]


def test_kafka_publisher_raises_when_the_queue_stays_full() -> None:
    pub, prod = kafka(buffer_errors=10**9, queue_full_timeout_s=0.0)
    with pytest.raises(PublishError, match="queue still full"):
        pub.publish("t", "k", b"v")
    assert pub.produced == 0


def test_kafka_publisher_close_reports_undelivered(caplog: pytest.LogCaptureFixture) -> None:
    pub, prod = kafka()
    pub.publish("t", "k", b"v")
    assert pub.close() == 1
    assert "1 message(s) undelivered" in caplog.text


def test_secrets_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    settings = Settings(kafka_security_protocol="SASL_SSL", kafka_sasl_username="agent",
                        kafka_sasl_password="hunter2-very-secret")
    pub, prod = kafka(settings)
    assert prod.conf["sasl.password"] == "hunter2-very-secret"  # the client gets it ...
    assert "hunter2" not in caplog.text and "hunter2" not in repr(pub)  # ... nobody else
    assert redacted({"sasl.password": "x", "acks": "all"}) == {"sasl.password": "***", "acks": "all"}


def test_list_publisher() -> None:
    with ListPublisher() as pub:
        pub.publish("a", "k", b"1")
        pub.publish("b", None, b"2", partition=0)
        assert pub.values("a") == [b"1"] and pub.values() == [b"1", b"2"]
        assert (pub.poll(), pub.flush(), pub.delivered) == (0, 0, 2)
    with pytest.raises(PublishError):
        pub.publish("a", "k", b"3")


@pytest.mark.parametrize("argv,message", [
    (["--interval", "0.0001"], "--interval must be a number of seconds of at least 0.001"),  # rounds to 0 ms
    (["--interval", "0.0004"], "--interval must be a number of seconds of at least 0.001"),
    (["--interval", "0"], "--interval must be a number of seconds of at least 0.001"),
    (["--interval", "-5"], "--interval must be a number of seconds of at least 0.001"),
    (["--interval", "inf"], "--interval must be a number of seconds of at least 0.001"),
    (["--interval", "nan"], "--interval must be a number of seconds of at least 0.001"),
    (["--metrics-port", "70000"], "--metrics-port must be within 0..65535"),
    (["--metrics-port", "-1"], "--metrics-port must be within 0..65535"),
    (["--ticks-per-message", "0"], "--ticks-per-message must be within 1..10000"),
    # NodeTickBatch.ticks holds at most 10000 (the config's le=10_000 too): 10001 was accepted, then lost ticks
    (["--ticks-per-message", "10001"], "--ticks-per-message must be within 1..10000"),
])
@pytest.mark.parametrize("agent", ["gpu", "dcgm"])
def test_impossible_tick_options_are_refused_with_one_line(agent, argv, message, capsys):
    """No ZeroDivisionError / OverflowError traceback: argparse's usage error naming the option."""
    if agent == "gpu":
        run = lambda: main(["--backend", "sim", "--once", "--print", *argv])  # noqa: E731
    else:
        from gpuledger.agents.dcgm_agent import main as dcgm_main
        run = lambda: dcgm_main(["--url", "http://127.0.0.1:9/metrics", "--once", "--print", *argv])  # noqa: E731
    with pytest.raises(SystemExit) as exc:
        run()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_one_millisecond_interval_is_accepted(capsys):
    assert main(["--backend", "sim", "--sim-gpus", "1xT4", "--once", "--print", "--interval", "0.001"]) == 0
    assert decode(NodeTick, capsys.readouterr().out.strip().encode()).interval_ms == 1


def test_once_exits_1_when_the_broker_refuses_the_tick(monkeypatch, capsys):
    """`--once` returned 0 when the broker refused the tick (a delivery report with an error): flush()
    counts only what still waits, and a refused tick does not wait. A fake producer: the exit code's
    logic (the dcgm agent's twin: tests/unit/test_dcgm.py)."""
    from refusing_producer import refuse_every_message

    refuse_every_message(monkeypatch)
    assert main(["--backend", "sim", "--sim-gpus", "2xL40S", "--once", "--node", "n9"]) == 1
    assert "not delivered" in capsys.readouterr().err


@pytest.mark.parametrize("agent", ["gpu", "dcgm"])
def test_a_cluster_name_the_wire_refuses_is_a_usage_error(agent, capsys):
    """`--cluster ' bad'` was a pydantic traceback at the first tick (NodeTick refuses it); now a usage
    error naming the flag, for both agents that build ticks (check_tick_options)."""
    from gpuledger.agents.dcgm_agent import main as dcgm_main

    argv = ["--cluster", " bad", "--once", "--print", "--node", "n1"]
    with pytest.raises(SystemExit) as exc:
        if agent == "gpu":
            main(["--backend", "sim", "--sim-gpus", "1xL40S", *argv])
        else:
            dcgm_main(["--url", "http://127.0.0.1:9/metrics", *argv])
    assert exc.value.code == 2 and "--cluster" in capsys.readouterr().err


def test_ticks_held_for_a_batch_go_out_when_ctrl_c_stops_the_agent() -> None:
    """Ctrl-C (SIGINT) raises KeyboardInterrupt in the wait between ticks: the ticks already held for the next
    batch are handed over (to the spool) on the way out, as on a SIGTERM stop, not lost with the process."""
    clock = FakeClock(60.0)
    pub = ListPublisher()
    waits = []

    def interrupted_sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 8:
            raise KeyboardInterrupt
        clock.sleep(seconds)

    with pytest.raises(KeyboardInterrupt):
        run_agent(SimBackend(["T4"]), pub, "t", cluster="c", node="n", interval_s=1, clock=clock,
                  sleep=interrupted_sleep, ticks_per_message=10)
    stamps = [t.ts_ms for v in pub.values() for t in decode_node_ticks(v)]
    assert stamps == [60_000 + 1000 * i for i in range(8)]  # the 8 sampled before the 8th wait
