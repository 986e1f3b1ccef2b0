"""``HSpecForVLLM.compile_layers``: the drafter's layers through torch.compile (Inductor's CPU backend
here; its CUDA backend on GPUs) compute what the eager layers compute, at two batch sizes and two
prefix capacities on one compilation (shapes are dynamic), so a round drafts the same tokens."""

from __future__ import annotations

import torch

from ...seeds import fresh_seed
from .test_draft_round import K, build


def test_compiled_layers_draft_what_the_eager_layers_draft():
    m = build(torch.float32, 2048, 16, "FLASH_ATTN", seed=3)
    gen = torch.Generator().manual_seed(fresh_seed("compiled layers"))
    n_sel = len(m.config.aux_hidden_state_layer_ids)
    d = m.config.transformer_layer_config.hidden_size
    cases = []
    for N, capacity in ((2, 40), (5, 72)):
        prefix_lens = torch.randint(1, capacity, (N,), generator=gen, dtype=torch.int32)
        block_table = torch.randperm(48, generator=gen)[: N * 5].view(N, 5).to(torch.int32)
        last_hidden = torch.randn(N, n_sel * d, generator=gen)
        anchors = torch.randint(0, 95, (N,), generator=gen)
        cases.append((last_hidden, anchors, block_table, prefix_lens, capacity))
    with torch.inference_mode():
        eager = [m.draft(h, a, m.gather_prefix_kv(t, c, p), p, K) for h, a, t, p, c in cases]
        m.compile_layers()
        assert m.layer_stack is not m.layers_forward
        compiled = [m.draft(h, a, m.gather_prefix_kv(t, c, p), p, K) for h, a, t, p, c in cases]
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e.tokens, c.tokens)
        torch.testing.assert_close(c.top1_prob, e.top1_prob, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(c.entropy, e.entropy, atol=1e-4, rtol=1e-4)
    # the hidden states themselves, on the second batch
    h, a, t, p, c = cases[1]
    prefix_kv = m.gather_prefix_kv(t, c, p)
    positions = p.long()[:, None] + torch.arange(K + 1)
    state = m.state_injection(h)
    hidden = m.embed_tokens(torch.cat([a[:, None], torch.full((a.shape[0], K), m.config.mask_token_id)], 1))
    cos, sin = m._rope(positions, hidden.dtype)
    mask = m._block_mask(p.long(), positions, c, K + 1)
    with torch.inference_mode():
        ref = m.layers_forward(hidden, state, cos, sin, prefix_kv, mask)
        got = m.layer_stack(hidden, state, cos, sin, prefix_kv, mask)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
