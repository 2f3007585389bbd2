"""Kueue in the pure Kubernetes core (agents/kubernetes.py): evictions that Kueue keeps showing on
the requeued Workload, and the Workloads of Kueue's plain pods and pod groups (one job with their
pods). Objects from tests/fixtures/kubernetes/, adapted by tests/kube/objects.py."""

from __future__ import annotations

import json

from gpuledger.agents.kubernetes import KubernetesLedger
from kube.objects import kueue_devices as devices
from kube.objects import kueue_ledger as ledger
from kube.objects import (
    at_time, gpu_pod, kinds, kueue_pod, ms, pod_group_workload, pod_workload, workload,
)

NOW = ms(1000)


def rerun(**kw) -> dict:
    return gpu_pod("train-1", "uid-train-1", created=200, started=210, finished=300, **kw)


def evicted_then_requeued(core: KubernetesLedger) -> list:
    """Attempt 0 runs, Kueue preempts it (Evicted=True at T+100), its pod goes, the Workload waits."""
    events = core.observe_workload(at_time(workload(status="admitted"), -30), NOW)
    events += core.observe_pod(gpu_pod(stage="running"), NOW, devices("train-0"))
    events += core.observe_workload(at_time(workload(status="preempted"), 100), NOW)
    events += core.pod_deleted(gpu_pod(stage="deleting"), NOW, devices())
    events += core.observe_workload(at_time(workload(status="preempted"), 100), NOW)   # retried, queued
    return events


# --------------------------------------------------------------------------- evictions
def test_a_rerun_after_a_kueue_eviction_ends_by_its_own_pods():
    """Kueue keeps Evicted=True on the requeued Workload: seeing it again (a status update, a
    relist) is the same eviction, not one of the next attempt."""
    core = ledger()
    events = evicted_then_requeued(core)
    assert kinds(events)[-3:] == ["preempted", "retried", "queued"]
    events = core.observe_workload(at_time(workload(status="preempted"), 100), NOW)     # seen again
    assert events == [] and len(core.snapshot(NOW).preemptions) == 1                   # counted once
    events += core.observe_workload(at_time(workload(status="admitted"), 150), NOW)
    for stage in ("running", "succeeded"):
        events += core.observe_pod(rerun(stage=stage), NOW, devices("train-1"))
    assert kinds(events) == ["allocated", "started", "completed"]
    assert {e.attempt for e in events} == {1} and core.snapshot(NOW).preemptions == []


def test_the_eviction_still_shown_after_a_restart_is_not_counted_again():
    core = ledger()
    evicted_then_requeued(core)
    core.snapshot(NOW)
    restarted = KubernetesLedger(core.mapping, json.loads(json.dumps(core.to_state())))
    assert restarted.observe_workload(at_time(workload(status="preempted"), 100), NOW) == []   # start-up relist
    assert restarted.snapshot(NOW).preemptions == []
    events = []
    for stage in ("running", "succeeded"):
        events += restarted.observe_pod(rerun(stage=stage), NOW, devices("train-1"))
    assert kinds(events)[-1] == "completed"


def test_a_state_saved_before_eviction_times_were_kept_does_not_count_it_again():
    core = ledger()
    evicted_then_requeued(core)
    state = json.loads(json.dumps(core.to_state()))
    del state["jobs"]["default/job/train"]["eviction_seen_ms"]
    restarted = KubernetesLedger(core.mapping, state)
    restarted.observe_workload(at_time(workload(status="preempted"), 100), NOW)
    assert restarted.snapshot(NOW).preemptions == []
    events = []
    for stage in ("running", "succeeded"):
        events += restarted.observe_pod(rerun(stage=stage), NOW, devices("train-1"))
    assert kinds(events)[-1] == "completed"


def test_a_second_eviction_of_the_rerun_is_counted():
    core = ledger()
    evicted_then_requeued(core)
    core.snapshot(NOW)
    core.observe_workload(at_time(workload(status="admitted"), 150), NOW)
    core.observe_pod(rerun(stage="running"), NOW, devices("train-1"))
    assert core.observe_workload(at_time(workload(status="preempted"), 250), NOW) == []
    events = core.pod_deleted(rerun(stage="deleting"), NOW, devices())
    assert kinds(events) == ["preempted", "retried", "queued"] and events[0].attempt == 1  # waiting again: attempt 2
    assert len(core.snapshot(NOW).preemptions) == 1


def test_an_eviction_before_any_pod_does_not_stick_to_the_pods_admitted_later():
    core = ledger()
    core.observe_workload(at_time(workload(status="preempted"), 10), NOW)     # evicted, no pod yet
    core.observe_workload(at_time(workload(status="admitted"), 30), NOW)
    events = []
    for stage in ("running", "succeeded"):
        events += core.observe_pod(gpu_pod(stage=stage), NOW, devices("train-0"))
    assert kinds(events)[-1] == "completed"


# --------------------------------------------------------------------------- plain pods, pod groups
def test_a_plain_pod_and_its_workload_are_one_job():
    core = ledger()
    pod = kueue_pod("train-0", "uid-train-0")
    events = core.observe_workload(at_time(pod_workload(pod, status="pending"), -30), NOW)
    events += core.observe_workload(at_time(pod_workload(pod, status="admitted"), -10), NOW)
    for stage in ("running", "succeeded"):
        events += core.observe_pod(kueue_pod("train-0", "uid-train-0", stage=stage), NOW, devices("train-0"))
    assert kinds(events) == ["submitted", "queued", "allocated", "started", "completed"]
    assert {e.job_id for e in events} == {"default/train-0"} and {e.attempt for e in events} == {0}
    assert events[0].requested_gpus == 1.0 and events[0].queue == "cluster-queue"
    assert list(core.jobs) == ["default/train-0"] and core.jobs["default/train-0"].attempt_ended


def test_a_deployments_pod_admitted_by_kueue_is_its_own_job():
    """A pod with a controller that Kueue does not manage (a ReplicaSet) still gets its own Workload."""
    core = ledger()
    pod = kueue_pod("web-0", "uid-web-0", job="web-5d4f")
    events = core.observe_workload(at_time(pod_workload(pod, status="pending"), -30), NOW)
    events += core.observe_pod(pod, NOW, devices("web-0"))
    assert {e.job_id for e in events} == {"default/web-0"} and list(core.jobs) == ["default/web-0"]


def test_a_pod_group_and_its_workload_are_one_job():
    core = ledger()
    pods = [kueue_pod(f"sample-{i}", f"uid-sample-{i}", group=True, index=i) for i in (0, 1)]
    events = core.observe_workload(at_time(pod_group_workload(pods, status="pending"), -30), NOW)
    events += core.observe_workload(at_time(pod_group_workload(pods, status="admitted"), -10), NOW)
    for stage in ("running", "succeeded"):
        for i in (0, 1):
            events += core.observe_pod(kueue_pod(f"sample-{i}", f"uid-sample-{i}", group=True, index=i, stage=stage),
                                       NOW, devices("sample-0", "sample-1"))
    assert {e.job_id for e in events} == {"default/podgroup/sample-group"}
    assert kinds(events)[:2] == ["submitted", "queued"] and kinds(events)[-1] == "completed"
    assert events[0].requested_gpus == 2.0 and list(core.jobs) == ["default/podgroup/sample-group"]


def test_a_prebuilt_group_workload_and_a_group_named_by_annotation_are_the_same_job():
    """A prebuilt Workload (no is-group-workload annotation) is named after the group; with Kueue's
    WorkloadIdentifierAnnotations the group's name is a pod annotation instead of a label."""
    core = ledger()
    pods = [kueue_pod(f"sample-{i}", f"uid-sample-{i}", group=True, index=i) for i in (0, 1)]
    events = core.observe_workload(at_time(pod_group_workload(pods, annotated=False, status="pending"), -30), NOW)
    pod = kueue_pod("sample-0", "uid-sample-0", group=True)
    pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-name"] = pod["metadata"]["labels"].pop(
        "kueue.x-k8s.io/pod-group-name")
    events += core.observe_pod(pod, NOW, devices("sample-0"))
    assert {e.job_id for e in events} == {"default/podgroup/sample-group"}


def test_the_agent_saves_a_workload_seen_again_under_its_pods_job():
    """The agent saves its state when a Workload's job is known (an eviction seen changes it with no
    event), so it must name the job as the core does."""
    from gpuledger.agents.kubernetes_agent import workload_job_of

    pods = [kueue_pod(f"sample-{i}", f"uid-sample-{i}", group=True, index=i) for i in (0, 1)]
    assert workload_job_of(pod_workload(pods[0])) == "default/sample-0"
    assert workload_job_of(pod_group_workload(pods)) == "default/podgroup/sample-group"
    assert workload_job_of(workload()) == "default/job/train"
