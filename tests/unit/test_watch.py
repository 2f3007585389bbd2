"""The watcher's rules on worked scenarios (docs/alerts.md): which alerts open and close, when, on
which GPUs; reclaim suggestions and their withdrawal; the same answers from 5-s records and from
60-s segments; a restored snapshot continues exactly like an uninterrupted run.

Pure: streams/watch.py without Kafka, on the unit fixture ledger (never the shipped defaults)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from gpuledger.schemas.models import (
    Alert,
    JobEvent,
    PendingByPriority,
    QueueState,
    ReclaimSuggestion,
    SchedulerSnapshot,
    UsageRecord,
)
from gpuledger.schemas.wire import encode
from gpuledger.ledger_files import load_ledger_config
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config
from gpuledger.streams.watch import Watcher
from gpuledger.streams.watchdefs import parse_watch_definitions

UNIT_LEDGER = Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml"  # never the shipped defaults
LEDGER = load_ledger_config(UNIT_LEDGER)
MIN = 60_000
T0 = 28_333_334 * MIN  # a whole minute
GIB = 1 << 30
USAGE, LIFE, SNAP = "p.usage", "p.lifecycle-accepted", "p.scheduler-snapshots"


def watcher(**alerts) -> Watcher:
    d = LEDGER.watch
    for name, values in alerts.items():
        d = replace(d, alerts=replace(d.alerts, **{name: replace(getattr(d.alerts, name), **values)}))
    return Watcher(d, currency=LEDGER.currency, alerts_topic="p.alerts",
                   suggestions_topic="p.reclaim-suggestions", usage_topic=USAGE, lifecycle_topic=LIFE,
                   snapshots_topic=SNAP)


def record(gpu, start, end, *, state="executing", job="j1", util=90.0, mem=10 * GIB, queue="batch", cost=0,
           attempt=0):
    held = state in ("executing", "allocated_idle")
    return UsageRecord(
        record_id=f"{gpu}/{start}/0", cluster="c1", node="n1", gpu_uuid=gpu, gpu_model="A100-80GB", start_ms=start,
        end_ms=end, state=state, job_id=job if held else "", attempt=attempt if held else 0,
        tenant="acme" if held else "", queue=queue if held else "", share_milli=1000, gpu_ms=end - start,
        util_pct=util, mem_used_bytes=mem, coefficient=1.0, coefficient_version="V100-32GB@2020-01-01",
        effective_gpu_ms=end - start, cost_micros=cost, definition_version="unit-1").model_dump(mode="json")


def event(kind, minute, job="j1", attempt=0, queue="batch", minute_offset=0.0):
    return encode(JobEvent(event_id=f"{job}-{attempt}-{kind}-{minute}", ts_ms=T0 + int((minute + minute_offset) * MIN), kind=kind,
                           cluster="c1", job_id=job, attempt=attempt, tenant="acme", queue=queue))


class Feed:
    """Feeds a watcher minute by minute; collects what it publishes."""

    def __init__(self, w: Watcher, tick_ms: int = MIN):
        self.w, self.tick_ms, self.offsets, self.out = w, tick_ms, {}, []

    def send(self, topic, raw):
        offset = self.offsets.get(topic, 0)
        self.offsets[topic] = offset + 1
        self.out += self.w.on_message(topic, 0, offset, raw)

    def minute(self, m, records_of):
        """records_of(gpu_start, gpu_end) -> records; called per tick of the minute."""
        recs = []
        for t in range(T0 + m * MIN, T0 + (m + 1) * MIN, self.tick_ms):
            recs += records_of(t, t + self.tick_ms)
        self.send(USAGE, orjson.dumps({"schema_version": 1, "node": "n1", "records": recs}))

    def alerts(self):
        return [Alert.model_validate_json(o.value) for o in self.out if o.topic == "p.alerts"]

    def suggestions(self):
        return [ReclaimSuggestion.model_validate_json(o.value) for o in self.out if o.topic == "p.reclaim-suggestions"]


def summary(alerts):
    return [(a.rule, a.status, (a.closed_at_ms if a.status == "closed" else a.opened_at_ms) - T0, a.gpus)
            for a in alerts]


def training_job(feed: Feed, minutes=80, *, down=None):
    """load (5%) 0-15 min, train (95%) 15-45, checkpoint (30%) 45-50, hang (0%, memory held) 50-70,
    train again 70-80, completed at 80. Two GPUs."""
    feed.send(LIFE, event("allocated", 0))
    feed.send(LIFE, event("started", 0))
    for m in range(minutes):
        if m == 45:
            feed.send(LIFE, event("checkpoint_begin", 45))
        if m == 50:
            feed.send(LIFE, event("checkpoint_end", 50))
        util = 5.0 if m < 15 else 95.0 if m < 45 else 30.0 if m < 50 else 0.0 if m < 70 else 95.0
        feed.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    feed.send(LIFE, event("completed", minutes))


@pytest.mark.parametrize("tick_ms", [MIN, 5000], ids=["60s-segments", "5s-ticks"])
def test_load_train_checkpoint_hang_recover_opens_and_closes_exactly(tick_ms):
    feed = Feed(watcher(), tick_ms)
    training_job(feed)
    alerts = feed.alerts()
    # loading (grace) and the checkpoint raise nothing; the hang is a drop and a hang, both closed
    # after 5 minutes of work again (close_s); 5 % for 15 min and 0 % for 20 min is never "low" for 30 min
    assert summary(alerts) == [
        ("util_drop", "open", 60 * MIN, ["GPU-a", "GPU-b"]),
        ("hung", "open", 60 * MIN, ["GPU-a", "GPU-b"]),
        ("util_drop", "closed", 75 * MIN, ["GPU-a", "GPU-b"]),
        ("hung", "closed", 75 * MIN, ["GPU-a", "GPU-b"]),
    ]
    drop_open, hung_open, drop_closed, _ = alerts
    assert drop_open.window_start_ms == T0 + 35 * MIN and drop_open.window_end_ms == T0 + 60 * MIN
    assert hung_open.window_start_ms == T0 + 50 * MIN
    assert drop_closed.alert_id == drop_open.alert_id and drop_closed.opened_at_ms == drop_open.opened_at_ms
    assert "fell from 95% to 0%" in drop_open.message
    assert drop_open.definition_version == "alerts-unit-1/util_drop.v1" and drop_open.tenant == "acme"
    assert feed.w.open_alerts() == [] and ("c1", "j1", 0) in feed.w.ended


def test_the_same_alerts_whatever_the_batching_of_usage():
    """The worker sends a node's usage once per watermark (minutes at a time): the rules step through
    every bucket the horizon passed, so batches of 7 minutes give what minute-by-minute gives."""
    by_minute = Feed(watcher())
    training_job(by_minute)
    batched = Feed(watcher())
    for kind, minute in (("allocated", 0), ("started", 0), ("checkpoint_begin", 45), ("checkpoint_end", 50)):
        batched.send(LIFE, event(kind, minute))

    def phase(m):
        return 5.0 if m < 15 else 95.0 if m < 45 else 30.0 if m < 50 else 0.0 if m < 70 else 95.0

    for first in range(0, 80, 7):
        recs = [record(g, T0 + m * MIN, T0 + (m + 1) * MIN, util=phase(m))
                for m in range(first, min(first + 7, 80)) for g in ("GPU-a", "GPU-b")]
        batched.send(USAGE, orjson.dumps({"schema_version": 1, "node": "n1", "records": recs}))
    batched.send(LIFE, event("completed", 80))
    assert [o.value for o in batched.out] == [o.value for o in by_minute.out] and len(by_minute.out) == 4


def test_without_the_checkpoint_window_the_checkpoint_is_a_drop():
    """The same job with its checkpoint events dropped: 30 % after 95 % would not recover within
    10 min only if it lasted 10 min; it lasts 5, so still no drop; the hang is still reported."""
    feed = Feed(watcher(util_drop={"recover_s": 240}))
    training_job(feed)
    assert ("util_drop", "open") in [(a.rule, a.status) for a in feed.alerts()]
    with_events = [(a.rule, a.opened_at_ms) for a in feed.alerts() if a.status == "open"]
    quiet = Feed(watcher(util_drop={"recover_s": 240}))
    quiet.send(LIFE, event("started", 0))
    for m in range(50):
        util = 5.0 if m < 15 else 95.0 if m < 45 else 30.0
        quiet.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    # 45-49 at 30 % with no checkpoint events: a drop from 95 % that did not recover within 4 min
    assert summary(quiet.alerts()) == [("util_drop", "open", 49 * MIN, ["GPU-a", "GPU-b"])]
    # with the checkpoint window the same minutes are excluded: the first drop is the hang's
    assert with_events[0] == ("util_drop", T0 + 54 * MIN)


def test_a_job_that_ends_closes_its_alerts_and_late_usage_reopens_nothing():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(62):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, util=0.0 if m >= 20 else 90.0)])
    # idle from 20 min: a drop and a hang after 10 min; low at 47 min, when the last 30 min average
    # (3 x 90 + 27 x 0) / 30 = 9 % < 10 %
    assert summary(feed.alerts()) == [("util_drop", "open", 30 * MIN, ["GPU-a"]), ("hung", "open", 30 * MIN, ["GPU-a"]),
                                      ("low_util", "open", 47 * MIN, ["GPU-a"])]
    feed.send(LIFE, event("cancelled", 62, minute_offset=0.5))
    # the end event runs ahead of the usage: the alerts close, at the end, once the job's GPUs have
    # reported past it (its last records are still judged); its records after the end count for nothing
    feed.minute(62, lambda s, e: [record("GPU-z", s, e, state="unallocated")])  # another node, ahead
    assert len(feed.alerts()) == 3
    feed.minute(62, lambda s, e: [record("GPU-a", s, e, util=0.0)])
    assert len(feed.alerts()) == 3  # GPU-a has not reported a minute past the end yet
    feed.minute(63, lambda s, e: [record("GPU-a", s, e, state="unallocated")])
    assert summary(feed.alerts()[3:]) == [("hung", "closed", 62 * MIN + MIN // 2, ["GPU-a"]),
                                          ("low_util", "closed", 62 * MIN + MIN // 2, ["GPU-a"]),
                                          ("util_drop", "closed", 62 * MIN + MIN // 2, ["GPU-a"])]
    assert "the job cancelled" in feed.alerts()[-1].message
    for m in range(64, 75):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, util=0.0)])
    assert len(feed.alerts()) == 6 and feed.w.attempts == {}


def test_a_job_whose_whole_lifecycle_comes_before_its_usage_is_still_judged():
    """A replay publishes lifecycle far ahead of usage (the worker's usage waits for watermarks, and
    another node's usage may run ahead): the end of a job read before any of its usage forgets nothing."""
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    feed.send(LIFE, event("completed", 60))
    for m in range(61):
        feed.minute(m, lambda s, e: [record("GPU-z", s, e, state="unallocated")])  # another node, ahead
    for m in range(60):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, util=5.0)])
    feed.minute(60, lambda s, e: [record("GPU-a", s, e, state="unallocated")])
    assert summary(feed.alerts()) == [("low_util", "open", 45 * MIN, ["GPU-a"]),
                                      ("low_util", "closed", 60 * MIN, ["GPU-a"])]


def test_low_utilization_after_grace_opens_once_and_closes_on_recovery():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(70):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, util=5.0 if m < 60 else 50.0)])
    # the first 30-min window wholly after the 15-min grace ends at 45 min; one alert, not one a minute;
    # closed when a 10-min stretch averages >= 10 %: (8 x 5 + 2 x 50) / 10 = 14 at 62 min (9.5 at 61)
    assert summary(feed.alerts()) == [("low_util", "open", 45 * MIN, ["GPU-a"]),
                                      ("low_util", "closed", 62 * MIN, ["GPU-a"])]
    assert feed.alerts()[0].window_start_ms == T0 + 15 * MIN


def test_low_utilization_inside_checkpoint_windows_is_not_judged():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(80):
        if m % 20 == 0:
            feed.send(LIFE, event("checkpoint_begin", m))
        if m % 20 == 12:
            feed.send(LIFE, event("checkpoint_end", m))
        # low only inside the checkpoints (12 of every 20 min), 60 % otherwise
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, util=2.0 if m % 20 < 12 else 60.0)])
    assert [a.rule for a in feed.alerts()] == []


def test_straggler_names_the_lagging_gpu():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    gpus = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")
    for m in range(70):
        feed.minute(m, lambda s, e: [record(g, s, e, util=40.0 if g == "GPU-c" and 30 <= m < 50 else 90.0)
                                     for g in gpus])
    # window 10 min: at 36 min GPU-c's mean is (4 x 90 + 6 x 40) / 10 = 60, spread 30 (was 0);
    # after it is back at 50 min the spread is 5 x (60 - t) points, below 30 from 55 min
    assert summary(feed.alerts()) == [("straggler", "open", 36 * MIN, ["GPU-c"]),
                                      ("straggler", "closed", 55 * MIN, ["GPU-c"])]
    assert "GPU GPU-c of j1 lags: 30 points" in feed.alerts()[0].message


def test_gpu_down_under_a_running_job_names_the_job_and_closes_when_it_is_back():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(40):
        def records(s, e):
            if 20 <= m < 30:  # GPU-b out of service: the worker records it down, held by no one
                return [record("GPU-a", s, e), record("GPU-b", s, e, state="down")]
            return [record(g, s, e) for g in ("GPU-a", "GPU-b")]
        feed.minute(m, records)
    assert summary(feed.alerts()) == [("gpu_down", "open", 20 * MIN, ["GPU-b"]),
                                      ("gpu_down", "closed", 30 * MIN, ["GPU-b"])]
    assert feed.alerts()[0].message == "GPU GPU-b went down under running job j1 (attempt 0)"


def test_a_job_killed_by_its_gpu_going_down_gets_the_alert_though_its_end_came_first():
    """The agent reports Xid 79 and the scheduler fails the job at the same moment: the failure is on
    lifecycle-accepted before the usage that shows the GPU down. The alert still names the job."""
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(20):
        feed.minute(m, lambda s, e: [record(g, s, e) for g in ("GPU-a", "GPU-b")])
    feed.send(LIFE, event("failed", 20))
    for m in range(20, 26):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, state="unallocated"), record("GPU-b", s, e, state="down")])
    assert summary(feed.alerts()) == [("gpu_down", "open", 20 * MIN, ["GPU-b"]),
                                      ("gpu_down", "closed", 20 * MIN, ["GPU-b"])]
    assert feed.alerts()[1].message.endswith("closed: the job failed")


def test_a_down_gpu_that_no_running_job_held_raises_nothing():
    feed = Feed(watcher())
    for m in range(10):
        feed.minute(m, lambda s, e: [record("GPU-a", s, e, state="down")])
    assert feed.alerts() == []


def snapshot(minute, pending_gpus=2.0, cluster="c1"):
    return encode(SchedulerSnapshot(cluster=cluster, ts_ms=T0 + minute * MIN, queues=[
        QueueState(queue="batch", priority=0, quota_gpus=8, allocated_gpus=6, pending_jobs=0, pending_gpus=0),
        QueueState(queue="prod", priority=10, quota_gpus=8, allocated_gpus=0, pending_jobs=1, pending_gpus=pending_gpus,
                   pending_by_priority=[PendingByPriority(priority=10, jobs=1, gpus=pending_gpus)]
                   if pending_gpus else [])]))


def queue_minute(feed, m):
    def records(s, e):
        recs = [record(g, s, e, state="allocated_idle", job="idle-job", util=0.0, cost=1000 * (e - s) // MIN)
                for g in ("GPU-1", "GPU-2", "GPU-3")]
        recs.append(record("GPU-4", s, e, job="busy-job"))
        if m >= 20:  # young: never named, however idle
            recs += [record(g, s, e, state="allocated_idle", job="young-job", util=0.0, cost=5000)
                     for g in ("GPU-5", "GPU-6")]
        return recs
    feed.minute(m, records)


@pytest.mark.parametrize("snapshots_first", [False, True], ids=["interleaved", "snapshots-ahead-of-usage"])
def test_reclaim_suggestion_names_the_least_productive_old_jobs_and_is_withdrawn(snapshots_first):
    """Snapshots, like lifecycle, may be read long before the usage of their time: a queue is judged
    against the snapshot of its window's end, not the newest read."""
    feed = Feed(watcher())
    for job, start in (("idle-job", 0), ("busy-job", 0), ("young-job", 20)):
        feed.send(LIFE, event("started", start, job=job))
    if snapshots_first:
        for m in range(0, 40, 2):
            feed.send(SNAP, snapshot(m, pending_gpus=2.0 if m < 36 else 0.0))
    for m in range(40):
        if m % 2 == 0 and not snapshots_first:
            feed.send(SNAP, snapshot(m, pending_gpus=2.0 if m < 36 else 0.0))
        queue_minute(feed, m)
    opened, withdrawn = feed.suggestions()
    # the first whole 30-min window ends at 30 min (the newest minute may still be filling):
    # executing 1 GPU x 30 min of 3 x 30 + 1 x 30 + 2 x 10 allocated
    assert opened.status == "open" and opened.opened_at_ms == T0 + 30 * MIN and opened.window_ms == 30 * MIN
    assert opened.execution_rate == round(30 / 140, 4)
    assert [(j.job_id, j.gpus, j.gpus_freed, j.execution_rate) for j in opened.jobs] == \
        [("idle-job", ["GPU-1", "GPU-2", "GPU-3"], 3.0, 0.0)]
    assert opened.gpus_freed == 3.0 and opened.waiting_demand.gpus == 2.0 and opened.waiting_demand.priority == 10
    assert opened.waiting_demand.queues == ["prod"] and opened.currency == "USD"
    # idle cost so far: 3 GPUs x 1000 micros a minute for the 30 minutes before it opened (the 31st,
    # read already, lies after the step it was judged at)
    assert opened.idle_cost_micros == opened.jobs[0].idle_cost_micros == 3 * 30 * 1000
    assert opened.definition_version == "reclaim-unit-1/reclaim.v1"
    # the prod work stops waiting at 36 min: withdrawn at the next evaluation
    assert withdrawn.suggestion_id == opened.suggestion_id and withdrawn.status == "withdrawn"
    assert withdrawn.withdrawn_at_ms == T0 + 36 * MIN and "no higher-priority work waits" in withdrawn.message


def test_a_suggestion_whose_jobs_all_ended_is_withdrawn():
    feed = Feed(watcher())
    for job in ("idle-job", "busy-job"):
        feed.send(LIFE, event("started", 0, job=job))
    for m in range(32):
        feed.send(SNAP, snapshot(m))
        queue_minute(feed, m)
    assert [s.status for s in feed.suggestions()] == ["open"]
    feed.send(LIFE, event("preempted", 33, job="idle-job"))
    # judged when the usage of the cluster passes the end (the lifecycle runs ahead of usage), at the end
    assert [s.status for s in feed.suggestions()] == ["open"]
    for m in range(32, 35):  # (to 35 min: the young job is not 15 min old yet, nothing new opens)
        feed.send(SNAP, snapshot(m))
        queue_minute(feed, m)
    assert [(s.status, s.withdrawn_at_ms) for s in feed.suggestions()] == [("open", None), ("withdrawn", T0 + 33 * MIN)]


def test_no_suggestion_without_a_fresh_snapshot_or_without_higher_priority_work():
    stale = Feed(watcher())
    stale.send(SNAP, snapshot(0))
    fresh_but_equal = Feed(watcher())
    for m in range(40):
        queue_minute(stale, m)
        fresh_but_equal.send(SNAP, snapshot(m, pending_gpus=0.0))
        queue_minute(fresh_but_equal, m)
    assert stale.suggestions() == [] and fresh_but_equal.suggestions() == []


def test_restored_snapshot_continues_like_an_uninterrupted_run():
    whole = Feed(watcher())
    training_job(whole)
    first = Feed(watcher())
    first.send(LIFE, event("allocated", 0))
    first.send(LIFE, event("started", 0))
    for m in range(55):
        if m == 45:
            first.send(LIFE, event("checkpoint_begin", 45))
        if m == 50:
            first.send(LIFE, event("checkpoint_end", 50))
        util = 5.0 if m < 15 else 95.0 if m < 45 else 30.0 if m < 50 else 0.0
        first.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    blob = first.w.snapshot()
    second = Feed(watcher())
    second.w.restore(blob)
    second.offsets = dict(first.offsets)
    # a redelivered message (offset below the snapshot's) is skipped
    assert second.w.on_message(USAGE, 0, 3, b"{}") == [] and second.w.counters["redelivered"] == 1
    for m in range(55, 80):
        util = 0.0 if m < 70 else 95.0
        second.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    second.send(LIFE, event("completed", 80))
    assert [o.value for o in first.out + second.out] == [o.value for o in whole.out]


def test_bad_input_is_skipped_and_counted():
    w = watcher()
    assert w.on_message(USAGE, 0, 0, b"not json") == []
    assert w.on_message(LIFE, 0, 0, b'{"type": "job_event"}') == []
    assert w.on_message(SNAP, 0, 0, b"[]") == []
    assert w.counters["bad_input"] == 3


def test_definitions_are_parsed_and_checked():
    doc = {"alerts": {"startup_grace_s": 60, "hung": {"for_s": 120, "min_mem_bytes": 5}},
           "reclaim": {"execution_rate_below": 0.3}}
    d = parse_watch_definitions(doc)
    assert (d.alerts.startup_grace_s, d.alerts.hung.for_s, d.alerts.hung.min_mem_bytes) == (60.0, 120.0, 5)
    assert d.reclaim.execution_rate_below == 0.3 and d.alerts.low_util.floor_pct == 10.0
    assert LEDGER.watch.alerts.low_util.for_s == 1800.0  # the fixture spells them out
    for bad, says in (({"alerts": {"hung": {"for_s": -1}}}, "alerts.hung.for_s"),
                      ({"alerts": {"low_util": {"floor": 3}}}, r"unknown key\(s\) floor"),
                      ({"reclaim": {"execution_rate_below": 1.5}}, "reclaim.execution_rate_below"),
                      ({"alerts": {"util_drop": {"enabled": "yes"}}}, "enabled must be true or false"),
                      ({"reclaim": {"version": ""}}, "reclaim.version must be a non-empty string")):
        raw = UNIT_LEDGER.read_text().split("\n# Behaviour alerts")[0]
        import tomllib
        with pytest.raises(LedgerConfigError, match=says):
            parse_ledger_config({**tomllib.loads(raw), **bad}, "x.toml")


# --------------------------------------------------------------------------- at fleet scale
def fleet_minute(feed: Feed, m: int, nodes: int, partitions: int = 1, skip=()) -> None:
    """One usage message per node for minute m (8 busy GPUs each, on partition node % partitions)."""
    for n in range(nodes):
        if n in skip:
            continue
        recs = [{**record(f"n{n}-g{i}", T0 + m * MIN, T0 + (m + 1) * MIN, job=f"job-{n}"), "node": f"n{n}"}
                for i in range(8)]
        topic_partition = n % partitions
        offset = feed.offsets.get((USAGE, topic_partition), 0)
        feed.offsets[(USAGE, topic_partition)] = offset + 1
        feed.out += feed.w.on_message(USAGE, topic_partition, offset, orjson.dumps({"node": f"n{n}", "records": recs}),
                                      now_s=float(m * 60))


def test_the_work_per_usage_message_does_not_grow_with_the_fleet(monkeypatch):
    """Each usage message used to look at every GPU of its cluster (when reclaim asked how far the
    cluster's usage had come) and at every attempt and holder (housekeeping): quadratic in the fleet,
    12 ms a message at 10,000 GPUs (bench/watch.py). The full look now runs once per reclaim step."""
    feed = Feed(watcher())
    looks = []
    full_look = Watcher._usage_horizon
    monkeypatch.setattr(Watcher, "_usage_horizon", lambda self, cluster: looks.append(cluster) or full_look(self, cluster))
    nodes, minutes = 40, 8
    for n in range(nodes):
        feed.send(LIFE, event("started", 0, job=f"job-{n}"))
    for m in range(minutes):
        feed.send(SNAP, snapshot(m + 1))
        fleet_minute(feed, m, nodes)
    assert feed.w.reclaim_evaluated["c1"] - T0 // MIN == minutes - 1  # every step judged ...
    assert len(looks) <= minutes  # ... with one full look each, not one per message (320 messages)


def test_reclaim_does_not_wait_for_a_stopped_node_or_a_quiet_partition():
    """A node that stops reporting (its partition goes on) and a whole partition that falls silent
    (behind the newest by more than RECLAIM_STALE_MS and quiet by wall clock) are not waited for;
    a partition that is only behind is."""
    stopped = Feed(watcher())
    for n in range(4):
        stopped.send(LIFE, event("started", 0, job=f"job-{n}"))
    for m in range(30):
        stopped.send(SNAP, snapshot(m + 1))
        fleet_minute(stopped, m, 4, partitions=2, skip={3} if m >= 5 else ())
    # node 3 stopped at minute 5; after 10 minutes its partition has gone on without it
    assert stopped.w.reclaim_evaluated["c1"] - T0 // MIN >= 28
    behind = Feed(watcher())
    for n in range(4):
        behind.send(LIFE, event("started", 0, job=f"job-{n}"))
    judged = []
    for m in range(30):
        behind.send(SNAP, snapshot(m + 1))
        fleet_minute(behind, m, 4, partitions=2, skip={1, 3} if m >= 5 else ())  # partition 1 silent
        judged.append(behind.w.reclaim_evaluated["c1"] - T0 // MIN)
    # the silent partition is waited for (its usage ends at minute 5: steps up to 4) until it is more
    # than 10 min behind the newest and quiet for a minute of wall clock; then the steps catch up
    assert judged == [0, 1, 2, 3, 4] + [4] * 10 + list(range(15, 30))


def test_another_clusters_node_on_the_same_partition_does_not_keep_a_silent_one_waited_for():
    """The usage topic is keyed by the bare node name: c2's node n1 shares c1's n1 partition. While
    c2/n1 keeps reporting there, c1's partition 1 (its n1 and n3 silent) is still quiet for c1:
    c1's reclaim steps catch up exactly as when c1 is alone, and c2's own steps go on."""
    feed = Feed(watcher())
    for n in range(4):
        feed.send(LIFE, event("started", 0, job=f"job-{n}"))
    judged, judged_c2 = [], []
    for m in range(30):
        feed.send(SNAP, snapshot(m + 1))
        feed.send(SNAP, snapshot(m + 1, cluster="c2"))
        fleet_minute(feed, m, 4, partitions=2, skip={1, 3} if m >= 5 else ())  # c1's partition 1 silent
        recs = [{**record(f"c2-n1-g{i}", T0 + m * MIN, T0 + (m + 1) * MIN, state="unallocated"), "cluster": "c2"}
                for i in range(2)]
        offset = feed.offsets.get((USAGE, 1), 0)
        feed.offsets[(USAGE, 1)] = offset + 1
        feed.out += feed.w.on_message(USAGE, 1, offset, orjson.dumps({"node": "n1", "records": recs}),
                                      now_s=float(m * 60) + 1)
        judged.append(feed.w.reclaim_evaluated["c1"] - T0 // MIN)
        judged_c2.append(feed.w.reclaim_evaluated["c2"] - T0 // MIN)
    # as test_reclaim_does_not_wait_for_a_stopped_node_or_a_quiet_partition ("behind"), c1 alone
    assert judged == [0, 1, 2, 3, 4] + [4] * 10 + list(range(15, 30))
    assert judged_c2 == list(range(30))  # c2's only partition is never silent
    # a redelivered usage message still counts as its own cluster's usage heard on the partition, only
    heard = dict(feed.w.partition_heard)
    feed.w.on_message(USAGE, 1, 0, orjson.dumps({"node": "n1", "records": recs}), now_s=5000.0)
    assert feed.w.partition_heard == {**heard, ("c2", 1): 5000.0}


def test_a_partition_silent_before_a_restart_is_not_waited_for_after_it():
    """Wall-clock silence is not in the state: a partition not heard from since the restart counts
    as quiet a minute after it, instead of holding the cluster's reclaim judgement for ever."""
    feed = Feed(watcher())
    for n in range(4):
        feed.send(LIFE, event("started", 0, job=f"job-{n}"))
    judged = []
    for m in range(30):
        if m == 8:  # the watcher restarts from its snapshot; partition 1 has been silent since minute 5
            restored = watcher()
            restored.restore(feed.w.snapshot())
            feed.w = restored
        feed.send(SNAP, snapshot(m + 1))
        fleet_minute(feed, m, 4, partitions=2, skip={1, 3} if m >= 5 else ())
        judged.append(feed.w.reclaim_evaluated["c1"] - T0 // MIN)
    # as without the restart, but quiet a minute after it rather than a minute after its last message
    assert judged == [0, 1, 2, 3, 4] + [4] * 12 + list(range(17, 30))


def test_a_gpu_back_in_service_no_longer_held_by_the_job_does_not_stop_its_rules():
    """GPU-b goes down under the job and comes back unallocated: the job is judged on GPU-a alone
    from then on (its hang is still found), not held at the time GPU-b went down."""
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(60):
        def records(s, e):
            out = [record("GPU-a", s, e, util=95.0 if m < 30 else 0.0)]  # hangs from minute 30
            if m < 20:
                out.append(record("GPU-b", s, e, util=95.0))
            elif m < 22:
                out.append(record("GPU-b", s, e, state="down"))
            else:
                out.append(record("GPU-b", s, e, state="unallocated", job=""))
            return out
        feed.minute(m, records)
    assert summary(feed.alerts())[:3] == [("gpu_down", "open", 20 * MIN, ["GPU-b"]),
                                          ("gpu_down", "closed", 22 * MIN, ["GPU-b"]),
                                          ("util_drop", "open", 40 * MIN, ["GPU-a"])]
    assert ("hung", "open", 40 * MIN, ["GPU-a"]) in summary(feed.alerts())
    assert feed.w.attempts[("c1", "j1", 0)].evaluated_bucket - T0 // MIN == 60


def test_attempts_and_ended_entries_are_forgotten_a_day_after_their_last_activity():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0, job="old"))
    feed.minute(0, lambda s, e: [record("GPU-a", s, e, job="old")])
    feed.send(LIFE, event("completed", 1, job="old"))
    feed.send(LIFE, event("started", 0, job="silent"))  # never ends, its GPU never reports again
    feed.minute(1, lambda s, e: [record("GPU-s", s, e, job="silent")])
    w = feed.w
    assert ("c1", "silent", 0) in w.attempts and ("c1", "old", 0) in w.ended
    day = 24 * 60
    feed.minute(day - 10, lambda s, e: [record("GPU-b", s, e, state="unallocated")])
    assert ("c1", "silent", 0) in w.attempts and ("c1", "old", 0) in w.ended  # not a day yet
    feed.minute(day + 5, lambda s, e: [record("GPU-b", s, e, state="unallocated")])
    assert ("c1", "silent", 0) not in w.attempts and ("c1", "old", 0) not in w.ended
    assert ("c1", "GPU-s") not in w.holders
    # an attempt started now is kept, whatever the floors say
    feed.send(LIFE, event("started", day + 6, job="new"))
    feed.minute(day + 6, lambda s, e: [record("GPU-c", s, e, job="new")])
    assert ("c1", "new", 0) in w.attempts and ("c1", "GPU-c") in w.holders


def test_snapshots_take_at_most_a_tenth_of_the_watchers_time():
    from gpuledger.watch import SnapshotPacer

    pacer = SnapshotPacer()
    assert pacer.due(0.0)
    pacer.took(10.0, 10.1)  # a small state: the next timer tick (2 s later) may take one
    assert pacer.due(12.0)
    pacer.took(12.0, 15.2)  # 3.2 s (100,000 GPUs): the next one 32 s after this one started
    assert not pacer.due(14.0) and not pacer.due(43.9) and pacer.due(44.0)


def test_the_core_leaves_out_a_record_it_cannot_read_and_applies_the_rest(caplog):
    """The core validates each usage batch once, at its parse step: record 2 of 3 with an attempt that
    is no number, record 3 a negative attempt. Both are left out with the reason and counted; the first
    is applied (its GPU is seen), and the message is read (next offset) — not skipped whole as bad
    input, nor stopped half way."""
    w = watcher()
    good = record("GPU-a", T0, T0 + MIN)
    batch = orjson.dumps({"schema_version": 1, "node": "n1", "records": [
        good, {**record("GPU-b", T0, T0 + MIN), "attempt": "x"}, record("GPU-c", T0, T0 + MIN, attempt=-1)]})
    with caplog.at_level("WARNING"):
        w.on_message(USAGE, 2, 7, batch)
    assert w.counters["bad_records"] == 2 and w.counters["bad_input"] == 0
    assert w.counters["usage_records"] == 1
    assert set(w.gpu_seen) == {("c1", "GPU-a")}
    assert w.next_offsets[USAGE] == {2: 8}
    assert f"leaving out record 1 of 3 of {USAGE}[2]@7: attempt: Input should be a valid integer" in caplog.text
    assert f"leaving out record 2 of 3 of {USAGE}[2]@7: attempt -1 is negative" in caplog.text
    w.on_message(USAGE, 2, 8, b"{not json")
    assert w.counters["bad_input"] == 1
