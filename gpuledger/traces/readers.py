"""What every trace replay shares: the trace time origin, reading CSV / tar.gz files with errors that name the file and line, and the lazily built stream of emissions.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import sys
import tarfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gpuledger.schemas.lines import Emission
from gpuledger.schemas.models import JobEventKind



#: Trace time 0 is mapped onto this instant (2023-01-01T00:00:00Z, epoch milliseconds).
EPOCH_BASE_MS = 1_672_531_200_000
HOUR_MS = 3_600_000

TRACES = ("alibaba-v2023", "alibaba-genai")
CLUSTER_V2023 = "alibaba-v2023"
CLUSTER_GENAI = "alibaba-genai"
#: Neither trace names tenants: every job is billed to this one.
TENANT = "default"
#: Queue priorities for the v2023 QoS classes (the trace gives none; used in events and snapshots).



class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file (and line)."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# =========================================================================== reading
def open_text(path: Path) -> str:
    """The text of a CSV file, of a gzipped one (.csv.gz, .gz), or of the single CSV inside a
    .tar.gz/.tgz/.tar (read in memory)."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path}: is a folder, expected a trace file (docs/traces.md: which files)")
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    name = path.name.lower()
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        try:
            with tarfile.open(path) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and m.name.lower().endswith(".csv")]
                if len(members) != 1:
                    raise TraceError(f"{path}: expected exactly one .csv inside, found {[m.name for m in members]}")
                fh = tar.extractfile(members[0])
                assert fh is not None
                data = fh.read()
        except tarfile.TarError as exc:
            raise TraceError(f"{path}: not a readable tar archive: {exc}") from None
    elif name.endswith(".gz"):
        try:
            data = gzip.decompress(path.read_bytes())
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            raise TraceError(f"{path}: not a readable gzip file: {exc}") from None
    else:
        data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a spreadsheet's byte order mark is not part of the first column's name
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a UTF-8 CSV ({exc.reason} at byte {exc.start}); expected a plain .csv, .csv.gz, "
                         ".tar.gz, .tgz or .tar") from None


def csv_rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with a header that has at least `required` columns. A row with
    more or fewer fields than the header is refused: a line cut short or an unquoted comma would
    otherwise shift or drop columns silently (e.g. a lost scheduled_time reads as never scheduled)."""
    reader = csv.reader(io.StringIO(open_text(path), newline=""))

    def next_fields() -> list[str] | None:
        try:
            return next(reader, None)
        except csv.Error as exc:  # e.g. a stray quote that makes the rest of the file one field
            raise TraceError(f"{path}:{reader.line_num}: not a readable CSV ({exc})") from None

    header = next_fields()
    if header is None:
        raise TraceError(f"{path}: empty file, expected a CSV header with {', '.join(required)}")
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; header is {header}")
    while (fields := next_fields()) is not None:
        if not fields:  # a blank line
            continue
        lineno = reader.line_num  # the file's own line, blank lines and quoted line breaks included
        if len(fields) != len(header):
            raise TraceError(f"{path}:{lineno}: {len(fields)} field(s), the header has {len(header)} (a line cut short, "
                             "or a comma inside a field that is not quoted)")
        yield lineno, dict(zip(header, fields))


def parse_int(value: str, what: str, where: str, *, optional: bool = False) -> int | None:
    text = (value or "").strip()
    if text == "" or text.lower() == "nan":
        if optional:
            return None
        raise TraceError(f"{where}: {what} is empty" if text == "" else f"{where}: {what} is NaN (a number is needed)")
    try:
        number = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise TraceError(f"{where}: {what} must be a finite number, got {value!r}")
    if number != int(number) or number < 0:
        raise TraceError(f"{where}: {what} must be a whole number >= 0, got {value!r}")
    return int(number)



# =========================================================================== emission plumbing
class Emissions:
    """A Sized, lazily built, event-time-ordered iterable of Emissions (so `publish` knows the
    total for progress), remembering the event time of the last one handed out."""

    def __init__(self, items: Sequence[Any], make: Callable[[Any], Emission], start_ms: int, end_ms: int):
        self._items = items
        self._make = make
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.last_ts_ms = start_ms

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Emission]:
        for item in self._items:
            emission = self._make(item)
            self.last_ts_ms = getattr(emission.message, "ts_ms", self.last_ts_ms)
            yield emission


def at_ms(base_ms: int, seconds: float) -> int:
    return base_ms + round(seconds * 1000)


def watermark_times(start_ms: int, end_ms: int, every_ms: int) -> list[int]:
    """Every `every_ms` after start, below end, then end (the final watermark)."""
    times = list(range(start_ms + every_ms, end_ms, every_ms))
    times.append(end_ms)
    return times


# equal-timestamp order: inventory ticks, lifecycle, snapshots, watermarks (as the simulator does)
ORDER_TICK, ORDER_LIFECYCLE, ORDER_SNAPSHOT, ORDER_WATERMARK = range(4)
KIND_ORDER = {k: i for i, k in enumerate((JobEventKind.submitted, JobEventKind.queued, JobEventKind.allocated,
                                           JobEventKind.started, JobEventKind.completed, JobEventKind.failed,
                                           JobEventKind.cancelled))}
