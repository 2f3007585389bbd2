"""Cluster idle shared among the tenants of that cluster only, with the same parts whatever the cluster
and queue filters, and per-queue reports adding up to the cluster's idle (docs/accounting.md §6); each
definition version's idle shared as the [idle] policy recorded with it says, whatever the running
ledger's is (§7), unless --idle-redistribution names one for every row."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from gpuledger.ledger_files import load_ledger_config, write_ledger_variant
from gpuledger.warehouse import library, reports
from gpuledger.warehouse.periodic import commands as pr
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


def test_each_definition_version_shares_its_idle_as_its_recorded_policy(tmp_path, monkeypatch, capsys):
    """A ledger moved from a version that shares the cluster idle evenly to one that keeps it with the
    platform: the old version's rows keep their shares in `report bills` and the monthly report run with
    the new ledger; a version with no recorded policy follows the running ledger; the flag overrides."""
    even = write_ledger_variant(None, tmp_path / "even.toml", suffix="even", idle={"redistribution": "even"})
    plain = write_ledger_variant(None, tmp_path / "none.toml", suffix="none", idle={"redistribution": "none"})
    v_even, v_none = load_ledger_config(even).definition_version, load_ledger_config(plain).definition_version

    def vrec(gpu, minutes, state, version, job="", tenant=""):
        return usage_record("c1", gpu, B, B + minutes * MIN, state, job, tenant).model_copy(
            update={"definition_version": version})

    with migrated_warehouse(tmp_path, DB) as (c, settings):
        for ledger in (even, plain):  # as `gpuledger migrate` records each version
            library.sync_library(c, DB, load_ledger_config(ledger))
        put_usage(c, DB, [
            vrec("g1", 10, "executing", v_even, "j1", "alpha"),    # 600
            vrec("g2", 30, "executing", v_even, "j2", "beta"),     # 1800
            vrec("g3", 60, "unallocated", v_even),                 # v_even's idle 3600
            vrec("g4", 20, "executing", v_none, "j3", "alpha"),    # 1200
            vrec("g5", 40, "unallocated", v_none),                 # v_none's idle 2400
            vrec("g6", 10, "executing", "d1", "j4", "gamma"),      # 600, a version with nothing recorded
            vrec("g7", 7, "unallocated", "d1"),                    # d1's idle 420
        ], 0)

        def parts(**filters):
            return {(r["definition_version"], r["tenant"]): (r.get("cluster_idle_cost_micros"),
                                                             r.get("billed_total_cost_micros"))
                    for r in reports.fetch(c, DB, "bills", **filters)}

        # the running ledger's policy (none, or usage) reaches the unrecorded version only
        assert parts(ledger_idle_redistribution="none") == {
            (v_even, "alpha"): (1800, 2400), (v_even, "beta"): (1800, 3600),
            (v_none, "alpha"): (0, 1200), ("d1", "gamma"): (0, 600)}
        assert parts(ledger_idle_redistribution="usage")[("d1", "gamma")] == (420, 1020)
        assert parts(ledger_idle_redistribution="usage")[(v_even, "alpha")] == (1800, 2400)
        assert parts(ledger_idle_redistribution="none", tenant="alpha") == {
            (v_even, "alpha"): (1800, 2400), (v_none, "alpha"): (0, 1200)}
        # --idle-redistribution: every row alike (a what-if view)
        assert parts(idle_redistribution="usage", ledger_idle_redistribution="none") == {
            (v_even, "alpha"): (900, 1500), (v_even, "beta"): (2700, 4500),
            (v_none, "alpha"): (2400, 3600), ("d1", "gamma"): (420, 1020)}
        assert set(parts(idle_redistribution="none").values()) == {(None, None)}
        # the monthly report shares it as the bills do
        month = pr.build_report(c, DB, "monthly", month="2024-03", ledger_idle_redistribution="none")
        tenants = {t["tenant"]: t for t in month.section("Tenant cost composition").rows}
        assert tenants["alpha"]["cluster_idle_cost"] == pytest.approx(0.0018)
        assert tenants["gamma"]["cluster_idle_cost"] == 0

    # the CLI run with the new ledger (none) bills the old version's rows as that version does
    monkeypatch.setenv("GPULEDGER_DATABASE", DB)
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(plain))
    from gpuledger.cli import main

    assert main(["report", "bills", "--warehouse", settings.warehouse, "--format", "json"]) == 0
    rows = {(r["definition_version"], r["tenant"]): r for r in json.loads(capsys.readouterr().out)}
    old = rows[(v_even, "alpha")]
    assert (old.get("cluster_idle_cost_micros"), old.get("billed_total_cost_micros")) == (1800, 2400), \
        "report bills shares the old version's idle under the running ledger's policy"
    assert rows[(v_none, "alpha")]["cluster_idle_cost_micros"] == 0
    assert main(["report", "bills", "--warehouse", settings.warehouse, "--format", "json",
                 "--idle-redistribution", "none"]) == 0
    assert all("cluster_idle_cost_micros" not in r for r in json.loads(capsys.readouterr().out))
    out = tmp_path / "monthly.md"
    assert main(["report", "monthly", "--month", "2024-03", "--warehouse", settings.warehouse,
                 "--format", "markdown", "--output", str(out)]) == 0
    text = out.read_text()  # shared, though the running ledger's policy is none
    assert "**Cluster idle cost (USD)**" in text and "cluster idle shared (each definition version's" in text


def test_usage_shares_evenly_when_no_tenant_cost_anything(tmp_path):
    """Tenants on a zero-priced model beside priced unallocated GPUs: 'usage' has no cost to weigh the
    parts by, and the idle must still be shared in full (as 'even' would), not left with nobody."""
    with migrated_warehouse(tmp_path, DB) as (c, _):
        free = {"cost_micros": 0}
        put_usage(c, DB, [
            rec("c1", "g1", 10, "executing", "j1", "alpha", "qa").model_copy(update=free),
            rec("c1", "g2", 10, "allocated_idle", "j2", "beta", "qa").model_copy(update=free),
            rec("c1", "g3", 61, "unallocated"),                      # c1 idle 3660
        ], 0)
        assert idle_parts(c, idle_redistribution="usage") == {("c1", "alpha"): 1830, ("c1", "beta"): 1830}, \
            "the cluster idle was shared with nobody: the parts do not add up to it"
