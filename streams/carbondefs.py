"""The [carbon] definition of the ledger TOML (docs/carbon.md): how energy becomes gCO2e.

    [carbon]
    version = "carbon-2026.1"        # names every carbon figure computed under this definition
    pue = 1.4                        # optional; default: [power].pue
    default_gco2e_per_kwh = 480.0    # grid intensity where no series is loaded for a zone
    default_source = "Ember, Global Electricity Review 2024: world average 2023"
    [carbon.zones]                   # optional: cluster -> the zone (region) its intensity series is named by
    gpu-east = "US-NY"

Pure: parses a mapping, no I/O (streams/ core rule)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpuledger.streams.configkeys import refuse_unknown_keys

#: World-average carbon intensity of electricity generation in 2023, gCO2e per kWh: Ember, Global
#: Electricity Review 2024 (480 g/kWh). Used where neither a loaded series nor the ledger's
#: [carbon].default_gco2e_per_kwh says otherwise.
WORLD_AVERAGE_GCO2E_PER_KWH = 480.0
WORLD_AVERAGE_SOURCE = "Ember, Global Electricity Review 2024: world average 2023, 480 gCO2e/kWh"
DEFAULT_CARBON_VERSION = "carbon-1"
#: no grid emits more than ~1,100 g/kWh (lignite); 5,000 leaves room and still refuses a unit mix-up (kg)
MAX_GCO2E_PER_KWH = 5000.0
#: power usage effectiveness is the facility's energy over the IT equipment's: 1 at best (The Green Grid)
MIN_PUE = 1.0


class CarbonConfigError(ValueError):
    """A bad [carbon] table (pricing.parse_ledger_config reports it as a LedgerConfigError)."""


@dataclass(frozen=True)
class CarbonDefinition:
    version: str = DEFAULT_CARBON_VERSION
    pue: float = 1.0
    default_gco2e_per_kwh: float = WORLD_AVERAGE_GCO2E_PER_KWH
    default_source: str = WORLD_AVERAGE_SOURCE
    #: cluster -> zone its intensity series is named by; a cluster not here is its own zone
    zones: dict[str, str] = field(default_factory=dict)

    def zone_of(self, cluster: str) -> str:
        return self.zones.get(cluster, cluster)

    def co2e_g(self, energy_j: float, gco2e_per_kwh: float) -> float:
        """gCO2e of energy measured at the GPU: kWh x PUE (the facility's overhead) x grid intensity."""
        return energy_j / 3_600_000 * self.pue * gco2e_per_kwh


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CarbonConfigError(f"carbon.{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # a TOML integer of 400 digits: no float holds it
        raise CarbonConfigError(f"carbon.{name} must be a finite number, got an integer of {len(str(abs(value)))} "
                                "digits") from None
    if not math.isfinite(v) or v > high or v < low or (low_open and v == low):
        raise CarbonConfigError(f"carbon.{name} must be within {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return v


def _text(value, name: str) -> str:
    """A TOML string: a number (version = 1) is not guessed at, as definition_version = 3 is not."""
    if not isinstance(value, str):
        raise CarbonConfigError(f"carbon.{name} must be a string (quoted), got {value!r}")
    return value


def parse_carbon(doc: dict, power_pue: float) -> CarbonDefinition:
    """The [carbon] table of a ledger document; absent: the documented defaults, PUE from [power]."""
    raw = doc.get("carbon", {})
    if not isinstance(raw, dict):
        raise CarbonConfigError("[carbon] must be a table")
    refuse_unknown_keys(raw, ("version", "pue", "default_gco2e_per_kwh", "default_source", "zones"), "carbon",
                        CarbonConfigError)
    version = _text(raw.get("version", DEFAULT_CARBON_VERSION), "version").strip()
    if not version or not version.isprintable():
        raise CarbonConfigError(f"carbon.version must be printable text, got {raw.get('version')!r}")
    zones = raw.get("zones", {})
    # a cluster name as records carry it: " gpu-east" matches no record, whose carbon would take the default
    if not isinstance(zones, dict) or not all(isinstance(k, str) and k and k == k.strip() and isinstance(v, str)
                                              and v.strip() for k, v in zones.items()):
        raise CarbonConfigError(f"carbon.zones must map cluster names to zone names (text; a cluster name without "
                                f"leading or trailing whitespace), got {zones!r}")
    has_default = "default_gco2e_per_kwh" in raw
    pue = _number(raw.get("pue", power_pue), "pue", 0.0, 10.0, low_open=True)
    if pue < MIN_PUE:
        # PUE is facility energy over IT energy: never below 1. One below (0.14 for 1.4) would divide every
        # carbon figure silently ([power].pue, the default, is held to the same bound where it is parsed)
        raise CarbonConfigError(f"carbon.pue must be at least 1 (facility energy / GPU energy), got {pue!r}")
    return CarbonDefinition(
        version=version,
        pue=pue,
        default_gco2e_per_kwh=_number(raw.get("default_gco2e_per_kwh", WORLD_AVERAGE_GCO2E_PER_KWH),
                                      "default_gco2e_per_kwh", 0.0, MAX_GCO2E_PER_KWH),
        default_source=_text(raw.get("default_source", "" if has_default else WORLD_AVERAGE_SOURCE), "default_source"),
        zones={k: v.strip() for k, v in zones.items()},
    )
