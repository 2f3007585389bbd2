"""A close run labels each closed row and adjustment with the currency of the row's own definition
version as recorded in `definitions`, not with the currency of the ledger that runs the close: usage
priced under d1 (USD) and closed after the ledger moved to d2 (EUR) stays USD (docs/accounting.md §6a)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_currency"
MIN = 60_000
D = dt.date(2024, 3, 1)
B = 1709251200000 + 3_600_000  # 2024-03-01T01:00:00Z
NEXT = 1709337600000           # 2024-03-02T00:00:00Z


def test_closed_rows_and_adjustments_carry_their_definition_versions_currency(tmp_path):
    # the ledger moved to d2 in EUR (a new currency is a new definition version)
    ledger = dataclasses.replace(load_ledger_config(None), definition_version="d2", currency="EUR")
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        # the accounting library as `gpuledger migrate` records it: d1 in USD, d2 in EUR
        c.insert(f"{DB}.definitions", [["d1", "f1", json.dumps({"currency": "USD"})],
                                       ["d2", "f2", json.dumps({"currency": "EUR"})]],
                 column_names=["definition_version", "fingerprint", "content"])
        put_usage(c, DB, [usage_record("c1", "g1", B, B + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", NEXT, NEXT + 60 * MIN, "unallocated")], 0)
        first = bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 2, 2, tzinfo=dt.timezone.utc))
        assert first.closed == {"c1": [D]}
        stored = c.query(f"SELECT definition_version, currency FROM {DB}.closed_tenant_bill "
                         f"UNION ALL SELECT definition_version, currency FROM {DB}.closed_job_cost").result_rows
        assert stored == [("d1", "USD"), ("d1", "USD")], "closed rows of d1 must be in d1's currency"
        assert [(m.definition_version, m.currency) for m in first.messages] == [("d1", "USD")]
        # late usage of the closed day: its adjustment is in d1's currency too
        put_usage(c, DB, [usage_record("c1", "g2", B, B + 5 * MIN, "executing", "j1", "alpha")], 1)
        second = bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 2, 3, tzinfo=dt.timezone.utc))
        assert second.adjustment_rows == 1
        assert c.query(f"SELECT definition_version, currency FROM {DB}.bill_adjustments").result_rows == [("d1", "USD")]
        assert [(m.kind, m.currency) for m in second.messages] == [("adjustment", "USD")]
        # the report agrees with the jobs report
        assert {(r["status"], r["currency"]) for r in reports.fetch(c, DB, "bills")} == {
            ("closed", "USD"), ("adjustment", "USD")}
        assert {r["currency"] for r in reports.fetch(c, DB, "jobs")} == {"USD"}


def test_a_version_not_recorded_falls_back_to_the_ledgers_currency(tmp_path):
    ledger = dataclasses.replace(load_ledger_config(None), definition_version="d2", currency="EUR")
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        put_usage(c, DB, [usage_record("c1", "g1", B, B + 10 * MIN, "executing", "j1", "alpha"),
                          usage_record("c1", "g1", NEXT, NEXT + 60 * MIN, "unallocated")], 0)
        bills.close_due(c, s, ledger, now=dt.datetime(2024, 3, 2, 2, tzinfo=dt.timezone.utc))
        assert c.query(f"SELECT currency FROM {DB}.closed_tenant_bill").result_rows == [("EUR",)]
