"""The wire: JSON Schema files match the models; decoding errors are clear."""

import orjson
import pytest

from gpuledger.schemas.export import JSON_DIR, render_all
from gpuledger.schemas.models import GpuSample, JobEvent, NodeTick
from gpuledger.schemas.wire import (
    DecodeError,
    decode,
    decode_lifecycle,
    decode_metered_ticks,
    decode_node_ticks,
    encode,
    encode_node_ticks,
)

T = 1_793_577_600_000


def test_exported_json_schemas_match_models():
    rendered = render_all()
    on_disk = {p.name: p.read_text() for p in JSON_DIR.glob("*.json")}
    drifted = sorted(n for n in rendered if on_disk.get(n) != rendered[n])
    extra = sorted(set(on_disk) - set(rendered))
    assert not drifted and not extra, f"JSON Schemas drifted from the models: {drifted + extra}; run `make schemas`"


def test_every_field_is_described_with_units_where_numeric():
    for name, text in render_all().items():
        assert '"description"' in text, name


def tick_dict(**kw):
    d = {"cluster": "c", "node": "n", "ts_ms": 1, "interval_ms": 5000,
         "gpus": [{"gpu_uuid": "G", "index": 0, "model": "T4", "util_gpu_pct": 10}]}
    d.update(kw)
    return d


def test_round_trip():
    tick = NodeTick(**tick_dict())
    assert decode(NodeTick, encode(tick)) == tick


@pytest.mark.parametrize("raw, reason", [
    (b"{oops", "malformed JSON"),
    (b"[1,2]", "expected a JSON object"),
    (b'{"schema_version": 99}', "unknown schema_version 99"),
    (b'{"cluster": "c"}', "schema violation at node"),
])
def test_decode_errors_say_why(raw, reason):
    with pytest.raises(DecodeError, match=reason):
        decode(NodeTick, raw)


def test_absurd_values_are_schema_violations():
    import orjson

    bad = tick_dict(gpus=[{"gpu_uuid": "G", "index": 0, "model": "T4", "util_gpu_pct": 250}])
    with pytest.raises(DecodeError, match="gpus.0.util_gpu_pct"):
        decode(NodeTick, orjson.dumps(bad))
    with pytest.raises(DecodeError, match="interval_ms"):
        decode(NodeTick, orjson.dumps(tick_dict(interval_ms=-5)))


def test_lifecycle_union_dispatches_on_type():
    assert decode_lifecycle(b'{"type": "watermark", "cluster": "c", "ts_ms": 5}').ts_ms == 5
    event = JobEvent(event_id="e", ts_ms=1, kind="started", cluster="c", job_id="j", tenant="t", queue="q")
    assert decode_lifecycle(encode(event)) == event
    with pytest.raises(DecodeError, match="lifecycle"):
        decode_lifecycle(b'{"type": "nope"}')


# --------------------------------------------------------------------------- line 1: batches, metered view
def _tick(ts_ms: int, node: str = "n1", **gpu) -> NodeTick:
    return NodeTick(cluster="c", node=node, ts_ms=ts_ms, interval_ms=1000,
                    gpus=[GpuSample(gpu_uuid="G1", index=0, model="A100-80GB", temperature_c=40.0, **gpu)])


def test_a_gpu_samples_message_is_one_tick_or_a_batch_of_one_node():
    ticks = [_tick(T + 1000 * i) for i in range(3)]
    assert decode_node_ticks(encode(ticks[0])) == ticks[:1]
    assert decode_node_ticks(encode_node_ticks("n1", ticks)) == ticks
    assert [t.ts_ms for t in decode_metered_ticks(encode_node_ticks("n1", ticks))] == [t.ts_ms for t in ticks]
    # field order on the wire does not matter (the fast path guesses the kind from the bytes)
    reordered = orjson.dumps({"ticks": [t.model_dump(mode="json") for t in ticks], "node": "n1", "type": "tick_batch"})
    assert decode_node_ticks(reordered) == ticks
    with pytest.raises(DecodeError, match="holds a tick of node 'n2'"):
        decode_node_ticks(encode_node_ticks("n1", [ticks[0], _tick(T + 5000, node="n2")]))
    with pytest.raises(DecodeError, match="NodeTickBatch: schema violation at ticks"):
        decode_node_ticks(b'{"type": "tick_batch", "node": "n1", "ticks": []}')
    with pytest.raises(DecodeError, match="malformed JSON"):
        decode_metered_ticks(b'{"type": "tick_batch", "node"')
    with pytest.raises(DecodeError, match="unknown schema_version 2"):
        decode_metered_ticks(orjson.dumps({**ticks[0].model_dump(mode="json"), "schema_version": 2}))
    with pytest.raises(DecodeError, match="empty message"):
        decode_metered_ticks(None)


def test_the_worker_validates_what_it_meters_with_the_schema_constraints():
    good = orjson.loads(encode(_tick(T, util_gpu_pct=50.0)))
    for field, value in [("util_gpu_pct", 150.0), ("power_w", -1.0), ("energy_j", -2.0), ("mem_used_bytes", -5),
                         ("gpu_uuid", ""), ("health", "melted")]:
        bad = {**good, "gpus": [{**good["gpus"][0], field: value}]}
        with pytest.raises(DecodeError, match=f"schema violation at gpus.0.{field}"):
            decode_metered_ticks(orjson.dumps(bad))
        with pytest.raises(DecodeError):
            decode_node_ticks(orjson.dumps(bad))  # the whole tick is wrong too
    infinite = encode(_tick(T, energy_j=5.0)).replace(b'"energy_j":5.0', b'"energy_j":1e999')
    with pytest.raises(DecodeError, match="infinity"):  # not a measurement
        decode_metered_ticks(infinite)
    # a field a newer producer added is ignored (forward-compatible reading, tests/unit/test_wire_forward_compat.py)
    assert decode_metered_ticks(orjson.dumps({**good, "surprise": 1}))[0].gpus[0].util_gpu_pct == 50.0
    # a health-only field out of range is the sink's to reject (the health record); the worker meters the tick
    hot = {**good, "gpus": [{**good["gpus"][0], "temperature_c": 999.0}]}
    assert decode_metered_ticks(orjson.dumps(hot))[0].gpus[0].util_gpu_pct == 50.0
    with pytest.raises(DecodeError, match="temperature_c"):
        decode_node_ticks(orjson.dumps(hot))
