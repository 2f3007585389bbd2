"""The Faust shell of the watcher (gpuledger/watch.py), driven without a broker: its agents read fake
streams, the snapshot reader and the producer are replaced. As the worker's (test_worker_shell.py),
it must never go on past a message whose alerts were not sent, nor past a snapshot it could not read
or restore: its state has moved past the message, and the next snapshot would cover alerts never
published. And a usage batch with one record it cannot read is applied without that record, each
of its other records once."""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path
from types import SimpleNamespace

import faust
import faust.topics
import orjson
import pytest

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import Alert, JobEvent, UsageRecord
from gpuledger.schemas.wire import encode
from gpuledger import watch as watch_shell
from faust_shell_fakes import Exited, Stream, event

LEDGER = load_ledger_config(Path(__file__).parents[1] / "fixtures" / "unit_ledger.toml")
MIN = 60_000
T0 = 28_333_334 * MIN


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """A watch app (no broker), its watcher, the exit codes it asked for (os._exit raises Exited) and
    what it sent (topic, value)."""
    settings = Settings(data_dir=tmp_path, kafka_bootstrap="127.0.0.1:1")
    exits: list[int] = []
    sent: list[tuple[str, bytes]] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise Exited(code)

    async def accept(self, *args, key=None, value=None, **kwargs):
        sent.append((self.get_topic_name(), value))
        return asyncio.get_running_loop().create_future()

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(watch_shell, "read_last_snapshot", lambda *a, **kw: None)
    monkeypatch.setattr(faust.topics.Topic, "send", accept)
    app = watch_shell.create_watch_app(settings, LEDGER)
    return SimpleNamespace(app=app, settings=settings, watcher=app.watcher, exits=exits, sent=sent)


def run_agent(shell, topic: str, events) -> None:
    name = "watch_" + topic.rsplit(".", 1)[-1].replace("-", "_")
    asyncio.run(shell.app.agents[name].fun(Stream(events)))


def record(gpu: str, minute: int, state: str = "executing") -> dict:
    held = state == "executing"
    start = T0 + minute * MIN
    return UsageRecord(
        record_id=f"{gpu}/{start}/0", cluster="c1", node="n1", gpu_uuid=gpu, gpu_model="A100-80GB", start_ms=start,
        end_ms=start + MIN, state=state, job_id="j1" if held else "", tenant="acme" if held else "",
        queue="batch" if held else "", share_milli=1000, gpu_ms=MIN, util_pct=90.0, coefficient=1.0,
        coefficient_version="V100-32GB@2020-01-01", effective_gpu_ms=MIN, cost_micros=0,
        definition_version="unit-1").model_dump(mode="json")


def batch(*records) -> bytes:
    return orjson.dumps({"schema_version": 1, "node": "n1", "records": list(records)})


#: GPU-a runs j1 for a minute, then goes down under it: one gpu_down alert
GOES_DOWN = batch(record("GPU-a", 0), record("GPU-a", 1, state="down"))


def alerts(shell) -> list[Alert]:
    return [Alert.model_validate_json(v) for topic, v in shell.sent if topic == shell.settings.topics.alerts]


def test_an_alert_that_cannot_be_sent_stops_the_watcher(shell, monkeypatch) -> None:
    """The broker refuses the alert (a timeout waiting for buffer room): the watcher exits (75)
    before it reads on; going on, its next snapshot covered the message and the alert was lost."""
    async def refuse(self, *args, **kwargs):
        raise asyncio.TimeoutError("no room in the producer's buffer")

    monkeypatch.setattr(faust.topics.Topic, "send", refuse)
    usage = shell.settings.topics.usage
    with pytest.raises(Exited):
        run_agent(shell, usage, [event(0, GOES_DOWN, usage), event(1, batch(record("GPU-b", 0)), usage)])
    assert shell.exits == [75]
    assert shell.watcher.next_offsets[usage] == {0: 1}, "the watcher read on after a message whose alert was lost"


def test_a_snapshot_the_watcher_cannot_read_stops_it(shell, monkeypatch, caplog) -> None:
    def unreachable(*args, **kwargs):
        raise TimeoutError("could not read the last snapshot within 30s")

    monkeypatch.setattr(watch_shell, "read_last_snapshot", unreachable)
    usage = shell.settings.topics.usage
    with pytest.raises(Exited):
        run_agent(shell, usage, [event(0, GOES_DOWN, usage)])
    assert shell.exits == [75] and shell.sent == []
    assert "cannot read its snapshot (TimeoutError" in caplog.text, caplog.text


def test_a_snapshot_the_watcher_cannot_restore_stops_it_with_the_reason(shell, monkeypatch, caplog) -> None:
    """A snapshot written by another watcher version (after a rollback): it exits naming the version
    (78), rather than its agent restarting while the messages pass unprocessed on an empty state."""
    blob = zlib.compress(orjson.dumps({"version": 99}))
    monkeypatch.setattr(watch_shell, "read_last_snapshot", lambda *a, **kw: blob)
    usage = shell.settings.topics.usage
    with pytest.raises(Exited):
        run_agent(shell, usage, [event(0, GOES_DOWN, usage)])
    assert shell.exits == [78] and shell.sent == []
    assert "watcher state version 99 is not 1" in caplog.text, caplog.text


def test_a_bad_record_is_left_out_and_the_rest_of_its_batch_applied_once(shell, caplog) -> None:
    """Record 2 of 3 has an attempt that is no number. Applied record by record, the watcher stopped
    there: GPU-a's down record after it was never read, and the message counted as read. Now the bad
    record is left out with the reason, the others applied (the alert opens), and the message read
    again (a restart before a snapshot covered it) changes and sends nothing."""
    topics = shell.settings.topics
    bad = {**record("GPU-b", 0), "attempt": "x"}
    usage = batch(record("GPU-a", 0), bad, record("GPU-a", 1, state="down"))
    run_agent(shell, topics.lifecycle_accepted, [event(0, encode(JobEvent(
        event_id="j1-started", ts_ms=T0, kind="started", cluster="c1", job_id="j1", tenant="acme", queue="batch")),
        topics.lifecycle_accepted)])
    run_agent(shell, topics.usage, [event(0, usage, topics.usage), event(0, usage, topics.usage)])
    assert [(a.rule, a.status, a.gpus) for a in alerts(shell)] == [("gpu_down", "open", ["GPU-a"])]
    assert shell.watcher.counters["bad_records"] == 1 and shell.watcher.counters["errors"] == 0
    assert shell.watcher.counters["redelivered"] == 1
    assert "leaving out record 1 of 3 of gpuledger.usage[0]@0: attempt: Input should be a valid integer" in caplog.text
    assert caplog.text.count("leaving out") == 1, "logged again when read again"
    assert ("c1", "GPU-b") not in shell.watcher.gpu_seen  # the bad record's GPU: nothing of it applied


def test_a_message_that_is_no_usage_batch_is_skipped_whole(shell) -> None:
    """Not JSON, or no list of records: nothing to pick good records from; the watcher skips it as
    before (bad_input) and reads on."""
    usage = shell.settings.topics.usage
    run_agent(shell, usage, [event(0, b"{not json", usage), event(1, orjson.dumps({"records": 3}), usage),
                             event(2, GOES_DOWN, usage)])
    assert shell.watcher.counters["bad_input"] == 2 and shell.watcher.counters["bad_records"] == 0
    assert shell.watcher.next_offsets[usage] == {0: 3}


class FakeMessage:
    def __init__(self, topic: str, value):
        self._topic, self._value = topic, value

    def topic(self):
        return self._topic

    def value(self):
        return self._value

    def error(self):
        return None


class FakeConsumer:
    """What `tail_alerts` uses of confluent-kafka's Consumer: one partition of each topic, whose
    messages it hands out in turn."""

    def __init__(self, messages):
        self.messages = list(messages)

    def list_topics(self, timeout=None):
        return SimpleNamespace(topics={m.topic(): SimpleNamespace(partitions={0: None}) for m in self.messages})

    def assign(self, partitions):
        pass

    def poll(self, timeout=None):
        return self.messages.pop(0) if self.messages else None

    def close(self):
        pass


def test_tail_prints_past_messages_it_cannot_read(monkeypatch) -> None:
    """Anyone may write to the alerts topic: a tombstone, JSON that is no object, an alert missing a
    field. `gpuledger tail alerts` crashed on each (TypeError, KeyError); it skips what is no JSON and
    prints other JSON as it is, and goes on to the next alert."""
    import io

    from gpuledger.watch import tail_alerts

    settings = Settings(kafka_bootstrap="127.0.0.1:1")
    topic = settings.topics.alerts
    alert = Alert(alert_id="a1", rule="hung", definition_version="v/hung.v1", cluster="c1", job_id="j1", attempt=0,
                  tenant="acme", queue="batch", gpus=["GPU-a"], status="open", opened_at_ms=T0, window_start_ms=T0,
                  window_end_ms=T0, message="stuck")
    messages = [FakeMessage(topic, None), FakeMessage(topic, b"[1, 2]"), FakeMessage(topic, b"7"),
                FakeMessage(topic, b'{"alert_id": "a0"}'), FakeMessage(topic, encode(alert))]
    monkeypatch.setattr(watch_shell, "Consumer", lambda config: FakeConsumer(messages))
    printed = io.StringIO()
    assert tail_alerts(settings, out=printed, max_messages=4, idle_timeout_s=5) == 4
    lines = printed.getvalue().splitlines()
    assert lines[:3] == [f"{topic}: [1, 2]", f"{topic}: 7", f'{topic}: {{"alert_id": "a0"}}']
    assert "ALERT OPEN   hung      c1/j1#0 tenant=acme gpus=GPU-a: stuck" in lines[3]
