"""Ledger configuration as plain data: definitions, unit prices and throughput coefficients.

Pure: `parse_ledger_config` turns a parsed TOML document (a mapping) into frozen objects; lookups
are plain functions of (model, time). Reading and writing the files is the edge's job
(gpuledger/ledger_files.py). See docs/accounting.md for the formulas.

Why one file: the ledger document is one schema (definitions, prices, coefficients, power, segments)
read by one set of strict helpers (`table`, `check_keys`, `_bounded`: an unknown key or a quoted
number is an error, never a default); the lookups are a few lines over the same frozen types."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from datetime import date, datetime, timezone

from gpuledger.streams.watchdefs import WatchDefinitions, parse_watch_definitions
from gpuledger.streams.carbondefs import CarbonDefinition, parse_carbon
from gpuledger.streams.configkeys import refuse_unknown_keys

MS_PER_HOUR = 3_600_000
JOULES_PER_KWH = 3_600_000.0

# ---- sane values (docs/accounting.md, "Sane values or none")
#: the most power any card may report or be limited to (the schema's bound on power_w), watts
MAX_POWER_W = 5000.0
#: bounds of the config's money values: a price component per GPU-hour, an electricity price per kWh
MAX_PRICE_PER_HOUR = 1_000_000.0
MAX_PRICE_PER_KWH = 1_000_000.0
MAX_PUE = 10.0
#: a throughput coefficient relative to the baseline card: far above any real card's, and it keeps a
#: record's effective_gpu_ms (an hour x this, 3.6e9) well within usage_raw's UInt64
MAX_COEFFICIENT = 1000.0
#: longest interval one record can cover (NodeTick.interval_ms <= 1 h), milliseconds
MAX_INTERVAL_MS = MS_PER_HOUR
#: the most one usage record can cost, micros: a GPU-hour at the highest prices the config accepts
#: (two fixed components) drawing MAX_POWER_W at the highest electricity price and PUE.
#: 5.2e13 < 2^63: a record always fits usage_raw's UInt64; sums are Int128 (sql/0015).
MAX_RECORD_COST_MICROS = round((2 * MAX_PRICE_PER_HOUR + MAX_POWER_W / 1000 * MAX_PRICE_PER_KWH * MAX_PUE) * 1_000_000)
#: the power limit assumed for a card whose sample names none and whose model has no
#: [power_limits] entry (and no `default` there): above every current data-centre card, watts
DEFAULT_POWER_LIMIT_W = 1500.0
#: an energy-counter delta (or a power reading) up to limit x this is believed
DEFAULT_POWER_LIMIT_TOLERANCE = 1.2
#: [unpriced] policy: what a GPU model without its own price is charged
UNPRICED_POLICIES = ("default", "zero")
#: [segments] defaults (streams/join.py): one usage record per GPU, holder and state for at most a
#: window of this many seconds, aligned to UTC; a silent node's open segment is flushed once the
#: samples of other nodes are this far past its window's end
DEFAULT_SEGMENT_WINDOW_S = 60
DEFAULT_SEGMENT_FLUSH_AFTER_S = 60
#: [execution] min_idle_s at most a week: a quiet stretch longer than that is idle (and a non-finite
#: value would break the join's arithmetic)
MAX_MIN_IDLE_S = 7 * 86400.0
#: [shared_gpu] weights are relative; this bound keeps their sum finite
MAX_SHARED_WEIGHT = 1_000_000.0
#: [approvals] threshold, currency: far above any estimate the config's prices can give, and finite
MAX_APPROVAL_THRESHOLD = 1e15


class LedgerConfigError(ValueError):
    """The ledger configuration file is unusable; the message says where."""


@dataclass(frozen=True)
class UnitPrice:
    depreciation_per_hour: float
    maintenance_per_hour: float

    @property
    def fixed_per_hour(self) -> float:
        return self.depreciation_per_hour + self.maintenance_per_hour


def _day(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).date().isoformat()


@dataclass(frozen=True)
class PriceEntry:
    """One entry of the price history: the unit price of `model` from `valid_from_ms` on (until the
    model's next entry). Every usage record names the entry it was priced with (`price_version`)."""

    model: str
    price: UnitPrice
    valid_from_ms: int
    version: str = field(init=False)  # "MODEL@YYYY-MM-DD", as coefficients

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", f"{self.model}@{_day(self.valid_from_ms)}")


@dataclass(frozen=True)
class Coefficient:
    model: str
    coefficient: float
    valid_from_ms: int
    # "MODEL@YYYY-MM-DD", stored on every usage record; computed once (it is on the hot path)
    version: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "version", f"{self.model}@{_day(self.valid_from_ms)}")


@dataclass(frozen=True)
class Definitions:
    """The parts of the accounting that are agreed with the business, not constants."""

    include_depreciation: bool = True
    include_maintenance: bool = True
    include_power: bool = True
    include_cooling: bool = True
    utilization_aggregation: str = "mean"        # mean | above_threshold
    utilization_threshold_pct: float = 20.0
    shared_split: str = "measured"               # measured | allocation
    shared_sm_weight: float = 0.5
    shared_memory_weight: float = 0.5
    shared_unused: str = "holders"               # holders | platform
    idle_redistribution: str = "none"            # none | even | usage
    #: when an allocated GPU counts as executing (docs/accounting.md, "Executing, measured"):
    #: "events" = from the job's `started` to its end; "measured" = when its use is measured above
    #: the floor (events decide only where nothing is measured); "both" = events say running and the
    #: measurement does not contradict them
    execution_source: str = "both"               # events | measured | both
    execution_util_floor_pct: float = 1.0        # at or below this the holder is quiet
    execution_min_idle_s: float = 300.0          # a quiet stretch counts as idle from this long on

    def utilization_metric(self, util_pct: float | None) -> float | None:
        """A slice's utilization under the agreed aggregation (averaged over GPU-time in reports)."""
        if util_pct is None or self.utilization_aggregation == "mean":
            return util_pct
        return 100.0 if util_pct >= self.utilization_threshold_pct else 0.0


_CHOICES = {
    "utilization_aggregation": ("mean", "above_threshold"),
    "shared_split": ("measured", "allocation"),
    "shared_unused": ("holders", "platform"),
    "idle_redistribution": ("none", "even", "usage"),
    "execution_source": ("events", "measured", "both"),
}


#: the keys each definitions table may hold (any other is a typo: refused, never ignored)
_DEFINITION_KEYS = {
    "cost": ("include_depreciation", "include_maintenance", "include_power", "include_cooling"),
    "utilization": ("aggregation", "threshold_pct"),
    "shared_gpu": ("split", "sm_weight", "memory_weight", "unused"),
    "idle": ("redistribution",),
    "execution": ("source", "util_floor_pct", "min_idle_s"),
}


def parse_definitions(doc: dict, source: str) -> Definitions:
    cost, util, shared, idle, execution = (table(doc, name, _DEFINITION_KEYS[name], source)
                                           for name in ("cost", "utilization", "shared_gpu", "idle", "execution"))
    values = dict(
        include_depreciation=_flag(cost.get("include_depreciation", True), f"{source}: cost.include_depreciation"),
        include_maintenance=_flag(cost.get("include_maintenance", True), f"{source}: cost.include_maintenance"),
        include_power=_flag(cost.get("include_power", True), f"{source}: cost.include_power"),
        include_cooling=_flag(cost.get("include_cooling", True), f"{source}: cost.include_cooling"),
        utilization_aggregation=_text(util.get("aggregation", "mean"), f"{source}: utilization.aggregation"),
        utilization_threshold_pct=_bounded(util.get("threshold_pct", 20.0), 0, 100, f"{source}: utilization.threshold_pct"),
        shared_split=_text(shared.get("split", "measured"), f"{source}: shared_gpu.split"),
        shared_sm_weight=_bounded(shared.get("sm_weight", 0.5), 0, MAX_SHARED_WEIGHT, f"{source}: shared_gpu.sm_weight"),
        shared_memory_weight=_bounded(shared.get("memory_weight", 0.5), 0, MAX_SHARED_WEIGHT,
                                      f"{source}: shared_gpu.memory_weight"),
        shared_unused=_text(shared.get("unused", "holders"), f"{source}: shared_gpu.unused"),
        idle_redistribution=_text(idle.get("redistribution", "none"), f"{source}: idle.redistribution"),
        execution_source=_text(execution.get("source", "both"), f"{source}: execution.source"),
        execution_util_floor_pct=_bounded(execution.get("util_floor_pct", 1.0), 0, 100,
                                          f"{source}: execution.util_floor_pct"),
        execution_min_idle_s=_bounded(execution.get("min_idle_s", 300.0), 0, MAX_MIN_IDLE_S,
                                      f"{source}: execution.min_idle_s"),
    )
    for key, allowed in _CHOICES.items():
        if values[key] not in allowed:
            raise LedgerConfigError(f"{source}: {key.replace('_', '.', 1)} must be one of {', '.join(allowed)}; got {values[key]!r}")
    if values["shared_sm_weight"] + values["shared_memory_weight"] <= 0:
        raise LedgerConfigError(f"{source}: shared_gpu weights must be >= 0 and not both 0")
    if values["execution_util_floor_pct"] == 100:
        raise LedgerConfigError(f"{source}: execution.util_floor_pct must be within 0..100 (100 excluded)")
    return Definitions(**values)


@dataclass(frozen=True)
class LedgerConfig:
    definition_version: str
    currency: str
    baseline_model: str
    reference_model: str
    electricity_price_per_kwh: float
    pue: float
    #: model -> its latest unit price (the whole history is `price_history`)
    prices: dict[str, UnitPrice]
    # model -> entries sorted by valid_from_ms
    coefficients: dict[str, tuple[Coefficient, ...]] = field(default_factory=dict)
    definitions: Definitions = field(default_factory=Definitions)
    # sha256 of everything but the coefficient and price histories: a changed definition must change the version
    fingerprint: str = ""
    #: the fingerprint as computed before [alerts] and [reclaim] were left out of it: a warehouse that
    #: recorded this version then still matches (gpuledger/warehouse/library.py)
    legacy_fingerprint: str = ""
    #: model -> price entries sorted by valid_from_ms (the old `[prices.MODEL]` tables: one entry
    #: valid from the epoch)
    price_history: dict[str, tuple[PriceEntry, ...]] = field(default_factory=dict)
    #: the prices came as undated [prices.MODEL] tables: they belong to the definition version (in the
    #: fingerprint), so a recorded row may be replaced; dated [[prices]] entries are append-only history
    prices_undated: bool = False
    #: model -> the most a card of it can draw, watts (`default`: every other model); a sample's own
    #: power_limit_w comes first (streams/join.py)
    power_limits: dict[str, float] = field(default_factory=dict)
    power_limit_tolerance: float = DEFAULT_POWER_LIMIT_TOLERANCE
    #: what a model without its own price is charged: "default" (the default price) or "zero"
    unpriced_policy: str = "default"
    #: [segments]: usage-record window, ms (1: one record per tick, the old form), and how far the
    #: samples clock must be past a window's end before a silent node's open segment is flushed, ms
    segment_window_ms: int = DEFAULT_SEGMENT_WINDOW_S * 1000
    segment_flush_after_ms: int = DEFAULT_SEGMENT_FLUSH_AFTER_S * 1000
    #: the behaviour alerts' and reclaim suggestions' definitions ([alerts], [reclaim]; streams/watchdefs.py)
    watch: WatchDefinitions = field(default_factory=WatchDefinitions)
    #: [carbon]: energy -> gCO2e (streams/carbondefs.py; docs/carbon.md), versioned on its own
    carbon: CarbonDefinition = field(default_factory=CarbonDefinition)
    #: [approvals] threshold (currency) when the file sets one; None: the estimator's default
    approval_threshold: float | None = None

    def price(self, model: str, at_ms: int | None = None) -> UnitPrice:
        """The unit price of `model` valid at at_ms; None: its latest entry, which may be one agreed in
        advance and not valid yet (the edge passes the clock: this module reads none)."""
        if at_ms is not None:
            return self.price_at(model, at_ms).price
        return self.prices.get(model) or self.prices["default"]

    def price_at(self, model: str, ts_ms: int) -> PriceEntry:
        """The price entry valid at ts_ms for this model; the `default` model's when it has none (then
        the record is flagged `priced_by_default` and charged under the [unpriced] policy)."""
        entry = _valid_at(self.price_history, model, ts_ms)
        if entry is not None:
            return entry
        # Before every entry (history older than the price list): the earliest default price, flagged
        # as priced by default like any unpriced model. Never an error here: this runs in the worker.
        entries = self.price_history.get("default") or self.price_history.get(model)
        if entries:
            return entries[0]
        raise LedgerConfigError(f"no price for model {model!r} (and no 'default' entry)")

    def power_limit_w(self, model: str) -> float:
        """The most power a card of this model is believed to draw, watts: a sample's own lower limit
        tightens it, a higher one does not raise it (docs/accounting.md §4a)."""
        limit = self.power_limits.get(model)
        if limit is None:
            limit = self.power_limits.get("default", DEFAULT_POWER_LIMIT_W)
        return limit

    def coefficient_at(self, model: str, ts_ms: int) -> Coefficient:
        """The coefficient entry valid at ts_ms for this model (falls back to 'default')."""
        entry = _valid_at(self.coefficients, model, ts_ms)
        if entry is not None:
            return entry
        # Before every entry, or no entry at all: the earliest default coefficient, else the baseline's
        # 1.0 (the record is flagged priced by default). Never an error here: this runs in the worker.
        entries = self.coefficients.get("default")
        return entries[0] if entries else _BASELINE

    def interval_cost_micros(self, model: str, duration_ms: int, energy_j: float, ts_ms: int | None = None) -> int:
        """Whole-GPU cost of one interval: fixed hourly parts + measured energy x price x PUE, with the
        price valid at ts_ms (None: the latest), under the [unpriced] policy for a model without one."""
        entry = self.price_at(model, (1 << 62) if ts_ms is None else ts_ms)
        return self.entry_cost_micros(entry, model, duration_ms, energy_j)

    def entry_cost_micros(self, entry: PriceEntry, model: str, duration_ms: int, energy_j: float) -> int:
        """Whole-GPU cost of one interval priced with `entry`. Bounded: the energy is at most
        MAX_POWER_W for the interval (the join caps it at the card's own limit before), so no record
        costs more than MAX_RECORD_COST_MICROS."""
        if entry.model != model and self.unpriced_policy == "zero":
            return 0
        terms = self._cost_terms.get(entry.version) or self._cost_terms.setdefault(entry.version, self.cost_terms_of(entry))
        per_hour, include_power, cooling = terms
        fixed = per_hour * duration_ms / MS_PER_HOUR
        power = 0.0
        if include_power:
            most = MAX_POWER_W * duration_ms / 1000.0
            if not energy_j <= most:  # also NaN
                energy_j = most if energy_j > 0 else 0.0
            power = energy_j / JOULES_PER_KWH * self.electricity_price_per_kwh * cooling
        return round((fixed + power) * 1_000_000)

    @cached_property
    def _cost_terms(self) -> dict[str, tuple[float, bool, float]]:
        """price version -> (fixed cost per hour, power included, cooling factor): filled on first use (hot path)."""
        return {}

    def cost_terms_of(self, entry: PriceEntry) -> tuple[float, bool, float]:
        price, d = entry.price, self.definitions
        per_hour = (price.depreciation_per_hour if d.include_depreciation else 0.0) + \
                   (price.maintenance_per_hour if d.include_maintenance else 0.0)
        return per_hour, d.include_power, (self.pue if d.include_cooling else 1.0)

    def reference_cost_per_gpu_hour(self, at_ms: int | None = None) -> float:
        """Opportunity cost of one waiting GPU for one hour: the reference card's fixed hourly cost valid at
        at_ms (None: its latest entry, see `price`)."""
        return self.price(self.reference_model, at_ms).fixed_per_hour


def date_ms(value, where: str) -> int:
    if isinstance(value, datetime):
        ms = int(value.replace(tzinfo=value.tzinfo or timezone.utc).timestamp() * 1000)
        # A whole UTC day only: an entry's id is MODEL@DAY and the warehouse's valid_from is a Date, so
        # two entries on one day would share an id (and the worker's caches keyed by it)
        if ms % 86_400_000:
            raise LedgerConfigError(f"{where}: valid_from must be a UTC date like 2026-01-01 (an entry starts at "
                                    f"midnight UTC), got the time {value.isoformat()}")
        return ms
    if isinstance(value, date):
        return int(datetime(value.year, value.month, value.day, tzinfo=timezone.utc).timestamp() * 1000)
    if isinstance(value, str):
        try:
            return date_ms(date.fromisoformat(value), where)
        except ValueError:
            pass
    raise LedgerConfigError(f"{where}: valid_from must be a date like 2026-01-01, got {value!r}")


#: the days a warehouse `Date` holds (coefficients.valid_from, prices.valid_from): an entry outside them
#: would price records in the worker and then fail every sync_library with an opaque DataError
FIRST_VALID_DAY, LAST_VALID_DAY = date(1970, 1, 1), date(2149, 6, 6)


def valid_from_ms(value, where: str) -> int:
    """date_ms of an entry's valid_from, which must be a day the warehouse can store."""
    ms = date_ms(value, where)
    if not date_ms(FIRST_VALID_DAY, where) <= ms <= date_ms(LAST_VALID_DAY, where):
        raise LedgerConfigError(f"{where}: valid_from must be within {FIRST_VALID_DAY} and {LAST_VALID_DAY} (the "
                                f"warehouse's dates), got {value}")
    return ms


def table(doc: dict, name: str, known, source: str, *, required: bool = False) -> dict:
    """doc[name] as a table holding no key outside `known` (an empty one when absent and not
    required), else a clear error naming the table and the unknown key(s): a misspelt key is an
    error, never a silently ignored line (a typo in electricity_price_per_kwh would bill energy at 0)."""
    if name not in doc:
        if required:
            raise LedgerConfigError(f"{source}: missing table [{name}]")
        return {}
    raw = doc[name]
    if not isinstance(raw, dict):
        raise LedgerConfigError(f"{source}: {name} must be a table ([{name}]), got {raw!r}")
    check_keys(raw, known, f"{source}: [{name}]")
    return raw


def check_keys(raw: dict, known, where: str) -> None:
    """Refuse a mapping with keys outside `known`, naming them (and the known ones)."""
    refuse_unknown_keys(raw, known, where, LedgerConfigError)


def _flag(value, where: str) -> bool:
    """A TOML boolean (true/false); a string such as "false" is refused (bool("false") is True)."""
    if not isinstance(value, bool):
        raise LedgerConfigError(f"{where} must be true or false (a TOML boolean, unquoted), got {value!r}")
    return value


def _number(value, where: str) -> float:
    """A TOML number (integer or float); a string or boolean is refused, never coerced."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LedgerConfigError(f"{where} must be a number (unquoted), got {value!r}")
    try:
        return float(value)
    except OverflowError:  # a TOML integer of 400 digits: no float holds it
        raise LedgerConfigError(f"{where} must be a finite number, got an integer of {len(str(abs(value)))} "
                                "digits") from None


def _required(raw: dict, key: str, where: str):
    """raw[key], else an error naming the entry it is missing from (a bare KeyError names no entry)."""
    if key not in raw:
        raise LedgerConfigError(f"{where}: missing key {key!r}")
    return raw[key]


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise LedgerConfigError(f"{where} must be a string, got {value!r}")
    return value


def _bounded(value, low: float, high: float, where: str, *, low_open: bool = False) -> float:
    """A finite number within [low, high] ((low, high] with low_open), else a clear error."""
    number = _number(value, where)
    if not (math.isfinite(number) and (number > low if low_open else number >= low) and number <= high):
        raise LedgerConfigError(f"{where} must be a number {'>' if low_open else '>='} {low:g} and <= {high:g}, "
                                f"got {value!r}")
    return number


_PRICE_KEYS = ("depreciation_per_hour", "maintenance_per_hour")


def _unit_price(p: dict, where: str, extra: tuple = ()) -> UnitPrice:
    if not isinstance(p, dict):
        raise LedgerConfigError(f"{where} must be a table, got {p!r}")
    check_keys(p, _PRICE_KEYS + extra, where)
    return UnitPrice(*(_bounded(_required(p, key, where), 0, MAX_PRICE_PER_HOUR, f"{where}.{key}") for key in _PRICE_KEYS))


def parse_prices(raw, source: str) -> dict[str, tuple[PriceEntry, ...]]:
    """The price history: `[[prices]]` entries (model, valid_from, depreciation_per_hour,
    maintenance_per_hour), or the older `[prices.MODEL]` tables, each valid from the epoch."""
    by_model: dict[str, list[PriceEntry]] = {}
    if isinstance(raw, dict):
        for name, p in raw.items():
            # a model as records name it: 5, "" or " A100" matches no record, whose cards the default would price
            _name(name, f"{source}: the model name of [prices.{name}]")
            by_model[name] = [PriceEntry(name, _unit_price(p, f"{source}: prices.{name}"), 0)]
    elif isinstance(raw, list):
        first: dict[str, int] = {}  # version -> index of the entry that has it
        for i, p in enumerate(raw):
            where = f"{source}: prices[{i}]"
            if not isinstance(p, dict):
                raise LedgerConfigError(f"{where} must be a table, got {p!r}")
            model = _name(_required(p, "model", where), f"{where}.model")
            entry = PriceEntry(model, _unit_price(p, where, ("model", "valid_from")),
                               valid_from_ms(_required(p, "valid_from", where), f"{where} (model {model!r})"))
            if entry.version in first:
                raise LedgerConfigError(f"{where}: {entry.version} is listed twice (prices[{first[entry.version]}] "
                                        "has the same model and valid_from)")
            first[entry.version] = i
            by_model.setdefault(entry.model, []).append(entry)
    else:
        raise LedgerConfigError(f"{source}: prices must be [prices.MODEL] tables or [[prices]] entries")
    if "default" not in by_model:
        raise LedgerConfigError(f"{source}: [prices.default] (or [[prices]] entries of model \"default\") is required")
    return {m: tuple(sorted(v, key=lambda e: e.valid_from_ms)) for m, v in by_model.items()}


def _segments(seg: dict, source: str) -> dict:
    """[segments] window_s (0: a record per tick; else it divides an hour, so windows split hours and
    UTC days exactly) and flush_after_s (>= 0)."""
    check_keys(seg, ("window_s", "flush_after_s"), f"{source}: [segments]")
    window = seg.get("window_s", DEFAULT_SEGMENT_WINDOW_S)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0 or (window and 3600 % window):
        raise LedgerConfigError(f"{source}: segments.window_s must be 0 or a whole number of seconds that divides "
                                f"3600; got {window!r}")
    flush = _bounded(seg.get("flush_after_s", DEFAULT_SEGMENT_FLUSH_AFTER_S), 0, 7 * 86400,
                     f"{source}: segments.flush_after_s")
    return {"segment_window_ms": window * 1000 or 1, "segment_flush_after_ms": round(flush * 1000)}


def _fingerprint(doc: dict, *, legacy: bool = False) -> str:
    """sha256 of the definitions: everything but the histories (coefficients; prices given as
    [[prices]] entries), which records name entry by entry. Old [prices.MODEL] tables stay in it.
    `legacy`: as computed before [alerts] and [reclaim] were left out (recorded by older warehouses)."""
    # [segments] is left out too: it changes how GPU time is cut into records, never what it costs
    # [carbon], [alerts] and [reclaim] too: each has its own version and changes no cost; [approvals]
    # changes no cost either (and no older version could load it)
    histories = {"coefficients", "segments", "carbon", "approvals"} | \
        ({"prices"} if isinstance(doc.get("prices"), list) else set()) | (set() if legacy else {"alerts", "reclaim"})
    return hashlib.sha256(
        json.dumps({k: v for k, v in doc.items() if k not in histories}, sort_keys=True, default=str).encode()
    ).hexdigest()


def _valid_at(history: dict, model: str, ts_ms: int):
    """The entry of `model` (else of 'default') valid at ts_ms in a dated history (entries sorted by
    valid_from_ms); None when ts_ms is before every entry of both."""
    for name in (model, "default"):
        entries = history.get(name)
        if not entries:
            continue
        if ts_ms >= entries[-1].valid_from_ms:  # the usual case: the latest entry (hot path)
            return entries[-1]
        i = bisect.bisect_right(entries, ts_ms, key=lambda e: e.valid_from_ms) - 1
        if i >= 0:
            return entries[i]
    return None


#: The coefficient of a model when the library has neither its own nor a 'default' entry.
_BASELINE = Coefficient("default", 1.0, 0)


#: the top-level keys and tables of a ledger document (any other is refused: a misspelt table name
#: would otherwise leave its values at their defaults)
LEDGER_TOP_LEVEL_KEYS = ("definition_version", "currency", "baseline_model", "reference_model", "prices",
                         "coefficients", "power", "power_limits", "unpriced", "segments", "carbon", "alerts",
                         "reclaim", "approvals", *_DEFINITION_KEYS)
_POWER_KEYS = ("electricity_price_per_kwh", "pue", "limit_tolerance")
_COEFFICIENT_KEYS = ("model", "coefficient", "valid_from")


def _name(value, where: str) -> str:
    """A non-empty string (a number is refused: `definition_version = 3` is not guessed at), printable and
    without surrounding whitespace, as records name models and versions."""
    if not isinstance(value, str) or not value.strip():
        raise LedgerConfigError(f"{where} must be a non-empty string, got {value!r}")
    if value != value.strip() or not value.isprintable():  # "v7\n" would be a version apart from "v7"
        raise LedgerConfigError(f"{where} must be printable text without leading or trailing whitespace, got {value!r}")
    return value


def _reference_model(doc: dict, price_history: dict, source: str) -> str:
    """reference_model must name a priced model: a typo would price waiting with the default card."""
    model = _name(doc.get("reference_model", "default"), f"{source}: reference_model")
    if model not in price_history:
        raise LedgerConfigError(f"{source}: reference_model {model!r} has no price; it must name a model of "
                                f"the price list ({', '.join(sorted(price_history))})")
    return model


def _baseline_model(doc: dict, coefficients: dict, source: str) -> str:
    """baseline_model, when set, must have coefficient 1.0 (its own entries, else the default ones it
    falls back to): it is the unit of effective GPU-hours."""
    if "baseline_model" not in doc:
        return ""
    model = _name(doc["baseline_model"], f"{source}: baseline_model")
    entries = coefficients.get(model) or coefficients.get("default") or (_BASELINE,)
    wrong = [e.version for e in entries if e.coefficient != 1.0]
    if wrong:
        raise LedgerConfigError(f"{source}: baseline_model {model!r} must have coefficient 1.0 (it defines the unit "
                                f"of effective GPU-hours), but {', '.join(wrong)} is not 1.0")
    return model


def _approval_threshold(doc: dict, source: str) -> float | None:
    """[approvals] threshold (currency, finite, >= 0), None when not set."""
    approvals = table(doc, "approvals", ("threshold",), source)
    if "threshold" not in approvals:
        return None
    return _bounded(approvals["threshold"], 0, MAX_APPROVAL_THRESHOLD, f"{source}: approvals.threshold")


def parse_ledger_config(doc: dict, source: str = "<config>") -> LedgerConfig:
    try:
        check_keys(doc, LEDGER_TOP_LEVEL_KEYS, f"{source}: top level")
        price_history = parse_prices(doc["prices"], source)
        prices = {m: entries[-1].price for m, entries in price_history.items()}
        by_model: dict[str, list[Coefficient]] = {}
        coefficients = doc.get("coefficients", [])
        if not isinstance(coefficients, list):
            raise LedgerConfigError(f"{source}: coefficients must be [[coefficients]] entries")
        first_coefficient: dict[str, int] = {}  # version -> index of the entry that has it
        for i, c in enumerate(coefficients):
            if not isinstance(c, dict):
                raise LedgerConfigError(f"{source}: coefficients[{i}] must be a table, got {c!r}")
            where = f"{source}: coefficients[{i}]"
            check_keys(c, _COEFFICIENT_KEYS, where)
            model = _name(_required(c, "model", where), f"{where}.model")
            coef = _bounded(_required(c, "coefficient", where), 0, MAX_COEFFICIENT, f"{where}.coefficient", low_open=True)
            entry = Coefficient(model, coef, valid_from_ms(_required(c, "valid_from", where), f"{where} (model {model!r})"))
            # one entry per model and day: the version id names the entry in records and caches
            if entry.version in first_coefficient:
                raise LedgerConfigError(f"{source}: coefficients[{i}]: {entry.version} is listed twice (coefficients"
                                        f"[{first_coefficient[entry.version]}] has the same model and valid_from)")
            first_coefficient[entry.version] = i
            by_model.setdefault(model, []).append(entry)
        power = table(doc, "power", _POWER_KEYS, source)
        power_limits = doc.get("power_limits", {})
        if not isinstance(power_limits, dict):
            raise LedgerConfigError(f"{source}: power_limits must be a table ([power_limits]), got {power_limits!r}")
        limits = {_name(m, f"{source}: power_limits key"): _bounded(w, 0, MAX_POWER_W, f"{source}: power_limits.{m}",
                                                                    low_open=True)
                  for m, w in power_limits.items()}
        policy = _text(table(doc, "unpriced", ("policy",), source).get("policy", "default"), f"{source}: unpriced.policy")
        if policy not in UNPRICED_POLICIES:
            raise LedgerConfigError(f"{source}: unpriced.policy must be one of {', '.join(UNPRICED_POLICIES)}; "
                                    f"got {policy!r}")
        pue = _bounded(power.get("pue", 1.0), 1.0, MAX_PUE, f"{source}: power.pue")  # facility / IT energy: 1 at best
        segments = doc.get("segments", {})
        if not isinstance(segments, dict):
            raise LedgerConfigError(f"{source}: segments must be a table ([segments]), got {segments!r}")
        coefficient_history = {m: tuple(sorted(v, key=lambda e: e.valid_from_ms)) for m, v in by_model.items()}
        return LedgerConfig(
            definition_version=_name(doc["definition_version"], f"{source}: definition_version"),
            currency=_name(doc.get("currency", "USD"), f"{source}: currency"),
            baseline_model=_baseline_model(doc, coefficient_history, source),
            reference_model=_reference_model(doc, price_history, source),
            electricity_price_per_kwh=_bounded(power.get("electricity_price_per_kwh", 0.0), 0, MAX_PRICE_PER_KWH,
                                               f"{source}: power.electricity_price_per_kwh"),
            pue=pue,
            prices=prices,
            coefficients=coefficient_history,
            definitions=parse_definitions(doc, source),
            fingerprint=_fingerprint(doc),
            legacy_fingerprint=_fingerprint(doc, legacy=True),
            price_history=price_history,
            prices_undated=isinstance(doc["prices"], dict),
            power_limits=limits,
            power_limit_tolerance=_bounded(power.get("limit_tolerance", DEFAULT_POWER_LIMIT_TOLERANCE), 1.0, 2.0,
                                           f"{source}: power.limit_tolerance"),
            unpriced_policy=policy,
            watch=parse_watch_definitions(doc),
            carbon=parse_carbon(doc, pue),
            approval_threshold=_approval_threshold(doc, source),
            **_segments(segments, source),
        )
    except KeyError as exc:
        raise LedgerConfigError(f"{source}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, LedgerConfigError):
            raise
        raise LedgerConfigError(f"{source}: {exc}") from None
