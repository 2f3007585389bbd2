"""The watcher (streams/watch.py) where a review found it depends on how its input came: a catch-up batch
of usage (reclaim steps), an accepted event read twice (checkpoints), a node lost before its job's end
(alerts of a forgotten attempt), close windows longer than the rules' look-back, GPUs and nodes that
come and go (state that only grew), and a job that gives its lagging GPU up (a straggler alert left open).

Pure: no Kafka, on the unit fixture ledger."""

from __future__ import annotations

from dataclasses import replace

import orjson

from test_watch import LIFE, MIN, SNAP, T0, USAGE, Feed, event, record, snapshot, summary, watcher  # (tests/unit is on the path)


def usage(records, node="n1") -> bytes:
    return orjson.dumps({"schema_version": 1, "node": node, "records": records})


# --------------------------------------------------------------------------- reclaim steps
def idle_queue_minute(m):
    s, e = T0 + m * MIN, T0 + (m + 1) * MIN
    return [record(g, s, e, state="allocated_idle", job="idle-job", util=0.0, cost=1000) for g in ("GPU-1", "GPU-2", "GPU-3")] \
        + [record("GPU-4", s, e, job="busy-job")]


def suggestions(w, usage_chunks, pending_minutes, minutes):
    feed = Feed(w)
    for job in ("idle-job", "busy-job"):
        feed.send(LIFE, event("started", 0, job=job))
    for m in range(minutes):
        feed.send(SNAP, snapshot(m, pending_gpus=2.0 if m in pending_minutes else 0.0))
    for chunk in usage_chunks:
        feed.send(USAGE, usage([r for m in chunk for r in idle_queue_minute(m)]))
    return [(s.status, ((s.opened_at_ms if s.status == "open" else s.withdrawn_at_ms) - T0) // MIN)
            for s in feed.suggestions()], feed.w.counters.get("reclaim_steps_skipped", 0)


def test_reclaim_judges_every_step_of_a_catch_up_batch():
    # higher-priority work waits in minutes 30-45 only; usage of minutes 10-79 comes in one batch (the
    # lifecycle watermark back after a stall): the steps between were skipped, and no suggestion opened
    pending = range(30, 45)
    one_by_one, _ = suggestions(watcher(), [[m] for m in range(80)], pending, 80)
    batched, skipped = suggestions(watcher(), [[m] for m in range(10)] + [list(range(10, 80))], pending, 80)
    assert one_by_one and batched == one_by_one and skipped == 0
    # a shorter window and a 20-minute batch: opened at minute 24 instead of 20, with another id
    w = watcher()
    short = replace(w.d, reclaim=replace(w.d.reclaim, window_s=600))
    make = lambda: type(w)(short, currency="USD", alerts_topic="p.alerts", suggestions_topic="p.reclaim-suggestions",  # noqa: E731
                           usage_topic=USAGE, lifecycle_topic=LIFE, snapshots_topic=SNAP)
    one_by_one, _ = suggestions(make(), [[m] for m in range(60)], range(20, 27), 60)
    batched, _ = suggestions(make(), [[m] for m in range(15)] + [list(range(15, 35))] + [[m] for m in range(35, 60)],
                             range(20, 27), 60)
    assert one_by_one and batched == one_by_one


# --------------------------------------------------------------------------- a checkpoint read twice
def test_a_checkpoint_begin_read_twice_opens_one_checkpoint():
    # a restarted worker sends again what it accepted after its last snapshot: the copy stayed open,
    # never ended, and hid 30 minutes of the job (a hang right after the checkpoint) from every rule
    def run(copies):
        feed = Feed(watcher())
        feed.send(LIFE, event("allocated", 0))
        feed.send(LIFE, event("started", 0))
        for m in range(100):
            if m == 45:
                for _ in range(copies):
                    feed.send(LIFE, event("checkpoint_begin", 45))
            if m == 47:
                feed.send(LIFE, event("checkpoint_end", 47))
            util = 5.0 if m < 15 else 95.0 if m < 45 else 30.0 if m < 47 else 0.0  # hangs from minute 47
            feed.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
        return summary(feed.alerts()), feed.w.attempts[("c1", "j1", 0)].checkpoints

    once, twice = run(1), run(2)
    assert twice == once
    assert once[1] == [[T0 + 45 * MIN, T0 + 47 * MIN]]
    assert ("hung", "open", 57 * MIN) in [(r, s, t) for r, s, t, _ in once[0]]


# --------------------------------------------------------------------------- a forgotten attempt's alerts
def test_alerts_of_an_attempt_forgotten_unfinished_are_closed():
    # n1 is lost at minute 40 while j1 hangs; j1 fails at 45; n2 reports on for 26 hours. j1's usage up to
    # its end never comes, so it was forgotten after a day with its alerts open for ever
    feed = Feed(watcher())
    for job in ("j1", "j2"):
        feed.send(LIFE, event("allocated", 0, job=job))
        feed.send(LIFE, event("started", 0, job=job))

    def on_n2(s, e):
        return usage([dict(record("GPU-z", s, e, job="j2"), node="n2")], node="n2")

    for m in range(40):
        util = 95.0 if m < 20 else 0.0
        feed.send(USAGE, usage([record("GPU-a", T0 + m * MIN, T0 + (m + 1) * MIN, util=util)]))
        feed.send(USAGE, on_n2(T0 + m * MIN, T0 + (m + 1) * MIN))
    opened = {a.rule for a in feed.alerts() if a.job_id == "j1" and a.status == "open"}
    assert "hung" in opened
    feed.send(LIFE, event("failed", 45, job="j1"))
    t = T0 + 40 * MIN
    for _ in range(26 * 6):
        feed.send(USAGE, on_n2(t, t + 10 * MIN))
        t += 10 * MIN
    closed = [a for a in feed.alerts() if a.job_id == "j1" and a.status == "closed"]
    assert {a.rule for a in closed} == opened
    assert all(a.closed_at_ms == T0 + 45 * MIN and "its usage up to the end never came" in a.message for a in closed)
    assert ("c1", "j1", 0) not in feed.w.attempts and not [a for a in feed.w.open_alerts() if a["job_id"] == "j1"]


# --------------------------------------------------------------------------- close windows
def test_a_close_window_longer_than_the_opening_ones_still_closes():
    # hung.close_s = 70 minutes, longer than every opening window: the buckets were pruned before it
    # could fill, and the alert stayed open while the job worked for hours
    feed = Feed(watcher(hung={"close_s": 4200}))
    feed.send(LIFE, event("allocated", 0))
    feed.send(LIFE, event("started", 0))
    for m in range(300):  # trains 15-50, hangs 50-70, trains again from 70
        util = 5.0 if m < 15 else 95.0 if m < 50 else 0.0 if m < 70 else 95.0
        feed.minute(m, lambda s, e: [record(g, s, e, util=util) for g in ("GPU-a", "GPU-b")])
    hung = [(s, t // MIN) for r, s, t, _ in summary(feed.alerts()) if r == "hung"]
    assert hung == [("open", 60), ("closed", 140)]


# --------------------------------------------------------------------------- bounded state
def test_gpus_and_nodes_that_come_and_go_are_forgotten():
    # a fresh autoscaled node with 8 new GPUs every hour for 4 days: the GPUs and nodes seen grew for ever
    feed = Feed(watcher())
    t, sizes = T0, []
    for day in range(4):
        for hour in range(24):
            node, job = f"spot-{day}-{hour}", f"job-{day}-{hour}"
            feed.send(LIFE, event("allocated", (t - T0) // MIN, job=job))
            for k in range(6):
                s, e = t + k * 10 * MIN, t + (k + 1) * 10 * MIN
                feed.send(USAGE, usage([dict(record(f"GPU-{node}-{g}", s, e, job=job), node=node) for g in range(8)],
                                       node=node))
            feed.send(LIFE, event("completed", (t - T0) // MIN + 60, job=job))
            t += 60 * MIN
        sizes.append((len(feed.w.gpu_seen), len(feed.w.gpu_partition), len(feed.w.node_seen)))
    # a day and up to an hour of nodes kept (the retention, looked at hourly), not all of them
    assert sizes[0] == (24 * 8, 24 * 8, 24)
    assert all(g <= 26 * 8 and p == g and n <= 26 for g, p, n in sizes[1:]), sizes
    # what a rule still uses stays: the newest node and its GPUs
    assert (("c1", "GPU-spot-3-23-0") in feed.w.gpu_seen) and ("c1", "spot-3-23") in feed.w.node_seen


# --------------------------------------------------------------------------- straggler
def test_a_straggler_alert_closes_when_the_job_gives_the_lagging_gpu_up():
    # GPU-b lags from minute 30 (straggler opens at 36); at 45 the job gives GPU-b up and runs on GPU-a
    # alone: with one GPU there is no spread to judge, and the alert stayed open until the job's end
    feed = Feed(watcher())
    feed.send(LIFE, event("started", 0))
    for m in range(90):
        def records(s, e, m=m):
            if m >= 45:
                return [record("GPU-a", s, e), record("GPU-b", s, e, state="unallocated", util=0.0)]
            return [record("GPU-a", s, e), record("GPU-b", s, e, util=40.0 if m >= 30 else 90.0)]
        feed.minute(m, records)
    alerts = summary(feed.alerts())
    assert [(r, st) for r, st, _, _ in alerts] == [("straggler", "open"), ("straggler", "closed")]
    assert alerts[0][2] == 36 * MIN and 45 * MIN <= alerts[1][2] <= 46 * MIN
    assert "GPU GPU-b no longer runs the job" in feed.alerts()[1].message
