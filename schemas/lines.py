"""The ledger's data lines as the producers see them: a message on a logical line, with its Kafka key.

Every producer of input (the simulator, the trace converters, the scheduler agents' tests, a
recorded dump) yields `Emission`s; `gpuledger.embedded.replay.publish` maps the logical line onto
the configured topic (`<prefix>gpu-samples` etc.). Neutral ground: nothing here imports a producer."""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel

LINE_SAMPLES = "gpu-samples"
LINE_JOB_EVENTS = "job-events"
LINE_SNAPSHOTS = "scheduler-snapshots"
LINES = (LINE_SAMPLES, LINE_JOB_EVENTS, LINE_SNAPSHOTS)


class Emission(NamedTuple):
    """One message of one data line. `key` is the Kafka key (None: broadcast watermark)."""

    line: str
    key: str | None
    message: BaseModel
