"""Simulator: hand-computed replay arithmetic, and the headline comparison on synthetic records."""

import pytest
import torch

from vllm_hybridspec.policy import (InputError, Policy, PolicyFile, Rounds, fit_policy, simulate,
                                    simulate_batched)
from vllm_hybridspec.policy.cost import CostFile, padded_curve
from vllm_hybridspec.policy.simulate import dcut_lengths, emitted_tokens, round_time
from vllm_hybridspec.policy.synthetic import synthesize, synthetic_costs

from .helpers import hand_policy, rounds_of


def test_emitted_tokens_and_round_time():
    a = torch.tensor([0, 3, 1, 2])
    w = torch.tensor([4, 2, 3, 1])
    assert emitted_tokens(a, w).tolist() == [1, 2, 2, 1]          # min(A_D, w - 1) + 1
    cost = padded_curve([1.0, 2.0, 3.0, 4.0])
    u = torch.tensor([4, 3, 3, 2])
    dev = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 4)
    t = round_time(w, u, cost, 2.0, 0.1, 0.5, dev)
    # fixed + C(w) + s (u - w) + eta * dev[w - 1]
    assert t.tolist() == pytest.approx([2 + 4 + 0 + 1.5, 2 + 2 + 0.1 + 0.5, 2 + 3 + 0 + 1.0,
                                        2 + 1 + 0.1 + 0.0])
    assert dcut_lengths(16) == [4, 8, 12, 16] and dcut_lengths(4) == [2, 3, 4]


def test_replay_without_routing_hand_computed():
    # D = 3, round time 2 + w ms, c = 0.5 so p = (0.5, 0.25, 0.125), rho = 0.3 -> w0 = 2.
    policy = Policy.from_params(hand_policy())
    rep = simulate(rounds_of([0, 3, 1, 2], 3), policy)
    got = {o.name: o for o in rep.outcomes}
    assert got["verify-all"].throughput == pytest.approx(1000 * 10 / 24)       # tokens 1+4+2+3
    assert got["best static"].throughput == pytest.approx(1000 * 9 / 20)       # w = 3: 1+3+2+3
    assert got["best static"].detail == "w = 3"
    for name in ("hybridspec", "EVICT ratio", "ratio, calibrated", "D-Cut"):
        assert got[name].throughput == pytest.approx(1000 * 7 / 16), name     # w = 2: 1+2+2+2
        assert got[name].mean_length == 2.0
    assert got["verify-all"].acceptance_length == pytest.approx(10 / 4)
    assert "hybridspec+routing" not in got and "oracle" not in got
    assert rep.rounds == 4 and rep.truncated_excluded == 0


def test_replay_with_routing_hand_computed():
    routing = {"s": 0.1, "eta": 0.01, "experts_per_token": 2, "later_layers": True,
               "n_all": [6.0, 10.0, 4.0], "n_all_given": [[1, 4, 7], [0, 5, 20], [2, 3, 4]]}
    policy = Policy.from_params(hand_policy(routing=routing))
    n0 = [[1, 0, 2], [2, 1, 0], [0, 0, 1], [1, 2, 1]]
    later = [[3, 0, 5], [10, 4, 0], [2, 1, 1], [1, 20, 3]]
    rounds = rounds_of([0, 3, 1, 2, 2], 3, n_new_l0=n0 + [n0[0]], n_new_later=later + [later[0]],
                       truncated=[False] * 4 + [True])
    rep = simulate(rounds, policy)
    got = {o.name: o for o in rep.outcomes}
    assert rep.truncated_excluded == 1
    # deviations n_all_j - nbar_all(j): [-2,-10,3], [6,-5,-4], [-4,-9,-2], [-4,12,0]
    assert got["verify-all"].throughput == pytest.approx(1000 * 10 / (24 - 0.01 * 19))
    assert got["best static"].throughput == pytest.approx(1000 * 9 / (20 - 0.01 * 16))
    assert got["hybridspec"].throughput == pytest.approx(1000 * 7 / (16 - 0.01 * 4))
    # correction (see test_selector's hand case): n_new of d_2 = 0, 1, 0, 2 -> w = 3, 2, 3, 2
    times = [2 + 3 - 0.01 * 12, 2 + 2 + 0.1 + 0.01 * 6, 2 + 3 - 0.01 * 13, 2 + 2 + 0.1 - 0.01 * 4]
    assert got["hybridspec+routing"].throughput == pytest.approx(1000 * 7 / sum(times))
    assert got["hybridspec+routing"].mean_length == pytest.approx(2.5)
    assert got["hybridspec+routing"].detail == "expanded 50.0% of rounds"


def test_remaining_budget_caps_every_policy():
    policy = Policy.from_params(hand_policy())
    rep = simulate(rounds_of([3, 3], 3, remaining=[2, 100]), policy)
    for o in rep.outcomes:
        assert o.lengths[0] == 2, o.name


def test_mismatched_draft_length_is_rejected():
    with pytest.raises(InputError, match="D = 4"):
        simulate(rounds_of([1], 4), Policy.from_params(hand_policy()))


def test_policy_beats_baselines_and_nears_the_oracle():
    costs = CostFile.model_validate(synthetic_costs())
    train = Rounds.from_records(synthesize(20000, seed=80))
    test = Rounds.from_records(synthesize(20000, seed=81))
    params, _ = fit_policy(train, costs)
    rep = simulate(test, Policy.from_params(params))
    t = {o.name: o.throughput for o in rep.outcomes}
    for o in rep.outcomes:
        print(f"{o.name:<20} {o.throughput:8.1f} tokens/s  mean w {o.mean_length:5.2f}  "
              f"AL {o.acceptance_length:4.2f}  {o.detail}")
    ratio = rep.as_dict()["oracle_ratio"]
    print("fraction of the oracle:", ratio)
    for ours in ("hybridspec", "hybridspec+routing"):
        for base in ("verify-all", "best static", "EVICT ratio", "ratio, calibrated", "D-Cut"):
            assert t[ours] > t[base], (ours, base)
        assert ratio[ours] >= 0.95
    assert t["hybridspec"] / t["verify-all"] > 1.15


def test_batched_replay_hand_computed():
    obj = hand_policy().model_dump()
    obj["batched"] = {2: {"measured_lengths": [2, 3, 4], "quadratic": [3.0, 2.0, 0.0], "fixed": 3.0,
                          "curve": [2.0, 4.0, 6.0, 8.0], "candidates": [2, 4], "rate": 0.3}}
    params = PolicyFile.model_validate(obj)
    rep = simulate_batched(rounds_of([0, 3, 1, 2, 3], 3), Policy.from_params(params), 2)
    got = {o.name: o for o in rep.outcomes}
    assert rep.rounds == 2                                     # the fifth round makes no batch
    # w = 4: tokens (1 + 4) + (2 + 3), time 2 * (3 + 8); w = 2: (1 + 2) + (2 + 2), 2 * (3 + 4)
    assert got["B=2 longest candidate"].throughput == pytest.approx(1000 * 10 / 22)
    assert got["B=2 best static"].throughput == pytest.approx(1000 * 7 / 14)
    # shared score at rho_B = 0.3: w = 2: 2 * 1.5 - 0.3 * 4 = 1.8; w = 4: 2 * 1.875 - 2.4 = 1.35
    assert got["B=2 shared length"].throughput == pytest.approx(1000 * 7 / 14)
    with pytest.raises(InputError, match="B = 3"):
        simulate_batched(rounds_of([0, 3, 1], 3), Policy.from_params(params), 3)
