"""Messages as a newer producer sends them: the known fields, plus fields this ledger does not know at
every level (tests/unit/test_wire_forward_compat.py, tests/integration/test_forward_compat.py)."""

import orjson

from gpuledger.schemas.wire import encode

#: maps whose keys are data, not fields (a key added there is a value, not an unknown field)
FREE_FORM = {"aliases"}
NEW_FIELD = "added_in_a_later_release"


def with_unknown_fields(value, path: str = "") -> object:
    """`value` with a field no model knows added to every JSON object in it, nested ones included."""
    if isinstance(value, dict):
        out = {k: v if k in FREE_FORM else with_unknown_fields(v, f"{path}.{k}") for k, v in value.items()}
        return {**out, NEW_FIELD: {"at": path or "<root>", "values": [1, 2.5, None]}}
    if isinstance(value, list):
        return [with_unknown_fields(v, f"{path}.{i}") for i, v in enumerate(value)]
    return value


def newer(model) -> dict:
    """`model`'s wire form with unknown fields at every level."""
    return with_unknown_fields(orjson.loads(encode(model)))
