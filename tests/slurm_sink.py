"""What a Slurm agent under test published on the job-events line, decoded: its events (keyed messages)
and its watermarks (unkeyed). Stands in for the Kafka publisher in the agent's unit tests."""

from __future__ import annotations

from gpuledger.schemas.models import JobEvent, LifecycleWatermark
from gpuledger.schemas.wire import decode


class JobEventSink:
    def __init__(self):
        self.events: list[JobEvent] = []
        self.watermarks: list[int] = []

    def put(self, line, key, value, partition=None):
        if line != "job-events":
            return
        if key:
            self.events.append(decode(JobEvent, value))
        else:
            self.watermarks.append(decode(LifecycleWatermark, value).ts_ms)

    def close(self, timeout=0):
        return 0
