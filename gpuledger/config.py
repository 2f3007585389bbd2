"""One frozen settings object, read from the environment (GPULEDGER_*) at the edge only.

Every environment variable the ledger reads is a field here; docs/configuration.md lists them."""

from __future__ import annotations

import dataclasses
import re
import string
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuledger.streams.checks import CLOCK_AHEAD_MS, MAX_AHEAD_MS
from gpuledger.streams.topic_names import TopicNames

DEFAULT_DATA_DIR = Path(".gpuledger")
#: GPULEDGER_KAFKA_SECURITY_PROTOCOL values (any case; stored upper-case: the SASL settings are sent
#: only for SASL_*, so a lower-case value must not drop them)
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
#: GPULEDGER_KAFKA_SASL_MECHANISM values (any case; stored upper-case): those librdkafka and Faust both take
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER")
#: the shortest topic retention, days (an hour): a smaller one would round to retention.ms=0
MIN_TOPIC_RETENTION_DAYS = 1 / 24
#: the longest table retention, days (50 years; 0 keeps rows for ever): a TTL is a ClickHouse Date, which
#: ends on 2149-06-06 and wraps round to 1970 past it, so a longer one would drop every row at once
MAX_RETENTION_DAYS = 50 * 365
#: Kafka's topic names: these characters, at most 249 of them; the prefix leaves room for the longest name
TOPIC_NAME_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")
MAX_TOPIC_PREFIX_LEN = 249 - max(len(name) for name in dataclasses.astuple(TopicNames.with_prefix("")))
#: a ClickHouse identifier, as gpuledger.warehouse.client.checked_identifier takes it (every query names the database)
DATABASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: schemas.models.MAX_CLUSTER_LEN (not imported: a report's command line does not load the models)
MAX_CLUSTER_LEN = 128
#: optional settings an empty variable leaves unset (`VAR=${X:-}` in compose or an env file): an empty
#: path would be Path("") = "." (a spool in the working directory, ssl.ca.location=".")
OPTIONAL_FIELDS = ("kafka_sasl_username", "kafka_sasl_password_file", "kafka_ssl_cafile", "clickhouse_password_file",
                   "ledger_config", "slurm_agent_state_file", "slurm_agent_allocations_dir", "agent_spool_dir", "kubernetes_pod_resources_socket",
                   "kubernetes_device_endpoint", "kubernetes_state_file")


def _refused(kind: str, rule: str, value: str, width: int = 80, **context) -> PydanticCustomError:
    """A setting refused: what it takes (`rule`, with {placeholders} from `context`), then the value given."""
    return PydanticCustomError(kind, rule + ", got {shown}", {**context, "shown": repr(value[:width])})


class Settings(BaseSettings):
    # allow_inf_nan=False: "inf" passes gt=0 / ge=0 and would crash the ms conversions with a bare
    # OverflowError; refused here it stops the process with the field's name
    model_config = SettingsConfigDict(env_prefix="GPULEDGER_", frozen=True, extra="ignore", allow_inf_nan=False)

    # --- Kafka
    kafka_bootstrap: str = Field("localhost:9092", min_length=1, description="Kafka bootstrap servers, host:port[,host:port]")
    kafka_security_protocol: str = Field("PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    kafka_sasl_mechanism: str = Field("PLAIN", description="SASL mechanism when SASL is used: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, GSSAPI or OAUTHBEARER")
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_sasl_password_file: Path | None = Field(None, description="file holding the SASL password (e.g. a mounted secret); used when KAFKA_SASL_PASSWORD is unset")
    kafka_ssl_cafile: Path | None = None
    topic_prefix: str = Field("gpuledger.", description="prefix of every topic name")
    replication_factor: int = Field(1, ge=1)
    partitions_gpu_samples: int = Field(8, ge=1, description="partitions of the GPU-sample topic (and of the internal node-allocations topic)")
    partitions_job_events: int = Field(4, ge=1)
    partitions_scheduler_snapshots: int = Field(1, ge=1)
    partitions_usage: int = Field(8, ge=1)
    partitions_dead_letters: int = Field(1, ge=1)
    partitions_bills: int = Field(1, ge=1, description="partitions of the bills topic (closed bill rows, key: tenant)")

    # --- Warehouse
    warehouse: str = Field("chdb", min_length=1, description="'chdb' (embedded, in DATA_DIR/chdb), 'chdb:/abs/dir', or http(s)://host:port of a ClickHouse server")
    database: str = Field("gpuledger", description="ClickHouse database")
    clickhouse_user: str = "default"
    clickhouse_password: SecretStr = SecretStr("")
    clickhouse_password_file: Path | None = Field(None, description="file holding the ClickHouse password (e.g. a mounted secret); used when CLICKHOUSE_PASSWORD is unset")
    data_dir: Path = Field(DEFAULT_DATA_DIR, description="embedded broker/warehouse data and worker state")

    # --- Accounting
    ledger_config: Path | None = Field(None, description="TOML file with definitions, prices and coefficients (default: the bundled one)")
    bills_close_grace_s: float = Field(21600.0, ge=0, description="a billing day of a cluster closes once the warehouse's event-time horizon of the cluster (max end_ms of usage_raw) has passed the day's end by this much, seconds")
    bills_adjust_lookback_days: int = Field(62, ge=1, description="each close run recomputes this many of the latest closed days of a cluster and books the differences as adjustments")
    # retention (docs/retention.md): days each table keeps rows, applied as TTLs by `gpuledger migrate`; 0 keeps them
    retention_health_days: int = Field(14, ge=0, le=MAX_RETENTION_DAYS, description="days gpu_health keeps per-sample rows (longer history: gpu_health_hourly)")
    retention_hourly_days: int = Field(730, ge=0, le=MAX_RETENTION_DAYS, description="days the hourly per-GPU aggregates (gpu_health_hourly, usage_gpu_hourly) keep rows")
    retention_load_5m_days: int = Field(90, ge=0, le=MAX_RETENTION_DAYS, description="days the 5-minute per-GPU load history (usage_gpu_5m) keeps rows")
    retention_usage_days: int = Field(2557, ge=0, le=MAX_RETENTION_DAYS, description="days usage_raw, job_events and job_idle_segments keep rows (bills, adjustments and re-bills are computed from them); 0 or more than BILLS_ADJUST_LOOKBACK_DAYS + 7")
    retention_ops_days: int = Field(400, ge=0, le=MAX_RETENTION_DAYS, description="days scheduler_snapshots, scheduler_preemptions, alerts and reclaim suggestions keep rows")
    retention_bills_days: int = Field(0, ge=0, le=MAX_RETENTION_DAYS, description="days the bill tables (daily bill grain, closed bills, adjustments, re-bills) keep rows; 0 or more than BILLS_ADJUST_LOOKBACK_DAYS + 7")
    clickhouse_cluster: str = Field("", pattern=r"^[A-Za-z0-9_\-]*$", description="ClickHouse cluster name: `gpuledger migrate` renders every migration for it (Replicated tables, ON CLUSTER, Distributed tables); empty: one server")
    topic_retention_input_days: float = Field(70.0, ge=MIN_TOPIC_RETENTION_DAYS, le=MAX_RETENTION_DAYS, description="retention of the input topics (gpu-samples, job-events, scheduler-snapshots), days: long enough to rebuild any day a close run may still adjust; more than BILLS_ADJUST_LOOKBACK_DAYS + 7 + BILLS_CLOSE_GRACE_S in days")
    topic_retention_output_days: float = Field(14.0, ge=MIN_TOPIC_RETENTION_DAYS, le=MAX_RETENTION_DAYS, description="retention of the ledger's output and internal topics (usage, lifecycle-accepted, node-allocations), days")
    topic_retention_diagnostics_days: float = Field(30.0, ge=MIN_TOPIC_RETENTION_DAYS, le=MAX_RETENTION_DAYS, description="retention of dead-letters, late-events, bills, alerts and reclaim suggestions, days")

    # --- Worker / agent
    worker_app_id: str = Field("gpuledger-worker", min_length=1, description="Faust application id (consumer group)")
    worker_rebalance_timeout_s: float = Field(10.0, gt=0, description="consumer-group rebalance timeout of worker and sink, seconds")
    kafka_fetch_max_wait_ms: int = Field(100, ge=1, le=30_000, description="longest a consumer's fetch waits at the broker for data, milliseconds (worker and sink); brokers that answer a waiting fetch only when the wait ends (Tansu) add up to this much to every hop through a topic")
    worker_snapshot_interval_s: float = Field(2.0, gt=0, description="how often the worker snapshots its state to the worker-state topic and commits its input offsets, seconds")
    worker_samples_ahead_s: float = Field(120.0, gt=0, le=86_400, description="how much of its nodes' samples (event time, per node on average, each node's newest tick not counted) may wait in the worker for the lifecycle watermark before it pauses reading that gpu-samples partition, seconds; it reads on at half of it. Waiting samples are held in memory (a tick closes only behind the watermark): while the worker catches up on a backlog, this keeps the backlog in Kafka until the lifecycle has caught up")
    worker_watermark_flush_s: float = Field(0.1, gt=0, description="how long the worker may hold lifecycle watermarks back to send only the latest of a burst on to the join (fewer messages while it works through a backlog), seconds")
    worker_retention_s: float = Field(86400.0, gt=0, description="event time behind the closed horizon for which the worker recognises duplicate allocation changes and accepts late ones, seconds")
    worker_max_ahead_s: float = Field(MAX_AHEAD_MS / 1000, gt=0, description="input more than this ahead of the lifecycle watermark, or of the receiving process's clock (also before the first watermark), is rejected as an absurd timestamp, seconds; worker and sink alike")
    max_clock_ahead_s: float = Field(CLOCK_AHEAD_MS / 1000, gt=0, le=MAX_AHEAD_MS / 1000, description="a GPU sample, lifecycle event or lifecycle watermark more than this ahead of the receiving process's clock is rejected (its node's or scheduler agent's clock is out of sync), seconds; worker and sink alike. The worker holds a sample until the lifecycle watermark reaches it: one node's clock a day ahead would pause its gpu-samples partition, every node in it, for that day; a watermark from the future would close every node's ticks before their allocation changes")
    sink_retry_max_s: float = Field(30.0, gt=0, description="longest pause between the sink's retries of a failed warehouse write, seconds (it retries until it succeeds)")
    dead_letter_max_bytes: int = Field(900_000, ge=16_384, le=990_000, description="largest dead letter the worker and sink produce, bytes; a larger original is cut (its size and SHA-256 kept). At most 990,000: the producers keep their clients' 1 MB message limit (a larger letter stopped the sink); keep it under the broker's message size too (Kafka's default 1 MB)")
    agent_interval_s: float = Field(5.0, ge=0.001, description="GPU agent sampling interval, seconds (the tick grid is in whole ms)")
    cluster: str = Field("default", description="cluster name the agent reports")
    slurm_agent_interval_s: float = Field(10.0, gt=0, description="Slurm agent: seconds between polls of squeue/sinfo")
    slurm_agent_command_timeout_s: float = Field(20.0, gt=0, description="Slurm agent: seconds a Slurm client command may take (they hang while slurmctld is down)")
    slurm_agent_watermark_margin_s: float = Field(1.0, ge=0, description="Slurm agent: the lifecycle watermark stays this far behind the poll's start (clock skew between the agent's host and slurmctld), seconds")
    slurm_agent_state_file: Path | None = Field(None, description="Slurm agent: its state file (default DATA_DIR/slurm-agent-<cluster>.json)")
    slurm_agent_allocations_dir: Path | None = Field(None, description="Slurm agent: the directory deploy/slurm/gpuledger-prolog-slurmctld writes each job's allocation to (unset: none)")

    # --- Agent spool and self-metrics
    agent_ticks_per_message: int = Field(1, ge=1, le=10_000, description="ticks the GPU agent sends per message: 1 sends each tick at once; N sends a NodeTickBatch every N ticks (fewer messages for brokers and workers, N - 1 intervals more latency)")
    agent_spool_dir: Path | None = Field(None, description="directory of the agent's local disk spool; the agent uses <dir>/<node> (default: DATA_DIR/spool/<node>)")
    agent_spool_max_bytes: int = Field(256 * 1024 * 1024, ge=0, description="bound of the agent's spool in bytes; when full the oldest ticks are dropped and counted (0: no spool, publish directly)")
    agent_spool_fsync: Literal["always", "interval", "never"] = Field("always", description="when the spool syncs to disk: every tick (always), at most once a second (interval), or left to the OS (never)")
    agent_metrics_port: int = Field(0, ge=0, le=65535, description="port of the agent's Prometheus /metrics endpoint (0: disabled)")
    worker_metrics_port: int = Field(0, ge=0, le=65535, description="port of the worker's Prometheus /metrics endpoint (0: disabled)")
    sink_metrics_port: int = Field(0, ge=0, le=65535, description="port of the sink's Prometheus /metrics endpoint (0: disabled)")

    # --- Kubernetes agent (docs/kubernetes.md)
    kubernetes_tenant_label: str = Field("gpuledger.io/tenant", min_length=1, description="pod label naming the tenant; pods without it belong to their namespace")
    kubernetes_queue_label: str = Field("kueue.x-k8s.io/queue-name", min_length=1, description="pod label naming the (Kueue Local)Queue; a LocalQueue is reported as its ClusterQueue")
    kubernetes_default_queue: str = Field("default", min_length=1, description="queue of pods without the queue label")
    kubernetes_gpu_resource: str = Field("nvidia.com/gpu", min_length=1, description="extended resource of GPUs (also counted: '<it>.<suffix>' and '<vendor>/mig-*')")
    kubernetes_time_slicing_replicas: int = Field(1, ge=1, description="replicas per GPU of the device plugin's time-slicing; a replica is 1/replicas of a GPU")
    kubernetes_allowed_lateness_s: float = Field(30.0, ge=0, description="lifecycle watermark = the time every watch has been seen up to, less this, seconds")
    kubernetes_device_wait_s: float = Field(120.0, ge=0, description="how long a scheduled pod waits for its device ids before its allocation is sent without GPUs, seconds")
    kubernetes_pod_resources_socket: Path | None = Field(None, description="kubelet PodResources socket of the agent's node")
    kubernetes_device_endpoint: str | None = Field(None, description="URL template ({node}, {host_ip}) of the per-node PodResources reporters")
    kubernetes_container_ids: Literal["runtime", "name"] = Field("runtime", description="how GPU holders' containers are named to match the GPU samples' processes: 'runtime' (the runtime's container id, as the NVML GPU agent reads it from cgroups) or 'name' (k8s://<namespace>/<pod>/<container>, as the dcgm agent reads it from dcgm-exporter's pod labels)")
    kubernetes_kueue: bool = Field(True, description="read Kueue Workloads, ClusterQueues and LocalQueues")
    kubernetes_watch_timeout_s: float = Field(30.0, gt=0, description="length of one watch request, seconds")
    kubernetes_list_page_size: int = Field(500, ge=1, description="objects per page of the agent's lists (the API server's limit/continue)")
    kubernetes_snapshot_interval_s: float = Field(30.0, gt=0, description="seconds between scheduler snapshots")
    kubernetes_state_file: Path | None = Field(None, description="the agent's state file (default: DATA_DIR/kubernetes-agent-<cluster>.json; a cluster named with characters other than A-Z a-z 0-9 . _ -: those as _ plus 8 hex digits of the name)")

    @field_validator(*OPTIONAL_FIELDS, mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        return None if value == "" else value

    @field_validator("data_dir", mode="before")
    @classmethod
    def _data_dir_not_empty(cls, value):
        if value == "":  # Path("") would be the working directory
            raise PydanticCustomError("empty", "must name a directory (unset: .gpuledger), got ''")
        return value

    @field_validator("warehouse")
    @classmethod
    def _warehouse_dir_named(cls, value: str) -> str:
        if value.strip() in ("chdb:", ""):  # Path("") would be the working directory
            raise PydanticCustomError("empty", "'chdb:' must name a directory ('chdb:/abs/dir'; 'chdb' for "
                                      "DATA_DIR/chdb), got '{value}'", {"value": value})
        return value

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        # every message of the agents carries it (the wire's identifier rule) and their state files and
        # spools are named by it (a / or \\ would be a directory)
        if not (0 < len(value) <= MAX_CLUSTER_LEN and value.isprintable() and value == value.strip()
                and "/" not in value and "\\" not in value):
            raise _refused("cluster_name", "must be 1 to {max} printable characters without / or \\ and without "
                           "leading or trailing whitespace", value, max=MAX_CLUSTER_LEN)
        return value

    @field_validator("topic_prefix")
    @classmethod
    def _topic_prefix(cls, value: str) -> str:
        if not (TOPIC_NAME_CHARS.match(value) and len(value) <= MAX_TOPIC_PREFIX_LEN):
            raise _refused("topic_prefix", "must be at most {max} of the characters Kafka allows in topic names "
                           "(letters, digits, '.', '_', '-')", value, max=MAX_TOPIC_PREFIX_LEN)
        return value

    @field_validator("database")
    @classmethod
    def _database_name(cls, value: str) -> str:
        if not DATABASE_NAME.match(value):
            raise _refused("database_name", "must be a ClickHouse name of letters, digits and _ (not starting "
                           "with a digit)", value)
        return value

    @field_validator("kubernetes_device_endpoint")
    @classmethod
    def _device_endpoint_template(cls, value: str | None) -> str | None:
        # the agent fills it per node and swallows what fails there (a pod then waits, and is sent
        # without GPUs): a template it cannot fill is refused here, once
        if value is None:
            return value
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            fields = {f"({exc})"}
        if not (value.startswith(("http://", "https://")) and fields and fields <= {"node", "host_ip"}):
            raise _refused("device_endpoint", "must be an http(s):// URL template with {node} and/or {host_ip} and "
                           "no other {...}", value, width=200)
        return value

    @field_validator("kafka_security_protocol", mode="before")
    @classmethod
    def _security_protocol(cls, value):
        protocol = value.strip().upper() if isinstance(value, str) else value
        if protocol not in KAFKA_SECURITY_PROTOCOLS:
            raise ValueError(f"must be one of {', '.join(KAFKA_SECURITY_PROTOCOLS)} (any case), got {value!r}")
        return protocol

    @field_validator("kafka_sasl_mechanism", mode="before")
    @classmethod
    def _sasl_mechanism(cls, value):
        mechanism = value.strip().upper() if isinstance(value, str) else value
        if mechanism not in KAFKA_SASL_MECHANISMS:
            raise ValueError(f"must be one of {', '.join(KAFKA_SASL_MECHANISMS)} (any case), got {value!r}")
        return mechanism

    @model_validator(mode="after")
    def _usage_outlives_adjustments(self):
        # a close run recomputes the latest closed days from usage_raw; rows expired under it would
        # turn into bogus negative adjustments
        bound = self.bills_adjust_lookback_days + 7
        if 0 < self.retention_usage_days <= bound:
            raise ValueError(f"GPULEDGER_RETENTION_USAGE_DAYS={self.retention_usage_days} must be 0 or more than "
                             f"GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS + 7 = {bound}")
        # the closed rows of every day a close run may still adjust must be kept: a month's rows expire N
        # days after its last day, so a month's last day is kept only N days (docs/retention.md); the
        # same week of slack as the usage, for a close run that lags
        if 0 < self.retention_bills_days <= bound:
            raise ValueError(f"GPULEDGER_RETENTION_BILLS_DAYS={self.retention_bills_days} must be 0 or more than "
                             f"GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS + 7 = {bound}")
        # a replay of the input topics rebuilds every day a close run may still adjust: the oldest starts
        # up to look-back + 1 day + the close grace ago (the last closed day ended at least the grace ago),
        # so the input is kept that long plus 6 days of slack (the input topics have no "0 keeps all")
        input_bound = bound + self.bills_close_grace_s / 86_400
        if self.topic_retention_input_days <= input_bound:
            raise ValueError(f"GPULEDGER_TOPIC_RETENTION_INPUT_DAYS={self.topic_retention_input_days:g} must be more than "
                             f"GPULEDGER_BILLS_ADJUST_LOOKBACK_DAYS + 7 + GPULEDGER_BILLS_CLOSE_GRACE_S in days "
                             f"= {input_bound:g}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, values):
        """KAFKA_SASL_PASSWORD / CLICKHOUSE_PASSWORD from their *_FILE when not given directly."""
        if isinstance(values, dict):
            for name in ("kafka_sasl_password", "clickhouse_password"):
                path = values.get(f"{name}_file")
                if path and not values.get(name):
                    try:
                        values = {**values, name: Path(path).read_text(encoding="utf-8").rstrip("\r\n")}
                    except OSError as exc:
                        raise ValueError(f"GPULEDGER_{name.upper()}_FILE: cannot read {path}: {exc.strerror}") from None
                    except UnicodeDecodeError as exc:
                        raise ValueError(f"GPULEDGER_{name.upper()}_FILE: {path} is not UTF-8 text ({exc.reason} "
                                         f"at byte {exc.start})") from None
        return values

    @cached_property
    def topics(self) -> TopicNames:
        """Every topic name, under `topic_prefix` (plain data: the worker's core gets this, not the settings)."""
        return TopicNames.with_prefix(self.topic_prefix)

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
            t.late_events: self.partitions_dead_letters,
            t.bills: self.partitions_bills,
            t.lifecycle_accepted: self.partitions_job_events,  # partition n holds job-events partition n's
            # one partition per join partition, then one per router (job-events) partition
            t.worker_state: self.partitions_gpu_samples + self.partitions_job_events,
            # behaviour alerts and reclaim suggestions (gpuledger watch): one partition each, in order;
            # the watcher's state is one snapshot
            t.alerts: 1,
            t.reclaim_suggestions: 1,
            t.watch_state: 1,
            # training progress (line 4, optional) and approval decisions: small, ordered per job
            t.job_progress: 1,
            t.approvals: 1,
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


def check_cluster_name(value: str) -> str:
    """An agent's `--cluster`, held to GPULEDGER_CLUSTER's rule: the name, or ValueError saying why.
    It names every message, state file and spool (a '/' would put them outside the data dir)."""
    return Settings._cluster_name(value)


def check_device_endpoint(value: str | None) -> str | None:
    """An agent's `--device-endpoint`, held to GPULEDGER_KUBERNETES_DEVICE_ENDPOINT's rule."""
    return Settings._device_endpoint_template(value)
