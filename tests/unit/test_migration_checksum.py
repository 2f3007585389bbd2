"""The migration checksum rule (gpuledger/warehouse/migrations.py, sql/README.md): comments of an applied
migration may be corrected, its SQL may not change; records of the earlier whole-file rule are
accepted and re-recorded."""

import hashlib

import pytest

from gpuledger.warehouse import (
    WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS,
    Migration,
    WarehouseError,
    load_migrations,
    sql_checksum,
)

APPLIED = """-- Usage as received.
CREATE TABLE IF NOT EXISTS t
(
    a UInt8,   -- a trailing comment is part of the SQL line
    b String
)
ENGINE = MergeTree ORDER BY a;
"""


def whole_file(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def migration(text: str) -> Migration:
    return Migration("0042", "t", text)


def test_comment_lines_and_blank_lines_may_change():
    recorded = migration(APPLIED).checksum
    reworded = APPLIED.replace("-- Usage as received.", "-- Usage as the sink received it,\n  -- corrected.\n\n")
    assert not migration(reworded).recorded_as_earlier(recorded)


@pytest.mark.parametrize("change", [
    lambda s: s.replace("UInt8", "UInt16"),
    lambda s: s.replace("    b String\n", "    b String,\n    c String\n"),
    lambda s: s.replace("part of the SQL line", "part of the SQL"),   # a trailing comment is SQL
    lambda s: s.replace("ORDER BY a", "ORDER BY  a"),
])
def test_any_change_to_the_sql_is_refused(change):
    recorded = migration(APPLIED).checksum
    with pytest.raises(WarehouseError, match="0042_t was applied with checksum .* its SQL now has .*must not change"):
        migration(change(APPLIED)).recorded_as_earlier(recorded)


def test_a_record_of_the_earlier_whole_file_rule_is_accepted_for_re_recording():
    assert migration(APPLIED).recorded_as_earlier(whole_file(APPLIED))
    # under the earlier rule a comment edit was a change: no way to tell it from an SQL change
    with pytest.raises(WarehouseError):
        migration(APPLIED.replace("as received", "as read")).recorded_as_earlier(whole_file(APPLIED))


def test_a_listed_checksum_of_a_file_before_its_comments_were_corrected_is_accepted():
    shipped = {mg.version: mg for mg in load_migrations()}
    for version, before in WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS.items():
        mg = shipped[version]
        assert before != whole_file(mg.sql), f"{version}: the file is as it was; drop it from the list"
        assert mg.recorded_as_earlier(before)


def test_every_shipped_migration_has_sql_under_its_comments():
    for mg in load_migrations():
        assert mg.checksum != sql_checksum(""), mg.version
        assert mg.checksum == sql_checksum(mg.sql + "\n-- a note added later\n")


def test_a_comment_line_ending_in_a_semicolon_does_not_end_a_statement():
    text = ("-- two tables;\nCREATE TABLE IF NOT EXISTS t\n(\n    -- the key (a counter);\n    a UInt8\n)\n"
            "ENGINE = MergeTree\nORDER BY (a);\n\n-- then a copy;\nINSERT INTO t SELECT 1;\n")
    create, insert = migration(text).statements()
    assert create.endswith("ORDER BY (a)") and "a UInt8" in create
    assert insert.endswith("INSERT INTO t SELECT 1")
    assert migration(text).declared_keys() == {"t": ("", "a")}


def test_a_changed_applied_file_says_what_to_do():
    recorded = migration(APPLIED).checksum
    changed = migration(APPLIED.replace("UInt8", "UInt16"))
    with pytest.raises(WarehouseError) as err:
        changed.recorded_as_earlier(recorded)
    # the operator's way out: the file as applied back, the change as a new file
    assert f"restore sql/{changed.version}_{changed.name}.sql as it was applied" in str(err.value)
    assert "new migration" in str(err.value)
