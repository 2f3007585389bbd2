"""Definitions of the behaviour alerts and the reclaim suggestions (`[alerts]` and `[reclaim]` in the
ledger configuration; docs/alerts.md explains each parameter).

They are definitions like the accounting's: agreed and versioned, each table on its own (`version`,
bump it when a parameter changes), as they change no cost: a new alert threshold must not give every
usage record a new definition_version. Every alert and suggestion names the version it was made
under, "<[alerts] version>/<rule>.v<n>" (or "<[reclaim] version>/reclaim.v<n>"), where n is the
version of the rule's logic (RULE_VERSIONS), bumped when the code's meaning changes.

Pure: plain frozen data parsed from the TOML document; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from gpuledger.streams.configkeys import refuse_unknown_keys

#: version of each rule's logic (docs/alerts.md); an alert's definition_version is
#: "<[alerts] version>/<rule>.v<n>"
RULE_VERSIONS = {"util_drop": 1, "low_util": 1, "straggler": 1, "hung": 1, "gpu_down": 2}
RECLAIM_VERSION = 1
RULES = tuple(RULE_VERSIONS)


class WatchConfigError(ValueError):
    """An [alerts] or [reclaim] value is unusable; the message says which."""


@dataclass(frozen=True)
class UtilDrop:
    """Utilization drops to at most (100 - drop_pct)% of what it was over `baseline_s`, and no
    minute of the following `recover_s` comes back above that; closed once every minute of a
    `close_s` stretch is back above it."""

    enabled: bool = True
    baseline_s: float = 600.0
    recover_s: float = 600.0
    min_baseline_pct: float = 40.0
    drop_pct: float = 50.0
    close_s: float = 300.0


@dataclass(frozen=True)
class LowUtil:
    """Mean utilization below `floor_pct` over `for_s` (phase-aware); closed when a `recover_s`
    stretch averages at or above the floor again."""

    enabled: bool = True
    floor_pct: float = 10.0
    for_s: float = 1800.0
    recover_s: float = 600.0


@dataclass(frozen=True)
class Straggler:
    """Spread (highest minus lowest per-GPU mean utilization, percentage points) over the last
    `window_s` at least `min_spread_pct` and at least `widen_pct` wider than over the window before."""

    enabled: bool = True
    window_s: float = 600.0
    min_spread_pct: float = 30.0
    widen_pct: float = 15.0


@dataclass(frozen=True)
class Hung:
    """Every GPU of the job holds at least `min_mem_bytes` and none is above `util_max_pct` in any
    minute of `for_s`; closed once every minute of a `close_s` stretch shows work (or the memory is
    released): a single busy minute is not a recovery."""

    enabled: bool = True
    for_s: float = 600.0
    util_max_pct: float = 1.0
    min_mem_bytes: int = 1 << 30
    close_s: float = 300.0


@dataclass(frozen=True)
class GpuDown:
    """A GPU held by a running job goes down (the agent reports it down: fatal Xid, off the bus)."""

    enabled: bool = True


@dataclass(frozen=True)
class AlertDefinitions:
    #: the version of these parameters, named by every alert
    version: str = "alerts-1"
    #: no shape rule but gpu_down looks at a job's first `startup_grace_s` (model loading)
    startup_grace_s: float = 900.0
    #: a checkpoint_begin without its checkpoint_end excludes at most this long
    checkpoint_max_s: float = 1800.0
    #: the rules read usage in buckets of this length (records are split across them by duration)
    bucket_s: float = 60.0
    util_drop: UtilDrop = field(default_factory=UtilDrop)
    low_util: LowUtil = field(default_factory=LowUtil)
    straggler: Straggler = field(default_factory=Straggler)
    hung: Hung = field(default_factory=Hung)
    gpu_down: GpuDown = field(default_factory=GpuDown)


@dataclass(frozen=True)
class ReclaimDefinitions:
    #: the version of these parameters, named by every suggestion
    version: str = "reclaim-1"
    enabled: bool = True
    #: rolling window of a queue's execution rate (executing / allocated GPU-time)
    window_s: float = 1800.0
    #: a suggestion opens while the rate is below this (0..1)
    execution_rate_below: float = 0.5
    #: jobs younger than this (since they started) are never named
    min_job_age_s: float = 900.0
    #: a scheduler snapshot older than this (event time) says nothing about waiting work
    snapshot_max_age_s: float = 300.0
    #: a suggestion counts as followed when a named job ended within this long after it
    followed_within_s: float = 3600.0


@dataclass(frozen=True)
class WatchDefinitions:
    alerts: AlertDefinitions = field(default_factory=AlertDefinitions)
    reclaim: ReclaimDefinitions = field(default_factory=ReclaimDefinitions)


def _number(value, where: str, *, low: float = 0.0, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WatchConfigError(f"{where} must be a number, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and (number > low if low_open else number >= low) and number <= high):
        raise WatchConfigError(f"{where} must be {'>' if low_open else '>='} {low:g} and <= {high:g}, got {value!r}")
    return number


def _table(cls, raw, where: str, bounds: dict):
    if not isinstance(raw, dict):
        raise WatchConfigError(f"{where} must be a table")
    refuse_unknown_keys(raw, (f.name for f in fields(cls)), where, WatchConfigError)
    values = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if f.name == "version":
            if not isinstance(value, str) or not value.strip():
                raise WatchConfigError(f"{where}.version must be a non-empty string, got {value!r}")
            values[f.name] = value
            continue
        if f.name == "enabled":
            if not isinstance(value, bool):
                raise WatchConfigError(f"{where}.enabled must be true or false, got {value!r}")
            values[f.name] = value
            continue
        low, high, low_open = bounds.get(f.name, (0.0, math.inf, True))
        number = _number(value, f"{where}.{f.name}", low=low, high=high, low_open=low_open)
        values[f.name] = int(number) if f.name.endswith("_bytes") else number
    return values


_PCT = (0.0, 100.0, False)
_RULE_TABLES = {"util_drop": (UtilDrop, {"min_baseline_pct": _PCT, "drop_pct": (0.0, 100.0, True)}),
                "low_util": (LowUtil, {"floor_pct": (0.0, 100.0, True)}),
                "straggler": (Straggler, {"min_spread_pct": (0.0, 100.0, True), "widen_pct": _PCT}),
                "hung": (Hung, {"util_max_pct": _PCT, "min_mem_bytes": (0.0, math.inf, False)}),
                "gpu_down": (GpuDown, {})}


def parse_watch_definitions(doc: dict, source: str = "") -> WatchDefinitions:
    """The [alerts] and [reclaim] tables of a ledger document (defaults where absent). Messages start
    with `source: ` when it is given (the ledger loader adds the file name itself)."""
    pre = f"{source}: " if source else ""
    alerts_raw = doc.get("alerts", {})
    if not isinstance(alerts_raw, dict):
        raise WatchConfigError(f"{pre}[alerts] must be a table")
    top = {k: v for k, v in alerts_raw.items() if k not in _RULE_TABLES}
    values = _table(AlertDefinitions, top, f"{pre}alerts", {"checkpoint_max_s": (0.0, math.inf, False)})
    for name, (cls, bounds) in _RULE_TABLES.items():
        values[name] = cls(**_table(cls, alerts_raw.get(name, {}), f"{pre}alerts.{name}", bounds))
    alerts = AlertDefinitions(**values)
    if alerts.bucket_s < 1 or alerts.bucket_s > 3600:
        raise WatchConfigError(f"{pre}alerts.bucket_s must be within 1..3600")
    reclaim = ReclaimDefinitions(**_table(ReclaimDefinitions, doc.get("reclaim", {}), f"{pre}reclaim",
                                          {"execution_rate_below": (0.0, 1.0, True),
                                           "min_job_age_s": (0.0, math.inf, False)}))
    return WatchDefinitions(alerts, reclaim)
