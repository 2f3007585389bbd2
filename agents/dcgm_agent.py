"""`gpuledger agent dcgm`: GPU samples from a dcgm-exporter `/metrics` endpoint instead of NVML.

The scraper is a `GpuBackend` (`DcgmBackend`), so the GPU agent's loop does the rest: the same
interval grid, spool, batching (GPULEDGER_AGENT_TICKS_PER_MESSAGE) and agent metrics.

    gpuledger agent dcgm --url http://localhost:9400/metrics --once --print   # one tick as JSON
    gpuledger agent dcgm --url http://localhost:9400/metrics --cluster prod   # publish forever

A scrape that fails (endpoint down, HTTP error, malformed text, not this node's rows) reports
nothing for that tick: the tick is skipped, logged and counted (`scrapes_failed` here, the
agent's tick-failure metric), never filled in. Mapping and limits: docs/dcgm.md.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import math
import socket
import sys
import time
import urllib.request
from typing import Any, Callable, NoReturn, Sequence

from gpuledger.agents.gpu_agent import add_tick_options
from gpuledger.agents.dcgm import (DcgmState, ExpositionError, Row, exposition_hostnames, gpu_samples,
                                  parse_exposition)
from gpuledger.schemas.models import GpuSample

log = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:9400/metrics"
#: Largest /metrics body read; a big node with every field and pod labels is ~1 MB.
MAX_BODY_BYTES = 32 * 1024 * 1024


class ScrapeFailed(RuntimeError):
    """The endpoint gave no usable exposition this tick."""


def fetch_text(url: str, timeout_s: float) -> str:
    """GET the exposition (Prometheus text format)."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        body = response.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"body larger than {MAX_BODY_BYTES} bytes")
    return body.decode("utf-8")


class DcgmBackend:
    """A dcgm-exporter endpoint as a GpuBackend. `node`: the Hostname label to keep when the
    endpoint serves several hosts (ignored when it serves one). `fetch(url, timeout_s)` is
    injectable for tests."""

    def __init__(self, url: str, *, node: str | None = None, timeout_s: float = 5.0,
                 fetch: Callable[[str, float], str] = fetch_text):
        self.url = url
        self.node = node
        self.timeout_s = timeout_s
        self._fetch = fetch
        self._state = DcgmState()
        self.calls_last_tick = 0
        self.scrapes = 0
        self.scrapes_failed = 0

    def scrape(self) -> list[Row]:
        """The exposition's DCGM rows now; ScrapeFailed (logged, counted) when there are none to use."""
        self.calls_last_tick = 1
        self.scrapes += 1
        try:
            return parse_exposition(self._fetch(self.url, self.timeout_s))
        # URLError, HTTPError, timeouts are OSError; a non-HTTP answer (BadStatusLine) or a body cut off
        # (IncompleteRead) is an HTTPException, not an OSError: a failed scrape all the same
        except (OSError, http.client.HTTPException, ValueError, ExpositionError) as exc:
            self._failed(exc)

    def sample(self, now_ms: int) -> list[GpuSample]:
        rows = self.scrape()
        try:
            samples, self._state = gpu_samples(rows, self._state, hostname=self.node)
        except ExpositionError as exc:
            self._failed(exc)
        if not samples:
            self._failed(ExpositionError("no GPU rows (is dcgm-exporter collecting? does it watch GPUs?)"))
        return samples

    def _failed(self, exc: Exception) -> NoReturn:
        self.scrapes_failed += 1
        log.error("scrape of %s failed (%d of %d so far): %s", self.url, self.scrapes_failed, self.scrapes, exc)
        raise ScrapeFailed(f"{self.url}: {exc}") from None

    def close(self) -> None:
        """Nothing to release: each scrape opens and closes its own connection."""


def default_node(backend: DcgmBackend, *, retry_s: float | None = None,
                 sleep: Callable[[float], Any] = time.sleep) -> str:
    """The node name when --node is not given: the exposition's Hostname label when it names one
    host, else this machine's host name. Taken from an exposition with rows only: falling back to
    this host's name while the exporter is not up yet would name another node for the whole run.
    Retries every `retry_s` seconds until the exporter answers; `retry_s` None: ScrapeFailed."""
    while True:
        try:
            rows = backend.scrape()
            if rows:
                break
            backend._failed(ExpositionError("no GPU rows yet (is dcgm-exporter still starting?)"))
        except ScrapeFailed:
            if retry_s is None:
                raise
            log.warning("no node name yet (--node not given): retrying %s in %g s", backend.url, retry_s)
            sleep(retry_s)
    hosts = exposition_hostnames(rows)
    return hosts[0] if len(hosts) == 1 else socket.gethostname()


def build_parser(settings: Any) -> argparse.ArgumentParser:
    """The agent's command line (defaults from `settings`); deploy/ files are checked against it."""
    p = argparse.ArgumentParser(prog="gpuledger agent dcgm",
                                description="GPU samples (NodeTicks) from a dcgm-exporter /metrics endpoint.")
    p.add_argument("--url", default=DEFAULT_URL, help="dcgm-exporter metrics URL (default %(default)s)")
    p.add_argument("--node", default=None,
                   help="node name (default: the exposition's Hostname label if it names one host, else this host's "
                        "name); when the endpoint serves several hosts only this one's rows are taken")
    p.add_argument("--timeout", type=float, default=None,
                   help="scrape timeout, seconds (default: the interval, at most 10)")
    add_tick_options(p, settings)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from gpuledger.agents.gpu_agent import build_tick, check_tick_options, serve_ticks
    from gpuledger.config import load_settings
    from gpuledger.schemas.wire import encode

    settings = load_settings()
    p = build_parser(settings)
    args = p.parse_args(argv)
    # inf reached the socket (OverflowError on every scrape), nan failed every scrape
    if args.timeout is not None and not (0 < args.timeout < math.inf):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
    check_tick_options(p, args)

    backend = DcgmBackend(args.url, node=args.node, timeout_s=args.timeout or min(args.interval, 10.0))
    try:
        node = backend.node = args.node or default_node(backend, retry_s=None if args.once else max(args.interval, 1.0))
    except ScrapeFailed as exc:  # --once: the exporter's answer is the tick's
        print(f"dcgm agent: {exc}", file=sys.stderr)
        return 1
    interval_ms = round(args.interval * 1000)
    if args.once:
        now_ms = int(time.time() * 1000)
        try:
            tick = build_tick(backend, cluster=args.cluster, node=node,
                              now_ms=now_ms // interval_ms * interval_ms, interval_ms=interval_ms)
        except ScrapeFailed as exc:
            print(f"dcgm agent: {exc}", file=sys.stderr)
            return 1
        if args.print_:
            sys.stdout.write(encode(tick).decode() + "\n")
            return 0
        from gpuledger.agents.publisher import KafkaPublisher
        with KafkaPublisher(settings) as pub:
            pub.publish(settings.topics.gpu_samples, node, encode(tick))
            # flush() counts what is still waiting; a tick the broker refused is not waiting, it failed
            if pub.flush() or pub.failed:
                print(f"dcgm agent: the tick was not delivered to {settings.topics.gpu_samples} (reason in the log)",
                      file=sys.stderr)
                return 1
            return 0

    log.info("scraping %s every %.3g s as node %s of cluster %s", args.url, args.interval, node, args.cluster)
    return serve_ticks(backend, settings, cluster=args.cluster, node=node, interval_s=args.interval,
                       ticks_per_message=args.ticks_per_message, print_=args.print_, metrics_port=args.metrics_port,
                       label="dcgm agent")

if __name__ == "__main__":
    sys.exit(main())
