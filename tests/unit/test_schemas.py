"""The wire: JSON Schema files match the models; decoding errors are clear."""

import pytest

from gpuledger.schemas.export import JSON_DIR, render_all
from gpuledger.schemas.models import JobEvent, NodeTick
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, encode


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
