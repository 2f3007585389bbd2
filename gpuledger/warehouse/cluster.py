"""Rendering the migrations for a ClickHouse cluster (GPULEDGER_CLICKHOUSE_CLUSTER; docs/architecture.md,
"Production layout"). Pure: SQL text in, SQL text out.

Every statement is first parsed and printed back by ClickHouse's own parser (`formatQuery`), whose
canonical text (one clause per line, one column per line) is what the rules below edit; each rendered
statement is parsed again, so a rendering ClickHouse cannot read never leaves this module.

  CREATE TABLE t [AS u]    -> t_local ON CLUSTER [AS u_local], Replicated* engine ('/clickhouse/tables/
                              {shard}/{database}/{table}', '{replica}'), replicated_deduplication_window;
                              and t ON CLUSTER AS t_local ENGINE = Distributed(cluster, db, t_local, key)
  CREATE MATERIALIZED VIEW -> ON CLUSTER, TO t_local, reading its source's t_local: a view fires on the
                              shard that stores the rows, so aggregates are built where the rows are
  CREATE [OR REPLACE] VIEW -> ON CLUSTER, over the Distributed tables (unchanged body)
  ALTER TABLE t            -> ON CLUSTER, on t_local; column changes also on t (Distributed);
                              non_replicated_deduplication_window becomes replicated_deduplication_window
  ALTER TABLE mv MODIFY QUERY -> ON CLUSTER, reading the source's t_local
  INSERT ... SELECT        -> run once, through the Distributed tables (back-fills), with
                              distributed_foreground_insert = 1: the rows are on the shards when
                              it returns, not queued, so a rebuild's EXCHANGE and DROP that follow
                              cannot leave them in the table being dropped; and with
                              distributed_product_mode = 'global': an IN (SELECT ... FROM t) over a
                              Distributed t inside a query reading a Distributed table (0023, 0028,
                              0037) is otherwise refused on 2+ shards (Code 288); 'global' runs the
                              subquery once on the initiator and sends its result to every shard
                              ('local' would be wrong: the IN keys are not co-sharded). A source t
                              whose columns the SELECT qualifies (t.col, sql/0018) is read as
                              `FROM t AS t`: without the alias the query sent to the shards reads
                              t_local and cannot resolve t.col (Code 47)
  TRUNCATE TABLE IF EXISTS t -> ON CLUSTER, t_local (a rebuild's copy starts empty: sql/0034)
  EXCHANGE TABLES a AND b  -> ON CLUSTER, of a_local and b_local (the Distributed tables name the
                              locals, so they follow); a table rebuild (sql/0022, sql/0034)
  DROP TABLE IF EXISTS t [SYNC] -> ON CLUSTER, t (Distributed) then t_local

Views and reports read the Distributed tables; every view over an aggregate groups again, so partial
aggregates of one key on several shards add up (the sharding keys below keep most keys on one shard).
"""

from __future__ import annotations

import re
from typing import Callable

#: Sharding key of each table's Distributed table. Usage and health rows go by GPU, so a GPU's
#: records, its latest state and its idle segments live on one shard; job events and per-job
#: aggregates go by job. Tables not named here shard by a hash of their sorting key, which keeps
#: the rows a ReplacingMergeTree or AggregatingMergeTree folds together on one shard.
SHARDING_KEYS: dict[str, str] = {
    "usage_raw": "cityHash64(gpu_uuid)",
    # sql/0022's rebuild of usage_raw: copied rows land on the shard usage_raw keeps them on
    "usage_raw_by_day": "cityHash64(gpu_uuid)",
    "gpu_health": "cityHash64(gpu_uuid)",
    # sql/0034's rebuild of gpu_health, likewise
    "gpu_health_by_day": "cityHash64(gpu_uuid)",
    "gpu_latest": "cityHash64(gpu_uuid)",
    "gpu_health_hourly": "cityHash64(gpu_uuid)",
    "usage_gpu_5m": "cityHash64(gpu_uuid)",
    "usage_gpu_hourly": "cityHash64(gpu_uuid)",
    "job_idle_segments": "cityHash64(gpu_uuid)",
    "gpu_down_records": "cityHash64(gpu_uuid)",
    "idle_stretches_daily": "cityHash64(gpu_uuid)",
    "job_events": "cityHash64(cluster, job_id)",
    "job_attempts_state": "cityHash64(cluster, job_id)",
    "job_gpu_usage": "cityHash64(cluster, job_id)",
    "job_util_buckets": "cityHash64(cluster, job_id)",
    "usage_by_job_daily": "cityHash64(cluster, job_id)",
    "usage_by_job_hourly": "cityHash64(cluster, job_id)",
    "node_inventory": "cityHash64(cluster, node)",
    "usage_node_5m": "cityHash64(cluster, node)",
}

LOCAL_SUFFIX = "_local"
REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"

Formatter = Callable[[str], str]


class RenderError(ValueError):
    """A statement the cluster rendering does not know how to handle, or ClickHouse cannot parse."""


def chdb_formatter() -> Formatter:
    """formatQuery of the embedded engine (chDB). Use it in a process that holds no chDB directory;
    elsewhere pass `server_formatter(client)`."""
    import chdb

    def fmt(sql: str) -> str:
        return chdb.query("SELECT formatQuery({q:String})", "TSVRaw", params={"q": _tsv_escape(sql)}).bytes().decode()
    return fmt


def server_formatter(client) -> Formatter:
    """formatQuery of the warehouse the client is connected to (a server, or this process's chDB)."""
    def fmt(sql: str) -> str:
        return client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows[0][0]
    return fmt


def _tsv_escape(text: str) -> str:
    # chDB reads query parameters as TSV-escaped values
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def _ident(name: str) -> str:
    return name.strip("`")


def sharding_key(table: str, order_by: str | None) -> str:
    if table in SHARDING_KEYS:
        return SHARDING_KEYS[table]
    if order_by:
        inner = order_by.strip()
        if inner.startswith("(") and inner.endswith(")"):
            inner = inner[1:-1]
        return f"cityHash64({inner})"
    return "rand()"


_CREATE_TABLE = re.compile(r"^CREATE TABLE (IF NOT EXISTS )?(`?\w+`?)(?: AS (`?\w+`?))?\n")
_CREATE_MV = re.compile(r"^CREATE MATERIALIZED VIEW (IF NOT EXISTS )?(`?\w+`?) TO (`?\w+`?)\n")
_CREATE_VIEW = re.compile(r"^CREATE (OR REPLACE )?VIEW (IF NOT EXISTS )?(`?\w+`?)\n")
_ALTER = re.compile(r"^ALTER TABLE (`?\w+`?)\n")
_ENGINE = re.compile(r"^ENGINE = (\w*)MergeTree(?:\((.*)\))?$", re.MULTILINE)
_ORDER_BY = re.compile(r"^ORDER BY (.+)$", re.MULTILINE)
_EXCHANGE = re.compile(r"^EXCHANGE TABLES (`?\w+`?) AND (`?\w+`?)$")
_DROP_TABLE = re.compile(r"^DROP TABLE IF EXISTS (`?\w+`?)( SYNC)?$")
_TRUNCATE = re.compile(r"^TRUNCATE TABLE IF EXISTS (`?\w+`?)$")
#: IN / JOIN subqueries over Distributed tables inside a query over a Distributed table: run the
#: subquery once on the initiator and send its result to the shards. The ledger's own clients set it
#: when a cluster is configured (client.py); readers' profiles must too (docs/architecture.md).
DISTRIBUTED_PRODUCT_MODE = "global"
#: an INSERT ... SELECT through Distributed tables returns once every shard has its rows, and may
#: use IN subqueries over Distributed tables
_INSERT_SETTINGS = f"distributed_foreground_insert = 1, distributed_product_mode = '{DISTRIBUTED_PRODUCT_MODE}'"
_FROM = re.compile(r"\bFROM (`?\w+`?)")


class ClusterRenderer:
    """Renders statements for cluster `cluster` and database `database`; keeps, across the statements
    of all migrations in order, which names are tables (they get a _local twin) and which are views."""

    def __init__(self, cluster: str, database: str, formatter: Formatter):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", cluster):
            raise RenderError(f"cluster name {cluster!r}: letters, digits, '_' and '-' only")
        self.cluster = cluster
        self.database = database
        self.fmt = formatter
        self.tables: set[str] = set()
        self.materialized_views: set[str] = set()

    def _on_cluster(self) -> str:
        return f"ON CLUSTER `{self.cluster}`"

    def parse(self, sql: str) -> str:
        try:
            return self.fmt(sql).strip()
        except Exception as exc:
            raise RenderError(f"ClickHouse cannot parse: {exc}\n{sql}") from exc

    def render(self, statement: str) -> list[str]:
        canonical = self.parse(statement)
        if m := _CREATE_TABLE.match(canonical):
            out = self._table(canonical, m)
        elif m := _CREATE_MV.match(canonical):
            out = self._materialized_view(canonical, m)
        elif m := _CREATE_VIEW.match(canonical):
            head = m.group(0).rstrip("\n")
            out = [f"{head} {self._on_cluster()}\n{canonical[m.end():]}"]
        elif m := _ALTER.match(canonical):
            out = self._alter(canonical, m)
        elif canonical.startswith("INSERT INTO "):
            out = [self._insert(canonical)]
        elif m := _EXCHANGE.match(canonical):
            out = [self._exchange(*(_ident(g) for g in m.groups()))]
        elif m := _DROP_TABLE.match(canonical):
            out = self._drop(_ident(m.group(1)), m.group(2) or "")
        elif m := _TRUNCATE.match(canonical):
            name = _ident(m.group(1))
            self._known_table(name, "TRUNCATE TABLE")
            out = [f"TRUNCATE TABLE IF EXISTS `{name}{LOCAL_SUFFIX}` {self._on_cluster()}"]
        else:
            raise RenderError(f"no cluster rendering for statement:\n{canonical}")
        # every rendered statement must parse; what is returned is ClickHouse's own text of it
        return [self.parse(sql) for sql in out]

    def _table(self, canonical: str, m: re.Match) -> list[str]:
        name = _ident(m.group(2))
        if_not = m.group(1) or ""
        engine = _ENGINE.search(canonical)
        if engine is None:
            raise RenderError(f"table {name}: only *MergeTree engines are rendered for a cluster")
        kind, args = engine.group(1), engine.group(2)
        if kind.startswith("Replicated"):
            raise RenderError(f"table {name} is already replicated")
        replicated = f"ENGINE = Replicated{kind}MergeTree({REPLICA_PATH}{', ' + args if args else ''})"
        body = canonical[m.end():]
        body = _ENGINE.sub(lambda _: replicated, body, count=1)
        body = body.replace("non_replicated_deduplication_window", "replicated_deduplication_window")
        like = ""  # CREATE TABLE t AS u (u's columns): t_local takes u_local's
        if m.group(3):
            source = _ident(m.group(3))
            self._known_table(source, f"CREATE TABLE {name} AS")
            like = f" AS `{source}{LOCAL_SUFFIX}`"
        local = f"CREATE TABLE {if_not}`{name}{LOCAL_SUFFIX}` {self._on_cluster()}{like}\n{body}"
        order = _ORDER_BY.search(canonical)
        key = sharding_key(name, order.group(1) if order else None)
        dist = (f"CREATE TABLE {if_not}`{name}` {self._on_cluster()} AS `{name}{LOCAL_SUFFIX}`\n"
                f"ENGINE = Distributed(`{self.cluster}`, `{self.database}`, `{name}{LOCAL_SUFFIX}`, {key})")
        self.tables.add(name)
        return [local, dist]

    def _insert(self, canonical: str) -> str:
        canonical = self._alias_qualified_sources(canonical)
        # the SELECT's trailing SETTINGS apply to the whole INSERT (formatQuery prints them on both)
        body, _, last = canonical.rpartition("\n")
        if last.startswith("SETTINGS "):
            return f"{body}\n{last}, {_INSERT_SETTINGS}"
        return f"{canonical}\n SETTINGS {_INSERT_SETTINGS}"

    def _alias_qualified_sources(self, sql: str) -> str:
        """`FROM t` -> `FROM t AS t` for every table t (a Distributed table here) whose columns the
        statement qualifies as `t.col`: the query a Distributed table sends to its shards names
        t_local, and an unaliased `t.col` no longer resolves there (Code 47, sql/0018's back-fills).
        The alias keeps the qualifier bound; on one server it changes nothing."""
        for table in sorted(self.tables):
            if not re.search(rf"(?<![\w.`])`?{table}`?\.", sql):
                continue
            sql = re.sub(rf"\b(FROM|JOIN) `?{table}`?(?![\w`.])(?! AS )", rf"\1 `{table}` AS `{table}`", sql)
        return sql

    def _known_table(self, name: str, what: str) -> None:
        if name not in self.tables:
            raise RenderError(f"{what} {name}: not a table of these migrations")

    def _exchange(self, a: str, b: str) -> str:
        self._known_table(a, "EXCHANGE TABLES")
        self._known_table(b, "EXCHANGE TABLES")
        return f"EXCHANGE TABLES `{a}{LOCAL_SUFFIX}` AND `{b}{LOCAL_SUFFIX}` {self._on_cluster()}"

    def _drop(self, name: str, sync: str) -> list[str]:
        self._known_table(name, "DROP TABLE")
        self.tables.discard(name)
        return [f"DROP TABLE IF EXISTS `{name}` {self._on_cluster()}{sync}",
                f"DROP TABLE IF EXISTS `{name}{LOCAL_SUFFIX}` {self._on_cluster()}{sync}"]

    def _local_source(self, select: str) -> str:
        """The first FROM of a materialized view's query, and its qualified column references, read the
        local table (the view fires on inserts into it)."""
        f = _FROM.search(select)
        if f is None:
            raise RenderError(f"materialized view without FROM:\n{select}")
        source = _ident(f.group(1))
        if source not in self.tables:
            raise RenderError(f"materialized view reads {source}, which is not a table of these migrations")
        return re.sub(rf"(?<![\w.`])`?{source}`?(?=\.|\s|$|\))", f"`{source}{LOCAL_SUFFIX}`", select)

    def _materialized_view(self, canonical: str, m: re.Match) -> list[str]:
        name, target = _ident(m.group(2)), _ident(m.group(3))
        if target not in self.tables:
            raise RenderError(f"materialized view {name} writes to {target}, which is not a table of these migrations")
        self.materialized_views.add(name)
        select = self._local_source(canonical[m.end():])
        return [f"CREATE MATERIALIZED VIEW {m.group(1) or ''}`{name}` {self._on_cluster()} "
                f"TO `{target}{LOCAL_SUFFIX}`\n{select}"]

    def _alter(self, canonical: str, m: re.Match) -> list[str]:
        name = _ident(m.group(1))
        body = canonical[m.end():]
        if name in self.materialized_views:
            if "MODIFY QUERY" not in body:
                raise RenderError(f"ALTER of materialized view {name}: only MODIFY QUERY is rendered")
            return [f"ALTER TABLE `{name}` {self._on_cluster()}\n{self._local_source(body)}"]
        if name not in self.tables:
            raise RenderError(f"ALTER TABLE {name}: not a table of these migrations")
        local_body = body.replace("non_replicated_deduplication_window", "replicated_deduplication_window")
        out = [f"ALTER TABLE `{name}{LOCAL_SUFFIX}` {self._on_cluster()}\n{local_body}"]
        # a Distributed table carries the columns too (no settings, no TTL)
        if re.search(r"\((?:ADD|MODIFY|DROP|RENAME) COLUMN ", body):
            out.append(f"ALTER TABLE `{name}` {self._on_cluster()}\n{body}")
        return out


def render_statements(statements: list[str], cluster: str | None, database: str,
                      formatter: Formatter | None = None) -> list[str]:
    """All statements (every migration's, in order) for one server (cluster None: unchanged) or for a cluster."""
    if not cluster:
        return list(statements)
    renderer = ClusterRenderer(cluster, database, formatter or chdb_formatter())
    return [sql for statement in statements for sql in renderer.render(statement)]
