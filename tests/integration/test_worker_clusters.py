"""The real worker on Tansu with three clusters: a job is (cluster, job id), a node is (cluster, node)
(c1 and c2 both have an n1), and a lifecycle watermark promises one cluster's events only
(tests/unit/test_router_clusters.py has the details)."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from confluent_kafka import Producer

from gpuledger.embedded.broker import free_port
from gpuledger.embedded.processes import ChildProcess, read_topic, wait_until_caught_up
from gpuledger.schemas.models import DeadLetter, GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick
from gpuledger.schemas.wire import decode, encode, encode_node_ticks
from gpuledger.topics import create_topics
from usage_reader import usage_until

pytestmark = pytest.mark.integration

T0 = 1_793_577_600_000
S = 1000
NODES = {"c1": ("n1", "GPU-a"), "c2": ("n1", "GPU-b"), "c3": ("n3", "GPU-c")}  # two clusters' n1


def ev(cluster, kind, at_s, job="1001"):
    node, gpu = NODES[cluster]
    return JobEvent(event_id=f"slurm:{cluster}:{job}:0:{kind}", ts_ms=T0 + at_s * S, kind=kind, cluster=cluster,
                    job_id=job, tenant=f"tenant-{cluster}", queue="q", requested_gpus=1,
                    gpus=[GpuAssignment(node=node, gpu_uuid=gpu)] if kind == "allocated" else [])


def messages_in(port: int, topic: str) -> float:
    import re
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:  # the worker's metrics endpoint not up yet
        return 0.0
    found = re.search(r'gpuledger_messages_in_total\{component="worker",topic="%s"\} (\S+)' % re.escape(topic), text)
    return float(found.group(1)) if found else 0.0


def test_same_job_id_in_two_clusters_and_one_clusters_agent_spooling(broker, make_settings, tmp_path):
    # c3's ticks wait in memory for c3's watermark (not paused: so that they are read either way)
    port = free_port()
    settings = make_settings(kafka_bootstrap=broker.bootstrap, worker_samples_ahead_s=3600.0, worker_metrics_port=port)
    create_topics(settings)
    t = settings.topics
    producer = Producer({**settings.kafka_client_config(), "partitioner": "murmur2_random"})

    def marks(clusters, at_s):  # what each scheduler agent sends: to every job-events partition
        for cluster in clusters:
            for p in range(settings.partitions_job_events):
                producer.produce(t.job_events, partition=p, value=encode(LifecycleWatermark(cluster=cluster, ts_ms=T0 + at_s * S)))

    def events(evs):  # with the agents' key, the bare job id
        for e in evs:
            producer.produce(t.job_events, key=e.job_id.encode(), value=encode(e))

    with ChildProcess(settings, "worker", log_path=tmp_path / "worker.log") as worker:
        # c3's agent promised everything before T0, then spools through an outage; c1's and c2's run
        marks(["c3"], 0)
        events([ev("c1", "allocated", 0), ev("c1", "started", 0), ev("c1", "completed", 30),
                ev("c2", "allocated", 40), ev("c2", "started", 40), ev("c2", "completed", 140)])
        for k in range(30):
            for cluster, (node, gpu) in NODES.items():
                producer.produce(t.gpu_samples, key=node.encode(), value=encode_node_ticks(node, [NodeTick(
                    cluster=cluster, node=node, ts_ms=T0 + 10 * S * k, interval_ms=10 * S,
                    gpus=[GpuSample(gpu_uuid=gpu, index=0, model="A100-80GB", power_w=300.0, util_gpu_pct=90.0)])]))
        marks(["c1", "c2"], 300)
        assert producer.flush(30) == 0
        # every sample read and every watermark applied (ticks waiting hold the samples' commit back)
        deadline = time.monotonic() + 120
        while messages_in(port, t.gpu_samples) < 30 * len(NODES):
            assert worker.proc.poll() is None and time.monotonic() < deadline, "the worker did not read the samples"
            time.sleep(0.2)
        wait_until_caught_up(settings, settings.worker_app_id, [t.job_events, t.node_allocations],
                             timeout_s=120, alive=worker)
        # c3's agent is back: its spooled events, then every agent's watermark
        events([ev("c3", "allocated", 0, job="train-7"), ev("c3", "started", 0, job="train-7")])
        marks(["c1", "c2", "c3"], 3600)
        assert producer.flush(30) == 0
        wait_until_caught_up(settings, settings.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                             timeout_s=120, alive=worker)
        records = usage_until(settings, 3 * 300_000, timeout_s=60.0)

    by = defaultdict(int)
    for r in records:
        by[(r.cluster, r.state.value, r.job_id, r.tenant)] += r.gpu_ms // 1000
    assert by[("c1", "executing", "1001", "tenant-c1")] == 30, dict(by)
    assert by[("c2", "executing", "1001", "tenant-c2")] == 100, dict(by)
    assert by[("c3", "executing", "train-7", "tenant-c3")] == 300, dict(by)
    assert sum(r.gpu_ms for r in records) == 3 * 300_000
    assert [decode(DeadLetter, v).reason for _, v in read_topic(settings, t.dead_letters)] == []
    assert [decode(DeadLetter, v).reason for _, v in read_topic(settings, t.late_events)] == []
