"""The private parts of faust-streaming and aiokafka the worker relies on (streams/app.py).

The worker bounds the broker's long-poll wait (`GPULEDGER_KAFKA_FETCH_MAX_WAIT_MS`; Faust fixes it at
1.5 s) by subclassing three classes of Faust's aiokafka driver and setting one private attribute
of aiokafka's consumer. None of that is public API, so both packages are pinned in pyproject.toml
and this file fails, naming what moved, when an upgrade changes any of it. When upgrading: bump
the pin, run this file, re-read the changed internals, adapt `_ShortPollConsumerThread`,
`_ShortPollConsumer`, `_LedgerTransport` and `LedgerApp` in streams/app.py, and run
tests/integration/test_worker.py (the worker's hops must stay fast on Tansu)."""

import asyncio
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import aiokafka
import faust
import pytest
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as aiokafka_driver

from gpuledger.streams import app as ledger_app

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
UPGRADE = ("; streams/app.py relies on it (bounded fetch wait): re-read the new version's code and adapt "
           "streams/app.py before changing the pin (see this file's docstring)")


def _pinned(package: str) -> str:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{re.escape(package)}\s*==\s*([\w.]+)", dep.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{package} is not pinned with == in pyproject.toml{UPGRADE}")


@pytest.mark.parametrize("package", ["faust-streaming", "aiokafka"])
def test_the_packages_whose_internals_are_used_are_pinned_to_the_installed_version(package):
    assert version(package) == _pinned(package), (
        f"installed {package} {version(package)} is not the pinned {_pinned(package)}{UPGRADE}")


def _method(cls: type, name: str) -> inspect.Signature:
    assert callable(getattr(cls, name, None)), f"{cls.__module__}.{cls.__qualname__}.{name} is gone{UPGRADE}"
    return inspect.signature(getattr(cls, name))


@pytest.mark.parametrize("subclass, base, method, params", [
    (ledger_app._ShortPollConsumerThread, aiokafka_driver.AIOKafkaConsumerThread, "_create_worker_consumer",
     ["self", "transport"]),
    (ledger_app._ShortPollConsumer, aiokafka_driver.Consumer, "_new_consumer_thread", ["self"]),
    (ledger_app.LedgerApp, faust.App, "_new_transport", ["self"]),
])
def test_every_overridden_driver_method_exists_with_the_same_parameters(subclass, base, method, params):
    assert issubclass(subclass, base)
    assert list(_method(base, method).parameters) == params, (
        f"{base.__qualname__}.{method} now takes {list(_method(base, method).parameters)}, not {params}{UPGRADE}")
    assert method in vars(subclass), f"streams/app.py no longer overrides {method}: update this test"


def test_the_transport_picks_its_consumer_class_from_a_class_attribute():
    assert aiokafka_driver.Transport.Consumer is aiokafka_driver.Consumer, f"Transport.Consumer changed{UPGRADE}"
    assert ledger_app._LedgerTransport.Consumer is ledger_app._ShortPollConsumer
    # LedgerApp builds its transport as the driver does: Transport(conf.broker_consumer, app)
    assert "self.conf.broker_consumer" in inspect.getsource(faust.App._new_transport), (
        f"faust.App._new_transport no longer builds the transport from conf.broker_consumer{UPGRADE}")
    assert list(inspect.signature(faust.transport.base.Transport.__init__).parameters)[:3] == ["self", "url", "app"]


def test_the_consumer_thread_is_built_as_the_driver_builds_it():
    # _ShortPollConsumer._new_consumer_thread copies the driver's construction and reads `self.app`
    assert "AIOKafkaConsumerThread(self, loop=self.loop, beacon=self.beacon)" in inspect.getsource(
        aiokafka_driver.Consumer._new_consumer_thread), f"the driver builds its consumer thread differently{UPGRADE}"
    assert "self.app = " in inspect.getsource(faust_consumer.ConsumerThread.__init__), (
        f"ConsumerThread no longer sets self.app{UPGRADE}")


def test_faust_still_fixes_the_fetch_wait_that_the_worker_overrides():
    source = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._create_worker_consumer)
    assert "fetch_max_wait_ms=" in source and "aiokafka.AIOKafkaConsumer(" in source, (
        f"Faust's _create_worker_consumer no longer builds an AIOKafkaConsumer with fetch_max_wait_ms{UPGRADE}")


def test_aiokafka_reads_the_private_fetch_wait_when_the_consumer_starts():
    async def build() -> aiokafka.AIOKafkaConsumer:
        return aiokafka.AIOKafkaConsumer(bootstrap_servers="localhost:1", fetch_max_wait_ms=1234)

    consumer = asyncio.run(build())  # built, never started: no connection
    assert getattr(consumer, "_fetch_max_wait_ms", None) == 1234, (
        f"aiokafka.AIOKafkaConsumer no longer keeps fetch_max_wait_ms in _fetch_max_wait_ms{UPGRADE}")
    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in inspect.getsource(aiokafka.AIOKafkaConsumer.start), (
        f"AIOKafkaConsumer.start no longer hands _fetch_max_wait_ms to its fetcher{UPGRADE}")


def test_the_stream_and_event_calls_the_worker_makes_exist():
    # manual acknowledgement: the worker acks input only once a snapshot covers it
    assert "enable_acks" in inspect.signature(faust.Stream.__init__).parameters
    for cls, name in [(faust.Stream, "events"), (faust.Event, "ack")]:
        _method(cls, name)


def test_faust_keeps_the_last_offset_it_handed_out_where_the_lag_timer_reads_it():
    # measure_lag (streams/app.py) reads Consumer._read_offset: the offset of the last message per partition
    # Faust handed to the agents
    assert "self._read_offset" in inspect.getsource(faust_consumer.Consumer.__init__), (
        f"faust's Consumer no longer keeps _read_offset{UPGRADE}")
    assert "_read_offset[" in inspect.getsource(faust_consumer.Consumer), (
        f"faust's Consumer no longer records the offsets it hands out in _read_offset{UPGRADE}")
