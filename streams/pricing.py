"""Ledger configuration as plain data: definitions, unit prices and throughput coefficients.

Pure: loading turns a TOML file into frozen objects; lookups are plain functions of
(model, time). See docs/accounting.md for the formulas."""

from __future__ import annotations

import bisect
import hashlib
import json
import importlib.resources
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from datetime import date, datetime, timezone
from pathlib import Path

BUNDLED_CONFIG = Path(str(importlib.resources.files("gpuledger") / "ledger_defaults.toml"))
MS_PER_HOUR = 3_600_000
JOULES_PER_KWH = 3_600_000.0


class LedgerConfigError(ValueError):
    """The ledger configuration file is unusable; the message says where."""


@dataclass(frozen=True)
class UnitPrice:
    depreciation_per_hour: float
    maintenance_per_hour: float

    @property
    def fixed_per_hour(self) -> float:
        return self.depreciation_per_hour + self.maintenance_per_hour


@dataclass(frozen=True)
class Coefficient:
    model: str
    coefficient: float
    valid_from_ms: int
    # "MODEL@YYYY-MM-DD", stored on every usage record; computed once (it is on the hot path)
    version: str = field(init=False)

    def __post_init__(self) -> None:
        day = datetime.fromtimestamp(self.valid_from_ms / 1000, tz=timezone.utc).date().isoformat()
        object.__setattr__(self, "version", f"{self.model}@{day}")


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


def parse_definitions(doc: dict, source: str) -> Definitions:
    cost, util, shared, idle, execution = (doc.get(k, {}) for k in ("cost", "utilization", "shared_gpu", "idle", "execution"))
    values = dict(
        include_depreciation=bool(cost.get("include_depreciation", True)),
        include_maintenance=bool(cost.get("include_maintenance", True)),
        include_power=bool(cost.get("include_power", True)),
        include_cooling=bool(cost.get("include_cooling", True)),
        utilization_aggregation=str(util.get("aggregation", "mean")),
        utilization_threshold_pct=float(util.get("threshold_pct", 20.0)),
        shared_split=str(shared.get("split", "measured")),
        shared_sm_weight=float(shared.get("sm_weight", 0.5)),
        shared_memory_weight=float(shared.get("memory_weight", 0.5)),
        shared_unused=str(shared.get("unused", "holders")),
        idle_redistribution=str(idle.get("redistribution", "none")),
        execution_source=str(execution.get("source", "both")),
        execution_util_floor_pct=float(execution.get("util_floor_pct", 1.0)),
        execution_min_idle_s=float(execution.get("min_idle_s", 300.0)),
    )
    for key, allowed in _CHOICES.items():
        if values[key] not in allowed:
            raise LedgerConfigError(f"{source}: {key.replace('_', '.', 1)} must be one of {', '.join(allowed)}; got {values[key]!r}")
    if values["shared_sm_weight"] < 0 or values["shared_memory_weight"] < 0 or \
            values["shared_sm_weight"] + values["shared_memory_weight"] <= 0:
        raise LedgerConfigError(f"{source}: shared_gpu weights must be >= 0 and not both 0")
    if not 0 <= values["utilization_threshold_pct"] <= 100:
        raise LedgerConfigError(f"{source}: utilization.threshold_pct must be within 0..100")
    if not 0 <= values["execution_util_floor_pct"] < 100:
        raise LedgerConfigError(f"{source}: execution.util_floor_pct must be within 0..100 (100 excluded)")
    if values["execution_min_idle_s"] < 0:
        raise LedgerConfigError(f"{source}: execution.min_idle_s must be >= 0")
    return Definitions(**values)


@dataclass(frozen=True)
class LedgerConfig:
    definition_version: str
    currency: str
    baseline_model: str
    reference_model: str
    electricity_price_per_kwh: float
    pue: float
    prices: dict[str, UnitPrice]
    # model -> entries sorted by valid_from_ms
    coefficients: dict[str, tuple[Coefficient, ...]] = field(default_factory=dict)
    definitions: Definitions = field(default_factory=Definitions)
    # sha256 of everything but the coefficient history: a changed definition must change the version
    fingerprint: str = ""

    def price(self, model: str) -> UnitPrice:
        return self.prices.get(model) or self.prices["default"]

    def coefficient_at(self, model: str, ts_ms: int) -> Coefficient:
        """The coefficient entry valid at ts_ms for this model (falls back to 'default')."""
        for name in (model, "default"):
            entries = self.coefficients.get(name)
            if not entries:
                continue
            if ts_ms >= entries[-1].valid_from_ms:  # the usual case: the latest entry (hot path)
                return entries[-1]
            i = bisect.bisect_right(entries, ts_ms, key=lambda e: e.valid_from_ms) - 1
            if i >= 0:
                return entries[i]
        raise LedgerConfigError(f"no coefficient valid for model {model!r} at {ts_ms} (and no 'default' entry)")

    def interval_cost_micros(self, model: str, duration_ms: int, energy_j: float) -> int:
        """Whole-GPU cost of one interval: fixed hourly parts + measured energy x price x PUE."""
        terms = self._cost_terms.get(model) or self._cost_terms.setdefault(model, self._terms_of(model))
        per_hour, include_power, cooling = terms
        fixed = per_hour * duration_ms / MS_PER_HOUR
        power = 0.0
        if include_power:
            power = energy_j / JOULES_PER_KWH * self.electricity_price_per_kwh * cooling
        return round((fixed + power) * 1_000_000)

    @cached_property
    def _cost_terms(self) -> dict[str, tuple[float, bool, float]]:
        """model -> (fixed cost per hour, power included, cooling factor): filled on first use (hot path)."""
        return {}

    def _terms_of(self, model: str) -> tuple[float, bool, float]:
        price, d = self.price(model), self.definitions
        per_hour = (price.depreciation_per_hour if d.include_depreciation else 0.0) + \
                   (price.maintenance_per_hour if d.include_maintenance else 0.0)
        return per_hour, d.include_power, (self.pue if d.include_cooling else 1.0)

    def reference_cost_per_gpu_hour(self) -> float:
        """Opportunity cost of one waiting GPU for one hour: the reference card's fixed hourly cost."""
        return self.price(self.reference_model).fixed_per_hour


def date_ms(value, where: str) -> int:
    if isinstance(value, datetime):
        return int(value.replace(tzinfo=value.tzinfo or timezone.utc).timestamp() * 1000)
    if isinstance(value, date):
        return int(datetime(value.year, value.month, value.day, tzinfo=timezone.utc).timestamp() * 1000)
    if isinstance(value, str):
        try:
            return date_ms(date.fromisoformat(value), where)
        except ValueError:
            pass
    raise LedgerConfigError(f"{where}: valid_from must be a date like 2026-01-01, got {value!r}")


def parse_ledger_config(doc: dict, source: str = "<config>") -> LedgerConfig:
    try:
        prices = {
            name: UnitPrice(float(p["depreciation_per_hour"]), float(p["maintenance_per_hour"]))
            for name, p in doc["prices"].items()
        }
        if "default" not in prices:
            raise LedgerConfigError(f"{source}: [prices.default] is required")
        by_model: dict[str, list[Coefficient]] = {}
        for i, c in enumerate(doc.get("coefficients", [])):
            coef = float(c["coefficient"])
            if coef <= 0:
                raise LedgerConfigError(f"{source}: coefficients[{i}] must be > 0, got {coef}")
            by_model.setdefault(c["model"], []).append(
                Coefficient(c["model"], coef, date_ms(c["valid_from"], f"{source}: coefficients[{i}]")))
        power = doc.get("power", {})
        return LedgerConfig(
            definition_version=str(doc["definition_version"]),
            currency=str(doc.get("currency", "USD")),
            baseline_model=str(doc.get("baseline_model", "")),
            reference_model=str(doc.get("reference_model", "default")),
            electricity_price_per_kwh=float(power.get("electricity_price_per_kwh", 0.0)),
            pue=float(power.get("pue", 1.0)),
            prices=prices,
            coefficients={m: tuple(sorted(v, key=lambda e: e.valid_from_ms)) for m, v in by_model.items()},
            definitions=parse_definitions(doc, source),
            fingerprint=hashlib.sha256(
                json.dumps({k: v for k, v in doc.items() if k != "coefficients"}, sort_keys=True, default=str).encode()
            ).hexdigest(),
        )
    except KeyError as exc:
        raise LedgerConfigError(f"{source}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, LedgerConfigError):
            raise
        raise LedgerConfigError(f"{source}: {exc}") from None


def write_ledger_variant(base: Path | None, target: Path, *, suffix: str, **tables: dict) -> Path:
    """A copy of the ledger config `base` (None: the bundled one) with `tables` replaced (e.g.
    execution={...}) and `+suffix` appended to its definition_version, so every record made under
    it says which definition it used. Written to `target`; returns it."""
    import tomli_w

    doc = tomllib.loads(Path(base or BUNDLED_CONFIG).read_text())
    doc.update(tables)
    doc["definition_version"] = f"{doc['definition_version']}+{suffix}"
    parse_ledger_config(doc, str(target))  # refuse to write a config the worker would reject
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(tomli_w.dumps(doc))
    return target


def load_ledger_config(path: Path | None = None) -> LedgerConfig:
    path = Path(path) if path else BUNDLED_CONFIG
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise LedgerConfigError(f"ledger config {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise LedgerConfigError(f"{path}: {exc}") from None
    return parse_ledger_config(doc, str(path))
