"""Float settings refuse inf and nan with the field's name (a bare OverflowError in the ms conversions
of worker, sink, agents and `topics create` otherwise), and a topic retention is at least an hour (a
smaller one rounded to retention.ms=0). docs/configuration.md."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuledger import topics
from gpuledger.config import Settings

FLOAT_FIELDS = sorted(name for name, f in Settings.model_fields.items() if f.annotation is float)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_setting_refuses_non_finite_values(monkeypatch, name, value):
    monkeypatch.setenv(f"GPULEDGER_{name.upper()}", value)
    with pytest.raises(ValidationError, match=name):
        Settings()


@pytest.mark.parametrize("kind", ["input", "output", "diagnostics"])
def test_a_topic_retention_under_an_hour_is_refused(kind):
    with pytest.raises(ValidationError, match=f"topic_retention_{kind}_days"):
        Settings(**{f"topic_retention_{kind}_days": 1e-9})
    if kind == "input":  # an hour is also shorter than any adjustment window (tests/unit/test_input_retention.py)
        with pytest.raises(ValidationError, match="GPULEDGER_TOPIC_RETENTION_INPUT_DAYS=0.0416667 must be more than"):
            Settings(topic_retention_input_days=1 / 24)
        return
    hour = Settings(**{f"topic_retention_{kind}_days": 1 / 24})
    name = {"input": hour.topics.gpu_samples, "output": hour.topics.usage,
            "diagnostics": hour.topics.dead_letters}[kind]
    assert topics.topic_config(hour, name)["retention.ms"] == "3600000"
