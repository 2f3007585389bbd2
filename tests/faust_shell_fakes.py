"""Fakes for driving a Faust app's agents without a broker (tests/unit/test_worker_shell.py,
tests/unit/test_watch_shell.py): an event as an agent's `stream.events()` yields it, a stream of
them, and the exception a replaced `os._exit` raises so that a test sees the exit status."""

from types import SimpleNamespace


class Exited(BaseException):
    """Raised by a test's `os._exit` stand-in (a BaseException: the shells catch Exception)."""


def event(offset: int, raw: bytes, topic: str, partition: int = 0, key: bytes = b"k1") -> SimpleNamespace:
    message = SimpleNamespace(topic=topic, partition=partition, offset=offset, key=key)
    return SimpleNamespace(message=message, value=raw, ack=lambda: None)


class Stream:
    def __init__(self, events):
        self.enable_acks, self._events = True, events

    async def events(self):
        for e in self._events:
            yield e
