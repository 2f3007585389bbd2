"""Approvals recorded before sql/0044 (docs/planning.md, "Approvals"; sql/0046), on real chDB.

Rows written then have cluster '' and attempt 0. Where the pending row's estimate names the cluster, the
approval is of that cluster's job (sql/0044). Estimates recorded before `gpuledger estimate` knew the
cluster name none: approving such an approval wrote cluster '' and the topic key "/<job id>", which no
cluster's admission hook reads, and `approvals list` showed it approved: it admitted nothing, silently.
Now approvals_current says why it needs re-approval, and approving it is refused."""

from __future__ import annotations

import json

import pytest

from gpuledger import warehouse
from gpuledger.warehouse import estimate, migrations

from warehouse_helpers import warehouse_before

pytestmark = pytest.mark.integration

DB = "gpuledger_apr_pre0044"
FIGURES = {"decided_by": "", "note": "", "target": "steps=60000", "cost_micros": 21_888_000,
           "cost_low_micros": 20_000_000, "cost_high_micros": 25_000_000, "threshold_micros": 10_000_000,
           "currency": "USD", "gpu_hours": 40.0, "wall_hours": 10.0}


def pending(approval_id: str, job_id: str, origin: dict) -> dict:
    return {**FIGURES, "approval_id": approval_id, "job_id": job_id, "status": "pending", "ts_ms": 1_000,
            "estimate": json.dumps({"job_id": job_id, **origin})}


def decided(approval_id: str, job_id: str, by: str) -> dict:
    return {**FIGURES, "approval_id": approval_id, "job_id": job_id, "status": "approved", "ts_ms": 2_000,
            "decided_by": by, "estimate": ""}


@pytest.fixture()
def client():
    c = warehouse_before("0044", DB, prefix="approvals-pre0044-")
    try:
        warehouse.insert_rows(c, "approvals", [
            pending("apr-known", "llm-1", {"attempt": 2, "cluster": "c1"}),  # estimate names its cluster
            decided("apr-known", "llm-1", "alice"),  # approved before the upgrade
            pending("apr-unknown", "llm-2", {"attempt": 1}),  # an estimate that names no cluster, pending
            pending("apr-unknown-done", "llm-3", {"attempt": 0}),  # the same, approved before the upgrade
            decided("apr-unknown-done", "llm-3", "bob"),
        ], database=DB)
        migrations.migrate(c, DB)
        yield c
    finally:
        c.close()


def current(client) -> dict[str, dict]:
    return {r["approval_id"]: r for r in estimate.list_approvals(client, DB)}


def test_an_old_approval_is_of_the_cluster_its_estimate_names(client):
    known = current(client)["apr-known"]
    assert (known["cluster"], known["job_id"], known["attempt"], known["status"]) == ("c1", "llm-1", 2, "approved")
    assert known.get("needs_reapproval", "") == ""
    # sent again (`approvals publish`), it goes under c1's key only, never another cluster's llm-1
    assert {estimate.message_key(r) for r in estimate.approval_history(client, DB, "apr-known")} == {b"c1/llm-1"}


def test_an_old_approval_whose_cluster_cannot_be_known_is_shown_and_cannot_be_approved(client):
    rows = current(client)
    for approval_id, job in (("apr-unknown", "llm-2"), ("apr-unknown-done", "llm-3")):
        reason = rows[approval_id].get("needs_reapproval")
        assert rows[approval_id]["cluster"] == "" and reason, f"{approval_id} admits no job; nothing says so: {reason!r}"
        assert "names no cluster" in reason and f"estimate job {job} again with --cluster" in reason
    with pytest.raises(ValueError, match="apr-unknown cannot be approved: names no cluster"):
        estimate.decide(client, DB, "apr-unknown", "approved", "alice", "", 3_000)
    assert [r["status"] for r in estimate.approval_history(client, DB, "apr-unknown")] == ["pending"]
    # rejecting it admits nothing either, and clears it
    estimate.decide(client, DB, "apr-unknown", "rejected", "alice", "estimated again as c1", 3_000)
    assert (current(client)["apr-unknown"]["status"], current(client)["apr-unknown"]["needs_reapproval"]) == ("rejected", "")
