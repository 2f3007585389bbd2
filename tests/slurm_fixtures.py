"""The recorded Slurm output of tests/fixtures/slurm (its README says what each file is), by name."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "slurm"


def load(name: str) -> dict:
    """tests/fixtures/slurm/<name>.json, parsed."""
    return json.loads((FIXTURES / f"{name}.json").read_text())
