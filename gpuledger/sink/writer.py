"""Writing one table's block to ClickHouse, and telling errors that retrying can never fix from transient ones.
"""

from __future__ import annotations

import logging
import re
import struct
from typing import Protocol

from clickhouse_connect.driver.exceptions import DataError





log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- error classes
#: ClickHouse error codes that the same block can never get past (retrying it is pointless):
#: CANNOT_PARSE_* (6, 26, 27, 38, 41, 72), BAD_ARGUMENTS (36), ILLEGAL_TYPE_OF_ARGUMENT (43),
#: ILLEGAL_COLUMN (44), TYPE_MISMATCH (53), ARGUMENT_OUT_OF_BOUND (69), CANNOT_CONVERT_TYPE (70),
#: TOO_LARGE_STRING_SIZE (131), TOO_MANY_PARTITIONS for one INSERT block (252),
#: VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE (321), CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN (349),
#: DECIMAL_OVERFLOW (407). Unknown tables/columns (a migration not applied yet) stay transient.
PERMANENT_CODES = frozenset({6, 26, 27, 36, 38, 41, 43, 44, 53, 69, 70, 72, 131, 252, 321, 349, 407})
_CODE = re.compile(r"Code:\s*(\d+)")


def error_code(exc: BaseException) -> int | None:
    """The ClickHouse error code of an exception (clickhouse-connect's `code`, or "Code: NNN" in the
    text, as chDB's errors carry it), or None."""
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    m = _CODE.search(str(exc))
    return int(m.group(1)) if m else None


def is_permanent(exc: BaseException) -> bool:
    """An insert error the same rows can never get past: a data error by its ClickHouse code, or a
    value the client cannot even serialize. Anything else (the warehouse down, a timeout, a schema
    not migrated yet) is transient and retried."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return False
    code = error_code(exc)
    if code is not None:
        return code in PERMANENT_CODES
    # clickhouse-connect raises the serializer's own error (struct.error for an integer outside its
    # column, OverflowError, TypeError) as its DataError, `from` it; retried, such a block would stall
    # the sink for ever (an Xid of -1 did)
    if isinstance(exc, DataError):
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, _UNSERIALIZABLE):
            return True
        seen.add(id(exc))
        exc = exc.__cause__
    return False


#: what a value the client cannot serialize raises (directly, or as the cause of a client error)
_UNSERIALIZABLE = (OverflowError, struct.error, TypeError, UnicodeError)


class PermanentWriteError(Exception):
    """A block's insert failed with an error that can never succeed (see `is_permanent`)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


# --------------------------------------------------------------------------- sink abstraction
class Writer(Protocol):
    """A sink backend: writes one table's block, or raises (the block is then retried). `token`
    identifies the block: a backend that sees the same token again must not store it twice."""

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None: ...


class ClickHouseWriter:
    def __init__(self, client, database: str):
        self.client = client
        self.database = database

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        # A backlog or a rebuild from the input topics can put more than ClickHouse's default 100
        # partitions in one block (gpu_health has one a day, sql/0034); refused, the block would be
        # retried for ever and stall the sink.
        settings: dict = {"max_partitions_per_insert_block": 0}
        if token is not None:
            settings |= {"insert_deduplication_token": token, "insert_deduplicate": 1,
                         "deduplicate_blocks_in_dependent_materialized_views": 1}
        insert_block(self.client, table, rows, self.database, settings)


def insert_block(client, table: str, rows: list[dict], database: str, settings: dict | None = None) -> None:
    """One INSERT of rows given as dicts with the same keys (one block: one dedup token)."""
    if not rows:
        return
    names = list(rows[0])
    client.insert(table, [[row[n] for n in names] for row in rows], column_names=names, database=database,
                  settings=settings)


class StoredHealth:
    """`BatchingSink.stored_health` on ClickHouse: which of a block's gpu_health samples (cluster, node,
    GPU, ts_ms) the table already holds from messages outside the block's own offset range. gpu_health
    itself is the record (it survives restarts; nothing else to keep). The lookup reads the block's GPUs
    over its time span by the table's sorting key (cluster, gpu_uuid, ts_ms), `gpus_per_query` GPUs at
    a time, and matches the exact samples here: the query's parameters stay small (a server takes them
    in the URL, which it caps at 1 MiB by default), and so does its answer (normally only the copies)."""

    def __init__(self, client, database: str, table: str = "gpu_health", gpus_per_query: int = 500):
        self.client, self.database, self.table, self.gpus_per_query = client, database, table, gpus_per_query

    def __call__(self, rows: list[dict], key: tuple[str, int], start: int, end: int) -> set[tuple]:
        samples = {(r["cluster"], r["node"], r["gpu_uuid"], r["ts_ms"]) for r in rows}
        if not samples:
            return set()
        lo, hi = min(s[3] for s in samples), max(s[3] for s in samples)
        gpus = sorted({(s[0], s[2]) for s in samples})
        stored = set()
        for i in range(0, len(gpus), self.gpus_per_query):
            chunk = gpus[i:i + self.gpus_per_query]
            result = self.client.query(
                f"SELECT cluster, toString(node), gpu_uuid, ts_ms FROM `{self.database}`.{self.table} "
                "WHERE cluster IN {clusters:Array(String)} AND gpu_uuid IN {gpus:Array(String)} "
                "AND ts_ms BETWEEN {lo:Int64} AND {hi:Int64} "
                # the block's own range: a pending block rebuilt after a crash may be partly in already
                "AND NOT (kafka_topic = {topic:String} AND kafka_partition = {partition:Int32} "
                "AND kafka_offset >= {start:Int64} AND kafka_offset < {end:Int64})",
                parameters={"clusters": sorted({c for c, _ in chunk}), "gpus": [g for _, g in chunk], "lo": lo,
                            "hi": hi, "topic": key[0], "partition": key[1], "start": start, "end": end})
            stored.update(t for t in map(tuple, result.result_rows) if t in samples)
        return stored
