"""Verification-length selection on device: the draft-side selector, the routing correction and
the shared length of a batch.

HybridSpec paper, "Draft-side selection and routing correction" (Eqs. 5 and 6), Algorithm 1 lines
3-11, and "Batched decoding".  Lengths count target input tokens: ``w = M + 1`` verifies the anchor
and ``M`` draft tokens, ``W = D + 1``.  Everything here is batched torch with no host sync, no
Python loop over requests and no data-dependent branch, so a round can be captured in a CUDA graph.

Cost tensors are indexed by ``w`` (see :func:`vllm_hybridspec.policy.cost.padded_curve`):
``cost[w] = C_tgt(w)`` for ``w = 1..W``, with unused entries at 0 and ``W + 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expected_tokens(p: torch.Tensor) -> torch.Tensor:
    """``G(w) = 1 + sum_{i=1}^{w-1} p_i`` for ``w = 1..W``.  p: [B, D] -> [B, W]."""
    return 1.0 + torch.cumsum(F.pad(p, (1, 0)), dim=1)


def select_length(p: torch.Tensor, cost: torch.Tensor, rate: torch.Tensor | float,
                  min_length: int = 2) -> torch.Tensor:
    """Eq. 5: ``w0 = argmax_{w in W0} [G(w) - rho C_tgt(w)]``, ties to the shorter length.

    p: [B, D] prefix acceptance probabilities; cost: [W + 2] indexed by ``w``; rate: ``rho`` (float
    or 0-d tensor on p's device); ``W0 = {min_length..W}``, ``min_length`` 2 (the paper) or 1
    (``w = 1`` verifies no draft token).  Returns ``w0``: [B] int64.
    """
    w = p.shape[1] + 1
    score = expected_tokens(p) - rate * cost[1:w + 1]                    # [B, W]
    if min_length > 1:
        score[:, :min_length - 1] = -torch.inf
    return score.argmax(dim=1) + 1                                       # first max = shortest


def stage0_length(w0: torch.Tensor, w_rem: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 line 4: ``u = min(w0 + 1, w_rem)``, the tokens Stage 0 runs to the router."""
    return torch.minimum(w0 + 1, w_rem)


def new_expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Experts each token adds to those chosen by the tokens before it: ``U_0(t+1) - U_0(t)``.

    expert_ids: [B, T, topk] int64 Layer-0 router choices of the target input (anchor first).
    Returns [B, T] int64; column ``w0`` is ``n_new`` for draft token ``d_{w0}``.
    """
    b, t, _ = expert_ids.shape
    chosen = torch.zeros(b, t, num_experts, dtype=torch.int32, device=expert_ids.device)
    chosen.scatter_(2, expert_ids, 1)                                    # [B, T, E]
    seen_before = (chosen.cumsum(dim=1) - chosen) > 0
    return ((chosen > 0) & ~seen_before).sum(dim=2)


def new_experts_at(expert_ids: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """``n_new = U_0(w0 + 1) - U_0(w0)`` (Algorithm 1 line 8): experts of draft token ``d_{w0}``
    (target position ``w0``, anchor at 0) that no earlier token of the input chose.

    expert_ids: [B, T, topk] int64 Layer-0 router choices (distinct within a token), T >= 1;
    w0: [B] int64.  Returns [B] int64 (where ``w0 >= T`` the count is of token ``T - 1``, which the
    correction never reads).  Compares ``topk x topk`` ids per earlier token rather than building
    a [B, T, num_experts] table, so it costs the same for any number of experts.
    """
    b, t, k = expert_ids.shape
    pos = w0.clamp(max=t - 1)
    own = expert_ids.gather(1, pos[:, None, None].expand(b, 1, k))        # [B, 1, topk]
    earlier = torch.arange(t, device=w0.device)[None, :] < pos[:, None]   # [B, T]
    same = expert_ids[:, :, :, None] == own[:, :, None, :]               # [B, T, topk, topk]
    seen = (same & earlier[:, :, None, None]).flatten(1, 2).any(dim=1)   # [B, topk]
    return k - seen.sum(dim=1)


def expansion_table(p: torch.Tensor, w0: torch.Tensor, u: torch.Tensor, cost: torch.Tensor,
                    rate: torch.Tensor | float, s: float, eta: float, n_all: torch.Tensor,
                    n_all_given: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 lines 6-10 before Stage 0 has run: for every count ``n = 0..topk`` of new Layer-0
    experts that ``d_{w0}`` may bring, whether it is kept (``p_{w0} > rho dL_c(n)``, Eq. 6). Stage 0
    then only looks its row's ``n_new`` up (:func:`routing_correction`; the engine's router does the
    same on the device, ``kernels.cut.stage0_expand_torch``).

    p: [B, D]; w0, u: [B] int64; cost: [W + 2]; n_all: [D + 1] and n_all_given: [D + 1, topk + 1]
    indexed by ``w0`` (row 0 unused). Returns [B, topk + 1] bool, all false where Stage 0 does not
    reach ``d_{w0}`` (``u < w0 + 1``: ``w0 = W`` or the budget ends first).
    """
    d = p.shape[1]
    covered = u == w0 + 1                          # false when w0 = W or w_rem <= w0
    j = w0.clamp(1, d)                             # a valid table row even where not covered
    d_cost = cost[w0 + 1] - cost[w0]
    d_experts = n_all_given[j] - n_all[j][:, None]  # [B, topk + 1]
    delta = (d_cost - s)[:, None] + eta * d_experts  # estimated Stage-1 latency of d_{w0} per n
    p_w0 = p.gather(1, (j - 1)[:, None])            # [B, 1]
    return covered[:, None] & (p_w0 > rate * delta)


def routing_correction(p: torch.Tensor, w0: torch.Tensor, u: torch.Tensor, n_new: torch.Tensor,
                       w_rem: torch.Tensor, cost: torch.Tensor, rate: torch.Tensor | float,
                       s: float, eta: float, n_all: torch.Tensor, n_all_given: torch.Tensor
                       ) -> torch.Tensor:
    """Algorithm 1 lines 6-11 (Eq. 6): keep ``d_{w0}`` iff ``p_{w0} > rho dL_c``, where
    ``dL_c = C(w0+1) - C(w0) - s + eta (nbar_all(w0 | n_new) - nbar_all(w0))``.

    p: [B, D]; w0, u, w_rem: [B] int64; n_new: [B] int64 new Layer-0 experts of ``d_{w0}``
    (only read where Stage 0 covered it, ``u == w0 + 1``); cost: [W + 2]; n_all: [D + 1] and
    n_all_given: [D + 1, topk + 1] indexed by ``w0`` (row 0 unused).
    Returns the executed length ``w = min(w_c, w_rem)``: [B] int64.
    """
    table = expansion_table(p, w0, u, cost, rate, s, eta, n_all, n_all_given)
    n = n_new.clamp(0, table.shape[1] - 1)
    expand = table.gather(1, n[:, None])[:, 0]
    return torch.minimum(w0 + expand.to(w0.dtype), w_rem)


def select_shared_length(p: torch.Tensor, candidates: torch.Tensor, cost: torch.Tensor,
                         rate: torch.Tensor | float, w_rem: torch.Tensor | None = None,
                         active: torch.Tensor | None = None) -> torch.Tensor:
    """"Batched decoding": one length for all B requests, ``argmax_{w in candidates}
    [sum_b G_b(w) - rho_B C_B(w)]``, ties to the shorter.

    p: [B, D]; candidates: [K] int64 sorted ascending; cost: [W + 2] ``C_B`` indexed by ``w``;
    w_rem: [B] (a request past its budget emits at most ``G_b(w_rem_b)``); active: [B] bool, false
    for padding rows.  Returns ``w``: 0-d int64 tensor on p's device.
    """
    gain = expected_tokens(p)                                            # [B, W]
    w = candidates[None, :].expand(p.shape[0], -1)
    if w_rem is not None:
        w = torch.minimum(w, w_rem[:, None])
    g = gain.gather(1, w - 1)                                            # [B, K]
    if active is not None:
        g = g * active[:, None].to(g.dtype)
    score = g.sum(dim=0) - rate * cost[candidates]                      # [K]
    return candidates[score.argmax()]
