"""A recorded cluster for the replay API server: one Kueue ClusterQueue/LocalQueue/Workload and two
GPU pods whose watch streams include a dropped connection, a bookmark and a 410 Gone."""

from __future__ import annotations

from kube.objects import cluster_queue, gpu_pod, local_queue, workload
from kube.replay_server import Resource, Session, bookmark, list_body

PODS = "/api/v1/pods"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
TRAIN_GPU = "GPU-8d0e2fb4-1c4a-4d0d-9c8e-6f3f2a1b0c11"
OTHER_MIG = "MIG-5c1f9a7e-2b3d-5e6f-8a9b-0c1d2e3f4a5b"
OTHER_CONTAINER = "containerd://0b7c3a2e51f44d0c9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"

#: the kubelet's view of node kube-worker-1: {(namespace, pod): {container: {resource: [ids]}}}
DEVICES = {
    ("default", "train-0"): {"nginx": {"nvidia.com/gpu": [TRAIN_GPU]}},
    ("default", "other-0"): {"nginx": {"nvidia.com/mig-3g.40gb": [OTHER_MIG]}},
}


def train(stage: str, rv: str) -> dict:
    return gpu_pod("train-0", "uid-train-0", job="train", stage=stage, resource_version=rv,
                   labels={"kueue.x-k8s.io/queue-name": "user-queue"})


def other(stage: str, rv: str) -> dict:
    return gpu_pod("other-0", "uid-other-0", job="other", stage=stage, resource_version=rv, created=10, started=14,
                   finished=50, container_id=OTHER_CONTAINER, resource="nvidia.com/mig-3g.40gb")


def recorded_cluster() -> dict[str, Resource]:
    kueue = "kueue.x-k8s.io/v1beta1"
    return {
        f"{KUEUE}/localqueues": Resource([list_body("LocalQueueList", "10", [local_queue()], kueue)]),
        f"{KUEUE}/clusterqueues": Resource([list_body("ClusterQueueList", "10", [cluster_queue(gpu_quota=8, reserved=1)],
                                                      kueue)]),
        f"{KUEUE}/workloads": Resource([list_body("WorkloadList", "10", [workload(status="admitted", count=1)], kueue)]),
        PODS: Resource(
            lists=[list_body("PodList", "100", [train("pending", "99")]),
                   # after the 410: other-0 was created and started while no watch was open
                   list_body("PodList", "200", [train("running", "103"), other("running", "150")])],
            sessions=[
                Session([{"type": "MODIFIED", "object": train("scheduled", "101")}, bookmark("Pod", "102")], "drop"),
                Session([{"type": "MODIFIED", "object": train("running", "103")}], "gone"),
                Session([{"type": "MODIFIED", "object": train("succeeded", "201")},
                         {"type": "MODIFIED", "object": other("failed-oom", "202")},
                         {"type": "DELETED", "object": other("failed-oom", "203")}], "close"),
            ]),
    }
