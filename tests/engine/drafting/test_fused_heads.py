"""``HSpecForVLLM.draft_heads`` through the Markov-head kernel (``kernels.markov``; what a CUDA device
runs) against the same method's torch positions and the float64 reference, no engine. It runs with
the kernel tests (Triton's interpreter): in the engine test processes vLLM's Triton placeholder
breaks interpreted kernels (Makefile)."""

from __future__ import annotations

import pytest
import torch
from vllm_hybridspec.kernels.markov import markov_heads_reference, top2_margins

from ...kernels.markov_check import mismatches
from ...seeds import fresh_seed
from .test_draft_round import K, build


@pytest.mark.parametrize(("N", "markov_rank", "candidates"), [(3, 16, 0), (2, 0, 0), (3, 16, 4)])
def test_the_fused_heads_draft_what_the_torch_heads_draft(N, markov_rank, candidates):
    """Float32, the same hidden states: the same tokens up to near-ties, signals within the kernel's
    bound, and both match the float64 reference of the round's logits; with ``candidate_heads`` the
    kernel goes through candidate previous tokens."""
    m = build(torch.float32, 2048, markov_rank, "FLASH_ATTN", seed=N)
    gen = torch.Generator().manual_seed(fresh_seed("fused heads"))
    d = m.config.transformer_layer_config.hidden_size
    hidden = 3 * torch.randn(N, K + 1, d, generator=gen)
    anchors = torch.randint(0, 95, (N,), generator=gen)
    with torch.inference_mode():
        torch_heads = m.draft_heads(hidden, anchors)
        m.fused_heads = True
        m.candidate_heads = candidates
        fused = m.draft_heads(hidden, anchors)
        logits = m.compute_logits(m.norm(hidden[:, 1:]).reshape(-1, d)).view(N, K, -1)
    mh = m.markov_head
    weights = (mh.markov_w1.weight, mh.markov_w2.weight) if mh is not None else ()
    ref = markov_heads_reference(logits, anchors, *weights)
    margins = top2_margins(logits, ref.tokens, anchors, *weights)
    assert mismatches(fused, ref, margins) == []
    assert mismatches(torch_heads, ref, margins) == []
