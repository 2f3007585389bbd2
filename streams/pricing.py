"""Ledger configuration as plain data: definitions, unit prices and throughput coefficients.

Pure: loading turns a TOML file into frozen objects; lookups are plain functions of
(model, time). See docs/accounting.md for the formulas."""

from __future__ import annotations

import bisect
import importlib.resources
import tomllib
from dataclasses import dataclass, field
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

    @property
    def version(self) -> str:
        day = datetime.fromtimestamp(self.valid_from_ms / 1000, tz=timezone.utc).date().isoformat()
        return f"{self.model}@{day}"


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

    def price(self, model: str) -> UnitPrice:
        return self.prices.get(model) or self.prices["default"]

    def coefficient_at(self, model: str, ts_ms: int) -> Coefficient:
        """The coefficient entry valid at ts_ms for this model (falls back to 'default')."""
        for name in (model, "default"):
            entries = self.coefficients.get(name)
            if not entries:
                continue
            i = bisect.bisect_right([e.valid_from_ms for e in entries], ts_ms) - 1
            if i >= 0:
                return entries[i]
        raise LedgerConfigError(f"no coefficient valid for model {model!r} at {ts_ms} (and no 'default' entry)")

    def interval_cost_micros(self, model: str, duration_ms: int, energy_j: float) -> int:
        """Whole-GPU cost of one interval: fixed hourly parts + measured energy x price x PUE."""
        price = self.price(model)
        fixed = price.fixed_per_hour * duration_ms / MS_PER_HOUR
        power = energy_j / JOULES_PER_KWH * self.electricity_price_per_kwh * self.pue
        return round((fixed + power) * 1_000_000)

    def reference_cost_per_gpu_hour(self) -> float:
        """Opportunity cost of one waiting GPU for one hour: the reference card's fixed hourly cost."""
        return self.price(self.reference_model).fixed_per_hour


def _date_ms(value, where: str) -> int:
    if isinstance(value, datetime):
        return int(value.replace(tzinfo=value.tzinfo or timezone.utc).timestamp() * 1000)
    if isinstance(value, date):
        return int(datetime(value.year, value.month, value.day, tzinfo=timezone.utc).timestamp() * 1000)
    if isinstance(value, str):
        try:
            return _date_ms(date.fromisoformat(value), where)
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
                Coefficient(c["model"], coef, _date_ms(c["valid_from"], f"{source}: coefficients[{i}]")))
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
        )
    except KeyError as exc:
        raise LedgerConfigError(f"{source}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, LedgerConfigError):
            raise
        raise LedgerConfigError(f"{source}: {exc}") from None


def load_ledger_config(path: Path | None = None) -> LedgerConfig:
    path = Path(path) if path else BUNDLED_CONFIG
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise LedgerConfigError(f"ledger config {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise LedgerConfigError(f"{path}: {exc}") from None
    return parse_ledger_config(doc, str(path))
