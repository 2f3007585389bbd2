"""NvmlBackend's real code path against a fake pynvml module (no GPU, no driver).

Why one file: every test here drives the one fake pynvml module (FakeNvml and its MIG/power-limit
variants) defined at the top, as the backend is one class over one library."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as real_pynvml
import pytest

from gpuledger.agents.backend import GpuBackend
from gpuledger.agents.nvml_backend import (
    NvmlBackend,
    NvmlUnavailable,
    container_id_of,
    is_mps_server,
    ledger_model_name,
    parse_container_id,
)
from gpuledger.schemas.models import GpuHealth, NodeTick
from gpuledger.streams.attribution import Holder
from gpuledger.streams.checks import tick_gpus_problem
from gpuledger.streams.execution import ACTIVE, measured_activity

GiB = 1 << 30
UINT_MAX = 0xFFFFFFFF
CID_A = "a" * 64
CID_B = "0123456789abcdef" * 4
CID_C = "fedcba9876543210" * 4


class FakeNVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


@dataclass
class FakeDevice:
    uuid: str
    name: str
    # (field id, scope) -> value (valueType 3, ullVal) or ("err", code)
    fields: dict[tuple[int, int], Any] = field(default_factory=dict)
    util: int = 0
    mem_used: int = 0                          # allocated by processes
    mem_total: int = 80 * GiB
    mem_reserved: int = 0                      # set aside by the driver/firmware (v1 counts it as used)
    memory_v2: bool = True                     # the driver has nvmlDeviceGetMemoryInfo_v2
    memory_errors: list[int] = field(default_factory=list)  # codes the next memory-info calls fail with
    temp: int = 40
    sm_clock: int = 1410
    mem_clock: int = 1593
    reasons: int = 0
    power_usage_mw: int | None = None          # nvmlDeviceGetPowerUsage; None: NOT_SUPPORTED
    procs: list[tuple[int, int | None]] = field(default_factory=list)       # (pid, used bytes)
    mps_procs: list[tuple[int, int | None]] = field(default_factory=list)   # MPS clients (pid, used bytes)
    proc_util: list[tuple[int, int, int]] | int = field(default_factory=list)  # (pid, ts_us, sm) or error code
    unsupported: set[str] = field(default_factory=set)  # function names answering NOT_SUPPORTED
    lost: bool = False
    # identity for the ID card; None: NOT_SUPPORTED (GeForce boards have no serial)
    serial: str | None = None
    board_part_number: str | None = None
    vbios: str | None = None


class FakeNvml:
    """Just enough of pynvml: same constants, same call shapes, per-call counting."""

    def __init__(self, devices: list[FakeDevice], *, init_error: int | None = None):
        for name in dir(real_pynvml):
            if name.startswith(("NVML_", "nvmlEventType")) and isinstance(getattr(real_pynvml, name), int):
                setattr(self, name, getattr(real_pynvml, name))
        self.NVMLError = FakeNVMLError
        self.nvmlMemory_v2 = real_pynvml.nvmlMemory_v2
        self.devices = devices
        self.handles = [object() for _ in devices]  # opaque handles, like ctypes pointers
        self.calls: Counter[str] = Counter()
        self.events: deque[SimpleNamespace] = deque()
        self.registered: list[tuple[Any, int]] = []
        self.event_wait_error: int | None = None  # nvmlEventSetWait fails with this code
        self.proc_util_args: list[tuple[int, int]] = []
        self.init_error = init_error
        self.initialized = False
        self.shutdowns = 0
        self.freed_event_sets = 0

    # -- helpers
    def _hit(self, name: str) -> None:
        self.calls[name] += 1

    def _dev(self, handle: Any, fn: str) -> FakeDevice:
        dev = self.devices[self.handles.index(handle)]
        if dev.lost:
            raise FakeNVMLError(self.NVML_ERROR_GPU_IS_LOST)
        if fn in dev.unsupported:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def total_calls(self) -> int:
        return sum(self.calls.values())

    def xid(self, device_index: int, code: int) -> None:
        self.events.append(SimpleNamespace(device=self.handles[device_index], eventType=self.nvmlEventTypeXidCriticalError,
                                           eventData=code, gpuInstanceId=0, computeInstanceId=0))

    # -- library
    def nvmlInit(self) -> None:
        self._hit("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._hit("nvmlShutdown")
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        self._hit("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._hit("nvmlDeviceGetHandleByIndex")
        return self.handles[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._hit("nvmlDeviceGetUUID")
        return self._dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        self._hit("nvmlDeviceGetName")
        return self._dev(handle, "nvmlDeviceGetName").name.encode()  # older pynvml returns bytes

    def _identity(self, handle: Any, fn: str, value: str | None) -> bytes:
        self._hit(fn)
        self._dev(handle, fn)
        if value is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value.encode()  # older pynvml returns bytes

    def nvmlDeviceGetSerial(self, handle: Any) -> bytes:
        return self._identity(handle, "nvmlDeviceGetSerial", self.devices[self.handles.index(handle)].serial)

    def nvmlDeviceGetBoardPartNumber(self, handle: Any) -> bytes:
        return self._identity(handle, "nvmlDeviceGetBoardPartNumber",
                              self.devices[self.handles.index(handle)].board_part_number)

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> bytes:
        return self._identity(handle, "nvmlDeviceGetVbiosVersion", self.devices[self.handles.index(handle)].vbios)

    def nvmlEventSetCreate(self) -> str:
        self._hit("nvmlEventSetCreate")
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: Any) -> None:
        self._hit("nvmlDeviceRegisterEvents")
        self.registered.append((handle, types))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> SimpleNamespace:
        self._hit("nvmlEventSetWait")
        assert timeout_ms == 0, "the agent must never block on events"
        if self.event_wait_error is not None:
            raise FakeNVMLError(self.event_wait_error)
        if not self.events:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.popleft()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._hit("nvmlEventSetFree")
        self.freed_event_sets += 1

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list) -> list[SimpleNamespace]:
        self._hit("nvmlDeviceGetFieldValues")
        dev = self._dev(handle, "nvmlDeviceGetFieldValues")
        out = []
        for fid in field_ids:
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            v = dev.fields.get((fid, scope), ("err", self.NVML_ERROR_NOT_SUPPORTED))
            if isinstance(v, tuple):
                out.append(SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=v[1], valueType=3,
                                           value=SimpleNamespace(ullVal=0), timestamp=0, latencyUsec=0))
            elif isinstance(v, float):
                out.append(SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=0, valueType=0,
                                           value=SimpleNamespace(dVal=v), timestamp=0, latencyUsec=0))
            else:
                out.append(SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=0, valueType=3,
                                           value=SimpleNamespace(ullVal=v), timestamp=0, latencyUsec=0))
        return out

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        self._hit("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self._dev(handle, "nvmlDeviceGetUtilizationRates").util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> SimpleNamespace:
        # pynvml: no version -> v1 (used = total - free, reserved included); a version -> the _v2 symbol
        self._hit("nvmlDeviceGetMemoryInfo")
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        if d.memory_errors:
            raise FakeNVMLError(d.memory_errors.pop(0))
        if not version:
            used = d.mem_used + d.mem_reserved
            return SimpleNamespace(used=used, total=d.mem_total, free=(d.mem_total - used) % (1 << 64))
        assert version == real_pynvml.nvmlMemory_v2
        if not d.memory_v2:
            raise FakeNVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND)
        return SimpleNamespace(version=version, used=d.mem_used, total=d.mem_total, reserved=d.mem_reserved,
                               free=d.mem_total - d.mem_reserved - d.mem_used)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._hit("nvmlDeviceGetTemperature")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._dev(handle, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        self._hit("nvmlDeviceGetClockInfo")
        d = self._dev(handle, "nvmlDeviceGetClockInfo")
        return {self.NVML_CLOCK_SM: d.sm_clock, self.NVML_CLOCK_MEM: d.mem_clock}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self._hit("nvmlDeviceGetCurrentClocksEventReasons")
        return self._dev(handle, "nvmlDeviceGetCurrentClocksEventReasons").reasons

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self._hit("nvmlDeviceGetPowerUsage")
        d = self._dev(handle, "nvmlDeviceGetPowerUsage")
        if d.power_usage_mw is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return d.power_usage_mw

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        self._hit("nvmlDeviceGetComputeRunningProcesses")
        d = self._dev(handle, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in d.procs]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        self._hit("nvmlDeviceGetMPSComputeRunningProcesses")
        d = self._dev(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in d.mps_procs]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, last_seen_us: int) -> list[SimpleNamespace]:
        self._hit("nvmlDeviceGetProcessUtilization")
        d = self._dev(handle, "nvmlDeviceGetProcessUtilization")
        self.proc_util_args.append((self.handles.index(handle), last_seen_us))
        if isinstance(d.proc_util, int):
            raise FakeNVMLError(d.proc_util)
        rows = [s for s in d.proc_util if s[1] > last_seen_us]
        if not rows:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=p, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0) for p, ts, sm in rows]


F = real_pynvml
POWER = (F.NVML_FI_DEV_POWER_INSTANT, 0)
ENERGY = (F.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0)
PCIE_TX = (F.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0)
PCIE_RX = (F.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)
NVL_TX = (F.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX)
NVL_RX = (F.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX)
SBE = (F.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 0)
DBE = (F.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0)


def a100(**kw: Any) -> FakeDevice:
    fields = {POWER: 250_000, ENERGY: 1_234_567_890, PCIE_TX: 10_000, PCIE_RX: 20_000,
              NVL_TX: 1_000, NVL_RX: 2_000, SBE: 3, DBE: 0}
    return FakeDevice(uuid="GPU-aaaa", name="NVIDIA A100-SXM4-80GB", fields=fields, util=87,
                      mem_used=40 * GiB, temp=61, reasons=4, **kw)


def h100(**kw: Any) -> FakeDevice:
    fields = {POWER: 500_000, ENERGY: 5_000_000, SBE: ("err", F.NVML_ERROR_NOT_SUPPORTED)}
    return FakeDevice(uuid="GPU-hhhh", name="NVIDIA H100 80GB HBM3", fields=fields, util=0, **kw)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    cgroups = {
        101: f"0::/system.slice/docker-{CID_A}.scope\n",
        202: f"12:memory:/kubepods/burstable/pod1234-5678/{CID_B}\n11:cpu:/kubepods/burstable/pod1234-5678/{CID_B}\n",
        404: "0::/user.slice/user-1000.slice/session-3.scope\n",
    }
    for pid, text in cgroups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path


def make(devices: list[FakeDevice], proc_root: Path | str = "/nonexistent", clock: Clock | None = None):
    fake = FakeNvml(devices)
    backend = NvmlBackend(fake, proc_root=proc_root, clock=clock or Clock())
    return fake, backend


# --------------------------------------------------------------------------- tests
def test_satisfies_the_backend_interface() -> None:
    _, backend = make([a100()])
    assert isinstance(backend, GpuBackend)


def test_reads_every_metric_and_one_field_call_per_gpu() -> None:
    fake, backend = make([a100(), h100()])
    assert fake.initialized and len(fake.registered) == 2
    assert all(t == F.nvmlEventTypeXidCriticalError for _, t in fake.registered)
    before = fake.total_calls()

    g0, g1 = backend.sample(now_ms=1_000)
    assert backend.calls_last_tick == fake.total_calls() - before
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2  # one batched call per GPU
    assert fake.calls["nvmlEventSetWait"] == 1           # queue empty: one non-blocking poll

    assert (g0.gpu_uuid, g0.index, g0.model, g0.health) == ("GPU-aaaa", 0, "A100-80GB", GpuHealth.ok)
    assert g0.power_w == 250.0
    assert g0.energy_j == pytest.approx(1_234_567.890)  # mJ -> J
    assert (g0.util_gpu_pct, g0.mem_used_bytes, g0.mem_total_bytes) == (87.0, 40 * GiB, 80 * GiB)
    assert (g0.temperature_c, g0.sm_clock_mhz, g0.mem_clock_mhz, g0.throttle_reasons) == (61.0, 1410.0, 1593.0, 4)
    assert (g0.ecc_sbe_total, g0.ecc_dbe_total) == (3, 0)
    assert g0.pcie_tx_bytes_per_s is None and g0.nvlink_rx_bytes_per_s is None  # rates need two ticks

    assert g1.model == "H100-80GB" and g1.power_w == 500.0
    assert g1.ecc_sbe_total is None  # per-field NOT_SUPPORTED -> None, the rest still read
    assert g1.pcie_tx_bytes_per_s is None and g1.nvlink_tx_bytes_per_s is None
    NodeTick(cluster="c", node="n", ts_ms=1_000, interval_ms=5_000, gpus=[g0, g1])  # valid on the wire


def test_throughput_from_counter_deltas_over_the_tick() -> None:
    clock = Clock(100.0)
    fake, backend = make([a100()], clock=clock)
    backend.sample(0)
    dev = fake.devices[0]
    clock.t += 5.0
    dev.fields[PCIE_TX] += 5_000_000_000
    dev.fields[PCIE_RX] += 500
    dev.fields[NVL_TX] += 10 * 1024 * 1024  # KiB
    dev.fields[NVL_RX] -= 1                 # counter reset: skip, never negative
    (g,) = backend.sample(5_000)
    assert g.pcie_tx_bytes_per_s == pytest.approx(1e9)
    assert g.pcie_rx_bytes_per_s == pytest.approx(100.0)
    assert g.nvlink_tx_bytes_per_s == pytest.approx(10 * GiB / 5)
    assert g.nvlink_rx_bytes_per_s is None
    clock.t += 5.0
    (g,) = backend.sample(10_000)
    assert g.nvlink_rx_bytes_per_s == 0.0  # rate resumes from the new baseline


def test_unsupported_queries_are_not_asked_again_and_power_falls_back() -> None:
    dev = h100(unsupported={"nvmlDeviceGetTemperature"}, power_usage_mw=321_000)
    dev.fields[POWER] = ("err", F.NVML_ERROR_NOT_SUPPORTED)
    fake, backend = make([dev])
    (g,) = backend.sample(0)
    assert g.temperature_c is None and g.power_w == 321.0
    backend.sample(5_000)
    assert fake.calls["nvmlDeviceGetTemperature"] == 1
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 2


def test_out_of_range_reading_is_dropped_not_fatal() -> None:
    dev = a100()
    dev.fields[POWER] = 9_000_000_000  # a garbage 9 MW reading
    _, backend = make([dev])
    (g,) = backend.sample(0)
    assert g.power_w is None and g.util_gpu_pct == 87.0


def test_memory_used_leaves_out_what_the_driver_reserves() -> None:
    """nvmlDeviceGetMemoryInfo (v1) counts the driver's/firmware's reserved memory as used: an idle A100
    showed ~912 MiB used, billed as the job's memory (dcgm's FB_USED leaves it out). Was: 920 MiB here."""
    MiB = 1 << 20
    idle = a100(mem_reserved=912 * MiB)
    idle.mem_used = 8 * MiB
    old_driver = h100(mem_reserved=579 * MiB, memory_v2=False)  # no nvmlDeviceGetMemoryInfo_v2 symbol
    old_driver.mem_used = GiB
    fake, backend = make([idle, old_driver])
    for now in (0, 5_000):
        g0, g1 = backend.sample(now)
        assert (g0.mem_used_bytes, g0.mem_total_bytes) == (8 * MiB, 80 * GiB)
        assert (g1.mem_used_bytes, g1.mem_total_bytes) == (GiB + 579 * MiB, 80 * GiB)  # v1: the best there is
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 2 + 3  # v2 not asked again where the driver lacks it
    idle.memory_errors = [F.NVML_ERROR_UNKNOWN]  # a passing failure is not a missing v2: asked again
    assert backend.sample(10_000)[0].mem_used_bytes is None
    assert backend.sample(15_000)[0].mem_used_bytes == 8 * MiB


def test_more_memory_used_than_the_gpu_has_is_dropped_not_the_whole_tick() -> None:
    """The worker refuses a whole tick (every GPU of the node) that lists a GPU using more memory than it
    has (`tick_gpus_problem`); a garbage reading of one GPU must cost that reading only."""
    bad = h100(memory_v2=False)
    bad.mem_used = 81 * GiB  # v1 used = total - free, with free misreported
    _, backend = make([a100(), bad])
    g0, g1 = backend.sample(0)
    assert g1.mem_used_bytes is None and g1.mem_total_bytes == 80 * GiB and g1.power_w == 500.0
    tick = NodeTick(cluster="c", node="n", ts_ms=0, interval_ms=5_000, gpus=[g0, g1])
    assert tick_gpus_problem(tick) is None and g0.mem_used_bytes == 40 * GiB


def test_processes_with_sm_share_memory_and_container(proc_root: Path) -> None:
    dev = a100(procs=[(101, 1 * GiB), (202, 2 * GiB), (404, None)],
               proc_util=[(101, 10, 40), (101, 20, 60), (303, 15, 10), (202, 18, 30)])
    other = h100(procs=[(505, 3 * GiB)], proc_util=F.NVML_ERROR_NOT_FOUND)  # nothing ran: not an error
    fake, backend = make([dev, other], proc_root=proc_root)
    g0, g1 = backend.sample(0)
    by_pid = {p.pid: p for p in g0.processes}
    assert sorted(by_pid) == [101, 202, 303, 404]
    assert (by_pid[101].container_id, by_pid[101].sm_util_pct, by_pid[101].mem_used_bytes) == (CID_A, 50.0, GiB)
    assert (by_pid[202].container_id, by_pid[202].sm_util_pct) == (CID_B, 30.0)
    assert by_pid[303].container_id is None and by_pid[303].mem_used_bytes is None  # exited during the tick
    assert by_pid[404].container_id is None and by_pid[404].sm_util_pct is None       # host process
    assert [(p.pid, p.sm_util_pct, p.mem_used_bytes) for p in g1.processes] == [(505, None, 3 * GiB)]

    # Next tick asks only for samples after the newest one seen.
    dev.proc_util.append((101, 30, 80))
    g0, _ = backend.sample(5_000)
    assert fake.proc_util_args[-2] == (0, 20)
    assert {p.pid: p.sm_util_pct for p in g0.processes}[101] == 80.0


def test_mps_clients_are_read_where_an_mps_server_runs(proc_root: Path) -> None:
    """With MPS, NVML's compute-process list shows the MPS server (the daemon's container) and the jobs'
    processes only in the MPS list. Was: the GPU showed the daemon's container alone, so every job on it
    was quiet by measurement ("containers on the GPU, none of them the holder's") and billed idle."""
    daemon = "d" * 64
    (proc_root / "606").mkdir()
    (proc_root / "606" / "cgroup").write_text(f"0::/kubepods/besteffort/pod9/{daemon}\n")
    (proc_root / "606" / "comm").write_text("nvidia-cuda-mps-server\n")
    (proc_root / "101" / "comm").write_text("python\n")
    mps = a100(procs=[(606, 1 * GiB)], mps_procs=[(101, 6 * GiB), (202, 2 * GiB)], proc_util=[(101, 10, 70)])
    plain = h100(procs=[(101, 1 * GiB)], mps_procs=[(999, GiB)], proc_util=F.NVML_ERROR_NOT_FOUND)
    fake, backend = make([mps, plain], proc_root=proc_root)
    g0, g1 = backend.sample(0)
    assert [(p.pid, p.container_id, p.mem_used_bytes) for p in g0.processes] == [
        (101, CID_A, 6 * GiB), (202, CID_B, 2 * GiB), (606, daemon, GiB)]
    assert [p.pid for p in g1.processes] == [101]  # no MPS server there: its MPS list is not asked
    assert fake.calls["nvmlDeviceGetMPSComputeRunningProcesses"] == 1
    # the job in CID_A is judged on its own process, not as someone else's GPU
    holder = Holder("j1", 0, "t", "q", 1000, True, CID_A)
    assert measured_activity(g0, holder, True, 1.0) == ACTIVE


def test_mps_server_is_recognised_by_the_comm_the_kernel_shows(proc_root: Path) -> None:
    """/proc/<pid>/comm holds at most 15 characters (TASK_COMM_LEN): the server's reads `nvidia-cuda-mps`,
    never `nvidia-cuda-mps-server`. Was: no real MPS server was recognised, its clients never read, and
    every MPS job judged quiet beside the daemon's container."""
    (proc_root / "606").mkdir()
    (proc_root / "606" / "cgroup").write_text(f"0::/kubepods/besteffort/pod9/{'d' * 64}\n")
    (proc_root / "606" / "comm").write_text("nvidia-cuda-mps\n")  # as the kernel truncates it
    (proc_root / "101" / "comm").write_text("nvidia-cuda-mp\n")  # a different (shorter) name is no server
    assert is_mps_server(606, proc_root) and not is_mps_server(101, proc_root)
    mps = a100(procs=[(606, GiB)], mps_procs=[(101, 6 * GiB)], proc_util=F.NVML_ERROR_NOT_FOUND)
    _, backend = make([mps], proc_root=proc_root)
    (g,) = backend.sample(0)
    assert [(p.pid, p.container_id) for p in g.processes] == [(101, CID_A), (606, "d" * 64)]


def test_a_process_name_cut_inside_a_character_does_not_stop_the_nodes_ticks(proc_root: Path) -> None:
    """The kernel cuts /proc/<pid>/comm at 15 bytes, which can split a multi-byte character (an executable
    named `a模型训练程序`); a cgroup path can hold any bytes too. Was: UnicodeDecodeError in every sample while
    such a process ran, so no tick of the node's GPUs at all; now it is one more process with its container."""
    (proc_root / "4242").mkdir()
    (proc_root / "4242" / "comm").write_bytes("a模型训练程序".encode()[:15] + b"\n")
    (proc_root / "4242" / "cgroup").write_bytes(b"0::/system.slice/docker-" + b"a" * 64 + b".scope\n1:name=\xff\xfe:/\n")
    _, backend = make([a100(procs=[(4242, GiB)], proc_util=F.NVML_ERROR_NOT_FOUND), h100()], proc_root=proc_root)
    g0, g1 = backend.sample(0)
    assert [(p.pid, p.container_id) for p in g0.processes] == [(4242, "a" * 64)] and g1.processes == []
    assert not is_mps_server(4242, proc_root)


def test_gpu_processes_invisible_under_proc_root_are_reported(proc_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NVML lists host pids; an agent in a container without the host's PID namespace (or with a wrong
    --proc-root) finds none of them and reports every process without a container: every job on a
    shared GPU then looks quiet. Was: silently; now one warning that names the cause."""
    _, backend = make([a100(procs=[(101, GiB), (202, GiB)], proc_util=F.NVML_ERROR_NOT_FOUND)], proc_root=proc_root)
    backend.sample(0)  # visible pids: nothing to say
    assert "PID namespace" not in caplog.text
    elsewhere = proc_root / "empty"
    elsewhere.mkdir()
    dev = a100(procs=[(7001, GiB)], proc_util=[(7009, 10, 50)])  # 7009: sampled, exited (not counted)
    fake, backend = make([dev], proc_root=elsewhere)
    backend.sample(0)
    dev.procs = [(7002, GiB), (7003, GiB)]
    (g,) = backend.sample(5_000)
    assert all(p.container_id is None for p in g.processes)
    warnings = [r for r in caplog.records if "PID namespace" in r.getMessage()]
    assert len(warnings) == 1 and str(elsewhere) in warnings[0].getMessage()
    dev.procs = [(7004, GiB)]
    backend.sample(10_000)
    assert len([r for r in caplog.records if "PID namespace" in r.getMessage()]) == 1  # said once


def test_zero_process_samples_reported_as_success_error_is_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    # pynvml raises NVMLError(NVML_SUCCESS) when the driver has zero samples and wants no buffer.
    _, backend = make([a100(procs=[(7, 1)], proc_util=F.NVML_SUCCESS)])
    (g,) = backend.sample(0)
    assert [(p.pid, p.sm_util_pct) for p in g.processes] == [(7, None)]
    assert "process utilization" not in caplog.text


def test_lost_gpu_is_down_and_the_rest_of_the_node_still_reports() -> None:
    fake, backend = make([a100(), h100()])
    fake.devices[1].lost = True  # fell off the bus after the agent started
    g0, g1 = backend.sample(0)
    assert g0.health == GpuHealth.ok and g0.power_w == 250.0
    assert g1.health == GpuHealth.down and "lost" in g1.down_reason
    assert (g1.gpu_uuid, g1.model, g1.power_w) == ("GPU-hhhh", "H100-80GB", None)
    fake.devices[1].lost = False  # answers again (e.g. transient)
    _, g1 = backend.sample(5_000)
    assert g1.health == GpuHealth.ok


def test_lost_reported_in_one_field_of_the_batch() -> None:
    dev = a100()
    dev.fields[ENERGY] = ("err", F.NVML_ERROR_GPU_IS_LOST)
    _, backend = make([dev])
    (g,) = backend.sample(0)
    assert g.health == GpuHealth.down


def test_fatal_xid_takes_gpu_down_and_keeps_it_down() -> None:
    fake, backend = make([a100(), h100()])
    fake.xid(0, 79)
    fake.xid(1, 13)  # application error: recorded, GPU stays in service
    g0, g1 = backend.sample(0)
    assert fake.calls["nvmlEventSetWait"] == 3  # two events, then the empty queue
    assert (g0.health, g0.down_reason, g0.xid_errors) == (GpuHealth.down, "xid 79: GPU fell off the bus", [79])
    assert g0.power_w == 250.0  # still measured while out of service
    assert (g1.health, g1.xid_errors) == (GpuHealth.ok, [13])
    g0, g1 = backend.sample(5_000)
    assert (g0.health, g0.xid_errors) == (GpuHealth.down, [])
    assert g1.xid_errors == []


def test_a_failing_event_queue_is_logged_once_not_every_tick(caplog: pytest.LogCaptureFixture) -> None:
    """nvmlEventSetWait answers GPU_IS_LOST while a GPU of the set is off the bus: was one warning per
    tick (17,280 a day at 5 s) for as long as the GPU stays lost; now one, and one when it works again."""
    fake, backend = make([a100(), h100()])
    fake.devices[1].lost = True
    fake.event_wait_error = F.NVML_ERROR_GPU_IS_LOST
    for now in range(0, 50_000, 5_000):
        g0, g1 = backend.sample(now)
        assert g0.health == GpuHealth.ok and g1.health == GpuHealth.down  # the tick itself goes on
    assert len([r for r in caplog.records if "NVML events" in r.getMessage()]) == 1
    fake.event_wait_error = None
    fake.xid(0, 48)
    assert backend.sample(50_000)[0].down_reason == "xid 48: double-bit ECC error"
    assert len([r for r in caplog.records if "NVML events" in r.getMessage()]) == 2  # "read again"


def test_init_failure_is_a_clear_error() -> None:
    fake = FakeNvml([], init_error=F.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NvmlUnavailable, match="--backend sim"):
        NvmlBackend(fake)
    assert fake.shutdowns == 0


def test_close_frees_events_and_shuts_down_once() -> None:
    fake, backend = make([a100()])
    with backend:
        backend.sample(0)
    backend.close()
    assert (fake.freed_event_sets, fake.shutdowns) == (1, 1)
    with pytest.raises(RuntimeError, match="closed"):
        backend.sample(5_000)


def test_gpu_unreadable_at_start_is_reported_down() -> None:
    fake = FakeNvml([a100(), h100()])
    fake.devices[1].unsupported.add("nvmlDeviceGetUUID")
    backend = NvmlBackend(fake)
    g0, g1 = backend.sample(0)
    assert g0.health == GpuHealth.ok
    assert g1.health == GpuHealth.down and g1.index == 1 and "unreadable" in g1.down_reason
    fake.devices[1].unsupported.clear()  # readable again: identified, watched for Xids, measured
    _, g1 = backend.sample(5_000)
    assert (g1.health, g1.gpu_uuid, g1.model) == (GpuHealth.ok, "GPU-hhhh", "H100-80GB")
    assert len(fake.registered) == 2


def test_unreadable_gpu_placeholder_names_its_node() -> None:
    # two nodes' unreadable GPU 1 are two GPUs: one placeholder UUID would give both the same record
    # ids, and the worker refuses a UUID that another node of its partition reports
    uuids = []
    for node in ("node001", "node002"):
        fake = FakeNvml([a100(), h100()])
        fake.devices[1].unsupported.add("nvmlDeviceGetUUID")
        uuids.append(NvmlBackend(fake, node=node).sample(0)[1].gpu_uuid)
    assert uuids == ["GPU-unreadable-node001-1", "GPU-unreadable-node002-1"]


@pytest.mark.parametrize("name, model", [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 PCIe", "H100-80GB"),
    ("NVIDIA H100 NVL", "H100-NVL-94GB"),
    ("NVIDIA H200", "H200-141GB"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("Tesla V100-PCIE-16GB", "V100-16GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "GeForce-RTX-4090"),
    ("NVIDIA GH200 480GB", "GH200-480GB"),
])
def test_ledger_model_name(name: str, model: str) -> None:
    assert ledger_model_name(name) == model


@pytest.mark.parametrize("text, cid", [
    (f"12:memory:/docker/{CID_A}\n", CID_A),
    (f"0::/system.slice/docker-{CID_A}.scope\n", CID_A),
    (f"0::/kubepods/burstable/pod0b6e/{CID_B}\n", CID_B),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b6e_11.slice/cri-containerd-{CID_B}.scope\n", CID_B),
    (f"0::/kubepods.slice/kubepods-pod1.slice/crio-{CID_C}.scope\n", CID_C),
    (f"0::/kubepods.slice/kubepods-pod1.slice/crio-conmon-{CID_A}.scope\n", None),
    (f"0::/machine.slice/libpod-{CID_C}.scope/container\n", CID_C),
    (f"1:name=systemd:/docker/{CID_A}/docker/{CID_B}\n", CID_B),  # docker in docker: the inner one
    ("0::/user.slice/user-1000.slice/session-2.scope\n", None),
    ("0::/\n", None),
    ("", None),
])
def test_parse_container_id(text: str, cid: str | None) -> None:
    assert parse_container_id(text) == cid


@pytest.mark.parametrize("text, cid", [
    # cgroup v1, proctrack/cgroup: every controller names the job
    ("12:memory:/slurm/uid_1000/job_12345/step_0/task_0\n4:cpuset:/slurm/uid_1000/job_12345/step_0\n", "slurm-job-12345"),
    ("7:freezer:/slurm/uid_0/job_7/step_batch\n", "slurm-job-7"),
    ("3:devices:/slurm/uid_1000/job_42/step_extern\n", "slurm-job-42"),
    # cgroup v2, without and with systemd (slurmstepd.scope)
    ("0::/slurm/uid_1000/job_12345/step_0\n", "slurm-job-12345"),
    ("0::/system.slice/slurmstepd.scope/job_12345/step_batch/user/task_0\n", "slurm-job-12345"),
    ("0::/system.slice/node01_slurmstepd.scope/job_99/step_0/user/task_1\n", "slurm-job-99"),
    # a container started inside a job: the innermost wins
    (f"0::/system.slice/slurmstepd.scope/job_5/step_0/docker-{CID_A}.scope\n", CID_A),
    # slurmstepd's own cgroup, no job: nothing; 'job_' outside any Slurm path is not a Slurm job
    ("0::/system.slice/slurmstepd.scope/system\n", None),
    ("0::/user.slice/job_12345\n", None),
])
def test_parse_container_id_slurm_jobs(text: str, cid: str | None) -> None:
    assert parse_container_id(text) == cid


def test_container_id_of_missing_pid(tmp_path: Path) -> None:
    assert container_id_of(99999, tmp_path) is None


# --------------------------------------------------------------------------- MIG
class FakeMigNvml(FakeNvml):
    """FakeNvml with MIG: device 0 in MIG mode with a 3g.40gb and a 4g.40gb instance in slots 0 and 2."""

    def __init__(self, devices: list[FakeDevice]):
        super().__init__(devices)
        self.mig_handles = {("mig", 0): ("MIG-3333", 3, 40_448), ("mig", 2): ("MIG-4444", 4, 40_448)}

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        self._hit("nvmlDeviceGetMigMode")
        enabled = self.handles.index(handle) == 0
        return [self.NVML_DEVICE_MIG_ENABLE if enabled else 0, 0]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> SimpleNamespace:
        self._hit("nvmlDeviceGetGpuInstanceProfileInfo")
        return SimpleNamespace(sliceCount=7 if profile == self.NVML_GPU_INSTANCE_PROFILE_7_SLICE else 4)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._hit("nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        self._hit("nvmlDeviceGetMigDeviceHandleByIndex")
        if ("mig", index) not in self.mig_handles:
            raise FakeNVMLError(self.NVML_ERROR_NOT_FOUND)
        return ("mig", index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if handle in self.mig_handles:
            self._hit("nvmlDeviceGetUUID")
            return self.mig_handles[handle][0]
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetAttributes(self, handle: Any) -> SimpleNamespace:
        self._hit("nvmlDeviceGetAttributes")
        _, slices, mb = self.mig_handles[handle]
        return SimpleNamespace(gpuInstanceSliceCount=slices, memorySizeMB=mb)


def test_mig_instances_are_listed_with_their_share_and_read_only_now_and_then() -> None:
    clock = Clock()
    fake = FakeMigNvml([a100(), h100()])
    backend = NvmlBackend(fake, clock=clock)
    first = backend.sample(0)
    assert [(m.uuid, m.profile, m.share_milli) for m in first[0].mig_devices] == \
        [("MIG-3333", "3g.40gb", 428), ("MIG-4444", "4g.40gb", 571)]
    assert first[1].mig_devices == []  # MIG off on the H100
    reads = fake.calls["nvmlDeviceGetMigMode"]
    backend.sample(5000)
    assert fake.calls["nvmlDeviceGetMigMode"] == reads  # not read again within MIG_REFRESH_S
    assert backend.sample(10_000)[0].mig_devices == first[0].mig_devices  # still reported
    clock.t += 301
    backend.sample(15_000)
    assert fake.calls["nvmlDeviceGetMigMode"] == reads + 2


class FakeCiNvml(FakeMigNvml):
    """FakeMigNvml whose MIG devices are compute instances: three 1c.3g.40gb in one 3g GPU instance and a
    4g.40gb; MIG configuration-change events as NVML 12+ has them (pynvml names the constant apart)."""

    nvmlEventMigConfigChange = real_pynvml.nvmlEventMigConfigChange

    def __init__(self, devices: list[FakeDevice]):
        super().__init__(devices)
        # slot -> (uuid, GPU-instance slices, compute-instance slices, MB)
        self.cis = {("mig", 0): ("MIG-CI-1", 3, 1, 40_448), ("mig", 1): ("MIG-CI-2", 3, 1, 40_448),
                    ("mig", 2): ("MIG-CI-3", 3, 1, 40_448), ("mig", 3): ("MIG-4G", 4, 4, 40_448)}
        self.reconfigure(self.cis)

    def reconfigure(self, cis: dict) -> None:
        self.cis = cis
        self.mig_handles = {k: (uuid, gi, mb) for k, (uuid, gi, _, mb) in cis.items()}

    def nvmlDeviceGetAttributes(self, handle: Any) -> SimpleNamespace:
        self._hit("nvmlDeviceGetAttributes")
        _, gi, ci, mb = self.cis[handle]
        return SimpleNamespace(gpuInstanceSliceCount=gi, computeInstanceSliceCount=ci, memorySizeMB=mb)

    def mig_config_changed(self, device_index: int) -> None:
        self.events.append(SimpleNamespace(device=self.handles[device_index], eventType=self.nvmlEventMigConfigChange,
                                           eventData=0, gpuInstanceId=0, computeInstanceId=0))


def test_mig_compute_instances_get_their_compute_slices_not_the_gpu_instances() -> None:
    fake = FakeCiNvml([a100(), h100()])
    migs = NvmlBackend(fake, clock=Clock()).sample(0)[0].mig_devices
    # 1 compute slice of 7 each (NVIDIA's name 1c.3g.40gb), not 3 of 7 three times over
    assert [(m.uuid, m.profile, m.share_milli) for m in migs] == [
        ("MIG-CI-1", "1c.3g.40gb", 142), ("MIG-CI-2", "1c.3g.40gb", 142), ("MIG-CI-3", "1c.3g.40gb", 142),
        ("MIG-4G", "4g.40gb", 571)]
    assert sum(m.share_milli for m in migs) <= 1000  # the join never has to scale the holders down


def test_a_mig_reconfiguration_is_read_at_the_next_tick_after_its_event() -> None:
    clock = Clock()
    fake = FakeCiNvml([a100(), h100()])
    backend = NvmlBackend(fake, clock=clock)
    assert [m.uuid for m in backend.sample(0)[0].mig_devices] == ["MIG-CI-1", "MIG-CI-2", "MIG-CI-3", "MIG-4G"]
    # watched on the MIG GPU only, apart from the Xid registration
    assert (fake.handles[0], fake.nvmlEventMigConfigChange) in fake.registered
    assert all(types != fake.nvmlEventMigConfigChange for h, types in fake.registered if h == fake.handles[1])
    reads = fake.calls["nvmlDeviceGetMigMode"]
    # operator: the 4g instance destroyed, a new 4g instance created
    fake.reconfigure({**{k: v for k, v in fake.cis.items() if k != ("mig", 3)}, ("mig", 4): ("MIG-5555", 4, 4, 40_448)})
    clock.t += 10
    assert "MIG-5555" not in [m.uuid for m in backend.sample(10_000)[0].mig_devices]  # no event: not read yet
    fake.mig_config_changed(0)
    clock.t += 10
    assert [m.uuid for m in backend.sample(20_000)[0].mig_devices][-1] == "MIG-5555"
    assert fake.calls["nvmlDeviceGetMigMode"] == reads + 1  # that GPU only, once


def test_without_mig_events_the_layout_is_read_again_within_a_minute() -> None:
    clock = Clock()
    fake = FakeMigNvml([a100(), h100()])  # its pynvml has no MIG configuration-change event
    backend = NvmlBackend(fake, clock=clock)
    backend.sample(0)
    fake.mig_handles = {("mig", 0): ("MIG-3333", 3, 40_448), ("mig", 2): ("MIG-5555", 4, 40_448)}
    clock.t += 60
    assert [m.uuid for m in backend.sample(60_000)[0].mig_devices] == ["MIG-3333", "MIG-5555"]


class FakeLimitNvml(FakeNvml):
    """A pynvml with nvmlDeviceGetEnforcedPowerLimit (mW); limits per device index, None: NOT_SUPPORTED."""

    def __init__(self, devices: list[FakeDevice], limits_mw: list[int | None]):
        super().__init__(devices)
        self.limits_mw = limits_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._hit("nvmlDeviceGetEnforcedPowerLimit")
        self._dev(handle, "nvmlDeviceGetEnforcedPowerLimit")
        limit = self.limits_mw[self.handles.index(handle)]
        if limit is None:
            raise FakeNVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return limit


def test_the_enforced_power_limit_is_reported_and_read_only_now_and_then() -> None:
    clock = Clock()
    fake = FakeLimitNvml([a100(), h100()], [400_000, None])
    backend = NvmlBackend(fake, clock=clock)
    g0, g1 = backend.sample(0)
    assert g0.power_limit_w == 400.0  # mW -> W
    assert g1.power_limit_w is None  # NOT_SUPPORTED: not reported (the worker uses the configured limit)
    NodeTick(cluster="c", node="n", ts_ms=0, interval_ms=5_000, gpus=[g0, g1])  # valid on the wire
    reads = fake.calls["nvmlDeviceGetEnforcedPowerLimit"]
    assert reads == 2
    fake.limits_mw[0] = 250_000  # an operator lowered it (nvidia-smi -pl 250)
    assert backend.sample(5_000)[0].power_limit_w == 400.0  # not read every tick
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == reads
    clock.t += 301
    assert backend.sample(10_000)[0].power_limit_w == 250.0  # read again with the MIG layout
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == reads + 1  # NOT_SUPPORTED is not asked again


def test_identity_read_once_at_start_and_carried_on_every_sample() -> None:
    # the A100 tells all three; the second card (a GeForce-like board) answers NOT_SUPPORTED for the serial
    fake, backend = make([a100(serial="1321020012345", board_part_number="692-2G506-0210-002",
                               vbios="92.00.45.00.05"),
                          h100(board_part_number="692-2G520-0200-000")])
    assert fake.calls["nvmlDeviceGetSerial"] == 2
    for now in (1_000, 6_000, 11_000):
        g0, g1 = backend.sample(now_ms=now)
        assert (g0.serial, g0.board_part_number, g0.vbios_version) == (
            "1321020012345", "692-2G506-0210-002", "92.00.45.00.05")
        assert (g1.serial, g1.board_part_number, g1.vbios_version) == (None, "692-2G520-0200-000", None)
    # read at start only: no tick asks again
    assert [fake.calls[f] for f in ("nvmlDeviceGetSerial", "nvmlDeviceGetBoardPartNumber",
                                    "nvmlDeviceGetVbiosVersion")] == [2, 2, 2]
    NodeTick(cluster="c", node="n", ts_ms=1_000, interval_ms=5_000, gpus=[g0, g1])


def test_identity_not_supported_is_left_out() -> None:
    dev = a100(serial="1321020012345")
    fake = FakeNvml([dev])
    dev.unsupported.add("nvmlDeviceGetSerial")  # e.g. a driver without the query: NOT_SUPPORTED
    backend = NvmlBackend(fake, clock=Clock())
    (g0,) = backend.sample(now_ms=1_000)
    assert g0.serial is None and g0.health == GpuHealth.ok
