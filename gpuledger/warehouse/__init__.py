"""The warehouse side: ClickHouse (a server, or chDB embedded) and everything that reads it.

client.py (connect, inserts), migrations.py (the numbered DDL in gpuledger.sql), cluster.py (rendering
the migrations for a ClickHouse cluster), reports.py (`gpuledger report`), bills.py (closing billing
days, adjustments), library.py (price and coefficient history, rebilling), periodic/ (weekly,
monthly, job-health reports).

The client and migration API is re-exported here: `from gpuledger.warehouse import connect, migrate`."""

from gpuledger.warehouse.client import WarehouseError, connect, connect_readonly, insert_rows
from gpuledger.warehouse.migrations import (
    MIGRATIONS_TABLE,
    WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS,
    Migration,
    applied_migrations,
    load_migrations,
    migrate,
    sql_checksum,
)

__all__ = ["MIGRATIONS_TABLE", "WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS", "Migration", "WarehouseError",
           "applied_migrations", "connect", "connect_readonly", "insert_rows", "load_migrations", "migrate",
           "sql_checksum"]
