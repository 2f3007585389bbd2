"""Edge cases of the Kubernetes core (agents/kubernetes.py, and where the verdict is the worker's, through
the real WorkerCore): time-sliced replicas of one GPU in one attempt, a pod the kubelet lists before its
devices are allocated, an object found malformed part-way, replica shares that must add up to one GPU,
and a Workload deleted while it waits in the queue."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import orjson
import pytest

from gpuledger.agents.kubernetes import JOB_RETENTION_MS, KubernetesLedger, KubernetesMapping, parse_device_id
from gpuledger.agents.kubernetes_agent import DeviceSource, KubernetesAgent
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import JobEventKind as K
from gpuledger.schemas.wire import encode
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.topic_names import TopicNames
from kube.objects import at, at_time, gpu_pod, kinds, local_queue, ms, workload

UUID = "GPU-8d0e2fb4-1c4a-4d0d-9c8e-6f3f2a1b0c11"
MIG = "MIG-1a2b3c4d-0000-5555-aaaa-0123456789ab"
NOW = ms(1000)
TOPICS = TopicNames.with_prefix("t.")
UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults


def devices(table: dict):
    """A PodResources view: (node, namespace, pod) -> {container: [device ids]}."""
    return lambda node, ns, name, host_ip: table.get((node, ns, name))


def ledger(**kw) -> KubernetesLedger:
    return KubernetesLedger(KubernetesMapping(cluster="k8s", **kw))


def dead_letters(events) -> list[str]:
    """What the real worker dead-letters of these lifecycle events, by reason."""
    worker = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1,
                        ledger=load_ledger_config(UNIT_LEDGER))
    reasons = []
    for offset, event in enumerate(events):
        for out in worker.on_lifecycle(0, offset, encode(event), now_ms=NOW):
            if out.topic == TOPICS.dead_letters:
                reasons.append(orjson.loads(out.value)["reason"])
    return reasons


# --------------------------------------------------------------------------- replicas of one GPU in one attempt
@pytest.mark.parametrize("device", [UUID, MIG])
def test_replicas_of_one_device_in_two_pods_of_an_attempt_are_one_assignment(device):
    core = ledger(time_slicing_replicas=4)
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [f"{device}::0"]},
                      ("kube-worker-1", "default", "train-1"): {"nginx": [f"{device}::1"]}})
    other = dict(name="train-1", uid="uid-1", container_id="containerd://bbbbbb")
    events = core.observe_pod(gpu_pod("train-0", "uid-0", stage="running"), NOW, lookup)
    events += core.observe_pod(gpu_pod(stage="running", **other), NOW, lookup)
    events += core.observe_pod(gpu_pod("train-0", "uid-0", stage="succeeded"), NOW, lookup)
    events += core.observe_pod(gpu_pod(stage="succeeded", **other), NOW, lookup)
    assert dead_letters(events) == []                  # the worker refuses an event listing a GPU twice
    allocated = [[(g.gpu_uuid, g.share_milli) for g in e.gpus] for e in events if e.kind == K.allocated]
    assert allocated == [[(device, 250)], [(device, 500)], [(device, 250)]]


def test_replicas_of_one_gpu_in_two_containers_of_a_pod_are_one_assignment():
    core = ledger(time_slicing_replicas=4)
    pod = gpu_pod(stage="running")
    side = copy.deepcopy(pod["spec"]["containers"][0])
    side["name"] = "side"
    pod["spec"]["containers"].append(side)
    status = copy.deepcopy(pod["status"]["containerStatuses"][0])
    status.update(name="side", containerID="containerd://cccccc")
    pod["status"]["containerStatuses"].append(status)
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [f"{UUID}::0"], "side": [f"{UUID}::1"]}})
    events = core.observe_pod(pod, NOW, lookup)
    assert kinds(events) == ["submitted", "allocated", "started"] and dead_letters(events) == []
    (alloc,) = [e for e in events if e.kind == K.allocated]
    nginx = pod["status"]["containerStatuses"][0]["containerID"].split("://")[1]     # the first container's
    assert [(g.gpu_uuid, g.share_milli, g.container_id) for g in alloc.gpus] == [(UUID, 500, nginx)]


# --------------------------------------------------------------------------- listed before its devices
def test_a_pod_listed_without_device_ids_waits_for_them():
    """The kubelet lists a pod before admission runs the device plugin's Allocate: no ids yet."""
    core = ledger(device_wait_ms=60_000)
    listed = devices({("kube-worker-1", "default", "train-0"): {}})
    assert kinds(core.observe_pod(gpu_pod(stage="scheduled"), NOW, listed)) == ["submitted"]
    assert core.waiting_count() == 1 and core.watermark(NOW + 10_000).ts_ms == ms(0)
    allocated = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    events = core.observe_pod(core.waiting_pods()[0], NOW + 5_000, allocated)
    assert kinds(events) == ["allocated"] and [g.gpu_uuid for g in events[0].gpus] == [UUID]


def test_a_pod_listed_without_device_ids_gives_up_after_the_wait(caplog):
    core = ledger(device_wait_ms=60_000)
    listed = devices({("kube-worker-1", "default", "train-0"): {"nginx": []}})
    core.observe_pod(gpu_pod(stage="scheduled"), NOW, listed)
    assert core.observe_pod(gpu_pod(stage="scheduled"), NOW + 30_000, listed) == []
    with caplog.at_level(logging.WARNING):
        late = core.observe_pod(gpu_pod(stage="scheduled"), NOW + 60_000, listed)
    assert kinds(late) == ["allocated"] and late[0].gpus == [] and core.waiting_pods() == []
    assert "no device ids for pod default/train-0" in caplog.text


def test_device_ids_found_after_the_wait_are_sent_with_the_pods_next_update():
    """The node's reporter was away for longer than the wait (restarted, or the node's network): the
    pod went out without GPUs. Before, its later updates (its container starting, a relist after the
    agent's restart) never looked again, so all its GPU time, for hours, was billed to nobody."""
    core = ledger(device_wait_ms=60_000)
    unreachable = devices({})
    core.observe_pod(gpu_pod(stage="scheduled"), NOW, unreachable)
    assert core.observe_pod(gpu_pod(stage="scheduled"), NOW + 60_000, unreachable)[0].gpus == []
    core.watermark(NOW + 70_000)
    back = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    events = core.observe_pod(gpu_pod(stage="running", started=100), NOW + 100_000, back)
    assert kinds(events) == ["allocated", "started"]
    assert [g.gpu_uuid for g in events[0].gpus] == [UUID] and events[0].gpus[0].container_id
    assert events[0].ts_ms == core.watermark_ms      # the earliest time the ledger still takes
    # found once: later updates change nothing, and a pod that has ended is not looked up again
    assert core.observe_pod(gpu_pod(stage="running", started=100), NOW + 110_000, back) == []
    ended = core.observe_pod(gpu_pod(stage="succeeded", started=100, finished=200), NOW + 200_000, back)
    assert kinds(ended) == ["completed"]


# --------------------------------------------------------------------------- malformed part-way
def test_a_pod_found_malformed_part_way_leaves_no_trace():
    core = ledger()
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    bad = gpu_pod(stage="running")
    bad["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "soon"   # not RFC 3339
    with pytest.raises(ValueError, match="not RFC 3339"):
        core.observe_pod(bad, NOW, lookup)
    assert core.jobs == {} and core.pods == {} and core.waiting_count() == 0
    events = core.observe_pod(gpu_pod(stage="running"), NOW, lookup)
    events += core.observe_pod(gpu_pod(stage="succeeded"), NOW, lookup)
    assert kinds(events) == ["submitted", "allocated", "started", "completed"]
    reference = ledger()                                                # as if the bad version never came
    assert events == (reference.observe_pod(gpu_pod(stage="running"), NOW, lookup)
                      + reference.observe_pod(gpu_pod(stage="succeeded"), NOW, lookup))


def test_a_known_pod_found_malformed_part_way_is_kept_as_it_was():
    core = ledger()
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    core.observe_pod(gpu_pod(stage="scheduled"), NOW, lookup)
    before = core.to_state()
    bad = gpu_pod(stage="succeeded")
    bad["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = "later"   # read last
    with pytest.raises(ValueError, match="not RFC 3339"):
        core.observe_pod(bad, NOW, lookup)
    assert core.to_state() == before
    reference = ledger()
    reference.observe_pod(gpu_pod(stage="scheduled"), NOW, lookup)
    expected = reference.observe_pod(gpu_pod(stage="succeeded"), NOW, lookup)
    assert kinds(expected) == ["allocated", "started", "completed"]               # now with its container id
    assert core.observe_pod(gpu_pod(stage="succeeded"), NOW, lookup) == expected


def test_a_workload_found_malformed_part_way_leaves_no_trace():
    core = ledger()
    core.observe_local_queue(local_queue())
    bad = workload(status="pending")
    bad["status"]["conditions"][0]["lastTransitionTime"] = "soon"
    with pytest.raises(ValueError, match="not RFC 3339"):
        core.observe_workload(bad, NOW)
    assert core.jobs == {} and core.workloads == {}
    assert kinds(core.observe_workload(workload(status="pending"), NOW)) == ["submitted", "queued"]


def agent_without_devices() -> KubernetesAgent:
    mapping = KubernetesMapping(cluster="k8s", devices_expected=False)
    return KubernetesAgent(KubernetesLedger(mapping), None, job_events_topic="e", snapshots_topic="s",
                           job_event_partitions=1, devices=DeviceSource(mapping), state_path=None)


def test_the_agent_keeps_the_last_good_object_of_a_skipped_one():
    """A relist that misses the pod then ends it from the version the core took, not the bad one."""
    agent = agent_without_devices()
    assert kinds(agent._apply("pod", "ADDED", gpu_pod(stage="running"))) == ["submitted", "allocated", "started"]
    bad = gpu_pod(stage="running")
    bad["status"]["conditions"] = "Ready"
    assert agent._apply("pod", "MODIFIED", bad) == [] and agent.skipped == 1
    assert [(e.kind.value, e.reason) for e in agent._sync("pod", [])] == [("cancelled", "deleted")]
    assert agent.skipped == 1


# --------------------------------------------------------------------------- replica shares
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 7, 10])
def test_the_replicas_of_a_device_add_up_to_the_whole_device(replicas):
    mapping = KubernetesMapping(cluster="c", time_slicing_replicas=replicas)
    shares = [parse_device_id(f"{UUID}::{n}", mapping)[2] for n in range(replicas)]
    assert sum(shares) == 1000 and max(shares) - min(shares) <= 1


def test_three_pods_on_three_replicas_hold_the_whole_gpu():
    core = ledger(time_slicing_replicas=3)
    lookup = devices({("kube-worker-1", "default", f"p{n}"): {"nginx": [f"{UUID}::{n}"]} for n in range(3)})
    shares = [g.share_milli for n in range(3)
              for e in core.observe_pod(gpu_pod(f"p{n}", f"uid-p{n}", job=f"j{n}"), NOW, lookup)
              if e.kind == K.allocated for g in e.gpus]
    assert shares == [333, 333, 334]


# --------------------------------------------------------------------------- Workload deleted in the queue
def test_a_workload_deleted_while_queued_cancels_its_attempt_and_the_job_is_pruned():
    core = ledger()
    core.observe_local_queue(local_queue())
    pending = workload(status="pending")
    assert kinds(core.observe_workload(pending, NOW)) == ["submitted", "queued"]
    pending["metadata"]["deletionTimestamp"] = "2024-03-21T14:00:00Z"
    events = core.workload_deleted(pending, NOW)
    assert kinds(events) == ["cancelled"]
    cancelled = events[0]
    assert (cancelled.kind, cancelled.reason, cancelled.attempt) == (K.cancelled, "deleted", 0)
    assert cancelled.ts_ms == 1711029600000                     # the deletion, not the agent's clock
    assert core.workload_deleted(pending, NOW) == []             # seen again (a relist): nothing more
    core.watermark(cancelled.ts_ms + JOB_RETENTION_MS + 60_000)
    assert core.jobs == {}


def test_a_workload_deleted_after_an_eviction_cancels_the_requeued_attempt():
    core = ledger()
    core.observe_local_queue(local_queue())
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    events = core.observe_workload(at_time(workload(status="admitted"), -30), NOW)
    events += core.observe_pod(gpu_pod(stage="running"), NOW, lookup)
    evicted = at_time(workload(status="preempted"), 100)
    events += core.observe_workload(evicted, NOW)
    events += core.pod_deleted(gpu_pod(stage="deleting"), NOW, lookup)
    events += core.observe_workload(evicted, NOW)
    assert kinds(events)[-3:] == ["preempted", "retried", "queued"]
    events = core.workload_deleted(evicted, NOW)                  # no deletionTimestamp: the agent's clock
    assert kinds(events) == ["cancelled"]
    cancelled = events[0]
    assert (cancelled.kind, cancelled.reason, cancelled.attempt, cancelled.ts_ms) == (K.cancelled, "deleted", 1, NOW)
    assert core.jobs["default/job/train"].attempt_ended


def test_a_finished_workload_or_one_with_live_pods_ends_nothing_when_deleted():
    core = ledger()
    core.observe_local_queue(local_queue())
    core.observe_workload(workload(status="admitted"), NOW)
    lookup = devices({("kube-worker-1", "default", "train-0"): {"nginx": [UUID]}})
    core.observe_pod(gpu_pod(stage="running"), NOW, lookup)
    assert core.workload_deleted(workload(status="admitted"), NOW) == []   # its pods end the attempt
    finished = workload(name="other", uid="uid-other", job="other", status="pending")
    core.observe_workload(finished, NOW)
    finished["status"]["conditions"].append({"type": "Finished", "status": "True", "reason": "JobFinished",
                                             "lastTransitionTime": "2024-03-21T14:00:00Z"})
    assert core.workload_deleted(finished, NOW) == []



def test_the_agent_sends_the_cancel_of_a_workload_deleted_in_the_queue():
    agent = agent_without_devices()
    agent.clock = lambda: NOW / 1000
    assert kinds(agent._apply("workload", "ADDED", workload(status="pending"))) == ["submitted", "queued"]
    agent.dirty = False
    assert kinds(agent._apply("workload", "DELETED", workload(status="pending"))) == ["cancelled"]
    assert agent.dirty and agent.skipped == 0                   # the state that ended the attempt is saved


# --------------------------------------------------------------------------- sidecar holding a GPU
def with_gpu_sidecar(pod: dict, *, started: int = 3) -> dict:
    """The pod with its GPU moved to a sidecar: an init container with `restartPolicy: Always` (the
    Pod API's sidecar, Kubernetes 1.29+), which runs beside the main containers for the pod's life
    and whose status is in `initContainerStatuses`. The kubelet's PodResources lists its devices."""
    main = pod["spec"]["containers"][0]["resources"]
    for part in ("limits", "requests"):
        main[part].pop("nvidia.com/gpu")
    pod["spec"]["initContainers"] = [{"name": "gpu-sidecar", "image": "nginx", "restartPolicy": "Always",
                                      "resources": {"limits": {"nvidia.com/gpu": "1"},
                                                    "requests": {"nvidia.com/gpu": "1"}}}]
    pod["status"]["initContainerStatuses"] = [{
        "name": "gpu-sidecar", "image": "nginx", "imageID": "", "ready": True, "restartCount": 0, "started": True,
        "containerID": "containerd://51decafe", "state": {"running": {"startedAt": at(started)}}}]
    return pod


def test_a_gpu_held_by_a_sidecar_container_is_billed():
    # before: the pod asked for no GPU as far as the agent saw (spec.containers only), so it was
    # ignored: its GPU time billed to nobody
    core = ledger()
    table = devices({("kube-worker-1", "default", "train-0"): {"gpu-sidecar": [UUID]}})
    events = core.observe_pod(with_gpu_sidecar(gpu_pod(stage="running")), NOW, table)
    assert kinds(events) == ["submitted", "allocated", "started"]
    assert events[0].requested_gpus == 1
    (gpu,) = events[1].gpus
    assert gpu.gpu_uuid == UUID and gpu.container_id == "51decafe"   # matched to the sidecar's processes
    assert events[2].ts_ms == ms(3)                                    # the sidecar started first


# --------------------------------------------------------------------------- a relist's order
class KubeletOf(DeviceSource):
    """The kubelets' PodResources: only pods still running are listed."""

    def __init__(self, table: dict):
        super().__init__(KubernetesMapping(cluster="k8s"))
        self.table = table

    def lookup(self, node, namespace, name, host_ip):
        return self.table.get(name)


def relisted_pod(name: str, stage: str, created: int, started: int, finished: int = 60) -> dict:
    return gpu_pod(name, f"uid-{name}", stage=stage, created=created, started=started, finished=finished)


def test_a_relist_applies_the_pods_changes_in_time_order_not_in_the_lists_name_order():
    """Job `train` ran train-a and train-c when the agent stopped; meanwhile train-c ended at 50 s, train-b was
    scheduled at 50 s and train-a ended at 100 s. The relist lists them by name (a, b, c): taken in that order,
    train-a's end moved the job's clock to 100 s, so train-c's GPU was billed until 100 s and train-b's only from
    100 s (each change clamped to the job's last). Taken in time order, each GPU is held as it was."""
    core = KubernetesLedger(KubernetesMapping(cluster="k8s"))
    table = {"train-a": {"nginx": ["GPU-a"]}, "train-b": {"nginx": ["GPU-b"]}, "train-c": {"nginx": ["GPU-c"]}}
    for name in ("train-a", "train-c"):
        core.observe_pod(relisted_pod(name, "running", 0, 4), ms(10), lambda n, ns, name, ip: table.get(name))
    core.watermark(ms(40))
    agent = KubernetesAgent(KubernetesLedger(KubernetesMapping(cluster="k8s"), orjson.loads(orjson.dumps(core.to_state()))),
                            None, job_events_topic="e", snapshots_topic="s", job_event_partitions=1,
                            devices=KubeletOf({"train-b": table["train-b"]}), state_path=None, clock=lambda: ms(200) / 1000)
    events = agent._sync("pod", [relisted_pod("train-a", "succeeded", 0, 4, 100),
                                 relisted_pod("train-b", "running", 50, 52), relisted_pod("train-c", "succeeded", 0, 4, 50)])
    held = [(e.ts_ms - ms(0), sorted(g.gpu_uuid for g in e.gpus)) for e in events if e.kind == K.allocated]
    assert held[-2:] == [(50_000, ["GPU-a", "GPU-b"]), (100_000, ["GPU-b"])] and all(t == 50_000 for t, _ in held[:-1])
    assert agent.core.clamped == 0


def test_a_first_list_with_an_ended_pod_and_its_running_sibling_keeps_them_one_attempt():
    """The agent's first list holds train-a (ran 0–100 s) and train-b (scheduled at 10 s, running): by name,
    train-a ended the attempt at 100 s before train-b was read, which then opened attempt 1 at 100 s (90 s
    lost). In time order train-b joins the attempt at 10 s and the attempt goes on after train-a's end."""
    agent = agent_without_devices()
    events = agent._sync("pod", [relisted_pod("train-a", "succeeded", 0, 4, 100), relisted_pod("train-b", "running", 10, 14)])
    assert [(e.kind.value, e.attempt, e.ts_ms - ms(0)) for e in events] == [
        ("submitted", 0, 0), ("allocated", 0, 0), ("started", 0, 4_000)]
    assert agent.core.clamped == 0
