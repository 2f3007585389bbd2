"""The Kubernetes agent's event ids across a crash (docs/kubernetes.md, "Exactly once"): the agent
spools a cycle's events, then saves its state; a crash between the two re-derives the cycle from the
older state. A re-derived event that is the same event (same content after the same history) must
keep its id, so the worker drops the copy; any other event must get an id never used before, so the
worker does not drop a genuine later event as a duplicate (its GPU time would be billed to nobody).

Driven through the real agent (KubernetesAgent, StateFile, DeviceSource with a kubelet stub standing
for PodResources) and fed to the worker's real LifecycleRouter, called as WorkerCore calls it."""

from __future__ import annotations

import orjson

from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping
from gpuledger.agents.kubernetes_agent import DeviceSource, KubernetesAgent, load_state
from gpuledger.schemas.models import JobEvent
from gpuledger.streams.router import LifecycleRouter

from kube.harness import JobEventsPublisher as Publisher
from kube.objects import gpu_pod, ms

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


class Kubelet:
    """What the node's PodResources List returns: the pods it still runs, with their device ids."""

    def __init__(self, pods: dict | None = None):
        self.pods = dict(pods or {})

    def list(self, wanted):
        return dict(self.pods)



def clock() -> float:
    return ms(5) / 1000


def agent(state_path, kubelet: Kubelet, now=clock) -> KubernetesAgent:
    mapping = KubernetesMapping(cluster="k8s")
    a = KubernetesAgent(KubernetesLedger(mapping, load_state(state_path)), Publisher(),
                        job_events_topic="job-events", snapshots_topic="snapshots", job_event_partitions=1,
                        devices=DeviceSource(mapping, local=kubelet, node="kube-worker-1"),
                        state_path=state_path, snapshots=False, clock=now)
    a.kinds = ["pod"]
    return a


def pod(name: str, **kw) -> dict:
    return gpu_pod(name, f"uid-{name}", **kw)


def listed(a: KubernetesAgent, pods: list[dict]) -> None:
    a._handle(("sync", "pod", pods, a.clock()))


def changed(a: KubernetesAgent, p: dict) -> None:
    a._handle(("event", "pod", "MODIFIED", p, a.clock()))


class Worker:
    """The worker's lifecycle path (streams/core.py): duplicates dropped, impossible sequences
    rejected, the rest routed to the GPUs they name."""

    def __init__(self):
        self.router = LifecycleRouter()
        self.dropped: list[str] = []
        self.rejected: list[str] = []
        self.routed: dict[str, set[str]] = {}      # event id -> GPU uuids it was routed to
        self.accepted: list[JobEvent] = []

    def feed(self, events: list[JobEvent]) -> None:
        for e in events:
            if self.router.is_duplicate(e):
                self.router.route(e)
                self.dropped.append(e.event_id)
            elif self.router.sequence_problem(e):
                self.rejected.append(e.event_id)
            else:
                self.routed[e.event_id] = {g.gpu_uuid for c in self.router.route(e) for g in c.gpus}
                self.accepted.append(e)

    def gpus(self) -> set[str]:
        return set().union(*self.routed.values())


def test_a_crash_whose_relist_derives_fewer_events_does_not_reuse_their_ids(tmp_path):
    """Run 1 sends train-b's allocated{B}, started, allocated{} (it ended), started, and crashes before
    its state is saved. The relist shows train-b ended: the kubelet no longer lists its devices, so
    fewer events are re-derived. train-a's genuine allocated{A}, started and completed that follow
    must reach the worker (they took run 1's ids before, and were dropped as duplicates)."""
    state, kubelet = tmp_path / "state.json", Kubelet()
    a1 = agent(state, kubelet)
    listed(a1, [pod("train-a", stage="pending"), pod("train-b", stage="pending")])
    a1.cycle()                                                  # saved: submitted, queued
    kubelet.pods[("default", "train-b")] = {"nginx": [GPU_B]}
    changed(a1, pod("train-b", created=10, started=12, stage="running"))
    del kubelet.pods[("default", "train-b")]
    changed(a1, pod("train-b", created=10, started=12, finished=50, stage="succeeded"))
    run1 = list(a1.publisher.events)                            # spooled; the crash comes before the save

    a2 = agent(state, kubelet)
    listed(a2, [pod("train-a", stage="pending"),
                pod("train-b", created=10, started=12, finished=50, stage="succeeded")])
    a2.cycle()
    kubelet.pods[("default", "train-a")] = {"nginx": [GPU_A]}
    changed(a2, pod("train-a", created=100, started=104, stage="running"))
    changed(a2, pod("train-a", created=100, started=104, finished=200, stage="succeeded"))
    run2 = list(a2.publisher.events)
    later = [e for e in run2 if e.ts_ms >= ms(100)]             # train-a's own events, after the crash window
    assert [e.kind.value for e in later] == ["allocated", "started", "completed"]

    worker = Worker()
    worker.feed(run1 + run2)
    lost = [e.event_id for e in later if not any(e is x for x in worker.accepted)]
    assert not lost, f"train-a's events dropped by the worker as duplicates of run 1's: {lost}"
    assert worker.routed[later[0].event_id] == {GPU_A}          # train-a's 96 s on GPU-aaaa are billed
    assert worker.gpus() == {GPU_A, GPU_B}
    ids1 = {e.event_id for e in run1}
    for e in run2:                                              # an id used before names the same event
        if e.event_id in ids1:
            same = next(x for x in run1 if x.event_id == e.event_id)
            assert same.model_dump() == e.model_dump()


def test_a_crash_that_derives_the_same_events_sends_the_same_ids(tmp_path):
    """The window docs/kubernetes.md promises: the relist shows what run 1 saw, so the same events come
    again with the same ids and the worker drops every copy; the job's later events still pass."""
    state = tmp_path / "state.json"
    kubelet = Kubelet({("default", "train-a"): {"nginx": [GPU_A]}, ("default", "train-b"): {"nginx": [GPU_B]}})
    a1 = agent(state, kubelet)
    listed(a1, [pod("train-a", stage="pending"), pod("train-b", stage="pending")])
    a1.cycle()
    changed(a1, pod("train-a", created=10, started=12, stage="running"))
    changed(a1, pod("train-b", created=20, started=22, stage="running"))
    run1 = list(a1.publisher.events)                            # crash before the save

    a2 = agent(state, kubelet)
    listed(a2, [pod("train-a", created=10, started=12, stage="running"),
                pod("train-b", created=20, started=22, stage="running")])
    a2.cycle()
    assert [e.event_id for e in a2.publisher.events] == [e.event_id for e in run1[2:]]
    changed(a2, pod("train-a", created=10, started=12, finished=60, stage="succeeded"))
    changed(a2, pod("train-b", created=20, started=22, finished=70, stage="succeeded"))
    worker = Worker()
    worker.feed(run1 + a2.publisher.events)
    assert worker.dropped == [e.event_id for e in run1[2:]]
    assert [e.kind.value for e in a2.publisher.events[len(run1) - 2:]] == ["allocated", "started", "completed"]
    assert not worker.rejected and worker.router.routes == {}  # the attempt ended: nothing held for ever


def test_a_clean_restart_keeps_the_ids_and_content_changes_them(tmp_path):
    """Ids are a function of the job's events so far: a run cut by a clean restart (state saved) sends
    the ids of an uninterrupted run; the first event keeps its plain id, later ones carry the digest."""
    kubelet = Kubelet({("default", "train-a"): {"nginx": [GPU_A]}})
    steps = [pod("train-a", stage="pending"), pod("train-a", created=10, started=12, stage="running"),
             pod("train-a", created=10, started=12, finished=60, stage="succeeded")]
    whole = agent(tmp_path / "whole.json", kubelet)
    listed(whole, steps[:1])
    for p in steps[1:]:
        changed(whole, p)
    whole.cycle()
    part = agent(tmp_path / "part.json", kubelet)
    listed(part, steps[:1])
    changed(part, steps[1])
    part.cycle()                                                # saved, then stopped
    rest = agent(tmp_path / "part.json", kubelet)
    listed(rest, steps[1:2])
    changed(rest, steps[2])
    ids = [e.event_id for e in whole.publisher.events]
    assert ids == [e.event_id for e in part.publisher.events + rest.publisher.events]
    assert ids[0] == "k8s/k8s/default/job/train/0/1/submitted"
    assert all(i.split("/")[-1].split(".")[0] == e.kind.value and len(i.split(".")[-1]) == 16
               for i, e in zip(ids[1:], whole.publisher.events[1:]))
    other = agent(tmp_path / "other.json", Kubelet({("default", "train-a"): {"nginx": [GPU_B]}}))
    listed(other, steps[:1])
    changed(other, steps[1])                                    # the same kinds and times, another GPU
    assert [e.event_id for e in other.publisher.events][:2] == ids[:2]
    assert other.publisher.events[2].event_id != ids[2]        # allocated{B} is not allocated{A}
    assert other.publisher.events[3].event_id != ids[3]        # nor is the started after it


def test_a_state_saved_by_the_old_scheme_resends_nothing_and_reuses_no_id(tmp_path):
    """An upgrade: a state written before the digest (no `history`) loads; what it holds is not sent
    again, and the job's next events take ids the old scheme (`.../<n>/<kind>`) never gave."""
    state, kubelet = tmp_path / "state.json", Kubelet({("default", "train-a"): {"nginx": [GPU_A]}})
    a1 = agent(state, kubelet)
    listed(a1, [pod("train-a", stage="pending")])
    changed(a1, pod("train-a", created=10, started=12, stage="running"))
    a1.cycle()
    old = load_state(state)
    for job in old["jobs"].values():
        del job["history"]                                      # as the old agent wrote it
    (tmp_path / "old.json").write_bytes(orjson.dumps(old))
    a2 = agent(tmp_path / "old.json", kubelet)
    listed(a2, [pod("train-a", created=10, started=12, stage="running")])
    assert a2.publisher.events == []                            # nothing sent again
    changed(a2, pod("train-a", created=10, started=12, finished=60, stage="succeeded"))
    old_ids = {f"k8s/k8s/default/job/train/0/{n}/{e.kind.value}" for n, e in enumerate(a1.publisher.events, 1)}
    (done,) = a2.publisher.events
    assert done.kind.value == "completed" and done.event_id.startswith("k8s/k8s/default/job/train/0/5/completed.")
    assert done.event_id not in old_ids | {e.event_id for e in a1.publisher.events}


def test_an_end_timed_by_the_agents_clock_comes_again_under_a_new_id_and_bills_nothing_twice(tmp_path):
    """A pod missing from a relist ends at the agent's clock; re-derived after a crash, the clock has
    moved, so the `cancelled` gets a new id: the worker refuses it (the attempt already ended)."""
    state, kubelet = tmp_path / "state.json", Kubelet({("default", "train-a"): {"nginx": [GPU_A]}})
    a1 = agent(state, kubelet, now=lambda: ms(20) / 1000)
    listed(a1, [pod("train-a", created=10, started=12, stage="running")])
    a1.cycle()                                                  # saved: it runs on GPU-aaaa
    listed(a1, [])                                              # a relist (410) without it
    run1 = list(a1.publisher.events)                            # crash before the save
    a2 = agent(state, kubelet, now=lambda: ms(30) / 1000)       # restarted 10 s later
    listed(a2, [])
    (again,) = a2.publisher.events
    assert again.kind.value == run1[-1].kind.value == "cancelled" and again.event_id != run1[-1].event_id
    assert (run1[-1].ts_ms, again.ts_ms) == (ms(20), ms(30))
    worker = Worker()
    worker.feed(run1 + a2.publisher.events)
    assert worker.rejected == [again.event_id] and worker.router.routes == {}
