"""A PodResourcesLister gRPC server built from the published proto (agents/podresources/api.proto),
on a unix socket, serving a table the test sets: the stand-in for the kubelet."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from gpuledger.agents.podresources import api_pb2, api_pb2_grpc


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    """pods: {(namespace, name): {container: {resource name: [device ids]}}}"""

    def __init__(self, pods: dict | None = None):
        self.pods: dict = dict(pods or {})
        self.calls: list[str] = []

    def _pod(self, namespace: str, name: str) -> api_pb2.PodResources:
        containers = [api_pb2.ContainerResources(name=c, devices=[
            api_pb2.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in sorted(res.items())])
            for c, res in sorted(self.pods[(namespace, name)].items())]
        return api_pb2.PodResources(namespace=namespace, name=name, containers=containers)

    def List(self, request, context):
        self.calls.append("List")
        return api_pb2.ListPodResourcesResponse(pod_resources=[self._pod(*key) for key in sorted(self.pods)])

    def Get(self, request, context):
        self.calls.append("Get")
        key = (request.pod_namespace, request.pod_name)
        if key not in self.pods:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {key[0]}/{key[1]} not found")
        return api_pb2.GetPodResourcesResponse(pod_resources=self._pod(*key))

    def GetAllocatableResources(self, request, context):
        return api_pb2.AllocatableResourcesResponse()


class PodResourcesServer:
    def __init__(self, socket_path: Path, kubelet: FakeKubelet):
        self.socket_path = socket_path
        self.kubelet = kubelet
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(kubelet, self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")

    def __enter__(self) -> "PodResourcesServer":
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
