"""The ledger watches itself: Prometheus metrics of agents, worker and sink (prometheus-client).

Why one file: every metric name is registered once per process on one registry, and the list of
them is the operator's reference (docs/reliability.md, "Metrics"); one module keeps that list in
one place, with the small per-component wrappers that feed it.

Every metric is defined here, once, on the default registry, named `gpuledger_*`. Each
process serves them with `start_metrics_server(port)` (port 0: disabled) on
`http://<host>:<port>/metrics`, beside prometheus-client's own process_* and python_* metrics.

    agents   AgentMetrics (wired in agents/gpu_agent.py; the scheduler agents' spools too)
    scheduler agents (Slurm, Kubernetes): SCHEDULER_AGENTS.attach(agent, cluster, stats), read at
             scrape time: their watermark and its age, events published, jobs tracked, failures
    worker   WorkerMetrics: message_in / message_out / dead_letter / sample_seen / set_lag (from
             the `measure_lag` timer of streams/app.py, every LAG_EVERY_S) / snapshot_written /
             forget_nodes (a revoked partition's nodes: their new owner reports them)
    sink     SinkMetrics:   message_in / dead_letter / InstrumentedWriter (rows, insert failures,
             insert time) / measure_lag(consumer) (each poll-loop turn; measures every LAG_EVERY_S)

Ages (of the last sample per node, of the oldest spooled tick) are computed when scraped, so
they keep growing while nothing arrives — which is what an alert on them needs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- agents
AGENT_TICKS_SAMPLED = Counter("gpuledger_agent_ticks_sampled", "Node ticks sampled (built from the GPUs)", ["node"])
AGENT_TICK_FAILURES = Counter("gpuledger_agent_tick_failures", "Ticks that failed to build (device read errors); skipped", ["node"])
AGENT_TICKS_SKIPPED = Counter("gpuledger_agent_ticks_skipped", "Grid points skipped because the agent fell behind", ["node"])
AGENT_PUBLISHED = Counter("gpuledger_agent_messages_published", "Ticks the broker acknowledged", ["node"])
AGENT_DELIVERY_FAILURES = Counter("gpuledger_agent_delivery_failures", "Deliveries the producer reported as failed (resent from the spool)", ["node"])
AGENT_SPOOL_RECORDS = Gauge("gpuledger_agent_spool_records", "Ticks in the local spool not yet acknowledged by the broker (spool depth)", ["node"])
AGENT_SPOOL_BYTES = Gauge("gpuledger_agent_spool_bytes", "Bytes of the local spool on disk", ["node"])
AGENT_SPOOL_MAX_BYTES = Gauge("gpuledger_agent_spool_max_bytes", "Configured bound of the local spool", ["node"])
AGENT_SPOOL_DROPPED = Counter("gpuledger_agent_spool_dropped", "Ticks dropped (oldest first) because the spool was full, in this process", ["node"])
AGENT_SPOOL_DROPPED_LIFETIME = Gauge("gpuledger_agent_spool_dropped_lifetime_records", "Ticks ever dropped from this spool (persisted across restarts)", ["node"])
AGENT_SPOOL_OLDEST_AGE = Gauge("gpuledger_agent_spool_oldest_age_seconds", "Age of the oldest unacknowledged tick in the spool (0 when empty)", ["node"])
AGENT_SPOOL_FSYNC_FAILURES = Gauge("gpuledger_agent_spool_fsync_failures", "fsyncs of the spool that failed in this process (the ticks are kept; they may not survive a power cut)", ["node"])
AGENT_PRODUCER_FAILURES = Gauge("gpuledger_agent_producer_failures", "Replacement Kafka producers that could not be made in this process (the ticks wait in the spool)", ["node"])
AGENT_INFLIGHT = Gauge("gpuledger_agent_kafka_pending_messages", "Messages handed to the producer and not yet acknowledged", ["node"])

# --------------------------------------------------------------------------- worker / sink
MESSAGES_IN = Counter("gpuledger_messages_in", "Messages consumed", ["component", "topic"])
MESSAGES_OUT = Counter("gpuledger_messages_out", "Messages produced", ["component", "topic"])
DEAD_LETTERS = Counter("gpuledger_dead_letters", "Messages sent to the dead-letter topic, by source topic and kind", ["component", "topic", "kind"])
UNMATCHED = Counter("gpuledger_unmatched", "What the worker could not match, by kind: allocation_gpu_not_reporting (an "
                    "allocated GPU the node does not report), unknown_node_changes (changes for a node that never sent a "
                    "sample), busy_unallocated_gpu_seconds (GPU time with processes or use but no allocation), "
                    "held_gpu_not_reporting_seconds (GPU time an attempt held on a GPU its node stopped reporting), "
                    "mig_assignments (MIG instances resolved to their parent GPU; matched, counted for visibility)",
                    ["component", "kind"])
VALUE_FALLBACKS = Counter("gpuledger_value_fallbacks", "Measurements the worker did not believe and replaced, by kind: "
                          "energy_over_power_limit (an energy-counter rise above the card's power limit x the interval: "
                          "power x time used), power_over_power_limit (a power reading above the limit: capped at it), "
                          "energy_counter_reset (the counter went backwards, e.g. a driver reload: power x time used)",
                          ["component", "kind"])
PRICED_BY_DEFAULT = Counter("gpuledger_priced_by_default_gpu_seconds", "GPU time of models without a price or "
                            "coefficient of their own, priced under the ledger's [unpriced] policy, by GPU model",
                            ["component", "model"])
DUPLICATES = Counter("gpuledger_duplicates", "Second copies dropped silently (at-least-once delivery), by kind", ["component", "kind"])
SAMPLES_PAUSED = Gauge("gpuledger_worker_samples_paused", "1 while the worker has paused a gpu-samples partition: more than "
                       "GPULEDGER_WORKER_SAMPLES_AHEAD_S of samples per node waited for the lifecycle watermark "
                       "(catching up on a backlog, or no watermark coming: check the scheduler agent)", ["partition"])
SNAPSHOT_BYTES = Gauge("gpuledger_worker_snapshot_bytes", "Size of the worker's latest state snapshot of an input "
                       "partition, by kind (router: job-events, join: gpu-samples); the worker-state topic takes at most "
                       "16 MiB: a larger one stops the worker", ["kind", "partition"])
CONSUMER_LAG = Gauge("gpuledger_consumer_lag_messages", "End offset minus the consumer's position", ["component", "topic", "partition"])
SINK_ROWS = Counter("gpuledger_sink_rows_inserted", "Rows inserted into the warehouse", ["table"])
SINK_INSERT_FAILURES = Counter("gpuledger_sink_insert_failures", "Failed insert attempts (each retry counts)", ["table"])
SINK_INSERT_SECONDS = Histogram("gpuledger_sink_insert_seconds", "Time of one insert into the warehouse", ["table"],
                                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
USAGE_DUPLICATE_RECORDS = Gauge("gpuledger_usage_duplicate_records", "Usage records counted more than once in the warehouse "
                                "(rows minus distinct record ids) over the audited days, by table; closed bills count each once "
                                "(gpuledger bills audit)", ["table"])
USAGE_RECORDS_AUDITED = Gauge("gpuledger_usage_records_audited", "Usage rows the last dedup audit looked at, by table", ["table"])
SINK_BATCHES = Counter("gpuledger_sink_batches", "Batches flushed and committed")
SINK_BATCH_ROWS = Histogram("gpuledger_sink_batch_rows", "Rows per flushed batch",
                            buckets=(1, 10, 100, 1_000, 5_000, 20_000, 100_000))


class _LastSample(Collector):
    """gpuledger_last_sample_age_seconds / _timestamp_seconds {component, cluster, node}: event time
    of the newest sample seen per node, and its age at scrape time. A node is (cluster, node): two
    clusters may both have a node001, and one's silence must not hide behind the other's samples."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], float] = {}

    def observe(self, component: str, node: str, ts_ms: int, cluster: str = "") -> None:
        key, ts = (component, cluster, node), ts_ms / 1000.0
        with self._lock:
            if ts > self._seen.get(key, float("-inf")):
                self._seen[key] = ts

    def forget(self, component: str, nodes: Iterable[tuple[str, str]]) -> None:
        """Drop the series of `nodes` ((cluster, node) pairs): another process reads them now."""
        with self._lock:
            for cluster, node in nodes:
                self._seen.pop((component, cluster, node), None)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        now = self.clock()
        age = GaugeMetricFamily("gpuledger_last_sample_age_seconds",
                                "Seconds since the event time of the newest GPU sample seen per node",
                                labels=["component", "cluster", "node"])
        stamp = GaugeMetricFamily("gpuledger_last_sample_timestamp_seconds",
                                  "Event time of the newest GPU sample seen per node (Unix seconds)",
                                  labels=["component", "cluster", "node"])
        with self._lock:
            items = sorted(self._seen.items())
        for (component, cluster, node), ts in items:
            age.add_metric([component, cluster, node], max(0.0, now - ts))
            stamp.add_metric([component, cluster, node], ts)
        yield age
        yield stamp


LAST_SAMPLE = _LastSample()
REGISTRY.register(LAST_SAMPLE)


#: What a scheduler agent's `stats()` may report: key -> (metric type, help). A key an agent does
#: not report is left out of its series.
SCHEDULER_STATS = {
    "watermark_timestamp_seconds": ("gauge", "The last lifecycle watermark the scheduler agent sent (Unix seconds)"),
    "watermark_age_seconds": ("gauge", "Seconds since that watermark's time, at scrape time: the allowed lateness "
                                       "plus the agent's delay; growing: the worker will pause (no watermark comes)"),
    "events_published": ("counter", "Job lifecycle events the scheduler agent handed to its spool"),
    "jobs_tracked": ("gauge", "Jobs the scheduler agent's state holds"),
    "polls": ("counter", "Polls of the scheduler whose messages were published (Slurm)"),
    "poll_failures": ("counter", "Polls that could not read or use the scheduler's output (Slurm): nothing published"),
    "objects_skipped": ("counter", "Objects the agent could not read and skipped, logged with the reason (Kubernetes)"),
    "watch_relists": ("counter", "Lists again after an expired resourceVersion or continue token (Kubernetes)"),
    "watch_reconnects": ("counter", "Watches started again after an error or a dropped connection (Kubernetes)"),
    "pods_waiting_for_devices": ("gauge", "Scheduled GPU pods waiting for their device ids; they hold the watermark "
                                          "(Kubernetes)"),
    "gpus_held_by_no_job": ("gauge", "GPUs the scheduler counts in use that no job holds, for 3 polls in a row: "
                                     "jobs needing them pend (Slurm; a slurmctld restart frees them)"),
    "state_bytes_written": ("counter", "Bytes the scheduler agent wrote to its state file (and journal): its disk "
                                      "write rate"),
}


class _SchedulerAgents(Collector):
    """gpuledger_scheduler_* {agent, cluster}: each attached agent's `stats()`, read at scrape time
    (so the watermark's age keeps growing while the agent is stuck)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, str], Callable[[], Mapping[str, float]]] = {}

    def attach(self, agent: str, cluster: str, stats: Callable[[], Mapping[str, float]]) -> None:
        with self._lock:
            self._sources[(agent, cluster)] = stats

    def detach(self, agent: str, cluster: str) -> None:
        with self._lock:
            self._sources.pop((agent, cluster), None)

    def collect(self) -> Iterable[Any]:
        now = self.clock()
        families = {key: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            f"gpuledger_scheduler_{key}", text, labels=["agent", "cluster"]) for key, (kind, text) in SCHEDULER_STATS.items()}
        with self._lock:
            sources = sorted(self._sources.items())
        for (agent, cluster), read in sources:
            try:
                stats = dict(read())
            except Exception:  # a scrape never breaks on an agent shutting down
                log.debug("scheduler agent %s/%s: stats unreadable", agent, cluster, exc_info=True)
                continue
            if "watermark_timestamp_seconds" in stats:
                stats["watermark_age_seconds"] = max(0.0, now - stats["watermark_timestamp_seconds"])
            for key, value in stats.items():
                if key in families:
                    families[key].add_metric([agent, cluster], float(value))
        yield from families.values()


SCHEDULER_AGENTS = _SchedulerAgents()
REGISTRY.register(SCHEDULER_AGENTS)


# --------------------------------------------------------------------------- server
def start_metrics_server(port: int, addr: str = "0.0.0.0") -> Any | None:
    """Serve /metrics on addr:port in a daemon thread; port 0 disables it (returns None).

    Returns the server (call `.shutdown()` to stop it early). A port it cannot bind is a
    RuntimeError saying so (the CLI prints it as one line)."""
    if not port:
        return None
    from prometheus_client import start_http_server

    try:
        started = start_http_server(port, addr=addr)
    except OSError as exc:  # most often: another agent on this host serves its metrics there
        raise RuntimeError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc} (another process on "
                           f"this port? give this one another: --metrics-port, or GPULEDGER_*_METRICS_PORT)") from None
    server = started[0] if isinstance(started, tuple) else started  # (server, thread) since 0.17
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server


def serve_scheduler_agent_metrics(port: int, spool_name: str) -> AgentMetrics | None:
    """A scheduler agent's /metrics on `port` (0: none, returns None): the metrics of its spool
    `spool_name`, to pass to the spool; the agent then `SCHEDULER_AGENTS.attach`es its stats."""
    if not port:
        return None
    start_metrics_server(port)
    return AgentMetrics(spool_name)


# --------------------------------------------------------------------------- helpers
def consumer_lag(end_offset: int, position: int) -> int | None:
    """Messages between a consumer's position (the next offset it will read) and the partition's
    end offset (high watermark); None when either is unknown (negative: librdkafka's
    OFFSET_INVALID and friends)."""
    if end_offset < 0 or position < 0:
        return None
    return max(0, end_offset - position)


#: the (topic, partition)s each component has a gpuledger_consumer_lag_messages series for
_LAG_SERIES: dict[str, set[tuple[str, int]]] = {}
_LAG_LOCK = threading.Lock()

#: how often the worker (streams/app.py) and the sink (gpuledger/sink/loop.py) measure their lag,
#: seconds: a timer, never per message (one end-offset request per assignment each time at most)
LAG_EVERY_S = 1.0


def set_consumer_lag(component: str, topic: str, partition: int, end_offset: int, position: int) -> int | None:
    lag = consumer_lag(end_offset, position)
    if lag is not None:
        CONSUMER_LAG.labels(component, topic, str(partition)).set(lag)
        with _LAG_LOCK:
            _LAG_SERIES.setdefault(component, set()).add((topic, partition))
    return lag


def forget_consumer_lag(component: str, keep: Iterable[tuple[str, int]] = ()) -> None:
    """Drop the component's lag series of partitions not in `keep` (no longer assigned: another
    member reports them now, and a stale value would count twice in `sum by (component)`)."""
    keep = set(keep)
    with _LAG_LOCK:
        gone = _LAG_SERIES.get(component, set()) - keep
        _LAG_SERIES.setdefault(component, set()).difference_update(gone)
    for topic, partition in gone:
        try:
            CONSUMER_LAG.remove(component, topic, str(partition))
        except KeyError:
            pass


def update_consumer_lag(component: str, consumer: Any, *, cached: bool = True, timeout_s: float = 5.0) -> dict[tuple[str, int], int]:
    """Lag of every partition assigned to a confluent-kafka Consumer.

    `cached=True` uses the end offsets librdkafka learnt from its last fetch responses (no
    broker round trip, cheap enough for every loop); a partition it knows nothing of yet is
    asked with `cached=False` once. Returns {(topic, partition): lag}."""
    out: dict[tuple[str, int], int] = {}
    try:
        assignment = consumer.assignment()
        forget_consumer_lag(component, ((tp.topic, tp.partition) for tp in assignment))
        if not assignment:
            return out
        positions = consumer.position(assignment)
    except Exception as exc:  # e.g. a rebalance in progress: try again next time
        log.debug("cannot read consumer positions: %s", exc)
        return out
    for tp in positions:
        try:
            _low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s, cached=cached)
            if high < 0 and cached:
                _low, high = consumer.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
        except Exception as exc:
            log.debug("cannot read the end offset of %s[%d]: %s", tp.topic, tp.partition, exc)
            continue
        lag = set_consumer_lag(component, tp.topic, tp.partition, high, tp.offset)
        if lag is not None:
            out[(tp.topic, tp.partition)] = lag
    return out


def dead_letter_kind(reason: str) -> str:
    """A small, fixed set of label values for a dead letter's free-text reason.

    'late' is input that came after its time was closed: a tick behind the node's closed horizon
    ("late tick: ...", an agent's spool draining after an outage), an allocation change beyond the
    retention ("too late: ..."). Everything else is 'invalid'. Silent duplicates are no dead
    letters (gpuledger_duplicates_total); a conflicting duplicate or an overlapping tick is
    'invalid'. 'duplicate' is kept for a reason starting with the word; the ledger writes none."""
    lowered = reason.lower()
    if lowered.startswith("duplicate"):
        return "duplicate"
    if lowered.startswith(("late", "too late")):
        return "late"
    return "invalid"


def _safe(read: Callable[[], float]) -> Callable[[], float]:
    """A gauge callback that never breaks a scrape (e.g. read after the spool was closed)."""
    def value() -> float:
        try:
            return float(read())
        except Exception:
            return float("nan")
    return value


# --------------------------------------------------------------------------- per component
class AgentMetrics:
    """The GPU agent's metrics for one node. `attach_spool` makes spool depth, bytes, oldest age
    and lifetime drops read live from the spool at scrape time."""

    def __init__(self, node: str, cluster: str = ""):
        self.node = node
        self.cluster = cluster
        self._sampled = AGENT_TICKS_SAMPLED.labels(node)
        self._failures = AGENT_TICK_FAILURES.labels(node)
        self._skipped = AGENT_TICKS_SKIPPED.labels(node)
        self._published = AGENT_PUBLISHED.labels(node)
        self._delivery_failures = AGENT_DELIVERY_FAILURES.labels(node)
        self._dropped = AGENT_SPOOL_DROPPED.labels(node)

    def tick_sampled(self, ts_ms: int) -> None:
        self._sampled.inc()
        LAST_SAMPLE.observe("agent", self.node, ts_ms, self.cluster)

    def tick_failed(self) -> None:
        self._failures.inc()

    def ticks_skipped(self, n: int) -> None:
        self._skipped.inc(n)

    def published(self, n: int = 1) -> None:
        self._published.inc(n)

    def delivery_failed(self, n: int = 1) -> None:
        self._delivery_failures.inc(n)

    def spool_dropped(self, n: int) -> None:
        self._dropped.inc(n)

    def attach_spool(self, spool: Any, forwarder: Any = None, clock: Callable[[], float] = time.time) -> None:
        node = self.node

        def oldest_age() -> float:
            ms = spool.oldest_unacked_ms()
            return 0.0 if ms is None else max(0.0, clock() - ms / 1000.0)

        AGENT_SPOOL_RECORDS.labels(node).set_function(_safe(lambda: spool.depth))
        AGENT_SPOOL_BYTES.labels(node).set_function(_safe(lambda: spool.bytes))
        AGENT_SPOOL_MAX_BYTES.labels(node).set(spool.max_bytes)
        AGENT_SPOOL_DROPPED_LIFETIME.labels(node).set_function(_safe(lambda: spool.dropped))
        AGENT_SPOOL_OLDEST_AGE.labels(node).set_function(_safe(oldest_age))
        AGENT_SPOOL_FSYNC_FAILURES.labels(node).set_function(_safe(lambda: spool.fsync_failures))
        if forwarder is not None:
            AGENT_INFLIGHT.labels(node).set_function(_safe(lambda: forwarder.inflight))
            AGENT_PRODUCER_FAILURES.labels(node).set_function(_safe(lambda: forwarder.producer_failures))


class WorkerMetrics:
    """The Faust worker's metrics (component="worker")."""

    component = "worker"

    def message_in(self, topic: str) -> None:
        MESSAGES_IN.labels(self.component, topic).inc()

    def message_out(self, topic: str, n: int = 1) -> None:
        MESSAGES_OUT.labels(self.component, topic).inc(n)

    def dead_letter(self, source_topic: str, reason: str) -> None:
        DEAD_LETTERS.labels(self.component, source_topic, dead_letter_kind(reason)).inc()

    def sample_seen(self, node: str, ts_ms: int, cluster: str = "") -> None:
        LAST_SAMPLE.observe(self.component, node, ts_ms, cluster)

    def forget_nodes(self, nodes: Iterable[tuple[str, str]]) -> None:
        """The (cluster, node)s of a partition revoked from this worker, or of a node the core retired:
        their last-sample series go (the new owner reports them; kept, they grew old here and the node
        looked silent; a retired node was silent for the retention and holds nothing)."""
        LAST_SAMPLE.forget(self.component, nodes)

    def duplicate(self, kind: str) -> None:
        """A second copy dropped: kind "tick" or "change"."""
        DUPLICATES.labels(self.component, kind).inc()

    def unmatched(self, kind: str, amount: float) -> None:
        """Something the join could not match (streams/join.py `NodeJoin.unmatched`); the same
        counters carry value fallbacks ('fallback_<kind>') and GPU time priced by default
        ('priced_by_default:<model>'), which go to metrics of their own."""
        if kind.startswith("fallback_"):
            VALUE_FALLBACKS.labels(self.component, kind[len("fallback_"):]).inc(amount)
        elif kind.startswith("priced_by_default:"):
            PRICED_BY_DEFAULT.labels(self.component, kind[len("priced_by_default:"):]).inc(amount)
        else:
            UNMATCHED.labels(self.component, kind).inc(amount)

    def snapshot_written(self, kind: str, partition: int, size: int) -> None:
        SNAPSHOT_BYTES.labels(kind, str(partition)).set(size)

    def samples_paused(self, partition: int, paused: bool) -> None:
        SAMPLES_PAUSED.labels(str(partition)).set(1 if paused else 0)

    def set_lag(self, topic: str, partition: int, end_offset: int, position: int) -> int | None:
        """From the worker's `measure_lag` timer (streams/app.py): `end_offset` the partition's end
        offset, `position` the offset after the last message read."""
        return set_consumer_lag(self.component, topic, partition, end_offset, position)


class SinkMetrics:
    """The sink's metrics (component="sink")."""

    component = "sink"

    def __init__(self) -> None:
        self._lag_at = float("-inf")  # when measure_lag last measured

    def message_in(self, topic: str) -> None:
        MESSAGES_IN.labels(self.component, topic).inc()

    def dead_letter(self, source_topic: str, reason: str, letter_topic: str) -> None:
        """A letter produced to `letter_topic`: the topic's own (prefixed) name, as the worker counts
        its letters, so one topic is one series (it was "dead-letters" here)."""
        DEAD_LETTERS.labels(self.component, source_topic, dead_letter_kind(reason)).inc()
        MESSAGES_OUT.labels(self.component, letter_topic).inc()

    def duplicate(self, n: int = 1) -> None:
        """Second copies dropped: messages the warehouse already held, health rows sent again, usage
        records and job events a restarted worker emitted again."""
        DUPLICATES.labels(self.component, "row").inc(n)

    def batch_flushed(self, written: Mapping[str, int]) -> None:
        """After a successful flush: `written` is BatchingSink.flush()'s rows per table."""
        if written:
            SINK_BATCHES.inc()
            SINK_BATCH_ROWS.observe(sum(written.values()))

    def update_consumer_lag(self, consumer: Any, **kw: Any) -> dict[tuple[str, int], int]:
        return update_consumer_lag(self.component, consumer, **kw)

    def measure_lag(self, consumer: Any, paused: bool = False) -> None:
        """Called by the sink's poll loop at every turn; measures at most every LAG_EVERY_S. The
        partitions paused during a warehouse outage are not fetched, so librdkafka's cached end
        offsets stop moving: then the broker is asked (cached=False)."""
        now = time.monotonic()
        if now - self._lag_at >= LAG_EVERY_S:
            self._lag_at = now
            self.update_consumer_lag(consumer, cached=not paused, timeout_s=1.0)


class InstrumentedWriter:
    """Wraps a sink `Writer`: counts rows inserted and failed insert attempts per table, and
    times each insert. Failures are re-raised unchanged (the sink retries them)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def write(self, table: str, rows: list[dict], token: str | None = None) -> None:
        started = time.perf_counter()
        try:
            self.inner.write(table, rows, token=token)  # the token is what makes a retried block exactly-once
        except Exception:
            SINK_INSERT_FAILURES.labels(table).inc()
            raise
        finally:
            SINK_INSERT_SECONDS.labels(table).observe(time.perf_counter() - started)
        SINK_ROWS.labels(table).inc(len(rows))


_worker = WorkerMetrics()
_sink = SinkMetrics()


def worker_metrics() -> WorkerMetrics:
    return _worker


def sink_metrics() -> SinkMetrics:
    return _sink


def observe_sink_batch(written: Mapping[str, int]) -> None:
    """Shorthand for `sink_metrics().batch_flushed(written)`."""
    _sink.batch_flushed(written)
