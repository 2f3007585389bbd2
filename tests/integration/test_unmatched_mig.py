"""`report unmatched` compares an allocation's MIG instances with the GPUs billed at GPU level (review
finding F1): several instances of one GPU are billed together on their parent (docs/accounting.md
§1b), so an attempt holding two instances of one A100, billed 856/1000 of the parent, is a
`mig_allocation`, not `allocation_gpu_not_billed`. Real misses stay reported: a whole GPU named beside
a MIG instance and never billed, and MIG instances that resolved to no GPU at all. On chDB."""

from __future__ import annotations

import datetime as dt

import pytest
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

from gpuledger import warehouse
from gpuledger.schemas.models import JobEvent
from gpuledger.sink.rows import Source, job_event_row
from gpuledger.warehouse import reports

pytestmark = pytest.mark.integration

DB = "unmatched_mig"
T0 = int(dt.datetime(2026, 11, 10, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000


def billed(gpu: str, job: str, share: int, start: int = T0):
    r = usage_record("c1", gpu, start, start + 30 * MIN, "executing", job, "t1")
    ms = 30 * MIN * share // 1000
    return r.model_copy(update={"share_milli": share, "gpu_ms": ms, "effective_gpu_ms": ms})


def allocated(n: int, job: str, refs: list[str]):
    ev = JobEvent(event_id=f"a{n}", ts_ms=T0, kind="allocated", cluster="c1", job_id=job, attempt=0, tenant="t1",
                  queue="q", requested_gpus=1.0, gpus=[{"node": "n1", "gpu_uuid": ref} for ref in refs])
    return job_event_row(ev, Source("e", 0, n))


def test_mig_instances_billed_on_their_parent_are_not_reported_unbilled(tmp_path):
    with migrated_warehouse(tmp_path, DB) as (client, _):
        client.insert("node_inventory", [["c1", "n1", T0, 3, ["GPU-p1", "GPU-p2", "GPU-w"], ["A100"] * 3]],
                      column_names=["cluster", "node", "seen_ms", "gpu_count", "gpu_uuids", "gpu_models"],
                      database=DB)
        put_usage(client, DB, [
            billed("GPU-p1", "mig-pair", 856),    # MIG-a + MIG-b (3g.40gb each) on one parent
            billed("GPU-p2", "whole-and-mig", 428),  # its MIG-c resolved; its whole GPU-x never billed
        ], 0)
        warehouse.insert_rows(client, "job_events", [
            allocated(0, "mig-pair", ["MIG-a", "MIG-b"]),
            allocated(1, "whole-and-mig", ["GPU-x", "MIG-c"]),
            allocated(2, "mig-lost", ["MIG-d", "MIG-e"]),  # resolved to no GPU: billed on none
        ], database=DB)
        rows = {r["job_id"]: r for r in reports.fetch(client, DB, "unmatched")}
        assert {j: (r["kind"], r["gpus_named"], r["gpus_billed"]) for j, r in rows.items()} == {
            "mig-pair": ("mig_allocation", 2, 1),
            "whole-and-mig": ("allocation_gpu_not_billed", 2, 1),
            "mig-lost": ("allocation_gpu_not_billed", 2, 0),
        }
        assert rows["mig-pair"]["detail"] == "MIG-a MIG-b"
