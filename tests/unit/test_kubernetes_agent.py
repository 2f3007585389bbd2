"""The Kubernetes agent driven through the official `kubernetes` client against a replay API server
(recorded list and watch responses with a dropped connection, a bookmark and a 410 Gone) and a
kubelet PodResources gRPC server: the events come out once each, none lost, in order."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from gpuledger.agents.kubernetes import KubernetesMapping
from gpuledger.agents.kubernetes_agent import (
    DeviceSource,
    RoutingPublisher,
    SpooledRoutes,
    decode_route,
    encode_route,
    listen_address,
    serve_pod_resources,
)
from gpuledger.agents.podresources.client import PodResourcesClient
from gpuledger.agents.publisher import ListPublisher
from kube.harness import Run, by_job
from kube.objects import gpu_pod, ms
from kube.podresources_server import FakeKubelet, PodResourcesServer
from kube.replay_server import ReplayApiServer, Resource, list_body
from kube.scenario import DEVICES, OTHER_CONTAINER, OTHER_MIG, PODS, TRAIN_GPU, other, recorded_cluster, train


@pytest.fixture
def kubelet_socket():
    with tempfile.TemporaryDirectory(prefix="pr-") as tmp:
        sock = Path(tmp) / "kubelet.sock"
        with PodResourcesServer(sock, FakeKubelet(DEVICES)):
            yield sock


def finished(run: Run) -> bool:
    kinds = by_job(run.events())
    return (kinds.get("default/job/train", [])[-1:] == ["completed"]
            and kinds.get("default/job/other", [])[-1:] == ["failed"] and len(run.snapshots()) >= 1
            and len(run.watermarks()) >= 2)


def test_watch_drop_bookmark_and_410_lose_and_repeat_nothing(kubelet_socket, tmp_path):
    with ReplayApiServer(recorded_cluster()) as server:
        run = Run(server, kubelet_socket, tmp_path / "state.json").until(finished)
        # the client reconnected from the bookmark's resourceVersion after the drop, listed again
        # after the 410 and watched from the new list's resourceVersion
        assert server.watch_versions(PODS)[:3] == ["100", "102", "200"]
        assert server.list_count(PODS) == 2
    events = run.events()
    assert len({e["event_id"] for e in events}) == len(events)
    assert by_job(events) == {
        "default/job/train": ["submitted", "queued", "allocated", "allocated", "started", "completed"],
        "default/job/other": ["submitted", "allocated", "started", "failed"],
    }
    train_events = [e for e in events if e["job_id"] == "default/job/train"]
    other_events = [e for e in events if e["job_id"] == "default/job/other"]
    # Kubernetes' own times: the Workload's creation, the pod's conditions and container states
    assert [e["ts_ms"] for e in train_events] == [ms(-60), ms(0), ms(0), ms(4), ms(4), ms(60)]
    assert {(e["tenant"], e["queue"]) for e in train_events} == {("default", "cluster-queue")}
    assert train_events[3]["gpus"] == [{"node": "kube-worker-1", "gpu_uuid": TRAIN_GPU,
                                        "share_milli": 1000,
                                        "container_id": "5403af59a2b46ee5a23fb0ae4b1e077f7ca5c5fb7af16e1ab21c00e0e616462a"}]
    assert other_events[1]["gpus"][0]["gpu_uuid"] == OTHER_MIG
    assert other_events[1]["gpus"][0]["container_id"] == OTHER_CONTAINER.split("://")[1]
    assert other_events[1]["requested_gpus"] == pytest.approx(3 / 7)
    assert other_events[-1]["reason"] == "OOMKilled (exit code 137, container nginx)"
    # watermarks go to every partition and only move forward
    marks = run.watermarks()
    assert {p for p, _ in marks} == {0, 1}
    for p in (0, 1):
        values = [ts for q, ts in marks if q == p]
        assert values == sorted(values)
    queue = run.snapshots()[0]["queues"][0]
    assert (queue["queue"], queue["quota_gpus"], queue["allocated_gpus"]) == ("cluster-queue", 8.0, 1.0)


def cpu_pod(i: int) -> dict:
    return gpu_pod(f"web-{i}", f"uid-web-{i}", job=f"web-{i}", gpus=0)


def test_a_large_list_comes_in_pages_and_an_expired_continue_token_lists_again(kubelet_socket, tmp_path):
    """Pages of 2 (the API server's limit/continue), the first list's continue token expired
    half-way (410): the agent lists again from the start and bills the GPU pods as one list would."""
    pods = [cpu_pod(0), train("running", "103"), cpu_pod(1), cpu_pod(2), other("running", "150"), cpu_pod(3), cpu_pod(4)]
    cluster = {PODS: Resource([list_body("PodList", "100", pods)], expire_continue=1)}
    with ReplayApiServer(cluster) as server:
        run = Run(server, kubelet_socket, tmp_path / "s.json", kueue=False, page_size=2).until(
            lambda r: {"default/job/train", "default/job/other"} <= set(by_job(r.events())) and r.watermarks())
        assert (server.list_count(PODS), server.page_count(PODS)) == (2, 1 + 1 + 4)
        assert {q.get("limit") for p, q in server.requests if p == PODS and "watch" not in q} == {"2"}
    assert run.watchers[-1].relists == 1
    stats = run.agent.stats()
    assert (stats["watch_relists"], stats["events_published"], stats["jobs_tracked"]) == (1, 6, 2)
    assert stats["watermark_timestamp_seconds"] == max(ts for _, ts in run.watermarks()) / 1000
    assert by_job(run.events()) == {"default/job/train": ["submitted", "allocated", "started"],
                                    "default/job/other": ["submitted", "allocated", "started"]}


def test_pods_that_ask_for_no_gpu_are_dropped_from_the_list_page_by_page():
    import queue
    import threading

    from gpuledger.agents.kubernetes_agent import api_client_for, make_watchers

    mapping = KubernetesMapping(cluster="k8s")
    broken = cpu_pod(9)
    broken["spec"]["containers"] = "not a list"          # unreadable: kept, so that the core says why
    pods = [cpu_pod(0), train("running", "103"), cpu_pod(1), broken, other("running", "150")]
    with ReplayApiServer({PODS: Resource([list_body("PodList", "100", pods)])}) as server:
        pod_watcher = make_watchers(api_client_for(server.url, None), queue.Queue(), threading.Event(), kueue=False,
                                    timeout_s=1, mapping=mapping, page_size=2)[-1]
        items, version = pod_watcher._list()
    assert [p["metadata"]["name"] for p in items] == ["train-0", "web-9", "other-0"]
    assert version == "100" and pod_watcher.pages == 3


def test_kueue_objects_are_listed_in_pages_too():
    import queue
    import threading

    from gpuledger.agents.kubernetes_agent import api_client_for, make_watchers
    from kube.objects import workload
    from kube.scenario import KUEUE

    workloads = [workload(f"job-{i}", f"uid-wl-{i}", job=f"job-{i}") for i in range(3)]
    cluster = {f"{KUEUE}/workloads": Resource([list_body("WorkloadList", "10", workloads, "kueue.x-k8s.io/v1beta1")])}
    with ReplayApiServer(cluster) as server:
        watchers = make_watchers(api_client_for(server.url, None), queue.Queue(), threading.Event(), kueue=True,
                                 timeout_s=1, mapping=KubernetesMapping(cluster="k8s"), page_size=1)
        items, version = next(w for w in watchers if w.kind == "workload")._list()
        assert server.page_count(f"{KUEUE}/workloads") == 3
    assert [w["metadata"]["name"] for w in items] == ["job-0", "job-1", "job-2"] and version == "10"


def test_a_restarted_agent_neither_loses_nor_repeats(kubelet_socket, tmp_path):
    state = tmp_path / "state.json"
    first = {PODS: Resource([list_body("PodList", "100", [train("running", "103")])])}
    with ReplayApiServer(first) as server:
        run1 = Run(server, kubelet_socket, state, kueue=False).until(
            lambda r: by_job(r.events()).get("default/job/train", [])[-1:] == ["started"] and r.watermarks())
    second = {PODS: Resource([list_body("PodList", "300", [train("succeeded", "250"),
                                                           other("running", "260")])])}
    with ReplayApiServer(second) as server:
        run2 = Run(server, kubelet_socket, state, kueue=False).until(
            lambda r: "default/job/other" in by_job(r.events()) and "completed" in by_job(r.events()).get(
                "default/job/train", []))
    both = run1.events() + run2.events()
    assert len({e["event_id"] for e in both}) == len(both)
    assert by_job(run1.events())["default/job/train"] == ["submitted", "allocated", "started"]
    assert by_job(run2.events())["default/job/train"] == ["completed"]


def test_a_pod_deleted_while_the_agent_was_away_is_cancelled_on_the_relist(kubelet_socket, tmp_path):
    state = tmp_path / "state.json"
    with ReplayApiServer({PODS: Resource([list_body("PodList", "100", [train("running", "103")])])}) as server:
        Run(server, kubelet_socket, state, kueue=False).until(lambda r: r.watermarks())
    with ReplayApiServer({PODS: Resource([list_body("PodList", "300", [])])}) as server:
        run = Run(server, kubelet_socket, state, kueue=False).until(lambda r: r.events())
    assert [(e["kind"], e["reason"]) for e in run.events()] == [("cancelled", "deleted")]


def test_a_malformed_object_is_skipped_and_the_rest_goes_on(kubelet_socket, tmp_path):
    broken = train("running", "103")
    del broken["metadata"]["creationTimestamp"]
    broken["metadata"].update(uid="uid-broken", name="broken-0")
    cluster = {PODS: Resource([list_body("PodList", "100", [broken, other("running", "150")])])}
    with ReplayApiServer(cluster) as server:
        run = Run(server, kubelet_socket, tmp_path / "s.json", kueue=False).until(
            lambda r: "started" in by_job(r.events()).get("default/job/other", []))
    assert run.agent.skipped == 1 and set(by_job(run.events())) == {"default/job/other"}


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _ipv6_loopback(), reason="this host has no IPv6 loopback"))], ids=["ipv4", "ipv6"])
def test_device_ids_from_a_per_node_reporter(kubelet_socket, host):
    """Also on an IPv6-only node (its hostIP an IPv6 address): the reporter listens there, and the agent puts
    the address in brackets in the URL. Was: the reporter could not bind one (an IPv4 server), so every GPU pod
    there waited out the device wait and went without GPUs."""
    mapping = KubernetesMapping(cluster="k8s")
    with PodResourcesClient(str(kubelet_socket)) as client:
        server = serve_pod_resources((host, 0), client, mapping)
        try:
            port = server.server_address[1]
            source = DeviceSource(mapping, endpoint=f"http://{{host_ip}}:{port}/pod-resources")
            assert source.lookup("kube-worker-1", "default", "train-0", host) == {"nginx": [TRAIN_GPU]}
            assert source.lookup("kube-worker-1", "default", "nobody", host) is None
            assert source.lookup("kube-worker-2", "default", "x", None) is None      # no address: unknown
        finally:
            server.shutdown()


def test_spool_records_carry_their_topic_key_and_partition(tmp_path):
    from gpuledger.agents.spool import Forwarder, Spool, SpoolingPublisher

    assert decode_route(encode_route("t.job-events", "default/job/train", None)) == ("t.job-events", "default/job/train", None)
    kafka = ListPublisher()
    spool = Spool(tmp_path / "spool")
    forwarder = Forwarder(spool, RoutingPublisher(kafka), "gpuledger-kubernetes-agent")
    routes = SpooledRoutes(SpoolingPublisher(spool, forwarder))
    routes.publish("t.job-events", "job-a", b"event")
    for partition in (0, 1):
        routes.publish("t.job-events", None, b"mark", partition=partition)
    routes.publish("t.scheduler-snapshots", "k8s", b"snap")
    forwarder.pump()
    assert kafka.messages == [("t.job-events", b"job-a", b"event", None), ("t.job-events", None, b"mark", 0),
                              ("t.job-events", None, b"mark", 1), ("t.scheduler-snapshots", b"k8s", b"snap", None)]
    assert spool.depth == 0
    spool.close()


def test_an_unreachable_reporter_leaves_the_pod_waiting():
    source = DeviceSource(KubernetesMapping(cluster="k8s"), endpoint="http://127.0.0.1:9/pod-resources", timeout_s=1)
    assert source.lookup("kube-worker-1", "default", "train-0", "127.0.0.1") is None
    assert source.lookup("kube-worker-1", "default", "train-1", "127.0.0.1") is None   # asked once per cycle
    assert source.failures == 1


def test_without_kueue_installed_the_agent_goes_on_with_pods_alone(kubelet_socket, tmp_path):
    cluster = {PODS: Resource([list_body("PodList", "100", [train("running", "103")])])}   # Kueue paths: 404
    with ReplayApiServer(cluster) as server:
        run = Run(server, kubelet_socket, tmp_path / "s.json", kueue=True).until(lambda r: r.watermarks())
    assert run.agent.absent == {"localqueue", "clusterqueue", "workload"}
    assert by_job(run.events())["default/job/train"] == ["submitted", "allocated", "started"]


@pytest.mark.parametrize("text, address", [("0.0.0.0:9478", ("0.0.0.0", 9478)), (":9478", ("0.0.0.0", 9478)),
                                           ("[::]:9478", ("::", 9478)), ("[fd00::1]:80", ("fd00::1", 80)),
                                           (":::9478", ("::", 9478))])
def test_the_reporters_listen_address(text, address):
    assert listen_address(text) == address


@pytest.mark.parametrize("text", ["9478", "host:", "host:http", "[::]:99999", "[::1:9478"])
def test_a_bad_listen_address_is_refused_with_what_to_give(text):
    with pytest.raises(ValueError, match=r"give HOST:PORT, e.g. 0.0.0.0:9478 or \[::\]:9478"):
        listen_address(text)
