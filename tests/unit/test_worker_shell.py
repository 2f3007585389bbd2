"""The Faust shell of the worker (streams/app.py), driven without a broker: its agents read fake
streams, the snapshot reader and the producer are replaced. What it must never do is go on after a
message's outputs were not sent: the core's state has moved past the message, so the next snapshot
would cover it and its records (a usage batch: GPU time) would be lost for good."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import faust
import pytest

from gpuledger.config import Settings
from gpuledger.schemas.models import GpuAssignment, JobEvent
from gpuledger.schemas.wire import encode
from gpuledger.streams import app as worker_app
from faust_shell_fakes import Exited, Stream, event
from worker_feeder import LEDGER, T0


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """A worker app (no broker), its core, and the exit code it asked for (os._exit raises Exited)."""
    settings = Settings(data_dir=tmp_path, kafka_bootstrap="127.0.0.1:1")
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(worker_app, "read_last_snapshot", lambda *a, **kw: None)
    app = worker_app.create_app(settings, LEDGER)
    return SimpleNamespace(app=app, settings=settings, core=app.ledger_core, exits=exits)


def allocated(n: int) -> bytes:
    return encode(JobEvent(event_id=f"j{n}/allocated", ts_ms=T0, kind="allocated", cluster="c", job_id=f"j{n}",
                           tenant="t", queue="q", gpus=[GpuAssignment(node="n1", gpu_uuid="GPU-1", share_milli=1000)]))


def run_agent(shell, name: str, events) -> None:
    asyncio.run(shell.app.agents[name].fun(Stream(events)))


def test_an_output_that_cannot_be_sent_stops_the_worker(shell, monkeypatch) -> None:
    """The broker refuses the first message's outputs (a timeout waiting for metadata or buffer room):
    the worker exits (75) before it reads on; going on, its next snapshot covered the message."""
    async def refuse(self, *args, **kwargs):
        raise asyncio.TimeoutError("no room in the producer's buffer")

    monkeypatch.setattr(faust.topics.Topic, "send", refuse)
    topic = shell.settings.topics.job_events
    with pytest.raises(Exited):
        run_agent(shell, "route_lifecycle", [event(0, allocated(1), topic), event(1, allocated(2), topic)])
    assert shell.exits == [75]
    assert shell.core.routers[0].next_offset == 1, "the worker read on after a message whose outputs were lost"


def test_a_snapshot_the_worker_cannot_read_stops_it_with_the_reason(shell, monkeypatch, caplog) -> None:
    """A snapshot written by a newer worker (after a rollback): the worker cannot restore the partition.
    It exits naming the snapshot's version, rather than its agent crashing and restarting while the
    partition's messages pass unprocessed."""
    import zlib

    import orjson

    blob = zlib.compress(orjson.dumps({"version": 99, "kind": "router", "partition": 0, "state": None}))
    monkeypatch.setattr(worker_app, "read_last_snapshot", lambda *a, **kw: blob)
    with pytest.raises(Exited):
        run_agent(shell, "route_lifecycle", [event(0, allocated(1), shell.settings.topics.job_events)])
    assert shell.exits == [78]
    assert "version 99, written by a newer worker" in caplog.text, caplog.text


def test_a_revoked_partition_takes_its_nodes_last_sample_series_with_it(shell) -> None:
    """After a rebalance another worker reads the partition's nodes: this one must stop reporting
    their last sample, or its series grows old for ever and the "node stopped reporting" alert
    (gpuledger_last_sample_age_seconds{component="worker"} > 120) fires for every node moved."""
    from faust.types import TP

    from gpuledger.metrics import LAST_SAMPLE
    from gpuledger.schemas.wire import encode_node_ticks
    from worker_feeder import tick

    topics = shell.settings.topics
    ticks = [event(0, encode_node_ticks("moved-1", [tick("moved-1", T0)]), topics.gpu_samples, partition=1),
             event(0, encode_node_ticks("stays-1", [tick("stays-1", T0)]), topics.gpu_samples, partition=0)]
    run_agent(shell, "join_nodes", ticks)
    seen = lambda: {key[2] for key in LAST_SAMPLE._seen if key[0] == "worker"}  # noqa: E731
    assert {"moved-1", "stays-1"} <= seen()
    asyncio.run(shell.app.on_partitions_revoked.send(revoked={TP(topics.gpu_samples, 1),
                                                             TP(topics.node_allocations, 1)}))
    assert "moved-1" not in seen() and "stays-1" in seen()


def test_a_partition_restored_reports_its_silent_nodes_again(shell, monkeypatch) -> None:
    """The other half: the worker that gets the partition (or gets it back after an eager rebalance)
    reports the last sample of every node its snapshot knows, so a node that went silent before the
    rebalance still ages (and alerts) instead of vanishing with the revocation."""
    from faust.types import TP

    from gpuledger.metrics import LAST_SAMPLE
    from gpuledger.schemas.models import NodeWatermark
    from gpuledger.schemas.wire import encode_node_ticks
    from gpuledger.streams.core import JOIN, WorkerCore
    from worker_feeder import T, Feeder, allocate, tick

    before = WorkerCore(T, partitions_gpu_samples=2, partitions_job_events=1, ledger=LEDGER)
    feed = Feeder(before)  # partition 0 of that core: its snapshot is restored as partition 1
    allocate(feed, "silent-1")
    feed(T.gpu_samples, encode_node_ticks("silent-1", [tick("silent-1", T0)]))
    feed(T.node_allocations, encode(NodeWatermark(ts_ms=T0 + 20_000, source_partition=0, source_partitions=1)))
    blob = before.snapshot(JOIN, 0)
    import zlib

    import orjson

    doc = orjson.loads(zlib.decompress(blob))
    doc["partition"] = 1
    monkeypatch.setattr(worker_app, "read_last_snapshot",
                        lambda settings, sp, **kw: zlib.compress(orjson.dumps(doc)) if sp == 1 else None)
    topics = shell.settings.topics
    mark = encode(NodeWatermark(ts_ms=T0 + 20_000, source_partition=0, source_partitions=1))
    run_agent(shell, "join_nodes", [event(0, mark, topics.node_allocations, partition=1)])
    assert LAST_SAMPLE._seen.get(("worker", "c", "silent-1")) == (T0 + 10_000) / 1000
    asyncio.run(shell.app.on_partitions_revoked.send(revoked={TP(topics.gpu_samples, 1)}))
    assert ("worker", "c", "silent-1") not in LAST_SAMPLE._seen


def test_a_snapshot_over_the_state_topics_limit_stops_the_worker_saying_so(shell, monkeypatch, caplog) -> None:
    """A partition's state outgrew what the worker-state topic takes (16 MiB): the producer refused it
    with "larger than the maximum request size you have configured with the max_request_size
    configuration" (a setting the ledger does not have), and the worker restarted for ever. It stops
    with the partition, the size, the limit and what to do; each snapshot's size is a gauge to alert on
    before that."""
    import inspect

    from gpuledger.metrics import SNAPSHOT_BYTES
    from gpuledger.topics import STATE_MAX_MESSAGE_BYTES

    async def accept(self, *args, **kwargs):
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    monkeypatch.setattr(faust.topics.Topic, "send", accept)
    snapshot_state = next(inspect.unwrap(t) for t in shell.app._app_tasks
                          if inspect.unwrap(t).__name__ == "snapshot_state")
    topic = shell.settings.topics.job_events

    async def scenario(size: int) -> None:
        await shell.app.agents["route_lifecycle"].fun(Stream([event(shell.core.routers.get(0, SimpleNamespace(
            next_offset=0)).next_offset, allocated(size % 1000), topic)]))
        monkeypatch.setattr(shell.core, "snapshot", lambda kind, partition: b"x" * size)
        await snapshot_state()

    asyncio.run(scenario(1000))
    assert shell.exits == [] and SNAPSHOT_BYTES.labels("router", "0")._value.get() == 1000
    with pytest.raises(Exited):
        asyncio.run(scenario(STATE_MAX_MESSAGE_BYTES))
    assert shell.exits == [78]
    assert f"router partition 0 is {STATE_MAX_MESSAGE_BYTES} bytes" in caplog.text, caplog.text


def test_a_snapshot_the_core_cannot_make_stops_the_worker_saying_so(shell, monkeypatch, caplog) -> None:
    """An exception from `core.snapshot` escaped the snapshot timer inside its lock: the timer died,
    no snapshot was written again and no offset committed, and only the lag said so. It stops the
    worker (75, restart from the last snapshot) with the partition and the reason."""
    import inspect

    snapshot_state = next(inspect.unwrap(t) for t in shell.app._app_tasks
                          if inspect.unwrap(t).__name__ == "snapshot_state")
    topic = shell.settings.topics.job_events

    def broken(kind, partition):
        raise TypeError("Integer exceeds 64-bit range")

    async def accept(self, *args, **kwargs):
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    monkeypatch.setattr(faust.topics.Topic, "send", accept)

    async def scenario() -> None:
        await shell.app.agents["route_lifecycle"].fun(Stream([event(0, allocated(1), topic)]))
        monkeypatch.setattr(shell.core, "snapshot", broken)
        await snapshot_state()

    with pytest.raises(Exited):
        asyncio.run(scenario())
    assert shell.exits == [75]
    assert "cannot snapshot router partition 0 (TypeError: Integer exceeds 64-bit range)" in caplog.text, caplog.text


@pytest.mark.parametrize("given_back", [False, True])
def test_a_message_of_a_partition_revoked_while_it_waited_is_not_processed(shell, monkeypatch, given_back) -> None:
    """Faust revokes without waiting for the agents (stream_wait_empty=False): a message whose
    partition's snapshot was still being read went on after the revocation, restored and changed the
    partition, and the snapshot timer wrote its state for a partition another worker now owns (its
    newer snapshot overwritten by an older one); were the partition given back later, the stale state
    counted as loaded and was never restored from the new owner's snapshot. Given back at once (an
    eager rebalance), the consumer reads again from the committed offset: the message, processed
    first, put the partition's next offset past the messages before it, which were then skipped."""
    import inspect
    import threading

    from faust.types import TP

    from gpuledger.schemas.wire import encode_node_ticks
    from worker_feeder import tick

    release, sent = threading.Event(), []

    def slow_read(settings, partition, **kw):
        release.wait(5)
        return None

    async def accept(self, *args, **kwargs):
        sent.append(self.get_topic_name())
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    monkeypatch.setattr(worker_app, "read_last_snapshot", slow_read)
    monkeypatch.setattr(faust.topics.Topic, "send", accept)
    snapshot_state = next(inspect.unwrap(t) for t in shell.app._app_tasks
                          if inspect.unwrap(t).__name__ == "snapshot_state")
    topics = shell.settings.topics
    late = event(0, encode_node_ticks("n1", [tick("n1", T0)]), topics.gpu_samples, partition=1)

    async def scenario() -> None:
        agent = asyncio.create_task(shell.app.agents["join_nodes"].fun(Stream([late])))
        await asyncio.sleep(0.2)  # the agent waits for the partition's snapshot
        mine = {TP(topics.gpu_samples, 1), TP(topics.node_allocations, 1)}
        await shell.app.on_partitions_revoked.send(revoked=mine)
        if given_back:
            await shell.app.on_partitions_assigned.send(assigned=mine)
        release.set()
        await agent
        await snapshot_state()

    asyncio.run(scenario())
    assert topics.worker_state not in sent, "a snapshot of a revoked partition was written"
    assert 1 not in shell.core.joins or not shell.core.joins[1].next_offsets, "a revoked partition's message was processed"
