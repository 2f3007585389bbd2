"""The migrator: applies `gpuledger.sql`'s numbered DDL files once each, in order, and refuses an applied file whose SQL changed (sql/README.md).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from gpuledger.warehouse.client import WarehouseError, checked_identifier
from gpuledger.warehouse.cluster import LOCAL_SUFFIX, ClusterRenderer, server_formatter
from gpuledger.warehouse.retention import apply_retention, wanted_ttls





log = logging.getLogger(__name__)

MIGRATIONS_TABLE = "schema_migrations"


_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_EXCHANGE = re.compile(r"^EXCHANGE TABLES `?(\w+)`? AND `?(\w+)`?")
_CREATE_TABLE = re.compile(r"^CREATE TABLE (?:IF NOT EXISTS )?`?(\w+)`?")
_ORDER_BY = re.compile(r"^ORDER BY \((.+)\)\s*$", re.MULTILINE)
_PARTITION_BY = re.compile(r"^PARTITION BY (.+?)\s*$", re.MULTILINE)
_STATEMENT_END = re.compile(r";[ \t]*$")


def _without_comments(statement: str) -> str:
    """The statement without its whole-line `--` comments."""
    return "\n".join(line for line in statement.splitlines() if not line.strip().startswith("--")).strip()



# --------------------------------------------------------------------------- migrations
def sql_checksum(text: str) -> str:
    """sha256 of a migration's SQL, whole-line comments (`--` first on the line) and blank lines left
    out: the prose of an applied migration may be corrected, any change to its SQL is refused."""
    sql = "\n".join(line.rstrip() for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("--"))
    return hashlib.sha256(sql.encode()).hexdigest()


#: Whole-file sha256s that ledgers before the comment-blind rule recorded, of files whose comments
#: were corrected since (same SQL): a warehouse migrated back then is accepted and re-recorded.
WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS = {
    "0008": "eb19d323e79039b6bec172cdfec31181a2bb85a3467726104382ed59c9c96885",
}


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return sql_checksum(self.sql)

    @property
    def earlier_checksums(self) -> set[str]:
        """What older ledgers recorded for this same SQL: the whole file's sha256 (the rule before
        comments were left out), and the one of the file before its comments were corrected."""
        before = WHOLE_FILE_CHECKSUMS_BEFORE_COMMENT_EDITS.get(self.version)
        return {hashlib.sha256(self.sql.encode()).hexdigest(), *([before] if before else [])}

    def recorded_as_earlier(self, recorded: str) -> bool:
        """Whether an applied migration's recorded checksum is this file's; True when it was recorded
        under the earlier rule (re-record it). Raises WarehouseError when the SQL changed."""
        if recorded == self.checksum:
            return False
        if recorded in self.earlier_checksums:
            return True
        raise WarehouseError(
            f"migration {self.version}_{self.name} was applied with checksum {recorded[:12]}… but its SQL now has "
            f"{self.checksum[:12]}…; applied migrations must not change (comments may): restore "
            f"sql/{self.version}_{self.name}.sql as it was applied and put the change in a new migration")

    def declared_keys(self) -> dict[str, tuple[str, str]]:
        """Table -> (partition key, sort key) as written ("toYYYYMM(day)", "a, f(b), c") of each CREATE
        TABLE in the file; the partition key is "" where there is none."""
        keys = {}
        for st in self.statements():
            body = _without_comments(st)
            if (name := _CREATE_TABLE.match(body)) and (order := _ORDER_BY.search(body)):
                partition = _PARTITION_BY.search(body)
                keys[name.group(1)] = (partition.group(1) if partition else "", order.group(1))
        return keys

    def statements(self) -> list[str]:
        """Statements end with ';' at the end of a line of SQL (a whole-line comment ending in ';' is
        prose: it would split a statement in two); comment-only chunks are dropped."""
        out, chunk = [], []
        for line in [*self.sql.splitlines(), ";"]:
            if line.lstrip().startswith("--") or not _STATEMENT_END.search(line):
                chunk.append(line)
                continue
            chunk.append(_STATEMENT_END.sub("", line))
            if _without_comments("\n".join(chunk)):
                out.append("\n".join(chunk).strip())
            chunk = []
        return out


def load_migrations() -> list[Migration]:
    """The packaged migrations in version order."""
    found = []
    for entry in resources.files("gpuledger.sql").iterdir():
        m = _MIGRATION_FILE.match(entry.name)
        if m:
            found.append(Migration(m.group(1), m.group(2), entry.read_text(encoding="utf-8")))
        elif entry.name.endswith(".sql"):
            raise WarehouseError(f"migration file {entry.name!r} does not follow NNNN_name.sql")
    found.sort(key=lambda mg: mg.version)
    versions = [mg.version for mg in found]
    if len(set(versions)) != len(versions):
        raise WarehouseError(f"duplicate migration versions in gpuledger.sql: {versions}")
    return found


def applied_migrations(client, database: str) -> dict[str, dict]:
    db = checked_identifier(database, "database")
    # a re-recorded version has a newer row (see migrate): the latest row of each version wins
    rows = client.query(f"SELECT version, name, checksum, applied_at FROM `{db}`.{MIGRATIONS_TABLE} "
                        "ORDER BY version, applied_at")
    # a `NNNN.i` row notes a statement of an unfinished file (see _resume_after), not a migration
    return {r["version"]: r for r in rows.named_results() if "." not in r["version"]}


def _resume_after(client, db: str, mg: Migration) -> int:
    """Index of the last statement of `mg` noted as done by an earlier, interrupted run (-1: none).

    A file's back-fills (`INSERT ... SELECT`) are not all idempotent (sql/0018 adds to summing
    aggregates whatever they hold), so each one completed is noted as a `NNNN.i` row (statements 0..i
    done), and a run of the file again resumes after it. Notes of another text of the file (edited
    before it was recorded) do not count."""
    rows = client.query(f"SELECT version FROM `{db}`.{MIGRATIONS_TABLE} "
                        "WHERE startsWith(version, {prefix:String}) AND checksum = {checksum:String}",
                        parameters={"prefix": mg.version + ".", "checksum": mg.checksum}).result_rows
    return max((int(v.rpartition(".")[2]) for (v,) in rows), default=-1)


def migrate(client, database: str, *, cluster: str | None = None,
            retention: dict[str, str | None] | None = None) -> list[str]:
    """Apply pending migrations in order; returns the versions applied now ([] when up to date).

    Each file is recorded in `schema_migrations` with the sha256 of its SQL (`sql_checksum`: whole-line
    comments left out) after all its statements ran. Statements are IF NOT EXISTS, and each
    `INSERT ... SELECT` completed is noted (a `NNNN.i` row, _resume_after), so a file interrupted
    halfway runs again from the statement after its last back-fill, none done twice. Refuses to run
    when the SQL of a file already applied has changed: add a new migration. A checksum recorded
    under the earlier whole-file rule is re-recorded (a newer row) under this one.

    `cluster` (GPULEDGER_CLICKHOUSE_CLUSTER) renders every statement for that ClickHouse cluster
    (gpuledger/warehouse/cluster.py); `retention` (table -> TTL expression or None, from
    retention.wanted_ttls) is applied after the migrations (gpuledger/warehouse/retention.py)."""
    db = checked_identifier(database, "database")
    renderer = ClusterRenderer(cluster, db, server_formatter(client)) if cluster else None
    on_cluster = f" ON CLUSTER `{cluster}`" if cluster else ""
    client.command(f"CREATE DATABASE IF NOT EXISTS `{db}`{on_cluster}")
    previous = client.database
    client.database = db  # unqualified names in the DDL resolve here (USE on chDB)
    try:
        create_records = (
            f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} "
            "(version String, name String, checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
            "ENGINE = MergeTree ORDER BY version"
        )
        for statement in renderer.render(create_records) if renderer else [create_records]:
            client.command(statement)
        applied = applied_migrations(client, db)
        migrations = load_migrations()
        unknown = sorted(set(applied) - {mg.version for mg in migrations})
        if unknown:
            # e.g. a rollback: this release may not write what the newer schema expects
            log.warning("warehouse %s holds migration(s) this release does not have: %s (applied by a newer "
                        "release?)", db, ", ".join(f"{v}_{applied[v]['name']}" for v in unknown))
        earlier = [mg for mg in migrations
                   if mg.version in applied and mg.recorded_as_earlier(applied[mg.version]["checksum"])]
        for mg in earlier:
            log.info("re-recording migration %s_%s under the comment-blind checksum", mg.version, mg.name)
            _record(client, db, mg, on_cluster=bool(cluster))
        now: list[str] = []
        for mg in migrations:
            # on a cluster every file is rendered, applied or not: the renderer learns the tables
            statements = [(i, sql) for i, st in enumerate(mg.statements())
                          for sql in (renderer.render(st) if renderer else [st])]
            if mg.version in applied:
                continue
            done = _resume_after(client, db, mg)
            log.info("applying migration %s_%s to %s%s%s", mg.version, mg.name, db, on_cluster,
                     f" (resuming after statement {done + 1}, done before)" if done >= 0 else "")
            for i, statement in statements:
                if i <= done:
                    continue
                if _exchanged_already(client, db, statement, mg, bool(cluster)):
                    log.info("migration %s_%s: %s took effect before; not run again", mg.version, mg.name,
                             statement.splitlines()[0])
                    continue
                try:
                    client.command(statement)
                except Exception as exc:
                    raise WarehouseError(f"migration {mg.version}_{mg.name} failed: {exc}") from exc
                if _without_comments(statement).startswith("INSERT"):
                    _record(client, db, mg, on_cluster=bool(cluster), step=i)
            _record(client, db, mg, on_cluster=bool(cluster))
            now.append(mg.version)
        if retention is not None:
            apply_retention(client, db, retention, local=(lambda t: t + LOCAL_SUFFIX) if cluster else (lambda t: t),
                            on_cluster=on_cluster.strip())
        return now
    finally:
        if previous and previous != db:
            client.database = previous


def _exchanged_already(client, db: str, statement: str, mg: Migration, cluster: bool) -> bool:
    """Whether `EXCHANGE TABLES a AND b` (a table rebuild: b created in the same file with a new sort
    or partition key, filled, then swapped in) already took effect: `a` has b's declared partition and
    sort keys. The one statement of a migration that is not idempotent; a file interrupted after it
    must not swap the tables back."""
    m = _EXCHANGE.match(_without_comments(statement))  # comments may come before it
    if m is None:
        return False
    table, rebuilt = m.groups()
    if cluster:
        rebuilt = rebuilt.removesuffix(LOCAL_SUFFIX)
    declared = mg.declared_keys()
    if rebuilt not in declared:
        raise WarehouseError(f"EXCHANGE TABLES {table} AND {m.group(2)}: the migration must create {rebuilt}")
    rows = client.query("SELECT partition_key, sorting_key FROM system.tables "
                        "WHERE database = {db:String} AND name = {t:String}",
                        parameters={"db": db, "t": table}).result_rows
    # system.tables spaces the keys its own way: compare without spaces
    return bool(rows) and [_unspaced(k) for k in rows[0]] == [_unspaced(k) for k in declared[rebuilt]]


def _unspaced(key: str) -> str:
    return "".join(key.split())


def _record(client, db: str, mg: Migration, *, on_cluster: bool = False, step: int | None = None) -> None:
    """Record `mg` as applied (with `step`: note its statements 0..step as done, _resume_after). On a
    cluster the table is Distributed, whose inserts are sent later by default: a migrate run right after
    would not see the record and run the file again (its back-fills twice), so the insert waits until
    the shard has it."""
    version = mg.version if step is None else f"{mg.version}.{step}"
    client.insert(MIGRATIONS_TABLE, [[version, mg.name, mg.checksum]], column_names=["version", "name", "checksum"],
                  database=db, settings={"distributed_foreground_insert": 1} if on_cluster else None)


def migrate_configured(client, settings) -> list[str]:
    """`migrate` as configured: for GPULEDGER_CLICKHOUSE_CLUSTER when set, with the GPULEDGER_RETENTION_* TTLs."""
    return migrate(client, settings.database, cluster=settings.clickhouse_cluster or None,
                   retention=wanted_ttls(settings))
