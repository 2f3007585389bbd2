"""The warehouse: one ClickHouse client (clickhouse-connect) for the embedded chDB engine or a server,
and the migrator that applies `gpuledger.sql`'s numbered DDL files.

chDB through clickhouse-connect (`get_client(interface="chdb", path=DIR)`), as found by trying it
(clickhouse-connect 1.12, chdb-core 26.9):
- one engine directory per process; a second client on the same path shares the engine, a client
  on another path while one is open raises ProgrammingError. Another *process* holding the
  directory makes the open fail with an opaque "Error initializing EmbeddedServer"; the engine
  keeps a flock'ed `status` file (with `PID: n`) there while open, which is how `connect` names
  the holder. Close every client (`client.close()`) so the directory is released.
- `client.database = name` is applied as a handle-level USE, so unqualified names in DDL and
  queries resolve there, as they do with a server's per-request `database`.
- server-side parameters (`{name:Type}` with `parameters=`) and `client.insert(..., column_names=)`
  work as with a server; a NULL for a non-Nullable column fails in the client-side encoder, so
  computed columns (`day`) are DEFAULT expressions and writers leave them out.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ProgrammingError

from gpuledger.config import Settings

log = logging.getLogger(__name__)

MIGRATIONS_TABLE = "schema_migrations"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class WarehouseError(RuntimeError):
    """The warehouse cannot be reached or its schema is not in a state the ledger can use."""


def _identifier(name: str, what: str) -> str:
    if not _IDENTIFIER.match(name):
        raise WarehouseError(f"invalid {what} name {name!r}: letters, digits and _ only")
    return name


# --------------------------------------------------------------------------- connect
def _chdb_holder(path: Path) -> str | None:
    """Who holds a chDB directory: the engine flocks `status` (which names its PID) while open."""
    import fcntl

    status = path / "status"
    try:
        with status.open("rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                text = status.read_text(errors="replace")
                m = re.search(r"PID:\s*(\d+)", text)
                return f"process {m.group(1)}" if m else "another process"
            fcntl.flock(fh, fcntl.LOCK_UN)
    except FileNotFoundError:
        return None
    return None


def _open(settings: Settings, *, create_dir: bool = True):
    """A client on the configured warehouse (nothing created in it)."""
    chdb_dir = settings.embedded_warehouse_dir
    if chdb_dir is not None:
        if create_dir:
            chdb_dir.mkdir(parents=True, exist_ok=True)
        elif not chdb_dir.is_dir():
            raise WarehouseError(f"warehouse not migrated: the embedded warehouse {chdb_dir} does not exist "
                                 "(run `gpuledger migrate`)")
        try:
            client = clickhouse_connect.get_client(interface="chdb", path=str(chdb_dir))
        except ProgrammingError as exc:
            holder = _chdb_holder(chdb_dir)
            if holder:
                raise WarehouseError(
                    f"the embedded warehouse {chdb_dir} is held by {holder}; only one process may open a chDB "
                    "directory at a time (stop it, or point GPULEDGER_WAREHOUSE at another chdb:/dir or a server)"
                ) from exc
            raise WarehouseError(
                f"cannot open the embedded warehouse {chdb_dir}: {exc} (this process may already hold another "
                "chDB directory: one per process)"
            ) from exc
    elif settings.warehouse.startswith(("http://", "https://")):
        try:
            client = clickhouse_connect.get_client(
                dsn=settings.warehouse,
                username=settings.clickhouse_user,
                password=settings.clickhouse_password.get_secret_value(),
            )
        except Exception as exc:
            raise WarehouseError(f"cannot reach ClickHouse at {settings.warehouse}: {exc}") from exc
    else:
        raise WarehouseError(
            f"unknown warehouse {settings.warehouse!r}: use 'chdb', 'chdb:/abs/dir' or http(s)://host:port"
        )
    return client


def connect(settings: Settings):
    """A clickhouse-connect client on the configured warehouse, its current database created if missing."""
    database = _identifier(settings.database, "database")
    client = _open(settings)
    try:
        client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
        client.database = database
    except Exception:
        client.close()
        raise
    return client


def connect_readonly(settings: Settings):
    """A client for readers (reports, `bills list|show|audit`): it never creates anything, so it works
    with a ClickHouse account that has SELECT only. Raises WarehouseError saying to run
    `gpuledger migrate` when the database, the migrations table or a migration is missing."""
    database = _identifier(settings.database, "database")
    client = _open(settings, create_dir=False)
    try:
        try:
            applied = {r[0] for r in client.query(f"SELECT version FROM `{database}`.{MIGRATIONS_TABLE}").result_rows}
        except Exception as exc:
            text = str(exc)
            if any(m in text for m in ("UNKNOWN_DATABASE", "UNKNOWN_TABLE", "does not exist", "doesn't exist")):
                raise WarehouseError(f"warehouse not migrated: database {database!r} has no {MIGRATIONS_TABLE} "
                                     "(run `gpuledger migrate`)") from None
            raise WarehouseError(f"cannot read the warehouse {settings.warehouse}: {text.splitlines()[0] if text else exc!r}") from exc
        pending = [mg.version for mg in load_migrations() if mg.version not in applied]
        if pending:
            raise WarehouseError(f"warehouse not migrated: migration(s) {', '.join(pending)} not applied to "
                                 f"{database!r} (run `gpuledger migrate`)")
        client.database = database
    except Exception:
        client.close()
        raise
    return client


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
            f"{self.checksum[:12]}…; applied migrations must not change (comments may; add a new migration)")

    def statements(self) -> list[str]:
        """Statements end with ';' at the end of a line; comment-only chunks are dropped."""
        out = []
        for chunk in re.split(r";[ \t]*(?:\n|$)", self.sql):
            body = "\n".join(line for line in chunk.splitlines() if not line.strip().startswith("--")).strip()
            if body:
                out.append(chunk.strip())
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
    db = _identifier(database, "database")
    # a re-recorded version has a newer row (see migrate): the latest row of each version wins
    rows = client.query(f"SELECT version, name, checksum, applied_at FROM `{db}`.{MIGRATIONS_TABLE} "
                        "ORDER BY version, applied_at")
    return {r["version"]: r for r in rows.named_results()}


def migrate(client, database: str) -> list[str]:
    """Apply pending migrations in order; returns the versions applied now ([] when up to date).

    Each file is recorded in `schema_migrations` with the sha256 of its SQL (`sql_checksum`: whole-line
    comments left out) after all its statements ran; statements are IF NOT EXISTS, so a file
    interrupted halfway is safe to run again. Refuses to run when the SQL of a file already applied
    has changed: add a new migration. A checksum recorded under the earlier whole-file rule is
    re-recorded (a newer row) under this one."""
    db = _identifier(database, "database")
    client.command(f"CREATE DATABASE IF NOT EXISTS `{db}`")
    previous = client.database
    client.database = db  # unqualified names in the DDL resolve here (USE on chDB)
    try:
        client.command(
            f"CREATE TABLE IF NOT EXISTS `{db}`.{MIGRATIONS_TABLE} "
            "(version String, name String, checksum String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3)) "
            "ENGINE = MergeTree ORDER BY version"
        )
        applied = applied_migrations(client, db)
        migrations = load_migrations()
        earlier = [mg for mg in migrations
                   if mg.version in applied and mg.recorded_as_earlier(applied[mg.version]["checksum"])]
        for mg in earlier:
            log.info("re-recording migration %s_%s under the comment-blind checksum", mg.version, mg.name)
            _record(client, db, mg)
        now: list[str] = []
        for mg in migrations:
            if mg.version in applied:
                continue
            log.info("applying migration %s_%s to %s", mg.version, mg.name, db)
            for statement in mg.statements():
                try:
                    client.command(statement)
                except Exception as exc:
                    raise WarehouseError(f"migration {mg.version}_{mg.name} failed: {exc}") from exc
            _record(client, db, mg)
            now.append(mg.version)
        return now
    finally:
        if previous and previous != db:
            client.database = previous


def _record(client, db: str, mg: Migration) -> None:
    client.insert(MIGRATIONS_TABLE, [[mg.version, mg.name, mg.checksum]], column_names=["version", "name", "checksum"],
                  database=db)


# --------------------------------------------------------------------------- inserts
def insert_rows(
    client,
    table: str,
    rows: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Any]],
    *,
    database: str | None = None,
) -> int:
    """Insert rows given as a list of dicts (every dict with the same keys) or as columns
    ({column: [values...]}); returns the number of rows. Columns left out take their DEFAULT."""
    _identifier(table, "table")
    if isinstance(rows, Mapping):
        names = list(rows)
        columns = [list(rows[n]) for n in names]
        lengths = {len(c) for c in columns}
        if len(lengths) > 1:
            raise ValueError(f"columns of unequal length for {table}: {dict(zip(names, map(len, columns)))}")
        count = lengths.pop() if lengths else 0
        if count:
            client.insert(table, columns, column_names=names, column_oriented=True, database=database)
        return count
    if not rows:
        return 0
    names = list(rows[0])
    expected = set(names)
    data = []
    for i, row in enumerate(rows):
        if row.keys() != expected:
            raise ValueError(f"row {i} for {table} has columns {sorted(row)}; expected {sorted(expected)}")
        data.append([row[n] for n in names])
    client.insert(table, data, column_names=names, database=database)
    return len(data)
