"""Feeding the pure worker core (`WorkerCore.on_node`) gpu-samples and node-allocations messages in the
unit tests, under the shipped [segments] values, and reading back what came out."""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

from gpuledger.schemas.models import (AllocationChange, DeadLetter, GpuAssignment, GpuSample, NodeTick, NodeWatermark,
                                      UsageBatch)
from gpuledger.schemas.wire import decode, encode
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.pricing import parse_ledger_config
from gpuledger.streams.topic_names import TopicNames

DOC = tomllib.loads((Path(__file__).resolve().parent / "fixtures" / "unit_ledger.toml").read_text())
#: the shipped [segments] values: 60 s windows, flushed 60 s after
LEDGER = parse_ledger_config({**DOC, "segments": {"window_s": 60, "flush_after_s": 60}}, "shipped-segments")
T = TopicNames.with_prefix("t.")
S, MIN = 1000, 60_000
T0 = 1_793_577_600_000  # 2026-11-02T00:00Z


class Feeder:
    """Sends messages to partition 0 of the core, one offset after the other per topic; keeps every
    output (`outs`) and every message sent (`sent`, by topic)."""

    def __init__(self, core: WorkerCore):
        self.core, self.offsets, self.outs = core, Counter(), []
        self.sent: dict[str, list[bytes]] = {T.gpu_samples: [], T.node_allocations: []}

    def __call__(self, topic: str, raw: bytes, now_ms: int | None = None) -> list:
        outs = self.core.on_node(topic, 0, self.offsets[topic], raw, now_ms=now_ms)
        self.offsets[topic] += 1
        self.sent.setdefault(topic, []).append(raw)
        self.outs += outs
        return outs

    def lifecycle(self, message, now_ms: int | None = None) -> list:
        """A job-events message through the router (partition 0); its allocation changes and watermarks
        go on to the node join as the worker sends them. Returns the router's outputs."""
        outs = self.core.on_lifecycle(0, self.offsets["life"], encode(message), now_ms=now_ms)
        self.offsets["life"] += 1
        for out in outs:
            if out.topic == T.node_allocations:
                self(T.node_allocations, out.value, now_ms)
            else:
                self.outs.append(out)
        return outs

    def letters(self) -> list[DeadLetter]:
        return [decode(DeadLetter, o.value) for o in self.outs if o.topic == T.dead_letters]

    def late(self, node: str) -> list[str]:
        """The reasons of the dead letters that say one of `node`'s ticks is late."""
        return [r for o in self.outs if o.topic == T.dead_letters
                for r in [decode(DeadLetter, o.value).reason] if r.startswith(f"late tick: {node}")]

    def billed(self, node: str) -> int:
        """GPU-ms of `node` in the usage records out so far."""
        return sum(r.gpu_ms for o in self.outs if o.topic == T.usage
                   for r in decode(UsageBatch, o.value).records if r.node == node)


def tick(node: str, ts: int, **gpu) -> NodeTick:
    """A 10-s tick of the node's one GPU (`gpu`: other GpuSample fields, or other values)."""
    g = dict(gpu_uuid=f"GPU-{node}", index=0, model="A100-80GB", power_w=200.0, util_gpu_pct=90.0)
    g.update(gpu)
    return NodeTick(cluster="c", node=node, ts_ms=ts, interval_ms=10 * S, gpus=[GpuSample(**g)])


def allocate(feed: Feeder, node: str, now_ms: int | None = None, kinds: tuple[str, ...] = ("allocated",)) -> None:
    """Job `job-<node>` gets the node's whole GPU at T0: one allocation change of each of `kinds`."""
    for kind in kinds:
        feed(T.node_allocations, encode(AllocationChange(
            ts_ms=T0, event_id=f"{node}/{kind}", kind=kind, node=node, job_id=f"job-{node}", tenant="t", queue="q",
            gpus=[GpuAssignment(node=node, gpu_uuid=f"GPU-{node}", share_milli=1000)])), now_ms)


def watermark(feed: Feeder, ts: int, now_ms: int | None = None) -> None:
    feed(T.node_allocations, encode(NodeWatermark(ts_ms=ts, source_partition=0, source_partitions=1)), now_ms)
