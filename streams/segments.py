"""Segments (docs/accounting.md, "Segments"): the records of consecutive closed ticks of one GPU add
up into one record per holder and state until the holders or states change, the GPU misses a
tick, or a tick starts at or after the segment's window end. Costs, GPU-ms and effective GPU-ms
are sums of the per-tick figures, utilization and memory gpu_ms-weighted means.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gpuledger.streams.attribution import MAX_MEM_BYTES, Holder, Piece





def holder_state(h: Holder) -> dict:
    return asdict(h)


def piece_key(template: dict, pieces: list[Piece]) -> tuple:
    """What must stay the same for samples to add up into one segment: the record template's entries
    and, per slot, state, holder and whether utilization and memory are measured at all (so that
    views weighting util by gpu_ms over the records that have it stay exact). The definition version
    too: a segment restored from a snapshot taken under another ledger never takes in samples priced
    under this one (a record names one definition)."""
    return (template["cluster"], template["gpu_model"], template["coefficient_version"], template["price_version"],
            tuple((p.state, p.holder, p.util_pct is None, p.mem_used_bytes is None) for p in pieces),
            template["definition_version"])


def _segment_key(template: dict, slots: list[list]) -> tuple:
    """`piece_key` of the pieces a segment's slots started with (a restored segment)."""
    return (template["cluster"], template["gpu_model"], template["coefficient_version"], template["price_version"],
            tuple((sl[0], sl[1], sl[7] is None, sl[9] is None) for sl in slots), template["definition_version"])


#: the largest integer a snapshot (JSON through orjson) holds
_MAX_JSON_INT = 2**63 - 1


def _storable(memory_sum: int | float) -> int | float:
    """A slot's memory x time sum as a snapshot can hold it: past 64 bits (only a bogus memory reading
    over a long segment gets there) a float, else every snapshot of the worker fails."""
    return memory_sum if memory_sum <= _MAX_JSON_INT else float(memory_sum)


#: a segment slot, as a list: state, holder, Σ share × ms, gpu_ms, energy_j, cost_micros,
#: effective_gpu_ms, then the first piece's util, metric, memory (a one-piece record keeps them
#: exact), Σ util × gpu_ms, Σ metric × gpu_ms, Σ mem × gpu_ms, Σ util × ms, Σ metric × ms, Σ mem × ms
_SLOT_SUMS = 16


def new_slot(p: Piece, metric, duration: int) -> list:
    util, mem, g = p.util_pct, p.mem_used_bytes, p.gpu_ms
    m = None if util is None else metric(util)
    return [p.state, p.holder, p.share_milli * duration, g, p.energy_j, p.cost_micros, p.effective_gpu_ms,
            util, m, mem,
            0.0 if util is None else util * g, 0.0 if m is None else m * g, 0 if mem is None else mem * g,
            0.0 if util is None else util * duration, 0.0 if m is None else m * duration,
            0 if mem is None else mem * duration]


def _add_to_slot(sl: list, share_milli: int, g: int, energy: float, cost: int, effective: int, util, mem,
                 duration: int, metric) -> None:
    """Add one piece (gpu_ms g of a stretch of `duration`) to a segment slot's sums."""
    sl[2] += share_milli * duration
    sl[3] += g
    sl[4] += energy
    sl[5] += cost
    sl[6] += effective
    if util is not None:
        m = metric(util)
        sl[10] += util * g
        sl[11] += m * g
        sl[13] += util * duration
        sl[14] += m * duration
    if mem is not None:
        sl[12] += mem * g
        sl[15] += mem * duration


@dataclass(slots=True)
class Segment:
    """One GPU's open segment: consecutive pieces of closed ticks with the same key, summed."""

    start_ms: int
    end_ms: int
    window_end_ms: int
    template: dict
    key: tuple
    slots: list[list]
    samples: int = 1
    pieces: int = 1
    last_tick_ms: int = 0

    def add(self, pieces: list[Piece], metric, start_ms: int, end_ms: int, tick_ms: int) -> None:
        duration = end_ms - start_ms
        for sl, p in zip(self.slots, pieces):
            _add_to_slot(sl, p.share_milli, p.gpu_ms, p.energy_j, p.cost_micros, p.effective_gpu_ms, p.util_pct,
                         p.mem_used_bytes, duration, metric)
        self._extended(end_ms, tick_ms)

    def extend(self, whole: tuple, metric, start_ms: int, end_ms: int, tick_ms: int) -> bool:
        """Add a whole-GPU stretch (`RecordMaker.whole`) if it continues this segment: it starts at the
        segment's end, inside its window, with the segment's template (the same object) and the key of
        its one slot (state, holder, what is measured). False: nothing added, and the caller takes the
        general path (the stretch's pieces, `piece_key`, `add`), which gives the same sums. The hot path:
        no pieces, no key built."""
        template, state, holder, util, mem, energy, cost, effective = whole
        if self.end_ms != start_ms or start_ms >= self.window_end_ms or template is not self.template:
            return False
        slots = self.key[4]
        if len(slots) != 1:
            return False
        key_state, key_holder, no_util, no_mem = slots[0]
        if key_state != state or no_util != (util is None) or no_mem != (mem is None) or \
                not (key_holder is holder or key_holder == holder):
            return False
        duration = end_ms - start_ms
        _add_to_slot(self.slots[0], 1000, duration, energy, cost, effective, util, mem, duration, metric)
        self._extended(end_ms, tick_ms)
        return True

    def _extended(self, end_ms: int, tick_ms: int) -> None:
        self.end_ms = end_ms
        self.pieces += 1
        if tick_ms != self.last_tick_ms:
            self.samples += 1
            self.last_tick_ms = tick_ms

    def records(self, fill) -> list[dict]:
        """The segment's usage records (wire dicts): sums, and gpu_ms-weighted means of utilization
        and memory (time-weighted where a slot has no GPU time at all)."""
        duration = self.end_ms - self.start_ms
        out = []
        uuid = self.template["gpu_uuid"]
        for slot, sl in enumerate(self.slots):
            state, holder, share_ms, gpu_ms, energy, cost, effective, util, metric, mem = sl[:10]
            if self.pieces > 1:
                weight, at = (gpu_ms, 10) if gpu_ms else (duration, 13)
                if util is not None:
                    util, metric = sl[at] / weight, sl[at + 1] / weight
                if mem is not None:  # the float division can round a mean past what any sample said (2**63)
                    mem = min(MAX_MEM_BYTES, round(sl[at + 2] / weight))
            out.append(fill(self.template, uuid, self.start_ms, self.end_ms, slot, state, holder,
                            min(1000, round(share_ms / duration)), util, mem, gpu_ms, energy, cost, effective,
                            metric, self.samples))
        return out

    def to_state(self) -> list:
        return [self.start_ms, self.end_ms, self.window_end_ms, self.template, self.samples, self.pieces,
                self.last_tick_ms,
                [[sl[0], None if sl[1] is None else holder_state(sl[1]), *sl[2:12], _storable(sl[12]), *sl[13:15],
                  _storable(sl[15])] for sl in self.slots]]

    @classmethod
    def from_state(cls, state: list) -> "Segment":
        start, end, window_end, template, samples, pieces, last_tick, slots = state
        slots = [[sl[0], None if sl[1] is None else Holder(**sl[1]), *sl[2:]] for sl in slots]
        return cls(start, end, window_end, template, _segment_key(template, slots), slots, samples, pieces, last_tick)
