from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

from gpuledger.schemas.models import GpuHealth, GpuSample, MeteredGpu, UsageState
from gpuledger.streams.pricing import MAX_POWER_W, Definitions, LedgerConfig

UNIT = 1_000_000  # weights of one GPU in millionths
#: the most memory a record says (bytes): what the wire (64-bit integers) and the sink's checks take
MAX_MEM_BYTES = 2**63 - 1
DOWN, UNALLOCATED = UsageState.down.value, UsageState.unallocated.value
ALLOCATED_IDLE, EXECUTING = UsageState.allocated_idle.value, UsageState.executing.value


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


class Piece(NamedTuple):
    """One slot of one GPU over one stretch of one sample: what a usage record of it carries."""

    state: str
    holder: Holder | None
    share_milli: int
    util_pct: float | None
    mem_used_bytes: int | None
    gpu_ms: int
    energy_j: float
    cost_micros: int
    effective_gpu_ms: int       # gpu_ms x coefficient, rounded per sample (segments add these up)


class Slice(NamedTuple):
    state: str                  # a UsageState value
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


#: What attribution reads of a GPU's sample: the worker's MeteredGpu, or a whole GpuSample.
Gpu = MeteredGpu | GpuSample


def measured_use(gpu: Gpu, holder: Holder) -> tuple[float | None, int | None]:
    """SM share (percent of the GPU) and memory of one holder's container, if NVML saw it."""
    container = holder.container_id
    if not container or not gpu.processes:
        return None, None
    util = mem = None
    for p in gpu.processes:  # one pass: this is on the hot path for every held GPU
        if p.container_id == container:
            if p.sm_util_pct is not None:
                util = p.sm_util_pct if util is None else util + p.sm_util_pct
            if p.mem_used_bytes is not None:
                mem = p.mem_used_bytes if mem is None else mem + p.mem_used_bytes
    # a container's processes can sum past what a record holds (bogus readings): capped like util
    return (None if util is None else min(100.0, util)), (mem if mem is None or mem <= MAX_MEM_BYTES else MAX_MEM_BYTES)


def whole_gpu_util(gpu: Gpu) -> float | None:
    """The GPU's own utilization: SM activity where measured, else GPU busy."""
    return gpu.sm_active_pct if gpu.sm_active_pct is not None else gpu.util_gpu_pct


def _time_split(gpu: Gpu, holders: list[Holder], shares: list[int]) -> list[Slice]:
    """Each holder gets its allocated share, executing or idle by its state."""
    alone = len(holders) == 1
    slices = []
    for holder, share in zip(holders, shares):
        util, mem = measured_use(gpu, holder)
        if util is None and alone:
            util, mem = whole_gpu_util(gpu), gpu.mem_used_bytes
        slices.append(Slice(EXECUTING if holder.running else ALLOCATED_IDLE, holder, share * 1000, util, mem))
    return slices


def _use_weight(gpu: Gpu, holder: Holder, share: int, d: Definitions) -> tuple[int, float | None, int | None]:
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


def _measured_split(gpu: Gpu, holders: list[Holder], shares: list[int], d: Definitions) -> list[Slice]:
    """Executing slices by measured use; the unused rest of the held part is idle."""
    held = sum(shares) * 1000
    uses = [(_use_weight(gpu, h, s, d) if h.running else (0, None, None)) for h, s in zip(holders, shares)]
    total_use = sum(u[0] for u in uses)
    if total_use > held:  # measured more than held (bursting into the free part): scale to the held part
        scaled = split_integer(held, [u[0] for u in uses])
        uses = [(w, u[1], u[2]) for w, u in zip(scaled, uses)]
        total_use = held
    slices = [Slice(EXECUTING, h, w, util, mem) for h, (w, util, mem) in zip(holders, uses) if w > 0]
    unused = held - total_use
    if unused > 0:
        if d.shared_unused == "holders":
            for h, w in zip(holders, split_integer(unused, shares)):
                if w > 0:
                    slices.append(Slice(ALLOCATED_IDLE, h, w, None, None))
        else:
            slices.append(Slice(UNALLOCATED, None, unused, None, None))
    return slices


def _whole(gpu: Gpu, holders: list[Holder]) -> tuple[str, Holder | None, float | None, int | None] | None:
    """The common cases, where the whole GPU is in one state: down, free, or held whole by one
    attempt. (state, holder, util, memory); None when the GPU is shared."""
    if gpu.health is GpuHealth.down:
        return DOWN, None, None, None
    if not holders:
        return UNALLOCATED, None, whole_gpu_util(gpu), gpu.mem_used_bytes
    if len(holders) == 1 and holders[0].share_milli == 1000:
        holder = holders[0]
        util, mem = measured_use(gpu, holder)
        if util is None:
            util, mem = whole_gpu_util(gpu), gpu.mem_used_bytes
        return (EXECUTING if holder.running else ALLOCATED_IDLE), holder, util, mem
    return None


def _shared_slices(gpu: Gpu, holders: list[Holder], d: Definitions) -> list[Slice]:
    """How a shared GPU's whole (UNIT) splits into states and holders; the weights add up to UNIT."""
    holders = sorted(holders)
    shares = normalise_shares(holders)
    if d.shared_split == "measured":
        slices = _measured_split(gpu, holders, shares, d)
    else:
        slices = _time_split(gpu, holders, shares)
    rest = UNIT - sum(s.weight for s in slices)
    if rest > 0:
        unallocated = [i for i, s in enumerate(slices) if s.state == UNALLOCATED]
        if unallocated:  # the shared GPU's unused part already went to the platform: one record
            slices[unallocated[0]] = slices[unallocated[0]]._replace(weight=slices[unallocated[0]].weight + rest)
        else:
            slices.append(Slice(UNALLOCATED, None, rest, None, None))
    return slices


def whole_pieces(whole: tuple, duration: int) -> tuple[dict, list[Piece]]:
    """`RecordMaker.pieces` of a stretch that `RecordMaker.whole` gave: its template and its one Piece."""
    template, state, holder, util, mem, energy, cost, effective = whole
    return template, [Piece(state, holder, 1000, util, mem, duration, energy, cost, effective)]


class RecordMaker:
    """Usage records of one node's GPUs. What every record of a GPU shares (cluster, node, model,
    coefficient entry, definition version) goes into a template made once per GPU and coefficient
    entry; a record is a copy of it with the slice's own values filled in. The worker's hot path:
    one maker per close of a node's ticks."""

    def __init__(self, ledger: LedgerConfig, cluster: str, node: str):
        self.ledger = ledger
        self.cluster = cluster
        self.node = node
        self.metric = ledger.definitions.utilization_metric
        self._templates: dict[tuple[str, str], dict] = {}
        #: model -> (from, until, price entry, coefficient entry): the entries valid in [from, until)
        self._entries: dict[str, tuple[float, float, object, object]] = {}

    def entries(self, model: str, ts_ms: int):
        """(price entry, coefficient entry) valid at ts_ms, remembered until either history changes
        (the hot path asks for every GPU of every tick)."""
        cached = self._entries.get(model)
        if cached is not None and cached[0] <= ts_ms < cached[1]:
            return cached[2], cached[3]
        ledger = self.ledger
        bounds = sorted({e.valid_from_ms for history in (ledger.price_history, ledger.coefficients)
                         for name in (model, "default") for e in history.get(name, ())})
        i = bisect.bisect_right(bounds, ts_ms)
        price, coef = ledger.price_at(model, ts_ms), ledger.coefficient_at(model, ts_ms)
        self._entries[model] = (bounds[i - 1] if i else -math.inf, bounds[i] if i < len(bounds) else math.inf,
                                price, coef)
        return price, coef

    def _template(self, gpu: Gpu, coef, price) -> dict:
        key = (gpu.gpu_uuid, gpu.model, coef.version, price.version)  # the model too: two unpriced models share versions
        template = self._templates.get(key)
        if template is None:
            # every key of the record, in the model's order, so that copies need no resizing
            template = self._templates[key] = {
                "schema_version": 1, "record_id": "", "cluster": self.cluster, "node": self.node,
                "gpu_uuid": gpu.gpu_uuid, "gpu_model": gpu.model, "start_ms": 0, "end_ms": 0, "state": "",
                "job_id": "", "attempt": 0, "tenant": "", "queue": "", "share_milli": 0, "gpu_ms": 0,
                "energy_j": 0.0, "coefficient": coef.coefficient, "coefficient_version": coef.version,
                "effective_gpu_ms": 0, "cost_micros": 0, "definition_version": self.ledger.definition_version,
                "price_version": price.version,
                # no price or no coefficient of its own: priced under the [unpriced] policy (pricing.py)
                "priced_by_default": price.model != gpu.model or coef.model != gpu.model,
                "sample_count": 1,
            }
        return template

    def whole(self, gpu: Gpu, holders: list[Holder], start_ms: int, end_ms: int, energy_j: float) -> tuple | None:
        """`pieces` of a GPU in one state for the whole stretch (`_whole`: down, free, or held whole by
        one attempt), without building them: (template, state, holder, util, memory, energy_j, cost,
        effective GPU-ms) of its one slot, whose gpu_ms is the duration. None: a shared GPU or an empty
        stretch (`shared_pieces` tells which). The worker's hot path extends open segments with it."""
        duration = end_ms - start_ms
        if duration <= 0:
            return None
        whole = _whole(gpu, holders)
        if whole is None:
            return None
        template, cost, energy_j, coefficient = self._priced(gpu, start_ms, duration, energy_j)
        state, holder, util, mem = whole
        return (template, state, holder, util, mem, energy_j * duration / duration, cost,
                round(duration * coefficient))

    def _priced(self, gpu: Gpu, start_ms: int, duration: int, energy_j: float) -> tuple[dict, int, float, float]:
        """(record template, the whole GPU's cost, its energy made believable, coefficient) of a stretch."""
        price, coef = self.entries(gpu.model, start_ms)
        cost = self.ledger.entry_cost_micros(price, gpu.model, duration, energy_j)
        # the join caps energy at the card's power limit; this is the backstop of pricing.py (no GPU draws
        # more than MAX_POWER_W), so a record's energy is always a finite, believable number
        most = MAX_POWER_W * duration / 1000.0
        energy_j = float(energy_j) if 0.0 <= energy_j <= most else (most if energy_j > 0 else 0.0)
        return self._template(gpu, coef, price), cost, energy_j, coef.coefficient

    def pieces(self, gpu: Gpu, holders: list[Holder], start_ms: int, end_ms: int,
               energy_j: float) -> tuple[dict, list[Piece]] | None:
        """How one GPU's [start_ms, end_ms) splits, given the attempts holding it: the record template
        (cluster, node, model, coefficient and price entries) and one Piece per slot, whose gpu_ms add
        up to the duration and whose costs to the GPU's cost for it. None for an empty stretch. The
        node join adds the pieces of consecutive ticks up into segments (streams/join.py)."""
        whole = self.whole(gpu, holders, start_ms, end_ms, energy_j)
        if whole is not None:
            return whole_pieces(whole, end_ms - start_ms)
        return self.shared_pieces(gpu, holders, start_ms, end_ms, energy_j)

    def shared_pieces(self, gpu: Gpu, holders: list[Holder], start_ms: int, end_ms: int,
                      energy_j: float) -> tuple[dict, list[Piece]] | None:
        """`pieces` of a stretch that `whole` does not cover (a shared GPU); None for an empty one."""
        duration = end_ms - start_ms
        if duration <= 0:
            return None
        template, cost, energy_j, coefficient = self._priced(gpu, start_ms, duration, energy_j)
        slices = _shared_slices(gpu, holders, self.ledger.definitions)
        gpu_ms = split_integer(duration, [s.weight for s in slices])
        costs = split_integer(cost, gpu_ms)
        return template, [Piece(piece.state, piece.holder, round(piece.weight / 1000), piece.util_pct,
                                piece.mem_used_bytes, g_ms, energy_j * g_ms / duration, piece_cost,
                                round(g_ms * coefficient))
                          for piece, g_ms, piece_cost in zip(slices, gpu_ms, costs)]

    def records(self, gpu: Gpu, holders: list[Holder], start_ms: int, end_ms: int, energy_j: float) -> list[dict]:
        """Usage records of one GPU over [start_ms, end_ms) given the attempts holding it (one sample's
        records; the worker adds samples up into segments instead)."""
        made = self.pieces(gpu, holders, start_ms, end_ms, energy_j)
        if made is None:
            return []
        template, pieces = made
        return [self._fill(template, gpu.gpu_uuid, start_ms, end_ms, slot, p.state, p.holder, p.share_milli,
                           p.util_pct, p.mem_used_bytes, p.gpu_ms, p.energy_j, p.cost_micros, p.effective_gpu_ms)
                for slot, p in enumerate(pieces)]

    def _fill(self, template: dict, gpu_uuid: str, start_ms: int, end_ms: int, slot: int, state: str,
              holder: Holder | None, share_milli: int, util: float | None, mem: int | None, gpu_ms: int,
              energy_j: float, cost_micros: int, effective_gpu_ms: int, util_metric: float | None = None,
              sample_count: int = 1) -> dict:
        """One UsageRecord in its wire form (None fields left out). `util_metric`: the utilization
        under the agreed definition when it is not the metric of `util` (a segment's mean of it)."""
        record = template.copy()
        record["record_id"] = f"{gpu_uuid}/{start_ms}/{slot}"
        record["start_ms"] = start_ms
        record["end_ms"] = end_ms
        record["state"] = state
        if holder is not None:
            record["job_id"] = holder.job_id
            record["attempt"] = holder.attempt
            record["tenant"] = holder.tenant
            record["queue"] = holder.queue
        record["share_milli"] = share_milli
        record["gpu_ms"] = gpu_ms
        record["energy_j"] = energy_j
        record["effective_gpu_ms"] = effective_gpu_ms
        record["cost_micros"] = cost_micros
        if util is not None:
            record["util_pct"] = util
            record["util_metric_pct"] = self.metric(util) if util_metric is None else util_metric
        if mem is not None:
            record["mem_used_bytes"] = mem
        record["sample_count"] = sample_count
        return record


def attribute(
    *,
    cluster: str,
    node: str,
    gpu: Gpu,
    holders: list[Holder],
    start_ms: int,
    end_ms: int,
    energy_j: float,
    ledger: LedgerConfig,
) -> list[dict]:
    """Usage records of one GPU over [start_ms, end_ms) given the attempts holding it.

    Records are plain dicts in the wire form of `UsageRecord` (what `encode` would give: enums as
    strings, None fields left out), built without a model per record because this is the hot path
    of the worker; tests check them against the `UsageRecord` schema. (The worker uses one
    `RecordMaker` per node instead of this one-off form.)"""
    return RecordMaker(ledger, cluster, node).records(gpu, holders, start_ms, end_ms, energy_j)
