"""Executing or idle, measured: whether an attempt holding a GPU is working on it.

Lifecycle events say when a job was *started*; some schedulers have no such event (Slurm's
RUNNING is both allocated and started), and a started job can still sit on its GPUs doing nothing
(a data-loading stall, a hung rank, a job waiting for its peers). The definition
(`[execution]` in the ledger config, docs/accounting.md "Executing, measured") decides:

- `events`: executing from `started` to the attempt's end, as the events say;
- `measured`: executing while the holder's measured use is above the floor; where nothing is
  measured for it, the events decide;
- `both` (default): the events say running and the measurement does not say quiet.

A holder is *quiet* in a tick when its use is at or below `util_floor_pct`, or when the node's
agent sees containers on the GPU and none of them is the holder's. A quiet stretch counts as idle
from `min_idle_s` after its first quiet tick on (the stretch's first ticks stay executing: a
checkpoint flush or a short stall is not billed as idle). Causal on purpose: a tick is judged from
itself and the ticks before it, so records never wait for the future and replays agree.

Pure: no I/O, no clock. The per-(GPU, holder) start of the current quiet stretch is part of the
worker's state (`to_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuledger.streams.attribution import Gpu, Holder, measured_use, whole_gpu_util
from gpuledger.streams.pricing import Definitions

QUIET, ACTIVE, UNKNOWN = "quiet", "active", "unknown"


def measured_activity(gpu: Gpu, holder: Holder, alone: bool, floor_pct: float) -> str:
    """QUIET, ACTIVE or UNKNOWN (nothing measured for this holder) in one tick.

    The holder's own use where the agent attributes processes to its container; for a holder
    alone on the GPU, the GPU's own utilization; otherwise unknown."""
    util, _ = measured_use(gpu, holder)
    if util is None and holder.container_id and gpu.processes:
        containers = {p.container_id for p in gpu.processes if p.container_id}
        if containers and holder.container_id not in containers:
            return QUIET  # the agent sees containers on this GPU, and none of them is the holder's
    if util is None and alone:
        util = whole_gpu_util(gpu)
    if util is None:
        return UNKNOWN
    return ACTIVE if util > floor_pct else QUIET


@dataclass
class ExecutionJudge:
    """Decides, per tick segment, which holders of a GPU are executing under the definition.

    `quiet_since[gpu][(job, attempt)]` = start of the holder's current quiet stretch."""

    quiet_since: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)

    def judge(self, gpu: Gpu, holders: list[Holder], start_ms: int, d: Definitions) -> list[Holder]:
        """The holders with `running` as the definition decides for the segment starting at start_ms."""
        source = d.execution_source
        if source == "events" or not holders:
            if not holders:
                self.quiet_since.pop(gpu.gpu_uuid, None)
            return holders
        before = self.quiet_since.get(gpu.gpu_uuid, {})
        now: dict[tuple[str, int], int] = {}
        min_idle_ms = round(d.execution_min_idle_s * 1000)
        alone = len(holders) == 1
        judged = []
        for holder in holders:
            activity = measured_activity(gpu, holder, alone, d.execution_util_floor_pct)
            key = (holder.job_id, holder.attempt)
            idle_by_measure = False
            if activity == QUIET:
                since = now[key] = before.get(key, start_ms)
                idle_by_measure = start_ms - since >= min_idle_ms
            if source == "measured":
                running = holder.running if activity == UNKNOWN else not idle_by_measure
            else:  # both
                running = holder.running and not idle_by_measure
            judged.append(holder if running == holder.running else replace(holder, running=running))
        if now:
            self.quiet_since[gpu.gpu_uuid] = now
        else:
            self.quiet_since.pop(gpu.gpu_uuid, None)
        return judged

    def to_state(self) -> dict:
        return {gpu: [[job, attempt, since] for (job, attempt), since in held.items()]
                for gpu, held in self.quiet_since.items()}

    @classmethod
    def from_state(cls, state: dict | None) -> "ExecutionJudge":
        return cls({gpu: {(job, int(attempt)): int(since) for job, attempt, since in held}
                    for gpu, held in (state or {}).items()})
