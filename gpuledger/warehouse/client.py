"""The warehouse: one ClickHouse client (clickhouse-connect) for the embedded chDB engine or a server,
and plain inserts (the migrator is in migrations.py).

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

On a ClickHouse cluster (GPULEDGER_CLICKHOUSE_CLUSTER) every client runs with
`distributed_product_mode = 'global'`: the views, reports and bill runs read Distributed tables with
`IN (SELECT ... FROM <another Distributed table>)`, which ClickHouse refuses on 2+ shards under its
default 'deny' (Code 288, "Double-distributed IN/JOIN subqueries is denied"); see cluster.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ProgrammingError

from gpuledger.config import Settings
from gpuledger.warehouse.cluster import DISTRIBUTED_PRODUCT_MODE



log = logging.getLogger(__name__)



_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")



class WarehouseError(RuntimeError):
    """The warehouse cannot be reached or its schema is not in a state the ledger can use."""


def checked_identifier(name: str, what: str) -> str:
    if not _IDENTIFIER.match(name):
        raise WarehouseError(f"invalid {what} name {name!r}: letters, digits and _ only")
    return name


def quoted_database(database: str) -> str:
    """The database name, checked and back-quoted: queries qualify every table with it, so any
    client works whatever its current database."""
    return f"`{checked_identifier(database, 'database')}`"


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


def _open(settings: Settings, *, create_dir: bool = True, writes: bool = True):
    """A client on the configured warehouse (nothing created in it); `writes`: it may insert."""
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
            raise _server_error(settings, exc) from exc
    else:
        raise WarehouseError(
            f"unknown warehouse {settings.warehouse!r}: use 'chdb', 'chdb:/abs/dir' or http(s)://host:port"
        )
    if settings.clickhouse_cluster:
        _cluster_session(client, settings.clickhouse_cluster, writes)
    return client


def shown_url(url: str) -> str:
    """The warehouse URL as messages and logs may show it: a password in it replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"))


def _server_error(settings: Settings, exc: Exception) -> WarehouseError:
    """One line saying why the ClickHouse server cannot be used: a refused login (code 516) is not an
    unreachable server."""
    url = shown_url(settings.warehouse)
    if getattr(exc, "code", None) == 516 or getattr(exc, "name", None) == "AUTHENTICATION_FAILED":
        in_url = urlsplit(settings.warehouse).username
        ignored = (f"; the user {in_url!r} in GPULEDGER_WAREHOUSE is not used"
                   if in_url and in_url != settings.clickhouse_user else "")
        return WarehouseError(f"ClickHouse at {url} refused user {settings.clickhouse_user!r}: authentication failed "
                              "(check GPULEDGER_CLICKHOUSE_USER and GPULEDGER_CLICKHOUSE_PASSWORD or "
                              f"GPULEDGER_CLICKHOUSE_PASSWORD_FILE{ignored})")
    detail = " ".join(str(exc).split()) or repr(exc)
    return WarehouseError(f"cannot reach ClickHouse at {url}: {detail}")


def _cluster_session(client, cluster: str, writes: bool = True) -> None:
    """Session settings for a warehouse on a cluster: IN/JOIN subqueries over Distributed tables run
    once on the initiator (`distributed_product_mode = 'global'`, cluster.py); and a writer's inserts
    through Distributed tables are on the shards when they return (`distributed_foreground_insert = 1`):
    queued on the initiator, the bill close's idle stretches (idle_stretches.refresh) and its version
    rows would be read back before they arrive. A profile that has them already needs nothing; an
    account whose profile forbids changing settings (readonly = 1) and does not set them gets a
    warning: its queries over the views with IN subqueries fail on 2+ shards."""
    wanted = {"distributed_product_mode": DISTRIBUTED_PRODUCT_MODE}
    if writes:
        wanted["distributed_foreground_insert"] = 1
    for name, value in wanted.items():
        try:
            client.set_client_setting(name, value)
        except ProgrammingError as exc:
            log.warning("cluster %s: cannot set %s = %r for this ClickHouse user (%s); "
                        "set it in the user's profile (docs/architecture.md, \"ClickHouse cluster\")",
                        cluster, name, value, exc)


def connect(settings: Settings):
    """A clickhouse-connect client on the configured warehouse, its current database created if missing."""
    database = checked_identifier(settings.database, "database")
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
    # imported here: the migrator imports this module (WarehouseError, checked_identifier)
    from gpuledger.warehouse.migrations import MIGRATIONS_TABLE, load_migrations

    database = checked_identifier(settings.database, "database")
    client = _open(settings, create_dir=False, writes=False)
    try:
        try:
            applied = {r[0] for r in client.query(f"SELECT version FROM `{database}`.{MIGRATIONS_TABLE}").result_rows}
        except Exception as exc:
            text = str(exc)
            if any(m in text for m in ("UNKNOWN_DATABASE", "UNKNOWN_TABLE", "does not exist", "doesn't exist")):
                raise WarehouseError(f"warehouse not migrated: database {database!r} has no {MIGRATIONS_TABLE} "
                                     "(run `gpuledger migrate`)") from None
            raise WarehouseError(f"cannot read the warehouse {shown_url(settings.warehouse)}: "
                                 f"{text.splitlines()[0] if text else exc!r}") from exc
        pending = [mg.version for mg in load_migrations() if mg.version not in applied]
        if pending:
            raise WarehouseError(f"warehouse not migrated: migration(s) {', '.join(pending)} not applied to "
                                 f"{database!r} (run `gpuledger migrate`)")
        client.database = database
    except Exception:
        client.close()
        raise
    return client




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
    checked_identifier(table, "table")
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
