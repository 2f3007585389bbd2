"""Executing or idle, measured: whether an attempt holding a GPU is working on it.

Lifecycle events say when a job was *started*; some schedulers have no such event (Slurm's
RUNNING is both allocated and started), and a started job can still sit on its GPUs doing nothing
(a data-loading stall, a hung rank, a job waiting for its peers). The definition
(`[execution]` in the ledger config, docs/accounting.md "Executing, measured") decides:

- `events`: executing from `started` to the attempt's end, as the events say;
- `measured`: executing while the holder's measured use is above the floor; where nothing is
  measured for it, the events decide;
- `both` (default): the events say running and the measurement does not say quiet.

A holder is *quiet* in a tick when its use is at or below `util_floor_pct`, when the node's agent
sees containers on the GPU and none of them is the holder's, or when it lists the holder's processes
without an SM share while it measured another process's (a neighbour's work is not the holder's).
A quiet stretch counts as idle from `min_idle_s` after its first quiet tick on (the stretch's first
ticks stay executing: a checkpoint flush or a short stall is not billed as idle). A stretch ends with
the GPU going down, unheld or missing from its node's tick, and is its container's: a holder back
in another one starts anew.
Causal on purpose: a tick is judged from itself and the ticks before it, so records never wait for
the future and replays agree.

Pure: no I/O, no clock. The per-(GPU, holder) start of the current quiet stretch, and its container,
are part of the worker's state (`to_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpuledger.schemas.models import GpuHealth
from gpuledger.streams.attribution import Gpu, Holder, measured_use, whole_gpu_util
from gpuledger.streams.pricing import Definitions

QUIET, ACTIVE, UNKNOWN = "quiet", "active", "unknown"
DOWN = GpuHealth.down


def measured_activity(gpu: Gpu, holder: Holder, alone: bool, floor_pct: float) -> str:
    """QUIET, ACTIVE or UNKNOWN (nothing measured for this holder) in one tick.

    The holder's own use where the agent attributes processes to its container; for a holder
    alone on the GPU, the GPU's own utilization, unless processes of other containers share the GPU
    (then that utilization is not the holder's: quiet only where the whole GPU is); otherwise unknown."""
    util, _ = measured_use(gpu, holder)
    if util is not None:
        return ACTIVE if util > floor_pct else QUIET
    others = False  # processes of another container on the GPU: its own utilization is not the holder's
    if holder.container_id and gpu.processes:
        mine = measured_elsewhere = False
        for p in gpu.processes:
            if p.container_id == holder.container_id:
                mine = True
            elif p.container_id:
                others = True
            if p.sm_util_pct is not None:
                measured_elsewhere = True  # never the holder's own here: its use would be measured
        if others and not mine:
            return QUIET  # the agent sees containers on this GPU, and none of them is the holder's
        if mine and measured_elsewhere:
            # the agent measures each process's SM share on this GPU and measured none for the holder's
            # processes (NVML gives a process no sample when it ran nothing since the last read): a busy
            # neighbour is not the holder's work
            return QUIET
    if not alone:
        return UNKNOWN
    whole = whole_gpu_util(gpu)
    if whole is None:
        return UNKNOWN
    if whole <= floor_pct:
        return QUIET  # nobody works on the GPU
    return UNKNOWN if others else ACTIVE  # busy, and with others on it not necessarily the holder


@dataclass
class ExecutionJudge:
    """Decides, per tick segment, which holders of a GPU are executing under the definition.

    `quiet_since[gpu][(job, attempt)]` = start of the holder's current quiet stretch;
    `quiet_in[gpu][(job, attempt)]` = the container it was quiet in (None: the holder named none). A
    stretch is the container's: a holder that comes back named by another one (a restarted container,
    a new pod of the attempt on the GPU) starts a new stretch, with its grace."""

    quiet_since: dict[str, dict[tuple[str, int], int]] = field(default_factory=dict)
    #: no entry for a stretch restored from a snapshot written before containers were kept: it goes on
    quiet_in: dict[str, dict[tuple[str, int], str | None]] = field(default_factory=dict)

    def judge(self, gpu: Gpu, holders: list[Holder], start_ms: int, d: Definitions) -> list[Holder]:
        """The holders with `running` as the definition decides for the segment starting at start_ms."""
        source = d.execution_source
        uuid = gpu.gpu_uuid
        down = gpu.health is DOWN
        if not holders or down:
            # no holder, no stretch; and a down GPU is the platform's time, not its holders' quiet: their
            # stretches start anew once it is back (whatever a down GPU's sample still measures)
            self.forget(uuid)
        if source == "events" or not holders or down:
            return holders
        before = self.quiet_since.get(uuid)
        now: dict[tuple[str, int], int] = {}
        now_in: dict[tuple[str, int], str | None] = {}
        min_idle_ms = round(d.execution_min_idle_s * 1000)
        alone = len(holders) == 1
        judged = []
        for holder in holders:
            activity = measured_activity(gpu, holder, alone, d.execution_util_floor_pct)
            idle_by_measure = False
            if activity == QUIET:
                key = (holder.job_id, holder.attempt)
                since = before.get(key) if before else None
                if since is None or self.quiet_in.get(uuid, {}).get(key, holder.container_id) != holder.container_id:
                    since = start_ms  # a new stretch (also of a holder back in another container)
                now[key], now_in[key] = since, holder.container_id
                idle_by_measure = start_ms - since >= min_idle_ms
            if source == "measured":
                running = holder.running if activity == UNKNOWN else not idle_by_measure
            else:  # both
                running = holder.running and not idle_by_measure
            judged.append(holder if running == holder.running else replace(holder, running=running))
        if now:
            self.quiet_since[uuid], self.quiet_in[uuid] = now, now_in
        elif before is not None:
            self.forget(uuid)
        return judged

    def forget(self, gpu_uuid: str) -> None:
        """The GPU's quiet stretches end (nobody holds it in a stretch the judge was not asked about)."""
        if self.quiet_since:
            self.quiet_since.pop(gpu_uuid, None)
            self.quiet_in.pop(gpu_uuid, None)

    def to_state(self) -> dict:
        """gpu -> [[job, attempt, since], ...]: the shape every worker version reads."""
        return {gpu: [[job, attempt, since] for (job, attempt), since in held.items()]
                for gpu, held in self.quiet_since.items()}

    def containers_to_state(self) -> dict:
        """gpu -> [[job, attempt, container], ...]: the stretches' containers, kept apart from `to_state`
        so that a worker of an earlier version given this snapshot (a rolling upgrade) still reads it."""
        return {gpu: [[job, attempt, container] for (job, attempt), container in held.items()]
                for gpu, held in self.quiet_in.items() if held}

    @classmethod
    def from_state(cls, state: dict | None, containers: dict | None = None) -> "ExecutionJudge":
        """`containers`: `containers_to_state()`'s; None for a snapshot written before it was kept (the
        stretches then go on whatever container comes)."""
        since = {gpu: {(job, int(attempt)): int(at) for job, attempt, at in held} for gpu, held in (state or {}).items()}
        within = {gpu: {(job, int(attempt)): container for job, attempt, container in held}
                  for gpu, held in (containers or {}).items()}
        return cls(since, within)
