"""One frozen settings object, read from the environment (GPULEDGER_*) at the edge only.

Every environment variable the ledger reads is a field here; docs/configuration.md lists them."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATA_DIR = Path(".gpuledger")


class Topics:
    """Topic names, all under one configurable prefix."""

    def __init__(self, prefix: str):
        self.gpu_samples = f"{prefix}gpu-samples"
        self.job_events = f"{prefix}job-events"
        self.scheduler_snapshots = f"{prefix}scheduler-snapshots"
        self.node_allocations = f"{prefix}node-allocations"  # internal: lifecycle re-keyed by node
        self.usage = f"{prefix}usage"
        self.dead_letters = f"{prefix}dead-letters"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULEDGER_", frozen=True, extra="ignore")

    # --- Kafka
    kafka_bootstrap: str = Field("localhost:9092", description="Kafka bootstrap servers, host:port[,host:port]")
    kafka_security_protocol: str = Field("PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    kafka_sasl_mechanism: str = Field("PLAIN", description="SASL mechanism when SASL is used")
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = None
    topic_prefix: str = Field("gpuledger.", description="prefix of every topic name")
    replication_factor: int = Field(1, ge=1)
    partitions_gpu_samples: int = Field(8, ge=1, description="partitions of the GPU-sample topic (and of the internal node-allocations topic)")
    partitions_job_events: int = Field(4, ge=1)
    partitions_scheduler_snapshots: int = Field(1, ge=1)
    partitions_usage: int = Field(8, ge=1)
    partitions_dead_letters: int = Field(1, ge=1)

    # --- Warehouse
    warehouse: str = Field("chdb", description="'chdb' (embedded, in DATA_DIR/chdb), 'chdb:/abs/dir', or http(s)://host:port of a ClickHouse server")
    database: str = Field("gpuledger", description="ClickHouse database")
    clickhouse_user: str = "default"
    clickhouse_password: SecretStr = SecretStr("")
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="embedded broker/warehouse data and worker state")

    # --- Accounting
    ledger_config: Path | None = Field(None, description="TOML file with definitions, prices and coefficients (default: the bundled one)")

    # --- Worker / agent
    worker_app_id: str = Field("gpuledger-worker", description="Faust application id (consumer group)")
    worker_rebalance_timeout_s: float = Field(10.0, gt=0, description="consumer-group rebalance timeout of worker and sink, seconds")
    agent_interval_s: float = Field(5.0, gt=0, description="GPU agent sampling interval, seconds")
    cluster: str = Field("default", description="cluster name the agent reports")

    @cached_property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    def partitions(self) -> dict[str, int]:
        """Every topic the ledger needs, with its partition count."""
        t = self.topics
        return {
            t.gpu_samples: self.partitions_gpu_samples,
            t.job_events: self.partitions_job_events,
            t.scheduler_snapshots: self.partitions_scheduler_snapshots,
            t.node_allocations: self.partitions_gpu_samples,  # co-partitioned with gpu-samples
            t.usage: self.partitions_usage,
            t.dead_letters: self.partitions_dead_letters,
        }

    def kafka_client_config(self) -> dict[str, str]:
        """librdkafka (confluent-kafka) client keys."""
        conf = {"bootstrap.servers": self.kafka_bootstrap, "security.protocol": self.kafka_security_protocol}
        if self.kafka_security_protocol.startswith("SASL"):
            conf["sasl.mechanism"] = self.kafka_sasl_mechanism
            if self.kafka_sasl_username:
                conf["sasl.username"] = self.kafka_sasl_username
            if self.kafka_sasl_password:
                conf["sasl.password"] = self.kafka_sasl_password.get_secret_value()
        if self.kafka_ssl_cafile:
            conf["ssl.ca.location"] = str(self.kafka_ssl_cafile)
        return conf

    @property
    def embedded_warehouse_dir(self) -> Path | None:
        """Directory of the embedded chDB engine, or None when a server is configured."""
        if self.warehouse == "chdb":
            return (self.data_dir / "chdb").resolve()
        if self.warehouse.startswith("chdb:"):
            return Path(self.warehouse[len("chdb:"):]).resolve()
        return None


def load_settings(**overrides) -> Settings:
    return Settings(**overrides)
