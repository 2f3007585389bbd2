"""Bad GPULEDGER_* values stop the process with the variable's name and what it takes, never a
traceback or a silent stand-in (docs/configuration.md): an empty optional path is unset (not the
current directory), an empty required name is refused, names that go into topic names, SQL,
file names and Kafka keys are checked where they are read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuledger.config import Settings

OPTIONAL_PATHS = ["ledger_config", "kafka_ssl_cafile", "agent_spool_dir", "slurm_agent_state_file",
                  "kubernetes_state_file", "kubernetes_pod_resources_socket", "kafka_sasl_password_file",
                  "clickhouse_password_file"]


@pytest.mark.parametrize("name", OPTIONAL_PATHS + ["kubernetes_device_endpoint", "kafka_sasl_username"])
def test_an_empty_optional_variable_is_unset(monkeypatch, name):
    # `VAR=${X:-}` in compose or an env file: Path("") would be "." (a spool in the working
    # directory, ssl.ca.location=".", a ledger config "." that is a directory)
    monkeypatch.setenv(f"GPULEDGER_{name.upper()}", "")
    assert getattr(Settings(), name) is None


def test_an_empty_ca_file_sends_no_ca_location(monkeypatch):
    monkeypatch.setenv("GPULEDGER_KAFKA_SSL_CAFILE", "")
    assert "ssl.ca.location" not in Settings().kafka_client_config()


@pytest.mark.parametrize("name", ["kafka_bootstrap", "warehouse", "database", "worker_app_id", "cluster", "data_dir",
                                  "kafka_sasl_mechanism"])
def test_an_empty_required_value_is_refused_by_name(monkeypatch, name):
    monkeypatch.setenv(f"GPULEDGER_{name.upper()}", "")
    with pytest.raises(ValidationError, match=name):
        Settings()


@pytest.mark.parametrize("cluster", [" gpu-east", "gpu-east\n", "gpu\teast", "a/b", "a\\b", "x" * 129])
def test_a_cluster_name_that_breaks_messages_or_files_is_refused(cluster):
    # the agents put it in every message (the wire refuses control characters, surrounding
    # whitespace, > 128 characters) and in their state files and spools (a / is a directory)
    with pytest.raises(ValidationError, match="cluster"):
        Settings(cluster=cluster)


@pytest.mark.parametrize("cluster", ["gpu-east", "prod_a.1", "Cluster 7", "x" * 128])
def test_ordinary_cluster_names_are_accepted(cluster):
    assert Settings(cluster=cluster).cluster == cluster


@pytest.mark.parametrize("prefix", ["bad prefix.", "team/ledger.", "prod:", "é.", "p" * 231])
def test_a_topic_prefix_kafka_cannot_name_topics_with_is_refused(prefix):
    # Kafka topic names are [a-zA-Z0-9._-], at most 249 characters (reclaim-suggestions is 19)
    with pytest.raises(ValidationError, match="topic_prefix"):
        Settings(topic_prefix=prefix)


@pytest.mark.parametrize("prefix", ["", "gpuledger.", "prod.gpu-ledger_2.", "p" * 230])
def test_ordinary_topic_prefixes_are_accepted(prefix):
    settings = Settings(topic_prefix=prefix)
    assert max(len(name) for name in settings.partitions()) <= 249


@pytest.mark.parametrize("database", ["gpu-ledger", "a;DROP TABLE x", "1st", "ledger db"])
def test_a_database_name_sql_cannot_quote_is_refused_at_start(database):
    # refused by the warehouse client only when a command connects, without the variable's name
    with pytest.raises(ValidationError, match="database"):
        Settings(database=database)


def test_an_agent_interval_under_a_millisecond_is_refused_at_start():
    # the tick grid is in whole milliseconds: the GPU agent refuses what rounds to 0 ms
    with pytest.raises(ValidationError, match="agent_interval_s"):
        Settings(agent_interval_s=0.0004)
    assert Settings(agent_interval_s=0.001).agent_interval_s == 0.001


def test_the_cluster_name_bound_is_the_wires():
    from gpuledger.config import MAX_CLUSTER_LEN
    from gpuledger.schemas.models import MAX_CLUSTER_LEN as WIRE_MAX_CLUSTER_LEN

    assert MAX_CLUSTER_LEN == WIRE_MAX_CLUSTER_LEN


@pytest.mark.parametrize("name, value, allowed", [
    ("agent_spool_fsync", "sometimes", "'always', 'interval' or 'never'"),
    ("kubernetes_container_ids", "names", "'runtime' or 'name'"),
])
def test_an_unknown_choice_names_the_allowed_ones(monkeypatch, name, value, allowed):
    # not a regular expression ("String should match pattern '^(always|interval|never)$'")
    monkeypatch.setenv(f"GPULEDGER_{name.upper()}", value)
    with pytest.raises(ValidationError, match=allowed):
        Settings()


@pytest.mark.parametrize("template", [
    "http://{nodename}:9478/pod-resources",  # a KeyError on every node: every GPU pod sent without its GPUs
    "http://{host_ip:9478/pod-resources",     # unbalanced
    "http://reporter:9478/pod-resources",     # one URL for every node
    "{node}:9478/pod-resources",              # no scheme: urllib refuses it on every node
])
def test_a_device_endpoint_template_the_agent_cannot_fill_is_refused(template):
    with pytest.raises(ValidationError, match="kubernetes_device_endpoint"):
        Settings(kubernetes_device_endpoint=template)


@pytest.mark.parametrize("template", ["http://{host_ip}:9478/pod-resources", "https://{node}.nodes.example/pr",
                                      "http://{node}-{host_ip}/x"])
def test_documented_device_endpoint_templates_are_accepted(template):
    assert Settings(kubernetes_device_endpoint=template).kubernetes_device_endpoint == template


def test_a_sasl_mechanism_is_one_both_kafka_clients_know_in_any_case():
    # Faust (the worker) refused 'scram-sha-512' with a bare ValueError at start; a typo reached the brokers
    assert Settings(kafka_sasl_mechanism="scram-sha-512").kafka_sasl_mechanism == "SCRAM-SHA-512"
    assert Settings(kafka_sasl_mechanism=" plain ").kafka_sasl_mechanism == "PLAIN"
    with pytest.raises(ValidationError, match="kafka_sasl_mechanism(.|\n)*SCRAM-SHA-512"):
        Settings(kafka_sasl_mechanism="SCRAM-SHA512")


def test_every_optional_setting_takes_empty_as_unset():
    """A new optional field joins OPTIONAL_FIELDS (the SASL password: empty is no password, as before)."""
    from gpuledger.config import OPTIONAL_FIELDS

    optional = {name for name, f in Settings.model_fields.items() if f.default is None} - {"kafka_sasl_password"}
    assert optional == set(OPTIONAL_FIELDS)


def test_a_dead_letter_larger_than_the_producers_can_send_is_refused(monkeypatch):
    """The worker's and sink's producers keep their clients' 1 MB message limit: a letter set larger was
    refused by the producer at once (MSG_SIZE_TOO_LARGE), and the sink stopped on it."""
    monkeypatch.setenv("GPULEDGER_DEAD_LETTER_MAX_BYTES", "2000000")
    with pytest.raises(ValidationError, match="less than or equal to 990000"):
        Settings()
    monkeypatch.setenv("GPULEDGER_DEAD_LETTER_MAX_BYTES", "990000")
    assert Settings().dead_letter_max_bytes == 990_000


def test_an_embedded_warehouse_without_its_directory_is_refused(monkeypatch):
    # 'chdb:' resolved to the working directory, as an empty DATA_DIR would
    monkeypatch.setenv("GPULEDGER_WAREHOUSE", "chdb:")
    with pytest.raises(ValidationError, match=r"(?s)warehouse.*'chdb:' must name a directory.*got 'chdb:'"):
        Settings()
    assert Settings(warehouse="chdb:/srv/ledger").embedded_warehouse_dir.name == "ledger"


@pytest.mark.parametrize("kind", ["input", "output", "diagnostics"])
def test_a_topic_retention_kafka_cannot_hold_is_refused_at_start(monkeypatch, kind):
    # 1e12 days is a retention.ms beyond Kafka's long: refused by the broker at `topics create`, not here
    monkeypatch.setenv(f"GPULEDGER_TOPIC_RETENTION_{kind.upper()}_DAYS", "1e12")
    with pytest.raises(ValidationError, match=f"topic_retention_{kind}_days"):
        Settings()
