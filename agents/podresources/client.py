"""Which devices each container holds, from the kubelet PodResources API (gRPC on a unix socket).

    client = PodResourcesClient("/var/lib/kubelet/pod-resources/kubelet.sock")
    client.list(is_gpu)            # {(namespace, pod): {container: [device id, ...]}}

Only pods the kubelet still runs are listed: a pod that has ended has no devices any more."""

from __future__ import annotations

from typing import Callable

import grpc

from gpuledger.agents.podresources import api_pb2, api_pb2_grpc

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

PodDevices = dict[tuple[str, str], dict[str, list[str]]]


def _containers(pod: api_pb2.PodResources, wanted: Callable[[str], bool]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for container in pod.containers:
        ids = [d for dev in container.devices if wanted(dev.resource_name) for d in dev.device_ids]
        if ids:
            out[container.name] = ids
    return out


class PodResourcesClient:
    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 5.0):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)

    def list(self, wanted: Callable[[str], bool] = lambda name: True) -> PodDevices:
        """Every pod on the node with the devices of the `wanted` resources, by container
        (pods holding none of them map to {}: also a pod listed before its devices are allocated,
        which the core therefore takes for one not reported yet)."""
        response = self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
        return {(pod.namespace, pod.name): _containers(pod, wanted) for pod in response.pod_resources}

    def get(self, namespace: str, name: str, wanted: Callable[[str], bool] = lambda name: True) -> dict[str, list[str]] | None:
        """One pod's devices (the kubelet's Get, beta since Kubernetes 1.34); None when the kubelet
        does not know the pod."""
        try:
            response = self._stub.Get(api_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace),
                                      timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return _containers(response.pod_resources, wanted)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "PodResourcesClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
