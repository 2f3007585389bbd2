"""The sink's dead letters: handed to the producer, and confirmed delivered before the block that holds their
source message is recorded done (docs/reliability.md, "Exactly-once into ClickHouse").
"""

from __future__ import annotations

import logging
from functools import partial

log = logging.getLogger(__name__)


class UndeliveredLetters(RuntimeError):
    """Dead letters not yet confirmed delivered (the broker is unreachable or refused them)."""


class DeadLetterOutbox:
    """Every letter handed to the producer stays here until its delivery report says it is in the topic.

    `confirm()` sends again the letters whose delivery failed (librdkafka gave up on them, e.g. after
    message.timeout.ms), waits up to `wait_s` and raises UndeliveredLetters while any is still out. The
    sink calls it through its retry helper before saving a block's `done` progress row: a sink that dies
    meanwhile re-handles the block on restart and sends its letters again (a duplicate letter is
    harmless, a lost one is not). `wait_s` is short so the retry helper's polling wait keeps the
    consumer in its group during a long outage of the dead-letter broker."""

    def __init__(self, producer, topic: str, wait_s: float = 5.0):
        self.producer, self.topic, self.wait_s = producer, topic, wait_s
        self._out: dict[int, tuple[bytes | None, bytes]] = {}  # not yet confirmed: id -> (key, value)
        self._failed: dict[int, str] = {}  # delivery reported failed: id -> error, to send again
        self._next = 0
        self.resent = 0

    @property
    def outstanding(self) -> int:
        return len(self._out)

    def send(self, key: bytes | None, value: bytes) -> None:
        self._next += 1
        self._out[self._next] = (key, value)
        self._produce(self._next)

    def _produce(self, letter: int) -> None:
        key, value = self._out[letter]
        while True:
            try:
                self.producer.produce(self.topic, key=key, value=value, on_delivery=partial(self._report, letter))
                return
            except BufferError:  # the producer's queue is full: let it drain
                self.producer.poll(0.5)

    def _report(self, letter: int, err, _msg) -> None:
        if letter not in self._out:
            return
        if err is None:
            del self._out[letter]
            self._failed.pop(letter, None)
        else:
            self._failed[letter] = str(err)

    def confirm(self) -> None:
        if not self._out:
            return
        for letter in list(self._failed):
            del self._failed[letter]
            self.resent += 1
            self._produce(letter)
        self.producer.flush(self.wait_s)
        if self._out:
            errors = sorted(set(self._failed.values()))[:3]
            raise UndeliveredLetters(f"{len(self._out)} dead letters not yet delivered to {self.topic}"
                                     + (f": {'; '.join(errors)}" if errors else " (still in flight)"))
