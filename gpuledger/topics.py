"""`gpuledger topics create|list`: the ledger's topics, created explicitly (never auto-created), each with
its retention and durability configured (docs/retention.md, "Topics"), never the broker's defaults."""

from __future__ import annotations

import logging

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from gpuledger.config import Settings

log = logging.getLogger(__name__)

DAY_MS = 86_400_000
#: the largest state snapshot a state topic takes (its `max.message.bytes`) and the state writers'
#: producers send (their max request size). Kafka's default is 1 MB a record; the watcher's one
#: document of state is ~2 MB compressed at 100,000 GPUs (bench/watch.py), and a worker partition's
#: grows with its nodes.
STATE_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: the largest job event the scheduler agents send (their producers' `message.max.bytes`): a job's
#: `allocated` names every GPU it holds, ~88 bytes a GPU by node and index (Slurm) and ~220 by UUID with
#: a containerd container id (Kubernetes), so Kafka's default 1 MB would refuse the allocation of a job on
#: more than ~11,000 or ~4,500 GPUs (15 MiB: ~170,000 or ~70,000). The topics that carry job events take `EVENT_TOPIC_MAX_MESSAGE_BYTES`, which leaves room
#: for a record's framing, as does the worker's producer (STATE_MAX_MESSAGE_BYTES) that passes them on.
EVENT_MAX_MESSAGE_BYTES = 15 * 1024 * 1024
EVENT_TOPIC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: TopicNames attributes of the topics that carry job events whole (the agents' and the accepted ones), or a
#: job's GPUs on one node from one event (node-allocations: up to the size of the event it comes from)
EVENT_TOPICS = ("job_events", "lifecycle_accepted", "node_allocations")

#: topic kind -> TopicNames attributes. Input topics are the only source a rebuild replays; output and
#: internal topics can be made again from them; diagnostics are read by people and downstream systems;
#: state topics hold snapshots (compacted: the latest per key is kept, however old).
KINDS: dict[str, tuple[str, ...]] = {
    "input": ("gpu_samples", "job_events", "scheduler_snapshots", "job_progress"),
    "output": ("usage", "lifecycle_accepted", "node_allocations"),
    "diagnostics": ("dead_letters", "late_events", "bills", "alerts", "reclaim_suggestions", "approvals"),
    "state": ("worker_state", "watch_state"),
}

#: TopicNames attribute -> the setting(s) its partition count follows (Settings.partitions); the others have 1
PARTITION_SETTINGS: dict[str, str] = {
    "gpu_samples": "GPULEDGER_PARTITIONS_GPU_SAMPLES",
    "node_allocations": "GPULEDGER_PARTITIONS_GPU_SAMPLES",
    "job_events": "GPULEDGER_PARTITIONS_JOB_EVENTS",
    "lifecycle_accepted": "GPULEDGER_PARTITIONS_JOB_EVENTS",
    "worker_state": "GPULEDGER_PARTITIONS_GPU_SAMPLES + GPULEDGER_PARTITIONS_JOB_EVENTS",
    "scheduler_snapshots": "GPULEDGER_PARTITIONS_SCHEDULER_SNAPSHOTS",
    "usage": "GPULEDGER_PARTITIONS_USAGE",
    "dead_letters": "GPULEDGER_PARTITIONS_DEAD_LETTERS",
    "late_events": "GPULEDGER_PARTITIONS_DEAD_LETTERS",
    "bills": "GPULEDGER_PARTITIONS_BILLS",
}


def partition_problems(settings: Settings, existing: dict, names: list[str] | None = None) -> list[str]:
    """One line per existing topic (name -> topic metadata; of `names` where given) whose partition count
    is not the configured one, naming the setting it follows. The worker broadcasts watermarks to
    partitions 0..n-1 of the configured n and joins gpu-samples with node-allocations partition by
    partition: with a count that disagrees, ticks are billed as unallocated or never closed, silently."""
    problems, configured = [], settings.partitions()
    for attr, name in vars(settings.topics).items():
        wanted = configured.get(name)
        if names is not None and name not in names:
            continue
        if name in existing and wanted is not None and len(existing[name].partitions) != wanted:
            setting = PARTITION_SETTINGS.get(attr, "the ledger (fixed)")
            problems.append(f"topic {name} has {len(existing[name].partitions)} partitions, {setting} says {wanted}")
    return problems


def check_topics(settings: Settings, names: list[str] | None = None, timeout_s: float = 30.0) -> None:
    """RuntimeError unless each topic of `names` (default: every topic of the ledger) exists with its
    configured partition count. For the processes that write or read them (a replay, the worker): a
    producer would create a missing topic with the broker's default count, and a count that disagrees
    bills ticks as unallocated or never closes them (`partition_problems`), silently."""
    names = list(settings.partitions()) if names is None else names
    existing = AdminClient(settings.kafka_client_config()).list_topics(timeout=timeout_s).topics
    missing = [name for name in names if name not in existing]
    problems = partition_problems(settings, existing, names)
    if missing:
        problems.insert(0, f"topic(s) {', '.join(missing)} missing (run `gpuledger topics create` first)")
    if problems:
        raise RuntimeError("; ".join(problems))


def topic_kind(settings: Settings, name: str) -> str:
    for kind, attrs in KINDS.items():
        if any(getattr(settings.topics, a, None) == name for a in attrs):
            return kind
    raise ValueError(f"topic {name} has no retention class (add it to gpuledger.topics.KINDS)")


def min_insync_replicas(replication_factor: int) -> int | None:
    """A majority of the replicas must have a write (producers use acks=all), where a majority still
    leaves a replica to lose: from 3 replicas on. With 1 or 2 the broker default (1) stays."""
    return replication_factor // 2 + 1 if replication_factor >= 3 else None


def topic_config(settings: Settings, name: str, replicas: int | None = None) -> dict[str, str]:
    """The configs `topics create` sets on one topic with `replicas` replicas (None: a topic it
    creates, with GPULEDGER_REPLICATION_FACTOR of them)."""
    kind = topic_kind(settings, name)
    if kind == "state":
        config = {"cleanup.policy": "compact", "retention.ms": "-1", "max.message.bytes": str(STATE_MAX_MESSAGE_BYTES)}
    else:
        days = {"input": settings.topic_retention_input_days, "output": settings.topic_retention_output_days,
                "diagnostics": settings.topic_retention_diagnostics_days}[kind]
        # retention.bytes -1: time alone decides, as documented; a broker's log.retention.bytes (or one
        # set on the topic before) would otherwise delete the input, a rebuild's only source, by size
        config = {"cleanup.policy": "delete", "retention.ms": str(int(days * DAY_MS)), "retention.bytes": "-1"}
        if any(getattr(settings.topics, attr) == name for attr in EVENT_TOPICS):
            config["max.message.bytes"] = str(EVENT_TOPIC_MAX_MESSAGE_BYTES)
    isr = min_insync_replicas(settings.replication_factor if replicas is None else replicas)
    if isr is not None:
        config["min.insync.replicas"] = str(isr)
    return config


def _differing(admin: AdminClient, name: str, wanted: dict[str, str], timeout_s: float) -> dict[str, str]:
    """The wanted configs an existing topic does not have (all of them where the broker cannot say)."""
    try:
        (future,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)]).values()
        have = {k: e.value for k, e in future.result(timeout=timeout_s).items()}
    except Exception as exc:  # a broker without DescribeConfigs
        log.warning("cannot read the configs of topic %s (%s); setting them", name, exc)
        have = {}
    differing = {k: v for k, v in wanted.items() if have.get(k) != v}
    for k, v in differing.items():  # say what changes: a shorter retention deletes records at once
        log.warning("topic %s: %s %s -> %s%s", name, k, have.get(k, "(unknown)"), v, _shortened(k, have.get(k), v))
    return differing


def _shortened(key: str, old: str | None, new: str) -> str:
    """What a change of a topic's retention.ms deletes, for the warning ('' where it deletes nothing)."""
    try:
        before, after = int(old), int(new)  # -1: kept for ever
    except (TypeError, ValueError):
        return ""
    if key != "retention.ms" or after < 0 or 0 <= before <= after:
        return ""
    return f": the broker deletes its records older than {after / DAY_MS:g} days"


def replica_count(topic_metadata) -> int | None:
    """The replicas of an existing topic (the fewest of any partition); None where the broker names none."""
    counts = [len(p.replicas) for p in topic_metadata.partitions.values() if p.replicas]
    return min(counts) if counts else None


def create_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic of the ledger with its configured partition count and configs; an existing
    topic gets the configs it lacks.

    Returns topic -> 'created' | 'exists' | 'updated'. An existing topic with a different partition
    count is an error (`partition_problems`: all of them, before any topic is changed): co-partitioning
    of gpu-samples and node-allocations depends on it. An existing topic keeps its replicas: its
    min.insync.replicas follows its real replica count (never more than it has, which would refuse
    every write), with a warning where that differs from GPULEDGER_REPLICATION_FACTOR."""
    admin = AdminClient(settings.kafka_client_config())
    wanted = settings.partitions()
    configs = {name: topic_config(settings, name) for name in wanted}
    existing = admin.list_topics(timeout=timeout_s).topics
    problems = partition_problems(settings, existing)
    if problems:  # all of them, before any topic is changed
        raise RuntimeError("; ".join(problems) + ". Set the partition settings to the topics' counts (Kafka cannot "
                           "take partitions away; adding some moves keys to other partitions, so a node's ticks "
                           "and allocations must be repartitioned together)")
    result: dict[str, str] = {}
    to_create = []
    for name, partitions in wanted.items():
        if name in existing:
            replicas = replica_count(existing[name])
            if replicas is not None and replicas != settings.replication_factor:
                log.warning("topic %s has %d replica(s) but GPULEDGER_REPLICATION_FACTOR is %d: its "
                            "min.insync.replicas follows its %d replica(s) (topics create does not change the "
                            "replicas of an existing topic; reassign its partitions to change them)",
                            name, replicas, settings.replication_factor, replicas)
                configs[name] = topic_config(settings, name, replicas)
            result[name] = "exists"
            differing = _differing(admin, name, configs[name], timeout_s)
            if differing:
                entries = [ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in differing.items()]
                (future,) = admin.incremental_alter_configs(
                    [ConfigResource(ResourceType.TOPIC, name, incremental_configs=entries)]).values()
                try:
                    future.result(timeout=timeout_s)
                except Exception as exc:
                    raise RuntimeError(f"could not set configs {differing} on topic {name}: {exc}") from exc
                result[name] = "updated"
        else:
            to_create.append(NewTopic(name, num_partitions=partitions, replication_factor=settings.replication_factor,
                                      config=configs[name]))
    if to_create:
        for name, future in admin.create_topics(to_create, operation_timeout=timeout_s).items():
            try:
                future.result()
                result[name] = "created"
            except Exception as exc:  # a concurrent creator may have won the race
                if "TOPIC_ALREADY_EXISTS" in str(exc):
                    result[name] = "exists"
                else:
                    raise RuntimeError(f"could not create topic {name}: {exc}") from exc
    return result


def list_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, int]:
    admin = AdminClient(settings.kafka_client_config())
    return {name: len(meta.partitions) for name, meta in admin.list_topics(timeout=timeout_s).topics.items()}
