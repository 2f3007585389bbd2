"""`gpuledger COMMAND` builds only the parsers it needs: the commands whose parsers live with their
modules (cli.MODULE_COMMANDS) are imported only for their own command lines, `--help` and a
mistyped command, so `gpuledger report` starts ~0.2 s sooner (docs/performance.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gpuledger.cli import MODULE_COMMANDS, _command_word, build_parser


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    return next(set(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_module_commands_are_exactly_those_the_modules_register():
    full = _commands(build_parser())
    core = _commands(build_parser("report"))
    assert full - core == set(MODULE_COMMANDS)
    assert core < full


@pytest.mark.parametrize("command", [None, "forecast", "approvals", "replay-trace", "no-such-command"])
def test_help_module_commands_and_mistakes_get_every_parser(command):
    assert _commands(build_parser(command)) == _commands(build_parser())


@pytest.mark.parametrize("argv, word", [
    (["report", "bills", "--tenant", "a"], "report"),
    (["-v", "forecast", "run"], "forecast"),
    (["--verbose"], None),
    ([], None),
])
def test_the_command_word_is_the_first_non_option(argv, word):
    assert _command_word(argv) == word


def test_a_report_command_line_does_not_import_the_other_modules():
    probe = ("import sys; from gpuledger.cli import build_parser; "
             "build_parser('report').parse_args(['report', 'weekly', '--format', 'html']); "
             "print(sorted(m for m in ('gpuledger.traces.run', 'gpuledger.integrations.superset', 'yaml', "
             "'jinja2', 'gpuledger.schemas.models') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
