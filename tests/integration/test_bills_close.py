"""Closed periods on the real embedded engine (chDB): close a day, deliver a late `failed` event and
late samples for it, close again -> the closed rows are unchanged and adjustments appear in the next
open day; a second close books nothing; the same records inserted twice (not through the sink) count
once in the closed bill and show in the dedup audit; the bills topic on the real broker (Tansu).

The scenario (cluster c1, day D = 2024-03-01 UTC, grace 1 h):
  gpu-A (A100, coefficient 2.0, 1 micro per GPU-ms)
    01:00-01:10 executing       job-1 attempt 0 (alpha/train)   600,000 GPU-ms, eff 1,200,000, 600,000 micros
    01:10-01:15 allocated_idle  job-1 attempt 0                 300,000 GPU-ms, eff   600,000, 300,000 micros
  gpu-B (T4, coefficient 0.5, 0.25 micro per GPU-ms)
    01:00-01:30 executing       job-2 attempt 0 (beta/infer)  1,800,000 GPU-ms, eff   900,000, 450,000 micros
  gpu-A 2024-03-02 00:00-01:00 unallocated: the warehouse's horizon for c1 is D's end + 1 h, so D is
  due (grace 1 h) and 2024-03-02 is not.
Closed bill of D: alpha compute 600,000 micros, alpha idle 300,000, beta compute 450,000.

Late data for D, after the close:
  job-1 attempt 0 `failed` at 01:15 (a late lifecycle outcome), and
  gpu-C (A100) 01:00-01:10 executing job-1 attempt 0 (late samples: an agent's spool drained).
Adjustments booked on 2024-03-02 (the next open day), correcting D, worked by hand:
  alpha compute       -600,000 GPU-ms, -1,200,000 eff, -600,000 micros   late_lifecycle_outcome
  alpha failed_retry  +600,000 GPU-ms, +1,200,000 eff, +600,000 micros   late_lifecycle_outcome
  alpha failed_retry  +600,000 GPU-ms, +1,200,000 eff, +600,000 micros   late_samples (gpu-C)
so D's bill is now: alpha compute 0, idle 300,000, failed_retry 1,200,000; beta compute 450,000.
"""

from __future__ import annotations

import datetime as dt

import orjson
import pytest

from gpuledger import warehouse
from gpuledger.warehouse import bills, reports
from gpuledger.schemas.models import BillRow, GpuAssignment, JobEvent, UsageBatch, UsageRecord
from gpuledger.sink.rows import Source, job_event_row, usage_rows
from gpuledger.ledger_files import load_ledger_config

from warehouse_helpers import migrated_warehouse

pytestmark = pytest.mark.integration

DB = "bills_test"
D = dt.date(2024, 3, 1)
D1 = dt.date(2024, 3, 2)
B = 1709251200000 + 3_600_000  # 2024-03-01T01:00:00Z
MIN = 60_000
NEXT = 1709337600000          # 2024-03-02T00:00:00Z
GPUS = {"gpu-A": ("A100", 2.0, 1.0), "gpu-B": ("T4", 0.5, 0.25), "gpu-C": ("A100", 2.0, 1.0)}
JOBS = {"job-1": ("alpha", "train"), "job-2": ("beta", "infer")}


def rec(gpu, start_ms, end_ms, state, job="", attempt=0) -> UsageRecord:
    model, coef, rate = GPUS[gpu]
    gpu_ms = end_ms - start_ms
    tenant, queue = JOBS[job] if job else ("", "")
    return UsageRecord(
        record_id=f"{gpu}/{start_ms}/0", cluster="c1", node="n1", gpu_uuid=gpu, gpu_model=model,
        start_ms=start_ms, end_ms=end_ms, state=state, job_id=job, attempt=attempt, tenant=tenant, queue=queue,
        share_milli=1000, gpu_ms=gpu_ms, util_pct=None, util_metric_pct=None, energy_j=0.0, coefficient=coef,
        coefficient_version=f"{model}-v", effective_gpu_ms=round(gpu_ms * coef), cost_micros=round(gpu_ms * rate),
        definition_version="def-v1")


USAGE = [
    rec("gpu-A", B, B + 10 * MIN, "executing", "job-1"),
    rec("gpu-A", B + 10 * MIN, B + 15 * MIN, "allocated_idle", "job-1"),
    rec("gpu-B", B, B + 30 * MIN, "executing", "job-2"),
    rec("gpu-A", NEXT, NEXT + 60 * MIN, "unallocated"),
]
LATE_USAGE = [rec("gpu-C", B, B + 10 * MIN, "executing", "job-1")]


def ev(n, minute, kind, job, gpu=None) -> JobEvent:
    tenant, queue = JOBS[job]
    return JobEvent(event_id=f"e{n}", ts_ms=B + minute * MIN, kind=kind, cluster="c1", job_id=job, attempt=0,
                    tenant=tenant, queue=queue, requested_gpus=1.0,
                    gpus=[GpuAssignment(node="n1", gpu_uuid=gpu)] if gpu else [])


EVENTS = [ev(1, -5, "queued", "job-1"), ev(2, 0, "allocated", "job-1", "gpu-A"), ev(3, 0, "started", "job-1", "gpu-A"),
          ev(4, -2, "queued", "job-2"), ev(5, 0, "allocated", "job-2", "gpu-B"), ev(6, 0, "started", "job-2", "gpu-B"),
          ev(7, 30, "completed", "job-2", "gpu-B")]
LATE_EVENTS = [ev(8, 15, "failed", "job-1", "gpu-A")]


def put_usage(client, records, offset):
    """The sink's rows for these records, inserted directly (one block, no deduplication token)."""
    columns = {r[0] for r in client.query(f"DESCRIBE TABLE {DB}.usage_raw").result_rows}
    rows = usage_rows(UsageBatch(node="n1", records=records), Source("t.usage", 0, offset))
    warehouse.insert_rows(client, "usage_raw", [{k: v for k, v in r.items() if k in columns} for r in rows], database=DB)


def put_events(client, events, offset):
    warehouse.insert_rows(client, "job_events", [job_event_row(e, Source("t.job-events", 0, offset + i))
                                                 for i, e in enumerate(events)], database=DB)


@pytest.fixture
def ledger(tmp_path):
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (client, settings):
        put_usage(client, USAGE, 0)
        put_events(client, EVENTS, 0)
        yield client, settings, load_ledger_config(None)


def closed_rows(client, table="closed_tenant_bill"):
    return client.query(f"SELECT * EXCEPT closed_at FROM {DB}.{table} ORDER BY ALL").result_rows


def adjustments(client):
    return sorted((r["booked_day"], r["corrects_day"], r["tenant"], r["line"], r["reason"], r["gpu_ms"],
                   r["effective_gpu_ms"], r["cost_micros"])
                  for r in client.query(f"SELECT * FROM {DB}.bill_adjustments").named_results())


def test_close_then_late_data_books_adjustments_in_the_next_open_day(ledger):
    client, settings, ledger_cfg = ledger
    first = bills.close_due(client, settings, ledger_cfg, now=dt.datetime(2024, 3, 2, 2, tzinfo=dt.timezone.utc))
    assert first.closed == {"c1": [D]} and first.bill_run_id
    lines = {(r["tenant"], r["line"]): (r["gpu_ms"], r["effective_gpu_ms"], r["cost_micros"], r["currency"])
             for r in client.query(f"SELECT * FROM {DB}.closed_tenant_bill").named_results()}
    assert lines == {("alpha", "compute"): (600_000, 1_200_000, 600_000, "USD"),
                     ("alpha", "idle"): (300_000, 600_000, 300_000, "USD"),
                     ("beta", "compute"): (1_800_000, 900_000, 450_000, "USD")}
    queues = {(r["queue"], r["tenant"]): r for r in
              client.query(f"SELECT * FROM {DB}.closed_queue_efficiency").named_results()}
    assert queues[("train", "")]["allocated_gpu_seconds"] == pytest.approx(900)
    assert queues[("infer", "beta")]["executed_gpu_seconds"] == pytest.approx(1800)
    assert queues[("train", "")]["queue_wait_max_s"] == pytest.approx(300)
    before = {t: closed_rows(client, t) for t in ("closed_tenant_bill", "closed_job_cost", "closed_queue_efficiency",
                                                  "closed_days")}

    # late: the failed outcome of job-1/0 and a GPU's samples for D
    put_events(client, LATE_EVENTS, 100)
    put_usage(client, LATE_USAGE, 100)
    second = bills.close_due(client, settings, ledger_cfg, now=dt.datetime(2024, 3, 2, 3, tzinfo=dt.timezone.utc))
    assert second.closed == {} and second.adjustment_rows == 3
    # a closed row never changes; queue efficiency (not money) is revised by rows added under the run (§6a)
    after = {t: closed_rows(client, t) for t in before}
    assert {t: rows for t, rows in after.items() if t != "closed_queue_efficiency"} == \
           {t: rows for t, rows in before.items() if t != "closed_queue_efficiency"}
    assert set(before["closed_queue_efficiency"]) <= set(after["closed_queue_efficiency"])
    revised = {(r["queue"], r["tenant"]): r["allocated_gpu_seconds"] for r in client.query(
        f"SELECT * FROM {DB}.closed_queue_efficiency WHERE bill_run_id = {{run:String}}",
        parameters={"run": second.bill_run_id}).named_results()}
    assert revised == {("train", ""): pytest.approx(1500), ("train", "alpha"): pytest.approx(1500),  # + gpu-C's
                       ("infer", ""): pytest.approx(1800), ("infer", "beta"): pytest.approx(1800)}  # the day whole
    assert adjustments(client) == sorted([
        (D1, D, "alpha", "compute", "late_lifecycle_outcome", -600_000, -1_200_000, -600_000),
        (D1, D, "alpha", "failed_retry", "late_lifecycle_outcome", 600_000, 1_200_000, 600_000),
        (D1, D, "alpha", "failed_retry", "late_samples", 600_000, 1_200_000, 600_000),
    ])
    assert [m.kind for m in second.messages] == ["adjustment"] * 3

    # idempotent: nothing new, nothing booked, no run
    third = bills.close_due(client, settings, ledger_cfg, now=dt.datetime(2024, 3, 2, 4, tzinfo=dt.timezone.utc))
    assert third.bill_run_id is None and third.adjustment_rows == 0
    assert len(adjustments(client)) == 3
    runs = bills.list_runs(client, DB)
    assert [r["bill_run_id"] for r in runs] == [second.bill_run_id, first.bill_run_id]

    shown = bills.show(client, DB, D)
    assert {(r["kind"], r["tenant"], r["line"], r["reason"], r["cost_micros"]) for r in shown} == {
        ("closed", "alpha", "compute", "", 600_000), ("closed", "alpha", "idle", "", 300_000),
        ("closed", "beta", "compute", "", 450_000),
        ("corrected later", "alpha", "compute", "late_lifecycle_outcome", -600_000),
        ("corrected later", "alpha", "failed_retry", "late_lifecycle_outcome", 600_000),
        ("corrected later", "alpha", "failed_retry", "late_samples", 600_000)}

    # D+1 closes later; its bill carries the adjustments booked on it; they are not booked again
    put_usage(client, [rec("gpu-A", NEXT + 86_400_000, NEXT + 86_400_000 + 61 * MIN, "unallocated")], 200)
    fourth = bills.close_due(client, settings, ledger_cfg)
    assert fourth.closed == {"c1": [D1]} and fourth.adjustment_rows == 0


def test_the_same_records_twice_count_once_and_show_in_the_audit(ledger):
    client, settings, ledger_cfg = ledger
    # usage_raw folds copies of a record when its parts merge (sql/0022); held here so the copies are
    # still stored when the audit counts them (merges run at the end)
    client.command(f"SYSTEM STOP MERGES {DB}.usage_raw")
    # a backfill: the same day-D records again, straight into usage_raw (another block, no sink, no token)
    put_usage(client, USAGE[:3], 500)
    audit = {(r["day"], r["source_table"]): r for r in bills.audit(client, DB)}
    assert (audit[(D, "usage_raw")]["rows"], audit[(D, "usage_raw")]["distinct_records"]) == (6, 3)
    assert audit[(D, "usage_raw")]["duplicates"] == 3
    assert audit[(D, "usage_by_job_daily")]["duplicates"] == 3      # the summing views count them twice
    assert audit[(D1, "usage_raw")]["duplicates"] == 0
    exported = bills.export_audit(list(audit.values()))
    assert exported["usage_raw"] == 3
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("gpuledger_usage_duplicate_records", {"table": "usage_raw"}) == 3

    # the live view doubles the day ...
    live = {r["tenant"]: r["total_cost_micros"] for r in
            client.query(f"SELECT * FROM {DB}.tenant_daily_bill").named_results()}
    assert live == {"alpha": 2 * 900_000, "beta": 2 * 450_000}
    # ... the closed bill counts every record id once
    bills.close_due(client, settings, ledger_cfg)
    closed = {(r["tenant"], r["line"]): r["cost_micros"] for r in
              client.query(f"SELECT * FROM {DB}.closed_tenant_bill").named_results()}
    assert closed == {("alpha", "compute"): 600_000, ("alpha", "idle"): 300_000, ("beta", "compute"): 450_000}
    # a third copy after the close books nothing
    put_usage(client, USAGE[:3], 900)
    assert bills.close_due(client, settings, ledger_cfg).bill_run_id is None
    # the report reads the closed rows for D
    rows = reports.fetch(client, DB, "bills")
    (d_alpha,) = [r for r in rows if r["day"] == D and r["tenant"] == "alpha"]
    assert d_alpha["status"] == "closed" and d_alpha["total_cost_micros"] == 900_000 and d_alpha["currency"] == "USD"

    # merged, usage_raw keeps one copy of each record; the summing views still count every copy
    client.command(f"SYSTEM START MERGES {DB}.usage_raw")
    client.command(f"OPTIMIZE TABLE {DB}.usage_raw FINAL")
    audit = {(r["day"], r["source_table"]): r for r in bills.audit(client, DB)}
    assert (audit[(D, "usage_raw")]["rows"], audit[(D, "usage_raw")]["duplicates"]) == (3, 0)
    assert audit[(D, "usage_by_job_daily")]["duplicates"] == 6


def test_a_run_that_died_before_committing_counts_nothing(ledger):
    client, settings, ledger_cfg = ledger
    # rows of a run with no bill_runs row (the process died before its commit)
    warehouse.insert_rows(client, "closed_tenant_bill", [dict(
        day=D, cluster="c1", tenant="alpha", queue="train", line="compute", definition_version="def-v1",
        gpu_ms=1, effective_gpu_ms=1, cost_micros=1, currency="USD", bill_run_id="br-dead")], database=DB)
    warehouse.insert_rows(client, "closed_days", [dict(day=D, cluster="c1", bill_run_id="br-dead", horizon_ms=0)],
                          database=DB)
    result = bills.close_due(client, settings, ledger_cfg)
    assert result.closed == {"c1": [D]}
    shown = bills.show(client, DB, D)
    assert sorted(r["cost_micros"] for r in shown) == [300_000, 450_000, 600_000]


def read_messages(settings, topic: str, count: int, timeout_s: float = 30.0) -> list[tuple[bytes, bytes]]:
    """(key, value) of the first `count` messages of every partition of `topic`, by assignment."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**settings.kafka_client_config(), "group.id": "bills-test", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        out, deadline = [], time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append((msg.key(), msg.value()))
        return out
    finally:
        consumer.close()


def test_bill_rows_go_to_the_bills_topic_keyed_by_tenant(settings, tmp_path):
    from gpuledger.agents.publisher import KafkaPublisher
    from gpuledger.schemas.wire import decode
    from gpuledger.topics import create_topics

    settings = settings.model_copy(update={"warehouse": f"chdb:{tmp_path / 'chdb'}", "database": DB,
                                           "bills_close_grace_s": 3600.0})
    create_topics(settings)
    client = warehouse.connect(settings)
    try:
        warehouse.migrate(client, DB)
        put_usage(client, USAGE, 0)
        put_events(client, EVENTS, 0)
        with KafkaPublisher(settings) as publisher:
            result = bills.close_due(client, settings, load_ledger_config(None), publisher=publisher)
    finally:
        client.close()
    got = read_messages(settings, settings.topics.bills, 3)
    rows = [decode(BillRow, value) for _key, value in got]
    assert sorted((k.decode(), r.tenant) for (k, _), r in zip(got, rows)) == [("alpha", "alpha"), ("alpha", "alpha"),
                                                                              ("beta", "beta")]
    assert {(r.kind, r.day, r.tenant, r.line, r.cost_micros, r.currency, r.bill_run_id) for r in rows} == {
        ("closed", "2024-03-01", "alpha", "compute", 600_000, "USD", result.bill_run_id),
        ("closed", "2024-03-01", "alpha", "idle", 300_000, "USD", result.bill_run_id),
        ("closed", "2024-03-01", "beta", "compute", 450_000, "USD", result.bill_run_id)}
    assert orjson.loads(got[0][1])["schema_version"] == 1


def test_reports_say_closed_open_and_adjustment(ledger, capsys, monkeypatch):
    client, settings, ledger_cfg = ledger
    put_usage(client, [rec("gpu-B", NEXT + 60 * MIN, NEXT + 70 * MIN, "executing", "job-2")], 50)  # D+1, open
    bills.close_due(client, settings, ledger_cfg)
    put_events(client, LATE_EVENTS, 100)
    put_usage(client, LATE_USAGE, 100)
    bills.close_due(client, settings, ledger_cfg)

    rows = reports.fetch(client, DB, "bills", currency="USD")
    got = [(r["day"], r["status"], r["tenant"], r.get("corrects_day"), r.get("reason"), r["compute_cost_micros"],
            r["idle_cost_micros"], r["failed_retry_cost_micros"], r["currency"]) for r in rows]
    assert got == [
        (D, "closed", "alpha", None, None, 600_000, 300_000, 0, "USD"),      # as closed: unchanged by the late data
        (D, "closed", "beta", None, None, 450_000, 0, 0, "USD"),
        (D1, "open", "beta", None, None, 150_000, 0, 0, "USD"),              # 10 min of a T4: 600,000 x 0.25
        (D1, "adjustment", "alpha", D, "late_lifecycle_outcome", -600_000, 0, 600_000, "USD"),
        (D1, "adjustment", "alpha", D, "late_samples", 0, 0, 600_000, "USD"),
    ]
    # filters: cluster, queue, tenant, days
    assert [r["status"] for r in reports.fetch(client, DB, "bills", day_from=D1, tenant="alpha")] == ["adjustment"] * 2
    assert reports.fetch(client, DB, "bills", cluster="elsewhere") == []
    assert [(r["day"], r["tenant"]) for r in reports.fetch(client, DB, "bills", queue="infer")] == [(D, "beta"), (D1, "beta")]

    jobs = {r["job_id"]: r for r in reports.fetch(client, DB, "jobs", currency="USD")}
    # job-1's days are all closed: closed rows + adjustments = 600,000 + 300,000 - 600,000 + 600,000 + 600,000
    assert (jobs["job-1"]["status"], jobs["job-1"]["cost_micros"], jobs["job-1"]["currency"]) == ("closed", 1_500_000, "USD")
    assert (jobs["job-2"]["status"], jobs["job-2"]["cost_micros"]) == ("open", 450_000 + 150_000)
    queues = reports.fetch(client, DB, "queues")
    assert {(r["day"], r["queue"], r["status"]) for r in queues} == {(D, "train", "closed"), (D, "infer", "closed")}
    assert [r["tenant"] for r in reports.fetch(client, DB, "queues", tenant="beta")] == ["beta"]

    # the CLI, read-only, labels days as UTC and money with its currency
    monkeypatch.setenv("GPULEDGER_DATABASE", DB)
    client.close()  # one chDB client per directory in this process: let the CLI open it
    from gpuledger.cli import main

    warehouse_arg = settings.warehouse
    assert main(["report", "bills", "--warehouse", warehouse_arg, "--format", "csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("day_utc,status,cluster,tenant,definition_version,currency,")
    assert out[1].startswith("2024-03-01,closed,c1,alpha,def-v1,USD,")
    assert main(["bills", "show", "--day", "2024-03-01", "--warehouse", warehouse_arg, "--format", "json"]) == 0
    shown = orjson.loads(capsys.readouterr().out)
    assert {r["kind"] for r in shown} == {"closed", "corrected later"} and all("day_utc" in r for r in shown)
    assert main(["bills", "close", "--no-publish", "--warehouse", warehouse_arg]) == 0
    assert orjson.loads(capsys.readouterr().out)["bill_run_id"] is None
