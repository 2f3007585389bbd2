"""Cluster idle shared among the tenants of that cluster only, with the same parts whatever the cluster
and queue filters, and per-queue reports adding up to the cluster's idle (docs/accounting.md §6)."""

from __future__ import annotations

import datetime as dt

import pytest

from gpuledger.warehouse import reports
from warehouse_helpers import migrated_warehouse, put_usage, usage_record

pytestmark = pytest.mark.integration

DB = "idle_redis"
MIN = 60_000
DAY = dt.date(2024, 3, 1)
B = int(dt.datetime(2024, 3, 1, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)


def rec(cluster, gpu, minutes, state, job="", tenant="", queue=""):
    r = usage_record(cluster, gpu, B, B + minutes * MIN, state, job, tenant)
    return r.model_copy(update={"queue": queue}) if job else r


def idle_parts(c, **filters):
    return {(r["cluster"], r["tenant"]): r["cluster_idle_cost_micros"]
            for r in reports.fetch(c, DB, "bills", **filters)}


@pytest.mark.parametrize("policy", ["even", "usage"])
def test_idle_goes_to_its_cluster_and_filters_show_the_same_parts(tmp_path, policy):
    with migrated_warehouse(tmp_path, DB) as (c, _):
        put_usage(c, DB, [
            rec("c1", "g1", 10, "executing", "j1", "alpha", "qa"),   # 600
            rec("c1", "g2", 30, "executing", "j2", "alpha", "qb"),   # 1800
            rec("c1", "g3", 10, "executing", "j3", "beta", "qb"),    # 600
            rec("c1", "g4", 61, "unallocated"),                      # c1 idle 3660
            rec("c2", "h1", 10, "executing", "j4", "gamma", "qa"),   # 600
            rec("c2", "h2", 7, "unallocated"),                       # c2 idle 420
        ], 0)
        whole = idle_parts(c, idle_redistribution=policy)
        # each cluster's idle goes to its own tenants, exactly
        assert whole[("c2", "gamma")] == 420
        assert whole[("c1", "alpha")] + whole[("c1", "beta")] == 3660
        if policy == "even":
            assert whole[("c1", "alpha")] == whole[("c1", "beta")] == 1830
        else:
            assert (whole[("c1", "alpha")], whole[("c1", "beta")]) == (2928, 732)  # 2400 : 600
        # a cluster's report shows the parts of the whole report
        assert idle_parts(c, idle_redistribution=policy, cluster="c1") == {
            k: v for k, v in whole.items() if k[0] == "c1"}
        assert idle_parts(c, idle_redistribution=policy, cluster="c2", tenant="gamma") == {("c2", "gamma"): 420}
        # the per-queue reports split each tenant's part and add up to each cluster's idle exactly
        qa = idle_parts(c, idle_redistribution=policy, queue="qa")
        qb = idle_parts(c, idle_redistribution=policy, queue="qb")
        for key, part in whole.items():
            assert qa.get(key, 0) + qb.get(key, 0) == part, key
        assert sum(qa.values()) + sum(qb.values()) == 3660 + 420
        rows = reports.fetch(c, DB, "bills", idle_redistribution=policy, queue="qa")
        assert all(r["billed_total_cost_micros"] == r["total_cost_micros"] + r["cluster_idle_cost_micros"] for r in rows)
