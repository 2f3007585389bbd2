"""Warehouse DDL: numbered migrations (`NNNN_name.sql`), the single source of truth of the schema.

Naming: raw table -> `<aggregate>_mv` -> aggregate table; views read the aggregates.
Statements end with `;` at the end of a line; names are unqualified (the migrator runs
them with the target database as the session's current database). `gpuledger.warehouse`
applies them and records each in `schema_migrations` with its checksum: never edit an
applied file, add a new one."""
