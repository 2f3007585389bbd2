"""gpuledger_consumer_lag_messages{component, topic, partition} (docs/reliability.md, "Metrics"):
the real worker and sink on Tansu and chDB, scraped on their metrics ports, report their lag while
a backlog waits for them and 0 once they caught up: what the "falls behind" alert needs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from gpuledger.embedded.broker import free_port
from gpuledger.embedded.processes import ChildProcess, wait_until_caught_up
from gpuledger.schemas.models import GpuSample, LifecycleWatermark, NodeTick
from gpuledger.schemas.wire import encode, encode_node_ticks
from gpuledger.sink.loop import sink_topics
from gpuledger.topics import create_topics
from gpuledger.warehouse import connect, migrate
from metrics_scrape import scrape

pytestmark = pytest.mark.integration

T0 = 1_793_577_600_000  # 2026-11-02T00:00:00Z
NODES, FIRST, LATER = 20, 20, 60  # ticks per node published before the processes start / while they wait
LAG = "gpuledger_consumer_lag_messages"

#: the sink as `gpuledger sink` runs it (metrics served on its port), with the tests' fault-injecting
#: writer in front of chDB (tests/sink_faults.py: "down" in the control file fails every write)
SINK = """
import sys; sys.path.insert(0, {tests!r})
from pathlib import Path
from gpuledger.config import Settings
from gpuledger.metrics import start_metrics_server
from gpuledger.sink.loop import run_sink
from sink_faults import fault_injecting
settings = Settings()
start_metrics_server(settings.sink_metrics_port)
run_sink(settings, wrap_writer=fault_injecting(Path({control!r})))
"""


def _samples(settings, ticks: range) -> list[tuple]:
    out = []
    for k in ticks:
        for n in range(NODES):
            node = f"n{n}"
            tick = NodeTick(cluster="c", node=node, ts_ms=T0 + 10_000 * k, interval_ms=10_000, gpus=[
                GpuSample(gpu_uuid=f"GPU-{node}", index=0, model="A100-80GB", util_gpu_pct=50.0, power_w=200.0)])
            out.append((settings.topics.gpu_samples, node.encode(), encode_node_ticks(node, [tick])))
    return out


def _publish(settings, messages) -> None:
    # one message a batch: Tansu's ListOffsets answers the start of a partition's last batch + 1
    producer = Producer({**settings.kafka_client_config(), "partitioner": "murmur2_random", "batch.num.messages": 1})
    for topic, key, value, *partition in messages:
        producer.produce(topic, key=key, value=value, **({"partition": partition[0]} if partition else {}))
        producer.poll(0)
    assert producer.flush(30) == 0


def _marks(settings, at_ms: int) -> list[tuple]:
    mark = encode(LifecycleWatermark(cluster="c", ts_ms=at_ms))
    return [(settings.topics.job_events, None, mark, p) for p in range(settings.partitions_job_events)]


def _families(port: int) -> dict:
    try:
        return scrape(port)
    except OSError:  # not serving yet
        return {}


def _lag(port: int) -> dict[tuple[str, str], float]:
    """{(topic, partition): lag} as scraped (empty while the process reports none)."""
    return {(s.labels["topic"], s.labels["partition"]): s.value for s in _families(port).get(LAG, [])}


def _value(port: int, name: str, **labels: str) -> float:
    return sum(s.value for family in _families(port).values() for s in family
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _wait(what: str, check, *processes, timeout_s: float = 90):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        for process in processes:
            process.check_alive()
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.2)
    return result


def test_worker_and_sink_export_their_consumer_lag(broker, make_settings, tmp_path):
    """The worker pauses gpu-samples (samples far ahead of the lifecycle watermark), the sink's
    warehouse is down: what is published meanwhile waits in Kafka, and both say how much; once the
    watermark comes and the warehouse is back, both catch up and say 0."""
    wport, sport = free_port(), free_port()
    settings = make_settings(kafka_bootstrap=broker.bootstrap, worker_samples_ahead_s=30.0,
                             worker_metrics_port=wport, sink_metrics_port=sport, warehouse=f"chdb:{tmp_path / 'chdb'}")
    create_topics(settings)
    client = connect(settings)
    migrate(client, settings.database)
    client.close()
    t = settings.topics
    control = tmp_path / "warehouse"
    control.write_text("down")
    _publish(settings, _marks(settings, T0) + _samples(settings, range(FIRST)))
    sink_code = SINK.format(tests=str(Path(__file__).resolve().parents[1]), control=str(control))
    with ChildProcess(settings, "worker", log_path=tmp_path / "worker.log") as worker, \
         ChildProcess(settings, command=[sys.executable, "-c", sink_code], log_path=tmp_path / "sink.log") as sink:
        _wait("the worker never paused gpu-samples", lambda: all(
            _value(wport, "gpuledger_worker_samples_paused", partition=p) == 1 for p in ("0", "1")), worker)
        _wait("the sink never tried to write", lambda: _value(sport, "gpuledger_sink_insert_failures_total") > 0, sink)
        _publish(settings, _samples(settings, range(FIRST, FIRST + LATER)))  # waits in Kafka for both
        waiting = NODES * LATER

        def backlog(port: int) -> float:
            return sum(v for (topic, _p), v in _lag(port).items() if topic == t.gpu_samples)

        _wait(lambda: f"the lag scraped while {waiting} samples wait: worker {_lag(wport)}, sink {_lag(sport)}",
              lambda: backlog(wport) >= waiting and backlog(sport) >= waiting, worker, sink, timeout_s=30)

        control.write_text("")  # the warehouse is back
        _publish(settings, _marks(settings, T0 + 10_000 * (FIRST + LATER)))  # the watermark lets the worker read on
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=180, alive=worker)
        wait_until_caught_up(settings, f"{settings.worker_app_id}-sink", sink_topics(settings), timeout_s=180,
                             alive=sink)
        caught_up = _wait(lambda: f"lag left once caught up: worker {_lag(wport)}, sink {_lag(sport)}",
                          lambda: (lambda w, s: (w, s) if w and s and not any(w.values()) and not any(s.values())
                                   else None)(_lag(wport), _lag(sport)), worker, sink, timeout_s=30)
    worker_lag, sink_lag = caught_up
    # a series per partition consumed, labelled as the alert sums them
    assert {(t.gpu_samples, "0"), (t.gpu_samples, "1"), (t.job_events, "0"), (t.job_events, "1")} <= set(worker_lag)
    assert {(t.gpu_samples, "0"), (t.gpu_samples, "1")} <= set(sink_lag)
