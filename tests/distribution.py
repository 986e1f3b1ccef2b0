"""Exact sampling distributions (float64) and a goodness-of-fit test, shared by the sampling tests
(``tests/engine/test_sampling_distribution.py``, ``tests/serving/test_sampling_engine.py``)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import power_divergence

ALPHA = 1e-4  # family-wise significance of one test function: Bonferroni over its cases


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution vLLM 0.26 samples from, in float64: temperature, then top-p as
    ``apply_top_k_top_p_pytorch`` defines it (ascending sort; tokens whose cumulative probability is
    ``<= 1 - top_p`` are dropped, the most likely is always kept); temperature 0 is the argmax.
    ``logits`` [..., V] -> [..., V] float64."""
    logits = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1)
    drop = sorted_probs.cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    kept = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    return kept / kept.sum(-1, keepdim=True)


def top_p_margin(logits: torch.Tensor, temperature: float, top_p: float) -> float:
    """How far (in probability) the cumulative sums of ``processed_probs``' top-p cut lie from its
    threshold ``1 - top_p``: float32 sampling makes the same cut when this is well above 1e-6."""
    if temperature == 0 or top_p >= 1.0:
        return float("inf")
    sums = torch.softmax(logits.double() / temperature, dim=-1).sort(dim=-1).values.cumsum(-1)
    return float((sums[..., :-1] - (1 - top_p)).abs().min())


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """G-test (log-likelihood ratio) of observed ``counts`` against the exact ``probs`` (same shape,
    any number of cells): returns ``(G, p-value)``. A sample in a cell of probability 0 gives
    ``(inf, 0)``. Cells expected below 5 are pooled (and the pool joins the smallest cell if it stays
    below 5), so the chi-square approximation holds."""
    counts = counts.reshape(-1).double().numpy()
    probs = probs.reshape(-1).double().numpy()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 0.0
    expected = probs[probs > 0] * counts.sum()
    counts = counts[probs > 0]
    order = np.argsort(expected)
    expected, counts = expected[order], counts[order]
    small = int(np.searchsorted(np.cumsum(expected), 5.0, side="right")) + 1  # cells pooled into one
    small = min(small, len(expected))
    expected = np.concatenate([[expected[:small].sum()], expected[small:]])
    counts = np.concatenate([[counts[:small].sum()], counts[small:]])
    if len(expected) < 2:
        return 0.0, 1.0
    stat, p = power_divergence(counts, expected, lambda_="log-likelihood")
    return float(stat), float(p)
