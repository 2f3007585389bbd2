"""dcgm-exporter /metrics -> GPU samples (agents/dcgm.py) and the dcgm agent (agents/dcgm_agent.py).

Fixtures under tests/fixtures/dcgm/ are real exporter output (tests/fixtures/dcgm/SOURCES.md).
Where a case is not in them (Xid changes, ECC, hpc_job, per-pod values) the test derives its text
from a real fixture's lines by changing values or labels, and says so.

Why one file: one agent's mapping and its command line share the fixtures, the derived-text helpers
and the local exporter; docs/dcgm.md names this file as the agent's tests."""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from gpuledger.agents.backend import xid_down_reason
from gpuledger.agents.dcgm import (
    MIB, MISSING_REASON, DcgmState, ExpositionError, gpu_samples, holder_container_id, is_blank, mig_share_milli,
    parse_exposition,
)
from gpuledger.agents.dcgm_agent import DcgmBackend, ScrapeFailed, default_node, main
from gpuledger.agents.gpu_agent import build_tick, run_agent
from gpuledger.agents.publisher import ListPublisher
from gpuledger.schemas.models import GpuHealth, NodeTick
from gpuledger.schemas.wire import decode_node_ticks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
H100 = "h100_k8s_aicr.prom"
A100_MIG = "a100_mig_cloud_native_docs.prom"
A30_MIG = "a30_mig_issue317.prom"
QUADRO = "quadro_k8s_dcgm_issue303.prom"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def samples(text: str, state: DcgmState | None = None, hostname: str | None = None):
    out, _ = gpu_samples(parse_exposition(text), state or DcgmState(), hostname=hostname)
    return out


def by_index(text: str) -> dict:
    return {g.index: g for g in samples(text)}


# A real row's labels (A100 of NVIDIA's docs) to derive cases the fixtures do not hold.
A100_LABELS = 'gpu="0",UUID="GPU-34319582-d595-d1c7-d1d2-179bcfa61660",device="nvidia0",Hostname="ub20-a100-k8s"'
A100_UUID = "GPU-34319582-d595-d1c7-d1d2-179bcfa61660"


def derived(*metrics: tuple[str, str], labels: str = A100_LABELS) -> str:
    return "".join(f"{m}{{{labels}}} {v}\n" for m, v in metrics)


# --------------------------------------------------------------------------- real fixtures
def test_h100_node_with_a_kubernetes_pod():
    gpus = by_index(fixture(H100))
    assert sorted(gpus) == list(range(8))
    g0 = gpus[0]
    assert g0.gpu_uuid == "GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005"
    assert g0.model == "H100-80GB"  # "NVIDIA H100 80GB HBM3", through the NVML backend's normaliser
    assert (g0.temperature_c, g0.power_w, g0.util_gpu_pct) == (30, 113.611, 0)
    assert [(p.pid, p.container_id) for p in g0.processes] == [
        (0, "k8s://dynamo-workload/vllm-agg-0-vllmdecodeworker-s65j5/main")]
    assert g0.processes[0].sm_util_pct is None  # the pod row repeats the GPU's value: not a per-pod part
    g7 = gpus[7]
    assert (g7.gpu_uuid, g7.temperature_c, g7.power_w, g7.processes) == (
        "GPU-04d228d3-3b5a-3534-f5cf-969706647d56", 26, 66.997, [])
    assert all(g.health == GpuHealth.ok and g.xid_errors == [] and g.mig_devices == [] for g in gpus.values())
    NodeTick(cluster="c", node="gpu-node-1", ts_ms=0, interval_ms=5000, gpus=list(gpus.values()))


def test_a100_with_a_mig_instance_from_nvidias_docs():
    [gpu] = samples(fixture(A100_MIG))
    assert gpu.gpu_uuid == A100_UUID and gpu.index == 0
    assert gpu.model == "unknown"  # that exporter version wrote no modelName label
    assert gpu.power_w == 409.692
    assert gpu.energy_j == pytest.approx(319159.391)  # mJ -> J
    assert gpu.temperature_c == 61
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz) == (1215, 1215)
    assert gpu.mem_used_bytes == 4845 * MIB
    assert gpu.mem_total_bytes == (4845 + 35690) * MIB  # no FB_TOTAL: used + free
    assert (gpu.pcie_tx_bytes_per_s, gpu.pcie_rx_bytes_per_s) == (33011804, 97863601)
    assert gpu.sm_active_pct is None  # SM_ACTIVE not collected there (GR_ENGINE_ACTIVE is not SM activity)
    assert [m.model_dump() for m in gpu.mig_devices] == [
        {"uuid": f"{A100_UUID}/gi/13", "profile": "1g.5gb", "share_milli": 142}]  # 1 of 7 slices
    assert gpu.xid_errors == [] and gpu.health == GpuHealth.ok


def test_a30_seen_only_through_its_mig_instances():
    g0, g1 = samples(fixture(A30_MIG))
    assert (g0.index, g0.model, g1.index) == (0, "A30", 1)
    assert [(m.profile, m.share_milli) for m in g0.mig_devices] == [("1g.6gb", 250)] * 4  # A30: 4 slices
    assert [m.uuid for m in g1.mig_devices] == [
        "GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49/gi/3", "GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49/gi/4"]
    assert g0.sm_active_pct == 0.0 and g0.sm_clock_mhz == 1440
    assert g0.util_gpu_pct is None  # GPU_UTIL is not defined for MIG instances


def test_instance_only_sm_activity_is_weighted_by_share():
    # derived from the A30 fixture: two of its instances busy at 0.5 and 1.0
    text = fixture(A30_MIG).replace('GPU_I_ID="3",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 0.000000',
                                    'GPU_I_ID="3",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 0.5')
    text = text.replace('GPU_I_ID="4",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 0.000000',
                        'GPU_I_ID="4",Hostname="yg-data-k8s-gpu-a30-node-test-test0003.mt"} 1.0')
    g0, g1 = samples(text)
    assert g0.sm_active_pct == pytest.approx((50 + 100) * 0.25)
    assert g1.sm_active_pct == pytest.approx((50 + 100) * 0.25)  # its other two instances are not exported


def test_quadro_node_two_gpus_held_by_one_pod():
    gpus = by_index(fixture(QUADRO))
    assert sorted(gpus) == [2, 3]
    assert gpus[3].model == "Quadro-RTX-5000" and gpus[3].util_gpu_pct == 100
    assert {p.container_id for g in gpus.values() for p in g.processes} == {
        "k8s://default/gpu-busy-test-all-gpus/gpu-workload"}


def test_readme_outputs_and_dcgm_blank_values():
    for name in ("readme_quickstart.prom", "readme_kubernetes.prom"):
        [gpu] = samples(fixture(name))
        assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.processes) == (139, 405, [])  # empty pod labels: no holder
    # the README's MEMORY_TEMP value is DCGM's int64 "not supported" sentinel
    assert is_blank(9223372036854775794) and is_blank(2147483632) and is_blank(2.0**47)
    assert not is_blank(319159391) and not is_blank(0)
    [gpu] = samples(derived(("DCGM_FI_DEV_GPU_TEMP", "9223372036854775794"), ("DCGM_FI_DEV_SM_CLOCK", "2147483634")))
    assert gpu.temperature_c is None and gpu.sm_clock_mhz is None


# --------------------------------------------------------------------------- every mapped field
def test_every_mapped_field_and_unit():
    [gpu] = samples(derived(
        ("DCGM_FI_DEV_GPU_UTIL", "87"), ("DCGM_FI_PROF_SM_ACTIVE", "0.625"),
        ("DCGM_FI_DEV_FB_USED", "1024"), ("DCGM_FI_DEV_FB_FREE", "3000"), ("DCGM_FI_DEV_FB_TOTAL", "81559"),
        ("DCGM_FI_DEV_GPU_TEMP", "64"), ("DCGM_FI_DEV_POWER_USAGE", "245.5"),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "251885217371"),
        ("DCGM_FI_DEV_SM_CLOCK", "1980"), ("DCGM_FI_DEV_MEM_CLOCK", "2619"),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", "33011804"), ("DCGM_FI_PROF_PCIE_RX_BYTES", "97863601"),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", "1000000"), ("DCGM_FI_PROF_NVLINK_RX_BYTES", "2000000"),
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "4"), ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "5"),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "1"), ("DCGM_FI_DEV_XID_ERRORS", "0"),
    ))
    assert gpu.util_gpu_pct == 87 and gpu.sm_active_pct == 62.5
    assert gpu.mem_used_bytes == 1024 * MIB and gpu.mem_total_bytes == 81559 * MIB  # FB_TOTAL wins over used+free
    assert (gpu.temperature_c, gpu.power_w) == (64, 245.5)
    assert gpu.energy_j == pytest.approx(251885217.371)
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz) == (1980, 2619)
    assert (gpu.pcie_tx_bytes_per_s, gpu.pcie_rx_bytes_per_s) == (33011804, 97863601)
    assert (gpu.nvlink_tx_bytes_per_s, gpu.nvlink_rx_bytes_per_s) == (1e6, 2e6)
    assert gpu.throttle_reasons == 4
    assert (gpu.ecc_sbe_total, gpu.ecc_dbe_total) == (5, 1)
    assert isinstance(gpu.ecc_sbe_total, int) and isinstance(gpu.mem_used_bytes, int)


def test_memory_total_adds_reserved_and_counter_suffix_is_accepted():
    [gpu] = samples(derived(("DCGM_FI_DEV_FB_USED", "4845"), ("DCGM_FI_DEV_FB_FREE", "35690"),
                            ("DCGM_FI_DEV_FB_RESERVED", "425"),
                            ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total", "1000")))
    assert gpu.mem_total_bytes == (4845 + 35690 + 425) * MIB
    assert gpu.energy_j == 1.0


def test_a_reading_outside_the_schema_is_dropped_not_the_tick():
    [gpu] = samples(derived(("DCGM_FI_DEV_GPU_TEMP", "300"), ("DCGM_FI_DEV_POWER_USAGE", "100"),
                            ("DCGM_FI_DEV_GPU_UTIL", "-1")))
    assert gpu.temperature_c is None and gpu.util_gpu_pct is None and gpu.power_w == 100


def test_unknown_metrics_and_rows_without_a_gpu_are_ignored():
    text = fixture(A100_MIG) + (
        "# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} 12345.67\n"
        "DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT{nvswitch=\"0\"} 40\n"
        "DCGM_FI_DEV_GPU_TEMP{cpu=\"0\"} 40\n")
    assert samples(text) == samples(fixture(A100_MIG))
    assert {r.metric for r in parse_exposition(text)} >= {"DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS"}
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE" not in {r.metric for r in parse_exposition(text)}


# --------------------------------------------------------------------------- holders
def test_holder_container_ids():
    assert holder_container_id({"pod": "p", "namespace": "ns", "container": "c"}) == "k8s://ns/p/c"
    assert holder_container_id({"pod_name": "p", "pod_namespace": "ns", "container_name": "c"}) == "k8s://ns/p/c"
    assert holder_container_id({"pod": "", "namespace": "", "container": ""}) is None
    assert holder_container_id({"hpc_job": "4242"}) == "slurm-job-4242"
    assert holder_container_id({"hpc_job": ""}) is None and holder_container_id({}) is None


def test_hpc_jobs_sharing_a_gpu_are_its_holders_and_values_are_not_summed():
    # derived: the exporter repeats each row once per job in the HPC mapping file of the GPU
    text = derived(("DCGM_FI_DEV_POWER_USAGE", "409.692000"), labels=A100_LABELS + ',hpc_job="1234"')
    text += derived(("DCGM_FI_DEV_POWER_USAGE", "409.692000"), labels=A100_LABELS + ',hpc_job="5678"')
    [gpu] = samples(text)
    assert gpu.power_w == 409.692
    assert [(p.pid, p.container_id) for p in gpu.processes] == [(0, "slurm-job-1234"), (0, "slurm-job-5678")]


def test_per_pod_parts_in_the_exporters_per_process_mode():
    # derived: its shared-GPU mode keeps the GPU's own row next to one row per pod for GPU_UTIL/FB_USED
    pod = A100_LABELS + ',container="c",namespace="ns",pod="{}",pod_uid="u"'
    text = (derived(("DCGM_FI_DEV_GPU_UTIL", "70"), ("DCGM_FI_DEV_FB_USED", "3000"), ("DCGM_FI_DEV_POWER_USAGE", "300"))
            + derived(("DCGM_FI_DEV_GPU_UTIL", "50"), ("DCGM_FI_DEV_FB_USED", "2000"), ("DCGM_FI_DEV_POWER_USAGE", "300"),
                      labels=pod.format("a"))
            + derived(("DCGM_FI_DEV_GPU_UTIL", "20"), ("DCGM_FI_DEV_FB_USED", "1000"), ("DCGM_FI_DEV_POWER_USAGE", "300"),
                      labels=pod.format("b")))
    [gpu] = samples(text)
    assert (gpu.util_gpu_pct, gpu.mem_used_bytes, gpu.power_w) == (70, 3000 * MIB, 300)
    assert [(p.container_id, p.sm_util_pct, p.mem_used_bytes) for p in gpu.processes] == [
        ("k8s://ns/a/c", 50, 2000 * MIB), ("k8s://ns/b/c", 20, 1000 * MIB)]


def test_mig_instance_uuid_from_dra_labels_and_profile_shares():
    text = derived(("DCGM_FI_PROF_SM_ACTIVE", "0.5"),
                   labels=A100_LABELS + ',GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",'
                                        'dra_mig_device_uuid="MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55"')
    [gpu] = samples(text)
    assert [m.model_dump() for m in gpu.mig_devices] == [
        {"uuid": "MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55", "profile": "3g.40gb", "share_milli": 428}]
    assert gpu.sm_active_pct == pytest.approx(50 * 0.428)
    assert mig_share_milli("7g.80gb", "A100-80GB") == 1000 and mig_share_milli("2g.12gb", "A30") == 500
    assert mig_share_milli("", "A100-80GB") is None


# --------------------------------------------------------------------------- Xid
def xid_text(value: str) -> str:
    return derived(("DCGM_FI_DEV_XID_ERRORS", value), ("DCGM_FI_DEV_POWER_USAGE", "100"))


def test_xid_is_reported_when_the_last_xid_gauge_changes():
    state = DcgmState()
    seen = []
    for value in ("0", "13", "13", "31", "31"):
        [gpu], state = gpu_samples(parse_exposition(xid_text(value)), state)
        seen.append((gpu.xid_errors, gpu.health))
    assert seen == [([], "ok"), ([13], "ok"), ([], "ok"), ([31], "ok"), ([], "ok")]  # 13, 31: a job's fault


def test_fatal_xid_takes_the_gpu_down_until_the_agent_restarts():
    state = DcgmState()
    out = []
    for value in ("0", "79", "79", "0"):
        [gpu], state = gpu_samples(parse_exposition(xid_text(value)), state)
        out.append((gpu.xid_errors, gpu.health, gpu.down_reason))
    down = (GpuHealth.down, xid_down_reason(79))
    assert out == [([], GpuHealth.ok, None), ([79], *down), ([], *down), ([], *down)]
    assert out[1][2] == "xid 79: GPU fell off the bus"


def test_fatal_xid_already_in_the_gauge_at_the_first_scrape_is_a_warning_not_down(caplog):
    """This used to take the GPU down. But dcgm-exporter keeps serving the last Xid after the GPU is
    reset (dcgm-exporter#500, DCGM#277), so after a repair and an agent restart the stale 48 took the
    repaired, busy GPU down for good and its holder's time was billed to nobody. Only a fatal Xid seen
    arriving while the agent runs takes a GPU down (as with NVML, whose Xid events start at the agent's start)."""
    state = DcgmState()
    out = []
    with caplog.at_level("WARNING", logger="gpuledger.agents.dcgm"):
        for value in ("48", "48", "48"):
            [gpu], state = gpu_samples(parse_exposition(xid_text(value)), state)
            out.append((gpu.xid_errors, gpu.health, gpu.down_reason))
    assert out == [([], GpuHealth.ok, None)] * 3, f"a stale fatal Xid at the first scrape took the GPU down: {out}"
    assert [r.levelname for r in caplog.records if "fatal" in r.getMessage()] == ["WARNING"]  # once, at the start
    assert "xid 48" in caplog.text


def test_a_fatal_xid_after_a_fatal_first_scrape_still_takes_the_gpu_down():
    state = DcgmState()
    out = []
    for value in ("48", "79", "0", "48"):
        [gpu], state = gpu_samples(parse_exposition(xid_text(value)), state)
        out.append((gpu.xid_errors, gpu.health))
    assert out == [([], GpuHealth.ok), ([79], GpuHealth.down), ([], GpuHealth.down), ([48], GpuHealth.down)]
    assert gpu.down_reason == xid_down_reason(79)  # the first fatal Xid seen stays the reason
    # the same 48 coming back after a blank first scrape is new, hence down
    [gpu], state = gpu_samples(parse_exposition(xid_text("9223372036854775792")), DcgmState())
    [gpu], state = gpu_samples(parse_exposition(xid_text("48")), state)
    assert (gpu.xid_errors, gpu.health) == ([48], GpuHealth.down)


# --------------------------------------------------------------------------- vanished GPUs
H100_GPU3 = "GPU-a65a773d-52bb-bcc1-a8ee-f78c3faa2e2d"


def without_gpu(text: str, index: int) -> str:
    """The exposition as the exporter serves it once that GPU fell off the bus: DCGM stops exporting it."""
    return "".join(line for line in text.splitlines(keepends=True) if f'gpu="{index}",' not in line)


def scrape_all(*texts: str, hostname: str | None = None) -> list[list]:
    state, ticks = DcgmState(), []
    for text in texts:
        gpus, state = gpu_samples(parse_exposition(text), state, hostname=hostname)
        ticks.append(gpus)
    return ticks


def test_a_gpu_missing_from_the_scrape_is_reported_down_until_it_returns(caplog):
    """It used to vanish from the node's ticks (one GPU fewer, nothing down): capacity shrank silently and
    its holder's time was no longer accounted. The NVML agent keeps a lost GPU's slot, reported down."""
    full, gone = fixture(H100), without_gpu(fixture(H100), 3)
    with caplog.at_level("WARNING", logger="gpuledger.agents.dcgm"):
        ticks = scrape_all(full, gone, gone, full)
    assert [[g.index for g in gpus] for gpus in ticks] == [list(range(8))] * 4, "the vanished GPU left the tick"
    for gpus in ticks[1:3]:
        g3 = gpus[3]
        assert (g3.gpu_uuid, g3.index, g3.model, g3.health, g3.down_reason) == (
            H100_GPU3, 3, "H100-80GB", GpuHealth.down, MISSING_REASON)
        assert (g3.power_w, g3.temperature_c, g3.processes, g3.xid_errors) == (None, None, [], [])  # nothing invented
        assert all(g.health == GpuHealth.ok for g in gpus if g.index != 3)
        NodeTick(cluster="c", node="gpu-node-1", ts_ms=0, interval_ms=5000, gpus=gpus)
    back = ticks[3][3]  # back: from its own rows again
    assert (back.gpu_uuid, back.health, back.down_reason, back.temperature_c, back.power_w) == (
        H100_GPU3, GpuHealth.ok, None, 29, 67.316)
    assert [r.levelname for r in caplog.records if "missing" in r.getMessage()] == ["ERROR"]  # once, when it goes
    assert [r.levelname for r in caplog.records if "again" in r.getMessage()] == ["WARNING"]
    assert MISSING_REASON == "missing from the dcgm-exporter scrape (fallen off the bus?)"


def test_a_missing_gpu_keeps_its_last_known_memory_total_and_a_mig_only_gpu_is_present():
    gpu1 = A100_LABELS.replace('gpu="0"', 'gpu="1"').replace(A100_UUID, "GPU-11111111-2222-3333-4444-555555555555")
    full = derived(("DCGM_FI_DEV_FB_USED", "100"), ("DCGM_FI_DEV_FB_FREE", "900")) + derived(
        ("DCGM_FI_DEV_FB_TOTAL", "81559"), labels=gpu1)
    blank_total = derived(("DCGM_FI_DEV_FB_USED", "100")) + derived(("DCGM_FI_DEV_POWER_USAGE", "70"), labels=gpu1)
    gone = derived(("DCGM_FI_DEV_POWER_USAGE", "70"), labels=gpu1)
    ticks = scrape_all(full, blank_total, gone)
    assert ticks[1][0].mem_total_bytes is None and ticks[1][0].health == GpuHealth.ok
    [g0, g1] = ticks[2]
    assert (g0.index, g0.gpu_uuid, g0.health, g0.mem_total_bytes) == (0, A100_UUID, GpuHealth.down, 1000 * MIB)
    assert (g0.model, g1.health) == ("unknown", GpuHealth.ok)  # no modelName label: the model it had
    # A GPU exported only through its MIG instances is present; its sibling vanishing is down.
    [a0, a1] = scrape_all(fixture(A30_MIG), without_gpu(fixture(A30_MIG), 1))[1]
    assert (a0.health, len(a0.mig_devices)) == (GpuHealth.ok, 4)
    assert (a1.index, a1.model, a1.health, a1.down_reason, a1.mig_devices) == (
        1, "A30", GpuHealth.down, MISSING_REASON, [])


def test_a_missing_gpu_whose_index_another_gpu_reports_is_forgotten():
    """A GPU replaced without restarting the agent: two GPUs of one index would resolve index-based
    allocations to the wrong one, so the missing one is dropped, for good."""
    new_uuid = "GPU-99999999-8888-7777-6666-555555555555"
    full, gone = fixture(H100), without_gpu(fixture(H100), 3)
    replaced = full.replace(H100_GPU3, new_uuid)
    ticks = scrape_all(full, gone, replaced, replaced, without_gpu(replaced, 3), full)
    assert ticks[1][3].gpu_uuid == H100_GPU3 and ticks[1][3].health == GpuHealth.down
    for gpus in ticks[2:4]:
        assert [g.index for g in gpus] == list(range(8))
        assert (gpus[3].gpu_uuid, gpus[3].health) == (new_uuid, GpuHealth.ok)
    assert [(g.gpu_uuid, g.health) for g in ticks[4] if g.index == 3] == [(new_uuid, GpuHealth.down)]  # not the old one
    assert [(g.gpu_uuid, g.health) for g in ticks[5] if g.index == 3] == [(H100_GPU3, GpuHealth.ok)]


def test_no_gpu_rows_after_gpus_were_seen_is_a_failed_scrape_not_every_gpu_down():
    """The exporter serves all its GPUs at once: an exposition without any (restarting, not ready) is a
    failed scrape, not eight GPUs fallen off the bus at once. At the first scrape: no samples, as before."""
    _, state = gpu_samples(parse_exposition(fixture(H100)), DcgmState())
    for text in ("", "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature.\n",
                 'DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT{nvswitch="0"} 40\n'):
        with pytest.raises(ExpositionError, match=r"the exporter serves no GPU \(restarting\?\)"):
            gpu_samples(parse_exposition(text), state)
        assert gpu_samples(parse_exposition(text), DcgmState()) == ([], DcgmState())
    # The edge: the tick is skipped and counted; the GPUs seen are kept for the next scrape.
    bodies = [fixture(H100), "", without_gpu(fixture(H100), 3)]
    backend = DcgmBackend("http://dcgm:9400/metrics", fetch=lambda u, t: bodies.pop(0))
    clock = iter(range(0, 10_000_000, 1000))
    pub = ListPublisher()
    assert run_agent(backend, pub, "gpu-samples", cluster="c", node="gpu-node-1", interval_s=1.0,
                     clock=lambda: next(clock) / 1000.0 + 0.0005, sleep=lambda s: None, max_ticks=2) == 2
    assert (backend.scrapes, backend.scrapes_failed) == (3, 1)
    ticks = [t for _, _, value, _ in pub.messages for t in decode_node_ticks(value)]
    assert [[g.health for g in t.gpus].count(GpuHealth.down) for t in ticks] == [0, 1]
    assert (ticks[1].gpus[3].index, ticks[1].gpus[3].down_reason) == (3, MISSING_REASON)


def test_only_the_nodes_gpus_count_as_seen():
    """The hostname filter comes first: another host's GPU vanishing is not this node's GPU down."""
    both = fixture(H100) + fixture(QUADRO)
    ticks = scrape_all(both, without_gpu(fixture(H100), 3) + fixture(QUADRO),
                       fixture(H100) + without_gpu(fixture(QUADRO), 2), hostname="phx8-2fa")
    assert [[(g.index, g.health) for g in gpus] for gpus in ticks] == [
        [(2, GpuHealth.ok), (3, GpuHealth.ok)], [(2, GpuHealth.ok), (3, GpuHealth.ok)],
        [(2, GpuHealth.down), (3, GpuHealth.ok)]]
    assert (ticks[2][0].gpu_uuid, ticks[2][0].model) == ("GPU-a76358a7-c820-d3dc-ad4e-2ff0d26935b2", "Quadro-RTX-5000")


# --------------------------------------------------------------------------- malformed, hosts
@pytest.mark.parametrize("text", [
    fixture(A100_MIG)[:-40],                                     # cut mid-line (a truncated response)
    'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a" 87\n',            # unclosed labels
    "<html><body>502 Bad Gateway</body></html>\n",               # a proxy's error page
    "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n...\n",                  # the README's elision
])
def test_malformed_exposition_is_an_error_with_a_reason(text):
    with pytest.raises(ExpositionError, match="malformed exposition"):
        parse_exposition(text)


def test_an_endpoint_serving_several_hosts_gives_only_the_nodes_rows():
    text = fixture(H100) + fixture(QUADRO)
    assert {g.index for g in samples(text, hostname="phx8-2fa")} == {2, 3}
    assert len(samples(text, hostname="gpu-node-1")) == 8
    with pytest.raises(ExpositionError, match="none is 'other'"):
        samples(text, hostname="other")
    with pytest.raises(ExpositionError, match="several hosts"):
        samples(text)
    # one host: its rows whatever the node is called (in Kubernetes the label is the exporter pod's name)
    assert len(samples(fixture(H100), hostname="ip-10-0-0-1")) == 8


# --------------------------------------------------------------------------- backend and agent
def test_backend_counts_failed_scrapes_and_the_agent_skips_those_ticks():
    bodies = [fixture(H100), OSError("connection refused"), "<html>oops", fixture(H100)]

    def fetch(url: str, timeout_s: float) -> str:
        body = bodies.pop(0)
        if isinstance(body, Exception):
            raise body
        return body

    backend = DcgmBackend("http://dcgm:9400/metrics", fetch=fetch)
    clock = iter(range(0, 10_000_000, 1000))
    pub = ListPublisher()
    published = run_agent(backend, pub, "gpu-samples", cluster="c", node="gpu-node-1", interval_s=1.0,
                          clock=lambda: next(clock) / 1000.0 + 0.0005, sleep=lambda s: None, max_ticks=2)
    assert published == 2
    assert (backend.scrapes, backend.scrapes_failed) == (4, 2)
    ticks = [t for _, _, value, _ in pub.messages for t in decode_node_ticks(value)]
    assert [len(t.gpus) for t in ticks] == [8, 8]
    with pytest.raises(ScrapeFailed):
        DcgmBackend("http://x", fetch=lambda u, t: "").sample(0)  # nothing exported: nothing invented


@pytest.mark.parametrize("exc", [http.client.BadStatusLine("SSH-2.0-OpenSSH_9.6"), http.client.IncompleteRead(b"DCGM", 100),
                                 http.client.RemoteDisconnected("closed")])
def test_a_non_http_answer_or_a_cut_off_body_is_a_failed_scrape(exc):
    """http.client.HTTPException is not an OSError: it must be a counted scrape failure, not a crash."""
    def fetch(url, timeout_s):
        raise exc

    backend = DcgmBackend("http://x", fetch=fetch)
    with pytest.raises(ScrapeFailed):
        backend.sample(0)
    assert (backend.scrapes, backend.scrapes_failed) == (1, 1)


def test_a_non_http_server_is_a_failed_scrape_over_a_socket():
    """A real socket answering garbage (not HTTP) to the real fetch."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(ScrapeFailed):
            DcgmBackend(f"http://127.0.0.1:{server.getsockname()[1]}/metrics", timeout_s=5).scrape()
    finally:
        thread.join(5)
        server.close()


class _Exporter(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def exporter():
    """A local HTTP server standing in for dcgm-exporter; set `.body` / `.status` on the handler."""
    handler = type("Handler", (_Exporter,), {"body": fixture(H100).encode(), "status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_agent_once_print_over_http_gives_a_valid_node_tick(exporter, capsys):
    _, url = exporter
    assert main(["--url", url, "--once", "--print", "--cluster", "lab", "--interval", "5"]) == 0
    tick = NodeTick.model_validate_json(capsys.readouterr().out)
    assert (tick.cluster, tick.node, tick.interval_ms, len(tick.gpus)) == ("lab", "gpu-node-1", 5000, 8)
    assert tick.ts_ms % 5000 == 0
    assert tick.gpus[0].processes[0].container_id == "k8s://dynamo-workload/vllm-agg-0-vllmdecodeworker-s65j5/main"


def test_agent_once_fails_cleanly_when_the_endpoint_errors(exporter, capsys):
    handler, url = exporter
    handler.status, handler.body = 500, b"DCGM not ready"
    assert main(["--url", url, "--once", "--print", "--node", "n1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "HTTP Error 500" in captured.err


def test_gpuledger_agent_dcgm_command_line(exporter):
    _, url = exporter
    done = subprocess.run([sys.executable, "-m", "gpuledger.cli", "agent", "dcgm", "--url", url, "--once", "--print",
                           "--node", "n7"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tick = NodeTick.model_validate(orjson.loads(done.stdout))
    assert tick.node == "n7" and [g.index for g in tick.gpus] == list(range(8))
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", tick.gpus[0].gpu_uuid)


def test_build_tick_with_the_backend_is_a_node_tick():
    backend = DcgmBackend("http://x", fetch=lambda u, t: fixture(A100_MIG))
    tick = build_tick(backend, cluster="c", node="ub20-a100-k8s", now_ms=10_000, interval_ms=5000)
    assert NodeTick.model_validate_json(tick.model_dump_json()) == tick
    assert backend.calls_last_tick == 1


def test_an_xid_after_a_blank_first_scrape_is_new():
    """A blank gauge is DCGM's "no Xid yet": on a healthy GPU it stays blank, so the first real value
    after it is the GPU's first Xid and must be reported (taking it for a baseline would swallow it).
    A blank between two values changes nothing."""
    state = DcgmState()
    [gpu], state = gpu_samples(parse_exposition(xid_text("9223372036854775792")), state)  # DCGM int64 blank
    assert gpu.xid_errors == []
    [gpu], state = gpu_samples(parse_exposition(xid_text("13")), state)
    assert gpu.xid_errors == [13]
    [gpu], state = gpu_samples(parse_exposition(xid_text("9223372036854775792")), state)  # blank again
    assert gpu.xid_errors == []
    [gpu], state = gpu_samples(parse_exposition(xid_text("13")), state)
    assert gpu.xid_errors == []


@pytest.mark.parametrize("value", ["-Inf", "+Inf", "NaN"])
@pytest.mark.parametrize("metric", ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS"])
def test_a_non_finite_value_is_blank(metric, value):
    """-Inf in an integer field (FB_USED -> mem_used_bytes) raised OverflowError; any non-finite
    value is read as missing, like DCGM's blank sentinels."""
    [gpu], _ = gpu_samples(parse_exposition(derived((metric, value), ("DCGM_FI_DEV_GPU_TEMP", "40"))), DcgmState())
    assert gpu.temperature_c == 40
    assert gpu.mem_used_bytes is None and gpu.power_w is None and gpu.xid_errors == []


def test_default_node_is_the_single_hostname_label_else_this_host():
    assert default_node(DcgmBackend("http://x", fetch=lambda u, t: fixture(H100))) == "gpu-node-1"
    assert default_node(DcgmBackend("http://x", fetch=lambda u, t: fixture(H100) + fixture(QUADRO))) == socket.gethostname()
    assert default_node(DcgmBackend("http://x", fetch=lambda u, t: fixture("readme_quickstart.prom"))) == socket.gethostname()


# --------------------------------------------------------------------------- a repeated collection
def energy_text(energy_mj: int) -> str:
    return derived(("DCGM_FI_DEV_POWER_USAGE", "300"), ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", str(energy_mj)),
                   labels=A100_LABELS + ',modelName="NVIDIA A100-SXM4-80GB"')


def test_an_energy_counter_repeated_from_the_exporters_last_collection_is_not_this_ticks_energy(caplog):
    """dcgm-exporter serves its last collection until the next one, every 30 s by default (`-c`); the
    agent scrapes every 5 s. The same counter came back 5 times in 6 and was reported as this tick's
    energy: a 0 J delta for 5 ticks, then 30 s of energy in one 5-s tick, above the power limit and so
    replaced by power x time. A busy A100 (300 W) was billed 3,000 J of 18,000 J in 60 s."""
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.streams.join import NodeJoin

    state, ticks = DcgmState(), []
    start_ms, interval_ms = 1_793_577_600_000, 5000
    with caplog.at_level("WARNING", logger="gpuledger.agents.dcgm"):
        for k in range(12):  # 60 s of 5-s ticks; the exporter collected at 0 s and 30 s
            counter_mj = 1_000_000_000 + (k // 6) * 9_000_000  # 300 W x 30 s = 9,000 J per collection
            gpus, state = gpu_samples(parse_exposition(energy_text(counter_mj)), state)
            ticks.append(NodeTick(cluster="c", node="n1", ts_ms=start_ms + k * interval_ms, interval_ms=interval_ms,
                                  gpus=gpus))
    assert [t.gpus[0].energy_j is not None for t in ticks] == [True] + [False] * 5 + [True] + [False] * 5
    assert [r.levelname for r in caplog.records if "collection" in r.getMessage()] == ["WARNING"]  # once
    join = NodeJoin(node="n1")
    for t in ticks:
        join.add_tick(t)
    ledger = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
    records = join.close_until(ticks[-1].ts_ms + interval_ms, ledger)
    assert sum(r["energy_j"] for r in records) == pytest.approx(300 * 60)  # power x time throughout
    # a counter that moves every scrape (exporter collecting at least as often) is reported every tick
    state = DcgmState()
    for counter_mj in (1_000_000_000, 1_001_500_000, 1_003_000_000):
        [gpu], state = gpu_samples(parse_exposition(energy_text(counter_mj)), state)
        assert gpu.energy_j == counter_mj / 1000


def test_default_node_waits_for_the_exporter_rather_than_taking_this_hosts_name(exporter, capsys):
    """The exporter not answering yet at the agent's start (a booting node: the exporter's DaemonSet
    takes seconds to start DCGM) made the node this machine's host name, in Kubernetes the agent pod's
    name, for the agent's whole run: every tick under a node no scheduler knows, its GPUs' time held by
    nobody. The name is now taken from the first exposition with GPU rows."""
    answers: list = [OSError("connection refused"), "", fixture(H100)]  # down, up but not collecting, ready

    def fetch(url: str, timeout_s: float) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    slept: list = []
    backend = DcgmBackend("http://x", fetch=fetch)
    assert default_node(backend, retry_s=2.0, sleep=slept.append) == "gpu-node-1"
    assert slept == [2.0, 2.0] and backend.scrapes_failed == 2
    # --once tries once: the failed scrape is the answer (exit 1), not this host's name
    handler, url = exporter
    handler.status, handler.body = 503, b"DCGM not ready"
    assert main(["--url", url, "--once", "--print"]) == 1
    assert "HTTP Error 503" in capsys.readouterr().err


def test_the_enforced_power_limit_is_the_samples_limit_as_with_nvml():
    """DCGM_FI_DEV_ENFORCED_POWER_LIMIT (W) is NVML's nvmlDeviceGetEnforcedPowerLimit, which the NVML
    agent sends as `power_limit_w`: the worker's energy cap (docs/accounting.md §4a). It was ignored, so
    a GPU capped at 250 W was judged against its model's configured limit (400 W for an A100-80GB):
    a counter rise of 2,000 J in 5 s (400 W) on that GPU was believed, NVML's samples have it refused.
    0 W is no limit (as in the NVML agent): missing."""
    [gpu] = samples(derived(("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "250.000000"), ("DCGM_FI_DEV_POWER_USAGE", "245")))
    assert gpu.power_limit_w == 250.0
    [gpu] = samples(derived(("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "0"), ("DCGM_FI_DEV_POWER_USAGE", "245")))
    assert gpu.power_limit_w is None and gpu.power_w == 245


def test_agent_once_exits_1_when_the_broker_refuses_the_tick(exporter, monkeypatch, capsys):
    """`--once` returned 0 when the broker refused the tick (a delivery report with an error, e.g.
    topic authorization failed): flush() counts only messages still waiting, and a refused one is not
    waiting. The tick was lost with a success exit. A fake producer, this being the exit code's logic
    (publishing to the real broker: tests/integration/test_dcgm_agent.py)."""
    from refusing_producer import refuse_every_message

    refuse_every_message(monkeypatch)
    _, url = exporter
    assert main(["--url", url, "--once", "--node", "n1"]) == 1
    assert "not delivered" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["inf", "nan", "0", "-1"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout, capsys):
    """`--timeout inf` passed the check (only <= 0 was refused) and every scrape raised OverflowError
    from the socket, a traceback per tick (and `--once` died with one); `nan` failed every scrape."""
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9/metrics", "--once", "--print", "--node", "n1", "--timeout", timeout])
    assert exc.value.code == 2
    assert "--timeout must be a positive number of seconds" in capsys.readouterr().err
