"""Cost and policy files are read strictly (``policy/files.read_model``): a value of the wrong type is
refused, never coerced ("2.2" is not a number, 8.0 not an integer, 1 not true), every number is
finite and within the range its quantity can have, and the fields agree with each other.  Each bad
file is one line naming the file, the field and the value; a command that reads it exits 2 and
writes nothing."""

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vllm_hybridspec.cli import app
from vllm_hybridspec.policy import InputError, load_policy, save_records
from vllm_hybridspec.policy.cost import load_costs
from vllm_hybridspec.policy.synthetic import synthesize

ROOT = Path(__file__).resolve().parents[2]
POLICY = json.loads((ROOT / "examples/policy_synth.json").read_text())  # draft_len 15, batched 4
COSTS = {"version": 1, "round_ms": {"2": 8.9, "4": [11.3, 11.4], "8": 14.4, "16": 18.1}, "fixed_ms": 2.2,
         "s_ms": 0.012, "eta_ms": 0.0042, "experts_per_token": 8,
         "batched": {"4": {"round_ms": {"2": 10.1, "8": 17.2, "16": 23.4}, "fixed_ms": 2.9, "plain_ms": 9.0,
                           "candidates": [2, 8, 16]}}}
runner = CliRunner()


def edited(base: dict, path: str, value) -> dict:
    """``base`` with the entry at a dotted path ('cost.curve.3') set to ``value``."""
    obj = copy.deepcopy(base)
    *head, last = path.split(".")
    here = obj
    for key in head:
        here = here[int(key)] if isinstance(here, list) else here[key]
    here[int(last) if isinstance(here, list) else last] = value
    return obj


def write(tmp_path, obj, name="bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))  # json.dumps writes NaN as NaN, which the readers must refuse
    return path


def refused(load, path) -> str:
    with pytest.raises(InputError) as e:
        load(path)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and message.startswith(str(path)), message
    return message


def test_the_good_files_load(tmp_path):
    costs = load_costs(write(tmp_path, COSTS, "c.json"))
    assert costs.round_ms[4] == [11.3, 11.4] and costs.batched[4].plain_ms == 9.0
    policy = load_policy(write(tmp_path, POLICY, "p.json"))
    assert policy.draft_len == 15 and policy.cost.quadratic == tuple(POLICY["cost"]["quadratic"])
    shipped = load_policy(ROOT / "models/hybrid-hspec/policy_cpu.json")
    assert shipped.draft_len == 7 and shipped.gate


@pytest.mark.parametrize("path,value,words", [
    ("fixed_ms", "2.2", ["'fixed_ms'", "valid number", "'2.2'"]),
    ("round_ms.2", "8.9", ["'round_ms.2'", "valid number", "'8.9'"]),
    ("round_ms.2", 1e300, ["'round_ms'", "time 1e+300 ms", "within 0.001..60000 ms"]),
    ("round_ms.2", 0.0, ["'round_ms'", "time 0.0 ms", "within 0.001..60000 ms"]),
    ("round_ms.4", [11.3, True], ["'round_ms.4[1]'", "valid number", "True"]),
    ("round_ms.4", [], ["'round_ms'", "length 4 has an empty list"]),
    ("experts_per_token", 8.0, ["'experts_per_token'", "valid integer", "8.0"]),
    ("experts_per_token", True, ["'experts_per_token'", "valid integer", "True"]),
    ("experts_per_token", 0, ["'experts_per_token'", "greater than or equal to 1", "0"]),
    ("s_ms", 1e9, ["'s_ms'", "less than or equal to 60000", "1000000000.0"]),
    ("eta_ms", "0.0042", ["'eta_ms'", "valid number", "'0.0042'"]),
    ("fixed_ms", 9.5, ["'fixed_ms' is 9.5 ms", "shortest mean round time 8.9 ms"]),
    ("fixed_ms", float("nan"), ["'fixed_ms' is NaN", "must be finite"]),
    ("batched.4.plain_ms", "9", ["'batched.4.plain_ms'", "valid number", "'9'"]),
    ("batched.4.candidates", [0, 8], ["'batched.4.candidates[0]'", "greater than or equal to 1"]),
    ("batched.4.fixed_ms", 12.0, ["'fixed_ms' is 12.0 ms", "10.1 ms"]),
    ("batched", {"0": COSTS["batched"]["4"]}, ["'batched.0'", "not a batch size written as a positive integer"]),
    ("version", "1", ["'version'", "'1'"]),
    ("time_unit", "s", ["'time_unit'", "'ms'"]),
])
def test_a_bad_cost_file_is_one_line(tmp_path, path, value, words):
    message = refused(load_costs, write(tmp_path, edited(COSTS, path, value)))
    for w in words:
        assert w in message, (w, message)


@pytest.mark.parametrize("path,value,words", [
    ("rate", "0.38", ["'rate'", "valid number", "'0.38'"]),
    ("rate", 0.0, ["'rate'", "greater than 0"]),
    ("draft_len", 15.0, ["'draft_len'", "valid integer", "15.0"]),
    ("draft_len", True, ["'draft_len'", "valid integer", "True"]),
    ("min_length", 2.0, ["'min_length'", "2.0"]),
    ("gate", {"1": "true"}, ["'gate.1'", "valid boolean", "'true'"]),
    ("gate", {"1": 1}, ["'gate.1'", "valid boolean", "1"]),
    ("cost.measured_lengths", [2, 2, 40], ["'cost.measured_lengths' is [2, 2, 40]", "one entry per measured length",
                                          "within 1..16"]),
    ("cost.measured_lengths", [2, 4, 17], ["'cost.measured_lengths' is [2, 4, 17]", "within 1..16"]),
    ("cost.fixed", "2.2", ["'cost.fixed'", "valid number", "'2.2'"]),
    ("cost.quadratic", ["8.6", 0.9, -0.016], ["'cost.quadratic[0]'", "valid number", "'8.6'"]),
    ("acceptance.isotonic.0.x.0", -5, ["'acceptance.isotonic[0].x[0]'", "greater than or equal to 0", "-5"]),
    ("acceptance.entropy_eps", 1e9, ["'acceptance.entropy_eps'", "less than or equal to 1"]),
    ("acceptance.intercept", "0.5", ["'acceptance.intercept'", "valid number", "'0.5'"]),
    ("routing.n_all.0", -3.0, ["'routing.n_all[0]'", "greater than or equal to 0", "-3.0"]),
    ("routing.experts_per_token", 8.5, ["'routing.experts_per_token'", "valid integer", "8.5"]),
    ("routing.later_layers", "yes", ["'routing.later_layers'", "valid boolean", "'yes'"]),
    ("routing.s", 1e9, ["'routing.s'", "less than or equal to 60000"]),
    ("batched.4.rate", "0.3", ["'batched.4.rate'", "valid number", "'0.3'"]),
    ("cost.curve.2", float("inf"), ["'cost.curve[2]' is Infinity", "must be finite"]),
])
def test_a_bad_policy_file_is_one_line(tmp_path, path, value, words):
    message = refused(load_policy, write(tmp_path, edited(POLICY, path, value)))
    for w in words:
        assert w in message, (w, message)


def test_a_policy_of_another_version_type_is_refused(tmp_path):
    message = refused(load_policy, write(tmp_path, edited(POLICY, "version", True)))
    assert "field 'version' is True; this build reads policy files of version 1" in message


def one_line_exit_2(result, *words):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_calibrate_fit_refuses_an_absurd_cost_file_and_writes_nothing(tmp_path):
    records = tmp_path / "r.jsonl"
    save_records(synthesize(300, seed=44), records)
    costs = write(tmp_path, edited(COSTS, "round_ms.16", 1e300), "costs.json")
    out = tmp_path / "out" / "policy.json"
    out.parent.mkdir()
    result = runner.invoke(app, ["calibrate", "fit", "--records", str(records), "--costs", str(costs),
                                 "--out", str(out)])
    one_line_exit_2(result, str(costs), "time 1e+300 ms")
    assert list(out.parent.iterdir()) == []


def test_simulate_and_time_selector_refuse_a_policy_with_a_number_as_text(tmp_path):
    policy = write(tmp_path, edited(POLICY, "rate", "0.38"), "policy.json")
    records = tmp_path / "r.jsonl"
    save_records(synthesize(100, seed=45), records)
    one_line_exit_2(runner.invoke(app, ["simulate", "--records", str(records), "--policy", str(policy)]),
                    str(policy), "'rate'", "'0.38'")
    one_line_exit_2(runner.invoke(app, ["calibrate", "time-selector", "--policy", str(policy), "--device", "cpu"]),
                    str(policy), "'rate'", "'0.38'")


def test_a_fit_whose_constant_term_is_negative_has_no_negative_fixed_cost(tmp_path):
    """Round times 1, 3, 5 ms at w = 1, 2, 3 fit 2w - 1: without 'fixed_ms' the fixed cost is 0, not -1."""
    from vllm_hybridspec.policy import Rounds, fit_policy

    costs = load_costs(write(tmp_path, {"round_ms": {"1": 1.0, "2": 3.0, "3": 5.0}}))
    policy, _ = fit_policy(Rounds.from_records(synthesize(300, seed=46)), costs)
    c0, c1, c2 = policy.cost.quadratic
    assert (c0, c1, c2) == pytest.approx((-1.0, 2.0, 0.0), abs=1e-9)
    assert policy.cost.fixed == 0.0
    assert policy.cost.curve[:3] == pytest.approx([1.0, 3.0, 5.0])
