"""Policy file: fit -> save -> load round trip, and clear errors for malformed files."""

import json

import pytest
import torch

from vllm_hybridspec.policy import (InputError, Policy, Rounds, fit_policy, load_policy,
                                    save_policy)
from vllm_hybridspec.policy.cost import CostFile
from vllm_hybridspec.policy.synthetic import synthesize, synthetic_costs


@pytest.fixture(scope="module")
def fitted():
    rounds = Rounds.from_records(synthesize(4000, seed=70))
    policy, notes = fit_policy(rounds, CostFile.model_validate(synthetic_costs()))
    assert notes == []
    return policy


def test_round_trip(tmp_path, fitted):
    path = tmp_path / "policy.json"
    save_policy(fitted, path)
    back = load_policy(path)
    assert back == fitted
    assert back.routing is not None and back.routing.later_layers and 4 in back.batched
    # the loaded policy selects exactly what the fitted one does
    gen = torch.Generator().manual_seed(71)
    conf, ent = torch.rand(512, 15, generator=gen), 3 * torch.rand(512, 15, generator=gen)
    w_rem = torch.randint(2, 17, (512,), generator=gen)
    a = Policy.from_params(fitted).to(None, torch.float32)
    b = Policy.load(path)
    pa, w0a, ua = a.draft_side(conf, ent, w_rem)
    pb, w0b, ub = b.draft_side(conf, ent, w_rem)
    assert torch.equal(pa, pb) and torch.equal(w0a, w0b) and torch.equal(ua, ub)
    n_new = torch.randint(0, 9, (512,), generator=gen)
    assert torch.equal(a.correct(pa, w0a, ua, n_new, w_rem), b.correct(pb, w0b, ub, n_new, w_rem))
    assert 2 <= int(b.shared_length(pb[:4])) <= 16
    # rho is the Dinkelbach rate of the fitted selector: about 0.38 tokens per ms here
    assert 0.3 < fitted.rate < 0.45


def edit(obj, path, value):
    """Set (or with value=DELETE remove) the entry at a dotted path like 'cost.curve.3'."""
    *head, last = path.split(".")
    for key in head:
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    key = int(last) if isinstance(obj, list) else last
    if value is DELETE:
        del obj[key]
    else:
        obj[key] = value


DELETE = object()


@pytest.mark.parametrize("path,value,words", [
    ("rate", DELETE, ["required field 'rate' is missing"]),
    ("rate", -0.2, ["'rate'", "greater than 0"]),
    ("version", 2, ["'version' is 2", "version 1"]),
    ("format", "something-else", ["not a policy file", "'format'"]),
    ("draft_len", 14, ["'acceptance.isotonic' has 15 maps but draft_len is 14"]),
    ("cost.curve", [1.0] * 15, ["'cost.curve' has 15 values but needs 16"]),
    ("cost.curve.3", 123.0, ["'cost.curve[3]' is 123.0", "disagree"]),
    ("cost.quadratic", [1.0, 2.0], ["cost.quadratic"]),
    ("acceptance.coef", [1.0, 2.0], ["'coef' has 2 weights"]),
    ("acceptance.features", ["conf"], ["acceptance.features", "must be"]),
    ("acceptance.isotonic.2.y", "reversed", ["acceptance.isotonic[2]", "non-decreasing"]),
    ("acceptance.isotonic.0.x", [0.1], ["acceptance.isotonic[0]", "'x' has 1 thresholds"]),
    ("routing.n_all", [1.0] * 14, ["'routing.n_all' has 14 values"]),
    ("routing.n_all_given.4", [1.0, 2.0], ["'routing.n_all_given[4]' needs 9"]),
    ("routing.eta", -1.0, ["routing.eta"]),
    ("batched.4.candidates", [8, 4], ["'batched.4.candidates' is [8, 4]"]),
    ("min_length", 3, ["min_length"]),
    ("gate", {"0": True}, ["'gate' key 0 is not a batch size"]),
    ("gate", {"4": "sometimes"}, ["gate.4"]),
    ("extra_field", 1, ["field 'extra_field': unknown key; valid keys here: format, version, draft_len"]),
    ("cost.curv", [], ["field 'cost.curv': unknown key (did you mean 'curve'?); valid keys here: measured_lengths"]),
])
def test_malformed_policy_is_named(tmp_path, fitted, path, value, words):
    obj = json.loads(fitted.model_dump_json())
    if value == "reversed":
        value = list(reversed(obj["acceptance"]["isotonic"][2]["y"]))
    edit(obj, path, value)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(obj))
    with pytest.raises(InputError) as e:
        load_policy(file)
    msg = str(e.value)
    assert str(file) in msg
    for w in words:
        assert w in msg, msg


def test_unreadable_policy_files(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_policy(tmp_path / "none.json")
    (tmp_path / "p.json").write_text('{"format": "hybridspec-policy",')
    with pytest.raises(InputError, match="not valid JSON"):
        load_policy(tmp_path / "p.json")


def test_batch_gate_fitted_from_plain_decoding_times(tmp_path, fitted):
    """Speculation at B = 4 yields rho_B tokens per ms; plain decoding 4 / plain_ms.  The gate is on
    exactly when rho_B is larger, at both sides of the break-even time."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rounds = Rounds.from_records(synthesize(1000, seed=int(torch.randint(0, 10**6, (), generator=gen))))
    costs = synthetic_costs()
    base, _ = fit_policy(rounds, CostFile.model_validate(costs))
    assert base.gate == {4: True}  # w = 1 is no faster than the round time it is measured by
    rho_4 = base.batched[4].rate
    break_even = 4 / rho_4  # ms per plain step at which both decode equally fast
    for factor, on in ((1.05, True), (0.95, False)):
        costs["batched"]["4"]["plain_ms"] = factor * break_even
        policy, notes = fit_policy(rounds, CostFile.model_validate(costs))
        assert policy.gate == {4: on} and policy.batched[4].rate == rho_4
        assert (notes == []) if on else ("batch gate: drafting off at batch sizes [4]" in notes)
        path = tmp_path / f"gate_{on}.json"
        save_policy(policy, path)
        assert Policy.load(path).gate == {4: on}


def test_gate_and_batched_lookup_take_the_largest_calibrated_size_at_or_below(fitted):
    policy = Policy.from_params(fitted.model_copy(update={"gate": {2: True, 8: False, 32: True}}))
    got = {b: policy.speculate(b) for b in (1, 2, 7, 8, 31, 32, 500)}
    assert got == {1: True, 2: True, 7: True, 8: False, 31: False, 32: True, 500: True}
    assert Policy.from_params(fitted.model_copy(update={"gate": {}})).speculate(64) is True
    assert policy.batched_cost(1) is policy.batched[4] and policy.batched_cost(100) is policy.batched[4]


def test_policy_files_without_a_gate_still_load(tmp_path, fitted):
    obj = json.loads(fitted.model_dump_json())
    del obj["gate"]
    (tmp_path / "old.json").write_text(json.dumps(obj))
    assert load_policy(tmp_path / "old.json").gate == {}
    assert Policy.load(tmp_path / "old.json").speculate(1000) is True
