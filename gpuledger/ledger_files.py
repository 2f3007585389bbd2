"""Ledger configuration files: the I/O edge of streams/pricing.py.

Reading a ledger TOML (the bundled defaults or GPULEDGER_LEDGER_CONFIG) and writing variants of
one happen here; turning the parsed document into a `LedgerConfig` is pure and stays in
`gpuledger.streams.pricing.parse_ledger_config`, so the worker's core never touches a file."""

from __future__ import annotations

import importlib.resources
import tomllib
from pathlib import Path

from gpuledger.streams.pricing import LedgerConfig, LedgerConfigError, parse_ledger_config

BUNDLED_CONFIG = Path(str(importlib.resources.files("gpuledger") / "ledger_defaults.toml"))


def load_ledger_config(path: Path | None = None) -> LedgerConfig:
    """The ledger config in the TOML file `path` (None: the bundled defaults)."""
    path = Path(path) if path else BUNDLED_CONFIG
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8, whatever the locale
    except FileNotFoundError:
        raise LedgerConfigError(f"ledger config {path} not found") from None
    except OSError as exc:  # a directory, no permission: one line with the path, not a traceback
        raise LedgerConfigError(f"ledger config {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise LedgerConfigError(f"ledger config {path} is not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise LedgerConfigError(f"{path}: {exc}") from None
    return parse_ledger_config(doc, str(path))


def write_ledger_variant(base: Path | None, target: Path, *, suffix: str, **tables: dict) -> Path:
    """A copy of the ledger config `base` (None: the bundled one) with `tables` replaced (e.g.
    execution={...}) and `+suffix` appended to its definition_version, so every record made under
    it says which definition it used. Written to `target`; returns it."""
    import tomli_w

    doc = tomllib.loads(Path(base or BUNDLED_CONFIG).read_text(encoding="utf-8"))
    doc.update(tables)
    doc["definition_version"] = f"{doc['definition_version']}+{suffix}"
    parse_ledger_config(doc, str(target))  # refuse to write a config the worker would reject
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(tomli_w.dumps(doc), encoding="utf-8")
    return target
