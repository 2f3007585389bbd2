"""`gpuledger agent kubernetes`: a Kubernetes cluster's GPU pods and Kueue queues -> the ledger.

Why one file: the agent's I/O edge (watches, PodResources, state file, publishing, its CLI) around
one loop; each part is short and they share the loop's lifecycle.

The I/O edge around the pure core (agents/kubernetes.py):
- list + watch (with resourceVersion, bookmarks, a fresh list after 410 Gone, a reconnect from the
  last resourceVersion after a dropped connection) of pods and, with Kueue, Workloads,
  ClusterQueues and LocalQueues, through the official `kubernetes` client, one thread per resource;
- the GPU device ids of each container from the kubelet PodResources API: this node's socket
  (`--pod-resources-socket`, for the pods on `--node`), and/or the per-node reporters
  (`--device-endpoint`, each node running `gpuledger agent kubernetes --serve-pod-resources`);
- publishing through the GPU agent's disk spool (agents/spool.py), so a Kafka outage loses nothing;
- a state file, written after each cycle's events are spooled and before its watermark is sent, so
  a restarted agent neither loses nor repeats events (repeats carry the same ids anyway).

Run one agent per cluster: it is the only producer of lifecycle watermarks, and a watermark is a
promise about everything on the job-events topic (docs/kubernetes.md, "Deployment").
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence

import orjson

from gpuledger.agents.kubernetes import (
    STATE_VERSION,
    KubernetesLedger,
    KubernetesMapping,
    MalformedObject,
    asks_for_gpus,
    metadata,
    relist_steps,
    workload_job_identity,
)
from gpuledger.agents.publisher import is_too_large
from gpuledger.schemas.wire import encode

log = logging.getLogger(__name__)

KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta1"
#: (kind, plural) of the Kueue objects read; LocalQueues first so queue names resolve.
KUEUE_RESOURCES = (("localqueue", "localqueues"), ("clusterqueue", "clusterqueues"), ("workload", "workloads"))
SPOOL_NAME = "kubernetes-agent"  # the spool is DATA_DIR/spool/kubernetes-agent-<cluster> (`spool_name`)
SPOOL_TOPIC = "gpuledger-kubernetes-agent"   # the spool's own label; each record names its real topic


# --------------------------------------------------------------------------- publishing
def encode_route(topic: str, key: str | bytes | None, partition: int | None) -> bytes:
    """A spool record's key: where the message goes (the spool keeps one ordered queue for
    job events, their watermarks to every partition, and snapshots)."""
    return orjson.dumps([topic, partition, key.decode() if isinstance(key, bytes) else key])


def decode_route(raw: bytes) -> tuple[str, str | None, int | None]:
    topic, partition, key = orjson.loads(raw)
    return topic, key, partition


class RoutingPublisher:
    """What the spool's forwarder publishes through: sends each record where its key says."""

    def __init__(self, inner: Any):
        self.inner = inner

    def publish(self, topic: str, key: bytes | None, value: bytes, partition: int | None = None,
                on_delivery: Any = None) -> None:
        real_topic, real_key, real_partition = decode_route(key or b"")
        self.inner.publish(real_topic, real_key, value, partition=real_partition, on_delivery=on_delivery)

    def __getattr__(self, name: str) -> Any:  # poll, flush, close, pending, fatal_error
        return getattr(self.inner, name)


class SpooledRoutes:
    """`publish(topic, key, value, partition)` into the disk spool (one record per message).

    A message the spool refuses (disk full or failing) is held in memory, in order with the ones
    after it, and spooled again at each `retry()`. While any is held the agent neither saves its
    state nor sends a watermark (`KubernetesAgent.cycle`): the state file must only ever say what is
    on disk, so a restart meanwhile derives the held events again from its last saved state."""

    def __init__(self, spooling: Any):
        self.spooling = spooling
        self.held: collections.deque[tuple[bytes, bytes]] = collections.deque()

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> None:
        self.held.append((encode_route(topic, key, partition), value))
        if len(self.held) == 1 and self.retry():  # behind held ones it waits for the next retry: order is kept
            log.error("the spool refused a message (disk full or failing?); holding it and what follows in "
                      "memory, no state saved and no watermark sent until the spool takes them")

    def retry(self) -> int:
        """Spool the held messages in order until the spool refuses one; returns how many are held."""
        was = len(self.held)
        while self.held:
            route, value = self.held[0]
            if not self.spooling.publish(SPOOL_TOPIC, route, value):
                break
            self.held.popleft()
        if was > 1 and not self.held:
            log.warning("the spool takes messages again: %d held message(s) spooled", was)
        return len(self.held)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def close(self, timeout: float = 10.0) -> int:
        return self.spooling.close(timeout)


class DirectPublisher:
    """Straight to Kafka, without the spool (GPULEDGER_AGENT_SPOOL_MAX_BYTES=0). A message the producer
    refuses for its size (over its `message.max.bytes`, EVENT_PRODUCER_OVERRIDES: the allocation of a JobSet
    on more than ~70,000 GPUs) can never be sent: it is dropped, logged at ERROR with its topic, key and size, and counted
    in `unsendable`, as the spool's forwarder does, instead of stopping the agent. A broker's refusal
    comes later in a delivery report, which KafkaPublisher logs and counts in `failed`."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.unsendable = 0

    def publish(self, topic: str, key: str | bytes | None, value: bytes, partition: int | None = None) -> None:
        try:
            self.inner.publish(topic, key, value, partition=partition)
        except Exception as exc:
            if not is_too_large(exc):
                raise
            self.unsendable += 1
            log.error("dropped a message to %s (key %r, %d bytes): larger than the producer's message limit "
                      "(%s); %d dropped so far", topic, key, len(value), exc, self.unsendable)

    def __getattr__(self, name: str) -> Any:  # poll, flush, close, produced, failed
        return getattr(self.inner, name)


def spool_name(cluster: str) -> str:
    """One spool per cluster, as the state file: two clusters' agents may share a data volume. The
    spool's directory keeps only the characters [A-Za-z0-9._-] of its name (gpu_agent.spool_dir), so
    a cluster name with others also carries a digest of itself: 'a b' and 'a_b' spool apart."""
    from gpuledger.agents.gpu_agent import agent_file_name

    return agent_file_name(SPOOL_NAME, cluster)


def adopt_shared_spool(settings: Any, cluster: str) -> None:
    """Spools of earlier versions the cluster's agent takes over whole (one rename) and sends what is
    left in: agents before 2026-12-06 spooled every cluster into DATA_DIR/spool/kubernetes-agent (a
    second cluster's agent on the same volume was refused), and those before `spool_name`'s digest
    spooled a cluster named with other characters than [A-Za-z0-9._-] into the directory of its name
    with those as '_'. Their records name their own topics and keys, so any agent may send them; one
    in use (another agent holds its lock) is left alone."""
    from gpuledger.agents.gpu_agent import spool_dir
    from gpuledger.agents.spool import take_over_spool

    own = spool_dir(settings, spool_name(cluster))
    for earlier in (spool_dir(settings, f"{SPOOL_NAME}-{cluster}"), spool_dir(settings, SPOOL_NAME)):
        if earlier != own and earlier.is_dir() and not own.exists():
            take_over_spool(earlier, own)


def open_publisher(settings: Any, cluster: str, metrics: Any = None) -> Any:
    """The durable publisher: the GPU agent's spool (GPULEDGER_AGENT_SPOOL_*), forwarded to Kafka.
    `metrics`: an AgentMetrics for the spool's depth and deliveries (optional). Raises SpoolLocked
    when another agent of the cluster holds the spool."""
    from gpuledger.agents.gpu_agent import open_spooled_publisher
    from gpuledger.agents.publisher import EVENT_PRODUCER_OVERRIDES, SPOOL_PRODUCER_OVERRIDES, KafkaPublisher

    if settings.agent_spool_max_bytes <= 0:
        return DirectPublisher(KafkaPublisher(settings, **EVENT_PRODUCER_OVERRIDES))
    adopt_shared_spool(settings, cluster)
    spooling = open_spooled_publisher(
        settings, spool_name(cluster), topic=SPOOL_TOPIC, metrics=metrics,
        publisher_factory=lambda: RoutingPublisher(KafkaPublisher(settings, **SPOOL_PRODUCER_OVERRIDES,
                                                                  **EVENT_PRODUCER_OVERRIDES)))
    return SpooledRoutes(spooling)


# --------------------------------------------------------------------------- device ids
class DeviceSource:
    """Per-cycle view of the nodes' PodResources: `lookup(node, namespace, pod, host_ip)`.

    `local`: a PodResourcesClient for this node (`node`); `endpoint`: a URL template with
    {node} and/or {host_ip} of the per-node reporters (`--serve-pod-resources`). Each node is asked
    at most once per cycle; a node that cannot be asked reports None (the pod waits)."""

    def __init__(self, mapping: KubernetesMapping, *, local: Any = None, node: str | None = None,
                 endpoint: str | None = None, timeout_s: float = 5.0):
        self.mapping = mapping
        self.local, self.node, self.endpoint, self.timeout_s = local, node, endpoint, timeout_s
        self._cache: dict[str, dict | None] = {}
        self.failures = 0

    @property
    def configured(self) -> bool:
        return self.local is not None or self.endpoint is not None

    def begin_cycle(self) -> None:
        self._cache.clear()

    def _node_table(self, node: str, host_ip: str | None) -> dict | None:
        if node in self._cache:
            return self._cache[node]
        table = None
        try:
            if self.local is not None and node == self.node:
                table = self.local.list(self.mapping.is_gpu_resource)
            elif self.endpoint is not None and (host_ip or "{host_ip}" not in self.endpoint):
                if host_ip and ":" in host_ip and "[{host_ip}]" not in self.endpoint:
                    host_ip = f"[{host_ip}]"  # an IPv6 address in a URL goes in brackets
                url = self.endpoint.format(node=node, host_ip=host_ip)
                with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                    body = json.loads(response.read())
                table = {(p["namespace"], p["name"]): p["containers"] for p in body["pods"]}
        except Exception as exc:  # the node's kubelet or reporter is unreachable: its pods wait
            self.failures += 1
            log.warning("pod resources of node %s: %s", node, exc)
        self._cache[node] = table
        return table

    def lookup(self, node: str, namespace: str, name: str, host_ip: str | None) -> dict[str, list[str]] | None:
        table = self._node_table(node, host_ip)
        return None if table is None else table.get((namespace, name))


def serve_pod_resources(address: tuple[str, int], client: Any, mapping: KubernetesMapping) -> ThreadingHTTPServer:
    """The per-node reporter: GET /pod-resources -> {"pods": [{"namespace", "name", "containers":
    {container: [device ids]}}]} from this node's kubelet. Returns the started server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/pod-resources":
                self.send_error(404)
                return
            try:
                listed = client.list(mapping.is_gpu_resource)
            except Exception as exc:
                self.send_error(503, f"kubelet PodResources: {exc}")
                return
            body = orjson.dumps({"pods": [{"namespace": ns, "name": name, "containers": containers}
                                          for (ns, name), containers in sorted(listed.items())]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("reporter: " + fmt, *args)

    server = (_Ipv6HttpServer if ":" in address[0] else ThreadingHTTPServer)(address, Handler)
    threading.Thread(target=server.serve_forever, name="pod-resources-reporter", daemon=True).start()
    return server


class _Ipv6HttpServer(ThreadingHTTPServer):
    """On an IPv6 address (`::` also takes IPv4 where the host allows both, Linux's default)."""

    address_family = socket.AF_INET6


def listen_address(text: str) -> tuple[str, int]:
    """`--serve-pod-resources` HOST:PORT: `0.0.0.0:9478`, `:9478` (every IPv4 address), `[::]:9478` (every
    address, IPv6 and IPv4) or `[fd00::1]:9478`. ValueError, with what was wrong, otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or "[" in host or "]" in host:
        raise ValueError(f"--serve-pod-resources {text!r}: give HOST:PORT, e.g. 0.0.0.0:9478 or [::]:9478")
    return host or "0.0.0.0", int(port)


# --------------------------------------------------------------------------- watching
class Watcher(threading.Thread):
    """List, then watch from the list's resourceVersion, for ever. Puts on `out`:
    ("sync", kind, items, t) after each list (t: when it was asked), ("event", kind, type, object, t),
    and ("fresh", kind, t) for a bookmark or a watch window that ended cleanly (everything the
    server had until t was delivered). 410 Gone (an expired resourceVersion, or an expired continue
    token in a paged list) -> list again; a dropped connection or an error -> watch again from the
    last resourceVersion seen. Lists are read in pages of `page_size` objects (the API server's
    limit/continue: one consistent snapshot, served in parts); objects `keep` says no to (pods
    that ask for no GPU) are dropped from the lists and the watch as they arrive."""

    def __init__(self, kind: str, list_fn: Callable[..., Any], args: tuple, out: queue.Queue, stop: threading.Event, *,
                 timeout_s: float = 30.0, clock: Callable[[], float] = time.time, raw_list: bool = False,
                 optional: bool = False, page_size: int = 500, keep: Callable[[Any], bool] | None = None):
        super().__init__(name=f"watch-{kind}", daemon=True)
        self.optional = optional  # a 404 (the resource's CRD is not installed) means: do without it
        self.kind, self.list_fn, self.args, self.out, self.stop = kind, list_fn, args, out, stop
        self.timeout_s, self.clock, self.raw_list = timeout_s, clock, raw_list
        self.page_size, self.keep = page_size, keep
        self.resource_version: str | None = None
        self.relists = 0
        self.reconnects = 0
        self.pages = 0
        self._watch: Any = None

    def _list(self) -> tuple[list, str]:
        items: list = []
        token = None
        while True:
            paging = {"limit": self.page_size, **({"_continue": token} if token else {})}
            if self.raw_list:  # CoreV1Api: raw JSON, not the client's models
                response = self.list_fn(*self.args, _preload_content=False, _request_timeout=self.timeout_s + 15,
                                        **paging)
                body = orjson.loads(response.data)
            else:
                body = self.list_fn(*self.args, _request_timeout=self.timeout_s + 15, **paging)
            self.pages += 1
            page = body.get("items") or []
            items += page if self.keep is None else [obj for obj in page if self.keep(obj)]
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items, body["metadata"]["resourceVersion"]

    def run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        while not self.stop.is_set():
            try:
                if self.resource_version is None:
                    asked = self.clock()
                    items, self.resource_version = self._list()
                    self.out.put(("sync", self.kind, items, asked))
                # return_type "object": events as the API's JSON, not the client's models (and the
                # client still turns an ERROR event into an ApiException, which deserialize=False breaks)
                self._watch = watch.Watch(return_type="object")
                for event in self._watch.stream(self.list_fn, *self.args, resource_version=self.resource_version,
                                                timeout_seconds=max(1, int(self.timeout_s)),
                                                allow_watch_bookmarks=True, _request_timeout=self.timeout_s + 15):
                    kind, obj = event.get("type"), event.get("raw_object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion") if isinstance(obj, dict) else None
                    self.resource_version = rv or self.resource_version
                    if kind == "BOOKMARK":
                        self.out.put(("fresh", self.kind, self.clock()))
                    elif kind in ("ADDED", "MODIFIED", "DELETED") and (self.keep is None or self.keep(obj)):
                        self.out.put(("event", self.kind, kind, obj, self.clock()))
                    if self.stop.is_set():
                        break
                else:
                    self.out.put(("fresh", self.kind, self.clock()))
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch %s: resourceVersion %s expired (410); listing again", self.kind,
                             self.resource_version)
                    self.resource_version = None
                    self.relists += 1
                    continue
                if exc.status == 404 and self.optional:
                    log.error("%s: not served by the API server (404: is Kueue installed?); going on without it "
                              "(--no-kueue skips it)", self.kind)
                    self.out.put(("absent", self.kind))
                    return
                log.warning("watch %s: API error %s %s; retrying in %.1f s", self.kind, exc.status, exc.reason, backoff)
                self.reconnects += 1
                self.stop.wait(backoff)
                backoff = min(30.0, backoff * 2)
            except Exception as exc:  # a dropped connection, a timeout, the API server away
                if self.stop.is_set():
                    break  # halt() cut the connection
                log.warning("watch %s: %s: %s; reconnecting from resourceVersion %s", self.kind,
                            type(exc).__name__, exc, self.resource_version)
                self.reconnects += 1
                self.stop.wait(backoff)
                backoff = min(30.0, backoff * 2)

    def halt(self) -> None:
        if self._watch is not None:
            self._watch.stop()


# --------------------------------------------------------------------------- the agent
def workload_job_of(workload: dict) -> str:
    _, _, namespace, name = metadata(workload)
    return workload_job_identity(workload, namespace, name)


def _side_path(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write a temporary file, fsync it, rename it over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _side_path(path, ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StateFile:
    """The agent's state on disk, written at a cost that follows what changed, not the cluster's size.

    - `<path>`: the whole state (`KubernetesLedger.state_bytes` plus a `generation`), replaced
      atomically: at the first save, at shutdown, and whenever the journal has outgrown it;
    - `<path>.journal`: one fsynced line per later save, holding only the entries (pods, jobs,
      local queues) that changed or went since the save before, and the watermark. Lines of
      another generation than the whole state's are left from before its last rewrite (a crash
      between the rename and the journal's truncation) and are not read.

    On a 100,000-GPU cluster the whole state is ~20 MB; rewriting it at each 1-s cycle that changed
    anything cost up to ~20 MB/s of disk writes (docs/kubernetes.md, "What a save writes")."""

    JOURNAL_MIN_BYTES = 1 << 20   # below this the journal is never worth a rewrite

    def __init__(self, path: Path):
        self.path = path
        self.journal_path = _side_path(path, ".journal")
        self._written: dict[str, dict[str, bytes]] | None = None   # entries as the files hold them
        self._generation = ""
        self._whole_bytes = 0
        self._journal_bytes = 0
        self.whole_writes = 0
        self.journal_lines = 0
        self.bytes_written = 0   # both files, since the start: the agent's disk write rate

    def load(self) -> dict | None:
        """The saved state (None: nothing saved): the whole state, its journal's lines, and the
        watermark side file of agents before the journal."""
        try:
            state = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            state = None
        generation = (state or {}).pop("generation", None)
        try:
            with open(self.journal_path, "rb") as f:
                for line in f:
                    try:
                        entry = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        break   # a line cut short by a crash: the last one, never acknowledged
                    if not isinstance(entry, dict):
                        raise ValueError(f"{self.journal_path}: a journal line is not an object")
                    if entry.get("generation") != generation:
                        continue
                    state = _apply_journal_line(state, entry)
        except FileNotFoundError:
            pass
        try:
            mark = int(_side_path(self.path, ".watermark").read_text())
        except (FileNotFoundError, ValueError):
            return state
        state = state or _empty_state()
        state["watermark_ms"] = max(int(state.get("watermark_ms", 0)), mark)
        return state

    def save(self, core: KubernetesLedger, *, whole: bool = False) -> None:
        """The core's state, durably: a journal line of what changed, or the whole state."""
        entries = {name: {key: orjson.dumps(value) for key, value in section.items()}
                   for name, section in core.state_sections().items()}
        if whole or self._written is None or self._journal_bytes > max(self._whole_bytes, self.JOURNAL_MIN_BYTES):
            self._save_whole(core.watermark_ms, entries)
        else:
            changed = {name: {key: orjson.Fragment(raw) for key, raw in section.items()
                              if self._written[name].get(key) != raw}
                       for name, section in entries.items()}
            gone = {name: [key for key in self._written[name] if key not in section]
                    for name, section in entries.items()}
            self._append({"generation": self._generation, "watermark_ms": core.watermark_ms,
                          "set": {n: c for n, c in changed.items() if c}, "gone": {n: g for n, g in gone.items() if g}})
        self._written = entries

    def save_watermark(self, watermark_ms: int) -> None:
        """Only the watermark moved: a line of a few dozen bytes."""
        if self._written is None:
            raise RuntimeError("save the whole state before its watermark")
        self._append({"generation": self._generation, "watermark_ms": watermark_ms})

    def _save_whole(self, watermark_ms: int, entries: dict[str, dict[str, bytes]]) -> None:
        self._generation = f"{time.time_ns():x}-{os.getpid()}"
        data = orjson.dumps({"version": STATE_VERSION, "generation": self._generation, "watermark_ms": watermark_ms,
                             **{name: {key: orjson.Fragment(raw) for key, raw in section.items()}
                                for name, section in entries.items()}})
        _write_atomically(self.path, data)
        with open(self.journal_path, "wb"):
            pass   # its lines belong to the generation just replaced
        _side_path(self.path, ".watermark").unlink(missing_ok=True)
        self._whole_bytes, self._journal_bytes = len(data), 0
        self.whole_writes += 1
        self.bytes_written += len(data)

    def _append(self, line: dict) -> None:
        data = orjson.dumps(line) + b"\n"
        with open(self.journal_path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._journal_bytes += len(data)
        self.journal_lines += 1
        self.bytes_written += len(data)


def _empty_state() -> dict:
    return {"version": STATE_VERSION, "watermark_ms": 0, "pods": {}, "jobs": {}, "local_queues": {}}


def _apply_journal_line(state: dict | None, line: dict) -> dict:
    state = state or _empty_state()
    for name, items in line.get("set", {}).items():
        state.setdefault(name, {}).update(items)
    for name, keys in line.get("gone", {}).items():
        for key in keys:
            state.get(name, {}).pop(key, None)
    state["watermark_ms"] = max(int(state.get("watermark_ms", 0)), int(line["watermark_ms"]))
    return state


def load_state(path: Path) -> dict | None:
    """The state saved at `path` (StateFile.load)."""
    return StateFile(path).load()


class KubernetesAgent:
    """Drives the core from the watchers' queue; publishes events, snapshots and watermarks."""

    def __init__(self, core: KubernetesLedger, publisher: Any, *, job_events_topic: str, snapshots_topic: str,
                 job_event_partitions: int, devices: DeviceSource, state_path: Path | None,
                 snapshot_interval_s: float = 30.0, snapshots: bool = True, cycle_s: float = 1.0,
                 clock: Callable[[], float] = time.time):
        self.core, self.publisher, self.devices = core, publisher, devices
        self.job_events_topic, self.snapshots_topic = job_events_topic, snapshots_topic
        self.partitions = job_event_partitions
        self.state_file = StateFile(state_path) if state_path is not None else None
        self.snapshot_interval_s, self.snapshots = snapshot_interval_s, snapshots
        self.cycle_s, self.clock = cycle_s, clock
        self.queue: queue.Queue = queue.Queue()
        self.kinds: list[str] = []
        self.fresh: dict[str, float] = {}
        self.synced: set[str] = set()
        self.known: dict[str, dict[str, dict]] = {}   # kind -> uid -> last object seen
        self.absent: set[str] = set()                 # optional resources the API server does not serve
        self.dirty = True                              # the core's saved state is behind
        self.skipped = 0
        self.published_events = 0
        self._last_snapshot = 0.0
        self.kueue_sync_timeout_s = 30.0  # pods wait this long for the queues to be known
        self.watchers: list[Watcher] = []

    def stats(self) -> dict[str, float]:
        """What its metrics show (gpuledger.metrics.SCHEDULER_STATS), read from another thread."""
        watchers = list(self.watchers)
        return {"watermark_timestamp_seconds": self.core.watermark_ms / 1000, "events_published": self.published_events,
                "jobs_tracked": len(self.core.jobs), "objects_skipped": self.skipped,
                "watch_relists": sum(w.relists for w in watchers),
                "watch_reconnects": sum(w.reconnects for w in watchers),
                "pods_waiting_for_devices": self.core.waiting_count(),
                "state_bytes_written": self.state_file.bytes_written if self.state_file is not None else 0}

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ------------------------------------------------------------------ one object
    def _lookup(self, node: str, namespace: str, name: str, host_ip: str | None) -> dict | None:
        return self.devices.lookup(node, namespace, name, host_ip)

    def _apply(self, kind: str, change: str, obj: dict) -> list:
        """One ADDED/MODIFIED/DELETED object into the core. A malformed one is logged and skipped."""
        known, uid, remembered = None, None, None
        try:
            _, uid, namespace, name = metadata(obj)
            known = self.known.setdefault(kind, {})
            remembered = known.get(uid)
            if change == "DELETED":
                known.pop(uid, None)
            else:
                known[uid] = obj
            now = self.now_ms()
            if kind == "pod":
                tracked = uid in self.core.pods
                if change == "DELETED":
                    events = self.core.pod_deleted(obj, now, self._lookup)
                else:
                    events = self.core.observe_pod(obj, now, self._lookup)
                if uid not in self.core.pods:
                    known.pop(uid, None)  # not a GPU pod (or gone): nothing to remember
                self.dirty = self.dirty or tracked or uid in self.core.pods
                return events
            if kind == "workload":
                if change == "DELETED":
                    events = self.core.workload_deleted(obj, now)
                    self.dirty = self.dirty or bool(events)
                    return events
                events = self.core.observe_workload(obj, now)
                self.dirty = self.dirty or bool(events) or self.core.jobs.get(workload_job_of(obj)) is not None
                return events
            if kind == "clusterqueue":
                (self.core.cluster_queue_deleted if change == "DELETED" else self.core.observe_cluster_queue)(obj)
            elif kind == "localqueue":
                (self.core.local_queue_deleted if change == "DELETED" else self.core.observe_local_queue)(obj)
                self.dirty = True
            return []
        except MalformedObject as exc:
            self.skipped += 1
            log.warning("skipped a malformed %s: %s", kind, exc)
        except Exception:  # a shape the core did not foresee: skip the object, keep the agent up
            self.skipped += 1
            log.exception("skipped a %s the agent could not read", kind)
        # skipped: a relist that misses the object ends it from the last version the core took
        if known is not None and remembered is not None:
            known[uid] = remembered
        elif known is not None:
            known.pop(uid, None)
        return []

    def _sync(self, kind: str, items: list) -> list:
        """A (re)list: objects that vanished since the last view were deleted meanwhile."""
        listed = {}
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid") if isinstance(obj, dict) else None
            if uid:
                listed[uid] = obj
        events = []
        previous = self.known.get(kind, {})
        if kind == "pod":  # pods the saved state knows that no watch saw go
            for uid in sorted(self.core.known_pod_uids() - set(listed)):
                obj = previous.get(uid) or self.core.vanished_pod_object(uid)
                events += self._apply(kind, "DELETED", obj)
        elif kind == "workload":
            # the listed ones first: a vanished Workload that Kueue replaced by a new one of the same
            # job does not cancel the job (KubernetesLedger.workload_deleted)
            first, vanished = kind not in self.known, sorted(set(previous) - set(listed))
            for obj in items:
                events += self._apply(kind, "ADDED", obj)
            for uid in vanished:
                events += self._apply(kind, "DELETED", previous[uid])
            if first:  # after a start: the state saves no Workloads, those deleted meanwhile are found by job
                jobs = set()
                for obj in listed.values():
                    try:
                        jobs.add(workload_job_of(obj))
                    except Exception:  # noqa: BLE001 - _apply has logged and skipped it
                        pass
                gone = self.core.workloads_listed_after_start(jobs, self.now_ms())
                self.dirty = self.dirty or bool(gone)
                events += gone
            self.known.setdefault(kind, {})
            return events
        else:
            for uid in sorted(set(previous) - set(listed)):
                events += self._apply(kind, "DELETED", previous[uid])
        for obj in (relist_steps(items) if kind == "pod" else items):  # pods: their changes in time order
            events += self._apply(kind, "ADDED", obj)
        return events

    # ------------------------------------------------------------------ output
    def _publish_events(self, events: list) -> None:
        for event in events:
            self.publisher.publish(self.job_events_topic, event.job_id, encode(event))
            self.published_events += 1

    def _handle(self, item: tuple) -> None:
        tag, kind = item[0], item[1]
        if tag == "sync":
            _, _, items, asked = item
            self._publish_events(self._sync(kind, items))
            self.synced.add(kind)
            self.fresh[kind] = max(self.fresh.get(kind, 0.0), asked)
        elif tag == "absent":
            self.kinds = [k for k in self.kinds if k != kind]
            self.absent.add(kind)
        elif tag == "event":
            _, _, change, obj, seen = item
            self._publish_events(self._apply(kind, change, obj))
            self.fresh[kind] = max(self.fresh.get(kind, 0.0), seen)
        elif tag == "fresh":
            self.fresh[kind] = max(self.fresh.get(kind, 0.0), item[2])

    def _held(self) -> int:
        """Messages the spool refused that wait in memory (SpooledRoutes), after trying them again."""
        retry = getattr(self.publisher, "retry", None)
        return retry() if retry is not None else 0

    def cycle(self) -> None:
        """The end of a cycle: retry pods waiting for device ids, snapshot, save state, watermark."""
        self.devices.begin_cycle()
        now = self.now_ms()
        for pod in self.core.waiting_pods():
            self._publish_events(self._apply("pod", "MODIFIED", pod))
        if self._held():
            return  # events the spool refused are not on disk: no state over them, no promise after them
        if not self.kinds or set(self.kinds) - self.synced:
            return  # no promise before every resource has been listed once
        if self.snapshots and self.clock() - self._last_snapshot >= self.snapshot_interval_s:
            self._last_snapshot = self.clock()
            snap = self.core.snapshot(now)
            self.publisher.publish(self.snapshots_topic, snap.cluster, encode(snap))
        observed = min([now] + [int(self.fresh.get(k, 0.0) * 1000) for k in self.kinds])
        mark = self.core.watermark(observed)
        if self.state_file is not None:  # before the watermark goes out: a restart never promises less
            if self.dirty:
                self.state_file.save(self.core)
                self.dirty = False
            elif mark is not None:
                self.state_file.save_watermark(mark.ts_ms)
        if mark is not None:
            value = encode(mark)
            for partition in range(self.partitions):
                self.publisher.publish(self.job_events_topic, None, value, partition=partition)
        self.publisher.poll(0)

    def run(self, watchers: list[Watcher], stop: threading.Event) -> None:
        """Start the watchers (Kueue's first, so queue names resolve before pods arrive) and work
        until `stop` is set."""
        self.kinds = [w.kind for w in watchers]
        self.watchers = list(watchers)
        first = [w for w in watchers if w.kind != "pod"]
        for w in first:
            w.start()
        deadline = time.monotonic() + self.kueue_sync_timeout_s
        waiting = lambda: {w.kind for w in first} - self.synced - self.absent  # noqa: E731
        while first and not stop.is_set() and waiting() and time.monotonic() < deadline:
            try:
                self._handle(self.queue.get(timeout=0.1))
            except queue.Empty:
                pass
        if waiting():
            log.warning("Kueue objects not listed after %.0f s; reading pods anyway", self.kueue_sync_timeout_s)
        for w in watchers:
            if w not in first:
                w.start()
        next_cycle = self.clock() + self.cycle_s
        try:
            while not stop.is_set():
                timeout = max(0.0, next_cycle - self.clock())
                try:
                    self._handle(self.queue.get(timeout=timeout))
                    continue  # drain what is waiting before closing the cycle
                except queue.Empty:
                    pass
                self.cycle()
                next_cycle = self.clock() + self.cycle_s
        finally:
            for w in watchers:
                w.halt()
            while True:  # what was already received is not lost: process it, then save
                try:
                    self._handle(self.queue.get_nowait())
                except queue.Empty:
                    break
            held = self._held()
            if self.state_file is not None and held:
                log.error("stopping with %d message(s) the spool refused: the state is not saved, so the "
                          "next start derives them again from the last saved state", held)
            elif self.state_file is not None:
                self.state_file.save(self.core, whole=True)
                self.dirty = False


def make_watchers(api_client: Any, out: queue.Queue, stop: threading.Event, *, kueue: bool, timeout_s: float,
                  mapping: KubernetesMapping, page_size: int = 500,
                  clock: Callable[[], float] = time.time) -> list[Watcher]:
    from kubernetes import client as k8s

    core_api, custom = k8s.CoreV1Api(api_client), k8s.CustomObjectsApi(api_client)
    watchers = []
    if kueue:
        for kind, plural in KUEUE_RESOURCES:
            watchers.append(Watcher(kind, custom.list_cluster_custom_object, (KUEUE_GROUP, KUEUE_VERSION, plural),
                                    out, stop, timeout_s=timeout_s, clock=clock, optional=True, page_size=page_size))
    watchers.append(Watcher("pod", core_api.list_pod_for_all_namespaces, (), out, stop, timeout_s=timeout_s,
                            clock=clock, raw_list=True, page_size=page_size,
                            keep=lambda pod: asks_for_gpus(pod, mapping)))
    return watchers


# --------------------------------------------------------------------------- command line
def api_client_for(api_server: str | None, kubeconfig: str | None) -> Any:
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    if api_server:
        configuration = k8s.Configuration()
        configuration.host = api_server
        return k8s.ApiClient(configuration)
    if kubeconfig:
        return k8s_config.new_client_from_config(config_file=kubeconfig)
    configuration = k8s.Configuration()
    k8s_config.load_incluster_config(client_configuration=configuration)
    return k8s.ApiClient(configuration)


def build_parser(settings: Any) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuledger agent kubernetes",
                                description="Kubernetes pods (+ kubelet PodResources, + Kueue) -> job events, "
                                            "scheduler snapshots and lifecycle watermarks.")
    p.add_argument("--cluster", default=settings.cluster)
    p.add_argument("--api-server", help="API server URL (default: in-cluster config, or --kubeconfig)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"),
                   help="this node's name, for --pod-resources-socket (default $NODE_NAME)")
    p.add_argument("--pod-resources-socket", default=settings.kubernetes_pod_resources_socket,
                   help="kubelet PodResources socket of --node (GPULEDGER_KUBERNETES_POD_RESOURCES_SOCKET)")
    p.add_argument("--device-endpoint", default=settings.kubernetes_device_endpoint,
                   help="URL template of the per-node reporters, e.g. http://{host_ip}:9478/pod-resources "
                        "(GPULEDGER_KUBERNETES_DEVICE_ENDPOINT)")
    p.add_argument("--no-devices", action="store_true",
                   help="no PodResources at all: allocations carry no GPUs (not billable to GPUs)")
    p.add_argument("--serve-pod-resources", metavar="HOST:PORT",
                   help="run as the per-node reporter: serve --pod-resources-socket over HTTP, nothing else")
    p.add_argument("--no-kueue", dest="kueue", action="store_false", default=settings.kubernetes_kueue,
                   help="do not read Kueue objects (queues come from the pods' labels)")
    p.add_argument("--state-file", type=Path, default=settings.kubernetes_state_file,
                   help="the agent's state (default DATA_DIR/kubernetes-agent-<cluster>.json; "
                        "with --print only when given)")
    p.add_argument("--print", dest="print_", action="store_true", help="write messages to stdout instead of Kafka")
    p.add_argument("--metrics-port", type=int, default=settings.agent_metrics_port,
                   help="port of the agent's Prometheus /metrics (default GPULEDGER_AGENT_METRICS_PORT; 0: off)")
    p.add_argument("--log-level", default="INFO")
    return p


def mapping_from(settings: Any, cluster: str, devices_expected: bool) -> KubernetesMapping:
    return KubernetesMapping(
        cluster=cluster, tenant_label=settings.kubernetes_tenant_label, queue_label=settings.kubernetes_queue_label,
        default_queue=settings.kubernetes_default_queue, gpu_resource=settings.kubernetes_gpu_resource,
        time_slicing_replicas=settings.kubernetes_time_slicing_replicas,
        allowed_lateness_ms=round(settings.kubernetes_allowed_lateness_s * 1000),
        device_wait_ms=round(settings.kubernetes_device_wait_s * 1000), devices_expected=devices_expected,
        container_ids=settings.kubernetes_container_ids)


def default_state_path(settings: Any, cluster: str) -> Path:
    """DATA_DIR/<spool_name(cluster)>.json: a cluster named with other characters than [A-Za-z0-9._-]
    gets the spool's digest too (a name of 80 CJK characters is 240 bytes, and with '.journal' over
    a file system's 255). The file earlier versions named with the raw cluster name is still used
    while no file of the new name exists."""
    path = Path(settings.data_dir) / f"{spool_name(cluster)}.json"
    earlier = Path(settings.data_dir) / f"kubernetes-agent-{cluster}.json"
    try:
        if earlier != path and earlier.exists() and not path.exists():
            return earlier
    except OSError:  # a raw name too long for the file system: no such file
        pass
    return path


class _StdoutPublisher:
    def publish(self, topic: str, key: Any, value: bytes, partition: int | None = None) -> None:
        if partition not in (None, 0):
            return  # a watermark once, not once per partition
        sys.stdout.write(value.decode() + "\n")
        sys.stdout.flush()

    def poll(self, timeout: float = 0) -> int:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    from gpuledger.config import check_cluster_name, check_device_endpoint, load_settings

    settings = load_settings()
    args = build_parser(settings).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the flags are held to the rules of the settings they stand for: the cluster names every message,
    # the state file and the spool (a '/' would put them outside the data dir), and a device endpoint
    # the agent cannot fill fails at every lookup, silently sending every pod without GPUs
    for flag, value, rule in (("--cluster", args.cluster, check_cluster_name),
                              ("--device-endpoint", args.device_endpoint, check_device_endpoint)):
        try:
            rule(value)
        except ValueError as exc:
            print(f"kubernetes agent: {flag} {exc}", file=sys.stderr)
            return 2
    devices_expected = not args.no_devices
    mapping = mapping_from(settings, args.cluster, devices_expected)
    local = None
    if args.pod_resources_socket and devices_expected:
        from gpuledger.agents.podresources.client import PodResourcesClient
        local = PodResourcesClient(str(args.pod_resources_socket))
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())

    if args.serve_pod_resources:
        if local is None:
            print("kubernetes agent: --serve-pod-resources needs --pod-resources-socket", file=sys.stderr)
            return 2
        try:
            address = listen_address(args.serve_pod_resources)
        except ValueError as exc:
            print(f"kubernetes agent: {exc}", file=sys.stderr)
            return 2
        server = serve_pod_resources(address, local, mapping)
        log.info("serving this node's pod resources on %s port %d, /pod-resources", *address)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        server.shutdown()
        return 0

    if devices_expected and local is None and not args.device_endpoint:
        print("kubernetes agent: give --pod-resources-socket (with --node) and/or --device-endpoint, or --no-devices "
              "(allocations then cannot be billed to GPUs)", file=sys.stderr)
        return 2
    if local is not None and not args.node:
        print("kubernetes agent: --pod-resources-socket needs --node (or $NODE_NAME)", file=sys.stderr)
        return 2
    # a look with --print keeps no state unless given one: the default file is the publishing agent's
    state_path = args.state_file or (None if args.print_ else default_state_path(settings, args.cluster))
    try:
        core = KubernetesLedger(mapping, load_state(state_path) if state_path is not None else None)
    except (ValueError, KeyError, TypeError, OSError) as exc:  # OSError: a directory, no permission
        print(f"kubernetes agent: unreadable state file {state_path}: {exc}", file=sys.stderr)
        return 2
    from gpuledger.metrics import SCHEDULER_AGENTS, serve_scheduler_agent_metrics

    from gpuledger.agents.spool import SpoolLocked

    spool_metrics = serve_scheduler_agent_metrics(args.metrics_port, spool_name(args.cluster))
    try:
        publisher = _StdoutPublisher() if args.print_ else open_publisher(settings, args.cluster, spool_metrics)
    except SpoolLocked as exc:
        print(f"kubernetes agent: {exc} (is another kubernetes agent running for cluster {args.cluster}?)",
              file=sys.stderr)
        return 2
    agent = KubernetesAgent(core, publisher, job_events_topic=settings.topics.job_events,
                            snapshots_topic=settings.topics.scheduler_snapshots,
                            job_event_partitions=settings.partitions_job_events,
                            devices=DeviceSource(mapping, local=local, node=args.node, endpoint=args.device_endpoint),
                            state_path=state_path, snapshot_interval_s=settings.kubernetes_snapshot_interval_s)
    if args.metrics_port:
        SCHEDULER_AGENTS.attach("kubernetes", args.cluster, agent.stats)
    watchers = make_watchers(api_client_for(args.api_server, args.kubeconfig), agent.queue, stop, kueue=args.kueue,
                             timeout_s=settings.kubernetes_watch_timeout_s, mapping=mapping,
                             page_size=settings.kubernetes_list_page_size)
    try:
        agent.run(watchers, stop)
    except KeyboardInterrupt:
        stop.set()
    finally:
        if hasattr(publisher, "close"):
            publisher.close()
        if local is not None:
            local.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
