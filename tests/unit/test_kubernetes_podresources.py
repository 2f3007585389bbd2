"""The PodResources client against a gRPC server built from the published kubelet proto, on a
unix socket; and the committed stubs are what grpcio-tools generates from the proto."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from gpuledger.agents.kubernetes import KubernetesMapping
from gpuledger.agents.podresources.client import PodResourcesClient
from kube.podresources_server import FakeKubelet, PodResourcesServer

PODS = {
    ("default", "train-0"): {"main": {"nvidia.com/gpu": ["GPU-aaaa", "GPU-bbbb"], "example.com/nic": ["nic0"]},
                             "sidecar": {}},
    ("team-a", "infer-0"): {"server": {"nvidia.com/gpu.shared": ["GPU-cccc::0", "GPU-cccc::1"]}},
    ("team-b", "mig-0"): {"worker": {"nvidia.com/mig-3g.40gb": ["MIG-dddd"]}},
    ("kube-system", "coredns"): {"coredns": {}},
}


@pytest.fixture
def kubelet():
    # unix socket paths are short (108 bytes): a fresh short temp dir rather than pytest's tmp_path
    with tempfile.TemporaryDirectory(prefix="pr-") as tmp:
        fake = FakeKubelet(PODS)
        sock = Path(tmp) / "kubelet.sock"
        with PodResourcesServer(sock, fake):
            yield fake, sock


def test_list_gives_gpu_devices_by_container(kubelet):
    fake, sock = kubelet
    is_gpu = KubernetesMapping(cluster="c").is_gpu_resource
    with PodResourcesClient(str(sock)) as client:
        listed = client.list(is_gpu)
    assert listed == {
        ("default", "train-0"): {"main": ["GPU-aaaa", "GPU-bbbb"]},       # the NIC is not a GPU
        ("team-a", "infer-0"): {"server": ["GPU-cccc::0", "GPU-cccc::1"]},
        ("team-b", "mig-0"): {"worker": ["MIG-dddd"]},
        ("kube-system", "coredns"): {},
    }
    assert fake.calls == ["List"]


def test_get_one_pod_and_an_unknown_one(kubelet):
    _, sock = kubelet
    with PodResourcesClient(str(sock)) as client:
        assert client.get("default", "train-0") == {"main": ["nic0", "GPU-aaaa", "GPU-bbbb"]}  # resources in name order
        assert client.get("default", "gone") is None


def test_committed_stubs_are_what_the_proto_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs")
    from gpuledger.agents.podresources import generate

    for path in generate.generate(tmp_path):
        assert path.read_text() == (generate.HERE / path.name).read_text(), f"{path.name} differs: regenerate it"
