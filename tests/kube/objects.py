"""Test objects built from the recorded upstream API objects in tests/fixtures/kubernetes/.

Every adaptation of an upstream object is made here, by a named helper, so that the fixture files
stay verbatim (tests/fixtures/kubernetes/SOURCES.md lists the sources and these adaptations):
- `gpu_pod`: the Running pod of the Kubernetes docs, given an `nvidia.com/gpu` limit, a name/uid,
  a batch/v1 Job as controlling owner instead of the ReplicaSet, and the status of one lifecycle
  stage (the stage statuses use the fields and values of the Pod API: PodScheduled=False with
  reason Unschedulable, containerStatuses[].state.terminated with exitCode/reason OOMKilled,
  the DisruptionTarget condition, deletionTimestamp);
- `workload`: the Workload of the Kueue docs with a uid, creationTimestamp, a Job owner and an
  `nvidia.com/gpu` request, plus one of the statuses recorded in Kueue's troubleshooting guide;
- `cluster_queue` / `local_queue`: Kueue's single-ClusterQueue setup with `nvidia.com/gpu` quota;
- `kueue_pod` / `pod_workload` / `pod_group_workload`: Kueue's plain-pod and pod-group examples on
  `gpu_pod`, and the Workloads Kueue's pod integration makes of them.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import yaml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubernetes"
T0 = "2022-02-17T21:51:01Z"   # the recorded pod's creation time


@cache
def _load(name: str) -> tuple:
    return tuple(yaml.safe_load_all((FIXTURES / name).read_text()))


def fixture(name: str, index: int = 0) -> dict:
    return copy.deepcopy(_load(name)[index])


def at(seconds: int) -> str:
    """T0 + seconds, RFC 3339 (the API's second resolution)."""
    from datetime import datetime, timedelta, timezone
    t = datetime(2022, 2, 17, 21, 51, 1, tzinfo=timezone.utc) + timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def ms(seconds: int) -> int:
    return 1645134661000 + seconds * 1000


STAGES = ("pending", "scheduled", "running", "succeeded", "failed-oom", "preempted", "deleting")


def at_time(wl: dict, seconds: int) -> dict:
    """The Workload with every condition's lastTransitionTime at T0 + seconds."""
    for c in wl["status"]["conditions"]:
        c["lastTransitionTime"] = at(seconds)
    return wl


def kinds(events) -> list[str]:
    """The kinds of a list of job events, in order, as strings."""
    return [e.kind.value for e in events]


#: the GPU the Kueue tests' pods hold (tests/fixtures/kubernetes/ pods list it as device "nginx")
KUEUE_GPU = "GPU-8d0e2fb4-1c4a-4d0d-9c8e-6f3f2a1b0c11"


def kueue_devices(*pods: str):
    """A kubelet device lookup that lists KUEUE_GPU for the named pods, nothing for the others."""
    return lambda node, ns, name, host_ip: {"nginx": [KUEUE_GPU]} if name in pods else None


def kueue_ledger():
    """A Kubernetes ledger of cluster "k8s" that knows the fixtures' LocalQueue."""
    from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping

    core = KubernetesLedger(KubernetesMapping(cluster="k8s"))
    core.observe_local_queue(local_queue())
    return core


def gpu_pod(name: str = "train-0", uid: str = "uid-train-0", *, job: str | None = "train", stage: str = "running",
            gpus: int = 1, node: str = "kube-worker-1", namespace: str = "default", created: int = 0,
            started: int = 4, finished: int = 60, labels: dict | None = None, resource: str = "nvidia.com/gpu",
            container_id: str = "containerd://5403af59a2b46ee5a23fb0ae4b1e077f7ca5c5fb7af16e1ab21c00e0e616462a",
            resource_version: str = "1364") -> dict:
    assert stage in STAGES, stage
    pod = fixture("pod-running.yaml")
    meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
    meta.update(name=name, uid=uid, namespace=namespace, creationTimestamp=at(created),
                resourceVersion=resource_version)
    meta["labels"].update(labels or {})
    if job is None:
        meta.pop("ownerReferences")
    else:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "blockOwnerDeletion": True, "controller": True,
                                    "kind": "Job", "name": job, "uid": f"uid-job-{job}"}]
        meta["labels"]["batch.kubernetes.io/job-name"] = job
    spec["containers"][0]["resources"]["limits"][resource] = str(gpus)
    spec["containers"][0]["resources"]["requests"][resource] = str(gpus)
    spec["nodeName"] = node
    cs = status["containerStatuses"][0]
    cs["containerID"] = container_id
    status["startTime"] = at(created)
    for c in status["conditions"]:
        c["lastTransitionTime"] = at(created + (5 if c["type"] in ("Ready", "ContainersReady") else 0))
    cs["state"] = {"running": {"startedAt": at(started)}}
    if stage == "pending":
        del spec["nodeName"]
        status.clear()
        status.update(phase="Pending", qosClass="Guaranteed", conditions=[{
            "lastProbeTime": None, "lastTransitionTime": at(created), "type": "PodScheduled", "status": "False",
            "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are "
                       "available: 4 No preemption victims found for incoming pod."}])
    elif stage == "scheduled":
        status["phase"] = "Pending"
        cs.pop("containerID")
        cs.update(ready=False, started=False, state={"waiting": {"reason": "ContainerCreating"}})
        status["conditions"] = [c for c in status["conditions"] if c["type"] in ("Initialized", "PodScheduled")]
    elif stage in ("succeeded", "failed-oom", "preempted"):
        code, reason = {"succeeded": (0, "Completed"), "failed-oom": (137, "OOMKilled"),
                        "preempted": (137, "Error")}[stage]
        status["phase"] = "Succeeded" if stage == "succeeded" else "Failed"
        cs.update(ready=False, started=False, state={"terminated": {
            "containerID": container_id, "exitCode": code, "reason": reason,
            "startedAt": at(started), "finishedAt": at(finished)}})
        if stage == "preempted":
            status["conditions"].append({"lastProbeTime": None, "lastTransitionTime": at(finished - 1),
                                         "type": "DisruptionTarget", "status": "True",
                                         "reason": "PreemptionByScheduler",
                                         "message": "default-scheduler: preempting to accommodate a higher priority pod"})
    elif stage == "deleting":
        meta["deletionTimestamp"] = at(finished + 30)
        meta["deletionGracePeriodSeconds"] = 30
    return pod


def workload(name: str = "job-train-1a2b3", uid: str = "uid-wl-train", *, job: str = "train", status: str | None = None,
             gpus_per_pod: int = 1, count: int = 3, namespace: str = "default", queue: str = "user-queue",
             created: int = -60, priority: int = 0, owners: list[dict] | None = None) -> dict:
    wl = fixture("kueue-workload.yaml")
    meta, spec = wl["metadata"], wl["spec"]
    meta.update(name=name, namespace=namespace, uid=uid, creationTimestamp=at(created), resourceVersion="1",
                ownerReferences=owners if owners is not None else [
                    {"apiVersion": "batch/v1", "blockOwnerDeletion": True, "controller": True,
                     "kind": "Job", "name": job, "uid": f"uid-job-{job}"}])
    spec.update(queueName=queue, priority=priority)
    spec["podSets"][0]["count"] = count
    spec["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = str(gpus_per_pod)
    if status:
        wl["status"] = fixture(f"kueue-workload-status-{status}.yaml")["status"]
    return wl


def kueue_pod(name: str, uid: str, *, group: bool = False, index: int = 0, stage: str = "running",
              job: str | None = None, **kw) -> dict:
    """`gpu_pod` with the metadata of Kueue's plain-pod example (`kueue-pod.yaml`) or of pod `index`
    of its pod-group example (`kueue-pod-group.yaml`), plus the `kueue.x-k8s.io/managed` label
    Kueue's pod webhook adds; `job` makes a ReplicaSet its controlling owner (a Deployment's pod)."""
    example = fixture("kueue-pod-group.yaml" if group else "kueue-pod.yaml", index)["metadata"]
    pod = gpu_pod(name, uid, job=None, stage=stage,
                  labels={**example["labels"], "kueue.x-k8s.io/managed": "true"}, **kw)
    pod["metadata"]["annotations"] = dict(example.get("annotations") or {})
    if job is not None:
        pod["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "blockOwnerDeletion": True, "controller": True,
                                               "kind": "ReplicaSet", "name": job, "uid": f"uid-rs-{job}"}]
    return pod


def pod_workload(pod: dict, **kw) -> dict:
    """The Workload of a single plain pod: named 'pod-<pod>-<hash>', the pod its controller
    (Kueue's pod_controller.go GetWorkloadNameForPod, jobframework ConstructWorkload)."""
    meta = pod["metadata"]
    owner = {"apiVersion": "v1", "blockOwnerDeletion": True, "controller": True, "kind": "Pod",
             "name": meta["name"], "uid": meta["uid"]}
    return workload(f"pod-{meta['name']}-3f1c2", f"uid-wl-{meta['name']}", count=1, owners=[owner],
                    queue=meta["labels"]["kueue.x-k8s.io/queue-name"], **kw)


def pod_group_workload(pods: list[dict], *, annotated: bool = True, **kw) -> dict:
    """The Workload of a pod group: named after the group, annotated `is-group-workload`, every pod
    an owner but none the controller (Kueue's NewGroupWorkload, controllerutil.SetOwnerReference).
    `annotated=False`: a prebuilt Workload (named after the group, owners added by Kueue)."""
    meta = pods[0]["metadata"]
    group = meta["labels"]["kueue.x-k8s.io/pod-group-name"]
    owners = [{"apiVersion": "v1", "kind": "Pod", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]}
              for p in pods]
    wl = workload(group, f"uid-wl-{group}", count=len(pods), owners=owners,
                  queue=meta["labels"]["kueue.x-k8s.io/queue-name"], **kw)
    if annotated:
        wl["metadata"]["annotations"] = {"kueue.x-k8s.io/is-group-workload": "true"}
    return wl


def cluster_queue(gpu_quota: int = 8, reserved: int | None = None, pending: int = 0) -> dict:
    cq = fixture("kueue-single-clusterqueue-setup.yaml", 1)
    cq["metadata"].update(uid="uid-cq", resourceVersion="1")
    group = cq["spec"]["resourceGroups"][0]
    group["coveredResources"].append("nvidia.com/gpu")
    group["flavors"][0]["resources"].append({"name": "nvidia.com/gpu", "nominalQuota": gpu_quota})
    cq["status"] = {"pendingWorkloads": pending}
    if reserved is not None:
        cq["status"]["flavorsReservation"] = [{"name": "default-flavor", "resources": [
            {"name": "cpu", "total": "3"}, {"name": "nvidia.com/gpu", "total": str(reserved)}]}]
    return cq


def local_queue() -> dict:
    lq = fixture("kueue-single-clusterqueue-setup.yaml", 2)
    lq["metadata"].update(uid="uid-lq", resourceVersion="1")
    return lq


TIME_FIELDS = frozenset({"creationTimestamp", "deletionTimestamp", "lastTransitionTime", "startedAt", "finishedAt",
                         "startTime"})


def shift_times(obj, seconds: float):
    """A copy of an API object (or a structure of them) with every timestamp moved by `seconds`."""
    from datetime import datetime, timedelta

    if isinstance(obj, list):
        return [shift_times(x, seconds) for x in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for key, value in obj.items():
        if key in TIME_FIELDS and isinstance(value, str):
            t = datetime.fromisoformat(value.replace("Z", "+00:00")) + timedelta(seconds=seconds)
            out[key] = t.strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            out[key] = shift_times(value, seconds)
    return out
