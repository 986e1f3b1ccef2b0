"""Cost model: quadratic curve, s and eta slopes, expert tables with the sparse-cell fallback."""

import json

import numpy as np
import pytest
import torch

from vllm_hybridspec.policy import InputError, cost_curve, expert_tables, load_costs

from .helpers import rounds_of


def test_quadratic_curve_and_fixed_cost():
    gen = torch.Generator().manual_seed(20)
    c0, c1, c2 = 7.0, 0.9, -0.015
    times = {w: [c0 + c1 * w + c2 * w * w + float(e) for e in 0.01 * torch.randn(5, generator=gen)]
             for w in (2, 4, 6, 8, 12, 16)}
    curve = cost_curve(times, 16, fixed=2.0)
    mean = {w: np.mean(t) for w, t in times.items()}
    want = np.polyfit(list(mean), list(mean.values()), 2)[::-1]
    np.testing.assert_allclose(curve.quadratic, want, rtol=1e-10)
    assert abs(curve.quadratic[2] - c2) < 2e-3
    vals = curve.values()
    assert len(vals) == 16
    for w in (1, 5, 16):
        assert vals[w - 1] == pytest.approx(want[0] + want[1] * w + want[2] * w * w - 2.0)
    # without a measured fixed cost, the quadratic's constant term is removed
    assert cost_curve(times, 16).fixed == pytest.approx(want[0])


@pytest.mark.parametrize("times,words", [
    ({2: 5.0, 4: 6.0}, ["three or more lengths"]),
    ({2: 5.0, 4: 6.0, 20: 9.0}, ["length 20", "1..16"]),
    ({1: 1.0, 2: 50.0, 3: 1.0}, ["non-positive round time"]),
])
def test_curve_errors(times, words):
    with pytest.raises(InputError) as e:
        cost_curve(times, 16)
    for w in words:
        assert w in str(e.value)


def test_cost_file_slopes_and_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "round_ms": {"2": 9.0, "8": [12.0, 12.2], "16": 16.0},
        "stage0": {"tokens": [2, 4, 8, 16], "ms": [0.30, 0.33, 0.39, 0.51]},
        "experts": {"distinct_experts": [8, 32, 128], "ms": [0.11, 0.31, 1.11]},
    }))
    c = load_costs(path)
    assert c.stage0_slope() == pytest.approx(0.015)
    assert c.expert_cost() == pytest.approx(1.0 / 120)
    assert c.round_ms[8] == [12.0, 12.2]

    for body, words in [
        ("{", ["not valid JSON"]),
        (json.dumps({"round_ms": {"2": -1.0, "4": 2.0, "6": 3.0}}), ["round_ms", "length 2 has time -1.0"]),
        (json.dumps({"round_ms": {"2": 1.0}, "s_ms": 0.1, "stage0": {"tokens": [1, 2], "ms": [1, 2]}}),
         ["'s_ms' or 'stage0'"]),
        (json.dumps({"round_ms": {"2": 1.0}, "eta_ms": -0.1}), ["'eta_ms'", "greater than or equal to 0"]),
        (json.dumps({"round_ms": {"2": 1.0}, "stage0": {"tokens": [1, 1], "ms": [1, 2]}}),
         ["'stage0'", "two distinct x values"]),
        (json.dumps({"fixed_ms": 1.0}), ["'round_ms' is missing"]),
        (json.dumps({"round_ms": {"two": 1.0}}), ["round_ms.two"]),
        (json.dumps({"round_ms": {"2": 1.0}, "version": 2}), ["'version'"]),
    ]:
        path.write_text(body)
        with pytest.raises(InputError) as e:
            load_costs(path)
        for w in words:
            assert w in str(e.value), (body, str(e.value))


def test_expert_tables_hand_case():
    # D = 2; position 1 has 40 tokens with n0 = 1 (later 10) and 40 with n0 = 3 (later 30);
    # position 2 has 40 tokens with n0 = 0 (later 2), 5 with n0 = 2 (later 12), 35 with n0 = 1
    # (later 9), so its n = 2 cell (5 < 30 tokens) and empty cells use a linear fit in n.
    n0_1 = [1] * 40 + [3] * 40
    later_1 = [10] * 40 + [30] * 40
    n0_2 = [0] * 40 + [2] * 5 + [1] * 35
    later_2 = [2] * 40 + [12] * 5 + [9] * 35
    rounds = rounds_of([0] * 80, draft_len=2, n_new_l0=[list(x) for x in zip(n0_1, n0_2)],
                       n_new_later=[list(x) for x in zip(later_1, later_2)])
    n_all, given, later = expert_tables(rounds, experts_per_token=3)
    assert later
    assert n_all[0] == pytest.approx(2.0 + 20.0)
    assert n_all[1] == pytest.approx(np.mean(n0_2) + np.mean(later_2))
    slope1, icpt1 = np.polyfit(n0_1, later_1, 1)          # exactly 10 per expert through 0
    assert given[0][1] == pytest.approx(1 + 10) and given[0][3] == pytest.approx(3 + 30)
    assert given[0][0] == pytest.approx(0 + max(icpt1, 0.0))
    assert given[0][2] == pytest.approx(2 + icpt1 + 2 * slope1)
    slope2, icpt2 = np.polyfit(n0_2, later_2, 1)
    assert given[1][0] == pytest.approx(0 + 2) and given[1][1] == pytest.approx(1 + 9)
    assert given[1][2] == pytest.approx(2 + icpt2 + 2 * slope2)   # sparse cell: the linear fit
    assert given[1][3] == pytest.approx(3 + icpt2 + 3 * slope2)


def test_expert_tables_without_later_counts_and_without_counts():
    rounds = rounds_of([1, 2], draft_len=2, n_new_l0=[[4, 2], [6, 0]])
    n_all, given, later = expert_tables(rounds, experts_per_token=2)
    assert not later and n_all == [5.0, 1.0] and given == [[0.0, 1.0, 2.0]] * 2
    with pytest.raises(InputError, match="n_new_l0"):
        expert_tables(rounds_of([1, 2], draft_len=2), experts_per_token=2)
