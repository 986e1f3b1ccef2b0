"""The float64 torch reference of the draft heads with a DSpark Markov head.

Position ``k`` of a block (``k = 0 .. K-1``, the drafts after the anchor) scores the vocabulary with
the drafter's LM-head logits plus the Markov bias of the token drafted just before it,
``W2 @ W1[prev]`` (``prev`` is the anchor at ``k = 0``), and yields its greedy token, that token's
probability and the distribution's entropy. The greedy token is the next position's ``prev``, so
the positions run in order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftHeads(NamedTuple):
    tokens: torch.Tensor  # [N, K] int64, the greedy draft tokens
    top1_prob: torch.Tensor  # [N, K], the greedy token's probability
    entropy: torch.Tensor  # [N, K], nats


def markov_heads_reference(logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor | None = None,
                           w2: torch.Tensor | None = None) -> DraftHeads:
    """``logits`` ``[N, K, V]`` (the LM head's, any float dtype); ``anchors`` ``[N]`` int; ``w1``
    ``[V_prev, R]`` (``MarkovHead.markov_w1.weight``, rows indexed by the previous token) and ``w2``
    ``[V, R]`` (``MarkovHead.markov_w2.weight``), or both ``None`` for a drafter without the head.
    Everything in float64; ties go to the lowest token id (``argmax``). Returns float64 signals."""
    if (w1 is None) != (w2 is None):
        raise ValueError("give both Markov weights (w1 and w2) or neither")
    x = logits.double()
    prev = anchors.long()
    tokens, top1, entropy = [], [], []
    for k in range(x.shape[1]):
        step = x[:, k]
        if w1 is not None:
            step = step + w1.double()[prev] @ w2.double().T  # [N, V]
        logp = torch.log_softmax(step, dim=-1)
        best = logp.argmax(dim=-1)
        top1.append(logp.gather(-1, best[:, None]).squeeze(-1).exp())
        entropy.append(-(logp.exp() * logp).sum(-1))
        tokens.append(best)
        prev = best
    return DraftHeads(torch.stack(tokens, 1), torch.stack(top1, 1), torch.stack(entropy, 1))


def markov_heads_torch(logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor | None = None,
                       w2: torch.Tensor | None = None) -> DraftHeads:
    """The heads as torch ops per position in float32 (what the engine runs off CUDA): the Markov bias
    ``linear(embedding(prev, w1), w2)`` in the weights' dtype is added to the float32 logits with type
    promotion, ``max`` gives the greedy token (the first maximal index, as ``argmax``) and its
    log-probability in one kernel, and the elementwise tails run once on the stacked ``[N, K]``
    values. Same arguments as :func:`markov_heads_reference`."""
    x = logits.float()
    prev, tokens, top1_logp, plogp = anchors, [], [], []
    for k in range(x.shape[1]):
        step = x[:, k]
        if w1 is not None:
            step = step + torch.nn.functional.linear(torch.nn.functional.embedding(prev.long(), w1), w2)
        logp = torch.log_softmax(step, dim=-1)
        best_logp, best = logp.max(dim=-1)
        top1_logp.append(best_logp)
        plogp.append((logp.exp() * logp).sum(-1))
        prev = best
        tokens.append(best)
    return DraftHeads(torch.stack(tokens, 1), torch.stack(top1_logp, 1).exp(), -torch.stack(plogp, 1))


def top2_margins(logits: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                 w1: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, K]`` float64: at each position, the gap between the best and second-best biased logit,
    with the bias taken from ``tokens`` (the reference's greedy chain). A fast path may pick another
    token where this gap is within its rounding error."""
    x = logits.double()
    prev = torch.cat([anchors.long()[:, None], tokens[:, :-1]], dim=1)  # [N, K]
    if w1 is not None:
        x = x + torch.einsum("nkr,vr->nkv", w1.double()[prev], w2.double())
    top = x.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
