"""Running the Kubernetes agent in a thread against a replay API server, for tests."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson

from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping
from gpuledger.agents.kubernetes_agent import DeviceSource, KubernetesAgent, api_client_for, load_state, make_watchers
from gpuledger.agents.podresources.client import PodResourcesClient
from gpuledger.agents.publisher import ListPublisher
from kube.objects import ms
from kube.replay_server import ReplayApiServer

JOB_EVENTS, SNAPSHOTS = "t.job-events", "t.scheduler-snapshots"


class JobEventsPublisher(ListPublisher):
    """A ListPublisher whose `events` are the JobEvents published to topic "job-events" (watermarks,
    which have no key, left out)."""

    @property
    def events(self) -> list:
        from gpuledger.schemas.models import JobEvent
        from gpuledger.schemas.wire import decode

        return [decode(JobEvent, value) for topic, key, value, _ in self.messages
                if topic == "job-events" and key is not None]


def k8s_era_clock(offset_s: float = 10.0):
    """The agent's clock, running from T0 + offset (the recorded objects' era), at real speed."""
    shift = time.time() - ms(0) / 1000 - offset_s
    return lambda: time.time() - shift


class Run:
    """The agent in a thread against a replay server, until `done(messages)` or a timeout."""

    def __init__(self, server: ReplayApiServer, socket: Path, state: Path, publisher=None, kueue: bool = True,
                 page_size: int = 500):
        self.clock = k8s_era_clock()
        mapping = KubernetesMapping(cluster="k8s", allowed_lateness_ms=120_000)
        self.publisher = publisher or ListPublisher()
        self.client = PodResourcesClient(str(socket))
        self.agent = KubernetesAgent(
            KubernetesLedger(mapping, load_state(state)), self.publisher, job_events_topic=JOB_EVENTS,
            snapshots_topic=SNAPSHOTS, job_event_partitions=2,
            devices=DeviceSource(mapping, local=self.client, node="kube-worker-1"), state_path=state,
            snapshot_interval_s=0.3, cycle_s=0.1, clock=self.clock)
        self.stop = threading.Event()
        self.watchers = make_watchers(api_client_for(server.url, None), self.agent.queue, self.stop, kueue=kueue,
                                      timeout_s=1, mapping=mapping, page_size=page_size, clock=self.clock)

    def until(self, done, timeout_s: float = 30.0) -> "Run":
        thread = threading.Thread(target=self.agent.run, args=(self.watchers, self.stop), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            while not done(self) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            self.stop.set()
            thread.join(20)
            self.client.close()
        assert done(self), "the agent did not get there in time"
        return self

    def events(self) -> list[dict]:
        return [orjson.loads(v) for t, k, v, p in self.publisher.messages if t == JOB_EVENTS and k is not None]

    def watermarks(self) -> list[tuple[int, int]]:
        return [(p, orjson.loads(v)["ts_ms"]) for t, k, v, p in self.publisher.messages if t == JOB_EVENTS and k is None]

    def snapshots(self) -> list[dict]:
        return [orjson.loads(v) for t, k, v, p in self.publisher.messages if t == SNAPSHOTS]


def by_job(events: list[dict]) -> dict[str, list[str]]:
    out = defaultdict(list)
    for e in events:
        out[e["job_id"]].append(e["kind"])
    return dict(out)


