"""Attribution: one GPU, one stretch of time, who held it -> usage records. Pure.

Every GPU-millisecond of the stretch lands in exactly one record (down, unallocated,
allocated_idle or executing-for-a-job), and the stretch's cost is split over the records
so that the parts add up to the whole (largest-remainder rounding in integer micros).

A GPU held whole by one attempt is split by time only: executing or allocated_idle.
A *shared* GPU (several holders, or a fractional share) is split, under the default
definition, by each container's measured use (SM and memory, weights configurable);
what no holder used of the held part is idle. See docs/accounting.md."""

from __future__ import annotations

from dataclasses import dataclass

from gpuledger.schemas.models import GpuHealth, GpuSample, UsageRecord, UsageState
from gpuledger.streams.pricing import Definitions, LedgerConfig

UNIT = 1_000_000  # weights of one GPU in millionths


@dataclass(frozen=True, order=True)
class Holder:
    """One attempt holding a share of one GPU."""

    job_id: str
    attempt: int
    tenant: str
    queue: str
    share_milli: int
    running: bool
    container_id: str | None = None


@dataclass(frozen=True)
class Slice:
    state: UsageState
    holder: Holder | None
    weight: int                 # millionths of the GPU
    util_pct: float | None
    mem_used_bytes: int | None


def split_integer(total: int, weights: list[int]) -> list[int]:
    """Split `total` in proportion to `weights` so the parts sum to `total` exactly
    (largest remainder; ties go to the earlier part)."""
    if len(weights) == 1:  # the common case: a GPU in one state for the whole stretch
        return [total if weights[0] else 0]
    weight_sum = sum(weights)
    if weight_sum == 0 or total == 0:
        return [0] * len(weights)
    floors = [total * w // weight_sum for w in weights]
    remainders = [total * w % weight_sum for w in weights]
    short = total - sum(floors)
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[:short]:
        floors[i] += 1
    return floors


def normalise_shares(holders: list[Holder]) -> list[int]:
    """Shares in thousandths; an over-committed GPU (sum > 1000, e.g. time slicing) is scaled down."""
    shares = [h.share_milli for h in holders]
    if sum(shares) > 1000:
        shares = split_integer(1000, shares)
    return shares


def measured_use(gpu: GpuSample, holder: Holder) -> tuple[float | None, int | None]:
    """SM share (percent of the GPU) and memory of one holder's container, if NVML saw it."""
    if not holder.container_id:
        return None, None
    procs = [p for p in gpu.processes if p.container_id == holder.container_id]
    utils = [p.sm_util_pct for p in procs if p.sm_util_pct is not None]
    mems = [p.mem_used_bytes for p in procs if p.mem_used_bytes is not None]
    return (min(100.0, sum(utils)) if utils else None), (sum(mems) if mems else None)


def _whole_gpu_util(gpu: GpuSample) -> float | None:
    return gpu.sm_active_pct if gpu.sm_active_pct is not None else gpu.util_gpu_pct


def _time_split(gpu: GpuSample, holders: list[Holder], shares: list[int]) -> list[Slice]:
    """Each holder gets its allocated share, executing or idle by its state."""
    alone = len(holders) == 1
    slices = []
    for holder, share in zip(holders, shares):
        util, mem = measured_use(gpu, holder)
        if util is None and alone:
            util, mem = _whole_gpu_util(gpu), gpu.mem_used_bytes
        state = UsageState.executing if holder.running else UsageState.allocated_idle
        slices.append(Slice(state, holder, share * 1000, util, mem))
    return slices


def _use_weight(gpu: GpuSample, holder: Holder, share: int, d: Definitions) -> tuple[int, float | None, int | None]:
    """Measured use of one running holder in millionths of the GPU (its share when unmeasured)."""
    util, mem = measured_use(gpu, holder)
    if util is None and mem is None:
        return share * 1000, None, None
    sm_w, mem_w = d.shared_sm_weight, d.shared_memory_weight
    if mem is None or not gpu.mem_total_bytes:
        mem_w = 0.0
    if util is None:
        sm_w = 0.0
    if sm_w + mem_w == 0:
        return share * 1000, util, mem
    used = (sm_w * (util or 0.0) / 100 + mem_w * (mem or 0) / (gpu.mem_total_bytes or 1)) / (sm_w + mem_w)
    return round(min(1.0, used) * UNIT), util, mem


def _measured_split(gpu: GpuSample, holders: list[Holder], shares: list[int], d: Definitions) -> list[Slice]:
    """Executing slices by measured use; the unused rest of the held part is idle."""
    held = sum(shares) * 1000
    uses = [(_use_weight(gpu, h, s, d) if h.running else (0, None, None)) for h, s in zip(holders, shares)]
    total_use = sum(u[0] for u in uses)
    if total_use > held:  # measured more than held (bursting into the free part): scale to the held part
        scaled = split_integer(held, [u[0] for u in uses])
        uses = [(w, u[1], u[2]) for w, u in zip(scaled, uses)]
        total_use = held
    slices = [Slice(UsageState.executing, h, w, util, mem) for h, (w, util, mem) in zip(holders, uses) if w > 0]
    unused = held - total_use
    if unused > 0:
        if d.shared_unused == "holders":
            for h, w in zip(holders, split_integer(unused, shares)):
                if w > 0:
                    slices.append(Slice(UsageState.allocated_idle, h, w, None, None))
        else:
            slices.append(Slice(UsageState.unallocated, None, unused, None, None))
    return slices


def attribute(
    *,
    cluster: str,
    node: str,
    gpu: GpuSample,
    holders: list[Holder],
    start_ms: int,
    end_ms: int,
    energy_j: float,
    ledger: LedgerConfig,
) -> list[UsageRecord]:
    """Usage records of one GPU over [start_ms, end_ms) given the attempts holding it."""
    duration = end_ms - start_ms
    if duration <= 0:
        return []
    d = ledger.definitions
    holders = sorted(holders)
    if gpu.health == GpuHealth.down:
        slices = [Slice(UsageState.down, None, UNIT, None, None)]
    else:
        shares = normalise_shares(holders)
        shared = len(holders) > 1 or any(s < 1000 for s in shares)
        if shared and d.shared_split == "measured":
            slices = _measured_split(gpu, holders, shares, d)
        else:
            slices = _time_split(gpu, holders, shares)
        rest = UNIT - sum(s.weight for s in slices)
        if rest > 0:
            free = not holders
            unallocated = [s for s in slices if s.state == UsageState.unallocated]
            if unallocated:  # the shared GPU's unused part already went to the platform: one record
                slices[slices.index(unallocated[0])] = Slice(UsageState.unallocated, None, unallocated[0].weight + rest, None, None)
            else:
                slices.append(Slice(UsageState.unallocated, None, rest,
                                    _whole_gpu_util(gpu) if free else None, gpu.mem_used_bytes if free else None))

    gpu_ms = split_integer(duration, [s.weight for s in slices])
    total_cost = ledger.interval_cost_micros(gpu.model, duration, energy_j)
    costs = split_integer(total_cost, gpu_ms)
    coef = ledger.coefficient_at(gpu.model, start_ms)

    records = []
    for slot, (piece, g_ms, cost) in enumerate(zip(slices, gpu_ms, costs)):
        holder = piece.holder
        records.append(UsageRecord(
            record_id=f"{gpu.gpu_uuid}/{start_ms}/{slot}",
            cluster=cluster,
            node=node,
            gpu_uuid=gpu.gpu_uuid,
            gpu_model=gpu.model,
            start_ms=start_ms,
            end_ms=end_ms,
            state=piece.state,
            job_id=holder.job_id if holder else "",
            attempt=holder.attempt if holder else 0,
            tenant=holder.tenant if holder else "",
            queue=holder.queue if holder else "",
            share_milli=round(piece.weight / 1000),
            gpu_ms=g_ms,
            util_pct=piece.util_pct,
            util_metric_pct=d.utilization_metric(piece.util_pct),
            mem_used_bytes=piece.mem_used_bytes,
            energy_j=energy_j * g_ms / duration,
            coefficient=coef.coefficient,
            coefficient_version=coef.version,
            effective_gpu_ms=round(g_ms * coef.coefficient),
            cost_micros=cost,
            definition_version=ledger.definition_version,
        ))
    return records
