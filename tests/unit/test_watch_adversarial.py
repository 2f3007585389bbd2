"""The watcher (streams/watch.py) on input a running ledger does produce but the worked scenarios of
test_watch.py do not: usage the worker emits again after its restart, a job that gives up one of its
GPUs while it runs, scheduler snapshots no reclaim step ever consumes, a job's nodes whose usage
partitions are read at different paces (the demo's pipeline), many minutes closed in one batch.

Pure: no Kafka, on the unit fixture ledger."""

from __future__ import annotations

from dataclasses import replace

import orjson

from gpuledger.schemas.models import GpuAssignment, JobEvent
from gpuledger.schemas.wire import encode

from test_watch import LIFE, MIN, SNAP, T0, USAGE, Feed, event, record, snapshot, watcher  # (tests/unit is on the path)


def usage(records) -> bytes:
    return orjson.dumps({"schema_version": 1, "node": "n1", "records": records})


def half_idle_queue(resend_at: int | None) -> Feed:
    """A queue executing exactly half its GPU-time (3 idle GPUs, 3 busy), higher-priority work
    waiting: no suggestion is due (it takes a rate below 0.5). With `resend_at`, the worker restarts
    at that minute and emits the idle job's node's last 10 minutes again (same ids, new offsets)."""
    feed = Feed(watcher())
    for job in ("idle-job", "busy-job"):
        feed.send(LIFE, event("started", 0, job=job))
    sent = []
    for m in range(40):
        feed.send(SNAP, snapshot(m))
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        sent.append(usage([record(g, s, e, state="allocated_idle", job="idle-job", util=0.0, cost=1000)
                           for g in ("GPU-1", "GPU-2", "GPU-3")]))
        feed.send(USAGE, sent[-1])
        feed.send(USAGE, usage([record(g, s, e, job="busy-job") for g in ("GPU-4", "GPU-5", "GPU-6")]))
        if m == resend_at:
            for raw in sent[-10:]:
                feed.send(USAGE, raw)
    return feed


def test_usage_the_worker_emits_again_after_its_restart_is_not_counted_twice():
    clean, resent = half_idle_queue(None), half_idle_queue(25)
    assert clean.suggestions() == []
    # counted twice, the idle job's 10 minutes made the queue's rate 0.43 and opened a suggestion
    assert resent.suggestions() == [] and resent.w.counters["duplicate_records"] == 30
    assert [o.value for o in resent.out] == [o.value for o in clean.out]


def test_a_down_record_emitted_again_after_the_gpu_came_back_reopens_nothing():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    down = None
    for m in range(10):
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        raw = usage([record("GPU-a", s, e, state="down" if m == 5 else "executing")])
        down = raw if m == 5 else down
        feed.send(USAGE, raw)
    feed.send(USAGE, down)
    assert [(a.rule, a.status) for a in feed.alerts()] == [("gpu_down", "open"), ("gpu_down", "closed")]


def pod_ends_then_hangs(feed: Feed, minutes: int = 60) -> None:
    """A 2-GPU job (two pods): the pod on GPU-b ends at 20 min and GPU-b goes to another job (a
    second `allocated` of the attempt without it); from 30 min the job hangs on GPU-a, memory held."""
    feed.send(LIFE, event("allocated", 0))
    feed.send(LIFE, event("started", 0))
    feed.send(LIFE, event("started", 20, job="other"))
    for m in range(minutes):
        feed.minute(m, lambda s, e, m=m: [
            record("GPU-a", s, e, util=95.0 if m < 30 else 0.0),
            record("GPU-b", s, e, util=95.0) if m < 20 else record("GPU-b", s, e, job="other", util=80.0)])


def test_a_job_that_gives_up_one_of_its_gpus_is_still_judged_on_the_others():
    feed = Feed(watcher())
    pod_ends_then_hangs(feed)
    # before: judged only to 20 min, when GPU-b left it; the hang was never reported
    opened = {(a.rule, a.opened_at_ms - T0, tuple(a.gpus)) for a in feed.alerts() if a.status == "open"}
    assert ("hung", 40 * MIN, ("GPU-a",)) in opened and ("util_drop", 40 * MIN, ("GPU-a",)) in opened


def test_a_given_up_gpu_gives_the_same_alerts_whichever_partition_is_read_first():
    def run(ahead: str | None) -> list[bytes]:
        w, out, offsets = watcher(), [], {}

        def send(topic, partition, raw):
            offsets[topic, partition] = offsets.get((topic, partition), -1) + 1
            out.extend(w.on_message(topic, partition, offsets[topic, partition], raw))

        for raw in (event("allocated", 0), event("started", 0), event("started", 20, job="other")):
            send(LIFE, 0, raw)
        batches = []
        for m in range(60):
            s, e = T0 + m * MIN, T0 + (m + 1) * MIN
            batches.append((m, 0, [record("GPU-a", s, e, util=95.0 if m < 30 else 0.0)]))
            batches.append((m, 1, [record("GPU-b", s, e, util=95.0) if m < 20
                                   else record("GPU-b", s, e, job="other", util=80.0)]))
        if ahead is not None:  # one node's whole backlog before the other's
            batches.sort(key=lambda b: (b[1] != ahead, b[0]))
        for _, p, records in batches:
            send(USAGE, p, usage(records))
        return [o.value for o in out]

    in_order = run(None)
    assert len(in_order) == 3 and run(0) == in_order and run(1) == in_order


def test_scheduler_snapshots_no_reclaim_step_consumes_are_not_kept_for_ever():
    w = watcher()
    disabled = watcher()
    disabled.d = replace(disabled.d, reclaim=replace(disabled.d.reclaim, enabled=False))
    for feed in (Feed(w), Feed(disabled)):
        feed.send(LIFE, event("started", 0, job="busy-job"))
        for m in range(0, 26 * 60, 10):  # 26 h, a snapshot every 10 min
            feed.send(SNAP, snapshot(m))
            feed.send(SNAP, snapshot(m, cluster="c2"))  # a cluster whose usage never comes
            feed.minute(m, lambda s, e: [record("GPU-4", s, e, job="busy-job")])
    assert len(disabled.snapshots["c1"]) == len(disabled.snapshots["c2"]) == 1
    # enabled: c1's steps prune its own; c2's (no usage, no step) are kept a day behind its newest
    assert len(w.snapshots["c1"]) <= 2 and len(w.snapshots["c2"]) == 24 * 6 + 1


def test_a_job_running_for_days_keeps_only_the_checkpoint_windows_its_rules_can_still_reach():
    """A 12-min checkpoint every hour at 0 % with memory held (hung and a drop, but for the windows):
    two days of them raise nothing, and the attempt keeps only the windows that reach a bucket it
    still judges (before: all 48, each looked through for every bucket judged)."""
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(2 * 24 * 60):
        if m % 60 == 30:
            feed.send(LIFE, event("checkpoint_begin", m))
        if m % 60 == 42:
            feed.send(LIFE, event("checkpoint_end", m))
        util = 0.0 if 30 <= m % 60 < 42 else 95.0
        feed.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    assert feed.alerts() == []
    assert len(feed.w.attempts[("c1", "j1", 0)].checkpoints) <= 2


def shared_gpu_down(feed: Feed, minutes: int = 40) -> None:
    """Jobs A and B share GPU-s (time slicing, 500 milli each); it is down from 20 to 30 min."""
    for job in ("A", "B"):
        feed.send(LIFE, event("started", 0, job=job))

    def records(s, e, m):
        if 20 <= m < 30:
            return [record("GPU-s", s, e, state="down")]
        return [{**record("GPU-s", s, e, job=job), "share_milli": 500, "record_id": f"GPU-s/{s}/{slot}"}
                for slot, job in enumerate(("A", "B"))]
    for m in range(minutes):
        feed.minute(m, lambda s, e, m=m: records(s, e, m))


def test_a_shared_gpu_going_down_alerts_every_job_on_it():
    feed = Feed(watcher())
    shared_gpu_down(feed)
    # before: only B, the holder whose record happened to be read last
    assert sorted((a.job_id, a.status, a.opened_at_ms - T0, a.closed_at_ms and a.closed_at_ms - T0)
                  for a in feed.alerts()) == [("A", "closed", 20 * MIN, 30 * MIN), ("A", "open", 20 * MIN, None),
                                              ("B", "closed", 20 * MIN, 30 * MIN), ("B", "open", 20 * MIN, None)]


def test_several_holders_of_a_gpu_survive_a_restore():
    whole = Feed(watcher())
    shared_gpu_down(whole)
    first = Feed(watcher())
    shared_gpu_down(first, minutes=20)
    second = Feed(watcher())
    second.w.restore(first.w.snapshot())
    second.offsets = dict(first.offsets)
    for m in range(20, 40):
        second.minute(m, lambda s, e, m=m: [record("GPU-s", s, e, state="down")] if m < 30 else
                      [{**record("GPU-s", s, e, job=job), "share_milli": 500, "record_id": f"GPU-s/{s}/{slot}"}
                       for slot, job in enumerate(("A", "B"))])
    assert [o.value for o in first.out + second.out] == [o.value for o in whole.out]


def test_a_gpu_handed_to_its_next_job_alerts_only_that_job_when_it_goes_down():
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0, job="X"))
    feed.send(LIFE, event("started", 10, job="Y"))
    for m in range(12):
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        records = [record("GPU-s", s, e, job="X" if m < 10 else "Y")] if m < 11 else \
            [record("GPU-s", s, s + 30_000, job="Y"), record("GPU-s", s + 30_000, e, state="down")]
        feed.send(USAGE, usage(records))
        if m == 9:
            feed.send(LIFE, event("completed", 10, job="X"))
    assert [(a.job_id, a.rule, a.status) for a in feed.alerts()] == [("Y", "gpu_down", "open")]
    assert {a.definition_version for a in feed.alerts()} == {"alerts-unit-1/gpu_down.v2"}  # its meaning changed


def two_node_feed(batches: list[tuple[int, int, list]], lifecycle: list[bytes], ahead: int | None) -> list[bytes]:
    """What the watcher publishes for usage `batches` (minute, partition, records), each partition
    read in order, after `lifecycle` (read ahead of usage, as in the pipeline): in time order, or
    with partition `ahead`'s whole backlog read before the rest of the other's (a consumer's first
    fetch reads every partition: each delivers its first minute first)."""
    w, out, offsets = watcher(), [], {}

    def send(topic, partition, raw):
        offsets[topic, partition] = offsets.get((topic, partition), -1) + 1
        out.extend(w.on_message(topic, partition, offsets[topic, partition], raw))

    for raw in lifecycle:
        send(LIFE, 0, raw)
    if ahead is not None:
        batches = sorted(batches, key=lambda b: (b[0] > 0, b[1] != ahead, b[0]))
    for _, p, records in batches:
        send(USAGE, p, usage(records))
    return [o.value for o in out]


def on_node(node: str, records: list[dict]) -> list[dict]:
    return [{**r, "node": node} for r in records]


def test_a_straggler_on_another_node_is_seen_whichever_node_is_read_first():
    """The demo's straggler (a 16-GPU job over 6 nodes) opened in the pure test and not in the
    pipeline, where each node's usage comes on its own partition at its own pace: the job was judged
    on the GPUs whose usage of it had been read, each minute once, so a node whose partition was
    still before the job's start (read later) never took part. A job now waits for every node of
    its allocation."""
    allocated = encode(JobEvent(event_id="j1-alloc", ts_ms=T0 + 10 * MIN, kind="allocated", cluster="c1",
                                job_id="j1", tenant="acme", queue="batch", requested_gpus=2,
                                gpus=[GpuAssignment(node="n1", gpu_uuid="GPU-a"), GpuAssignment(node="n2", gpu_uuid="GPU-b")]))
    batches = []
    for m in range(60):  # j1 from 10 min; GPU-b, on n2, falls to 40 % from 40 min
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        if m < 10:
            batches += [(m, p, on_node(n, [record(g, s, e, state="unallocated")]))
                        for p, n, g in ((0, "n1", "GPU-a"), (1, "n2", "GPU-b"))]
            continue
        batches.append((m, 0, on_node("n1", [record("GPU-a", s, e, util=90.0)])))
        batches.append((m, 1, on_node("n2", [record("GPU-b", s, e, util=40.0 if m >= 40 else 90.0)])))
    lifecycle = [allocated, event("started", 10)]
    in_order = two_node_feed(batches, lifecycle, None)
    opened = [orjson.loads(raw) for raw in in_order]
    assert [(a["rule"], a["opened_at_ms"] - T0, a["gpus"]) for a in opened] == [("straggler", 46 * MIN, ["GPU-b"])]
    # before: n1's backlog read first, nothing (judged on GPU-a alone)
    assert two_node_feed(batches, lifecycle, 0) == in_order
    assert two_node_feed(batches, lifecycle, 1) == in_order


def test_a_gpu_down_read_after_another_partition_ran_ahead_still_names_the_job_it_killed():
    """Xid 79 on GPU-b kills j1 at 20 min; the failure is read first (lifecycle runs ahead), then
    n1's usage, an hour ahead (another partition's backlog), then n2's. The job was forgotten once
    GPU-b had reported up to its end while the cluster was 5 min further, before GPU-b's down
    record: no gpu_down. Now the GPU's own partition tells whether it stopped there."""
    batches = []
    for m in range(60):
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        batches.append((m, 0, on_node("n1", [record("GPU-a", s, e, job="other")])))
        if m < 26:
            batches.append((m, 1, on_node("n2", [record("GPU-b", s, e) if m < 20 else
                                                 record("GPU-b", s, e, state="down")])))
    lifecycle = [event("started", 0), event("started", 0, job="other"), event("failed", 20)]
    for ahead in (None, 0):
        alerts = [orjson.loads(raw) for raw in two_node_feed(batches, lifecycle, ahead)]
        assert [(a["rule"], a["job_id"], a["status"], a["opened_at_ms"] - T0) for a in alerts] == \
            [("gpu_down", "j1", "open", 20 * MIN), ("gpu_down", "j1", "closed", 20 * MIN)], ahead


def test_a_gpu_back_after_the_job_it_killed_ended_closes_its_alert_at_the_end_whatever_the_pace():
    """GPU-b (n2) goes down at 20 min and kills j1, back at 30; j1's other GPU is on n1, whose
    partition is behind. The alert closed at the end ("the job failed") when n1 was read in step,
    and at 30 min ("back in service") when n2's partition ran ahead: the job's alerts are forgotten
    only once all its GPUs are past its end."""
    batches = []
    for m in range(40):
        s, e = T0 + m * MIN, T0 + (m + 1) * MIN
        batches.append((m, 0, on_node("n1", [record("GPU-a", s, e) if m < 20 else
                                             record("GPU-a", s, e, state="unallocated")])))
        batches.append((m, 1, on_node("n2", [record("GPU-b", s, e) if m < 20 else
                                             record("GPU-b", s, e, state="down" if m < 30 else "unallocated")])))
    lifecycle = [event("started", 0), event("failed", 20)]
    for ahead in (None, 1):
        alerts = [orjson.loads(raw) for raw in two_node_feed(batches, lifecycle, ahead)]
        assert [(a["status"], a.get("closed_at_ms") and a["closed_at_ms"] - T0) for a in alerts] == \
            [("open", None), ("closed", 20 * MIN)], ahead
        assert alerts[1]["message"].endswith("closed: the job failed")


def test_the_gpus_a_suggestion_frees_are_the_jobs_shares_at_the_windows_end():
    """An idle job holds half of GPU-s (time slicing) to 32 min, a quarter after. The suggestion
    opened at 30 min frees 0.5 GPU whether the snapshots come with the usage or after all of it
    (before: 0.25, the share of the newest record read when the step was judged)."""
    def run(snapshots_late: bool) -> list:
        feed = Feed(watcher())
        for job in ("idle-job", "busy-job"):
            feed.send(LIFE, event("started", 0, job=job))
        for m in range(40):
            if not snapshots_late:
                feed.send(SNAP, snapshot(m))
            share = 500 if m < 32 else 250
            feed.minute(m, lambda s, e: [
                {**record("GPU-s", s, e, state="allocated_idle", job="idle-job", util=0.0),
                 "share_milli": share, "gpu_ms": (e - s) * share // 1000},
                record("GPU-4", s, e, state="allocated_idle", job="busy-job", util=0.0)])
        for m in range(40 if snapshots_late else 0):
            feed.send(SNAP, snapshot(m))
        return [(s.status, s.opened_at_ms - T0, [(j.job_id, j.gpus_freed) for j in s.jobs]) for s in feed.suggestions()]

    assert run(False)[0] == ("open", 30 * MIN, [("busy-job", 1.0), ("idle-job", 0.5)])
    assert run(True) == run(False)


def test_a_job_whose_last_minutes_come_in_one_batch_with_later_usage_is_still_judged():
    """The worker closes many minutes at once when it catches up (the demo's pipeline: one message
    of 20 minutes per node). j1 hangs from 20 min and completes at 40; its node's minutes 25-50 come
    in one batch, the job's end first. Each GPU had then been read over 5 min past the job's last
    slice on it, so every GPU counted as given up: the job was not judged past 25 min, then forgotten
    (the demo lost job-00043's `hung`). Judged to its last slice, it opens at 30 min as when the
    minutes come one by one."""
    def run(batched: bool) -> list:
        feed = Feed(watcher())
        feed.send(LIFE, event("started", 0))
        feed.send(LIFE, event("completed", 40))

        def minute(m):
            s, e = T0 + m * MIN, T0 + (m + 1) * MIN
            return [record(g, s, e, util=0.0 if m >= 20 else 90.0) if m < 40 else record(g, s, e, state="unallocated")
                    for g in ("GPU-a", "GPU-b")]
        for m in range(25):
            feed.send(USAGE, usage(minute(m)))
        if batched:
            feed.send(USAGE, usage([r for m in range(25, 50) for r in minute(m)]))
        else:
            for m in range(25, 50):
                feed.send(USAGE, usage(minute(m)))
        return [(a.rule, a.status, (a.closed_at_ms or a.opened_at_ms) - T0) for a in feed.alerts()]

    one_by_one = run(False)
    assert ("hung", "open", 30 * MIN) in one_by_one
    assert run(True) == one_by_one
