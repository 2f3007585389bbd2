"""bench/spy.py: py-spy's raw stacks of a worker put in the parts of its work, and the figures made
of them. The fixture holds eight stacks py-spy recorded of a `gpuledger worker` in a join pass
(2026-12-03), one per kind; their counts were set for this test (7, 11, 2, 3, 1, 5, 6, 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.spy import PARTS, SHELL, frame_function, group_samples, parts_per_tick, ratio_without, shell_package

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pyspy" / "worker_raw.txt"
VALIDATION, ACCOUNTING, ROUTING, NODE_OTHER, SNAPSHOTS = (name for name, _ in PARTS)


def test_recorded_stacks_go_to_their_parts():
    grouped = group_samples(FIXTURE.read_text().splitlines())
    assert grouped["samples"] == 39
    # validation and accounting run inside on_node: they win over it by their place in PARTS
    assert grouped["parts"] == {VALIDATION: 7, ACCOUNTING: 11, ROUTING: 2, NODE_OTHER: 3, SNAPSHOTS: 1, SHELL: 15}
    assert grouped["shell"] == {"faust": 5, "asyncio": 6, "native (no Python frame)": 4}


def test_frames_and_packages_as_py_spy_names_them():
    assert frame_function("NodeJoin.close_until (streams/join.py:403)") == ("NodeJoin.close_until", "streams/join.py")
    assert frame_function("<module> (gpuledger/cli.py:592)") == ("<module>", "gpuledger/cli.py")
    assert frame_function("_run_code (<frozen runpy>:88)") == ("_run_code", "<frozen runpy>")
    assert shell_package("faust/topics.py") == "faust"
    assert shell_package("/x/.venv/lib/python3.11/site-packages/aiokafka/conn.py") == "aiokafka"
    assert shell_package("streams/app.py") == "ledger: streams/app.py"
    assert shell_package("selectors.py") == "stdlib: selectors.py"
    assert shell_package("") == "native (no Python frame)"


def test_parts_per_tick_and_the_ratio_without_each():
    grouped = {"samples": 100, "parts": {VALIDATION: 25, ACCOUNTING: 50, SHELL: 25}, "shell": {}}
    rows = {r["part"]: r for r in parts_per_tick(grouped, 200.0, 0.1)}
    assert set(rows) == {name for name, _ in PARTS} | {SHELL}
    assert rows[VALIDATION]["cpu_us_per_tick"] == pytest.approx(50.0)
    assert rows[VALIDATION]["ratio_without_it"] == pytest.approx(0.1 * 200 / 150)
    assert rows[ACCOUNTING]["ratio_without_it"] == pytest.approx(0.2)
    assert rows[ROUTING]["share"] == 0 and rows[ROUTING]["ratio_without_it"] == pytest.approx(0.1)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert ratio_without(grouped, 0.1, [VALIDATION, ACCOUNTING]) == pytest.approx(0.4)
    assert ratio_without(grouped, 0.1, [name for name, _ in PARTS]) == pytest.approx(0.4)  # the shell alone
    assert ratio_without(grouped, 0.1, []) == pytest.approx(0.1)
    assert ratio_without({"samples": 3, "parts": {VALIDATION: 3}, "shell": {}}, 0.1, [VALIDATION]) == float("inf")


def test_a_line_that_is_not_py_spy_output_is_an_error():
    with pytest.raises(ValueError, match="not a py-spy raw line"):
        group_samples(["main (x.py:1);f (x.py:2) many"])
    assert group_samples(["", "   "]) == {"samples": 0, "parts": {}, "shell": {}}
