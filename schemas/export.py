"""Export every wire model as a JSON Schema file into schemas/json/ (run: gpuledger schemas export)."""

from __future__ import annotations

import json
from pathlib import Path

from gpuledger.schemas.models import EXPORTED_MODELS

JSON_DIR = Path(__file__).parent / "json"


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
