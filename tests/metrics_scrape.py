"""Reading a process's Prometheus /metrics, as Prometheus scrapes it (for tests)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def sample(families: dict[str, list], name: str, **labels: str) -> float:
    for family in families.values():
        for s in family:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels} not scraped")
