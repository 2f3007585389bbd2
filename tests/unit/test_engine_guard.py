"""The unit-test guard (tests/conftest.py): an unmarked test that opens chDB or Kafka fails."""

import pytest

from gpuledger import warehouse
from gpuledger.embedded.broker import EmbeddedBroker
from gpuledger.config import Settings


def test_a_unit_test_cannot_open_chdb(tmp_path):
    with pytest.raises(RuntimeError, match="unit test opened ClickHouse"):
        warehouse.connect(Settings(warehouse=f"chdb:{tmp_path}/x", database="d"))


def test_a_unit_test_cannot_open_kafka_or_the_broker():
    from confluent_kafka import Producer

    with pytest.raises(RuntimeError, match="Kafka"):
        Producer({"bootstrap.servers": "x"})
    with pytest.raises(RuntimeError, match="embedded broker"):
        EmbeddedBroker().start()
