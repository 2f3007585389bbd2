"""Golden accounting scenarios, replayed together through the full pipeline (Tansu + Faust
worker + sink + chDB) once, with exact bill numbers worked out by hand.

Prices (tests/golden/ledger.toml): A100 2.40/h fixed, T4 0.60/h fixed; every GPU draws a
constant 360 W (A100) or 60 W (T4); electricity 0.10/kWh x PUE 1.5. Ticks are 60 s:
  A100 tick = 2.40/60 = 0.04 = 40,000 micros + 360 W x 60 s = 0.006 kWh x 0.15 = 900 micros = 40,900
  T4 tick   = 0.60/60 = 0.01 = 10,000 micros +  60 W x 60 s = 0.001 kWh x 0.15 = 150 micros = 10,150
  a down tick has no power reading (the GPU is off the bus): 40,000 (A100), energy 0.
docs/accounting.md walks through every number asserted here."""

from __future__ import annotations

from datetime import date, datetime, timezone
from pathlib import Path

import pytest

from gpuledger.schemas.lines import Emission
from gpuledger.warehouse.library import rebill, rebill_bill
from gpuledger.config import Settings
from gpuledger.embedded.pipeline import run_embedded
from gpuledger.warehouse.reports import fetch
from gpuledger.schemas.models import (
    GpuAssignment,
    GpuSample,
    JobEvent,
    LifecycleWatermark,
    MigDevice,
    NodeTick,
    ProcessSample,
)
from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import connect

pytestmark = pytest.mark.integration

GOLDEN_LEDGER = Path(__file__).resolve().parents[1] / "golden" / "ledger.toml"
MIN = 60_000
GIB = 1 << 30
A100_TICK, T4_TICK, A100_DOWN_TICK = 40_900, 10_150, 40_000


def at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


D = at("2026-11-10T00:00")          # scenarios 1-6
D7 = at("2026-11-15T23:00")         # scenario 7 crosses midnight into 16 Nov (coefficient change)
POWER = {"A100-80GB": 360.0, "T4": 60.0}


class Builder:
    def __init__(self):
        self.out: list[Emission] = []

    def event(self, ts, kind, job, tenant, queue, attempt=0, gpus=(), requested=1.0):
        self.out.append(Emission("job-events", job, JobEvent(
            event_id=f"{job}/{attempt}/{kind}/{ts}", ts_ms=ts, kind=kind, cluster="golden", job_id=job,
            attempt=attempt, tenant=tenant, queue=queue, requested_gpus=requested,
            gpus=[GpuAssignment(node=n, gpu_uuid=g, share_milli=s, container_id=c) for n, g, s, c in gpus])))

    def slurm_event(self, ts, kind, job, tenant, queue, gpu_indexes=(), node="", requested=1.0):
        """A lifecycle event as the Slurm agent sends it: GPUs named by device index (Slurm's
        IDX), the job's processes known by their cgroup as container 'slurm-job-<id>'."""
        self.out.append(Emission("job-events", job, JobEvent(
            event_id=f"slurm:golden:{job}:0:{kind}", ts_ms=ts, kind=kind, cluster="golden", job_id=job,
            tenant=tenant, queue=queue, requested_gpus=requested, aliases={"slurm_job_id": job},
            gpus=[GpuAssignment(node=node, gpu_index=i, container_id=f"slurm-job-{job}") for i in gpu_indexes])))

    def ticks(self, node, gpus, start, minutes, sample=None):
        """One tick a minute for `minutes` minutes; sample(uuid, model, ts) may override a GPU's sample."""
        for k in range(minutes):
            ts = start + k * MIN
            samples = []
            for index, (uuid, model) in enumerate(gpus):
                custom = sample(uuid, model, ts) if sample else None
                samples.append(custom or steady(uuid, index, model, ts))
            self.out.append(Emission("gpu-samples", node, NodeTick(cluster="golden", node=node, ts_ms=ts,
                                                                  interval_ms=MIN, gpus=samples)))

    def emissions(self) -> list[Emission]:
        """Everything in event-time order, with a lifecycle watermark at every minute boundary."""
        times = sorted({e.message.ts_ms for e in self.out if e.line == "gpu-samples"})
        marks = [Emission("job-events", None, LifecycleWatermark(cluster="golden", ts_ms=t)) for t in times]
        marks.append(Emission("job-events", None, LifecycleWatermark(cluster="golden", ts_ms=times[-1] + 2 * MIN)))
        order = {"job-events": 0, "gpu-samples": 1}
        return sorted(self.out + marks, key=lambda e: (e.message.ts_ms, order[e.line], e.key is None))


def steady(uuid, index, model, ts, util=80.0, processes=()):
    power = POWER[model]
    return GpuSample(gpu_uuid=uuid, index=index, model=model, util_gpu_pct=util, power_w=power,
                     energy_j=power * (ts - D + 3_600_000) / 1000,  # a counter that grows with power x time
                     mem_total_bytes=80 * GIB, processes=list(processes))


def down(uuid, index, model):
    return GpuSample(gpu_uuid=uuid, index=index, model=model, health="down", down_reason="xid 79")


def build() -> list[Emission]:
    b = Builder()
    m = lambda minutes: D + minutes * MIN  # noqa: E731

    # 1. plain job: queued 0, allocated 10, started 15, completed 75 (ticks 0..90)
    g1 = [("n-plain", "g-plain", 1000, None)]
    b.event(m(0), "submitted", "plain", "t-plain", "research")
    b.event(m(10), "allocated", "plain", "t-plain", "research", gpus=g1)
    b.event(m(15), "started", "plain", "t-plain", "research")
    b.event(m(75), "completed", "plain", "t-plain", "research")
    b.ticks("n-plain", [("g-plain", "A100-80GB")], m(0), 90)

    # 2. failed and retried: attempt 0 runs 0..30 and fails; attempt 1 queued 30, runs 40..100
    g2 = [("n-retry", "g-retry", 1000, None)]
    b.event(m(0), "submitted", "retry", "t-retry", "research")
    b.event(m(0), "allocated", "retry", "t-retry", "research", gpus=g2)
    b.event(m(0), "started", "retry", "t-retry", "research")
    b.event(m(30), "failed", "retry", "t-retry", "research")
    b.event(m(30), "retried", "retry", "t-retry", "research", attempt=1)
    b.event(m(40), "allocated", "retry", "t-retry", "research", attempt=1, gpus=g2)
    b.event(m(40), "started", "retry", "t-retry", "research", attempt=1)
    b.event(m(100), "completed", "retry", "t-retry", "research", attempt=1)
    b.ticks("n-retry", [("g-retry", "A100-80GB")], m(0), 100)

    # 3. preempted: victim (batch) runs 0..20, preempted by vip (prod) 20..50; victim retried at
    #    20, waits, runs again 50..90
    g3 = [("n-preempt", "g-preempt", 1000, None)]
    b.event(m(0), "submitted", "victim", "t-victim", "batch")
    b.event(m(0), "allocated", "victim", "t-victim", "batch", gpus=g3)
    b.event(m(0), "started", "victim", "t-victim", "batch")
    b.event(m(20), "submitted", "vip", "t-vip", "prod")
    b.event(m(20), "preempted", "victim", "t-victim", "batch")
    b.event(m(20), "retried", "victim", "t-victim", "batch", attempt=1)
    b.event(m(20), "allocated", "vip", "t-vip", "prod", gpus=g3)
    b.event(m(20), "started", "vip", "t-vip", "prod")
    b.event(m(50), "completed", "vip", "t-vip", "prod")
    b.event(m(50), "allocated", "victim", "t-victim", "batch", attempt=1, gpus=g3)
    b.event(m(50), "started", "victim", "t-victim", "batch", attempt=1)
    b.event(m(90), "completed", "victim", "t-victim", "batch", attempt=1)
    b.ticks("n-preempt", [("g-preempt", "A100-80GB")], m(0), 90)

    # 4. one GPU shared for 24 h (the seed's case): inference busy by day (08-20), training at
    #    night, a preprocessing container all day. Shares 400/400/200; measured (SM %, memory GiB):
    #    day:   infer 60 %, 32 GiB; train 0, 0; prep 10 %, 8 GiB
    #    night: infer  5 %, 32 GiB; train 80 %, 40 GiB; prep 10 %, 8 GiB
    g4 = [("n-shared", "g-shared", 400, "c-infer"), ("n-shared", "g-shared", 400, "c-train"),
          ("n-shared", "g-shared", 200, "c-prep")]
    for job, gpu in zip(("infer", "train", "prep"), g4):
        b.event(m(0), "allocated", job, f"t-{job}", "prod", gpus=[gpu], requested=gpu[2] / 1000)
        b.event(m(0), "started", job, f"t-{job}", "prod")
        b.event(m(1440), "completed", job, f"t-{job}", "prod")

    def shared(uuid, model, ts):
        day = 8 <= (ts - D) // 3_600_000 < 20
        use = {"c-infer": (60.0, 32) if day else (5.0, 32), "c-train": (0.0, 0) if day else (80.0, 40),
               "c-prep": (10.0, 8)}
        procs = [ProcessSample(pid=i + 1, container_id=c, sm_util_pct=sm, mem_used_bytes=gib * GIB)
                 for i, (c, (sm, gib)) in enumerate(use.items())]
        return steady(uuid, 0, model, ts, util=70.0, processes=procs)

    b.ticks("n-shared", [("g-shared", "A100-80GB")], m(0), 1440, shared)

    # 5. a GPU goes down mid-job: 2-GPU job runs 0..30; g-down-1 falls off the bus at 30 (down
    #    until 60), the attempt fails; attempt 1 runs on g-down-0 alone 40..60
    g5 = [("n-down", "g-down-0", 1000, None), ("n-down", "g-down-1", 1000, None)]
    b.event(m(0), "allocated", "downed", "t-down", "research", gpus=g5, requested=2)
    b.event(m(0), "started", "downed", "t-down", "research")
    b.event(m(30), "failed", "downed", "t-down", "research")
    b.event(m(30), "retried", "downed", "t-down", "research", attempt=1, requested=1)
    b.event(m(40), "allocated", "downed", "t-down", "research", attempt=1, gpus=g5[:1], requested=1)
    b.event(m(40), "started", "downed", "t-down", "research", attempt=1)
    b.event(m(60), "completed", "downed", "t-down", "research", attempt=1)
    b.ticks("n-down", [("g-down-0", "A100-80GB"), ("g-down-1", "A100-80GB")], m(0), 60,
            lambda uuid, model, ts: down(uuid, 1, model) if uuid == "g-down-1" and ts >= m(30) else None)

    # 6. two GPU models, one job: an A100 (coefficient 2.0) and a T4 (0.5) for one hour
    g6 = [("n-mixed", "g-mixed-a", 1000, None), ("n-mixed", "g-mixed-t", 1000, None)]
    b.event(m(0), "allocated", "mixed", "t-mixed", "research", gpus=g6, requested=2)
    b.event(m(0), "started", "mixed", "t-mixed", "research")
    b.event(m(60), "completed", "mixed", "t-mixed", "research")
    b.ticks("n-mixed", [("g-mixed-a", "A100-80GB"), ("g-mixed-t", "T4")], m(0), 60)

    # 7. coefficient change mid-month: an A100 job 15 Nov 23:00 -> 16 Nov 01:00 (A100 = 3.0 from 16 Nov)
    g7 = [("n-coef", "g-coef", 1000, None)]
    b.event(D7, "allocated", "coef", "t-coef", "research", gpus=g7)
    b.event(D7, "started", "coef", "t-coef", "research")
    b.event(D7 + 120 * MIN, "completed", "coef", "t-coef", "research")
    b.ticks("n-coef", [("g-coef", "A100-80GB")], D7, 120)

    # 8. Slurm, a data-loading stall: job 4101 RUNNING from 0 (allocated + started at once, GPU by
    #    index) to 60; its GPU works at 80 % except minutes 20-35 (0 %, the process still there).
    #    Quiet from 20: the first 5 minutes (min_idle_s) stay executing, 25..34 are idle.
    def slurm_sample(job, busy):
        def sample(uuid, model, ts):
            util = 80.0 if busy(uuid, (ts - D) // MIN) else 0.0
            proc = ProcessSample(pid=7, container_id=f"slurm-job-{job}", sm_util_pct=util, mem_used_bytes=20 * GIB)
            return steady(uuid, int(uuid[-1]), model, ts, util=util, processes=[proc])
        return sample

    b.slurm_event(m(0), "submitted", "4101", "t-slurm-stall", "gpu")
    for kind in ("allocated", "started"):
        b.slurm_event(m(0), kind, "4101", "t-slurm-stall", "gpu", gpu_indexes=[0], node="n-slurm-stall")
    b.slurm_event(m(60), "completed", "4101", "t-slurm-stall", "gpu")
    b.ticks("n-slurm-stall", [("g-slurm-stall-0", "A100-80GB")], m(0), 60,
            slurm_sample("4101", lambda uuid, minute: not 20 <= minute < 35))

    # 9. Slurm, a hung job: job 4102 on 2 GPUs works for 10 minutes, then hangs (processes hold
    #    memory, 0 % on both GPUs) until it is cancelled at 40; node n-slurm-hung reports on to 45.
    b.slurm_event(m(0), "submitted", "4102", "t-slurm-hung", "gpu", requested=2)
    for kind in ("allocated", "started"):
        b.slurm_event(m(0), kind, "4102", "t-slurm-hung", "gpu", gpu_indexes=[0, 1], node="n-slurm-hung", requested=2)
    b.slurm_event(m(40), "cancelled", "4102", "t-slurm-hung", "gpu")
    #    Its node has a third GPU that 4102 was never given but ran on for its first 10 minutes:
    #    busy and unallocated (the platform's, and listed by `report unmatched`).
    b.ticks("n-slurm-hung", [("g-slurm-hung-0", "A100-80GB"), ("g-slurm-hung-1", "A100-80GB"),
                             ("g-slurm-hung-2", "A100-80GB")], m(0), 45,
            slurm_sample("4102", lambda uuid, minute: minute < 10))

    # 10. nothing unmatched in silence: 4103 is allocated on a node that never reports; 4104 names
    #     GPU index 3 of n-slurm-stall, which reports only index 0; a MIG instance (3g.40gb = 3/7 of
    #     an A100) held by "mig-job" for 30 minutes is billed as 428/1000 of its parent GPU.
    for job, node, index in (("4103", "n-ghost", 0), ("4104", "n-slurm-stall", 3)):
        for kind in ("allocated", "started"):
            b.slurm_event(m(0), kind, job, "t-unmatched", "gpu", gpu_indexes=[index], node=node)
        b.slurm_event(m(30), "completed", job, "t-unmatched", "gpu")
    mig = [("n-mig", "MIG-4f7c", 1000, "c-mig")]
    b.event(m(0), "allocated", "mig-job", "t-mig", "research", gpus=mig, requested=0.428)
    b.event(m(0), "started", "mig-job", "t-mig", "research")
    b.event(m(30), "completed", "mig-job", "t-mig", "research")
    b.ticks("n-mig", [("g-mig", "A100-80GB")], m(0), 30, lambda uuid, model, ts: steady(uuid, 0, model, ts).model_copy(
        update={"mig_devices": [MigDevice(uuid="MIG-4f7c", profile="3g.40gb", share_milli=428)]}))
    return b.emissions()


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    data = tmp_path_factory.mktemp("golden")
    settings = Settings(data_dir=data, ledger_config=GOLDEN_LEDGER, worker_rebalance_timeout_s=4.0,
                        partitions_gpu_samples=2, partitions_job_events=2, partitions_usage=2)
    run_embedded(settings, build())
    client = connect(settings)
    yield client, settings
    client.close()


def bills(warehouse) -> dict:
    client, settings = warehouse
    return {(str(r["day"]), r["tenant"]): r for r in fetch(client, settings.database, "bills")}


def jobs(warehouse) -> dict:
    client, settings = warehouse
    ref = load_ledger_config(GOLDEN_LEDGER).reference_cost_per_gpu_hour()
    return {r["job_id"]: r for r in fetch(client, settings.database, "jobs", reference_cost_per_gpu_hour=ref)}


DAY = "2026-11-10"


def lines(bill) -> tuple[int, int, int]:
    return bill["compute_cost_micros"], bill["idle_cost_micros"], bill["failed_retry_cost_micros"]


def test_1_plain_job(warehouse):
    b = bills(warehouse)[(DAY, "t-plain")]
    assert lines(b) == (60 * A100_TICK, 5 * A100_TICK, 0)           # 2,454,000 / 204,500 / 0
    assert b["compute_effective_gpu_hours"] == pytest.approx(2.0)   # 1 h x 2.0
    j = jobs(warehouse)["plain"]
    assert j["queue_wait_seconds"] == 600 and j["opportunity_cost"] == pytest.approx(10 / 60 * 2.40)
    client, settings = warehouse
    (layers,) = [r for r in fetch(client, settings.database, "utilization", by="job_id") if r["job_id"] == "plain"]
    assert layers["execution_utilization"] == pytest.approx(60 / 65)
    assert layers["hardware_utilization"] == pytest.approx(0.80)


def test_2_failed_and_retried(warehouse):
    b = bills(warehouse)[(DAY, "t-retry")]
    assert lines(b) == (60 * A100_TICK, 0, 30 * A100_TICK)          # 2,454,000 / 0 / 1,227,000
    j = jobs(warehouse)["retry"]
    assert (j["attempts"], j["failed_attempts"], j["queue_wait_seconds"]) == (2, 1, 600)


def test_3_preempted_job(warehouse):
    b = bills(warehouse)
    assert lines(b[(DAY, "t-victim")]) == ((20 + 40) * A100_TICK, 0, 0)  # preemption is not the tenant's failure
    assert lines(b[(DAY, "t-vip")]) == (30 * A100_TICK, 0, 0)
    assert jobs(warehouse)["victim"]["queue_wait_seconds"] == 30 * 60


def test_4_shared_gpu_split_by_measured_use(warehouse):
    b = bills(warehouse)
    # per day tick: infer 0.50 exec + 0.16 idle, train 0 + 0.16, prep 0.10 + 0.08 (all exact);
    # per night tick: infer 0.225 exec (9,202.5 -> 9,203 by largest remainder) + 0.01 idle,
    # train 0.65 + 0.01, prep 0.10 + 0.005 (204.5 -> 204)
    assert lines(b[(DAY, "t-infer")]) == (720 * 20_450 + 720 * 9_203, 720 * 6_544 + 720 * 409, 0)
    assert lines(b[(DAY, "t-train")]) == (720 * 26_585, 720 * 6_544 + 720 * 409, 0)
    assert lines(b[(DAY, "t-prep")]) == (720 * 4_090 * 2, 720 * 3_272 + 720 * 204, 0)
    total = sum(sum(lines(b[(DAY, f"t-{j}")])) for j in ("infer", "train", "prep"))
    assert total == 1440 * A100_TICK                                # the parts add up to the GPU's cost
    assert b[(DAY, "t-infer")]["compute_gpu_hours"] == pytest.approx(12 * 0.5 + 12 * 0.225)


def test_5_gpu_down_mid_job(warehouse):
    b = bills(warehouse)[(DAY, "t-down")]
    assert lines(b) == (20 * A100_TICK, 0, 2 * 30 * A100_TICK)      # retry compute / - / failed attempt on 2 GPUs
    client, settings = warehouse
    cap = fetch(client, settings.database, "capacity", day_from=DAY, day_to=DAY, gpu_model="A100-80GB")
    assert sum(r["down_gpu_seconds"] for r in cap) == 30 * 60       # the platform's, never the tenant's


def test_6_two_models_with_different_coefficients(warehouse):
    b = bills(warehouse)[(DAY, "t-mixed")]
    assert lines(b) == (60 * A100_TICK + 60 * T4_TICK, 0, 0)         # 3,063,000
    assert b["compute_gpu_hours"] == pytest.approx(2.0)
    assert b["compute_effective_gpu_hours"] == pytest.approx(1 * 2.0 + 1 * 0.5)


def test_7_coefficient_change_mid_month_and_rebill(warehouse):
    b = bills(warehouse)
    first, second = b[("2026-11-15", "t-coef")], b[("2026-11-16", "t-coef")]
    assert first["compute_effective_gpu_hours"] == pytest.approx(1 * 2.0)   # before the change
    assert second["compute_effective_gpu_hours"] == pytest.approx(1 * 3.0)  # after it
    assert first["compute_cost_micros"] == second["compute_cost_micros"] == 60 * A100_TICK

    client, settings = warehouse
    ledger = load_ledger_config(GOLDEN_LEDGER)
    rid = rebill(client, settings.database, ledger, date(2026, 11, 1), date(2026, 11, 30), date(2026, 11, 16))
    again = {(str(r["day"]), r["tenant"]): r for r in rebill_bill(client, settings.database, rid)}
    assert again[("2026-11-15", "t-coef")]["rebilled_effective_gpu_hours"] == pytest.approx(3.0)
    assert again[("2026-11-15", "t-coef")]["original_effective_gpu_hours"] == pytest.approx(2.0)
    assert again[(DAY, "t-plain")]["rebilled_compute_effective_gpu_hours"] == pytest.approx(3.0)
    assert bills(warehouse)[("2026-11-15", "t-coef")] == first        # the original bill is untouched


def test_8_slurm_data_loading_stall_is_idle_after_the_grace(warehouse):
    b = bills(warehouse)[(DAY, "t-slurm-stall")]
    # 60 minutes held: 50 executing (45 busy + the stall's first 5), 10 idle (minutes 25..34)
    assert lines(b) == (50 * A100_TICK, 10 * A100_TICK, 0)          # 2,045,000 / 409,000 / 0
    j = jobs(warehouse)["4101"]
    assert j["last_outcome"] == "completed" and j["queue_wait_seconds"] == 0


def test_9_slurm_hung_job_bills_its_hang_as_idle(warehouse):
    b = bills(warehouse)[(DAY, "t-slurm-hung")]
    # per GPU: 10 busy + 5 of grace executing, 25 idle (15..39); two GPUs; cancelled is no failure
    assert lines(b) == (2 * 15 * A100_TICK, 2 * 25 * A100_TICK, 0)  # 1,227,000 / 2,045,000 / 0
    client, settings = warehouse
    held = client.query("SELECT gpu_uuid, sum(gpu_ms) FROM usage_raw WHERE job_id = '4102' GROUP BY gpu_uuid "
                        "ORDER BY gpu_uuid").result_rows
    assert held == [("g-slurm-hung-0", 40 * MIN), ("g-slurm-hung-1", 40 * MIN)]  # indexes resolved to UUIDs
    assert jobs(warehouse)["4102"]["last_outcome"] == "cancelled"


def test_10_nothing_unmatched_in_silence(warehouse, monkeypatch):
    client, settings = warehouse
    rows = fetch(client, settings.database, "unmatched", day_from=DAY, day_to=DAY)
    found = {(r["kind"], r["node"], r["job_id"] or r["detail"]) for r in rows}
    assert found == {
        ("unknown_node", "n-ghost", "4103"),
        ("allocation_gpu_not_billed", "n-slurm-stall", "4104"),
        ("mig_allocation", "n-mig", "mig-job"),
        ("busy_unallocated", "n-slurm-hung", "g-slurm-hung-2"),
        # scenarios 1, 2 and 5 sample their GPUs at a steady 80 % also outside their jobs: real
        # findings in this data (a GPU at work that no allocation explains)
        ("busy_unallocated", "n-plain", "g-plain"),
        ("busy_unallocated", "n-retry", "g-retry"),
        ("busy_unallocated", "n-down", "g-down-0"),
    }
    busy = next(r for r in rows if r["kind"] == "busy_unallocated")
    assert busy["gpu_hours"] == pytest.approx(10 / 60)               # its 10 busy minutes
    # the default floor reads the per-day aggregate (sql/0025); scanning the records gives the same rows
    import gpuledger.warehouse.reports as report_module
    aggregated = fetch(client, settings.database, "unmatched")
    monkeypatch.setattr(report_module, "DEFAULT_BUSY_FLOOR_PCT", -1.0)
    assert fetch(client, settings.database, "unmatched", day_from=DAY, day_to=DAY, busy_floor_pct=1.0) == rows
    assert fetch(client, settings.database, "unmatched", busy_floor_pct=1.0) == aggregated
    assert next(r for r in rows if r["kind"] == "mig_allocation")["gpus_billed"] == 1
    b = bills(warehouse)[(DAY, "t-mig")]
    assert b["compute_gpu_hours"] == pytest.approx(0.5 * 0.428)      # 3/7 of the parent for 30 minutes
    assert (DAY, "t-unmatched") not in bills(warehouse)               # nothing billed to a GPU no one reports


def test_conservation_on_every_row(warehouse, assert_conserved):
    client, settings = warehouse
    assert_conserved(fetch(client, settings.database, "capacity"), abs_tol=1e-9)


def test_idle_redistribution_policy_conserves_cluster_idle(warehouse):
    client, settings = warehouse
    idle = sum(r["unallocated_cost"] * 1_000_000 for r in fetch(client, settings.database, "capacity", day_from=DAY,
                                                                    day_to=DAY))
    for policy in ("even", "usage"):
        rows = fetch(client, settings.database, "bills", day_from=DAY, day_to=DAY, idle_redistribution=policy)
        assert sum(r["cluster_idle_cost_micros"] for r in rows) == pytest.approx(idle, abs=1)


def test_closing_keeps_the_hand_worked_bills(warehouse):
    """Closing (docs/accounting.md §6a) writes the same hand-worked figures as the live bills, labels
    them closed, and a second close books nothing. Runs last: it adds closed rows to the warehouse."""
    from gpuledger.warehouse import bills as closing

    client, settings = warehouse
    live = {(str(r["day"]), r["tenant"]): lines(r) for r in fetch(client, settings.database, "bills")}
    result = closing.close_due(client, settings, load_ledger_config(GOLDEN_LEDGER))
    # the last usage ends 16 Nov 01:00; with 6 h of grace 10..14 Nov close, 15 and 16 Nov stay open
    assert {d.isoformat() for days in result.closed.values() for d in days} >= {DAY}
    assert all(d.isoformat() < "2026-11-15" for days in result.closed.values() for d in days)
    rows = fetch(client, settings.database, "bills")
    assert {(str(r["day"]), r["tenant"]): lines(r) for r in rows} == live
    assert {r["status"] for r in rows if str(r["day"]) == DAY} == {"closed"}
    assert {r["status"] for r in rows if str(r["day"]) >= "2026-11-15"} == {"open"}
    assert lines(bills(warehouse)[(DAY, "t-plain")]) == (60 * A100_TICK, 5 * A100_TICK, 0)
    assert closing.close_due(client, settings, load_ledger_config(GOLDEN_LEDGER)).bill_run_id is None
