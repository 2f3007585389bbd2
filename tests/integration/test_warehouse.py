"""The warehouse on the real embedded engine (chDB): migrations, and one hand-worked accounting day.

The scenario (cluster c1, day 2024-03-01 UTC, minutes counted from B = 01:00 UTC):

GPU A (A100, coefficient 2.0, cost 1 micro per GPU-ms = 3.6 per GPU-hour)
  0-10  executing       job-1 attempt 0 (alpha/train)  util 80   -> attempt 0 fails at 10
  10-15 unallocated
  15-20 allocated_idle  job-1 attempt 1                util 0 (not executing: not hardware util)
  20-30 executing       job-1 attempt 1                util 50
  30-50 executing       job-1 attempt 1                util 80   -> completes at 50
  50-60 down
GPU B (T4, coefficient 0.5, cost 0.25 micro per GPU-ms = 0.9 per GPU-hour)
  0-20  unallocated
  20-30 allocated_idle  job-2 attempt 0 (beta/infer)
  30-40 executing       job-2 attempt 0                util 40
  40-60 executing       job-2 attempt 0                util unknown -> still running
job-3 (beta/infer, 2 GPUs) is submitted at 40 and queued at 45; it never gets GPUs.
Energy: A100 300 W executing, 60 W otherwise, 0 when down; T4 70 W executing, 10 W otherwise.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from importlib import resources

import pytest

from gpuledger import warehouse
from gpuledger.warehouse import reports
from gpuledger.config import Settings
from gpuledger.schemas.models import GpuAssignment, JobEvent, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, job_event_row, usage_rows

pytestmark = pytest.mark.integration

DB = "ledger_test"
DAY = dt.date(2024, 3, 1)
B = 1709251200000 + 3_600_000  # 2024-03-01T01:00:00Z
MIN = 60_000

GPUS = {
    # gpu -> (model, coefficient, cost micros per GPU-ms, watts executing, watts otherwise)
    "gpu-A": ("A100", 2.0, 1.0, 300, 60),
    "gpu-B": ("T4", 0.5, 0.25, 70, 10),
}
JOBS = {"job-1": ("alpha", "train"), "job-2": ("beta", "infer"), "job-3": ("beta", "infer")}


def slice_(gpu, start_min, end_min, state, job="", attempt=0, util=None) -> UsageRecord:
    """One input slice; the derived fields follow the worker's rules (gpu_ms × coefficient, × rate)."""
    model, coef, rate, w_exec, w_other = GPUS[gpu]
    gpu_ms = (end_min - start_min) * MIN
    watts = 0 if state == "down" else (w_exec if state == "executing" else w_other)
    tenant, queue = JOBS[job] if job else ("", "")
    return UsageRecord(
        record_id=f"{gpu}/{B + start_min * MIN}/0",
        cluster="c1", node="n1", gpu_uuid=gpu, gpu_model=model,
        start_ms=B + start_min * MIN, end_ms=B + end_min * MIN, state=state,
        job_id=job, attempt=attempt, tenant=tenant, queue=queue,
        share_milli=1000, gpu_ms=gpu_ms, util_pct=util, util_metric_pct=util,
        energy_j=watts * gpu_ms / 1000, coefficient=coef, coefficient_version=f"{model}-2024Q1",
        effective_gpu_ms=round(gpu_ms * coef), cost_micros=round(gpu_ms * rate), definition_version="def-v1",
    )


USAGE = [
    slice_("gpu-A", 0, 10, "executing", "job-1", 0, 80.0),
    slice_("gpu-A", 10, 15, "unallocated"),
    slice_("gpu-A", 15, 20, "allocated_idle", "job-1", 1, 0.0),
    slice_("gpu-A", 20, 30, "executing", "job-1", 1, 50.0),
    slice_("gpu-A", 30, 50, "executing", "job-1", 1, 80.0),
    slice_("gpu-A", 50, 60, "down"),
    slice_("gpu-B", 0, 20, "unallocated"),
    slice_("gpu-B", 20, 30, "allocated_idle", "job-2", 0),
    slice_("gpu-B", 30, 40, "executing", "job-2", 0, 40.0),
    slice_("gpu-B", 40, 60, "executing", "job-2", 0, None),
]


def event(n, minute, kind, job, attempt=0, gpu=None, requested=1.0) -> JobEvent:
    tenant, queue = JOBS[job]
    return JobEvent(
        event_id=f"e{n}", ts_ms=B + minute * MIN, kind=kind, cluster="c1", job_id=job, attempt=attempt,
        tenant=tenant, queue=queue, priority=5 if job == "job-1" else 1, requested_gpus=requested,
        gpus=[GpuAssignment(node="n1", gpu_uuid=gpu)] if gpu else [],
    )


EVENTS = [
    event(1, -10, "submitted", "job-1"),
    event(2, -9, "queued", "job-1"),
    event(3, 0, "allocated", "job-1", 0, "gpu-A"),
    event(4, 0, "started", "job-1", 0, "gpu-A"),
    event(5, 10, "failed", "job-1", 0, "gpu-A"),
    event(6, 10, "retried", "job-1", 1),
    event(7, 15, "allocated", "job-1", 1, "gpu-A"),
    event(8, 20, "started", "job-1", 1, "gpu-A"),
    event(9, 50, "completed", "job-1", 1, "gpu-A"),
    event(10, 5, "submitted", "job-2"),
    event(11, 20, "allocated", "job-2", 0, "gpu-B"),
    event(12, 30, "started", "job-2", 0, "gpu-B"),
    event(13, 40, "submitted", "job-3", requested=2.0),
    event(14, 45, "queued", "job-3", requested=2.0),
]


@pytest.fixture
def client(tmp_path):
    c = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", database=DB))
    try:
        yield c
    finally:
        c.close()  # one chDB directory per process: release it for the next test


def load(client, usage=USAGE, events=EVENTS, offset0=0):
    src = Source("t.usage", 0, offset0)
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=usage), src), database=DB)
    rows = [job_event_row(e, Source("t.job-events", 0, offset0 + i)) for i, e in enumerate(events)]
    warehouse.insert_rows(client, "job_events", rows, database=DB)


def one(rows, **match):
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, rows)
    return found[0]


# --------------------------------------------------------------------------- migrations
def test_migrate_is_idempotent_and_records_versions(client):
    files = sorted(f.name for f in resources.files("gpuledger.sql").iterdir() if f.name.endswith(".sql"))
    versions = [name[:4] for name in files]
    assert versions == sorted(versions) and versions[0] == "0001"

    assert warehouse.migrate(client, DB) == versions
    assert warehouse.migrate(client, DB) == []

    recorded = warehouse.applied_migrations(client, DB)
    assert list(recorded) == versions
    for name in files:
        text = resources.files("gpuledger.sql").joinpath(name).read_text(encoding="utf-8")
        assert recorded[name[:4]]["checksum"] == warehouse.sql_checksum(text)  # comment lines left out
        assert recorded[name[:4]]["name"] == name[5:-4]


def test_migrate_refuses_a_changed_applied_file(client):
    warehouse.migrate(client, DB)
    client.command(f"TRUNCATE TABLE {DB}.schema_migrations")
    warehouse.insert_rows(client, "schema_migrations", [{"version": "0001", "name": "usage", "checksum": "0" * 64}], database=DB)
    with pytest.raises(warehouse.WarehouseError, match="0001_usage.*must not change"):
        warehouse.migrate(client, DB)


def test_migrate_re_records_a_checksum_of_the_earlier_whole_file_rule(client):
    warehouse.migrate(client, DB)
    client.command(f"TRUNCATE TABLE {DB}.schema_migrations")
    before = warehouse.WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS  # 0008, as it was before its comments were corrected
    rows = [{"version": mg.version, "name": mg.name,
             "checksum": before.get(mg.version, hashlib.sha256(mg.sql.encode()).hexdigest())}
            for mg in warehouse.load_migrations()]
    warehouse.insert_rows(client, "schema_migrations", rows, database=DB)
    assert warehouse.migrate(client, DB) == []
    assert {v: r["checksum"] for v, r in warehouse.applied_migrations(client, DB).items()} == {
        mg.version: mg.checksum for mg in warehouse.load_migrations()}


def test_ddl_holds_every_wire_field(client):
    warehouse.migrate(client, DB)

    def columns(table):
        return {r[0] for r in client.query(f"DESCRIBE TABLE {DB}.{table}").result_rows}

    assert set(UsageRecord.model_fields) <= columns("usage_raw")
    assert {"day", "kafka_topic", "kafka_partition", "kafka_offset"} <= columns("usage_raw")
    scalar_event_fields = set(JobEvent.model_fields) - {"type", "gpus"}
    assert scalar_event_fields <= columns("job_events")
    # the sink's rows fit the tables exactly (nothing unknown, nothing required left out)
    row = usage_rows(UsageBatch(node="n1", records=USAGE[:1]), Source("t", 0, 0))[0]
    assert set(row) <= columns("usage_raw")
    assert set(job_event_row(EVENTS[0], Source("t", 0, 0))) <= columns("job_events")


# --------------------------------------------------------------------------- the accounting day
@pytest.fixture
def ledger(client):
    warehouse.migrate(client, DB)
    load(client)
    return client


def test_tenant_daily_bill(ledger):
    rows = reports.fetch(ledger, DB, "bills")
    assert [(r["day"], r["tenant"]) for r in rows] == [(DAY, "alpha"), (DAY, "beta")]
    alpha, beta = rows
    assert alpha["definition_version"] == "def-v1"
    # alpha compute = executing of job-1 attempt 1 (completed): A 20-30 + 30-50 = 30 min = 0.5 GPU-h;
    #   effective × 2.0 = 1.0; cost 1_800_000 ms × 1 micro = 1_800_000 micros = 1.8
    assert alpha["compute_gpu_hours"] == pytest.approx(0.5)
    assert alpha["compute_effective_gpu_hours"] == pytest.approx(1.0)
    assert alpha["compute_cost_micros"] == 1_800_000 and alpha["compute_cost"] == pytest.approx(1.8)
    # alpha idle = allocated_idle A 15-20 = 5 min = 1/12 GPU-h; effective 1/6; 300_000 micros = 0.3
    assert alpha["idle_gpu_hours"] == pytest.approx(1 / 12)
    assert alpha["idle_effective_gpu_hours"] == pytest.approx(1 / 6)
    assert alpha["idle_cost_micros"] == 300_000 and alpha["idle_cost"] == pytest.approx(0.3)
    # alpha failed_retry = executing of attempt 0 (failed): A 0-10 = 1/6 GPU-h; effective 1/3; 0.6
    assert alpha["failed_retry_gpu_hours"] == pytest.approx(1 / 6)
    assert alpha["failed_retry_effective_gpu_hours"] == pytest.approx(1 / 3)
    assert alpha["failed_retry_cost_micros"] == 600_000 and alpha["failed_retry_cost"] == pytest.approx(0.6)
    # total 45 min = 0.75 GPU-h, effective 1.5, 2.7
    assert alpha["total_gpu_hours"] == pytest.approx(0.75)
    assert alpha["total_effective_gpu_hours"] == pytest.approx(1.5)
    assert alpha["total_cost_micros"] == 2_700_000 and alpha["total_cost"] == pytest.approx(2.7)
    # beta compute = B 30-40 + 40-60 = 30 min = 0.5 GPU-h; effective × 0.5 = 0.25; 1_800_000 × 0.25 = 450_000 micros
    assert beta["compute_gpu_hours"] == pytest.approx(0.5)
    assert beta["compute_effective_gpu_hours"] == pytest.approx(0.25)
    assert beta["compute_cost_micros"] == 450_000 and beta["compute_cost"] == pytest.approx(0.45)
    # beta idle = B 20-30 = 1/6 GPU-h; effective 1/12; 600_000 × 0.25 = 150_000 micros
    assert beta["idle_gpu_hours"] == pytest.approx(1 / 6)
    assert beta["idle_effective_gpu_hours"] == pytest.approx(1 / 12)
    assert beta["idle_cost_micros"] == 150_000
    assert beta["failed_retry_gpu_hours"] == 0 and beta["failed_retry_cost_micros"] == 0
    assert beta["total_cost_micros"] == 600_000
    # unallocated (A 10-15, B 0-20) and down (A 50-60) are the platform's: in no tenant's bill
    assert sum(r["total_cost_micros"] for r in rows) == 2_700_000 + 600_000


def test_job_cost_and_opportunity_cost(ledger):
    rows = reports.fetch(ledger, DB, "jobs", reference_cost_per_gpu_hour=3.6)
    assert [r["job_id"] for r in rows] == ["job-1", "job-2", "job-3"]  # by cost, descending
    j1, j2, j3 = rows
    assert (j1["tenant"], j1["queue"], j1["attempts"], j1["failed_attempts"], j1["last_outcome"]) == ("alpha", "train", 2, 1, "completed")
    # job-1 holds A 0-10, 15-20, 20-30, 30-50 = 45 min = 0.75 GPU-h (40 min executing, 5 idle)
    assert j1["gpu_hours"] == pytest.approx(0.75)
    assert j1["executing_gpu_hours"] == pytest.approx(40 / 60)
    assert j1["idle_gpu_hours"] == pytest.approx(5 / 60)
    assert j1["effective_gpu_hours"] == pytest.approx(1.5)
    assert j1["cost_micros"] == 2_700_000 and j1["cost"] == pytest.approx(2.7)
    # energy 300 W × (600+600+1200) s + 60 W × 300 s = 738_000 J = 0.205 kWh
    assert j1["energy_kwh"] == pytest.approx(0.205)
    # waits: attempt 0 allocated 0 − queued −10 = 600 s; attempt 1 allocated 15 − retried 10 = 300 s
    assert j1["queue_wait_seconds"] == pytest.approx(900)
    # 900 s × 1 GPU = 0.25 GPU-h waiting × 3.6 reference = 0.9 opportunity cost
    assert j1["queue_wait_gpu_hours"] == pytest.approx(0.25)
    assert j1["opportunity_cost"] == pytest.approx(0.9)
    # job-2: B 20-60 = 40 min = 2/3 GPU-h, effective 1/3, 2_400_000 × 0.25 = 600_000 micros; running
    assert (j2["tenant"], j2["attempts"], j2["last_outcome"]) == ("beta", 1, "")
    assert j2["gpu_hours"] == pytest.approx(2 / 3)
    assert j2["effective_gpu_hours"] == pytest.approx(1 / 3)
    assert j2["cost_micros"] == 600_000
    # wait: allocated 20 − submitted 5 = 900 s × 1 GPU = 0.25 GPU-h × 3.6 = 0.9
    assert j2["queue_wait_seconds"] == pytest.approx(900)
    assert j2["opportunity_cost"] == pytest.approx(0.9)
    # job-3 never ran: no cost, no finished wait yet
    assert (j3["tenant"], j3["requested_gpus"], j3["gpu_hours"], j3["cost_micros"]) == ("beta", 2.0, 0, 0)
    assert j3["queue_wait_seconds"] == 0 and j3["first_day"] is None

    only = reports.fetch(ledger, DB, "jobs", tenant="alpha")
    assert [r["job_id"] for r in only] == ["job-1"] and only[0]["opportunity_cost"] is None
    # a period selects the jobs whose usage overlaps it
    assert [r["job_id"] for r in reports.fetch(ledger, DB, "jobs", day_from=DAY, day_to=DAY)] == ["job-1", "job-2"]
    assert reports.fetch(ledger, DB, "jobs", day_to=DAY - dt.timedelta(days=1)) == []


def test_queue_efficiency(ledger):
    rows = reports.fetch(ledger, DB, "queues")
    assert [(r["day"], r["queue"]) for r in rows] == [(DAY, "infer"), (DAY, "train")]
    infer, train = rows
    # train: attempt 0 requested 1 GPU from −10 to its end at 10 = 1200 GPU-s; attempt 1 from 10 to 50 = 2400
    assert train["attempts"] == 2
    assert train["requested_gpu_seconds"] == pytest.approx(3600)
    # allocated = A 0-10 + 15-20 + 20-50 = 2700 GPU-s; executed = 0-10 + 20-50 = 2400
    assert train["allocated_gpu_seconds"] == pytest.approx(2700)
    assert train["executed_gpu_seconds"] == pytest.approx(2400)
    assert train["allocated_to_requested"] == pytest.approx(0.75)
    assert train["executed_to_allocated"] == pytest.approx(8 / 9)
    assert train["executed_to_requested"] == pytest.approx(2 / 3)
    # waits [300, 600] s; inclusive percentiles: p50 = 450, p90 = 300 + 0.9 × 300 = 570, p99 = 597
    assert train["waits"] == 2
    assert (train["queue_wait_p50_s"], train["queue_wait_p90_s"], train["queue_wait_p99_s"]) == pytest.approx((450, 570, 597))
    assert (train["queue_wait_mean_s"], train["queue_wait_max_s"]) == pytest.approx((450, 600))
    # infer: job-2 running, last seen in usage at 60: 1 GPU × (60 − 5) = 3300 GPU-s;
    #        job-3 waiting, last seen (queued event) at 45: 2 GPUs × (45 − 40) = 600 GPU-s
    assert infer["attempts"] == 2
    assert infer["requested_gpu_seconds"] == pytest.approx(3900)
    assert infer["allocated_gpu_seconds"] == pytest.approx(2400)  # B 20-60
    assert infer["executed_gpu_seconds"] == pytest.approx(1800)  # B 30-60
    assert infer["allocated_to_requested"] == pytest.approx(2400 / 3900)
    assert infer["executed_to_allocated"] == pytest.approx(0.75)
    # only job-2 has been allocated: one wait of 900 s
    assert infer["waits"] == 1
    assert infer["queue_wait_p50_s"] == pytest.approx(900) and infer["queue_wait_max_s"] == pytest.approx(900)


def test_capacity_daily(ledger):
    rows = reports.fetch(ledger, DB, "capacity")
    assert [(r["day"], r["cluster"], r["gpu_model"]) for r in rows] == [(DAY, "c1", "A100"), (DAY, "c1", "T4")]
    a100, t4 = rows
    parts = ("down_gpu_seconds", "unallocated_gpu_seconds", "allocated_idle_gpu_seconds", "executing_gpu_seconds")
    # A: down 50-60, unallocated 10-15, allocated_idle 15-20, executing 0-10 + 20-50
    assert [a100[p] for p in parts] == pytest.approx([600, 300, 300, 2400])
    # B: unallocated 0-20, allocated_idle 20-30, executing 30-60
    assert [t4[p] for p in parts] == pytest.approx([0, 1200, 600, 1800])
    for r in rows:
        assert r["gpus"] == 1
        assert r["capacity_gpu_seconds"] == pytest.approx(3600)  # one GPU for one hour
        assert r["capacity_gpu_seconds"] == pytest.approx(sum(r[p] for p in parts))  # the identity
    assert a100["cost"] == pytest.approx(3.6) and t4["cost"] == pytest.approx(0.9)
    assert a100["unallocated_cost"] == pytest.approx(0.3) and t4["unallocated_cost"] == pytest.approx(0.3)
    # energy A: 300 W × 2400 s + 60 W × 600 s = 756_000 J = 0.21 kWh; B: 70 × 1800 + 10 × 1800 = 144_000 J = 0.04 kWh
    assert a100["energy_kwh"] == pytest.approx(0.21) and t4["energy_kwh"] == pytest.approx(0.04)


def test_utilization(ledger):
    (row,) = reports.fetch(ledger, DB, "utilization")
    assert (row["day"], row["cluster"]) == (DAY, "c1")
    # capacity 2 GPUs × 3600 s = 7200; down 600; allocated (300+2400) + (600+1800) = 5100; executing 4200
    assert row["capacity_gpu_seconds"] == pytest.approx(7200)
    assert row["down_gpu_seconds"] == pytest.approx(600)
    assert row["allocated_gpu_seconds"] == pytest.approx(5100)
    assert row["executing_gpu_seconds"] == pytest.approx(4200)
    assert row["scheduling_utilization"] == pytest.approx(5100 / 6600)
    assert row["execution_utilization"] == pytest.approx(4200 / 5100)
    # executing slices with util: 80×600 + 50×600 + 80×1200 + 40×600 = 198_000 over 3000 s = 66 %
    # (B 40-60 has no util and is left out; A 15-20's util 0 is idle, not executing)
    assert row["hardware_utilization"] == pytest.approx(0.66)
    assert row["scheduling_share_of_capacity"] == pytest.approx(5100 / 7200)
    assert row["execution_share_of_capacity"] == pytest.approx(4200 / 7200)
    assert row["hardware_share_of_capacity"] == pytest.approx(0.66 * 4200 / 7200)

    by_tenant = reports.fetch(ledger, DB, "utilization", by="tenant")
    assert [r["tenant"] for r in by_tenant] == ["alpha", "beta"]
    alpha, beta = by_tenant
    # alpha holds 2700 GPU-s of the 6600 schedulable, executes 2400; util (48000+30000+96000)/2400 = 72.5 %
    assert alpha["scheduling_utilization"] == pytest.approx(2700 / 6600)
    assert alpha["execution_utilization"] == pytest.approx(2400 / 2700)
    assert alpha["hardware_utilization"] == pytest.approx(0.725)
    # beta holds 2400, executes 1800, util measured 40 % over 600 s
    assert beta["scheduling_utilization"] == pytest.approx(2400 / 6600)
    assert beta["execution_utilization"] == pytest.approx(0.75)
    assert beta["hardware_utilization"] == pytest.approx(0.40)
    # tenants' scheduling shares add up to the cluster's
    assert alpha["scheduling_utilization"] + beta["scheduling_utilization"] == pytest.approx(row["scheduling_utilization"])

    by_model = {r["gpu_model"]: r for r in reports.fetch(ledger, DB, "utilization", by="gpu_model")}
    # A100: allocated 2700 of 3600 − 600 down = 0.9; T4: 2400 of 3600 = 2/3
    assert by_model["A100"]["scheduling_utilization"] == pytest.approx(0.9)
    assert by_model["T4"]["scheduling_utilization"] == pytest.approx(2 / 3)
    assert by_model["T4"]["down_gpu_seconds"] == 0

    assert reports.fetch(ledger, DB, "utilization", day_from="2024-03-02") == []
    with pytest.raises(ValueError, match="by"):
        reports.fetch(ledger, DB, "utilization", by="node")


def test_duplicate_and_reordered_events_do_not_change_attempts(ledger):
    def attempts():
        return ledger.query(f"SELECT * FROM {DB}.job_attempts ORDER BY job_id, attempt").result_rows

    before = attempts()
    a0 = one(list(ledger.query(f"SELECT * FROM {DB}.job_attempts").named_results()), job_id="job-1", attempt=0)
    assert (a0["queued_ms"], a0["allocated_ms"], a0["started_ms"], a0["ended_ms"]) == (B - 10 * MIN, B, B, B + 10 * MIN)
    assert (a0["outcome"], a0["events"], a0["queue_wait_ms"], a0["priority"]) == ("failed", 5, 10 * MIN, 5)
    j2 = one(list(ledger.query(f"SELECT * FROM {DB}.job_attempts").named_results()), job_id="job-2")
    assert (j2["outcome"], j2["ended_ms"], j2["allocated_gpus"]) == ("", None, 1.0)

    bill_before = reports.fetch(ledger, DB, "bills")
    # redelivery: every event again, newest first, from other offsets
    warehouse.insert_rows(
        ledger, "job_events",
        [job_event_row(e, Source("t.job-events", 1, 100 + i)) for i, e in enumerate(reversed(EVENTS))],
        database=DB,
    )
    assert attempts() == before
    assert reports.fetch(ledger, DB, "bills") == bill_before
    assert ledger.query(f"SELECT count() FROM {DB}.job_events").result_rows == [(2 * len(EVENTS),)]  # raw keeps both


def test_report_filters_are_parameters(ledger):
    # a hostile value is just a value that matches nothing
    assert reports.fetch(ledger, DB, "bills", tenant="alpha' OR 1=1 --") == []
    assert [r["tenant"] for r in reports.fetch(ledger, DB, "bills", tenant="beta", day_from=DAY, day_to=DAY)] == ["beta"]
    with pytest.raises(ValueError, match="takes no"):
        reports.fetch(ledger, DB, "capacity", tenant="alpha")
    with pytest.raises(ValueError, match="unknown report"):
        reports.fetch(ledger, DB, "nope")


def test_a_chdb_directory_held_by_another_process_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, clickhouse_connect; c = clickhouse_connect.get_client(interface='chdb', path=sys.argv[1]); "
         "print('ready', flush=True); sys.stdin.read(); c.close()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(warehouse.WarehouseError, match=rf"held by process {holder.pid}"):
            warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    client = warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))  # free again
    client.close()
