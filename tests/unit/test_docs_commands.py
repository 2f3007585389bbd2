"""Every `gpuledger ...` command written in README.md and docs/*.md names a command, action and
options the CLI has: the docs drift from the code otherwise (docs/carbon.md once pointed readers to
a `gpuledger bills runs` that never existed)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from gpuledger.cli import AGENT_MODULES, build_parser
from gpuledger.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `gpuledger WORD` and what follows it on the same line up to the end of a code span or table cell
_COMMAND = re.compile(r"\bgpuledger\s+([a-z][a-z-]*)((?:[ \t]+[^\s`|]+)*)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _choices_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser | None]:
    """The command's first positional with fixed choices: sub-parsers, or a plain `choices=` list."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
        if not action.option_strings and action.choices:
            return {str(choice): None for choice in action.choices}
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _agent_parser(kind: str) -> argparse.ArgumentParser:
    import importlib

    module = importlib.import_module(f"gpuledger.agents.{AGENT_MODULES[kind]}")
    return module.build_parser(Settings())


def _mentions():
    """(file:line, command, words after it) for each `gpuledger COMMAND ...` in the docs."""
    for path in DOCS:
        # a shell line continued with a backslash is one command
        text = path.read_text().replace("\\\n", " ")
        for number, line in enumerate(text.splitlines(), 1):
            for match in _COMMAND.finditer(line):
                yield f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2).split()


MENTIONS = list(_mentions())


def test_the_docs_mention_commands():
    assert len(MENTIONS) > 150, "the scan found too few commands: the pattern no longer matches the docs"


def problems_in(mentions) -> list[str]:
    top = build_parser()
    commands = _choices_of(top)
    problems = []
    for where, command, words in mentions:
        if command not in commands:
            continue  # prose such as "gpuledger is", or a package path; a real command is checked below
        parser = commands[command]
        choices = _choices_of(parser)
        target = parser
        if command == "agent" and words and words[0] in AGENT_MODULES:
            target = _agent_parser(words[0])
        elif choices and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
            # a plain word right after a command with fixed actions must be one of them
            if words[0] not in choices:
                problems.append(f"{where}: `gpuledger {command} {words[0]}`: no such action "
                                f"(choose from {', '.join(sorted(choices))})")
                continue
            target = choices[words[0]] or parser
        known = _options(target) | _options(top)
        for flag in sorted(set(_FLAG.findall(" ".join(words))) - known):
            problems.append(f"{where}: `gpuledger {command} ... {flag}`: no such option")
    return problems


def test_every_documented_command_exists_with_its_action_and_options():
    problems = problems_in(MENTIONS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line, found", [
    ("`gpuledger bills runs`", "no such action"),
    ("gpuledger report jobs --tenant a --colour red", "--colour`: no such option"),
    ("gpuledger agent slurm --once --url U", "--url`: no such option"),  # a dcgm option, not slurm's
    ("gpuledger report jobs --tenant a --limit 5", None),
    ("gpuledger agent dcgm --url U --once --print", None),
    ("gpuledger is a ledger", None),
])
def test_the_check_finds_what_does_not_exist(line, found):
    mentions = [("x.md:1", m.group(1), m.group(2).split()) for m in _COMMAND.finditer(line)]
    problems = problems_in(mentions)
    if found is None:
        assert problems == []
    else:
        assert len(problems) == 1 and found in problems[0]
