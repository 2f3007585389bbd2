"""A confluent-kafka producer stand-in whose broker refuses every message: it reports each one
failed when flushed (e.g. topic authorization failed). For the agents' `--once` exit codes
(tests/unit/test_gpu_agent.py, tests/unit/test_dcgm.py); publishing to a real broker is tested in
tests/integration."""

from types import SimpleNamespace


class RefusingProducer:
    def __init__(self, conf):
        self.waiting: list = []

    def produce(self, topic, **kw):
        self.waiting.append((topic, kw))

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=30):
        for topic, kw in self.waiting:  # the broker answers: refused
            msg = SimpleNamespace(topic=lambda: topic, key=lambda: kw["key"], value=lambda: kw["value"])
            kw["on_delivery"]("Broker: Topic authorization failed", msg)
        self.waiting.clear()
        return 0

    def __len__(self):
        return len(self.waiting)


def refuse_every_message(monkeypatch) -> None:
    """Make every KafkaPublisher built after this use a RefusingProducer."""
    from gpuledger.agents import publisher as publisher_module

    real = publisher_module.KafkaPublisher
    monkeypatch.setattr(publisher_module, "KafkaPublisher",
                        lambda settings, **kw: real(settings, producer_factory=RefusingProducer, **kw))
