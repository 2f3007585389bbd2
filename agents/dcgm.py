"""dcgm-exporter's `/metrics` text -> the ledger's GPU samples. Pure: no I/O, no clock.

Sites that already run NVIDIA's dcgm-exporter feed line 1 from it instead of the NVML agent
(`gpuledger agent dcgm`, agents/dcgm_agent.py). The mapping, units and limits are in docs/dcgm.md.

    rows = parse_exposition(text)                      # ExpositionError on malformed text
    samples, state = gpu_samples(rows, state, hostname=None)

The text is parsed with prometheus_client's parser. Rows are grouped by the GPU's UUID; the
`gpu` label is the device index. What the exporter adds on top of the DCGM values:
- MIG: rows of a GPU instance carry the parent's UUID plus `GPU_I_ID` / `GPU_I_PROFILE`; they
  become the parent's `mig_devices`. The exporter gives no MIG device UUID (only its DRA mode
  adds `dra_mig_device_uuid`), so without it the instance is named `<parent UUID>/gi/<GPU_I_ID>`,
  a name no scheduler uses: allocations naming MIG UUIDs do not resolve through it.
- Holders: with its Kubernetes mapping a row names a pod (`pod`/`namespace`/`container`, or the
  old `pod_name`/`pod_namespace`/`container_name`), with its HPC mapping a job (`hpc_job`); a GPU
  held by several is repeated once per holder with the same value. Holders become processes
  (pid 0) named by `holder_container_id`. In its per-process mode (shared GPUs, 4.5.3+) the GPU's
  own row is kept next to per-pod rows of GPU_UTIL and FB_USED, which then hold each pod's part.
- Vanished GPUs: DCGM stops exporting a GPU that fell off the bus (Xid 79, GPU_IS_LOST). A GPU seen
  earlier in this agent run and missing now is reported down (index, model, memory total as last
  seen) until it comes back or the agent restarts, as the NVML agent keeps a lost GPU's slot.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from gpuledger.agents.backend import FATAL_XIDS, xid_down_reason
from gpuledger.agents.nvml_backend import ledger_model_name
from gpuledger.schemas.models import GpuHealth, GpuSample, MigDevice, ProcessSample

log = logging.getLogger(__name__)

MIB = 1 << 20

#: dcgm-exporter metric -> (GpuSample field, factor to the field's unit). Units as DCGM reports them.
FIELDS: dict[str, tuple[str, float]] = {
    "DCGM_FI_DEV_GPU_UTIL": ("util_gpu_pct", 1.0),                    # percent
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active_pct", 100.0),               # ratio 0-1
    "DCGM_FI_DEV_FB_USED": ("mem_used_bytes", MIB),                   # MiB
    "DCGM_FI_DEV_FB_TOTAL": ("mem_total_bytes", MIB),                 # MiB
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_c", 1.0),                   # degrees C
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1.0),                      # W
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": ("power_limit_w", 1.0),       # W (0: none, dropped by the schema)
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_j", 1e-3),       # mJ since driver load
    "DCGM_FI_DEV_SM_CLOCK": ("sm_clock_mhz", 1.0),                    # MHz
    "DCGM_FI_DEV_MEM_CLOCK": ("mem_clock_mhz", 1.0),                  # MHz
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_tx_bytes_per_s", 1.0),       # a rate, bytes/s
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_rx_bytes_per_s", 1.0),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("nvlink_tx_bytes_per_s", 1.0),   # a rate, bytes/s
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("nvlink_rx_bytes_per_s", 1.0),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("throttle_reasons", 1.0),    # bitmask (DCGM 3.3+ name)
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("throttle_reasons", 1.0),  # bitmask (older name)
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_total", 1.0),          # count
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_total", 1.0),          # count
}
MEASURED_FIELDS = frozenset(name for name, _ in FIELDS.values())
INTEGER_FIELDS = frozenset({"mem_used_bytes", "mem_total_bytes", "throttle_reasons", "ecc_sbe_total", "ecc_dbe_total"})
XID = "DCGM_FI_DEV_XID_ERRORS"          # gauge: the value of the last Xid, not a count
FB_FREE = "DCGM_FI_DEV_FB_FREE"         # MiB; total = used + free (+ reserved) when no FB_TOTAL
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
KNOWN_METRICS = frozenset(FIELDS) | {XID, FB_FREE, FB_RESERVED}
#: The exporter splits these two per pod in its per-process mode (transformation/process_metrics.go).
PER_HOLDER_FIELDS = {"DCGM_FI_DEV_GPU_UTIL": "sm_util_pct", "DCGM_FI_DEV_FB_USED": "mem_used_bytes"}
MAX_PER_HOLDER = {"sm_util_pct": 100.0, "mem_used_bytes": 1 << 30}  # percent; MiB (a blank is larger)

#: Label spellings across exporter versions and options (UseOldNamespace, #655 hostname rename).
UUID_LABELS = ("UUID", "uuid")
HOSTNAME_LABELS = ("Hostname", "hostname")
MODEL_LABELS = ("modelName", "model_name")
POD_LABELS = (("pod", "namespace", "container"), ("pod_name", "pod_namespace", "container_name"))
HPC_JOB_LABEL = "hpc_job"
MIG_UUID_LABEL = "dra_mig_device_uuid"

#: Compute slices of a whole GPU by ledger model, for a MIG instance's share (`<n>g.` profiles).
MIG_SLICES = {"A30": 4}
DEFAULT_MIG_SLICES = 7  # A100, H100, H200, B200


class ExpositionError(ValueError):
    """The scrape is not usable: malformed text, or no rows of the node asked for."""


@dataclass(frozen=True)
class Row:
    """One sample line of a known DCGM metric."""

    metric: str
    labels: dict[str, str]
    value: float

    def label(self, names: Iterable[str]) -> str:
        """The first of `names` this row carries, '' if none."""
        return next((self.labels[n] for n in names if self.labels.get(n)), "")

    @property
    def gpu_instance(self) -> str:
        return self.labels.get("GPU_I_ID", "")


@dataclass(frozen=True)
class SeenGpu:
    """A GPU this agent run has seen: what its down sample needs if it goes missing from the scrape."""

    index: int
    model: str
    mem_total_bytes: int | None = None
    missing: bool = False  # missing from the last scrape (reported down)


#: down_reason of a GPU seen earlier in this agent run and missing from the current scrape.
MISSING_REASON = "missing from the dcgm-exporter scrape (fallen off the bus?)"


@dataclass(frozen=True)
class DcgmState:
    """What one scrape leaves for the next, per GPU UUID: the Xid gauge's last value, the
    fatal Xid seen arriving while the agent runs (sticky until the agent restarts, as in the NVML backend:
    a reset is needed; a fatal value already in the gauge at the first scrape is not one, docs/dcgm.md),
    every GPU seen in this run (a GPU that vanishes from the scrape is reported down), and each GPU's
    energy counter as last scraped (a repeat is the exporter's previous collection, not a new reading)."""

    last_xid: dict[str, int] = field(default_factory=dict)
    fatal_xid: dict[str, int] = field(default_factory=dict)
    seen: dict[str, SeenGpu] = field(default_factory=dict)
    last_energy: dict[str, float] = field(default_factory=dict)  # counter as last scraped, joules
    repeat_warned: bool = False


def parse_exposition(text: str) -> list[Row]:
    """The rows of known DCGM metrics in a Prometheus text exposition; others are ignored.
    ExpositionError when the text does not parse (the whole scrape is then unusable)."""
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, but also IndexError/KeyError on some inputs
        raise ExpositionError(f"malformed exposition: {type(exc).__name__}: {exc}") from None
    rows = []
    for family in families:
        for sample in family.samples:
            # Counters are '<name>_total' after some relabelling pipelines; DCGM names are upper case.
            metric = sample.name.removesuffix("_total")
            if metric in KNOWN_METRICS:
                rows.append(Row(metric, dict(sample.labels), float(sample.value)))
    return rows


def exposition_hostnames(rows: Iterable[Row]) -> list[str]:
    """The distinct Hostname labels of the rows, in order of appearance."""
    return list(dict.fromkeys(h for r in rows if (h := r.label(HOSTNAME_LABELS))))


def rows_of_host(rows: list[Row], hostname: str | None) -> list[Row]:
    """The rows of `hostname` when the endpoint serves several hosts; all rows when it serves one
    (in Kubernetes the label is the exporter pod's name, not the node's, unless NODE_NAME is set)."""
    hosts = exposition_hostnames(rows)
    if len(hosts) <= 1 or hostname is None:
        if len(hosts) > 1:
            raise ExpositionError(f"the endpoint serves several hosts ({', '.join(hosts)}); name the node")
        return rows
    if hostname not in hosts:
        raise ExpositionError(f"the endpoint serves hosts {', '.join(hosts)}; none is {hostname!r}")
    return [r for r in rows if r.label(HOSTNAME_LABELS) in ("", hostname)]


def holder_container_id(labels: dict[str, str]) -> str | None:
    """The container id the ledger matches a GPU holder by, from the exporter's mapping labels:
    - Kubernetes mapping: `k8s://<namespace>/<pod>/<container>` (container may be empty);
    - HPC job mapping (Slurm): `slurm-job-<hpc_job>`, the name the Slurm agent gives a job's
      container (`slurm-job-<raw job id>`).
    None when the row names no holder (the exporter writes empty pod labels for a free GPU)."""
    for pod_label, namespace_label, container_label in POD_LABELS:
        pod = labels.get(pod_label, "")
        if pod:
            return f"k8s://{labels.get(namespace_label, '')}/{pod}/{labels.get(container_label, '')}"
    job = labels.get(HPC_JOB_LABEL, "")
    return f"slurm-job-{job}" if job else None


def mig_share_milli(profile: str, model: str) -> int | None:
    """A MIG instance's share of its GPU from its profile ('3g.40gb' -> 3 of 7 slices -> 428)."""
    match = re.match(r"(\d+)g\.", profile)
    if not match:
        return None
    slices = MIG_SLICES.get(model, DEFAULT_MIG_SLICES)
    return max(1, min(1000, int(match.group(1)) * 1000 // slices))


def is_blank(value: float) -> bool:
    """DCGM's 'no value' sentinels, which the exporter prints as numbers (dcgm_structs.h):
    int32 blank 0x7ffffff0.. (+ not found / not supported / no permission), int64 blank
    0x7ffffffffffffff0.., fp64 blank 2**47..; e.g. the README's MEMORY_TEMP 9223372036854775794.
    Any non-finite value (NaN, +Inf, -Inf) is blank too: no reading is infinite (and int() of one fails)."""
    return (not math.isfinite(value) or value >= 0x7FFFFFFFFFFFFFF0 or 0x7FFFFFF0 <= value <= 0x7FFFFFFF
            or 2.0**47 <= value <= 2.0**47 + 16)


def gpu_samples(rows: list[Row], previous: DcgmState, *, hostname: str | None = None
                ) -> tuple[list[GpuSample], DcgmState]:
    """One GpuSample per GPU (by UUID) in the rows of `hostname` (see rows_of_host), ordered by
    index, and the state for the next scrape. Rows without a GPU UUID (NvSwitch, CPU) are ignored.
    A GPU seen earlier in this run and missing now is reported down (see _missing_samples).
    ExpositionError when there are no GPU rows although GPUs were seen before: the exporter serves
    all its GPUs at once, so that is the exporter restarting or not ready, not every GPU lost."""
    by_gpu: dict[str, list[Row]] = {}
    for row in rows_of_host(rows, hostname):
        uuid = row.label(UUID_LABELS)
        if uuid and row.labels.get("gpu", "").isdigit():
            by_gpu.setdefault(uuid, []).append(row)
    if not by_gpu and previous.seen:
        raise ExpositionError(f"the exporter serves no GPU (restarting?); {len(previous.seen)} seen before")
    last_xid, fatal_xid = dict(previous.last_xid), dict(previous.fatal_xid)
    last_energy, repeat_warned = dict(previous.last_energy), previous.repeat_warned
    samples = []
    for uuid, gpu_rows in by_gpu.items():
        xid = _last_xid(gpu_rows)
        # A GPU's first scrape only sets the baseline: when its Xid happened is unknown. A blank gauge
        # is "no Xid yet" (0), so the first value after it is new; a blank later changes nothing.
        first_scrape = uuid not in last_xid
        new_xids = [xid] if xid and not first_scrape and last_xid[uuid] != xid else []
        last_xid[uuid] = xid if xid is not None else last_xid.get(uuid, 0)
        # Only a fatal Xid seen *arriving* takes the GPU down. dcgm-exporter keeps serving the last
        # Xid after the GPU is reset (until the exporter restarts: dcgm-exporter#500, DCGM#277), so a
        # fatal value already there at the first scrape may be stale, from before a repair.
        if new_xids and xid in FATAL_XIDS:
            fatal_xid.setdefault(uuid, xid)
        elif first_scrape and xid in FATAL_XIDS:
            log.warning("GPU %s: the exporter's last Xid is fatal (%s) but from before this agent started "
                        "(possibly stale: the exporter keeps it after a GPU reset); not reporting the GPU down",
                        uuid, xid_down_reason(xid))
        sample = _gpu_sample(uuid, gpu_rows, new_xids, fatal_xid.get(uuid))
        if sample.energy_j is not None and last_energy.get(uuid) == sample.energy_j:
            # The exporter serves its last collection until the next (`-c`, 30 s by default): a counter
            # that did not move is that collection again, not this tick's energy. Reported as such, the
            # ticks between collections showed 0 J and the next one 30 s of energy (over the power
            # limit, so power x time): a busy GPU billed a sixth of its energy. None: power x time.
            if not repeat_warned:
                repeat_warned = True
                log.warning("GPU %s: the exporter's energy counter did not move since the last scrape: its collection "
                            "interval (-c, DCGM_EXPORTER_INTERVAL) is not shorter than the agent's --interval; a tick "
                            "on a repeated collection reports no energy (the ledger uses power x time)", uuid)
            sample = sample.model_copy(update={"energy_j": None})
        elif sample.energy_j is not None:
            last_energy[uuid] = sample.energy_j
        samples.append(sample)
    seen = _present(samples, previous.seen)
    samples += _missing_samples(previous.seen, seen)
    state = DcgmState(last_xid, fatal_xid, seen, last_energy, repeat_warned)
    return sorted(samples, key=lambda g: g.index), state


# --------------------------------------------------------------------------- vanished GPUs
def _present(samples: list[GpuSample], previous: dict[str, SeenGpu]) -> dict[str, SeenGpu]:
    """The GPUs of this scrape as seen now (a memory total once known is kept when it goes blank)."""
    seen = {}
    for g in samples:
        before = previous.get(g.gpu_uuid)
        if before is not None and before.missing:
            log.warning("GPU %d (%s) is in the exporter's scrape again; reporting it from its rows",
                        g.index, g.gpu_uuid)
        total = g.mem_total_bytes
        if total is None and before is not None:
            total = before.mem_total_bytes
        seen[g.gpu_uuid] = SeenGpu(g.index, g.model, total)
    return seen


def _missing_samples(previous: dict[str, SeenGpu], seen: dict[str, SeenGpu]) -> list[GpuSample]:
    """A down sample per GPU seen before and missing from this scrape (DCGM stops exporting a GPU
    that fell off the bus), kept in `seen` so it stays down each tick until it returns or the agent
    restarts (the NVML agent keeps a lost GPU's slot too: capacity still shows it, its time is `down`).
    A GPU whose index another GPU now reports (replaced without restarting the agent) is forgotten:
    two GPUs of one index would resolve index-based allocations to the wrong one."""
    taken = {g.index for g in seen.values()}
    out = []
    for uuid, gpu in previous.items():
        if uuid in seen:
            continue
        if gpu.index in taken:
            log.warning("GPU %d (%s) is missing and GPU %s reports its index now (replaced?); forgetting it",
                        gpu.index, uuid, next(u for u, g in seen.items() if g.index == gpu.index))
            continue
        if not gpu.missing:
            log.error("GPU %d (%s) is missing from the exporter's scrape (fallen off the bus?); reporting it down "
                      "until it returns or the agent restarts", gpu.index, uuid)
        seen[uuid] = SeenGpu(gpu.index, gpu.model, gpu.mem_total_bytes, missing=True)
        taken.add(gpu.index)
        out.append(_valid_sample(dict(gpu_uuid=uuid, index=gpu.index, model=gpu.model,
                                      mem_total_bytes=gpu.mem_total_bytes,
                                      health=GpuHealth.down, down_reason=MISSING_REASON)))
    return out


# --------------------------------------------------------------------------- one GPU
def _value(rows: Iterable[Row], metric: str) -> float | None:
    """The metric's value for the whole GPU: its row without a holder if there is one (in the
    per-process mode the holders' rows hold their parts), else the first (holders repeat it)."""
    found = [r for r in rows if r.metric == metric and not is_blank(r.value)]
    chosen = [r for r in found if holder_container_id(r.labels) is None] or found
    return chosen[0].value if chosen else None


def _last_xid(rows: list[Row]) -> int | None:
    value = _value([r for r in rows if not r.gpu_instance] or rows, XID)  # the GPU's own row first
    return int(value) if value is not None else None


def _gpu_sample(uuid: str, rows: list[Row], new_xids: list[int], fatal_xid: int | None) -> GpuSample:
    first = rows[0]
    model = ledger_model_name(next((name for r in rows if (name := r.label(MODEL_LABELS))), ""))
    gpu_rows = [r for r in rows if not r.gpu_instance]
    instance_rows = [r for r in rows if r.gpu_instance]
    # A MIG GPU may be exported only as its instances (`-d i`, or `f` with MIG on): device-wide
    # values (power, energy, clocks, temperature, errors) repeat on each instance row.
    whole = gpu_rows or instance_rows
    measured: dict[str, Any] = {}
    for metric, (name, factor) in FIELDS.items():
        value = _value(whole, metric)
        if value is not None and measured.get(name) is None:
            measured[name] = int(value * factor) if name in INTEGER_FIELDS else value * factor
    migs = _mig_devices(uuid, instance_rows, model)
    if not gpu_rows and instance_rows:
        measured.update(_instance_totals(instance_rows, migs))
    if measured.get("mem_total_bytes") is None:
        measured["mem_total_bytes"] = _memory_total(whole)
    fields = dict(
        gpu_uuid=uuid, index=int(first.labels["gpu"]), model=model, xid_errors=new_xids,
        processes=_holders(rows), mig_devices=[m for m, _ in migs], **measured,
    )
    if fatal_xid is not None:
        fields.update(health=GpuHealth.down, down_reason=xid_down_reason(fatal_xid))
    return _valid_sample(fields)


def _instance_totals(instance_rows: list[Row], migs: list[tuple[MigDevice, str]]) -> dict[str, Any]:
    """Whole-GPU values of a GPU seen only through its MIG instances: SM activity weighted by each
    instance's share, framebuffer summed (each instance owns its memory). GPU_UTIL is not defined
    for MIG instances (NVIDIA, dcgm-exporter issue #50)."""
    instances = _by_instance(instance_rows)
    out: dict[str, Any] = {"util_gpu_pct": None, "mem_total_bytes": None}  # total: from used + free below
    active = [(_value(instances[gi], "DCGM_FI_PROF_SM_ACTIVE"), mig.share_milli) for mig, gi in migs]
    if any(a is not None for a, _ in active):
        out["sm_active_pct"] = sum((a or 0.0) * 100.0 * share for a, share in active) / 1000.0
    used = [_value(part, "DCGM_FI_DEV_FB_USED") for part in instances.values()]
    out["mem_used_bytes"] = int(sum(used) * MIB) if None not in used else None
    return out


def _by_instance(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.gpu_instance, []).append(r)
    return out


def _memory_total(rows: list[Row]) -> int | None:
    """used + free (+ reserved), summed over MIG instances when that is all there is."""
    total = 0.0
    for part in _by_instance(rows).values():
        used, free = _value(part, "DCGM_FI_DEV_FB_USED"), _value(part, FB_FREE)
        if used is None or free is None:
            return None
        total += used + free + (_value(part, FB_RESERVED) or 0.0)
    return int(total * MIB) if rows else None


def _mig_devices(uuid: str, instance_rows: list[Row], model: str) -> list[tuple[MigDevice, str]]:
    """(MigDevice, GPU_I_ID) per instance with a known profile, by instance id."""
    out = []
    for gi, rows in sorted(_by_instance(instance_rows).items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        profile = next((r.labels["GPU_I_PROFILE"] for r in rows if r.labels.get("GPU_I_PROFILE")), "")
        share = mig_share_milli(profile, model)
        if share is None:
            continue
        mig_uuid = next((r.labels[MIG_UUID_LABEL] for r in rows if r.labels.get(MIG_UUID_LABEL)), f"{uuid}/gi/{gi}")
        out.append((MigDevice(uuid=mig_uuid, profile=profile, share_milli=share), gi))
    return out


def _holders(rows: list[Row]) -> list[ProcessSample]:
    """One process (pid 0) per holder named in the rows. Per-holder GPU_UTIL / FB_USED only where
    the exporter split them (its per-process mode: the GPU's own row is there too)."""
    parts: dict[str, dict[str, Any]] = {}
    for row in rows:
        holder = holder_container_id(row.labels)
        if holder is None:
            continue
        part = parts.setdefault(holder, {})
        name = PER_HOLDER_FIELDS.get(row.metric)
        if name is None or not 0 <= row.value <= MAX_PER_HOLDER[name] or not _split_per_holder(rows, row):
            continue
        value = int(row.value * MIB) if name == "mem_used_bytes" else row.value
        part[name] = part.get(name, 0) + value  # a pod on several MIG instances of the GPU
        if name == "sm_util_pct":
            part[name] = min(100.0, part[name])
    return [ProcessSample(pid=0, container_id=holder, **part) for holder, part in parts.items()]


def _split_per_holder(rows: list[Row], row: Row) -> bool:
    return any(r.metric == row.metric and r.gpu_instance == row.gpu_instance
               and holder_container_id(r.labels) is None for r in rows)


def _valid_sample(fields: dict[str, Any]) -> GpuSample:
    """The sample, with any reading outside the wire model's range dropped (None) rather than
    failing the node's whole tick; anything else invalid is an error."""
    try:
        return GpuSample(**fields)
    except ValidationError as exc:
        bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        if not bad or not bad <= MEASURED_FIELDS:
            raise
        return GpuSample(**{k: (None if k in bad else v) for k, v in fields.items()})
