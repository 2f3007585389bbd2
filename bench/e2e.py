"""End to end: from a sample's publication to its appearance in the bill tables.

Live, in wall-clock event time. The benchmark plays the GPU agents and the scheduler adapter:
every second (the sampling interval) it publishes one 8-GPU NodeTick per node (ts = that second)
through the ledger's publisher, and a lifecycle watermark (ts = that second: every event before it
is out) on every job-events partition. Each node runs one job on all its GPUs (allocated and
started before the window), so every tick lands in `usage_by_job_daily` (the MV table behind the
bills) as executing time of that node's job. The Faust worker runs as a child process, the sink
(default batching: 20,000 rows or 1 s) in a thread of this process, which also polls chDB every
100 ms for the newest `last_end_ms` per job.

Latency of the tick at ts = first poll that sees it - the tick's publication time. A tick is
written in its segment's record (docs/accounting.md, "Segments": the shipped ledger's 60-s
windows), which is written when the window's last tick closes, i.e. when the watermark reaches
the window's end; so it is reported twice: `from sample publication`
(the figure asked for; includes that event-time wait, up to a window) and `from closing
watermark` (the pipeline alone: worker + usage topic + sink batch + MV + poll). Only ticks
published after the pipeline was seen live (and 3 s more) count; publishing goes on until the
window holding the last of them has closed.
"""

from __future__ import annotations

import shutil
import threading
import time

from gpuledger.agents.publisher import KafkaPublisher
from gpuledger.embedded.processes import ChildProcess
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import GpuAssignment, GpuSample, JobEvent, LifecycleWatermark, NodeTick
from gpuledger.schemas.wire import encode
from gpuledger.sink.loop import run_sink
from gpuledger.topics import create_topics
from gpuledger.warehouse import connect, migrate

from bench.common import SIZES, bench_settings, percentile, say, workdir

CLUSTER = "e2e"


def _gpu(node: str, i: int) -> str:
    return f"GPU-{node}-{i}"


def _tick(node: str, ts: int, interval_ms: int, k: int) -> bytes:
    return encode(NodeTick(cluster=CLUSTER, node=node, ts_ms=ts, interval_ms=interval_ms, gpus=[
        GpuSample(gpu_uuid=_gpu(node, i), index=i, model="A100-80GB", util_gpu_pct=80.0, sm_active_pct=60.0,
                  mem_used_bytes=40 << 30, mem_total_bytes=80 << 30, power_w=300.0,
                  energy_j=1e6 + 300.0 * k * interval_ms / 1000)
        for i in range(8)]))


def run(bootstrap: str) -> dict:
    nodes = [f"e2e-node{i:03d}" for i in range(SIZES.e2e_nodes)]
    interval_ms = round(SIZES.e2e_interval_s * 1000)
    window_ms = load_ledger_config(None).segment_window_ms  # the worker runs under the shipped ledger
    path = workdir() / "e2e-chdb"
    if path.exists():
        shutil.rmtree(path)
    s = bench_settings(bootstrap, "e2e", warehouse=f"chdb:{path}")
    create_topics(s)
    client = connect(s)
    migrate(client, s.database)
    logs = workdir() / "logs"
    logs.mkdir(exist_ok=True)
    stop = threading.Event()
    sink_result: dict = {}

    def sink() -> None:
        try:
            sink_result.update(run_sink(s, stop=stop, client=connect(s)))
        except BaseException as exc:  # reported below
            sink_result["error"] = exc

    t = s.topics
    published: dict[tuple[str, int], float] = {}   # (node, ts) -> wall time of the tick's publication
    mark_at: dict[int, float] = {}                 # watermark ts -> wall time of its publication
    seen: dict[tuple[str, int], float] = {}
    newest: dict[str, int] = {}

    def poll() -> None:
        now = time.time()
        rows = client.query(f"SELECT job_id, max(last_end_ms) FROM usage_by_job_daily WHERE cluster = '{CLUSTER}' "
                            "GROUP BY job_id").result_rows
        for job, last_end in rows:
            node = job.removeprefix("job-")
            if last_end > newest.get(node, 0):
                for ts in range(newest.get(node, last_end - 600 * interval_ms) // interval_ms * interval_ms,
                                last_end, interval_ms):
                    if (node, ts) in published and ts + interval_ms <= last_end:
                        seen.setdefault((node, ts), now)
                newest[node] = last_end

    with ChildProcess(s, "worker", log_path=logs / "e2e-worker.log") as worker, KafkaPublisher(s) as pub:
        thread = threading.Thread(target=sink, name="bench-sink", daemon=True)
        thread.start()
        grid = (int(time.time() * 1000) // interval_ms + 1) * interval_ms
        for node in nodes:  # one job per node, holding all 8 GPUs, running from before the first tick
            gpus = [GpuAssignment(node=node, gpu_uuid=_gpu(node, i)) for i in range(8)]
            for n, kind in enumerate(("allocated", "started")):
                ev = JobEvent(event_id=f"job-{node}/{kind}", ts_ms=grid - 2 * interval_ms + n, kind=kind, cluster=CLUSTER,
                              job_id=f"job-{node}", tenant=f"tenant{int(node[-3:]) % 5}", queue="prod",
                              requested_gpus=8, gpus=gpus if kind == "allocated" else [])
                pub.publish(t.job_events, ev.job_id, encode(ev))
        pub.flush()
        live_from: float | None = None
        window_start = window_end = publish_until = None
        k = 0
        deadline = time.monotonic() + 120 + SIZES.e2e_seconds + 2 * window_ms / 1000
        while time.monotonic() < deadline:
            worker.check_alive()
            if "error" in sink_result:
                raise sink_result["error"]
            ts = grid + k * interval_ms
            while (wait := ts / 1000 - time.time()) > 0:
                if wait > 0.12:
                    poll()
                    time.sleep(min(0.1, max(0.0, ts / 1000 - time.time() - 0.02)))
                else:
                    time.sleep(wait)
            now = time.time()
            if publish_until is not None and ts > publish_until:
                break
            for node in nodes:
                published[(node, ts)] = time.time()
                pub.publish(t.gpu_samples, node, _tick(node, ts, interval_ms, k))
            mark = encode(LifecycleWatermark(cluster=CLUSTER, ts_ms=ts))
            mark_at[ts] = time.time()
            for p in range(s.partitions_job_events):
                pub.publish(t.job_events, None, mark, partition=p)
            pub.poll(0)
            if live_from is None and seen:
                live_from = now
                window_start = ts + 3 * interval_ms
                window_end = window_start + round(SIZES.e2e_seconds * 1000)
                # the segment holding the last measured tick closes at its window's end
                publish_until = (window_end // window_ms + 1) * window_ms + interval_ms
                say(f"e2e: pipeline live after {now - grid / 1000:.1f} s; measuring {SIZES.e2e_seconds:.0f} s "
                    f"at {len(nodes)} nodes x 8 GPUs every {interval_ms} ms")
            k += 1
        if window_start is None:
            raise TimeoutError("e2e: nothing reached the bill tables within 120 s")
        # close the last ticks, then wait for them
        final = publish_until + 2 * interval_ms
        mark = encode(LifecycleWatermark(cluster=CLUSTER, ts_ms=final))
        mark_at[final] = time.time()
        for p in range(s.partitions_job_events):
            pub.publish(t.job_events, None, mark, partition=p)
        pub.flush()
        wanted = [key for key in published if window_start <= key[1] <= window_end]
        wait_until = time.monotonic() + 30
        while time.monotonic() < wait_until and not all(key in seen for key in wanted):
            poll()
            time.sleep(0.1)
        stop.set()
        thread.join(timeout=60)
    client.close()
    shutil.rmtree(path, ignore_errors=True)
    missing = [key for key in wanted if key not in seen]
    from_sample = [seen[key] - published[key] for key in wanted if key in seen]
    # the watermark that closes tick ts's segment: the first one at or after its window's end (the
    # window's last tick closes there, and a segment that reached its window's end is written)
    marks = sorted(mark_at)

    def closing_mark_time(ts: int) -> float:
        closes = max(ts + interval_ms, (ts // window_ms + 1) * window_ms)
        for m in marks:
            if m >= closes:
                return mark_at[m]
        return float("nan")

    from_mark = [seen[key] - closing_mark_time(key[1]) for key in wanted if key in seen]
    load = {"nodes": len(nodes), "gpus_per_node": 8, "interval_s": interval_ms / 1000,
            "samples_per_s": len(nodes) * 8 * 1000 / interval_ms, "ticks_per_s": len(nodes) * 1000 / interval_ms,
            "watermark_every_s": interval_ms / 1000, "window_s": (window_end - window_start) / 1000,
            "segment_window_s": window_ms / 1000,
            "sink_batch": "20000 rows or 1.0 s", "poll_every_s": 0.1}
    say(f"e2e: {len(from_sample)} ticks, p50 {percentile(from_sample, 50):.2f} s, p99 {percentile(from_sample, 99):.2f} s "
        f"from publication; from the closing watermark p50 {percentile(from_mark, 50):.2f} s")
    return {
        "e2e_latency_p50_s": percentile(from_sample, 50),
        "e2e_latency_p99_s": percentile(from_sample, 99),
        "e2e_pipeline_latency_p50_s": percentile(from_mark, 50),
        "e2e_pipeline_latency_p99_s": percentile(from_mark, 99),
        "e2e_detail": {"load": load, "ticks_measured": len(from_sample), "ticks_missing": len(missing),
                       "max_s": max(from_sample) if from_sample else None,
                       "sink": {k: v for k, v in sink_result.items() if k != "error"}},
    }


if __name__ == "__main__":
    from gpuledger.embedded.broker import EmbeddedBroker

    with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
        for key, value in run(broker.bootstrap).items():
            print(key, value)
