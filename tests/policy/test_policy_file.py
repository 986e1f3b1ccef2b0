"""Policy file: fit -> save -> load round trip, and clear errors for malformed files."""

import json

import pytest
import torch

from vllm_hybridspec.policy import (InputError, Policy, Rounds, fit_policy, load_policy,
                                    save_policy)
from vllm_hybridspec.policy.cost import CostFile
from vllm_hybridspec.policy.synthetic import synthesize, synthetic_costs
from ..seeds import fresh_seed


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
    ("gate", {"0": True}, ["'gate.0'", "key '0' is not a batch size written as a positive integer"]),
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
    gen = torch.Generator().manual_seed(fresh_seed("policy_file_batch_gate_fitted_from_plain"))
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
    policy = Policy.from_params(fitted.model_copy(update={"gate": {2: True, 8: False, 32: True}, "speedup": {}}))
    got = {b: policy.speculate(b) for b in (1, 2, 7, 8, 31, 32, 500)}
    assert got == {1: True, 2: True, 7: True, 8: False, 31: False, 32: True, 500: True}
    assert Policy.from_params(fitted.model_copy(update={"gate": {}, "speedup": {}})).speculate(64) is True
    assert policy.batched_cost(1) is policy.batched[4] and policy.batched_cost(100) is policy.batched[4]


def test_policy_files_without_a_gate_still_load(tmp_path, fitted):
    obj = json.loads(fitted.model_dump_json())
    del obj["gate"], obj["speedup"]
    (tmp_path / "old.json").write_text(json.dumps(obj))
    assert load_policy(tmp_path / "old.json").gate == {}
    assert Policy.load(tmp_path / "old.json").speculate(1000) is True


def _speedup_policy(fitted, speedup):
    return Policy.from_params(fitted.model_copy(update={"speedup": speedup, "gate": {b: r > 1 for b, r in
                                                                                        speedup.items()}}))


def test_the_gate_drafts_where_the_predicted_speedup_is_above_one_between_calibrated_sizes(fitted):
    """Between calibrated sizes the speedup is linear in log B, at them it is the fitted value: random
    tables, every batch size up to 4x the largest one, the decision is ``predicted > 1``."""
    import math
    import random

    rng = random.Random(fresh_seed("policy_file_the_gate_drafts_where_the_pr"))
    for _ in range(20):
        sizes = sorted(rng.sample([1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128], rng.randint(1, 5)))
        table = {b: rng.uniform(0.5, 2.5) for b in sizes}
        policy = _speedup_policy(fitted, table)
        for b, r in table.items():
            assert policy.predicted_speedup(b) == pytest.approx(r)
        for lo, hi in zip(sizes, sizes[1:]):
            for b in range(lo, hi + 1):
                t = (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
                assert policy.predicted_speedup(b) == pytest.approx(table[lo] + t * (table[hi] - table[lo]))
        for b in range(1, 4 * sizes[-1] + 1):
            assert policy.speculate(b) == (policy.predicted_speedup(b) > 1)


def test_past_the_largest_calibrated_size_the_prediction_never_rises_and_falls_with_the_batch(fitted):
    """Beyond ``B_max`` the predicted speedup is at most the value at ``B_max``, at most that value times
    ``B_max / B``, and non-increasing, so a gate off at some size stays off at every larger one."""
    import random

    rng = random.Random(fresh_seed("policy_file_past_the_largest_calibrated"))
    for _ in range(20):
        sizes = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64], rng.randint(1, 4)))
        table = {b: rng.uniform(0.5, 3.0) for b in sizes}
        policy = _speedup_policy(fitted, table)
        b_max, r_max = sizes[-1], table[sizes[-1]]
        previous, off = r_max, False
        for b in range(b_max + 1, 8 * b_max + 2):
            r = policy.predicted_speedup(b)
            assert r <= previous + 1e-12 and r <= r_max * b_max / b + 1e-12
            previous = r
            off = off or not policy.speculate(b)
            assert not (off and policy.speculate(b))


def test_the_gate_turns_off_where_the_old_table_lookup_would_lose(fitted):
    """The issue's failure, as a negative control: calibrated at B = 1 and 4 with speculation paying 1.3x at
    4, the old lookup (the entry of the largest calibrated size <= B) drafts at B = 8 and 64; the prediction
    gates B = 64 off (at most 1.3 * 4 / 64), and the old rule, planted, would keep drafting there."""
    policy = _speedup_policy(fitted, {1: 1.6, 4: 1.3})
    assert policy.speculate(4) and not policy.speculate(64)
    old_rule = Policy.from_params(fitted.model_copy(update={"speedup": {}, "gate": {1: True, 4: True}}))
    assert old_rule.speculate(64)  # the planted (previous) behaviour drafts where the prediction says 0.08x
    assert policy.predicted_speedup(64) < 1 < 1.3


def test_the_gate_ranges_are_the_decision_at_every_batch_size(fitted):
    """``Policy.gate_ranges`` (vLLM's schedule) agrees with ``speculate`` at every batch size up to a bound,
    ranges merged, ending at the bound."""
    import random

    rng = random.Random(fresh_seed("policy_file_the_gate_ranges_are_the_deci"))
    for _ in range(20):
        sizes = sorted(rng.sample([1, 2, 4, 8, 16, 32, 64, 128], rng.randint(1, 4)))
        policy = _speedup_policy(fitted, {b: rng.uniform(0.4, 4.0) for b in sizes})
        big = rng.choice([64, 300, 5000])
        ranges = policy.gate_ranges(15, big)
        assert ranges[0][0] == 1 and ranges[-1][1] == big
        assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(ranges, ranges[1:]))
        lookup = {b: k for start, end, k in ranges for b in range(start, end + 1)}
        assert [lookup[b] for b in range(1, big + 1)] == [15 if policy.speculate(b) else 0
                                                          for b in range(1, big + 1)]


def test_a_speedup_table_is_read_strictly(tmp_path, fitted):
    obj = json.loads(fitted.model_dump_json())
    for bad, message in (({"4": 0.0}, "'speedup.4': Input should be greater than 0 (got 0.0)"),
                         ({"0": 1.2}, "'speedup.0': key '0' is not a batch size written as a positive integer")):
        (tmp_path / "bad.json").write_text(json.dumps({**obj, "speedup": bad}))
        with pytest.raises(InputError) as e:
            load_policy(tmp_path / "bad.json")
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["04", "+4", " 4", "4.0", "4e0", "0x4", "four", "65537"])
@pytest.mark.parametrize("table", ["batched", "gate", "speedup"])
def test_per_batch_keys_are_canonical_positive_integers(tmp_path, fitted, table, key):
    """One batch size has one key: ``"4"`` only, within 1..65,536; anything else is one line naming it."""
    obj = json.loads(fitted.model_dump_json())
    obj[table] = {key: obj[table]["4"]}
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(InputError) as e:
        load_policy(tmp_path / "bad.json")
    message = str(e.value)
    assert f"'{table}.{key}'" in message and "\n" not in message, message
    assert ("positive integer" in message) if key != "65537" else ("65536" in message), message


def test_the_gate_has_one_source(tmp_path, fitted):
    """``speedup`` decides; a ``gate`` that disagrees with it, or a prediction without the batched costs it
    came from, is refused in one line."""
    obj = json.loads(fitted.model_dump_json())
    assert obj["gate"] == {"4": obj["speedup"]["4"] > 1}  # as calibrate fit writes them
    flipped = {"4": not obj["gate"]["4"]}
    orphan = {**obj["speedup"], "8": 1.5}
    for edit, words in (({"gate": flipped}, ["'gate.4' is", f"'speedup.4' is {obj['speedup']['4']:g}", "must agree"]),
                        ({"speedup": orphan, "gate": {}}, ["'speedup.8' has no 'batched.8'", "batched sizes: [4]"]),
                        ({"gate": {**obj["gate"], "2": True}}, ["'gate' has batch sizes [2, 4] but 'speedup' [4]"])):
        (tmp_path / "bad.json").write_text(json.dumps({**obj, **edit}))
        with pytest.raises(InputError) as e:
            load_policy(tmp_path / "bad.json")
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), (edit, str(e.value))
    (tmp_path / "gate_only.json").write_text(json.dumps({**obj, "speedup": {}}))
    assert load_policy(tmp_path / "gate_only.json").gate == {4: obj["gate"]["4"]}  # a gate alone is the source
