"""Dinkelbach's rate against brute force over every combination of choices."""

import itertools

import pytest
import torch

from vllm_hybridspec.policy import dinkelbach


def brute_force(gain, time, allowed):
    best = -1.0
    options = [[k for k in range(gain.shape[1]) if allowed[r, k]] for r in range(gain.shape[0])]
    for combo in itertools.product(*options):
        idx = torch.tensor(combo)
        g = gain[torch.arange(len(combo)), idx].sum()
        t = time[torch.arange(len(combo)), idx].sum()
        best = max(best, float(g / t))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dinkelbach_is_optimal(seed):
    gen = torch.Generator().manual_seed(300 + seed)
    n, k = 5, 5
    gain = 1 + torch.cumsum(torch.rand(n, k, generator=gen, dtype=torch.float64), dim=1)
    time = torch.rand(n, k, generator=gen, dtype=torch.float64) * 4 + 0.5
    if seed % 2:
        time = torch.sort(time, dim=1).values          # a latency curve: longer costs more
    allowed = torch.rand(n, k, generator=gen) < 0.7
    allowed[:, 0] |= ~allowed.any(dim=1)
    rate, choice = dinkelbach(gain, time, allowed)
    want = brute_force(gain, time, allowed)
    assert rate == pytest.approx(want, rel=1e-12)
    # the returned choices attain the rate and each maximises G - rho L in its round
    rows = torch.arange(n)
    assert float(gain[rows, choice].sum() / time[rows, choice].sum()) == pytest.approx(rate, rel=1e-12)
    score = torch.where(allowed, gain - rate * time, -torch.inf)
    assert torch.equal(score.argmax(dim=1), choice)
    assert allowed[rows, choice].all()


def test_dinkelbach_shared_curve_and_ties():
    gain = torch.tensor([[1.0, 2.0, 3.0]])
    time = torch.tensor([1.0, 2.0, 3.0])                # every option has ratio 1: tie -> first
    rate, choice = dinkelbach(gain, time)
    assert rate == pytest.approx(1.0) and choice.tolist() == [0]
    with pytest.raises(ValueError):
        dinkelbach(gain, time, torch.tensor([False, False, False]))
