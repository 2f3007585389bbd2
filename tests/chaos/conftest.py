"""The fault-injection suite runs only when selected (`-m chaos`, i.e. `make chaos`): it takes minutes."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "chaos: fault-injection suite on Tansu + Faust + chDB (make chaos; minutes)")


def pytest_collection_modifyitems(config, items):
    if "chaos" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="fault-injection suite: run it with `make chaos` (pytest -m chaos)")
    for item in items:
        if "chaos" in item.keywords:
            item.add_marker(skip)
