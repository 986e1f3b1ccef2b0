"""The check of draft heads against the float64 reference, shared by the kernel's tests and the
drafting round's."""

from __future__ import annotations

import torch
from vllm_hybridspec.kernels.markov import DraftHeads

TIE_GAP = 1e-4  # float32 logits of magnitude ~10 plus a float32-accumulated bias: rounding ~1e-6
TOP1_ATOL = 2e-6
ENTROPY_ATOL = 2e-5  # entropy up to log V ~ 7 nats, float32 sums over V terms


def mismatches(got: DraftHeads, ref: DraftHeads, margins: torch.Tensor) -> list[str]:
    """What differs, position by position, up to each row's first near-tie (after which the chains
    may legitimately follow different tokens)."""
    problems = []
    for n in range(ref.tokens.shape[0]):
        for k in range(ref.tokens.shape[1]):
            if margins[n, k] < TIE_GAP:
                break
            if got.tokens[n, k] != ref.tokens[n, k]:
                problems.append(f"row {n} position {k}: token {int(got.tokens[n, k])}, reference "
                                f"{int(ref.tokens[n, k])} (gap {float(margins[n, k]):.2e})")
                break
            dp = abs(float(got.top1_prob[n, k]) - float(ref.top1_prob[n, k]))
            dh = abs(float(got.entropy[n, k]) - float(ref.entropy[n, k]))
            if dp > TOP1_ATOL or dh > ENTROPY_ATOL:
                problems.append(f"row {n} position {k}: top-1 off by {dp:.2e}, entropy by {dh:.2e}")
    return problems
