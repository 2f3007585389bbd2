"""What the warehouse holds of each (topic, partition): the sink's progress records (`sink_progress`, sql/0009).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol
from gpuledger.sink.writer import insert_block





log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the warehouse holds of one (topic, partition): offsets below `done_to` are in; the range
    [pending[0], pending[1]) may be partly in (written with its token, not yet confirmed).
    `horizons` (usage only): per GPU, the end of the latest record taken — as of `done_to`, or, when
    a range is pending, as of its start."""

    epoch: int = 0
    done_to: int = 0
    pending: tuple[int, int] | None = None
    horizons: dict[str, int] = field(default_factory=dict)


class ProgressStore(Protocol):
    def load(self, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], Progress]: ...

    def save(self, rows: list[dict]) -> None: ...


class MemoryProgress:
    """A ProgressStore in memory (unit tests)."""

    def __init__(self):
        self.rows: list[dict] = []

    def save(self, rows: list[dict]) -> None:
        self.rows.extend(dict(r) for r in rows)

    def load(self, partitions):
        out = {}
        for r in sorted(self.rows, key=lambda r: r["seq"]):
            key = (r["topic"], r["partition"])
            if key in partitions:
                out[key] = _progress_from_row(r)
        return out


def _progress_from_row(r: dict) -> Progress:
    if r["phase"] == "pending":
        return Progress(r["epoch"], r["from_offset"], (r["from_offset"], r["to_offset"]), dict(r["horizons"]))
    return Progress(r["epoch"], r["to_offset"], None, dict(r["horizons"]))


class ClickHouseProgress:
    """The `sink_progress` table (sql/0009): the latest row per (consumer, topic, partition) wins."""

    TABLE = "sink_progress"

    def __init__(self, client, database: str, consumer: str):
        self.client, self.database, self.consumer = client, database, consumer

    def save(self, rows: list[dict]) -> None:
        insert_block(self.client, self.TABLE, [{**r, "consumer": self.consumer} for r in rows], self.database)

    def load(self, partitions):
        wanted = set(partitions)
        result = self.client.query(
            f"SELECT topic, partition, argMax(epoch, seq) AS epoch, argMax(from_offset, seq) AS from_offset, "
            f"argMax(to_offset, seq) AS to_offset, argMax(phase, seq) AS phase, argMax(horizons, seq) AS horizons, "
            f"max(seq) AS last_seq FROM `{self.database}`.{self.TABLE} WHERE consumer = {{c:String}} "
            f"GROUP BY topic, partition", parameters={"c": self.consumer})
        return {(r["topic"], r["partition"]): _progress_from_row(r)
                for r in result.named_results() if (r["topic"], r["partition"]) in wanted}
