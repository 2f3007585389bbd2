"""The warehouse schema as the migrations leave it: every table and view's CREATE statement against
a committed snapshot (tests/golden/schema.sql), and every materialized view's SELECT columns against
the table it writes to. A column the SELECT names but the TO table lacks is dropped by ClickHouse
without a word; a type that differs is converted silently. Both are caught here.

    GPULEDGER_UPDATE_GOLDEN=1 pytest tests/integration/test_schema_snapshot.py   # rewrite the snapshot
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_schema"
SNAPSHOT = Path(__file__).resolve().parents[1] / "golden" / "schema.sql"


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    client = warehouse.connect(Settings(warehouse=f"chdb:{tmp_path_factory.mktemp('schema') / 'chdb'}", database=DB))
    try:
        warehouse.migrate(client, DB)
        rows = client.query("SELECT name, engine, formatQuery(create_table_query) AS create_table_query, as_select "
                            "FROM system.tables "
                            "WHERE database = {db:String} ORDER BY name", parameters={"db": DB}).named_results()
        columns: dict[str, dict[str, str]] = {}
        # system.columns, not DESCRIBE: a parameterized view cannot be described without its parameters.
        # A MATERIALIZED or ALIAS column is the table's to compute: no SELECT writes it (sql/0032)
        for table, name, type_ in client.query(
                "SELECT table, name, type FROM system.columns WHERE database = {db:String} "
                "AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') ORDER BY table, position",
                parameters={"db": DB}).result_rows:
            columns.setdefault(table, {})[name] = type_
        out = []
        for row in rows:
            row["columns"] = columns.get(row["name"], {})
            if row["engine"] == "MaterializedView":
                row["select_columns"] = {n: t for n, t, *_ in client.query(f"DESCRIBE ({row['as_select']})").result_rows}
            out.append(row)
        yield out
    finally:
        client.close()  # one chDB directory per process


def render_snapshot(tables: list[dict]) -> str:
    """One CREATE per table or view, the database name written as `{db}`, sorted by name."""
    parts = ["-- The warehouse schema after every migration in sql/ (tests/integration/test_schema_snapshot.py).",
             "-- Do not edit: GPULEDGER_UPDATE_GOLDEN=1 rewrites it; review the diff like a migration.", ""]
    for t in tables:
        parts.append(t["create_table_query"].replace(f"{DB}.", "{db}.") + ";\n")
    return "\n".join(parts)


def test_create_statements_match_the_snapshot(tables):
    actual = render_snapshot(tables)
    if os.environ.get("GPULEDGER_UPDATE_GOLDEN") == "1":
        SNAPSHOT.write_text(actual)
    assert SNAPSHOT.exists(), f"{SNAPSHOT} missing: run with GPULEDGER_UPDATE_GOLDEN=1 to create it"
    expected = SNAPSHOT.read_text()
    assert actual == expected, ("the schema the migrations build changed; if intended, rerun with "
                                "GPULEDGER_UPDATE_GOLDEN=1 and review the diff of tests/golden/schema.sql")


def _stored_type(target_type: str) -> str:
    """What a TO table column holds: SimpleAggregateFunction(f, T) stores plain T values."""
    m = re.fullmatch(r"SimpleAggregateFunction\(\w+, (.+)\)", target_type)
    return m.group(1) if m else target_type


def test_every_materialized_view_writes_the_columns_and_types_of_its_table(tables):
    by_name = {t["name"]: t for t in tables}
    views = [t for t in tables if t["engine"] == "MaterializedView"]
    assert views, "no materialized views found"
    for view in views:
        target = re.search(rf"\bTO {DB}\.`?(\w+)`?", view["create_table_query"])
        assert target, f"{view['name']}: a materialized view must write TO a table"
        target_columns = {n: _stored_type(t) for n, t in by_name[target.group(1)]["columns"].items()}
        select_columns = view["select_columns"]
        assert sorted(select_columns) == sorted(target_columns), (
            f"{view['name']} -> {target.group(1)}: SELECT has {sorted(set(select_columns) - set(target_columns))} "
            f"not in the table, the table has {sorted(set(target_columns) - set(select_columns))} not selected")
        wrong = {n: (t, target_columns[n]) for n, t in select_columns.items() if t != target_columns[n]}
        assert not wrong, f"{view['name']} -> {target.group(1)}: SELECT type vs table type {wrong}"
