"""What a tick needs from a GPU source: one call that measures every GPU on the node.

Everything above this interface (tick building, scheduling, publishing) runs without a GPU;
only `NvmlBackend` talks to hardware. `SimBackend` is the fake-GPU switch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuledger.schemas.models import GpuSample

#: Xid codes after which a GPU is out of service until it is reset or the node rebooted.
#: From NVIDIA's Xid catalogue ("Xid Errors", docs.nvidia.com/deploy/xid-errors); each one's
#: recovery action is a GPU reset or node reboot, not an application restart:
#:   48  double-bit (uncorrectable) ECC error
#:   62  internal micro-controller halt
#:   64  ECC row-remapping failure
#:   74  NVLink error (link down / fatal link error)
#:   79  GPU has fallen off the bus
#:   95  uncontained ECC error (every process on the GPU is affected)
#:   119 GSP RPC timeout
#:   120 GSP error
#:   140 unrecovered ECC error
#: Deliberately not fatal: 92 (high single-bit ECC rate: a warning, the GPU still works),
#: 94 (contained ECC error: only the faulting process is killed, the GPU keeps serving),
#: and application errors such as 13, 31, 43, 45 (a job's bug, not the card's).
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC row-remapping failure",
    74: "NVLink error",
    79: "GPU fell off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def xid_down_reason(xid: int) -> str:
    """The `down_reason` written for a GPU taken out of service by a fatal Xid."""
    return f"xid {xid}: {FATAL_XIDS.get(xid, 'fatal error')}"


@runtime_checkable
class GpuBackend(Protocol):
    """A source of GPU measurements for one node."""

    #: Device-library calls made by the last `sample()`; the agent's cost per tick.
    calls_last_tick: int

    def sample(self, now_ms: int) -> list[GpuSample]:
        """Measure every GPU on the node now (`now_ms` is the tick's grid time).

        Must not raise for one bad GPU: a GPU that cannot be read is reported with
        health="down" and a down_reason, a metric that cannot be read is None."""
        ...

    def close(self) -> None:
        """Release the device library. Idempotent."""
        ...
