"""docs/inputs.md against the code: every option and argument of every ``hybridspec`` command (walked
from typer's app, sub-apps included), every ``"hybridspec"`` engine option and every recipe field has a
row naming its check and the tests that refuse a bad value; each named test exists and is about that
input. A new option without a row, a row for an option that is gone, or a row whose test does not
mention the option fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_hybridspec.engine.options import HybridSpecOptions

from .cli_walk import numeric, options, ranged
from .train.test_inputs import RECIPE_BOUNDS, RECIPE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "inputs.md"
ROW = re.compile(r"^\| `(?P<where>[^`]+)` \| `(?P<input>[^`]+)` \| (?P<check>.+?) \| (?P<tests>.+?) \|$")

# tests that walk a set of inputs themselves: the input must be in the set they walk
WALKERS = {
    "tests/tools/test_inputs.py::test_every_declared_range_is_enforced_in_one_line":
        lambda where, name: (where, name) in {(o.command, o.name) for o in ranged()},
    "tests/tools/test_inputs.py::test_every_number_given_as_text_is_refused_in_one_line":
        lambda where, name: (where, name) in {(o.command, o.name) for o in numeric()},
    "tests/train/test_inputs.py::test_every_recipe_field_refuses_a_value_of_the_wrong_type":
        lambda where, name: where == "recipe" and name in {p for p, _ in RECIPE_FIELDS},
    "tests/train/test_inputs.py::test_every_recipe_bound_is_enforced":
        lambda where, name: where == "recipe" and name in {p for p, _, _ in RECIPE_BOUNDS},
}
# a row without a test must say why no check is needed
NO_TEST_REASONS = ("flag (on or off)", "free text", "passed to vLLM, which checks it")


def doc_rows(text: str | None = None) -> dict[tuple[str, str], tuple[str, list[str]]]:
    rows = {}
    for line in (DOC.read_text() if text is None else text).splitlines():
        match = ROW.match(line)
        if match:
            key = (match["where"], match["input"])
            assert key not in rows, f"docs/inputs.md lists {key} twice"
            tests = re.findall(r"`([^`]+::[^`]+)`", match["tests"])
            assert tests or match["tests"] == "—", line
            rows[key] = (match["check"], tests)
    return rows


ROWS = doc_rows()
FLAGS = {(o.command, o.name) for o in options() if o.is_flag}


def expected_inputs() -> set[tuple[str, str]]:
    return ({(o.command, o.name) for o in options()} | {("engine", k) for k in HybridSpecOptions.model_fields}
            | {("recipe", p) for p, _ in RECIPE_FIELDS})


def test_every_input_has_a_row_and_every_row_an_input():
    expected, listed = expected_inputs(), set(ROWS)
    assert sorted(expected - listed) == [], "inputs without a row in docs/inputs.md"
    assert sorted(listed - expected) == [], "rows in docs/inputs.md for inputs that do not exist"


def _source(test: str) -> str | None:
    path, name = test.split("::")
    file = ROOT / path
    if not file.is_file():
        return None
    text = file.read_text()
    return text if re.search(rf"^def {re.escape(name)}\(", text, re.M) else None


def row_problem(key: tuple[str, str], check: str, tests: list[str]) -> str | None:
    """Why the row of ``key`` does not hold, or ``None``."""
    where, name = key
    if not tests:
        reason_ok = check.startswith(NO_TEST_REASONS) and (key in FLAGS) == check.startswith("flag")
        return None if reason_ok else f"{key}: no test and no accepted reason ({check!r})"
    for test in tests:
        text = _source(test)
        if text is None:
            return f"{key}: {test} does not exist"
        if test in WALKERS:
            if not WALKERS[test](where, name):
                return f"{key}: {test} does not walk this input"
            continue
        # a test about an option mentions it (an argument: its command), and the command
        mention = name if name.startswith("--") or where in ("engine", "recipe") else where.split()[-1]
        if mention.split(".")[-1] not in text:
            return f"{key}: {test} never mentions {mention!r}"
        if where not in ("engine", "recipe") and where.split()[-1] not in text:
            return f"{key}: {test} never mentions the command {where!r}"
    return None


@pytest.mark.parametrize("key", sorted(ROWS), ids=[f"{w} {i}" for w, i in sorted(ROWS)])
def test_each_row_names_a_test_about_its_input_or_a_reason(key):
    assert row_problem(key, *ROWS[key]) is None


def test_the_audit_catches_a_missing_row_a_foreign_test_and_an_unexplained_gap():
    """Negative controls: each planted fault is found, naming the input."""
    text = DOC.read_text()
    dropped = doc_rows("\n".join(line for line in text.splitlines() if "| `--num-requests` |" not in line))
    assert expected_inputs() - set(dropped) == {("bench", "--num-requests")}
    foreign = "tests/policy/test_cli_errors.py::test_fit_refuses_binary_records"
    assert row_problem(("bench", "--url"), "http(s)://HOST[:PORT]", [foreign]) == (
        f"('bench', '--url'): {foreign} never mentions '--url'")
    assert row_problem(("bench", "--url"), "x", ["tests/bench/test_inputs.py::test_gone"]) == (
        "('bench', '--url'): tests/bench/test_inputs.py::test_gone does not exist")
    assert row_problem(("bench", "--url"), "free text", []) is None
    assert row_problem(("bench", "--url"), "not checked", []) == (
        "('bench', '--url'): no test and no accepted reason ('not checked')")
    # no input is left to another change: a row that says so without a test is a gap, whatever the command
    assert row_problem(("kernels tune", "--out"), "not checked; outside this change", []) == (
        "('kernels tune', '--out'): no test and no accepted reason ('not checked; outside this change')")
    assert row_problem(("kernels draft-round", "--json"), "flag (on or off)", []) == (
        "('kernels draft-round', '--json'): no test and no accepted reason ('flag (on or off)')")  # not a flag
