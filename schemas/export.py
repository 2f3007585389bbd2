"""Export every wire model as a JSON Schema file (run: gpuledger schemas export [--output DIR]): into
schemas/json/ in a checkout, else into ./gpuledger-schemas."""

from __future__ import annotations

import json
from pathlib import Path

from gpuledger.schemas.models import EXPORTED_MODELS

JSON_DIR = Path(__file__).parent / "json"
#: where an installed gpuledger (not a checkout) exports: the installed copy is not for editing
INSTALLED_OUTPUT = Path("gpuledger-schemas")


def default_output_dir() -> Path:
    """schemas/json/ of a checkout (where the files are versioned), else ./gpuledger-schemas."""
    in_checkout = (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file()
    return JSON_DIR if in_checkout else INSTALLED_OUTPUT


def render_all() -> dict[str, str]:
    """File name -> file text, for every exported model."""
    return {
        f"{name}.json": json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"
        for name, model in EXPORTED_MODELS.items()
    }


def export(target: Path = JSON_DIR) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = target / name
        path.write_text(text)
        written.append(path)
    return written
