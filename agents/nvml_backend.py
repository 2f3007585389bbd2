"""The real GPU backend: NVML through pynvml (PyPI `nvidia-ml-py`).

Why one file: one class over one library (pynvml); its queries share the per-GPU support cache and
the call counter.

The pynvml module is a constructor parameter so that tests can hand in a fake module and
still run every line here. Cost matters (one seed team saw agent CPU rise 30% at 1 s
sampling), so the backend:
- reads power, energy, PCIe/NVLink byte counters and ECC counts in one
  `nvmlDeviceGetFieldValues` call per GPU, each field with its own return code;
- stops calling a query on a GPU after it answered NOT_SUPPORTED once;
- counts every pynvml call of the last tick in `calls_last_tick`.
GPU temperature, current clocks and clock-event reasons have no field ids in NVML, so they
are separate calls.

Throughput comes from cumulative counters (PCIe bytes, NVLink KiB), differenced between
ticks over the backend's monotonic clock: exact bytes over the whole tick, rather than
NVML's 20 ms throughput snapshot. The first tick therefore has no rates.

Agents running in a container need the host's PID namespace (NVML reports host pids) and
the host's /proc mounted somewhere: pass it as `proc_root`.

MIG: a MIG-enabled GPU is reported as one whole GPU (its parent device), measured as a whole,
with its MIG devices listed in `mig_devices` (UUID, profile, share of the parent = the device's
compute slices / the GPU's). NVML lists one MIG device per *compute instance*: the compute instances
of one GPU instance share its slices, so each is billed its own compute slices (three 1c.3g.40gb
compute instances of a 3g GPU instance: 1/7 each), never the GPU instance's. Schedulers hand out MIG
UUIDs; the worker bills an allocation of one as that share of the parent. The layout changes only
when an operator reconfigures the GPU, so it is not read every tick: at start, at once after NVML's
MIG configuration-change event for the GPU (registered on MIG-enabled GPUs, drained with the Xid
events), and every MIG_REFRESH_S in case no event comes (no event set, the event unsupported).
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from gpuledger.agents.backend import FATAL_XIDS, xid_down_reason
from gpuledger.schemas.models import GpuHealth, GpuSample, MigDevice, ProcessSample

log = logging.getLogger(__name__)

_UINT_MAX = 0xFFFFFFFF  # NVLink throughput scopeId that sums every link (nvml.h)
#: How often the MIG layout of a GPU is read again, seconds, when no MIG configuration-change event
#: says it changed. A job placed on a new MIG device is billed only once the layout lists it, so this
#: bounds the unbilled time where events are missing; a read is ~2 calls per MIG device slot, a few
#: percent of a MIG GPU's per-tick calls at 60 s.
MIG_REFRESH_S = 60.0
#: Running GPU processes in a row not found under proc_root before the agent warns (once) that it does
#: not see the host's processes.
INVISIBLE_PIDS_WARNING = 3
#: Whole-GPU instance profiles, largest first: their slice count is the GPU's (7 on A100/H100/H200, 4 on A30).
_WHOLE_GPU_PROFILES = ("NVML_GPU_INSTANCE_PROFILE_7_SLICE", "NVML_GPU_INSTANCE_PROFILE_4_SLICE")

#: The GPU's identity for its ID card, read once at start: (GpuSample field, pynvml function).
IDENTITY_QUERIES: tuple[tuple[str, str], ...] = (
    ("serial", "nvmlDeviceGetSerial"),
    ("board_part_number", "nvmlDeviceGetBoardPartNumber"),
    ("vbios_version", "nvmlDeviceGetVbiosVersion"),
)

#: Fields read in the one nvmlDeviceGetFieldValues call: (our name, pynvml constant, scopeId).
#: Constants a given pynvml lacks are skipped. Units as NVML reports them.
FIELDS: tuple[tuple[str, str, int], ...] = (
    ("power_mw", "NVML_FI_DEV_POWER_INSTANT", 0),                 # mW, GPU scope
    ("energy_mj", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 0),    # mJ since driver load
    ("pcie_tx_bytes", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 0),     # cumulative, may wrap
    ("pcie_rx_bytes", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 0),
    ("nvlink_tx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", _UINT_MAX),  # cumulative KiB, all links
    ("nvlink_rx_kib", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", _UINT_MAX),
    ("ecc_sbe", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 0),             # corrected, volatile
    ("ecc_dbe", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 0),             # uncorrected, volatile
)

#: nvmlValueType_t -> member of the c_nvmlValue_t union holding the value.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

#: NVML device names -> the ledger's model names (the coefficient library's keys). First match
#: wins, so the more specific patterns come first. Unknown names fall back to a cleaned-up name.
MODEL_NAMES: tuple[tuple[str, str], ...] = (
    (r"\bH200\b", "H200-141GB"),
    (r"\bH100\b.*\bNVL\b", "H100-NVL-94GB"),
    (r"\bH100\b", "H100-80GB"),            # SXM5 80GB HBM3 and PCIe are both 80 GB
    (r"\bA100\b.*\b80\s*GB\b", "A100-80GB"),
    (r"\bA100\b", "A100-40GB"),
    (r"\bV100\b.*\b32\s*GB\b", "V100-32GB"),
    (r"\bV100\b", "V100-16GB"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"\bA10\b", "A10"),
)
_MODEL_PATTERNS = tuple((re.compile(p, re.IGNORECASE), m) for p, m in MODEL_NAMES)


def ledger_model_name(nvml_name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'A100-80GB'; unknown cards: 'NVIDIA GeForce RTX 4090' -> 'GeForce-RTX-4090'."""
    for pattern, model in _MODEL_PATTERNS:
        if pattern.search(nvml_name):
            return model
    cleaned = re.sub(r"^(NVIDIA|Tesla)\s+", "", nvml_name.strip(), flags=re.IGNORECASE)
    cleaned = re.sub(r"[^A-Za-z0-9.]+", "-", cleaned).strip("-")
    return cleaned or "unknown"


# --------------------------------------------------------------------------- containers
#: Prefixes container runtimes put before the id in cgroup path segments
#: (systemd cgroup driver: docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, ...).
_RUNTIME_PREFIXES = ("docker-", "cri-containerd-", "crio-", "libpod-", "containerd-", "nerdctl-", "cri-dockerd-")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
#: A Slurm job's cgroup segment (`job_12345`), under a path naming Slurm (`/slurm/uid_0/job_12345/step_0`,
#: `/system.slice/slurmstepd.scope/job_12345/step_batch`): the job's GPUs' processes are metered as
#: container `slurm-job-<id>`, the container id the Slurm agent puts in its GPU assignments.
_SLURM_JOB = re.compile(r"job_(\d+)")


def parse_container_id(cgroup_text: str) -> str | None:
    """The container id (64 hex digits, runtime prefix removed) in a /proc/<pid>/cgroup file.

    Handles cgroup v1 and v2 with the cgroupfs and systemd drivers, e.g.
    `12:memory:/docker/<id>`, `0::/system.slice/docker-<id>.scope`,
    `0::/kubepods/burstable/pod<uid>/<id>`,
    `0::/kubepods.slice/.../cri-containerd-<id>.scope`, `crio-<id>.scope`, `libpod-<id>.scope/container`;
    and Slurm jobs (cgroup v1 and v2, with or without systemd): `4:memory:/slurm/uid_1000/job_12345/step_0`,
    `0::/system.slice/slurmstepd.scope/job_12345/step_batch/user/task_0` → `slurm-job-12345`.
    None for a process outside any container."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        in_slurm = "slurm" in parts[2]
        # Deepest segment first: the container a process is in is the innermost one.
        for segment in reversed(parts[2].split("/")):
            if in_slurm and (job := _SLURM_JOB.fullmatch(segment)):
                return f"slurm-job-{job.group(1)}"
            segment = segment.removesuffix(".scope")
            if segment.startswith("crio-conmon-"):  # CRI-O's monitor process, not a container
                continue
            for prefix in _RUNTIME_PREFIXES:
                if segment.startswith(prefix):
                    segment = segment[len(prefix):]
                    break
            if _CONTAINER_ID.fullmatch(segment):
                return segment
    return None


#: the MPS control daemon's server process: with MPS, NVML's compute-process list shows it, and the clients
#: (the jobs' processes) only in the MPS list
MPS_SERVER_COMM = "nvidia-cuda-mps-server"
#: what the kernel shows of a name in /proc/<pid>/comm: 15 characters (TASK_COMM_LEN 16, NUL included)
_COMM_LEN = 15


def is_mps_server(pid: int, proc_root: Path | str = "/proc") -> bool:
    """Whether a host pid is the MPS server, from `<proc_root>/<pid>/comm` (False when not visible). The
    kernel cuts the name to `nvidia-cuda-mps`, which the control daemon's also reads; that one never
    holds a GPU context, so never is in the GPU's process list."""
    try:
        # bytes, not text: the kernel cuts the name at 15 bytes, which can split a multi-byte character
        comm = (Path(proc_root) / str(pid) / "comm").read_bytes().decode("utf-8", "replace").strip()
    except OSError:
        return False
    return comm in (MPS_SERVER_COMM, MPS_SERVER_COMM[:_COMM_LEN])


def container_id_of(pid: int, proc_root: Path | str = "/proc") -> str | None:
    """Container id of a host pid, from `<proc_root>/<pid>/cgroup`; None if not in a container
    or if the process is gone / not visible from here."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_bytes().decode("utf-8", "replace")
    except OSError:
        return None
    return parse_container_id(text)


# --------------------------------------------------------------------------- backend
class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised: no driver, no GPU, or no permission."""


class _GpuLost(Exception):
    """A query said the GPU is gone (fallen off the bus, needs a reset)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    model: str
    unreadable: str | None = None           # why the GPU could not even be identified at start
    fatal_xid: int | None = None            # sticky: a fatal Xid needs a reset, i.e. an agent restart
    lost: bool = False
    xids: list[int] = field(default_factory=list)            # since the previous tick
    counters: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (value, clock)
    proc_util_seen_us: int = 0              # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization
    unsupported: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    mig: list[MigDevice] = field(default_factory=list)   # MIG instances, as last read
    mig_read_at: float = -math.inf                        # backend clock of that read (-inf: read next tick)
    mig_events: bool = False                              # MIG configuration-change events registered
    power_limit_w: float | None = None                    # enforced power limit, read with the MIG layout
    identity: dict[str, str] = field(default_factory=dict)  # serial, board_part_number, vbios_version: read once


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> int:
    """Identity of a device handle that survives NVML handing back a new ctypes object for it
    (event data): the device pointer's address. Non-ctypes handles (fakes) use id()."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or id(handle)
    except (ctypes.ArgumentError, TypeError):
        return id(handle)


def _bounded(value: float | None, lo: float, hi: float) -> float | None:
    """Drop a reading outside the wire model's range instead of failing the node's whole tick."""
    if value is None or not (lo <= value <= hi):
        return None
    return value


class NvmlBackend:
    """Every GPU of this node through NVML. Opens NVML on construction; `close()` shuts it down."""

    def __init__(
        self,
        nvml: ModuleType | Any | None = None,
        *,
        proc_root: Path | str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        max_events_per_tick: int = 256,
        node: str = "",
    ):
        if nvml is None:
            import pynvml as nvml
        self._nvml = nvml
        self._proc_root = Path(proc_root)
        self._clock = clock
        self._max_events = max_events_per_tick
        self._node = node
        self._calls = 0
        self.calls_last_tick = 0
        self._closed = True
        self._event_set: Any = None
        #: codes that say a call or struct version does not exist here (an older driver): ask the older one
        self._no_such_call = {getattr(nvml, name, None) for name in (
            "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH")} - {None}
        self._event_error: int | None = None  # the error code nvmlEventSetWait answered last, until it works
        self._gpus: list[_Gpu] = []
        self._by_key: dict[int, _Gpu] = {}
        self._containers: dict[int, str | None] = {}  # pid -> container id, for pids seen last tick
        self._mps_servers: dict[int, bool] = {}  # pid -> is the MPS server, for pids seen last tick
        self._invisible_in_a_row = 0  # running GPU processes, one after the other, not found under proc_root
        try:
            self._call("nvmlInit")
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(
                f"cannot initialise NVML: {exc}. Is the NVIDIA driver loaded and a GPU visible to this "
                "process (in a container: --gpus/NVIDIA runtime)? Use --backend sim to run without a GPU."
            ) from exc
        self._closed = False
        try:
            self._field_names: list[str] = []
            self._field_request: list[tuple[int, int]] = []
            for name, const, scope in FIELDS:
                fid = getattr(nvml, const, None)
                if fid is not None:
                    self._field_names.append(name)
                    self._field_request.append((fid, scope))
            for index in range(self._call("nvmlDeviceGetCount")):
                self._gpus.append(self._open_gpu(index))
            self._open_events()
        except BaseException:
            self.close()
            raise
        self.init_calls = self._calls
        log.info("NVML backend: %d GPU(s): %s", len(self._gpus),
                 ", ".join(f"{g.index}={g.model}" for g in self._gpus))

    # ------------------------------------------------------------------ setup
    def _call(self, name: str, *args: Any) -> Any:
        self._calls += 1
        return getattr(self._nvml, name)(*args)

    def _open_gpu(self, index: int, *, quiet: bool = False) -> _Gpu:
        nv = self._nvml
        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", index)
            uuid = _text(self._call("nvmlDeviceGetUUID", handle))
            name = _text(self._call("nvmlDeviceGetName", handle))
        except nv.NVMLError as exc:
            # Keep the slot so the node's capacity still shows it, as down; retried each tick.
            if not quiet:
                log.error("GPU %d cannot be identified (%s); reporting it down", index, exc)
            # the placeholder names the node: a UUID is a GPU's identity fleet-wide (record ids, the
            # worker's one-node-per-UUID rule), and two nodes' unreadable GPU 3 are two GPUs
            where = f"{self._node}-" if self._node else ""
            return _Gpu(index=index, handle=None, uuid=f"GPU-unreadable-{where}{index}", model="unknown",
                        unreadable=f"unreadable at agent start: {exc}")
        gpu = _Gpu(index=index, handle=handle, uuid=uuid, model=ledger_model_name(name))
        self._by_key[_handle_key(handle)] = gpu
        gpu.identity = self._read_identity(gpu)
        return gpu

    def _read_identity(self, gpu: _Gpu) -> dict[str, str]:
        """Serial, board part number and VBIOS of the GPU's ID card (docs/gpu-cards.md): read here, once
        per GPU, never per tick. One the GPU or driver cannot give (NOT_SUPPORTED on GeForce boards, a
        pynvml without the call) is left out, like the other optional queries."""
        out: dict[str, str] = {}
        for key, fn in IDENTITY_QUERIES:
            if not hasattr(self._nvml, fn):
                continue
            try:
                value = self._query(gpu, key, fn)
            except _GpuLost:
                return out  # the first sample reports the GPU down
            text = _text(value).strip() if value is not None else ""
            if text and text.isprintable():
                out[key] = text[:128]
        return out

    def _reopen(self, gpu: _Gpu) -> _Gpu:
        """Try again to identify a GPU that could not be read at start (3 calls, only for such GPUs)."""
        fresh = self._open_gpu(gpu.index, quiet=True)
        if fresh.unreadable:
            return gpu
        log.warning("GPU %d is readable again: %s (%s)", fresh.index, fresh.uuid, fresh.model)
        self._gpus[gpu.index] = fresh  # slots are built in index order
        self._register(fresh)
        return fresh

    def _register(self, gpu: _Gpu) -> None:
        nv = self._nvml
        if self._event_set is None or gpu.handle is None:
            return
        try:
            self._call("nvmlDeviceRegisterEvents", gpu.handle, nv.nvmlEventTypeXidCriticalError, self._event_set)
        except nv.NVMLError as exc:
            log.warning("GPU %d (%s): cannot watch Xid errors (%s)", gpu.index, gpu.uuid, exc)

    def _open_events(self) -> None:
        nv = self._nvml
        try:
            self._event_set = self._call("nvmlEventSetCreate")
        except nv.NVMLError as exc:
            log.warning("NVML event set unavailable (%s): Xid errors will not be reported", exc)
            return
        for gpu in self._gpus:
            self._register(gpu)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nv = self._nvml
        if self._event_set is not None:
            try:
                self._call("nvmlEventSetFree", self._event_set)
            except nv.NVMLError as exc:
                log.warning("nvmlEventSetFree failed: %s", exc)
            self._event_set = None
        try:
            self._call("nvmlShutdown")
        except nv.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    # ------------------------------------------------------------------ tick
    def sample(self, now_ms: int) -> list[GpuSample]:
        if self._closed:
            raise RuntimeError("NvmlBackend is closed")
        self._calls = 0
        self._drain_events()
        seen_pids: set[int] = set()
        samples = [self._sample_gpu(gpu, seen_pids) for gpu in self._gpus]
        # Forget container ids of pids that left the GPUs, so a reused pid is looked up again.
        for pid in self._containers.keys() - seen_pids:
            del self._containers[pid]
        for pid in self._mps_servers.keys() - seen_pids:
            del self._mps_servers[pid]
        self.calls_last_tick = self._calls
        return samples

    def _drain_events(self) -> None:
        nv = self._nvml
        if self._event_set is None:
            return
        for _ in range(self._max_events):
            try:
                data = self._call("nvmlEventSetWait", self._event_set, 0)  # 0 ms: never block the tick
            except nv.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == nv.NVML_ERROR_TIMEOUT:  # the queue is empty
                    self._events_readable()
                elif code != self._event_error:
                    # said once per cause: GPU_IS_LOST comes back every tick while a GPU is off the bus
                    log.warning("reading NVML events failed: %s (Xid errors unread until it works again)", exc)
                    self._event_error = code
                return
            self._events_readable()
            gpu = self._by_key.get(_handle_key(data.device))
            if int(data.eventType) & getattr(nv, "nvmlEventMigConfigChange", 0):
                # A MIG device was created or destroyed: read the layout next tick (all GPUs if NVML
                # names a device this agent does not know, e.g. a MIG device handle).
                for changed in [gpu] if gpu is not None else self._gpus:
                    changed.mig_read_at = -math.inf
                continue
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            xid = int(data.eventData)
            if gpu is None:
                log.warning("Xid %d on a device this agent does not know", xid)
                continue
            gpu.xids.append(xid)
            if xid in FATAL_XIDS and gpu.fatal_xid is None:
                gpu.fatal_xid = xid
                log.error("GPU %d (%s): fatal %s; reporting it down until the agent restarts",
                          gpu.index, gpu.uuid, xid_down_reason(xid))
            else:
                log.warning("GPU %d (%s): Xid %d", gpu.index, gpu.uuid, xid)
        log.warning("more than %d NVML events in one tick; the rest are read next tick", self._max_events)

    def _events_readable(self) -> None:
        if self._event_error is not None:
            log.warning("reading NVML events works again")
            self._event_error = None

    def _is_lost(self, exc: Exception | int) -> str | None:
        """The down_reason when an NVML error (or return code) means the GPU itself is gone."""
        nv = self._nvml
        code = exc if isinstance(exc, int) else getattr(exc, "value", None)
        if code == nv.NVML_ERROR_GPU_IS_LOST:
            return "gpu lost (NVML_ERROR_GPU_IS_LOST)"
        if code == nv.NVML_ERROR_RESET_REQUIRED:
            return "gpu reset required (NVML_ERROR_RESET_REQUIRED)"
        return None

    def _query(self, gpu: _Gpu, what: str, fn: str, *args: Any) -> Any:
        """One optional query: its value, or None when unsupported/failed; _GpuLost when the GPU is gone."""
        nv = self._nvml
        if what in gpu.unsupported:
            return None
        try:
            return self._call(fn, gpu.handle, *args)
        except nv.NVMLError as exc:
            lost = self._is_lost(exc)
            if lost:
                raise _GpuLost(lost) from None
            if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                gpu.unsupported.add(what)
                log.info("GPU %d (%s): %s not supported, not asked again", gpu.index, gpu.uuid, what)
            else:
                self._warn_once(gpu, what, exc)
            return None

    def _read_power_limit(self, gpu: _Gpu) -> float | None:
        """The GPU's enforced power limit in watts (nvmlDeviceGetEnforcedPowerLimit, mW), or None.
        The worker does not believe energy above it (docs/accounting.md, "Sane values or none")."""
        if not hasattr(self._nvml, "nvmlDeviceGetEnforcedPowerLimit"):  # a pynvml (or fake) without it
            return None
        limit_mw = self._query(gpu, "power limit", "nvmlDeviceGetEnforcedPowerLimit")
        if limit_mw is None:
            return None
        limit = _bounded(limit_mw / 1000.0, 0, 5000)
        return limit if limit else None  # 0 W is no limit the ledger can use

    def _read_mig(self, gpu: _Gpu) -> list[MigDevice]:
        """The GPU's MIG instances (empty when MIG is off or unsupported). Raises _GpuLost."""
        nv = self._nvml
        if not hasattr(nv, "nvmlDeviceGetMigMode"):  # a pynvml without MIG
            return []
        mode = self._query(gpu, "mig", "nvmlDeviceGetMigMode")
        if not mode or mode[0] != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        if not gpu.mig_events:
            self._register_mig_events(gpu)
        whole = 7
        for name in _WHOLE_GPU_PROFILES:
            const = getattr(nv, name, None)
            info = None if const is None else self._query(gpu, f"mig profile {name}", "nvmlDeviceGetGpuInstanceProfileInfo",
                                                            const)
            if info is not None:
                whole = int(info.sliceCount)
                break
        found = []
        for i in range(self._query(gpu, "mig count", "nvmlDeviceGetMaxMigDeviceCount") or 0):
            try:
                handle = self._call("nvmlDeviceGetMigDeviceHandleByIndex", gpu.handle, i)
                uuid = _text(self._call("nvmlDeviceGetUUID", handle))
                attrs = self._call("nvmlDeviceGetAttributes", handle)
            except nv.NVMLError as exc:
                lost = self._is_lost(exc)
                if lost:
                    raise _GpuLost(lost) from None
                if getattr(exc, "value", None) != nv.NVML_ERROR_NOT_FOUND:  # NOT_FOUND: an empty slot
                    self._warn_once(gpu, f"MIG device {i}", exc)
                continue
            # One MIG device per compute instance: its share is its own compute slices (the compute
            # instances of a GPU instance split its slices); a pynvml without the field: the GPU instance's.
            gi_slices = int(attrs.gpuInstanceSliceCount)
            ci_slices = int(getattr(attrs, "computeInstanceSliceCount", 0) or gi_slices)
            memory = f"{gi_slices}g.{math.ceil(int(attrs.memorySizeMB) / 1024)}gb"
            found.append(MigDevice(uuid=uuid, profile=memory if ci_slices == gi_slices else f"{ci_slices}c.{memory}",
                                   share_milli=max(1, min(1000, ci_slices * 1000 // whole))))
        if found:
            log.info("GPU %d (%s): MIG instances %s", gpu.index, gpu.uuid,
                     ", ".join(f"{m.uuid} {m.profile}" for m in found))
        return found

    def _register_mig_events(self, gpu: _Gpu) -> None:
        """Watch a MIG-enabled GPU for MIG reconfiguration (once per GPU). Registered apart from the Xid
        events: NVML refuses a whole registration when one of its event types is unsupported."""
        nv = self._nvml
        gpu.mig_events = True  # tried once: a refusal is not asked again
        event = getattr(nv, "nvmlEventMigConfigChange", None)
        if self._event_set is None or event is None:
            return
        try:
            self._call("nvmlDeviceRegisterEvents", gpu.handle, event, self._event_set)
        except nv.NVMLError as exc:
            lost = self._is_lost(exc)
            if lost:
                raise _GpuLost(lost) from None
            log.info("GPU %d (%s): no MIG configuration events (%s); layout read every %g s",
                     gpu.index, gpu.uuid, exc, MIG_REFRESH_S)

    def _warn_once(self, gpu: _Gpu, what: str, exc: Exception) -> None:
        if what not in gpu.warned:
            gpu.warned.add(what)
            log.warning("GPU %d (%s): reading %s failed: %s (reported as missing; warned once)",
                        gpu.index, gpu.uuid, what, exc)

    def _sample_gpu(self, gpu: _Gpu, seen_pids: set[int]) -> GpuSample:
        xids, gpu.xids = gpu.xids, []
        ident = dict(gpu_uuid=gpu.uuid, index=gpu.index, model=gpu.model, xid_errors=xids, **gpu.identity)
        if gpu.unreadable:
            gpu = self._reopen(gpu)
            if gpu.unreadable:
                return GpuSample(**ident, health=GpuHealth.down, down_reason=gpu.unreadable)
            ident.update(gpu_uuid=gpu.uuid, model=gpu.model, **gpu.identity)
        try:
            if self._clock() - gpu.mig_read_at >= MIG_REFRESH_S:
                # the power limit changes as seldom (an operator's nvidia-smi -pl): read at the same times
                gpu.power_limit_w = self._read_power_limit(gpu)
                gpu.mig, gpu.mig_read_at = self._read_mig(gpu), self._clock()
            metrics = self._measure(gpu, seen_pids)
        except _GpuLost as lost:
            if not gpu.lost:
                log.error("GPU %d (%s): %s; reporting it down", gpu.index, gpu.uuid, lost.reason)
            gpu.lost = True
            gpu.counters.clear()  # no rate across an outage
            return GpuSample(**ident, health=GpuHealth.down, down_reason=lost.reason)
        if gpu.lost:
            log.warning("GPU %d (%s) answers again", gpu.index, gpu.uuid)
            gpu.lost = False
        if gpu.mig:
            metrics["mig_devices"] = gpu.mig
        if gpu.power_limit_w is not None:
            metrics["power_limit_w"] = gpu.power_limit_w
        if gpu.fatal_xid is not None:
            # Still measured (energy keeps counting, processes may linger), but out of service.
            return GpuSample(**ident, **metrics, health=GpuHealth.down, down_reason=xid_down_reason(gpu.fatal_xid))
        return GpuSample(**ident, **metrics)

    def _read_fields(self, gpu: _Gpu) -> tuple[dict[str, float | int | None], float]:
        nv = self._nvml
        values: dict[str, float | int | None] = dict.fromkeys(self._field_names)
        now = self._clock()
        if not self._field_request or "fields" in gpu.unsupported:
            return values, now
        try:
            raw = self._call("nvmlDeviceGetFieldValues", gpu.handle, self._field_request)
        except nv.NVMLError as exc:
            lost = self._is_lost(exc)
            if lost:
                raise _GpuLost(lost) from None
            if getattr(exc, "value", None) == nv.NVML_ERROR_NOT_SUPPORTED:
                gpu.unsupported.add("fields")
            self._warn_once(gpu, "field values", exc)
            return values, now
        now = self._clock()
        for name, fv in zip(self._field_names, raw):
            ret = int(fv.nvmlReturn)
            if ret == nv.NVML_SUCCESS:
                member = _VALUE_MEMBER.get(int(fv.valueType))
                values[name] = getattr(fv.value, member) if member else None
            elif lost := self._is_lost(ret):
                raise _GpuLost(lost)
            # any other per-field code (NOT_SUPPORTED, NO_PERMISSION, ...) leaves that field None
        return values, now

    def _rate(self, gpu: _Gpu, name: str, value: float | int | None, now: float, scale: float) -> float | None:
        """Per-second rate of a cumulative counter since the previous tick, times `scale`."""
        prev = gpu.counters.pop(name, None)
        if value is None:
            return None
        gpu.counters[name] = (int(value), now)
        if prev is None:
            return None
        dv, dt = int(value) - prev[0], now - prev[1]
        if dv < 0 or dt <= 0:  # counter wrapped or reset (driver reload): skip one tick, never negative
            return None
        return dv * scale / dt

    def _measure(self, gpu: _Gpu, seen_pids: set[int]) -> dict[str, Any]:
        nv = self._nvml
        f, now = self._read_fields(gpu)

        power_mw = f.get("power_mw")
        if power_mw is None:  # drivers without the power field: the classic call
            power_mw = self._query(gpu, "power usage", "nvmlDeviceGetPowerUsage")
        util = self._query(gpu, "utilization", "nvmlDeviceGetUtilizationRates")
        mem_used, mem_total = self._read_memory(gpu)
        temp = self._query(gpu, "temperature", "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU)
        sm_clock = self._query(gpu, "SM clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM)
        mem_clock = self._query(gpu, "memory clock", "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_MEM)
        reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
                      else "nvmlDeviceGetCurrentClocksThrottleReasons")
        reasons = self._query(gpu, "clock-event reasons", reasons_fn)

        energy_mj = f.get("energy_mj")
        return dict(
            util_gpu_pct=_bounded(float(util.gpu), 0, 100) if util is not None else None,
            mem_used_bytes=mem_used,
            mem_total_bytes=mem_total,
            temperature_c=_bounded(float(temp), -50, 200) if temp is not None else None,
            power_w=_bounded(power_mw / 1000.0, 0, 5000) if power_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            pcie_tx_bytes_per_s=self._rate(gpu, "pcie_tx", f.get("pcie_tx_bytes"), now, 1.0),
            pcie_rx_bytes_per_s=self._rate(gpu, "pcie_rx", f.get("pcie_rx_bytes"), now, 1.0),
            nvlink_tx_bytes_per_s=self._rate(gpu, "nvlink_tx", f.get("nvlink_tx_kib"), now, 1024.0),
            nvlink_rx_bytes_per_s=self._rate(gpu, "nvlink_rx", f.get("nvlink_rx_kib"), now, 1024.0),
            sm_clock_mhz=float(sm_clock) if sm_clock is not None else None,
            mem_clock_mhz=float(mem_clock) if mem_clock is not None else None,
            throttle_reasons=int(reasons) if reasons is not None else None,
            ecc_sbe_total=int(f["ecc_sbe"]) if f.get("ecc_sbe") is not None else None,
            ecc_dbe_total=int(f["ecc_dbe"]) if f.get("ecc_dbe") is not None else None,
            processes=self._processes(gpu, seen_pids),
        )

    def _read_memory(self, gpu: _Gpu) -> tuple[int | None, int | None]:
        """(used, total) bytes. Used is what processes allocated: v1's `used` also counts the memory the
        driver and firmware reserve (~0.9 GiB on an idle A100), which no job holds, so v2 is asked where
        driver and pynvml have it. A used above total (a misread free) is dropped: the worker refuses a
        whole tick that lists one (streams/checks.py `tick_gpus_problem`)."""
        nv = self._nvml
        version = getattr(nv, "nvmlMemory_v2", None)
        mem = None
        if version is not None and "memory info v2" not in gpu.unsupported:
            try:
                mem = self._call("nvmlDeviceGetMemoryInfo", gpu.handle, version)
            except nv.NVMLError as exc:
                lost = self._is_lost(exc)
                if lost:
                    raise _GpuLost(lost) from None
                if getattr(exc, "value", None) not in self._no_such_call:
                    self._warn_once(gpu, "memory info", exc)
                    return None, None
                gpu.unsupported.add("memory info v2")  # e.g. a driver before R510 (FUNCTION_NOT_FOUND)
                log.info("GPU %d (%s): memory info v2 unavailable (%s); v1 from now on, reserved memory "
                         "counted as used", gpu.index, gpu.uuid, exc)
        if mem is not None:
            total = int(mem.total)
            # v2's `used` leaves the reserved memory out (some NVML docs say it includes it): take it
            # from the parts, which is right either way
            used: int | None = total - int(mem.reserved) - int(mem.free)
        else:
            mem = self._query(gpu, "memory info", "nvmlDeviceGetMemoryInfo")
            if mem is None:
                return None, None
            total, used = int(mem.total), int(mem.used)
        if used is not None and not 0 <= used <= total:
            self._warn_once(gpu, "memory used", ValueError(f"{used} bytes used of {total}"))
            used = None
        return used, total

    def _note_visible(self, pid: int, container_id: str | None) -> None:
        """Say once when the GPUs' processes cannot be found under proc_root: NVML lists host pids, so an
        agent outside the host's PID namespace (or given the wrong --proc-root) reports every process
        without a container, and every job on a shared GPU looks quiet. A few in a row, not one: a
        process may exit between NVML's list and the read."""
        visible = container_id is not None or (self._proc_root / str(pid)).is_dir()
        self._invisible_in_a_row = 0 if visible else self._invisible_in_a_row + 1
        if self._invisible_in_a_row == INVISIBLE_PIDS_WARNING:
            log.warning("%d processes in a row on this node's GPUs are not under %s (the last: pid %d): their "
                        "containers are unknown. Run the agent in the host's PID namespace (hostPID: true, "
                        "--pid=host) and pass the host's /proc as --proc-root", self._invisible_in_a_row,
                        self._proc_root, pid)

    def _is_mps_server(self, pid: int) -> bool:
        if pid not in self._mps_servers:
            self._mps_servers[pid] = is_mps_server(pid, self._proc_root)
        return self._mps_servers[pid]

    def _processes(self, gpu: _Gpu, seen_pids: set[int]) -> list[ProcessSample]:
        nv = self._nvml
        mem: dict[int, int | None] = {}
        for proc in self._query(gpu, "compute processes", "nvmlDeviceGetComputeRunningProcesses") or ():
            used = getattr(proc, "usedGpuMemory", None)
            mem[int(proc.pid)] = int(used) if used is not None else None
        if any(self._is_mps_server(pid) for pid in mem):
            # MPS: the jobs' processes are the server's clients, listed by their own call. Without them the
            # GPU shows the daemon's container only, and every job on it would look quiet (someone else's).
            # Asked only where a server runs: no extra call per tick elsewhere.
            for proc in self._query(gpu, "MPS compute processes", "nvmlDeviceGetMPSComputeRunningProcesses") or ():
                used = getattr(proc, "usedGpuMemory", None)
                mem[int(proc.pid)] = int(used) if used is not None else None

        sm: dict[int, list[int]] = {}
        if "process utilization" not in gpu.unsupported:
            try:
                samples = self._call("nvmlDeviceGetProcessUtilization", gpu.handle, gpu.proc_util_seen_us)
            except nv.NVMLError as exc:
                # NOT_FOUND: no samples since lastSeen (nothing ran). pynvml also raises
                # NVMLError(NVML_SUCCESS) when the driver reports zero samples without asking for a buffer.
                code = getattr(exc, "value", None)
                if code not in (nv.NVML_ERROR_NOT_FOUND, nv.NVML_SUCCESS):
                    lost = self._is_lost(exc)
                    if lost:
                        raise _GpuLost(lost) from None
                    if code == nv.NVML_ERROR_NOT_SUPPORTED:
                        gpu.unsupported.add("process utilization")
                    else:
                        self._warn_once(gpu, "process utilization", exc)
                samples = ()
            for s in samples:
                sm.setdefault(int(s.pid), []).append(int(s.smUtil))
                gpu.proc_util_seen_us = max(gpu.proc_util_seen_us, int(s.timeStamp))

        out = []
        # A pid with utilization samples but no longer running still used the GPU this tick.
        for pid in sorted(mem.keys() | sm.keys()):
            seen_pids.add(pid)
            if pid not in self._containers:
                self._containers[pid] = container_id_of(pid, self._proc_root)
                if pid in mem:  # running: a pid only sampled may have exited since
                    self._note_visible(pid, self._containers[pid])
            shares = sm.get(pid)
            out.append(ProcessSample(
                pid=pid,
                container_id=self._containers[pid],
                sm_util_pct=_bounded(sum(shares) / len(shares), 0, 100) if shares else None,
                mem_used_bytes=mem.get(pid),
            ))
        return out
