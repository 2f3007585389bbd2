"""Attribution: one GPU, one stretch of time, who held it -> usage records. Pure.

Every GPU-millisecond of the stretch lands in exactly one record (down, unallocated,
allocated_idle or executing-for-a-job), and the stretch's cost is split over the records
so that the parts add up to the whole (largest-remainder rounding in integer micros)."""

from __future__ import annotations

from dataclasses import dataclass

from gpuledger.schemas.models import GpuHealth, GpuSample, UsageRecord, UsageState
from gpuledger.streams.pricing import LedgerConfig


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


def split_integer(total: int, weights: list[int]) -> list[int]:
    """Split `total` in proportion to `weights` so the parts sum to `total` exactly
    (largest remainder; ties go to the earlier part)."""
    weight_sum = sum(weights)
    if weight_sum == 0 or total == 0:
        return [0] * len(weights)
    floors = [total * w // weight_sum for w in weights]
    remainders = [total * w % weight_sum for w in weights]
    short = total - sum(floors)
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[:short]:
        floors[i] += 1
    return floors


def _holder_util(gpu: GpuSample, holder: Holder, alone: bool) -> tuple[float | None, int | None]:
    """Measured SM share and memory of one holder: its container's processes if NVML saw
    them, else the whole GPU when it is the only holder."""
    if holder.container_id:
        procs = [p for p in gpu.processes if p.container_id == holder.container_id]
        if procs:
            utils = [p.sm_util_pct for p in procs if p.sm_util_pct is not None]
            mems = [p.mem_used_bytes for p in procs if p.mem_used_bytes is not None]
            return (min(100.0, sum(utils)) if utils else None), (sum(mems) if mems else None)
    if alone:
        util = gpu.sm_active_pct if gpu.sm_active_pct is not None else gpu.util_gpu_pct
        return util, gpu.mem_used_bytes
    if not gpu.processes:  # nobody measured on a shared GPU: nobody used it
        return 0.0, None
    return None, None


def normalise_shares(holders: list[Holder]) -> list[int]:
    """Shares in thousandths; an over-committed GPU (sum > 1000, bad input) is scaled down."""
    shares = [h.share_milli for h in holders]
    if sum(shares) > 1000:
        shares = split_integer(1000, shares)
    return shares


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
    holders = sorted(holders)
    down = gpu.health == GpuHealth.down
    # (state, holder or None, share_milli, util, mem)
    slices: list[tuple[UsageState, Holder | None, int, float | None, int | None]] = []
    if down:
        slices.append((UsageState.down, None, 1000, None, None))
    else:
        shares = normalise_shares(holders)
        for holder, share in zip(holders, shares):
            util, mem = _holder_util(gpu, holder, alone=len(holders) == 1 and share == 1000)
            state = UsageState.executing if holder.running else UsageState.allocated_idle
            slices.append((state, holder, share, util, mem))
        rest = 1000 - sum(shares)
        if rest > 0:
            util = gpu.util_gpu_pct if not holders else None
            slices.append((UsageState.unallocated, None, rest, util, None if holders else gpu.mem_used_bytes))

    # shares always sum to 1000 here, so this is duration x share / 1000, summing to duration exactly
    gpu_ms = split_integer(duration, [s[2] for s in slices])
    total_cost = ledger.interval_cost_micros(gpu.model, duration, energy_j)
    costs = split_integer(total_cost, gpu_ms)
    coef = ledger.coefficient_at(gpu.model, start_ms)

    records = []
    for slot, ((state, holder, share, util, mem), g_ms, cost) in enumerate(zip(slices, gpu_ms, costs)):
        records.append(UsageRecord(
            record_id=f"{gpu.gpu_uuid}/{start_ms}/{slot}",
            cluster=cluster,
            node=node,
            gpu_uuid=gpu.gpu_uuid,
            gpu_model=gpu.model,
            start_ms=start_ms,
            end_ms=end_ms,
            state=state,
            job_id=holder.job_id if holder else "",
            attempt=holder.attempt if holder else 0,
            tenant=holder.tenant if holder else "",
            queue=holder.queue if holder else "",
            share_milli=share,
            gpu_ms=g_ms,
            util_pct=util,
            mem_used_bytes=mem,
            energy_j=energy_j * g_ms / duration,
            coefficient=coef.coefficient,
            coefficient_version=coef.version,
            effective_gpu_ms=round(g_ms * coef.coefficient),
            cost_micros=cost,
            definition_version=ledger.definition_version,
        ))
    return records
