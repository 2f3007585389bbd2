"""orjson on the wire: one place that turns models into bytes and bytes into models.

Decoding never raises anything but DecodeError, whose message is the reason an operator
reads in the dead-letter topic.

Forward-compatible reading: a decoder ignores fields it does not know, at every level, in a
message of a schema version it knows; a wrong value in a known field is still a violation. So a
producer upgraded to send a new (optional) field is read by workers and sinks not yet upgraded
(a rolling upgrade). Writers stay strict: the models forbid unknown fields when they are built."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from gpuledger.schemas.models import (
    SCHEMA_VERSION,
    LifecycleMessage,
    MeteredTick,
    MeteredTickBatch,
    NodeAllocationMessage,
    NodeTick,
    NodeTickBatch,
)

M = TypeVar("M", bound=BaseModel)

_lifecycle = TypeAdapter(LifecycleMessage)
_node_allocation = TypeAdapter(NodeAllocationMessage)


#: pydantic's per-call override of the models' `extra="forbid"`; it reaches nested models too
_READ_EXTRA = "ignore"


class DecodeError(ValueError):
    """A message that cannot be used: malformed JSON, unknown schema version, schema violation."""


def encode(model: BaseModel) -> bytes:
    return orjson.dumps(model.model_dump(mode="json", exclude_none=True))


def _load(raw: bytes) -> dict:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"expected a JSON object, got {type(obj).__name__}")
    version = obj.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DecodeError(f"unknown schema_version {version!r} (this ledger reads {SCHEMA_VERSION})")
    return obj


def _explain(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"schema violation at {where}: {first['msg']}{more}"


def _validate(validate_json, raw: bytes, label: str):
    """`raw` validated by pydantic's JSON parser, strictly: a JSON value of the wrong type is a violation
    (`true` is no interval, `"5"` no count), as the published JSON Schemas say; pydantic's lax mode
    would take both. Strict JSON mode still reads enum values from strings and integers as floats.
    Parsed once; a message that fails is read again for the usual reasons first (malformed JSON, not an
    object, unknown schema_version)."""
    try:
        return validate_json(raw, strict=True, extra=_READ_EXTRA)
    except (ValidationError, TypeError) as exc:  # TypeError: no bytes at all, which _load refuses
        _load(raw)
        raise DecodeError(f"{label}: {_explain(exc)}") from None


def decode(model: type[M], raw: bytes) -> M:
    return _validate(model.model_validate_json, raw, model.__name__)


def decode_lifecycle(raw: bytes):
    """A job-events message: a JobEvent or a LifecycleWatermark."""
    return _validate(_lifecycle.validate_json, raw, "lifecycle message")


def decode_node_allocation(raw: bytes):
    """An internal node-allocations message: an AllocationChange or a NodeWatermark."""
    return _validate(_node_allocation.validate_json, raw, "node-allocation message")


def _decode_ticks(raw: bytes, tick_model: type[BaseModel], batch_model: type[BaseModel]) -> list:
    if raw is None:
        raise DecodeError("empty message (no value)")
    # A well-formed message is validated straight from its bytes by pydantic's JSON parser (a
    # third cheaper than orjson + model_validate); one that fails goes through the general path,
    # which gives the usual reasons (malformed JSON, unknown schema_version, first violation).
    fast = batch_model if b'"tick_batch"' in raw else tick_model
    try:
        message = fast.model_validate_json(raw, strict=True, extra=_READ_EXTRA)
    except (ValidationError, TypeError):
        obj = _load(raw)
        if obj.get("type") == "tick_batch" or "ticks" in obj:
            message = _validate(batch_model.model_validate_json, raw, "NodeTickBatch")
        else:
            message = _validate(tick_model.model_validate_json, raw, "NodeTick")
    if isinstance(message, tick_model):
        return [message]
    for tick in message.ticks:
        if tick.node != message.node:
            raise DecodeError(f"NodeTickBatch of {message.node!r} holds a tick of node {tick.node!r}")
    return message.ticks


def decode_node_ticks(raw: bytes) -> list[NodeTick]:
    """A gpu-samples message (one `NodeTick` or a `NodeTickBatch`) as the list of its ticks, whole."""
    return _decode_ticks(raw, NodeTick, NodeTickBatch)


def decode_metered_ticks(raw: bytes) -> list[MeteredTick]:
    """The same, as the worker reads it: `MeteredTick`s (what the accounting uses, validated with
    the full schema's constraints; health-only fields are the sink's to check)."""
    return _decode_ticks(raw, MeteredTick, MeteredTickBatch)


def encode_node_ticks(node: str, ticks: list[NodeTick]) -> bytes:
    """One gpu-samples message for a node's ticks: a plain `NodeTick` for one, else a batch."""
    if len(ticks) == 1:
        return encode(ticks[0])
    return encode(NodeTickBatch(node=node, ticks=ticks))
