"""docs/configuration.md lists every Settings field as GPULEDGER_<FIELD> with its default, and
names no variable that no field reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import SecretStr

from gpuledger.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def variable(field: str) -> str:
    return f"GPULEDGER_{field.upper()}"


def shown_default(value) -> str:
    """How the reference table writes a default (the same rule the table was generated with)."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "(unset)"
    if value == "":
        return "(empty)"
    return f"`{value}`"


@pytest.fixture(scope="module")
def rows() -> dict[str, str]:
    """Table rows of the reference, by variable name."""
    out = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`(GPULEDGER_\w+)`\s*\|", line)
        if m:
            out[m.group(1)] = line
    return out


def test_every_settings_field_is_documented(rows):
    missing = [variable(name) for name in Settings.model_fields if variable(name) not in rows]
    assert not missing, f"docs/configuration.md lacks a table row for {missing}"


@pytest.mark.parametrize("name", sorted(Settings.model_fields))
def test_documented_default_is_the_real_one(rows, name):
    row = rows.get(variable(name))
    if row is None:
        pytest.skip("missing row is reported by test_every_settings_field_is_documented")
    default_cell = row.split("|")[2].strip()
    assert default_cell == shown_default(Settings.model_fields[name].default), row


ROOT = DOC.parents[1]
VARIABLE = r"GPULEDGER_[A-Z0-9_]*[A-Z0-9]"


def other_variables() -> set[str]:
    """The variables of the "Other variables" section: read by one command or backend, not Settings."""
    text = DOC.read_text()
    if "### Other variables" not in text:
        return set()
    section = text[text.index("### Other variables"):]
    return set(re.findall(r"^\|\s*`(" + VARIABLE + r")`\s*\|", section[:section.index("\n#", 1)], re.M))


def code_variables() -> dict[str, str]:
    """Every GPULEDGER_* name in the product's code (not the tests'), with a file that names it."""
    out = {}
    for folder in ("gpuledger", "agents", "streams", "schemas"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in re.findall(VARIABLE, path.read_text()):
                out.setdefault(name, str(path.relative_to(ROOT)))
    return out


def test_no_stale_variables_are_documented():
    named = set(re.findall(VARIABLE, DOC.read_text()))
    stale = sorted(n for n in named if n[len("GPULEDGER_"):].lower() not in Settings.model_fields
                   and not (n in other_variables() and n in code_variables()))
    assert not stale, f"docs/configuration.md names variables no Settings field or code reads: {stale}"


def test_every_variable_the_code_reads_is_documented():
    fields = {variable(name) for name in Settings.model_fields}
    # prose may name a group by its prefix ("GPULEDGER_RETENTION_*")
    undocumented = {name: path for name, path in code_variables().items()
                    if name not in fields | other_variables() and not any(f.startswith(name + "_") for f in fields)}
    assert not undocumented, f"docs/configuration.md lacks these variables: {undocumented}"


def test_the_documented_topics_are_the_ones_topics_create_makes():
    """The Topics table of docs/configuration.md names exactly Settings.partitions()' topics."""
    text = DOC.read_text()
    section = text[text.index("### Topics"):]
    section = section[:section.index("\n## ")]
    documented = set(re.findall(r"^\|\s*`([a-z-]+)`\s*\|", section, re.M))
    made = {name.removeprefix("p.") for name in Settings(topic_prefix="p.").partitions()}
    assert documented == made
    count = {9: "nine", 10: "ten", 15: "fifteen", 16: "sixteen"}.get(len(made), str(len(made)))
    assert f"{count} topics" in text and "only verifies" not in text
