"""The sink's rules without Kafka or ClickHouse: the shared checks before any insert, errors that can
never succeed split down to the poison message (exactly once across a crash mid-split), transient
errors retried through the polling wait, progress seq from offsets, and re-emitted accepted events."""

from __future__ import annotations

import re

import pytest

from gpuledger.schemas.models import JobProgress, QueueState, RankProgress, SchedulerSnapshot
from gpuledger.schemas.wire import DecodeError, encode
from gpuledger.sink.rows import JOB_EVENTS, PROGRESS, SNAPSHOTS
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.progress import MemoryProgress
from gpuledger.sink.writer import PermanentWriteError, error_code, is_permanent
from gpuledger.sink.rows import Source, process_message
from gpuledger.streams.checks import CLOCK_AHEAD_MS, DAY_MS

T0 = 1_793_577_600_000
SNAP = "p.scheduler-snapshots"
ACCEPTED = "p.lifecycle-accepted"


class Crash(BaseException):
    """The process dies here."""


class ChError(Exception):
    """What chDB raises: the code only in the text."""


class Warehouse:
    """Dedups by token like ClickHouse; refuses (Code: 252) any block holding more than `max_months`
    distinct months, and (Code: 53) any block holding a row marked poison; can crash after N writes."""

    def __init__(self, max_months=3):
        self.tables: dict[str, list[dict]] = {}
        self.tokens: set[str] = set()
        self.max_months = max_months
        self.writes = 0
        self.crash_after: int | None = None
        self.down = 0

    def write(self, table, rows, token=None):
        if self.down:
            self.down -= 1
            raise ConnectionError("warehouse down")
        if any(r.get("poison") for r in rows):
            raise ChError("Code: 53. DB::Exception: Type mismatch in column. (TYPE_MISMATCH)")
        if len({r["ts_ms"] // (30 * DAY_MS) for r in rows}) > self.max_months:
            raise ChError("Code: 252. DB::Exception: Too many partitions for single INSERT block. (TOO_MANY_PARTS)")
        if token not in self.tokens:
            self.tokens.add(token)
            self.tables.setdefault(table, []).extend(rows)
        self.writes += 1
        if self.crash_after is not None and self.writes >= self.crash_after:
            self.crash_after = None
            raise Crash()


def snapshot_rows(n, *, months_apart=True, poison_at=()):
    out = []
    for offset in range(n):
        ts = T0 + (offset * 31 * DAY_MS if months_apart else offset)
        out.append((offset, {"scheduler_snapshots": [{"ts_ms": ts, "kafka_offset": offset, "q": offset,
                                                      "poison": offset in poison_at}]}))
    return out


def feed(sink, messages, topic=SNAP, partition=0):
    for offset, rows in messages:
        sink.add(rows, Source(topic, partition, offset))
    return sink.flush()


def test_1970_and_far_future_snapshots_and_unstorable_values_are_refused_before_any_insert():
    src = Source(SNAP, 0, 0)
    now = T0
    with pytest.raises(DecodeError, match="before 2000"):
        process_message(SNAPSHOTS, encode(SchedulerSnapshot(cluster="c", ts_ms=31 * DAY_MS, queues=[])), src, now_ms=now)
    with pytest.raises(DecodeError, match="clock at receipt"):
        process_message(SNAPSHOTS, encode(SchedulerSnapshot(cluster="c", ts_ms=now + 30 * DAY_MS, queues=[])), src,
                        now_ms=now)
    huge = SchedulerSnapshot(cluster="c", ts_ms=now, queues=[QueueState(queue="q", quota_gpus=1, allocated_gpus=0,
                                                                        pending_jobs=2**40, pending_gpus=0)])
    with pytest.raises(DecodeError, match="pending_jobs"):
        process_message(SNAPSHOTS, encode(huge), src, now_ms=now)
    ok = SchedulerSnapshot(cluster="c", ts_ms=now - DAY_MS, queues=[QueueState(queue="q", quota_gpus=1,
                                                                               allocated_gpus=0, pending_jobs=2,
                                                                               pending_gpus=0)])
    assert len(process_message(SNAPSHOTS, encode(ok), src, now_ms=now)["scheduler_snapshots"]) == 1



def test_progress_and_snapshots_from_a_clock_ahead_are_refused_like_ticks():
    """A training node's clock an hour fast: its progress report, accepted under the 7-day window,
    became the pilot's last window (the estimate's central cost 10.61 -> 133.01 in the golden
    pilot). A scheduler agent's snapshot an hour ahead would be the latest queue state for that
    hour. Both are held to GPULEDGER_MAX_CLOCK_AHEAD_S, as ticks, events and watermarks are."""
    src, now = Source("p.job-progress", 0, 0), T0
    ahead = now + CLOCK_AHEAD_MS + 1
    with pytest.raises(DecodeError, match="clock ahead: progress of j1"):
        process_message(PROGRESS, encode(JobProgress(ts_ms=ahead, job_id="j1", step=10)), src, now_ms=now)
    with pytest.raises(DecodeError, match="clock ahead: snapshot of c"):
        process_message(SNAPSHOTS, encode(SchedulerSnapshot(cluster="c", ts_ms=ahead, queues=[])), src, now_ms=now)
    # at the bound, and from a tool replaying recorded data (no clock), they are stored
    at_bound = now + CLOCK_AHEAD_MS
    assert process_message(PROGRESS, encode(JobProgress(ts_ms=at_bound, job_id="j1", step=10)), src, now_ms=now)
    assert process_message(PROGRESS, encode(JobProgress(ts_ms=ahead + DAY_MS, job_id="j1", step=10)), src)
    assert process_message(SNAPSHOTS, encode(SchedulerSnapshot(cluster="c", ts_ms=at_bound, queues=[])), src,
                           now_ms=now)



def test_a_progress_report_naming_a_rank_twice_is_refused():
    """Rank 1 listed twice counted twice in job_rank_step_times (its spread and mean moved)."""
    src = Source("p.job-progress", 0, 0)
    twice = JobProgress(ts_ms=T0, job_id="j1", step=10, ranks=[RankProgress(rank=0, step_time_ms=100),
                                                                 RankProgress(rank=1, step_time_ms=300),
                                                                 RankProgress(rank=1, step_time_ms=300)])
    with pytest.raises(DecodeError, match="rank 1 is reported twice"):
        process_message(PROGRESS, encode(twice), src, now_ms=T0)
    once = twice.model_copy(update={"ranks": twice.ranks[:2]})
    assert len(process_message(PROGRESS, encode(once), src, now_ms=T0)["job_progress"]) == 1


def test_errors_are_classified_by_code():
    assert error_code(ChError("Code: 252. DB::Exception: too many partitions")) == 252
    assert is_permanent(ChError("Code: 252. DB::Exception")) and is_permanent(OverflowError("int too big"))
    assert not is_permanent(ConnectionError("down")) and not is_permanent(ChError("Code: 60. Unknown table"))
    assert not is_permanent(RuntimeError("something else"))

    class WithCode(Exception):
        code = 321
    assert is_permanent(WithCode("out of range"))


def test_a_block_the_warehouse_can_never_take_is_split_and_the_sink_moves_on():
    wh = Warehouse(max_months=3)
    poisoned = []
    sink = BatchingSink(wh, MemoryProgress(), batch_rows=10_000, on_poison=lambda *a: poisoned.append(a),
                        sleep=lambda s: pytest.fail("a permanent error must not be retried"))
    written, offsets = feed(sink, snapshot_rows(20, poison_at={7}))
    rows = wh.tables["scheduler_snapshots"]
    assert sorted(r["kafka_offset"] for r in rows) == [o for o in range(20) if o != 7]  # each once
    assert [(key, offset, table) for key, offset, table, _rows, _reason, _key in poisoned] == [((SNAP, 0), 7,
                                                                                                 "scheduler_snapshots")]
    assert "Code: 53" in poisoned[0][4] and "not retried" in poisoned[0][4]
    assert offsets == {(SNAP, 0): 20} and written == {"scheduler_snapshots": 19}
    assert sink.splits > 0 and sink.poisoned == 1
    # and the next block goes in whole
    written, offsets = feed(sink, [(20, {"scheduler_snapshots": [{"ts_ms": T0, "kafka_offset": 20}]})])
    assert offsets == {(SNAP, 0): 21}


@pytest.mark.parametrize("crash_after", range(1, 12))
def test_a_crash_in_the_middle_of_a_split_still_writes_every_row_once(crash_after):
    wh = Warehouse(max_months=2)
    progress = MemoryProgress()
    messages = snapshot_rows(12, poison_at={3, 9})
    wh.crash_after = crash_after
    sink = BatchingSink(wh, progress, batch_rows=10_000)
    try:
        feed(sink, messages)
        crashed = False
    except Crash:
        crashed = True
    # restart: everything from the last committed offset (0), progress from the store
    sink = BatchingSink(wh, progress, batch_rows=10_000)
    sink.assign([(SNAP, 0)])
    feed(sink, messages)
    got = sorted(r["kafka_offset"] for r in wh.tables["scheduler_snapshots"])
    assert got == [o for o in range(12) if o not in (3, 9)], (crashed, got)


def test_an_outage_is_waited_out_through_the_polling_sleep_and_reported_as_recovered():
    wh = Warehouse()
    wh.down = 4
    waits, recovered = [], []
    sink = BatchingSink(wh, MemoryProgress(), sleep=waits.append, on_recovered=lambda: recovered.append(1),
                        backoff_s=0.5, backoff_max_s=2.0)
    feed(sink, snapshot_rows(3, months_apart=False))
    assert waits == [0.5, 1.0, 2.0, 2.0] and recovered == [1]
    assert len(wh.tables["scheduler_snapshots"]) == 3


def test_progress_seq_comes_from_offsets_not_the_clock():
    progress = MemoryProgress()
    sink = BatchingSink(Warehouse(), progress)
    feed(sink, snapshot_rows(3, months_apart=False))
    feed(sink, [(3, {"scheduler_snapshots": [{"ts_ms": T0, "kafka_offset": 3}]})])
    seqs = [(r["phase"], r["to_offset"], r["seq"]) for r in progress.rows]
    assert [s for *_, s in seqs] == sorted(s for *_, s in seqs) and len({s for *_, s in seqs}) == 4
    assert seqs[0][2] == BatchingSink.SEQ_BASE + 2 * 3 and seqs[1][2] == BatchingSink.SEQ_BASE + 2 * 3 + 1
    again = MemoryProgress()
    feed(BatchingSink(Warehouse(), again), snapshot_rows(3, months_apart=False))
    assert [r["seq"] for r in again.rows] == [s for *_, s in seqs[:2]]  # the same input, the same seq


def test_accepted_events_sent_again_by_a_restarted_worker_are_dropped_by_their_source_offset():
    wh = Warehouse()
    progress = MemoryProgress()
    sink = BatchingSink(wh, progress)

    def msg(src_offset):
        return {"job_events": [{"ts_ms": T0, "event_id": f"e{src_offset}"}]}
    # the worker forwarded source offsets 0..4, crashed, and re-forwarded 2..4 before going on with 5
    for offset, src in enumerate([0, 1, 2, 3, 4, 2, 3, 4, 5]):
        sink.add(msg(src), Source(ACCEPTED, 0, offset), origin=(0, src))
        if offset == 6:
            sink.flush()
            sink = BatchingSink(wh, progress)  # the sink restarts too: the source horizon is in the progress
            sink.assign([(ACCEPTED, 0)])
            for o, s in enumerate([0, 1, 2, 3, 4, 2, 3]):
                assert not sink.add(msg(s), Source(ACCEPTED, 0, o), origin=(0, s))
    sink.flush()
    assert sorted(r["event_id"] for r in wh.tables["job_events"]) == [f"e{i}" for i in range(6)]


def test_the_job_events_line_is_the_accepted_topic():
    from gpuledger.config import Settings
    from gpuledger.sink.loop import _lines, sink_topics

    s = Settings(topic_prefix="x.")
    assert _lines(s)[s.topics.lifecycle_accepted] == JOB_EVENTS and s.topics.job_events not in sink_topics(s)
    assert s.partitions()[s.topics.lifecycle_accepted] == s.partitions_job_events


def test_permanent_write_error_names_its_cause():
    assert "OverflowError" in str(PermanentWriteError(OverflowError("x")))


def test_a_bad_tick_costs_only_itself_and_a_batch_the_worker_cannot_read_is_rejected_whole():
    import orjson

    from gpuledger.schemas.models import GpuSample, NodeTick, NodeTickBatch
    from gpuledger.sink.rows import SAMPLES

    def batch(spoil):
        ticks = [NodeTick(cluster="c", node="n", ts_ms=T0 + k * 5000, interval_ms=5000,
                          gpus=[GpuSample(gpu_uuid="G", index=0, model="A100", util_gpu_pct=5.0)]) for k in range(4)]
        obj = orjson.loads(encode(NodeTickBatch(node="n", ticks=ticks)))
        spoil(obj["ticks"][1]) and spoil(obj["ticks"][3])
        return orjson.dumps(obj)

    src, now = Source("p.gpu-samples", 0, 5), T0 + 60_000
    rows = process_message(SAMPLES, batch(lambda t: t.update(ts_ms=631_152_000_000) or True), src, now_ms=now)
    assert [r["ts_ms"] for r in rows["gpu_health"]] == [T0, T0 + 10_000]
    assert len(rows["node_inventory"]) == 2
    # one rejection per bad tick, each with its own reason and the tick as original
    assert [(why.split(":")[0], t["ts_ms"]) for why, t in rows.rejected] == [("absurd timestamp", 631_152_000_000)] * 2
    assert all(why.endswith("(2 of the batch's 4 ticks rejected; the others stored)") for why, _ in rows.rejected)
    class Tables:
        def write(self, table, rows, token=None):
            return len(rows)

    letters = []
    sink = BatchingSink(Tables(), MemoryProgress(), sleep=lambda s: pytest.fail("nothing here may be retried"))
    assert sink.add(rows, src, letter=lambda: letters.append(src.offset), message_key=b"n")
    written, _ = sink.flush()
    assert written == {"gpu_health": 2, "node_inventory": 2}
    assert letters == [5]
    assert not sink.add(rows, src, letter=lambda: letters.append(src.offset)) and letters == [5]  # read again: no letter
    # a metered field out of range: the worker rejects the whole message, so does the sink
    with pytest.raises(DecodeError, match="ticks.1.gpus.0.util_gpu_pct"):
        process_message(SAMPLES, batch(lambda t: t["gpus"][0].update(util_gpu_pct=500.0)), src, now_ms=now)


def test_the_sink_rejects_the_ticks_the_worker_finds_inconsistent():
    """A tick listing a GPU twice, or one using more memory than it has, is dead-lettered by the
    worker (streams/join.py check_tick): the sink must not store its health and inventory rows
    either, or gpu_health would hold a tick the bills never saw."""
    from gpuledger.schemas.models import GpuSample, NodeTick, NodeTickBatch
    from gpuledger.sink.rows import SAMPLES
    from gpuledger.streams.join import check_tick

    def gpu(uuid, used=None):
        return GpuSample(gpu_uuid=uuid, index=0, model="A100", util_gpu_pct=5.0,
                         mem_used_bytes=used, mem_total_bytes=80 if used is not None else None)

    twice = NodeTick(cluster="c", node="n", ts_ms=T0 + 5000, interval_ms=5000, gpus=[gpu("G"), gpu("G")])
    too_full = NodeTick(cluster="c", node="n", ts_ms=T0 + 10_000, interval_ms=5000, gpus=[gpu("G", used=81)])
    good = NodeTick(cluster="c", node="n", ts_ms=T0, interval_ms=5000, gpus=[gpu("G", used=80)])
    src, now = Source("p.gpu-samples", 0, 5), T0 + 60_000
    for bad in (twice, too_full):
        worker_says = check_tick(bad, 0, now_ms=now)
        assert worker_says and worker_says.startswith("inconsistent tick")
        with pytest.raises(DecodeError, match=re.escape(worker_says)):
            process_message(SAMPLES, encode(bad), src, now_ms=now)
    rows = process_message(SAMPLES, encode(NodeTickBatch(node="n", ticks=[good, twice, too_full])), src, now_ms=now)
    assert [r["ts_ms"] for r in rows["gpu_health"]] == [T0] and len(rows["node_inventory"]) == 1
    (twice_why, twice_tick), (full_why, full_tick) = rows.rejected
    assert twice_why.startswith("inconsistent tick: n ts_ms=") and "lists GPU G twice" in twice_why
    assert full_why.startswith("inconsistent tick: n GPU G uses 81 bytes of 80")
    assert twice_why.endswith("(2 of the batch's 3 ticks rejected; the others stored)")
    assert [twice_tick["ts_ms"], full_tick["ts_ms"]] == [T0 + 5000, T0 + 10_000]


def test_a_partition_revoked_while_its_pending_row_waits_for_the_warehouse_is_left_to_its_new_owner():
    """The warehouse is down when a block's pending rows are to be saved; the run loop keeps polling
    meanwhile, and a rebalance there gives partition 1 to another sink, which loads its progress (no
    pending range: it cuts blocks of its own from the last done offset). This sink must then neither
    record a range of partition 1 nor insert its rows: under this sink's token they were stored again
    beside the new owner's blocks, and the pending row (a higher seq) made the new owner's next load
    rebuild a range it had already written."""

    class DownProgress(MemoryProgress):
        down = 1

        def save(self, rows):
            if self.down:
                self.down -= 1
                raise ConnectionError("warehouse down")
            super().save(rows)

    wh, progress = Warehouse(), DownProgress()
    sink = BatchingSink(wh, progress, sleep=lambda _s: sink.revoke([(SNAP, 1)]))  # the loop's rebalance
    sink.assign([(SNAP, 0), (SNAP, 1)])
    for partition in (0, 1):
        for offset, rows in snapshot_rows(2, months_apart=False):
            sink.add({"scheduler_snapshots": [{**r, "q": partition} for r in rows["scheduler_snapshots"]]},
                     Source(SNAP, partition, offset))
    written, offsets = sink.flush()
    assert written == {"scheduler_snapshots": 2} and offsets == {(SNAP, 0): 2}
    assert {r["q"] for r in wh.tables["scheduler_snapshots"]} == {0}
    assert {(r["partition"], r["phase"]) for r in progress.rows} == {(0, "pending"), (0, "done")}
    assert sink.progress_of((SNAP, 1)).done_to == 0 and sink.buffered == 0
