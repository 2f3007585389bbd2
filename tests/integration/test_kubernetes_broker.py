"""The Kubernetes agent on the real broker (Tansu): `gpuledger agent kubernetes` as a child process,
reading the replay API server (recorded objects; a dropped watch, a bookmark, a 410) and a kubelet
PodResources gRPC server, publishing through its disk spool; the topic read back. Then the agent's
events through the real worker and sink into chDB: a pod's allocated GPU-seconds."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from gpuledger.schemas.lines import Emission
from gpuledger.embedded.broker import free_port
from gpuledger.embedded.processes import ChildProcess, read_topic
from gpuledger.schemas.models import GpuSample, JobEvent, LifecycleWatermark, MigDevice, NodeTick, SchedulerSnapshot
from gpuledger.topics import create_topics
from kube.objects import ms, shift_times
from kube.podresources_server import FakeKubelet, PodResourcesServer
from kube.replay_server import ReplayApiServer, list_body
from kube.scenario import DEVICES, OTHER_MIG, PODS, TRAIN_GPU, recorded_cluster, train
from metrics_scrape import sample, scrape

pytestmark = pytest.mark.integration

EXPECTED = {
    "default/job/train": ["submitted", "queued", "allocated", "allocated", "started", "completed"],
    "default/job/other": ["submitted", "allocated", "started", "failed"],
}


def now_shifted_cluster(age_s: float = 20.0) -> tuple[dict, float]:
    """The recorded cluster with its times moved so that it happened `age_s` ago."""
    shift = time.time() - ms(0) / 1000 - age_s
    cluster = recorded_cluster()
    for resource in cluster.values():
        resource.lists = shift_times(resource.lists, shift)
        for session in resource.sessions:
            session.events = shift_times(session.events, shift)
    return cluster, shift


def messages(settings) -> tuple[list[dict], list[dict]]:
    values = [orjson.loads(v) for _, v in read_topic(settings, settings.topics.job_events)]
    return [v for v in values if v.get("type") == "job_event"], [v for v in values if v.get("type") == "watermark"]


def by_job(events):
    out: dict[str, list[str]] = {}
    for e in sorted(events, key=lambda e: (e["ts_ms"], int(e["event_id"].split("/")[-2]))):
        out.setdefault(e["job_id"], []).append(e["kind"])
    return out


def wait_for(check, timeout_s: float, agent: ChildProcess):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agent.check_alive()
        if check():
            return
        time.sleep(1.0)
    raise AssertionError("timed out")


def test_the_agent_process_publishes_each_event_once_to_the_broker(make_settings, broker, tmp_path):
    with tempfile.TemporaryDirectory(prefix="pr-") as sockdir:
        sock = Path(sockdir) / "kubelet.sock"
        settings = make_settings(kafka_bootstrap=broker.bootstrap, kubernetes_watch_timeout_s=1.0,
                                 kubernetes_snapshot_interval_s=1.0, kubernetes_allowed_lateness_s=120.0,
                                 cluster="k8s", agent_spool_fsync="never")
        create_topics(settings)
        cluster, shift = now_shifted_cluster()
        args = ("agent", "kubernetes", "--node", "kube-worker-1", "--pod-resources-socket", str(sock))
        port = free_port()
        with PodResourcesServer(sock, FakeKubelet(DEVICES)), ReplayApiServer(cluster) as api:
            agent = ChildProcess(settings, *args, "--api-server", api.url, "--metrics-port", str(port),
                                 log_path=tmp_path / "agent.log").start()
            try:
                wait_for(lambda: by_job(messages(settings)[0]) == EXPECTED and messages(settings)[1], 90, agent)
                # its /metrics: what it published, from its spool, and the watermark it holds. The spool
                # drains: nothing waits in it for long. Not "the spool is empty": the agent appends a
                # snapshot or watermark every ~0.3 s, so under load an empty spool at the instant of a
                # scrape may never come (a CI run saw 30 scrapes in a row with records in flight)
                wait_for(lambda: sample(scrape(port), "gpuledger_agent_spool_oldest_age_seconds",
                                        node="kubernetes-agent-k8s") < 5, 30, agent)
                families = scrape(port)
            finally:
                assert agent.stop() == 0
            own = {"agent": "kubernetes", "cluster": "k8s"}
            assert sample(families, "gpuledger_scheduler_events_published_total", **own) == sum(map(len, EXPECTED.values()))
            assert sample(families, "gpuledger_scheduler_watch_relists_total", **own) == 1       # the 410
            assert sample(families, "gpuledger_scheduler_watch_reconnects_total", **own) >= 1    # the dropped watch
            assert 120 <= sample(families, "gpuledger_scheduler_watermark_age_seconds", **own) < 150  # the lateness
            assert sample(families, "gpuledger_scheduler_state_bytes_written_total", **own) > 0  # its state file
            assert sample(families, "gpuledger_agent_messages_published_total", node="kubernetes-agent-k8s") > 0
            assert api.watch_versions(PODS)[:3] == ["100", "102", "200"]
            events, marks = messages(settings)
            # restarted with its state file: nothing repeated, watermarks go on
            api.resources[PODS].lists = [list_body("PodList", "300", [shift_times(train("succeeded", "201"), shift)])]
            api.resources[PODS].sessions = []
            again = ChildProcess(settings, *args, "--api-server", api.url, log_path=tmp_path / "agent2.log").start()
            try:
                wait_for(lambda: len(messages(settings)[1]) > len(marks), 60, again)
            finally:
                assert again.stop() == 0
        events_after, marks_after = messages(settings)
    assert len({e["event_id"] for e in events}) == len(events) == sum(map(len, EXPECTED.values()))
    key = lambda e: e["event_id"]  # noqa: E731 (partitions are read in no particular interleaving)
    assert sorted(events_after, key=key) == sorted(events, key=key)
    train_ts = [e["ts_ms"] for e in events if e["job_id"] == "default/job/train"]
    assert sorted(train_ts) == [round((ms(t) / 1000 + shift) * 1000) // 1000 * 1000 for t in (-60, 0, 0, 4, 4, 60)]
    per_mark = Counter(m["ts_ms"] for m in marks_after)
    assert set(per_mark.values()) == {settings.partitions_job_events}     # every watermark on every partition
    snapshots = [orjson.loads(v) for _, v in read_topic(settings, settings.topics.scheduler_snapshots)]
    assert snapshots and snapshots[0]["queues"][0]["queue"] == "cluster-queue"


def test_a_pods_gpu_seconds_through_worker_and_sink(make_settings, tmp_path):
    """The events the agent derives from the recorded cluster, with one node's GPU samples, through
    the real pipeline (Tansu, Faust worker, sink, chDB)."""
    from gpuledger.embedded.pipeline import run_embedded
    from gpuledger.warehouse import connect
    from kube.harness import Run

    with tempfile.TemporaryDirectory(prefix="pr-") as sockdir:
        sock = Path(sockdir) / "kubelet.sock"
        with PodResourcesServer(sock, FakeKubelet(DEVICES)), ReplayApiServer(recorded_cluster()) as api:
            run = Run(api, sock, tmp_path / "state.json").until(
                lambda r: by_job(r.events()) == EXPECTED and r.snapshots())
    out = [Emission("job-events", e.job_id, e) for e in map(JobEvent.model_validate, run.events())]
    out.append(Emission("scheduler-snapshots", "k8s", SchedulerSnapshot.model_validate(run.snapshots()[0])))
    parent = "GPU-3f6c2a10-7d4e-4b1a-9e2f-5a6b7c8d9e0f"
    start, interval = ms(-10), 5_000
    ticks = [start + k * interval for k in range(20)]                    # T0-10 s .. T0+90 s
    for ts in ticks:
        out.append(Emission("gpu-samples", "kube-worker-1", NodeTick(cluster="k8s", node="kube-worker-1", ts_ms=ts,
                                                                     interval_ms=interval, gpus=[
            GpuSample(gpu_uuid=TRAIN_GPU, index=0, model="A100-80GB", util_gpu_pct=80.0, power_w=300.0),
            GpuSample(gpu_uuid=parent, index=1, model="A100-80GB", util_gpu_pct=50.0, power_w=200.0,
                      mig_devices=[MigDevice(uuid=OTHER_MIG, profile="3g.40gb", share_milli=428)])])))
        out.append(Emission("job-events", None, LifecycleWatermark(cluster="k8s", ts_ms=ts)))
    out.append(Emission("job-events", None, LifecycleWatermark(cluster="k8s", ts_ms=ticks[-1] + 2 * interval)))
    order = {"job-events": 0, "scheduler-snapshots": 1, "gpu-samples": 2}
    out.sort(key=lambda e: (e.message.ts_ms, order[e.line], e.key is None))
    settings = make_settings(data_dir=tmp_path / "pipeline")
    run_embedded(settings, out, log=lambda text: None, timeout_s=300)
    client = connect(settings)
    try:
        rows = client.query("SELECT job_id, state, gpu_uuid, sum(gpu_ms) FROM usage_raw WHERE job_id != '' "
                            "GROUP BY job_id, state, gpu_uuid ORDER BY job_id, state").result_rows
    finally:
        client.close()
    assert rows == [
        ("default/job/other", "allocated_idle", parent, 4_000 * 428 // 1000),    # T+10 .. T+14, 3g.40gb of 7
        ("default/job/other", "executing", parent, 36_000 * 428 // 1000),        # T+14 .. T+50
        ("default/job/train", "allocated_idle", TRAIN_GPU, 4_000),               # scheduled T0, started T+4
        ("default/job/train", "executing", TRAIN_GPU, 56_000),                   # T+4 .. T+60
    ]
