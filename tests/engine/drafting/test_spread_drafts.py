"""``spread_drafts``, the benchmark's distinct draft ids (``spec-steps --drafts spread``): every position
of a row gets its own id inside the vocabulary, and so does every row where the rows share an anchor
(a dummy target's greedy output); the signals pass through."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridspec.drafter.layers import DraftBlock
from vllm_hybridspec.engine.drafting.proposer import spread_drafts


@pytest.mark.parametrize("vocab", [8192, 151936, 248320])
def test_spread_drafts_differ_by_position_and_row(vocab):
    g = torch.Generator().manual_seed(vocab)
    N, K = 64, 15
    same = torch.zeros(N, K, dtype=torch.int64)  # a dummy drafter's block: one id everywhere
    top1, ent = torch.rand(N, K, generator=g), torch.rand(N, K, generator=g)
    for anchors in (torch.full((N,), 7, dtype=torch.int32), torch.randint(0, vocab, (N,), generator=g)):
        out = spread_drafts(DraftBlock(same, top1, ent), anchors, vocab)
        assert out.tokens.dtype == torch.int64 and out.tokens.shape == (N, K)
        assert int(out.tokens.min()) >= 0 and int(out.tokens.max()) < vocab
        assert all(len(set(row.tolist())) == K for row in out.tokens)  # every position of a row
        if bool((anchors == anchors[0]).all()):  # rows of one anchor (a dummy target's): every row apart
            assert all(len(set(col.tolist())) == N for col in out.tokens.T)
        assert out.top1_prob is top1 and out.entropy is ent
        assert torch.equal(out.tokens, spread_drafts(DraftBlock(same, top1, ent), anchors, vocab).tokens)
    # the ids follow the anchor: the next round's drafts are other ids
    a = torch.full((N,), 7), torch.full((N,), 8)
    t0, t1 = (spread_drafts(DraftBlock(same, top1, ent), x, vocab).tokens for x in a)
    assert not torch.isin(t1[0], t0[0]).any()
