"""The cluster rendering (GPULEDGER_CLICKHOUSE_CLUSTER, gpuledger/warehouse/cluster.py) *applied*, in
migration order, on an in-process ClickHouse cluster of 2 shards: chDB with a `remote_servers` config
(both shards this process). No Keeper here, so Replicated engines are turned back into plain ones and
ON CLUSTER is dropped; everything else runs as rendered. Only 2+ shards show ClickHouse's
"Double-distributed IN/JOIN subqueries is denied" (distributed_product_mode = 'deny', Code 288) and
the unresolved `t.col` of a back-fill read through a Distributed table (Code 47).

chDB takes one engine directory and config per process, so each check runs in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """<clickhouse>
  <tcp_port>9000</tcp_port>
  <remote_servers>
    <two>
      <shard><replica><host>localhost</host><port>9000</port></replica></shard>
      <shard><replica><host>127.0.0.1</host><port>9000</port></replica></shard>
    </two>
  </remote_servers>
</clickhouse>
"""

APPLY = r"""
import json, re, sys
import chdb
from gpuledger.warehouse import bills, migrations
from gpuledger.warehouse.cluster import ClusterRenderer, _tsv_escape

workdir, config = sys.argv[1], sys.argv[2]
conn = chdb.connect(f"file:{workdir}/chdb?config-file={config}")
cur = conn.cursor()

def fmt(sql):
    return conn.query("SELECT formatQuery({q:String})", "TSVRaw", params={"q": _tsv_escape(sql)}).bytes().decode()

def no_keeper(sql):
    sql = re.sub(r"Replicated(\w*MergeTree)\('/clickhouse/tables/\{shard\}/\{database\}/\{table\}', "
                 r"'\{replica\}'(?:, )?", r"\1(", sql)
    sql = sql.replace(" ON CLUSTER two", "")
    return re.sub(r"\breplicated_deduplication_window", "non_replicated_deduplication_window", sql)

out = {"shards": None, "statements": 0, "failed": [], "views": [], "views_failed": [], "report": None}
cur.execute("SELECT count() FROM system.clusters WHERE cluster = 'two'")
out["shards"] = cur.fetchall()[0][0]
cur.execute("CREATE DATABASE gpuledger")
cur.execute("USE gpuledger")
renderer = ClusterRenderer("two", "gpuledger", fmt)
for mg in migrations.load_migrations():
    for statement in mg.statements():
        for sql in renderer.render(statement):
            out["statements"] += 1
            try:
                cur.execute(no_keeper(sql))
            except Exception as exc:
                out["failed"].append(f"[{mg.version}] {sql.splitlines()[0]} :: {str(exc)[:200]}")

mode = sys.argv[3]
if mode:
    cur.execute(f"SET distributed_product_mode = '{mode}'")
cur.execute("SELECT name, create_table_query FROM system.tables WHERE database = 'gpuledger' AND engine = 'View' "
            "ORDER BY name")
for name, create in cur.fetchall():
    if "{" in create:  # parameterized view: read with its parameters, not here
        continue
    out["views"].append(name)
    try:
        cur.execute(f"SELECT * FROM gpuledger.{name} LIMIT 1")
        cur.fetchall()
    except Exception as exc:
        out["views_failed"].append(f"{name} :: {str(exc)[:200]}")
# the bill close's open days (bills.open_days_sql: NOT IN subqueries over Distributed tables) as the
# IN filter of a read of usage_raw, as the close and the reports use it
cur.execute("INSERT INTO gpuledger.usage_capacity_daily (cluster, day) SELECT 'c1', toDate('2024-01-02')")
try:
    cur.execute(f"SELECT count() FROM gpuledger.usage_raw WHERE (cluster, day) IN ({bills.open_days_sql('gpuledger')})")
    out["report"] = cur.fetchall()[0][0]
except Exception as exc:
    out["report"] = f"ERROR {str(exc)[:200]}"
print("RESULT " + json.dumps(out))
"""

SESSION = r"""
import json, sys
from gpuledger.config import Settings
from gpuledger.warehouse.client import connect
out = {}
for name, cluster in (("single", ""), ("cluster", "ledger")):
    client = connect(Settings(warehouse=f"chdb:{sys.argv[1]}/{name}", clickhouse_cluster=cluster))
    try:
        out[name] = list(client.query("SELECT getSetting('distributed_product_mode'), "
                                      "toString(getSetting('distributed_foreground_insert'))").result_rows[0])
    finally:
        client.close()
print("RESULT " + json.dumps(out))
"""


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def _apply(tmp_path: Path, mode: str) -> dict:
    config = tmp_path / "cluster.xml"
    config.write_text(CONFIG)
    return _run(APPLY, str(tmp_path), str(config), mode)


def test_every_rendered_migration_applies_on_two_shards_and_reads_with_global_in(tmp_path):
    out = _apply(tmp_path, "global")
    assert out["shards"] == 2
    assert out["statements"] > 200
    # back-fills with IN subqueries (0023, 0028, 0037) and with t.col (0018) included
    assert out["failed"] == [], "\n".join(out["failed"])
    # the views with IN subqueries (job_idle_stretches, tenant_daily_carbon, ...) read through
    # Distributed tables with the ledger clients' setting
    assert "job_idle_stretches" in out["views"]
    assert out["views_failed"] == [], "\n".join(out["views_failed"])
    assert isinstance(out["report"], int), out["report"]


def test_ledger_clients_set_global_in_only_on_a_cluster(tmp_path):
    """And a writer's inserts through Distributed tables wait for the shards on a cluster (the bill
    close reads its idle stretches back right after inserting them); one server keeps the defaults."""
    assert _run(SESSION, str(tmp_path)) == {"single": ["deny", "false"], "cluster": ["global", "true"]}
