"""Wire schemas of GPU Ledger (pydantic v2 models, orjson on the wire)."""

from gpuledger.schemas.models import *  # noqa: F401,F403
from gpuledger.schemas.models import EXPORTED_MODELS, SCHEMA_VERSION  # noqa: F401
from gpuledger.schemas.wire import DecodeError, decode, decode_lifecycle, decode_node_allocation, encode  # noqa: F401
