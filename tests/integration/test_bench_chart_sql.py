"""The queries benchmark (bench/queries.py, `make bench`) times every chart of the Superset bundle with the
SQL Superset sends for it: that SQL must run on the migrated schema, calculated columns included (the bill
datasets' `currency` is an expression, not a column of the table)."""

from __future__ import annotations

import pytest

from bench.queries import DATABASE, bundle_charts
from gpuledger import warehouse
from gpuledger.config import Settings

pytestmark = pytest.mark.integration  # the real engine (chDB)


def test_every_bundle_chart_query_of_the_benchmark_runs(tmp_path):
    client = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", database=DATABASE))
    try:
        warehouse.migrate(client, DATABASE)
        charts = bundle_charts()
        assert any("currency" in sql for _, _, sql in charts)
        for name, _table, sql in charts:
            try:
                client.query(sql)
            except Exception as exc:  # noqa: BLE001 (named: which chart's SQL the schema refuses)
                pytest.fail(f"{name}: {exc}")
    finally:
        client.close()
