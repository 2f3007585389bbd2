"""The real-Slurm check runs only when selected (`-m slurm`, i.e. `make slurm-check`): it starts
a Slurm cluster on this host (installing the packages when missing) and takes minutes."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if "slurm" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="real Slurm cluster check: run it with `make slurm-check` (pytest -m slurm)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)
