"""The Markov-head kernel (``kernels.markov.markov_heads``, Triton's interpreter on the CPU) against the
float64 reference on fresh random inputs: the same greedy tokens wherever the reference's top-2 gap is
wider than float32 rounding, and the top-1 probability and entropy within a stated bound. The check
(``markov_check.mismatches``) is shown to reject two planted bugs of the head: a bias that never
follows the drafted tokens, and signals taken without the bias."""

from __future__ import annotations

import pytest
import torch
from vllm_hybridspec.kernels.markov import (
    DraftHeads,
    markov_heads,
    markov_heads_reference,
    top2_margins,
)

from ..seeds import fresh_seed
from .markov_check import TIE_GAP, mismatches


def random_case(gen, N, K, V, R, dtype, scale=3.0):
    logits = (scale * torch.randn(N, K, V, generator=gen)).to(dtype)
    anchors = torch.randint(0, V, (N,), generator=gen)
    if R == 0:
        return logits, anchors, None, None
    w1 = torch.randn(V, R, generator=gen).to(dtype)
    w2 = (torch.randn(V, R, generator=gen) / R**0.5).to(dtype)
    return logits, anchors, w1, w2


@pytest.mark.parametrize(("N", "K", "V", "R", "dtype", "programs"), [
    (1, 7, 500, 16, torch.bfloat16, None),
    (3, 5, 1000, 32, torch.float32, 7),  # several vocabulary slices per request, merged
    (17, 3, 300, 8, torch.bfloat16, 3),  # NP = 32 padded requests; R below a dot's minimum of 16
    (2, 4, 333, 0, torch.float32, 5),  # no Markov head
    (4, 15, 129, 64, torch.float16, 2),
])
def test_heads_match_the_float64_reference(N, K, V, R, dtype, programs):
    gen = torch.Generator().manual_seed(fresh_seed("markov heads"))
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, dtype)
    ref = markov_heads_reference(logits, anchors, w1, w2)
    margins = top2_margins(logits, ref.tokens, anchors, w1, w2)
    got = markov_heads(logits, anchors, w1, w2, BV=32, programs=programs)
    assert got.tokens.dtype == torch.int64 and got.top1_prob.dtype == got.entropy.dtype == torch.float32
    assert mismatches(got, ref, margins) == []
    compared = int((margins >= TIE_GAP).sum())
    assert compared >= 0.9 * N * K, f"only {compared} of {N * K} positions compared (too many near-ties)"


def test_strided_rows_ties_and_masked_tokens():
    """Logits as vLLM's LogitsProcessor leaves them (a slice of padded rows), an exact tie (the first
    index wins, as ``argmax``) and tokens at -inf."""
    gen = torch.Generator().manual_seed(fresh_seed("markov heads"))
    N, K, V, R = 3, 4, 200, 16
    padded = 2.0 * torch.randn(N * K, V + 56, generator=gen)
    logits = padded[:, :V].view(N, K, V)
    logits[0, 0, 10] = logits[0, 0, 150] = 50.0  # a tie across vocabulary slices
    logits[1, :, :20] = float("-inf")
    anchors = torch.randint(0, V, (N,), generator=gen)
    w1 = torch.randn(V, R, generator=gen)
    w2 = 0.1 * torch.randn(V, R, generator=gen)
    w2[10] = w2[150] = 0.0  # keep the tie exact after the bias
    got = markov_heads(logits, anchors, w1, w2, BV=16, programs=5)
    ref = markov_heads_reference(logits, anchors, w1, w2)
    assert int(got.tokens[0, 0]) == int(ref.tokens[0, 0]) == 10
    assert bool((got.tokens[1] >= 20).all())
    margins = top2_margins(logits, ref.tokens, anchors, w1, w2)
    margins[0, 0] = 1.0  # the tie is decided by index, which both take from the first maximum
    assert mismatches(got, ref, margins) == []


def test_the_check_catches_planted_head_bugs():
    """Negative controls: two wrong heads, each rejected by the same check the kernel passes."""
    gen = torch.Generator().manual_seed(fresh_seed("markov heads"))
    N, K, V, R = 4, 6, 400, 16
    logits, anchors, w1, w2 = random_case(gen, N, K, V, R, torch.float32, scale=1.0)
    w2 = 8 * w2  # a bias that matters
    ref = markov_heads_reference(logits, anchors, w1, w2)
    margins = top2_margins(logits, ref.tokens, anchors, w1, w2)
    assert mismatches(markov_heads(logits, anchors, w1, w2, BV=32, programs=3), ref, margins) == []

    # 1. the bias of the anchor at every position (prev never follows the drafted tokens)
    stale = [markov_heads_reference(logits[:, k:k + 1], anchors, w1, w2) for k in range(K)]
    stale = DraftHeads(*(torch.cat(parts, 1) for parts in zip(*stale, strict=True)))
    assert len(mismatches(stale, ref, margins)) >= N // 2
    # 2. the signals of the unbiased logits next to the right tokens
    unbiased = markov_heads_reference(logits, anchors)
    wrong_signals = DraftHeads(ref.tokens, unbiased.top1_prob, unbiased.entropy)
    assert len(mismatches(wrong_signals, ref, margins)) >= N * K // 2


def test_empty_batch_and_mismatched_weights():
    logits = torch.zeros(0, 3, 50)
    out = markov_heads(logits, torch.zeros(0, dtype=torch.long))
    assert out.tokens.shape == (0, 3)
    with pytest.raises(ValueError, match="both Markov weights"):
        markov_heads(torch.zeros(1, 2, 50), torch.zeros(1, dtype=torch.long), torch.zeros(50, 16), None)
    with pytest.raises(ValueError, match=r"w2 must be \[V=50, R=16\]"):
        markov_heads(torch.zeros(1, 2, 50), torch.zeros(1, dtype=torch.long), torch.zeros(50, 16),
                     torch.zeros(40, 16))
