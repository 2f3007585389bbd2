"""Kueue Workloads against the attempts of their jobs (agents/kubernetes.py, kubernetes_agent.py):
a re-queue seen while the evicted pod still terminates, a Workload Kueue replaces by a new one of
the same job, and a queued Workload deleted while the agent was stopped. Objects from
tests/fixtures/kubernetes/, adapted by tests/kube/objects.py."""

from __future__ import annotations

from pathlib import Path

from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping
from gpuledger.agents.kubernetes_agent import DeviceSource, KubernetesAgent, load_state
from kube.harness import JobEventsPublisher as Publisher
from kube.objects import at, at_time, gpu_pod, kinds, local_queue, ms, workload
from kube.objects import kueue_devices as devices
from kube.objects import kueue_ledger as ledger

NOW = ms(1000)
JOB = "default/job/train"


def rerun(stage: str) -> dict:
    return gpu_pod("train-1", "uid-train-1", created=400, started=410, finished=500, stage=stage)


def timeline(events) -> list[tuple[int, str, int]]:
    return [(e.attempt, e.kind.value, (e.ts_ms - ms(0)) // 1000) for e in events]


# --------------------------------------------------------------------------- A: re-queue before the pod goes
def evicted_while_terminating(core: KubernetesLedger) -> list:
    """Kueue's order: the pod is terminating (not active), so Kueue unsets the quota (QuotaReserved=False
    at T+100) before the pod's DELETED reaches the agent; no Workload update follows until re-admission."""
    events = core.observe_workload(at_time(workload(status="admitted"), -30), NOW)
    events += core.observe_pod(gpu_pod(stage="running"), NOW, devices("train-0"))
    events += core.observe_pod(gpu_pod(stage="deleting", finished=100), NOW, devices("train-0"))
    events += core.observe_workload(at_time(workload(status="preempted"), 100), NOW)   # evicted + requeued
    events += core.pod_deleted(gpu_pod(stage="deleting", finished=100), NOW, devices())
    return events


def test_a_requeue_seen_before_the_evicted_pod_went_queues_the_next_attempt_from_the_requeue():
    core = ledger()
    events = evicted_while_terminating(core)
    assert timeline(events)[-3:] == [(0, "preempted", 100), (1, "retried", 100), (1, "queued", 100)], \
        "the next attempt is not retried/queued at the re-queue time"
    assert events[-1].reason.startswith("Pending: couldn't assign flavors")
    later = core.observe_workload(at_time(workload(status="admitted"), 400), NOW)      # re-admitted
    for stage in ("running", "succeeded"):
        later += core.observe_pod(rerun(stage), NOW, devices("train-1"))
    assert timeline(later) == [(1, "allocated", 400), (1, "started", 410), (1, "completed", 500)]
    # the same waiting Workload seen again (a relist) changes nothing
    again = ledger()
    evicted_while_terminating(again)
    assert again.observe_workload(at_time(workload(status="preempted"), 100), NOW) == []


def test_the_rerun_ending_before_its_admission_is_seen_does_not_open_another_attempt():
    """Pods and Workloads are separate watches: the rerun's pods may run and end while the agent
    still holds the waiting Workload; only the evicted attempt takes up the re-queue."""
    core = ledger()
    evicted_while_terminating(core)
    events = []
    for stage in ("running", "succeeded"):
        events += core.observe_pod(rerun(stage), NOW, devices("train-1"))
    events += core.pod_deleted(rerun("succeeded"), NOW, devices())
    assert timeline(events) == [(1, "allocated", 400), (1, "started", 410), (1, "completed", 500)]
    assert core.jobs[JOB].attempt_ended and core.jobs[JOB].attempt == 1


# --------------------------------------------------------------------------- B: a Workload replaced
def old_workload() -> dict:
    return at_time(workload(status="pending"), -50)


def new_workload(status: str = "pending", seconds: int = 20) -> dict:
    return at_time(workload("job-train-9z8y7", "uid-wl-train-2", status=status, created=20), seconds)


def deleted(wl: dict) -> dict:
    wl["metadata"]["deletionTimestamp"] = at(20)
    return wl


def test_a_workload_replaced_by_a_new_one_of_the_same_job_does_not_cancel_it():
    """Kueue (jobframework ensureOneWorkload) deletes a Workload that no longer matches its Job and
    creates another; the old one's finalizer can hold its DELETED until after the new one's ADDED."""
    core = ledger()
    events = core.observe_workload(old_workload(), NOW)
    events += core.observe_workload(new_workload(), NOW)
    events += core.workload_deleted(deleted(old_workload()), NOW)
    assert "cancelled" not in kinds(events), "the replaced Workload cancelled the job that still waits"
    events += core.observe_workload(new_workload("admitted", 300), NOW)
    for stage in ("running", "succeeded"):
        events += core.observe_pod(gpu_pod(created=300, started=305, finished=400, stage=stage), NOW, devices("train-0"))
    assert timeline(events) == [(0, "submitted", -60), (0, "queued", -50), (0, "allocated", 300),
                                (0, "started", 305), (0, "completed", 400)]


def test_a_workload_still_deleted_alone_cancels_its_waiting_job():
    core = ledger()
    core.observe_workload(old_workload(), NOW)
    core.observe_workload(new_workload(), NOW)
    assert core.workload_deleted(deleted(old_workload()), NOW) == []
    gone = core.workload_deleted(deleted(new_workload()), NOW)
    assert [(e.kind.value, e.reason) for e in gone] == [("cancelled", "deleted")]


# --------------------------------------------------------------------------- C: deleted while away

def agent(state: Path) -> KubernetesAgent:
    mapping = KubernetesMapping(cluster="k8s")
    a = KubernetesAgent(KubernetesLedger(mapping, load_state(state)), Publisher(), job_events_topic="job-events",
                        snapshots_topic="s", job_event_partitions=1, devices=DeviceSource(mapping, local=object(), node="n"),
                        state_path=state, snapshots=False, clock=lambda: ms(100) / 1000)
    a.kinds = ["localqueue", "clusterqueue", "workload", "pod"]
    return a


def start(a: KubernetesAgent, workloads: list, pods: list = ()) -> list[str]:
    for kind, items in (("localqueue", [local_queue()]), ("clusterqueue", []), ("workload", workloads),
                        ("pod", list(pods))):
        a._handle(("sync", kind, items, ms(100) / 1000))
    a.cycle()
    return [f"{e.attempt}/{e.kind.value}" for e in a.publisher.events]


def test_a_queued_workload_deleted_while_the_agent_was_stopped_is_cancelled(tmp_path):
    state = tmp_path / "state.json"
    first = agent(state)
    assert start(first, [old_workload()]) == ["0/submitted", "0/queued"]
    first.state_file.save(first.core, whole=True)                     # a clean stop
    second = agent(state)
    assert start(second, []) == ["0/cancelled"], "the Workload deleted while the agent was away ended nothing"
    assert second.publisher.events[0].ts_ms == ms(100) and second.core.jobs[JOB].attempt_ended
    third = agent(state)                                               # saved: not cancelled twice
    assert start(third, []) == []


def test_a_restart_keeps_the_jobs_whose_workload_or_pods_are_still_there(tmp_path):
    state = tmp_path / "state.json"
    first = agent(state)
    other = at_time(workload("job-other-1", "uid-wl-other", job="other", status="pending"), -40)
    start(first, [old_workload(), other], [gpu_pod("other-0", "uid-other-0", job="other", stage="pending")])
    first.state_file.save(first.core, whole=True)
    second = agent(state)                                              # both Workloads listed again
    assert start(second, [old_workload(), other], [gpu_pod("other-0", "uid-other-0", job="other", stage="pending")]) == []
    third = agent(state)                                               # replaced by a new Workload of the job
    assert start(third, [new_workload()], [gpu_pod("other-0", "uid-other-0", job="other", stage="pending")]) == []


def test_a_relist_showing_the_replacing_workload_does_not_cancel_the_job(tmp_path):
    a = agent(tmp_path / "state.json")
    start(a, [old_workload()])
    a._handle(("sync", "workload", [new_workload()], ms(100) / 1000))  # after a 410: the old one is gone
    assert [e.kind.value for e in a.publisher.events] == ["submitted", "queued"]
    a._handle(("sync", "workload", [], ms(100) / 1000))                # then the job's last Workload goes
    assert [e.kind.value for e in a.publisher.events][-1] == "cancelled"
