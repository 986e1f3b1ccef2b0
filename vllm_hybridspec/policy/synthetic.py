"""Synthetic capture runs whose acceptance truly depends on the drafter's confidence, with the true
prefix probabilities attached (``p_true``), and a cost file shaped like the paper's profile.

Generative model, per round of a request (all draws from one seeded generator):

* difficulty ``z ~ N(0, 1)``; latent logit ``l_i = 2.4 + 1.5 z - 0.1 (i - 1) + 0.9 e_i``
  with ``e_i ~ N(0, 1)``; confidence ``conf_i = sigmoid(l_i)``;
* true conditional acceptance ``c_i = sigmoid(1.3 l_i - 1.0 - 0.03 (i - 1))``: the drafter is
  over-confident and its calibration drifts with position, so raw confidences are not probabilities;
* entropy of a top-1 ``conf_i`` with the rest spread over ``m ~ logNormal(log 20, 0.8)`` tokens;
* ``A_D`` = leading successes of independent ``Bernoulli(c_i)``; ``p_true = cumprod(c)``;
* Layer-0 new experts ``n0_i ~ Binomial(k, a_i e^{0.4 zeta_i})`` and later-layer new pairs
  ``~ Poisson(39 k a_i e^{0.4 (0.75 zeta_i + 0.66 xi_i)} / 2)`` with ``a_i = 0.75 * 0.92^{i-1}``:
  after removing each position's mean they correlate at about 0.5 with about 9 later pairs per
  Layer-0 expert, as the paper's "Layer-0 routing as a proxy" measures;
* requests emit up to ``max_tokens`` with the capture run's verify-all trajectory, ``remaining``
  is the budget left at each round, and EOS ends a request after a round with probability
  ``eos_prob``; the round that hits EOS or the limit is marked truncated.
"""

from __future__ import annotations

import math

import numpy as np

from .records import RoundRecord

# Paper, "Profile across verification lengths": target ms per verification call at w (A100,
# Qwen3.6-35B-A3B); w = 2, 3 extend the trend.  A round adds drafting and overhead (FIXED_MS).
PROFILE_TARGET_MS = {2: 8.45, 3: 9.0, 4: 9.527, 5: 10.055, 6: 10.811, 7: 11.876, 8: 12.648,
                     10: 14.075, 12: 14.659, 15: 16.078, 16: 16.318}
FIXED_MS = 2.2


def true_conditional(latent: np.ndarray) -> np.ndarray:
    """``c_i`` from the latent logits [N, D]."""
    i = np.arange(latent.shape[1])
    return 1.0 / (1.0 + np.exp(-(1.3 * latent - 1.0 - 0.03 * i)))


def top1_entropy(conf: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Entropy (nats) of a distribution with top-1 probability ``conf`` and the rest spread evenly
    over ``spread`` tokens.  Same shapes in and out."""
    rest = np.clip(1.0 - conf, 1e-12, None)
    return np.maximum(-(conf * np.log(conf) + rest * np.log(rest / spread)), 0.0)


def expert_counts(rng: np.random.Generator, n: int, d: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer-0 new experts and later-layer new pairs, [n, d] int each (the module docstring)."""
    a = 0.75 * 0.92 ** np.arange(d)
    zeta, xi = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    n0 = rng.binomial(k, np.clip(a * np.exp(0.4 * zeta), 0.0, 1.0))
    later = rng.poisson(39 * k * a * np.exp(0.4 * (0.75 * zeta + 0.66 * xi)) / 2)
    return n0, later


def synthesize(n_rounds: int, draft_len: int = 15, seed: int = 0, experts_per_token: int = 8,
               max_tokens: int = 512, eos_prob: float = 0.01, routing: bool = True
               ) -> list[RoundRecord]:
    """``n_rounds`` capture-run rounds (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n, d, k = n_rounds, draft_len, experts_per_token
    i = np.arange(d)
    z = rng.standard_normal((n, 1))
    latent = 2.4 + 1.5 * z - 0.1 * i + 0.9 * rng.standard_normal((n, d))
    conf = 1.0 / (1.0 + np.exp(-latent))
    c = true_conditional(latent)
    p_true = np.cumprod(c, axis=1)
    ent = top1_entropy(conf, np.exp(math.log(20.0) + 0.8 * rng.standard_normal((n, d))))
    ok = rng.random((n, d)) < c
    accepted = np.cumprod(ok, axis=1).sum(axis=1)

    n0, later = expert_counts(rng, n, d, k)

    records, emitted, request = [], 0, 0
    for r in range(n):
        remaining = max_tokens - emitted
        a_d = int(accepted[r])
        emitted += a_d + 1
        eos = rng.random() < eos_prob
        truncated = eos or emitted >= max_tokens
        if truncated:
            # the round stopped early: its accepted count is cut where EOS or the limit fell
            a_d = int(rng.integers(0, a_d + 1)) if eos else min(a_d, remaining - 1)
        records.append(RoundRecord(
            conf=conf[r].tolist(), ent=ent[r].tolist(), accepted=a_d,
            truncated=bool(truncated), remaining=remaining, request=request,
            p_true=np.minimum.accumulate(p_true[r]).tolist(),
            n_new_l0=n0[r].tolist() if routing else None,
            n_new_later=later[r].tolist() if routing else None,
        ))
        if truncated:
            emitted, request = 0, request + 1
    return records


def synthetic_costs(draft_len: int = 15, experts_per_token: int = 8) -> dict:
    """A cost file (see :mod:`vllm_hybridspec.policy.cost`) for :func:`synthesize`'s records."""
    w_max = draft_len + 1
    lengths = [w for w in PROFILE_TARGET_MS if w <= w_max]
    if len(lengths) < 3:
        lengths = list(range(1, w_max + 1))
    target = {w: PROFILE_TARGET_MS.get(w, 8.45 + 0.53 * (w - 2)) for w in lengths}
    batch_lengths = [w for w in (2, 4, 8, 12, 16) if w <= w_max] or lengths
    return {
        "version": 1,
        "round_ms": {str(w): round(t + FIXED_MS, 4) for w, t in target.items()},
        "fixed_ms": FIXED_MS,
        "stage0": {"tokens": [2, 4, 8, 12, 16], "ms": [0.324, 0.348, 0.396, 0.444, 0.492]},
        "eta_ms": 0.00418,
        "experts_per_token": experts_per_token,
        "batched": {"4": {"round_ms": {str(w): round(1.35 * (8.45 + 0.62 * (w - 2)) + 2.9, 4)
                                       for w in batch_lengths}, "fixed_ms": 2.9}},
    }
