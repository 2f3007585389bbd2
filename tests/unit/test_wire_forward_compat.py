"""Forward-compatible reading (schemas/wire.py): a message of a known schema version with fields
this ledger does not know, at any level, decodes as if they were absent; a wrong value in a known
field is still a DecodeError with its reason; writers stay strict."""

import orjson
import pytest
from pydantic import ValidationError

from gpuledger.schemas.models import (
    AllocationChange,
    GpuAssignment,
    GpuSample,
    JobEvent,
    LifecycleWatermark,
    MigDevice,
    NodeTick,
    NodeTickBatch,
    NodeWatermark,
    PendingByPriority,
    PreemptionFired,
    ProcessSample,
    QueueState,
    SchedulerSnapshot,
    UsageBatch,
    UsageRecord,
)
from gpuledger.schemas.wire import (
    DecodeError,
    decode,
    decode_lifecycle,
    decode_metered_ticks,
    decode_node_allocation,
    decode_node_ticks,
    encode,
)
from newer_producer import NEW_FIELD
from newer_producer import newer as newer_message

T = 1_767_225_600_000  # 2026-01-01 UTC


def newer(model) -> bytes:
    """The message as a newer producer would send it: the same, plus fields at every level."""
    raw = orjson.dumps(newer_message(model))
    assert NEW_FIELD.encode() in raw
    return raw


def tick(ts_ms: int = T) -> NodeTick:
    return NodeTick(cluster="c1", node="n1", ts_ms=ts_ms, interval_ms=5000, gpus=[GpuSample(
        gpu_uuid="GPU-1", index=0, model="A100-80GB", util_gpu_pct=80.0, power_w=250.0, energy_j=1000.0,
        processes=[ProcessSample(pid=7, container_id="slurm-job-1", sm_util_pct=70.0, mem_used_bytes=1 << 30)],
        mig_devices=[MigDevice(uuid="MIG-1", profile="3g.40gb", share_milli=428)])])


EVENT = JobEvent(event_id="e1", ts_ms=T, kind="allocated", cluster="c1", job_id="j1", tenant="t1", queue="q1",
                 requested_gpus=1, aliases={"container_id": "slurm-job-1"},
                 gpus=[GpuAssignment(node="n1", gpu_uuid="GPU-1", container_id="slurm-job-1")])
SNAPSHOT = SchedulerSnapshot(cluster="c1", ts_ms=T, queues=[QueueState(
    queue="q1", quota_gpus=8, allocated_gpus=1, pending_jobs=1, pending_gpus=2,
    pending_by_priority=[PendingByPriority(priority=1, jobs=1, gpus=2)])],
    preemptions=[PreemptionFired(job_id="j2", by_job_id="j1", queue="q1", rule="priority")])
RECORD = UsageRecord(record_id="GPU-1/1/0", cluster="c1", node="n1", gpu_uuid="GPU-1", gpu_model="A100-80GB",
                     start_ms=T, end_ms=T + 5000, state="executing", job_id="j1", tenant="t1", queue="q1",
                     share_milli=1000, gpu_ms=5000, coefficient=1.0, coefficient_version="v1",
                     effective_gpu_ms=5000, cost_micros=10, definition_version="d1")


@pytest.mark.parametrize("message, read", [
    (tick(), lambda raw: decode_node_ticks(raw)[0]),
    (NodeTickBatch(node="n1", ticks=[tick(), tick(T + 5000)]), decode_node_ticks),
    (EVENT, decode_lifecycle),
    (LifecycleWatermark(cluster="c1", ts_ms=T), decode_lifecycle),
    (SNAPSHOT, lambda raw: decode(SchedulerSnapshot, raw)),
    (UsageBatch(node="n1", records=[RECORD]), lambda raw: decode(UsageBatch, raw)),
    (AllocationChange(ts_ms=T, event_id="e1", kind="allocated", node="n1", job_id="j1", tenant="t1", queue="q1",
                      gpus=EVENT.gpus), decode_node_allocation),
    (NodeWatermark(ts_ms=T, source_partition=0, source_partitions=2), decode_node_allocation),
], ids=["tick", "tick-batch", "job-event", "lifecycle-watermark", "snapshot", "usage", "allocation", "node-watermark"])
def test_a_newer_producers_message_reads_as_the_known_fields(message, read):
    expected = message.ticks if isinstance(message, NodeTickBatch) else message
    assert read(newer(message)) == expected


def test_the_worker_meters_a_newer_tick_the_same():
    for message in (tick(), NodeTickBatch(node="n1", ticks=[tick(), tick(T + 5000)])):
        assert decode_metered_ticks(newer(message)) == decode_metered_ticks(encode(message))


@pytest.mark.parametrize("where, mutate", [
    ("ts_ms", lambda d: {**d, "ts_ms": "yesterday"}),
    ("gpus.0.util_gpu_pct", lambda d: {**d, "gpus": [{**d["gpus"][0], "util_gpu_pct": 150.0}]}),
    ("gpus.0.processes.0.pid", lambda d: {**d, "gpus": [{**d["gpus"][0], "processes": [{"pid": "seven"}]}]}),
])
def test_a_wrong_value_in_a_known_field_is_still_a_violation(where, mutate):
    raw = orjson.dumps(mutate(orjson.loads(newer(tick()))))
    with pytest.raises(DecodeError, match=f"NodeTick: schema violation at {where}"):
        decode_node_ticks(raw)
    if where != "gpus.0.processes.0.pid":  # the worker does not meter pids
        with pytest.raises(DecodeError, match=f"schema violation at {where}"):
            decode_metered_ticks(raw)
    bad_event = {**orjson.loads(newer(EVENT)), "attempt": "first"}
    with pytest.raises(DecodeError, match="lifecycle message: schema violation at job_event.attempt"):
        decode_lifecycle(orjson.dumps(bad_event))


def test_an_unknown_schema_version_is_still_refused():
    with pytest.raises(DecodeError, match="unknown schema_version 2"):
        decode_node_ticks(orjson.dumps({**orjson.loads(newer(tick())), "schema_version": 2}))


def test_writers_stay_strict():
    with pytest.raises(ValidationError, match=NEW_FIELD):
        NodeTick.model_validate(orjson.loads(newer(tick())))
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        GpuAssignment(node="n1", gpu_uuid="GPU-1", colour="blue")
