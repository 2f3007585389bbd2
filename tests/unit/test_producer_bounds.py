"""What one producer's values cannot do to the ledger: outgrow the messages the worker makes of them,
overflow what the warehouse stores, pass a wrong JSON type as a number, or raise the energy cap on its
own word (docs/reliability.md, "Bad input"; docs/accounting.md §4a)."""

from __future__ import annotations

import orjson
import pytest

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import (
    AllocationChange,
    DeadLetter,
    GpuAssignment,
    GpuSample,
    NodeTick,
    NodeWatermark,
    ProcessSample,
    UsageBatch,
)
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_metered_ticks, decode_node_ticks, encode
from gpuledger.streams.core import USAGE_MESSAGE_MAX_BYTES, WorkerCore, usage_messages
from gpuledger.streams.join import NodeJoin
from gpuledger.streams.topic_names import TopicNames
from gpuledger.topics import EVENT_TOPIC_MAX_MESSAGE_BYTES, topic_config

LEDGER = load_ledger_config()
TOPICS = TopicNames.with_prefix("t.")
T0 = 1_793_577_600_000  # 2026-11-02
MINUTE = 60_000


def tick_doc(node="n1", ts_ms=T0, interval_ms=5000, **gpu):
    g = {"gpu_uuid": f"GPU-{node}", "index": 0, "model": "A100-80GB", "util_gpu_pct": 50.0, "power_w": 300.0}
    g.update(gpu)
    return {"cluster": "c", "node": node, "ts_ms": ts_ms, "interval_ms": interval_ms, "gpus": [g]}


def rejected(doc) -> str:
    raw = orjson.dumps(doc)
    with pytest.raises(DecodeError) as metered:
        decode_metered_ticks(raw)
    with pytest.raises(DecodeError) as whole:  # the sink's reading, for the health record
        decode_node_ticks(raw)
    assert str(metered.value) == str(whole.value)
    return str(metered.value)


# --------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("field, value", [
    ("gpu_uuid", "GPU-" + "x" * 300), ("model", "A" * 257), ("gpu_uuid", "GPU-1\n"), ("gpu_uuid", " GPU-1"),
    ("processes", [{"pid": 1, "container_id": "c" * 257}]),
    ("mig_devices", [{"uuid": "MIG-" + "m" * 253, "profile": "1g.10gb", "share_milli": 142}]),
    ("mig_devices", [{"uuid": "MIG-1", "profile": "p" * 257, "share_milli": 142}]),
])
def test_device_names_are_bounded_like_identifiers(field, value):
    # a 300-KB UUID in a 300-KB tick made a 1.2-MB usage message (every record repeats it): refused by
    # the broker, the worker restarted on the same tick for ever
    assert "schema violation at gpus.0." + field in rejected(tick_doc(**{field: value}))


def test_device_names_within_bounds_pass():
    doc = tick_doc(gpu_uuid="GPU-" + "a" * 252, model="NVIDIA H100 80GB HBM3",
                   processes=[{"pid": 1, "container_id": "containerd://" + "f" * 64}],
                   mig_devices=[{"uuid": "MIG-" + "b" * 252, "profile": "3g.40gb", "share_milli": 428}])
    (tick,) = decode_node_ticks(orjson.dumps(doc))
    assert len(tick.gpus[0].gpu_uuid) == 256


def test_an_allocation_names_its_gpu_and_container_within_bounds():
    event = {"type": "job_event", "event_id": "e1", "ts_ms": T0, "kind": "allocated", "cluster": "c",
             "job_id": "j", "tenant": "t", "queue": "q"}
    with pytest.raises(DecodeError, match="gpus.0.container_id: String should have at most 256"):
        decode_lifecycle(orjson.dumps({**event, "gpus": [{"node": "n1", "gpu_index": 0, "container_id": "c" * 2_000_000}]}))
    with pytest.raises(DecodeError, match="gpus.0.gpu_uuid: an identifier must be printable"):
        decode_lifecycle(orjson.dumps({**event, "gpus": [{"node": "n1", "gpu_uuid": "GPU-1 "}]}))


@pytest.mark.parametrize("field", ["mem_used_bytes", "mem_total_bytes"])
def test_memory_beyond_what_the_warehouse_stores_is_refused(field):
    assert "less than or equal to 9223372036854775807" in rejected(tick_doc(**{field: 2**63}))
    # a process's memory as well; 2**63 - 1 itself is a number the tables hold
    assert "processes.0.mem_used_bytes" in rejected(tick_doc(processes=[{"pid": 1, "mem_used_bytes": 2**63}]))
    decode_metered_ticks(orjson.dumps(tick_doc(**{field: 2**63 - 1})))


def test_one_nodes_absurd_memory_loses_no_other_nodes_usage():
    # 2**63 bytes used on n2 was accepted; at the next watermark the usage batch of the partition could
    # not be encoded, and every node's records for the window were lost with the watermark's dead letter
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    outs, offset = [], 0
    for k in range(12):
        for node in ("n1", "n2"):
            doc = tick_doc(node=node, ts_ms=T0 + k * 5000, mem_total_bytes=2**64 - 1 if node == "n2" else 80 * 2**30,
                           mem_used_bytes=2**63 if node == "n2" else 2**30)
            outs += core.on_node(TOPICS.gpu_samples, 0, offset, orjson.dumps(doc))
            offset += 1
    letters = [decode(DeadLetter, o.value) for o in outs if o.topic == TOPICS.dead_letters]
    assert len(letters) == 12 and all("mem_" in letter.reason for letter in letters)
    mark = encode(NodeWatermark(ts_ms=T0 + MINUTE, source_partition=0, source_partitions=1))
    usage = [o for o in core.on_node(TOPICS.node_allocations, 0, 0, mark) if o.topic == TOPICS.usage]
    gpu_ms = {}
    for out in usage:
        for r in decode(UsageBatch, out.value).records:
            gpu_ms[r.node] = gpu_ms.get(r.node, 0) + r.gpu_ms
    assert gpu_ms == {"n1": MINUTE}


# --------------------------------------------------------------------------- types
@pytest.mark.parametrize("field, value", [("interval_ms", True), ("interval_ms", "5000"), ("interval_ms", 5000.0),
                                          ("ts_ms", str(T0))])
def test_a_wrong_json_type_is_no_number(field, value):
    # pydantic's lax mode read `true` as 1: a 1-ms tick, billed
    doc = tick_doc()
    doc[field] = value
    assert f"schema violation at {field}: Input should be a valid integer" in rejected(doc)


def test_a_wrong_json_type_in_a_gpu_or_an_event_is_no_number():
    assert "gpus.0.util_gpu_pct: Input should be a valid number" in rejected(tick_doc(util_gpu_pct=True))
    event = {"type": "job_event", "event_id": "e1", "ts_ms": T0, "kind": "allocated", "cluster": "c", "job_id": "j",
             "tenant": "t", "queue": "q", "gpus": [{"node": "n1", "gpu_index": 0, "share_milli": True}]}
    with pytest.raises(DecodeError, match="gpus.0.share_milli: Input should be a valid integer"):
        decode_lifecycle(orjson.dumps(event))
    with pytest.raises(DecodeError, match="attempt: Input should be a valid integer"):
        decode_lifecycle(orjson.dumps({**event, "gpus": [], "attempt": "1"}))
    # what JSON does say stays readable: integers where floats are due, enum values as strings
    (tick,) = decode_metered_ticks(orjson.dumps(tick_doc(util_gpu_pct=50, power_w=300, health="down")))
    assert tick.gpus[0].util_gpu_pct == 50.0 and tick.gpus[0].health == "down"


# --------------------------------------------------------------------------- one index, one GPU
def test_two_gpus_at_one_index_are_refused():
    doc = tick_doc()
    doc["gpus"].append({**doc["gpus"][0], "gpu_uuid": "GPU-other"})
    core = WorkerCore(TOPICS, partitions_gpu_samples=1, partitions_job_events=1, ledger=LEDGER)
    (out,) = core.on_node(TOPICS.gpu_samples, 0, 0, orjson.dumps(doc))
    assert out.topic == TOPICS.dead_letters
    assert "lists two GPUs at index 0" in decode(DeadLetter, out.value).reason


# --------------------------------------------------------------------------- energy cap
def energy_of(power_w, power_limit_w, model="A100-80GB"):
    join = NodeJoin(node="n1")
    join.add_tick(NodeTick(cluster="c", node="n1", ts_ms=T0, interval_ms=MINUTE, gpus=[
        GpuSample(gpu_uuid="G", index=0, model=model, power_w=power_w, power_limit_w=power_limit_w)]))
    (record,) = join.close_until(T0 + MINUTE, LEDGER)
    return record["energy_j"], join.take_unmatched()


def test_a_sample_cannot_raise_the_configured_power_limit():
    # an A100-80GB is 400 W in [power_limits]; a producer saying 5,000 W (limit and reading) was believed
    assert energy_of(5_000.0, 5_000.0) == (400.0 * 60, {"fallback_power_over_power_limit": 1})
    # a lower limit of its own still tightens the cap (a card capped at 250 W)
    assert energy_of(400.0, 250.0) == (250.0 * 60, {"fallback_power_over_power_limit": 1})
    assert energy_of(300.0, 250.0) == (300.0 * 60, {})  # within 250 x 1.2


# --------------------------------------------------------------------------- message sizes
def shared_gpu_records(hours):
    """A node's records closed `hours` at once (the lifecycle watermark back after a stall): two GPUs, one
    shared by three jobs in mid-window segments (busy, then quiet), the other unallocated."""
    join = NodeJoin(node="n1")
    shares = (("j-a", 400), ("j-b", 400), ("j-c", 200))
    for n, (job, share) in enumerate(shares):
        for kind in ("allocated", "started"):
            join.add_change(AllocationChange(ts_ms=T0, event_id=f"{job}-{kind}", kind=kind, node="n1", job_id=job,
                                             attempt=0, tenant="t", queue="q", cluster="c",
                                             gpus=[GpuAssignment(node="n1", gpu_uuid="G-shared", share_milli=share)]))
    for k in range(hours * 60 * 2):  # 30-s ticks: busy and quiet halves of each window
        ts = T0 + k * 30_000
        busy = k % 4 < 2
        join.add_tick(NodeTick(cluster="c", node="n1", ts_ms=ts, interval_ms=30_000, gpus=[
            GpuSample(gpu_uuid="G-shared", index=0, model="A100-80GB", util_gpu_pct=90.0 if busy else 0.0,
                      power_w=300.0, processes=[ProcessSample(pid=1, container_id="x", sm_util_pct=90.0 if busy else 0.0)]),
            GpuSample(gpu_uuid="G-free", index=1, model="A100-80GB", util_gpu_pct=0.0, power_w=60.0)]))
    return join.close_until(T0 + hours * 3_600_000, LEDGER)


def sink_keeps(messages):
    """What the sink's per-GPU horizon keeps of these messages, in order (gpuledger/sink/batching.py
    `_new_usage`: a record starting before the end of one already taken for its GPU is dropped)."""
    running, kept = {}, []
    for raw in messages:
        rows = orjson.loads(raw)["records"]
        before = {r["gpu_uuid"]: running.get(r["gpu_uuid"], 0) for r in rows}
        for r in rows:
            if r["start_ms"] >= before[r["gpu_uuid"]]:
                kept.append(r)
                running[r["gpu_uuid"]] = max(running.get(r["gpu_uuid"], 0), r["end_ms"])
    return kept


def test_a_large_close_is_split_into_usage_messages_the_broker_takes():
    records = shared_gpu_records(hours=6)
    assert len({(r["gpu_uuid"], r["start_ms"]) for r in records}) < len(records)  # several records a window
    whole = usage_messages("n1", records)
    assert len(whole) == 1 and len(whole[0]) > 100_000
    for max_bytes in (USAGE_MESSAGE_MAX_BYTES // 10, 20_000, 3_000):
        messages = usage_messages("n1", records, max_bytes)
        assert len(messages) > 3 and all(len(m) <= max_bytes for m in messages)
        back = [r for m in messages for r in orjson.loads(m)["records"]]
        assert sorted(r["record_id"] for r in back) == sorted(r["record_id"] for r in records)
        # cut where no record spans: the sink keeps every record (a cut inside a window lost records of
        # the GPU's other holders to the horizon of the first part, as the golden shared GPU showed)
        kept = sink_keeps(messages)
        assert len(kept) == len(records)
        assert sum(r["gpu_ms"] for r in kept) == 2 * 6 * 3_600_000
    # one window's records cannot be cut in time: by GPU, each GPU's records whole
    window = [r for r in records if r["start_ms"] < T0 + 60_000]
    messages = usage_messages("n1", window, 1_000)
    assert len(messages) == 2 and len(sink_keeps(messages)) == len(window)
    assert [{r["gpu_uuid"] for r in orjson.loads(m)["records"]} for m in messages] in (
        [{"G-shared"}, {"G-free"}], [{"G-free"}, {"G-shared"}])


def test_node_allocations_take_what_job_events_take():
    # an allocation change carries a job's GPUs on one node from one event, up to the event's size
    settings = Settings(topic_prefix="t.")
    for name in (settings.topics.job_events, settings.topics.node_allocations, settings.topics.lifecycle_accepted):
        assert topic_config(settings, name)["max.message.bytes"] == str(EVENT_TOPIC_MAX_MESSAGE_BYTES)
    assert "max.message.bytes" not in topic_config(settings, settings.topics.usage)  # split to fit instead
