"""The watcher on the real broker (Tansu): `gpuledger watch` reads the ledger's usage output, the
accepted lifecycle events and the scheduler snapshots, and publishes the exact alerts and reclaim
suggestions worked out in docs/alerts.md; a restart resumes from its snapshot without publishing
anything twice; `gpuledger tail alerts` prints them.

The inputs are published phase by phase (lifecycle, then the usage the worker would emit after
them), as the worker orders them in production: its usage waits for the lifecycle watermark."""

from __future__ import annotations

import io
import subprocess
import sys
import zlib

import orjson
import pytest
from confluent_kafka import Producer

from gpuledger.embedded.processes import ChildProcess, read_topic, settings_env, wait_until_caught_up
from gpuledger.schemas.models import (
    Alert,
    JobEvent,
    PendingByPriority,
    QueueState,
    ReclaimSuggestion,
    SchedulerSnapshot,
    UsageRecord,
)
from gpuledger.schemas.wire import encode
from gpuledger.sink.loop import run_sink
from gpuledger.topics import create_topics
from gpuledger.warehouse import connect
from gpuledger.warehouse.periodic import commands as periodic
from gpuledger.warehouse.reports import fetch
from gpuledger.streams.app import read_last_snapshot
from gpuledger.watch import tail_alerts, watch_group, watch_inputs

pytestmark = pytest.mark.integration

MIN = 60_000
T0 = 29_893_000 * MIN  # 2026-11-02T00:40:00Z
GIB = 1 << 30


def record(gpu, start, *, state="executing", job="train-1", util=90.0, queue="batch", cost=0):
    return UsageRecord(
        record_id=f"{gpu}/{start}/0", cluster="c1", node="n1", gpu_uuid=gpu, gpu_model="A100-80GB", start_ms=start,
        end_ms=start + MIN, state=state, job_id=job, attempt=0, tenant="acme", queue=queue, share_milli=1000,
        gpu_ms=MIN, util_pct=util, mem_used_bytes=10 * GIB, coefficient=2.3, coefficient_version="A100-80GB@2020-01-01",
        effective_gpu_ms=round(2.3 * MIN), cost_micros=cost, definition_version="defaults-test",
        ).model_dump(mode="json")


def event(kind, minute, job="train-1"):
    return JobEvent(event_id=f"{job}-{kind}-{minute}", ts_ms=T0 + minute * MIN, kind=kind, cluster="c1", job_id=job,
                    tenant="acme", queue="batch")


#: (topic, partition) -> offset after the last message the broker acknowledged. Tansu reports a
#: partition's end as its last batch's start + 1, so the tests judge "all read" by what they sent.
DELIVERED: dict[tuple[str, int], int] = {}


def _delivered(err, msg) -> None:
    assert err is None, err
    key = (msg.topic(), msg.partition())
    DELIVERED[key] = max(DELIVERED.get(key, 0), msg.offset() + 1)


def publish(settings, messages) -> None:
    producer = Producer(settings.kafka_client_config())
    for topic, key, value in messages:
        producer.produce(topic, key=key, value=value, on_delivery=_delivered)
    assert producer.flush(30) == 0


def lifecycle(settings, *events):
    publish(settings, [(settings.topics.lifecycle_accepted, e.job_id.encode(), encode(e)) for e in events])


def usage(settings, minutes, records_of):
    publish(settings, [(settings.topics.usage, b"n1", orjson.dumps({"schema_version": 1, "node": "n1",
                                                                    "records": records_of(T0 + m * MIN, m)}))
                       for m in minutes])


def watch(settings) -> dict:
    """Run `gpuledger watch` (the Faust process) until it has acknowledged all of its input, i.e.
    until a durable snapshot covers it; stop it; return that snapshot."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with ChildProcess(settings, "watch", log_path=settings.data_dir / "watch.log") as proc:
        wait_until_caught_up(settings, watch_group(settings), watch_inputs(settings), alive=proc, timeout_s=120,
                             known_ends=dict(DELIVERED))
    return orjson.loads(zlib.decompress(read_last_snapshot(settings, 0, topic=settings.topics.watch_state)))


def end_offsets(settings) -> dict[str, dict[str, int]]:
    """What was sent to the watcher's inputs, as its snapshot's `next_offsets` spells it."""
    ends: dict[str, dict[str, int]] = {}
    for (topic, partition), end in DELIVERED.items():
        if topic in watch_inputs(settings):
            ends.setdefault(topic, {})[str(partition)] = end
    return ends


def alerts(settings) -> list[Alert]:
    return [Alert.model_validate_json(v) for _, v in read_topic(settings, settings.topics.alerts)]


def test_load_train_checkpoint_hang_recover(settings):
    create_topics(settings)
    lifecycle(settings, event("allocated", 0), event("started", 0), event("checkpoint_begin", 45),
              event("checkpoint_end", 50))
    watch(settings)

    def phase(m):  # load, train, checkpoint, hang (memory held), train again
        return 5.0 if m < 15 else 95.0 if m < 45 else 30.0 if m < 50 else 0.0 if m < 70 else 95.0

    usage(settings, range(0, 55), lambda t, m: [record(g, t, util=phase(m)) for g in ("GPU-a", "GPU-b")])
    # the watch process, stopped once a snapshot covers its input
    snapshot = watch(settings)
    assert snapshot["next_offsets"] == end_offsets(settings)  # the snapshot covers every input message
    assert alerts(settings) == []  # nothing yet: the checkpoint is no drop, the hang is 5 min old
    # restarted from its snapshot: the rest of the job
    usage(settings, range(55, 80), lambda t, m: [record(g, t, util=phase(m)) for g in ("GPU-a", "GPU-b")])
    assert watch(settings)["next_offsets"] == end_offsets(settings)  # resumed from its snapshot, read the rest
    lifecycle(settings, event("completed", 80))
    watch(settings)
    got = [(a.rule, a.status, a.opened_at_ms - T0, (a.closed_at_ms or T0) - T0, a.gpus) for a in alerts(settings)]
    assert got == [("util_drop", "open", 60 * MIN, 0, ["GPU-a", "GPU-b"]),
                   ("hung", "open", 60 * MIN, 0, ["GPU-a", "GPU-b"]),
                   ("util_drop", "closed", 60 * MIN, 75 * MIN, ["GPU-a", "GPU-b"]),
                   ("hung", "closed", 60 * MIN, 75 * MIN, ["GPU-a", "GPU-b"])]
    opened, closed = alerts(settings)[0], alerts(settings)[2]
    assert opened.alert_id == closed.alert_id and opened.tenant == "acme" and opened.job_id == "train-1"
    assert opened.definition_version.endswith("/util_drop.v1")
    # a third run has nothing new to say
    watch(settings)
    assert len(alerts(settings)) == 4

    printed = io.StringIO()
    assert tail_alerts(settings, out=printed, from_beginning=True, max_messages=4, idle_timeout_s=20) == 4
    lines = printed.getvalue().splitlines()
    assert "ALERT OPEN   util_drop c1/train-1#0 tenant=acme gpus=GPU-a,GPU-b" in lines[0]
    assert "ALERT CLOSED hung" in lines[3] and "the job has been working for 5 min" in lines[3]

    # stored by the sink, one row per alert in its latest status, and reported
    stats = run_sink(settings, until_caught_up=True)
    assert stats["rows"]["alerts"] == 4
    done = subprocess.run([sys.executable, "-m", "gpuledger.cli", "report", "alerts", "--format", "json"],
                          env=settings_env(settings), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [(r["rule"], r["job_id"], r["tenant"], r["status"], r["opened_at"], r["closed_at"])
            for r in orjson.loads(done.stdout)]
    # T0 is 00:40 UTC: opened at +60 min, closed at +75 min (UTC, as every report prints times)
    assert rows == [("hung", "train-1", "acme", "closed", "2026-11-02T01:40:00", "2026-11-02T01:55:00"),
                    ("util_drop", "train-1", "acme", "closed", "2026-11-02T01:40:00", "2026-11-02T01:55:00")]


def snapshot(minute, pending_gpus):
    return SchedulerSnapshot(cluster="c1", ts_ms=T0 + minute * MIN, queues=[
        QueueState(queue="batch", priority=0, quota_gpus=8, allocated_gpus=4, pending_jobs=0, pending_gpus=0),
        QueueState(queue="prod", priority=10, quota_gpus=8, allocated_gpus=0, pending_jobs=1 if pending_gpus else 0,
                   pending_gpus=pending_gpus,
                   pending_by_priority=[PendingByPriority(priority=10, jobs=1, gpus=pending_gpus)] if pending_gpus else [])])


def queue_records(t, m):
    recs = [record(g, t, state="allocated_idle", job="idle-job", util=0.0, cost=1000) for g in ("GPU-1", "GPU-2", "GPU-3")]
    return recs + [record("GPU-4", t, job="busy-job")]


def test_reclaim_suggestion_and_its_withdrawal(settings):
    create_topics(settings)
    lifecycle(settings, event("started", 0, job="idle-job"), event("started", 0, job="busy-job"))
    publish(settings, [(settings.topics.scheduler_snapshots, b"c1", encode(snapshot(m, 2.0))) for m in (0, 10, 20, 30)])
    watch(settings)
    usage(settings, range(0, 36), queue_records)
    watch(settings)
    publish(settings, [(settings.topics.scheduler_snapshots, b"c1", encode(snapshot(36, 0.0)))])
    watch(settings)
    usage(settings, range(36, 40), queue_records)
    watch(settings)
    got = [ReclaimSuggestion.model_validate_json(v) for _, v in read_topic(settings, settings.topics.reclaim_suggestions)]
    assert [(s.status, s.opened_at_ms - T0, s.withdrawn_at_ms and s.withdrawn_at_ms - T0) for s in got] == \
        [("open", 30 * MIN, None), ("withdrawn", 30 * MIN, 36 * MIN)]
    opened = got[0]
    # executing: 1 of 4 GPUs for the whole 30-min window; the idle job, 3 GPUs idle for the 30 minutes
    # before the step it opened at (however much later usage had been read by then)
    assert opened.execution_rate == 0.25 and opened.window_ms == 30 * MIN
    assert [(j.job_id, j.gpus, j.execution_rate, j.idle_cost_micros) for j in opened.jobs] == \
        [("idle-job", ["GPU-1", "GPU-2", "GPU-3"], 0.0, 3 * 30 * 1000)]
    assert (opened.gpus_freed, opened.waiting_demand.gpus, opened.waiting_demand.priority) == (3.0, 2.0, 10)
    assert got[1].suggestion_id == opened.suggestion_id and "no higher-priority work waits" in got[1].message

    # the idle job is preempted 7 min after the suggestion: it was followed
    lifecycle(settings, event("preempted", 37, job="idle-job"))
    watch(settings)
    stats = run_sink(settings, until_caught_up=True)
    assert stats["rows"]["reclaim_suggestions"] == 2
    client = connect(settings)
    try:
        (row,) = fetch(client, settings.database, "suggestions", followed_within_s=3600.0)
        (unfollowed,) = fetch(client, settings.database, "suggestions", followed_within_s=60.0)
        weekly = periodic.build_report(client, settings.database, "weekly", followed_within_s=3600.0)
    finally:
        client.close()
    assert (row["status"], row["jobs"], row["followed"], row["released_gpus"]) == ("withdrawn", "idle-job", True, 3.0)
    assert row["followed"] is True
    assert unfollowed["followed"] is False  # released 7 min after: not within 1 min
    # reclaimed: 3 GPUs idle at rate 0 from the release (37 min) to the end of the follow span
    # (30 + 60 min), 3 x 53 / 60 GPU-hours, at the job's idle cost of 1000 micros a GPU-minute
    (reclaimed,) = weekly.section("Reclaimed on followed reclaim suggestions").rows
    assert reclaimed["job_id"] == "idle-job" and reclaimed["reclaimed_gpu_hours"] == pytest.approx(3 * 53 / 60)
    assert reclaimed["saved_cost"] == pytest.approx(3 * 53 / 60 * 0.06)
    assert weekly.summary["reclaimed_gpu_hours"] == pytest.approx(3 * 53 / 60)
    assert weekly.summary["estimated_savings"] == pytest.approx(3 * 53 / 60 * 0.06)
