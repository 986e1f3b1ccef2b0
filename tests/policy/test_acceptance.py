"""Acceptance model: isotonic map, features, labels, monotone prefix probabilities, fitting."""

import numpy as np
import pytest
import torch
from sklearn.isotonic import IsotonicRegression

from vllm_hybridspec.policy import InputError, Rounds, acceptance_model, fit_acceptance
from vllm_hybridspec.policy.acceptance import (AcceptanceModel, acceptance_features, ema_matrix,
                                               isotonic_calibrate, training_labels)
from vllm_hybridspec.policy.synthetic import synthesize

from .helpers import rounds_of


def random_model(gen, d=6, k_max=12) -> AcceptanceModel:
    iso = []
    for _ in range(d):
        k = int(torch.randint(1, k_max, (1,), generator=gen))
        x = torch.sort(torch.rand(k, generator=gen)).values.unique().tolist()
        y = torch.sort(torch.rand(len(x), generator=gen)).values.tolist()
        iso.append((x, y))
    coef = (3 * torch.randn(5, generator=gen, dtype=torch.float64)).tolist()
    return AcceptanceModel.from_params(iso, coef, float(torch.randn(1, generator=gen)))


def test_ema_matrix_is_the_papers_moving_average():
    gen = torch.Generator().manual_seed(1)
    h = 2 * torch.rand(7, 9, generator=gen, dtype=torch.float64)
    hbar = [h[:, 0]]                                  # hbar_0 = h_1
    for i in range(9):
        hbar.append((h[:, i] + hbar[-1]) / 2)         # hbar_i = (h_i + hbar_{i-1}) / 2
    want = torch.stack(hbar[:9], dim=1)               # column i-1 holds hbar_{i-1}
    torch.testing.assert_close(h @ ema_matrix(9).T, want, rtol=1e-14, atol=1e-14)
    assert torch.allclose(ema_matrix(9).sum(dim=1), torch.ones(9, dtype=torch.float64))


def test_isotonic_matches_sklearn_predict():
    gen = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    iso, fitted = [], []
    for _ in range(5):
        x = rng.random(300)
        y = (rng.random(300) < x ** 2).astype(float)
        r = IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(x, y)
        iso.append((r.X_thresholds_.tolist(), r.y_thresholds_.tolist()))
        fitted.append(r)
    model = AcceptanceModel.from_params(iso, [0.0] * 5, 0.0)
    conf = torch.rand(400, 5, generator=gen, dtype=torch.float64)
    conf[:3] = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)[:, None]
    conf[3] = torch.tensor([x[0] for x, _ in iso], dtype=torch.float64)   # exactly on thresholds
    conf[4] = torch.tensor([x[-1] for x, _ in iso], dtype=torch.float64)
    q = isotonic_calibrate(conf, model)
    want = np.stack([fitted[i].predict(conf[:, i].numpy()) for i in range(5)], axis=1)
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=1e-12)


def test_fast_logit_equals_feature_definition_and_batches():
    gen = torch.Generator().manual_seed(3)
    model = random_model(gen)
    conf = torch.rand(50, 6, generator=gen, dtype=torch.float64)
    ent = 3 * torch.rand(50, 6, generator=gen, dtype=torch.float64)
    ent[:4, ::2] = 0.0                                 # a drafter that is certain
    c, p = acceptance_model(conf, ent, model)
    x = acceptance_features(isotonic_calibrate(conf, model), ent, model)
    torch.testing.assert_close(c, torch.sigmoid(x @ model.coef + model.intercept), rtol=0,
                               atol=1e-13)
    rows = torch.cat([acceptance_model(conf[i:i + 1], ent[i:i + 1], model)[1] for i in range(50)])
    torch.testing.assert_close(rows, p, rtol=0, atol=1e-15)
    c32, p32 = acceptance_model(conf.float(), ent.float(), model)
    assert c32.dtype == torch.float32 and c32.device == conf.device
    torch.testing.assert_close(c32.double(), c, rtol=0, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_probabilities_are_monotone(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    model = random_model(gen, d=15, k_max=40)
    conf = torch.rand(500, 15, generator=gen)
    conf[:20] = torch.where(torch.rand(20, 15, generator=gen) < 0.5, 0.0, 1.0)
    ent = torch.rand(500, 15, generator=gen) * torch.tensor(10.0) ** torch.randint(-6, 2, (500, 15),
                                                                                 generator=gen)
    ent[:10] = 0.0
    for dtype in (torch.float32, torch.float64):
        c, p = acceptance_model(conf.to(dtype), ent.to(dtype), model)
        assert torch.isfinite(p).all()
        assert ((c >= 0) & (c <= 1)).all() and ((p >= 0) & (p <= 1)).all()
        assert (p[:, 1:] <= p[:, :-1]).all()
        torch.testing.assert_close(p[:, 0], c[:, 0], rtol=0, atol=0)


def test_labels_follow_the_paper():
    rounds = rounds_of([0, 2, 3], draft_len=3)
    eligible, label = training_labels(rounds)
    # c_i: label 1[A_D >= i] among rounds with A_D >= i - 1
    assert eligible.tolist() == [[True, False, False], [True, True, True], [True, True, True]]
    assert label.tolist() == [[False, False, False], [True, True, False], [True, True, True]]


def test_truncated_rounds_do_not_train():
    records = synthesize(3000, draft_len=6, seed=4, routing=False, eos_prob=0.0, max_tokens=10**9)
    clean = Rounds.from_records(records)
    gen = torch.Generator().manual_seed(4)
    junk = Rounds.from_records(synthesize(500, draft_len=6, seed=5, routing=False))
    junk.accepted = torch.randint(0, 7, (len(junk),), generator=gen)
    junk.truncated[:] = True
    both = Rounds(**{k: torch.cat([getattr(clean, k), getattr(junk, k)]) for k in vars(clean)})
    a, b = fit_acceptance(clean), fit_acceptance(both)
    assert torch.equal(a.iso_x, b.iso_x) and torch.equal(a.iso_y, b.iso_y)
    torch.testing.assert_close(a.coef, b.coef, rtol=1e-6, atol=1e-6)


def test_fit_recovers_true_acceptance():
    train = Rounds.from_records(synthesize(20000, seed=6))
    test = Rounds.from_records(synthesize(5000, seed=7))
    test = test.select(~test.truncated)
    model = fit_acceptance(train)
    _, p = acceptance_model(test.conf, test.ent, model)
    err = (p - test.p_true).abs()
    mean_hat, mean_true = p.sum(dim=1).mean(), test.p_true.sum(dim=1).mean()
    print(f"|p_hat - p_true|: mean {err.mean():.4f}, max {err.max():.4f}; E[A_D]: model "
          f"{mean_hat:.3f}, truth {mean_true:.3f}, realised {test.accepted.double().mean():.3f}")
    assert err.mean() < 0.03
    # the logistic is linear in the calibrated confidence (as in the paper), not in its logit, so
    # products of near-1 c_i carry a few percent of bias; the selector tolerates it (test_simulate)
    assert abs(mean_hat - mean_true) / mean_true < 0.05


def test_one_class_labels_are_rejected():
    rounds = rounds_of([3, 3, 3], draft_len=3)
    with pytest.raises(InputError, match="both accepted and rejected"):
        fit_acceptance(rounds)
