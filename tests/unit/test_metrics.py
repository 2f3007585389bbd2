"""gpuledger/metrics.py: the /metrics endpoint serves every gpuledger_* metric of agents, worker
and sink; the helpers compute lag and ages; the agent wires its metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuledger import metrics
from gpuledger.agents.gpu_agent import run_agent
from gpuledger.agents.publisher import ListPublisher
from gpuledger.agents.sim_backend import SimBackend
from gpuledger.agents.spool import Forwarder, Spool, SpoolingPublisher
from gpuledger.embedded.broker import free_port
from metrics_scrape import sample, scrape

EXPECTED = {
    # agents
    "gpuledger_agent_ticks_sampled", "gpuledger_agent_tick_failures", "gpuledger_agent_ticks_skipped",
    "gpuledger_agent_messages_published", "gpuledger_agent_delivery_failures",
    "gpuledger_agent_spool_records", "gpuledger_agent_spool_bytes", "gpuledger_agent_spool_max_bytes",
    "gpuledger_agent_spool_dropped", "gpuledger_agent_spool_dropped_lifetime_records",
    "gpuledger_agent_spool_oldest_age_seconds", "gpuledger_agent_kafka_pending_messages",
    "gpuledger_agent_spool_fsync_failures", "gpuledger_agent_producer_failures",
    # worker and sink
    "gpuledger_messages_in", "gpuledger_messages_out", "gpuledger_dead_letters", "gpuledger_duplicates",
    "gpuledger_consumer_lag_messages", "gpuledger_last_sample_age_seconds", "gpuledger_last_sample_timestamp_seconds",
    "gpuledger_sink_rows_inserted", "gpuledger_sink_insert_failures", "gpuledger_sink_insert_seconds",
    "gpuledger_sink_batches", "gpuledger_sink_batch_rows",
}


class FakeWriter:
    def __init__(self, fail: int = 0):
        self.fail = fail
        self.tokens: list[str | None] = []

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        self.tokens.append(token)  # the dedup token must reach the real writer
        if self.fail:
            self.fail -= 1
            raise ConnectionError("warehouse down")


@pytest.fixture(scope="module")
def port() -> int:
    p = free_port()
    server = metrics.start_metrics_server(p, addr="127.0.0.1")
    yield p
    server.shutdown()


def test_disabled_on_port_zero() -> None:
    assert metrics.start_metrics_server(0) is None


def test_a_port_in_use_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from gpuledger.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.start_metrics_server(port, addr="127.0.0.1")
        assert main(["agent", "slurm", "--once", "--print", "--metrics-port", str(port)]) == 2
    assert f"gpuledger: error: cannot serve metrics on 0.0.0.0:{port}" in capsys.readouterr().err


def test_endpoint_serves_every_metric(port: int, tmp_path: Path) -> None:
    # one of everything, so that the labelled families have samples
    agent = metrics.AgentMetrics("node-m1", "c1")
    with Spool(tmp_path, fsync="never") as spool:
        agent.attach_spool(spool, Forwarder(spool, ListPublisher(), "t"))
        spool.append(b"tick", b"node-m1")
        agent.tick_sampled(1_700_000_000_000)
        agent.tick_failed()
        agent.ticks_skipped(2)
        agent.published(3)
        agent.delivery_failed()
        agent.spool_dropped(4)
        worker = metrics.worker_metrics()
        worker.message_in("p.gpu-samples")
        worker.message_out("p.usage", 2)
        worker.dead_letter("p.gpu-samples", "duplicate tick: n ts_ms=5")
        worker.sample_seen("node-m1", 1_700_000_005_000, "c1")
        worker.duplicate("tick")
        worker.set_lag("p.gpu-samples", 0, 120, 100)
        sink = metrics.sink_metrics()
        sink.duplicate()
        sink.message_in("p.usage")
        sink.dead_letter("p.usage", "invalid JSON", "p.dead-letters")
        inner = FakeWriter(fail=1)
        writer = metrics.InstrumentedWriter(inner)
        with pytest.raises(ConnectionError):
            writer.write("usage_raw", [{}], token="t1")
        writer.write("usage_raw", [{}, {}], token="t1")
        assert inner.tokens == ["t1", "t1"]
        metrics.observe_sink_batch({"usage_raw": 2})

        families = scrape(port)
        missing = EXPECTED - set(families)
        assert not missing, f"not served: {sorted(missing)}"
        assert all(name.startswith("gpuledger_") for name in EXPECTED)
        assert sample(families, "gpuledger_agent_spool_records", node="node-m1") == 1
        # one topic, one series: the sink counted its letters under "dead-letters", the worker under the real name
        assert sample(families, "gpuledger_messages_out_total", component="sink", topic="p.dead-letters") == 1
        assert sample(families, "gpuledger_agent_spool_bytes", node="node-m1") > 0
        assert sample(families, "gpuledger_agent_ticks_sampled_total", node="node-m1") >= 1
        assert sample(families, "gpuledger_consumer_lag_messages", component="worker", topic="p.gpu-samples", partition="0") == 20
        assert sample(families, "gpuledger_dead_letters_total", component="worker", kind="duplicate") >= 1
        assert sample(families, "gpuledger_sink_insert_failures_total", table="usage_raw") >= 1
        assert sample(families, "gpuledger_sink_rows_inserted_total", table="usage_raw") >= 2
        assert sample(families, "gpuledger_last_sample_age_seconds", component="worker", cluster="c1", node="node-m1") > 0
        assert sample(families, "gpuledger_last_sample_timestamp_seconds", component="agent", cluster="c1", node="node-m1") == 1_700_000_000


def test_last_sample_age_grows_at_scrape_time() -> None:
    now = [1000.0]
    collector = metrics._LastSample(clock=lambda: now[0])
    collector.observe("worker", "n1", 990_000)
    collector.observe("worker", "n1", 980_000)  # older: ignored
    age = next(iter(collector.collect()))
    assert [(s.labels["node"], s.value) for s in age.samples] == [("n1", 10.0)]
    now[0] = 1030.0
    assert next(iter(collector.collect())).samples[0].value == 40.0


def test_last_sample_keeps_two_clusters_nodes_of_one_name_apart() -> None:
    """Both clusters have a node001: c2's went silent 60 s ago while c1's reports. One series per node
    name showed 0 s, and the silence alert (docs/reliability.md) could not fire."""
    collector = metrics._LastSample(clock=lambda: 1000.0)
    collector.observe("worker", "node001", 940_000, "c2")
    collector.observe("worker", "node001", 1_000_000, "c1")
    age = next(iter(collector.collect()))
    assert [(s.labels["cluster"], s.labels["node"], s.value) for s in age.samples] == [
        ("c1", "node001", 0.0), ("c2", "node001", 60.0)]


def test_scheduler_agents_are_read_at_scrape_time(port: int) -> None:
    """gpuledger_scheduler_* from each attached agent's stats(); the watermark's age grows while
    nothing moves it, and an agent whose stats cannot be read leaves the others' series alone."""
    now, stats = [1_000.0], {"watermark_timestamp_seconds": 970.0, "events_published": 5, "jobs_tracked": 2,
                             "polls": 3, "poll_failures": 1}
    agents = metrics._SchedulerAgents(clock=lambda: now[0])
    agents.attach("slurm", "c1", lambda: stats)
    agents.attach("kubernetes", "c2", lambda: 1 / 0)

    def series() -> dict[str, float]:
        return {f.name: s.value for f in agents.collect() for s in f.samples if s.labels == {"agent": "slurm", "cluster": "c1"}}

    assert series() == {"gpuledger_scheduler_watermark_timestamp_seconds": 970.0,
                        "gpuledger_scheduler_watermark_age_seconds": 30.0,
                        "gpuledger_scheduler_events_published": 5.0, "gpuledger_scheduler_jobs_tracked": 2.0,
                        "gpuledger_scheduler_polls": 3.0, "gpuledger_scheduler_poll_failures": 1.0}
    now[0] = 1_100.0
    assert series()["gpuledger_scheduler_watermark_age_seconds"] == 130.0
    # through the process's registry and HTTP, as Prometheus scrapes it
    metrics.SCHEDULER_AGENTS.attach("slurm", "scraped", lambda: stats)
    try:
        families = scrape(port)
        assert sample(families, "gpuledger_scheduler_events_published_total", agent="slurm", cluster="scraped") == 5
        assert sample(families, "gpuledger_scheduler_watermark_age_seconds", agent="slurm", cluster="scraped") > 0
    finally:
        metrics.SCHEDULER_AGENTS.detach("slurm", "scraped")


def test_consumer_lag_helpers() -> None:
    assert metrics.consumer_lag(100, 90) == 10
    assert metrics.consumer_lag(100, 100) == 0
    assert metrics.consumer_lag(-1, 5) is None and metrics.consumer_lag(10, -1001) is None

    tp = lambda t, p, o=-1: SimpleNamespace(topic=t, partition=p, offset=o)  # noqa: E731

    class Consumer:
        def assignment(self):
            return [tp("a", 0), tp("a", 1)]

        def position(self, parts):
            return [tp("a", 0, 40), tp("a", 1, -1001)]  # partition 1: nothing consumed yet

        def get_watermark_offsets(self, part, timeout=None, cached=False):
            return (0, -1) if cached else (0, 50)

    assert metrics.update_consumer_lag("sink", Consumer()) == {("a", 0): 10}


def test_the_lag_of_a_partition_no_longer_assigned_is_dropped() -> None:
    """A partition revoked (moved to another member) keeps no stale series: `sum by (component)`
    would count its lag twice."""
    tp = lambda t, p, o=-1: SimpleNamespace(topic=t, partition=p, offset=o)  # noqa: E731
    assigned = [tp("b", 0), tp("b", 1)]

    class Consumer:
        def assignment(self):
            return list(assigned)

        def position(self, parts):
            return [tp(x.topic, x.partition, 40) for x in parts]

        def get_watermark_offsets(self, part, timeout=None, cached=False):
            return (0, 50)

    def series() -> dict[str, float]:
        return {s.labels["partition"]: s.value for s in metrics.CONSUMER_LAG.collect()[0].samples
                if s.labels["component"] == "forget-test"}

    assert metrics.update_consumer_lag("forget-test", Consumer()) == {("b", 0): 10, ("b", 1): 10}
    assert series() == {"0": 10, "1": 10}
    assigned.pop()  # partition 1 revoked
    metrics.update_consumer_lag("forget-test", Consumer())
    assert series() == {"0": 10}


def test_dead_letter_kinds() -> None:
    assert metrics.dead_letter_kind("duplicate tick: n ts_ms=1") == "duplicate"
    assert metrics.dead_letter_kind("late tick: n ts_ms=1 is before ...") == "late"
    assert metrics.dead_letter_kind("invalid JSON at byte 3") == "invalid"


def test_run_agent_counts_ticks(tmp_path: Path) -> None:
    class Clock:
        t = 100.0

        def __call__(self):
            return self.t

        def sleep(self, s):
            self.t += s

    clock = Clock()
    agent = metrics.AgentMetrics("node-m2")
    before = metrics.AGENT_TICKS_SAMPLED.labels("node-m2")._value.get()
    with Spool(tmp_path, fsync="never") as spool:
        pub = ListPublisher()
        fwd = Forwarder(spool, pub, "t", metrics=agent)
        run_agent(SimBackend(["T4"]), SpoolingPublisher(spool, fwd), "t", cluster="c", node="node-m2",
                  interval_s=1, clock=clock, sleep=clock.sleep, max_ticks=5, metrics=agent)
        fwd.pump()
        assert len(pub.values()) == 5
    assert metrics.AGENT_TICKS_SAMPLED.labels("node-m2")._value.get() - before == 5
    assert metrics.AGENT_PUBLISHED.labels("node-m2")._value.get() >= 5
