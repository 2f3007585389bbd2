"""A migration's record on a cluster is inserted in the foreground: schema_migrations is then a
Distributed table, whose inserts are otherwise sent later, so a migrate run right after would not see
the record and apply the file again (its back-fills twice). The client here records what it is asked
to do: what is checked is the request the migrator makes, not ClickHouse."""

from gpuledger.warehouse import migrations


class RecordingClient:
    def __init__(self):
        self.inserts = []

    def insert(self, table, rows, **kwargs):
        self.inserts.append((table, rows, kwargs))


def test_the_record_waits_for_the_shard_on_a_cluster_only():
    mg = migrations.load_migrations()[0]
    client = RecordingClient()
    migrations._record(client, "gpuledger", mg, on_cluster=True)
    migrations._record(client, "gpuledger", mg)
    (_, rows, on_cluster), (_, _, single) = client.inserts
    assert rows == [[mg.version, mg.name, mg.checksum]]
    assert on_cluster["settings"] == {"distributed_foreground_insert": 1}
    assert single["settings"] is None
