"""Two close runs at the same time (cron starting a run while a slow one still runs, or closers on two
hosts) close a day once and book an adjustment once (docs/accounting.md §6a, "Who closes"): close_due
holds a lock file per warehouse on the host (a second run waits, or with lock_wait_s does nothing), and
just before writing a run leaves out every cluster for which another run committed since it started."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from gpuledger.ledger_files import load_ledger_config
from gpuledger.warehouse import bills, reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "bills_concurrent"
HOUR = 3_600_000
UTC = dt.timezone.utc
D = dt.date(2024, 3, 1)
D0 = int(dt.datetime.combine(D, dt.time(), UTC).timestamp() * 1000)
CLOSE_AT = dt.datetime(2024, 3, 2, 3, tzinfo=UTC)


@pytest.fixture
def warehouse(tmp_path):
    """alpha executes 1 h on 1 March (3,600 micros); usage up to 2 March 02:00, so 1 March is due."""
    with migrated_warehouse(tmp_path, DB, bills_close_grace_s=3600) as (c, s):
        put_usage(c, DB, [usage_record("c1", "g1", D0 + HOUR, D0 + 2 * HOUR, "executing", "j1", "alpha"),
                          usage_record("c1", "g2", D0 + 22 * HOUR, D0 + 26 * HOUR, "unallocated")], 0)
        yield c, s, load_ledger_config(None)


def alpha_bill(c) -> list[tuple]:
    return [(r["day"], r["status"], r["total_cost_micros"]) for r in reports.fetch(c, DB, "bills", tenant="alpha")]


def test_two_close_runs_at_once_close_the_day_once(warehouse):
    c, s, ledger = warehouse
    results = []
    runs = [threading.Thread(target=lambda: results.append(bills.close_due(c, s, ledger, now=CLOSE_AT)))
            for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert alpha_bill(c) == [(D, "closed", 3600)], "1 March closed by both runs: bill doubled"
    assert c.query(f"SELECT count() FROM {DB}.bill_runs").result_rows[0][0] == 1
    assert sorted(r.closed.get("c1", []) for r in results) == [[], [D]]
    assert sum(m.cost_micros for r in results for m in r.messages if m.tenant == "alpha") == 3600, "published twice"


def test_a_run_started_while_another_holds_the_lock_does_nothing(warehouse):
    c, s, ledger = warehouse
    with bills.close_lock(s, DB) as held:
        assert held
        run = bills.close_due(c, s, ledger, now=CLOSE_AT, lock_wait_s=0)
        assert run.skipped == bills.LOCKED, "a second close run ran beside the one holding the lock"
        assert (run.bill_run_id, run.closed, run.as_dict()["skipped"]) == (None, {}, bills.LOCKED)
    assert bills.close_due(c, s, ledger, now=CLOSE_AT, lock_wait_s=0).closed == {"c1": [D]}
    assert alpha_bill(c) == [(D, "closed", 3600)]


def test_a_run_committed_meanwhile_by_another_host_leaves_its_cluster_out(warehouse, monkeypatch):
    """Another host's closer (which does not share this host's lock) commits while this run computes:
    after this run has read the cluster and before it writes (here: where it works out idle stretches)."""
    c, s, ledger = warehouse
    refresh = bills.idle_stretches.refresh
    other: list = []
    at = [CLOSE_AT]

    def other_host_commits_meanwhile(*args, **kw):
        if not other:
            other.append(None)  # the other run calls this too
            other[0] = bills._close(c, s, ledger, at[0], None, None)
        return refresh(*args, **kw)

    monkeypatch.setattr(bills.idle_stretches, "refresh", other_host_commits_meanwhile)
    run = bills.close_due(c, s, ledger, now=CLOSE_AT)
    assert other[0].closed == {"c1": [D]}
    assert alpha_bill(c) == [(D, "closed", 3600)], "1 March closed by both hosts' runs: bill doubled"
    assert (run.bill_run_id, run.closed, run.left_out, run.messages) == (None, {}, ["c1"], [])

    # the same for an adjustment: 30 more minutes of alpha on 1 March arrive late
    put_usage(c, DB, [usage_record("c1", "g3", D0 + 3 * HOUR, D0 + 3 * HOUR + HOUR // 2, "executing", "j1",
                                   "alpha")], 1)
    other.clear()
    at[0] = CLOSE_AT + dt.timedelta(hours=1)
    run = bills.close_due(c, s, ledger, now=at[0])
    assert other[0].adjustment_rows == 1 and run.left_out == ["c1"]
    assert c.query(f"SELECT corrects_day, line, reason, cost_micros FROM {DB}.bill_adjustments").result_rows == [
        (D, "compute", "late_samples", 1800)], "the late usage booked by both hosts' runs"
