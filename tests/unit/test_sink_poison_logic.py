"""Values that once stalled or killed the sink, without Kafka or ClickHouse: an Xid code outside
UInt32 (gpu_health.xid_errors) is a dead letter before any insert; an error the client raises for a
value it cannot serialize is permanent (split and dead-lettered, never retried for ever); and the
retry backoff survives an outage of any length (docs/reliability.md, "Exactly-once into ClickHouse"
and "Bad input"). The same through real chDB and Tansu: tests/integration/test_sink_poison_values.py."""

from __future__ import annotations

import struct

import pytest
from clickhouse_connect.driver.exceptions import DataError, OperationalError

from gpuledger.schemas.models import GpuSample, NodeTick, NodeTickBatch
from gpuledger.schemas.wire import DecodeError, decode_metered_ticks, encode
from gpuledger.sink.batching import BatchingSink
from gpuledger.sink.rows import SAMPLES, Source, process_message
from gpuledger.sink.writer import is_permanent
from gpuledger.streams.checks import rows_problem
from gpuledger.streams.join import check_tick

T0 = 1_764_000_000_000
S = 5000


def tick(k: int, xid: list[int]) -> NodeTick:
    return NodeTick(cluster="c1", node="n1", ts_ms=T0 + k * S, interval_ms=S,
                    gpus=[GpuSample(gpu_uuid="GPU-1", index=0, model="A100-80GB", xid_errors=xid)])


@pytest.mark.parametrize("xid", [-1, 2**32 + 79])
def test_an_xid_code_outside_uint32_is_a_dead_letter_before_any_insert(xid) -> None:
    assert rows_problem({"gpu_health": [{"xid_errors": [79, xid]}]}) == \
        f"value cannot be stored: gpu_health.xid_errors={xid} is outside [0, 4294967295]"
    assert rows_problem({"gpu_health": [{"xid_errors": [0, 79, 2**32 - 1]}]}) is None

    # one tick: the message is a dead letter naming the column and value
    with pytest.raises(DecodeError, match=rf"gpu_health\.xid_errors={xid} is outside"):
        process_message(SAMPLES, encode(tick(0, [xid])), Source("p.gpu-samples", 0, 0), now_ms=T0 + 60_000)
    # a batch: the good ticks keep their rows, the bad one gets a dead letter of its own
    raw = encode(NodeTickBatch(node="n1", ticks=[tick(0, []), tick(1, [xid]), tick(2, [79])]))
    rows = process_message(SAMPLES, raw, Source("p.gpu-samples", 0, 1), now_ms=T0 + 60_000)
    assert [r["ts_ms"] for r in rows["gpu_health"]] == [T0, T0 + 2 * S], "the bad Xid reached the insert"
    [(reason, bad)] = rows.rejected
    assert reason.startswith(f"value cannot be stored: gpu_health.xid_errors={xid}")
    assert bad["ts_ms"] == T0 + S
    # the worker meters the tick anyway: Xid codes are a health field it does not read (as a
    # temperature out of range), so only the health record of the tick is refused
    assert [check_tick(t, 0, now_ms=T0 + 60_000) for t in decode_metered_ticks(raw)] == [None] * 3


def test_a_value_the_client_cannot_serialize_is_permanent() -> None:
    # what clickhouse-connect raises for an Xid of -1 in an Array(UInt32) (driver/common.py)
    try:
        try:
            struct.pack("<I", -1)
        except struct.error as ex:
            raise DataError("Unable to create native array for column `xid_errors`: error") from ex
    except DataError as exc:
        wrapped = exc
    assert is_permanent(wrapped), "a value the client cannot serialize is retried for ever"
    assert is_permanent(DataError("Map insert values must be dictionaries, got int."))
    try:
        try:
            raise OverflowError("int too big to convert")
        except OverflowError as ex:
            raise RuntimeError("serializer failed") from ex
    except RuntimeError as exc:
        assert is_permanent(exc)
    # transient stays transient
    assert not is_permanent(ConnectionError("refused"))
    assert not is_permanent(OperationalError("Error HTTPConnectionPool: read timed out"))
    assert not is_permanent(RuntimeError("Code: 60. DB::Exception: Unknown table"))


class DownFor:
    """A warehouse that refuses the first `n` writes as unavailable (pure logic, no ClickHouse)."""

    def __init__(self, n: int):
        self.left, self.calls, self.rows = n, 0, []

    def write(self, table, rows, token=None):
        self.calls += 1
        if self.left:
            self.left -= 1
            raise ConnectionError("warehouse unavailable")
        self.rows += rows


def test_the_backoff_survives_an_outage_of_any_length() -> None:
    # 1100 failed tries: ~9 h at the 30 s cap; 2**1024 does not fit a float
    warehouse, slept = DownFor(1100), []
    sink = BatchingSink(warehouse, backoff_max_s=30.0, sleep=slept.append)
    sink.add({"job_events": [{"kafka_offset": 0, "ts_ms": T0}]}, Source("p.lifecycle-accepted", 0, 0))
    sink.flush()
    assert warehouse.calls >= 1101 and len(warehouse.rows) == 1
    assert slept[:3] == [0.5, 1.0, 2.0]
    assert max(slept) == 30.0 and slept[-1] == 30.0
