"""The demo's simulated cluster (agents/simcluster.py, `gpuledger demo` defaults: 8 nodes, 6 h,
seed 7) gives the watcher every shape it alerts on and a queue to reclaim from: the worker core and
the watcher, pure, on the unit fixture ledger (whose [alerts] and [reclaim] are the shipped ones)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson

from gpuledger.agents.simcluster import SimSpec, simulate
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.lines import LINE_JOB_EVENTS, LINE_SAMPLES, LINE_SNAPSHOTS
from gpuledger.schemas.wire import encode
from gpuledger.streams.core import WorkerCore
from gpuledger.streams.topic_names import TopicNames
from gpuledger.streams.watch import Watcher
from gpuledger.streams.watchdefs import RULES

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults


def run_demo_cluster(spec: SimSpec, snapshots: str = "in_order") -> tuple[list[dict], list[dict]]:
    """Alerts and suggestions of the simulated cluster through WorkerCore and Watcher, one partition
    each, in the order the topics would deliver them (lifecycle before the usage it closes).
    `snapshots`: "in_order" as the simulator emits them, "first" all before any usage, "late" each
    10 minutes of event time after it was taken (three consumers of one Faust app read their topics
    at their own pace)."""
    ledger = load_ledger_config(UNIT_LEDGER)
    t = TopicNames.with_prefix("demo.")
    core = WorkerCore(t, partitions_gpu_samples=1, partitions_job_events=1, ledger=ledger)
    watcher = Watcher(ledger.watch, currency=ledger.currency, alerts_topic=t.alerts,
                      suggestions_topic=t.reclaim_suggestions, usage_topic=t.usage,
                      lifecycle_topic=t.lifecycle_accepted, snapshots_topic=t.scheduler_snapshots)
    offsets: Counter[str] = Counter()
    published = []

    def offset(topic: str) -> int:
        offsets[topic] += 1
        return offsets[topic] - 1

    def deliver(outs) -> None:
        for out in outs:
            if out.topic == t.node_allocations:
                deliver(core.on_node(t.node_allocations, 0, offset(t.node_allocations), out.value))
            elif out.topic in (t.usage, t.lifecycle_accepted):
                published.extend(watcher.on_message(out.topic, 0, offset(out.topic), out.value))

    emissions = list(simulate(spec))
    held = [(e.message.ts_ms, encode(e.message)) for e in emissions if e.line == LINE_SNAPSHOTS]

    def snapshot(raw: bytes) -> None:
        published.extend(watcher.on_message(t.scheduler_snapshots, 0, offset(t.scheduler_snapshots), raw))

    if snapshots == "first":
        for _, raw in held:
            snapshot(raw)
    late = list(held) if snapshots == "late" else []
    for emission in emissions:
        while late and late[0][0] + 600_000 <= getattr(emission.message, "ts_ms", 0):
            snapshot(late.pop(0)[1])
        raw = encode(emission.message)
        if emission.line == LINE_JOB_EVENTS:
            deliver(core.on_lifecycle(0, offset(t.job_events), raw))
        elif emission.line == LINE_SAMPLES:
            deliver(core.on_node(t.gpu_samples, 0, offset(t.gpu_samples), raw))
        elif emission.line == LINE_SNAPSHOTS and snapshots == "in_order":
            snapshot(raw)
    for _, raw in late:
        snapshot(raw)
    alerts = [orjson.loads(o.value) for o in published if o.topic == t.alerts]
    suggestions = [orjson.loads(o.value) for o in published if o.topic == t.reclaim_suggestions]
    return alerts, suggestions


def test_the_demo_cluster_raises_every_rule_and_a_reclaim_suggestion():
    alerts, suggestions = run_demo_cluster(SimSpec())
    opened = Counter(a["rule"] for a in alerts if a["status"] == "open")
    assert set(opened) == set(RULES), f"rules that never fired: {set(RULES) - set(opened)}"
    # one open alert per job and rule: never two open at once
    open_now: set = set()
    for a in alerts:
        key = (a["job_id"], a["attempt"], a["rule"])
        assert (key in open_now) == (a["status"] == "closed"), a
        (open_now.add if a["status"] == "open" else open_now.discard)(key)
    assert any(s["status"] == "open" for s in suggestions)
    for s in (s for s in suggestions if s["status"] == "open"):
        assert s["execution_rate"] < 0.5 and s["waiting_demand"]["gpus"] > 0 and s["jobs"]
    # every suggestion opened is withdrawn once, with the same id
    assert Counter(s["suggestion_id"] for s in suggestions if s["status"] == "withdrawn") <= \
        Counter(s["suggestion_id"] for s in suggestions if s["status"] == "open")


def test_reclaim_suggestions_do_not_depend_on_when_the_snapshots_arrive():
    _, in_order = run_demo_cluster(SimSpec())
    assert in_order
    # all snapshots before any usage (in the pipeline they go straight to the watcher, while usage
    # waits for the worker): the same suggestions, judged when the usage of their window is in
    _, first = run_demo_cluster(SimSpec(), snapshots="first")
    assert first == in_order
    # snapshots 10 min late: no step is judged before its snapshot is in, so suggestions still open
    _, late = run_demo_cluster(SimSpec(), snapshots="late")
    assert any(s["status"] == "open" for s in late)
