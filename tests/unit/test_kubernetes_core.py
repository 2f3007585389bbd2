"""The pure Kubernetes core (agents/kubernetes.py) on recorded upstream API objects
(tests/fixtures/kubernetes/, adapted by tests/kube/objects.py)."""

from __future__ import annotations

import json

import pytest

from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping, MalformedObject, parse_device_id
from gpuledger.schemas.models import JobEventKind as K
from gpuledger.schemas.wire import encode
from kube.objects import at, cluster_queue, gpu_pod, kinds, local_queue, ms, workload

UUID = "GPU-8d0e2fb4-1c4a-4d0d-9c8e-6f3f2a1b0c11"
CONTAINER = "5403af59a2b46ee5a23fb0ae4b1e077f7ca5c5fb7af16e1ab21c00e0e616462a"
NOW = ms(1000)


def devices(table: dict | None = None):
    """A PodResources view: (node, namespace, pod) -> {container: [device ids]}."""
    table = {("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}} if table is None else table
    return lambda node, ns, name, host_ip: table.get((node, ns, name))


def ledger(**kw) -> KubernetesLedger:
    return KubernetesLedger(KubernetesMapping(cluster="k8s", **kw))


def run(core, stages, lookup=None, **kw):
    out = []
    for stage in stages:
        out += core.observe_pod(gpu_pod(stage=stage, **kw), NOW, lookup or devices())
    return out


def test_a_job_pod_from_pending_to_completed():
    core = ledger()
    events = run(core, ["pending", "scheduled", "running", "succeeded"])
    assert kinds(events) == ["submitted", "queued", "allocated", "allocated", "started", "completed"]
    submitted, queued, alloc, alloc_ids, started, completed = events
    assert {e.job_id for e in events} == {"default/job/train"} and {e.attempt for e in events} == {0}
    assert submitted.ts_ms == ms(0) and submitted.aliases == {"k8s_pod": "default/train-0",
                                                             "k8s_pod_uid": "uid-train-0"}
    assert queued.reason.startswith("Unschedulable: 0/4 nodes are available")
    assert alloc.ts_ms == ms(0) and [(g.node, g.gpu_uuid, g.share_milli, g.container_id) for g in alloc.gpus] == [
        ("kube-worker-1", UUID, 1000, None)]                   # scheduled: the container does not exist yet
    assert alloc_ids.ts_ms == started.ts_ms == ms(4)           # the runtime's id, from containerStatuses
    assert alloc_ids.gpus[0].container_id == CONTAINER          # 'containerd://' removed
    assert completed.ts_ms == ms(60) and completed.reason is None
    assert (submitted.tenant, submitted.queue, submitted.requested_gpus) == ("default", "default", 1.0)
    for e in events:
        encode(e)                                              # every event is a valid wire message


def test_seen_again_gives_nothing_new_and_ids_are_deterministic():
    a, b = ledger(), ledger()
    first = run(a, ["running", "running", "succeeded", "succeeded"])
    second = run(b, ["running", "succeeded"])
    assert [e.event_id for e in first] == [e.event_id for e in second]
    assert first[0].event_id == "k8s/k8s/default/job/train/0/1/submitted"


def test_state_survives_a_restart_without_loss_or_duplication():
    whole = run(ledger(), ["scheduled", "running", "succeeded"])
    core = ledger()
    part = run(core, ["scheduled"])
    restored = KubernetesLedger(core.mapping, json.loads(json.dumps(core.to_state())))
    rest = run(restored, ["scheduled", "running", "succeeded"])
    assert [e.event_id for e in part + rest] == [e.event_id for e in whole]


def test_the_state_written_is_every_field_of_every_pod_and_job():
    """state_bytes (what the agent saves each cycle) is the JSON of the dataclasses, as asdict gives
    them, written by orjson directly (2.7 s -> 0.04 s at 15,625 pods and jobs)."""
    from dataclasses import asdict

    core = ledger()
    run(core, ["scheduled", "running"])
    assert core.pods and core.jobs
    state = json.loads(core.state_bytes())
    assert state["pods"] == {uid: asdict(p) for uid, p in core.pods.items()}
    assert state["jobs"] == {jid: asdict(j) for jid, j in core.jobs.items()}
    assert state == core.to_state() and state["version"] and "watermark_ms" in state


def test_oom_failure_then_the_jobs_next_pod_is_a_retried_attempt():
    core = ledger()
    events = run(core, ["running", "failed-oom"])
    events += core.observe_pod(gpu_pod("train-1", "uid-train-1", stage="running", created=70, started=75),
                               NOW, devices({("kube-worker-1", "default", "train-1"): {"nginx": [UUID]}}))
    assert kinds(events) == ["submitted", "allocated", "started", "failed", "retried", "allocated", "started"]
    failed, retried = events[3], events[4]
    assert failed.reason == "OOMKilled (exit code 137, container nginx)" and failed.ts_ms == ms(60)
    assert (retried.attempt, retried.ts_ms) == (1, ms(70))
    assert [e.attempt for e in events[5:]] == [1, 1]


def test_a_container_that_never_started_does_not_start_the_attempt():
    """containerd reports a container it could not start (StartError) as terminated with startedAt at its zero
    time, as recorded in kubernetes/kubernetes#120331 (a Job whose command is not in the image): that is no
    start. Was: `started` (moved up to the allocation), so the pod's GPU time until the failure was executing."""
    core = ledger()
    failed = gpu_pod(stage="failed-oom", finished=9)
    failed["status"]["containerStatuses"][0]["state"] = {"terminated": {
        "exitCode": 128, "reason": "StartError", "startedAt": "1970-01-01T00:00:00Z", "finishedAt": at(9),
        "message": "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc "
                   "create failed: unable to start container process: exec: \"sleepx\": executable file not found "
                   "in $PATH: unknown", "containerID": f"containerd://{CONTAINER}"}}
    events = run(core, ["scheduled"]) + core.observe_pod(failed, NOW, devices())
    assert "started" not in kinds(events) and kinds(events)[-1] == "failed", kinds(events)
    assert events[-1].ts_ms == ms(9) and events[-1].reason.startswith("StartError")


def test_preempted_by_the_scheduler():
    events = run(ledger(), ["running", "preempted"])
    assert kinds(events)[-1] == "preempted"
    assert events[-1].reason.startswith("PreemptionByScheduler: default-scheduler: preempting")


def test_deleted_while_running_is_cancelled_at_the_delete_request():
    core = ledger()
    events = run(core, ["running", "deleting"])
    assert kinds(events) == ["submitted", "allocated", "started"]        # terminating: not over yet
    events += core.pod_deleted(gpu_pod(stage="deleting"), NOW, devices())
    assert kinds(events)[-1] == "cancelled"
    assert events[-1].ts_ms == ms(60)  # deletionTimestamp (T+90 s) less its 30 s grace period


def test_deleted_with_a_grace_period_ends_when_its_containers_stop():
    """The GPUs are held until the containers are gone: the end is their finishedAt, not the request."""
    core = ledger()
    run(core, ["running"])
    pod = gpu_pod(stage="running")
    pod["metadata"].update(deletionTimestamp=at(700), deletionGracePeriodSeconds=600)   # asked at T+100 s
    assert core.observe_pod(pod, NOW, devices()) == []
    pod["status"]["phase"] = "Failed"                                                    # SIGTERM: exits at T+500 s
    pod["status"]["containerStatuses"][0]["state"] = {"terminated": {
        "exitCode": 143, "reason": "Error", "startedAt": at(4), "finishedAt": at(500)}}
    events = core.observe_pod(pod, NOW, devices()) + core.pod_deleted(pod, NOW, devices())
    assert [(e.kind.value, e.ts_ms, e.reason) for e in events] == [("cancelled", ms(500), "deleted")]


def test_deleted_never_ends_before_the_delete_request():
    """A container that stopped before the request (a sidecar) does not end the pod's GPUs early."""
    core = ledger()
    run(core, ["running"])
    pod = gpu_pod(stage="running")
    pod["metadata"].update(deletionTimestamp=at(700), deletionGracePeriodSeconds=600)   # asked at T+100 s
    sidecar = {**pod["status"]["containerStatuses"][0], "name": "sidecar",
               "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": at(4), "finishedAt": at(50)}}}
    pod["status"]["containerStatuses"].append(sidecar)
    events = core.observe_pod(pod, NOW, devices()) + core.pod_deleted(pod, NOW, devices())
    assert [(e.kind.value, e.ts_ms, e.reason) for e in events] == [("cancelled", ms(100), "deleted")]


def test_a_pod_without_gpus_is_ignored():
    pod = gpu_pod()
    del pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    del pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    assert ledger().observe_pod(pod, NOW, devices()) == []


@pytest.mark.parametrize("device_id, replicas, expected", [
    ("GPU-8d0e2fb4", 1, ("GPU-8d0e2fb4", None, 1000)),
    ("GPU-8d0e2fb4::3", 4, ("GPU-8d0e2fb4", None, 250)),          # time-slicing replica 3 of 4
    ("MIG-1a2b3c4d-0000-5555-aaaa-0123456789ab", 1, ("MIG-1a2b3c4d-0000-5555-aaaa-0123456789ab", None, 1000)),
    ("2", 1, (None, 2, 1000)),                                     # DEVICE_ID_STRATEGY=index
])
def test_device_ids(device_id, replicas, expected):
    assert parse_device_id(device_id, KubernetesMapping(cluster="c", time_slicing_replicas=replicas)) == expected


def test_two_replicas_of_one_gpu_are_one_assignment_with_both_shares():
    core = ledger(time_slicing_replicas=4)
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [f"{UUID}::0", f"{UUID}::1"]}})
    events = run(core, ["running"], lookup, gpus=2, resource="nvidia.com/gpu.shared")
    (alloc,) = [e for e in events if e.kind == K.allocated]
    assert [(g.gpu_uuid, g.share_milli) for g in alloc.gpus] == [(UUID, 500)]
    assert alloc.requested_gpus == 0.5


@pytest.mark.parametrize("resource, replicas, gpus", [
    ("nvidia.com/mig-1g.10gb", 1, 1 / 7),
    ("nvidia.com/mig-1g.10gb", 4, 1 / 28),            # time-sliced MIG instance, not renamed
    ("nvidia.com/mig-3g.40gb.shared", 2, 3 / 14),     # renamed time-sliced MIG instance
    ("nvidia.com/gpu.shared", 4, 1 / 4),
])
def test_a_time_sliced_mig_instance_counts_one_replica_of_its_share(resource, replicas, gpus):
    """As the device ids say: 'MIG-<uuid>::<n>' is 1/replicas of the instance."""
    core = ledger(time_slicing_replicas=replicas)
    events = run(core, ["running"], resource=resource)
    assert events[0].requested_gpus == round(gpus, 6)
    cq = cluster_queue(gpu_quota=0, reserved=0)
    for group in cq["spec"]["resourceGroups"]:
        for flavor in group["flavors"]:
            flavor["resources"].append({"name": resource, "nominalQuota": replicas * 7})
    for flavor in cq["status"]["flavorsReservation"]:
        flavor["resources"].append({"name": resource, "total": str(replicas)})
    core.observe_cluster_queue(cq)
    (q,) = core.snapshot(NOW).queues
    assert q.quota_gpus == pytest.approx(gpus * replicas * 7) and q.allocated_gpus == pytest.approx(gpus * replicas)


def test_a_pod_waits_for_its_device_ids_and_holds_the_watermark():
    core = ledger(device_wait_ms=60_000)
    none = devices({})
    assert kinds(core.observe_pod(gpu_pod(stage="scheduled"), NOW, none)) == ["submitted"]
    mark = core.watermark(NOW + 10_000)
    assert mark.ts_ms == ms(0)                                  # held at the pod's scheduling time
    assert core.observe_pod(gpu_pod(stage="scheduled"), NOW + 30_000, none) == []
    late = core.observe_pod(gpu_pod(stage="scheduled"), NOW + 60_000, none)
    assert kinds(late) == ["allocated"] and late[0].gpus == []  # gave up: not billable to a GPU
    assert core.waiting_pods() == []
    assert core.watermark(NOW + 90_000).ts_ms == NOW + 90_000 - 30_000


def test_devices_arriving_while_held_are_used():
    core = ledger()
    core.observe_pod(gpu_pod(stage="scheduled"), NOW, devices({}))
    (waiting,) = core.waiting_pods()
    events = core.observe_pod(waiting, NOW + 5_000, devices())
    assert kinds(events) == ["allocated"] and events[0].gpus[0].gpu_uuid == UUID and events[0].ts_ms == ms(0)


def test_watermark_is_monotonic_and_later_events_are_clamped_to_it():
    core = ledger()
    assert core.watermark(ms(100)).ts_ms == ms(70)
    assert core.watermark(ms(90)) is None
    events = run(core, ["running"])                             # happened at T0, seen only now
    assert all(e.ts_ms >= ms(70) for e in events) and core.clamped == len(events)


def test_a_multi_pod_attempt_grows_and_shrinks_its_gpu_set():
    core = ledger()
    table = {("kube-worker-1", "default", "train-0"): {"nginx": ["GPU-a"]},
             ("kube-worker-2", "default", "train-1"): {"nginx": ["GPU-b"]}}
    a = dict(name="train-0", uid="uid-0")
    b = dict(name="train-1", uid="uid-1", node="kube-worker-2", started=6, finished=90,
             container_id="containerd://bbbb")
    ev = core.observe_pod(gpu_pod(stage="running", **a), NOW, devices(table))
    ev += core.observe_pod(gpu_pod(stage="running", **b), NOW, devices(table))
    ev += core.observe_pod(gpu_pod(stage="succeeded", **a), NOW, devices(table))
    ev += core.observe_pod(gpu_pod(stage="succeeded", **b), NOW, devices(table))
    assert kinds(ev) == ["submitted", "allocated", "started", "allocated", "started", "allocated", "started",
                         "completed"]
    assert [g.gpu_uuid for g in ev[3].gpus] == ["GPU-a", "GPU-b"]
    assert [g.gpu_uuid for g in ev[5].gpus] == ["GPU-b"] and ev[5].ts_ms == ms(60)
    assert ev[-1].ts_ms == ms(90) and {e.attempt for e in ev} == {0}
    assert ev[3].aliases["k8s_pods"] == "default/train-0,default/train-1"


def test_tenant_label_and_queue_label_through_a_local_queue():
    core = ledger()
    core.observe_local_queue(local_queue())
    events = run(core, ["running"], labels={"gpuledger.io/tenant": "team-a", "kueue.x-k8s.io/queue-name": "user-queue"})
    assert {(e.tenant, e.queue) for e in events} == {("team-a", "cluster-queue")}


def test_kueue_pending_then_admitted_workload_and_the_snapshot():
    core = ledger()
    core.observe_local_queue(local_queue())
    core.observe_cluster_queue(cluster_queue(gpu_quota=8, pending=1))
    pending = core.observe_workload(workload(status="pending"), NOW)
    assert kinds(pending) == ["submitted", "queued"]
    assert pending[0].job_id == "default/job/train" and pending[0].requested_gpus == 3.0
    assert pending[1].reason.startswith("Pending: couldn't assign flavors to pod set main")
    snap = core.snapshot(NOW)
    (q,) = snap.queues
    assert (q.queue, q.quota_gpus, q.allocated_gpus, q.pending_jobs, q.pending_gpus) == ("cluster-queue", 8.0, 0.0, 1, 3.0)
    assert core.observe_workload(workload(status="admitted"), NOW) == []
    core.observe_cluster_queue(cluster_queue(gpu_quota=8, reserved=3))
    (q,) = core.snapshot(NOW).queues
    assert (q.allocated_gpus, q.pending_jobs, q.pending_gpus) == (3.0, 0, 0.0)
    # the Job's pods join the workload's attempt
    events = run(core, ["running"], labels={"kueue.x-k8s.io/queue-name": "user-queue"})
    assert kinds(events) == ["allocated", "started"] and events[0].attempt == 0 and events[0].queue == "cluster-queue"


def test_kueue_eviction_ends_the_attempt_as_preempted_and_requeues_it():
    core = ledger()
    core.observe_local_queue(local_queue())
    core.observe_workload(workload(status="admitted"), NOW)
    run(core, ["running"])
    assert core.observe_workload(workload(status="preempted"), NOW) == []   # pods still live
    events = core.pod_deleted(gpu_pod(stage="deleting"), NOW, devices())
    # the last evicted pod gone, the Workload waiting for quota again: the next attempt queues at once
    # (Kueue sends no Workload update until it admits it again)
    assert kinds(events) == ["preempted", "retried", "queued"] and events[1].attempt == 1
    assert events[0].reason == "Kueue Preempted: Preempted to accommodate a higher priority Workload"
    assert core.observe_workload(workload(status="preempted"), NOW) == []   # seen again: nothing new
    snap = core.snapshot(NOW)
    assert [(p.job_id, p.rule) for p in snap.preemptions] == [
        ("default/job/train", "Preempted to accommodate a higher priority Workload")]
    assert core.snapshot(NOW).preemptions == []                # reported once


def test_snapshot_without_kueue_counts_the_pods_queues():
    core = ledger()
    run(core, ["running"])
    core.observe_pod(gpu_pod("other-0", "uid-other", job="other", stage="pending"), NOW, devices())
    by_queue = {q.queue: q for q in core.snapshot(NOW).queues}
    assert (by_queue["default"].allocated_gpus, by_queue["default"].pending_jobs) == (1.0, 1)


@pytest.mark.parametrize("mangle, why", [
    (lambda p: p["metadata"].pop("uid"), "metadata.uid is missing"),
    (lambda p: p["metadata"].update(creationTimestamp="yesterday"), "not RFC 3339"),
    (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": "lots"}), "bad resource quantity"),
    (lambda p: p["status"].update(conditions="Ready"), "not a list"),
])
def test_malformed_objects_are_refused_with_the_reason(mangle, why):
    pod = gpu_pod()
    mangle(pod)
    with pytest.raises(MalformedObject, match=why):
        ledger().observe_pod(pod, NOW, devices())


def test_without_podresources_the_allocation_carries_no_gpus_at_once():
    core = ledger(devices_expected=False)
    events = run(core, ["scheduled", "running", "succeeded"], lookup=lambda *a: pytest.fail("no lookup expected"))
    assert kinds(events) == ["submitted", "allocated", "started", "completed"]
    assert events[1].gpus == [] and core.waiting_pods() == []


def test_a_gpu_index_from_the_device_plugin_stays_an_index():
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": ["3"]}})
    (alloc,) = [e for e in run(ledger(), ["running"], lookup) if e.kind == K.allocated]
    assert [(g.node, g.gpu_uuid, g.gpu_index) for g in alloc.gpus] == [("kube-worker-1", None, 3)]


def test_a_restarted_container_sends_its_new_id_from_its_start():
    core = ledger()
    run(core, ["running"])
    restarted = gpu_pod(stage="running", started=30, container_id="containerd://ffff")
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    events = core.observe_pod(restarted, NOW, devices())
    assert kinds(events) == ["allocated", "started"]
    assert events[0].ts_ms == ms(30) and events[0].gpus[0].container_id == "ffff"


def test_container_ids_by_name_match_what_the_dcgm_agent_reports():
    from gpuledger.agents.dcgm import holder_container_id
    from gpuledger.agents.kubernetes import KubernetesMapping

    by_name = KubernetesMapping(cluster="c", container_ids="name")
    ref = by_name.container_ref("ml", "train-0", "trainer", "containerd://abc")
    assert ref == holder_container_id({"namespace": "ml", "pod": "train-0", "container": "trainer"})
    assert KubernetesMapping(cluster="c").container_ref("ml", "train-0", "trainer", "containerd://abc") == "abc"
