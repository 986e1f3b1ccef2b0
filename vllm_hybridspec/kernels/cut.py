"""The device-side cut of a verification step in one launch (``engine/length/cut.py`` says what the cut
is): each row's length ``w`` gathered from the selector's lengths of the previous round, and each
token's router source (itself below its row's ``w``, else its row's first token).

As torch ops that is about fifteen small kernels per step, each a launch on the host's critical
path; here it is one. :func:`plan_cut_torch` is the same computation in torch, the reference the
kernel is tested against and the path off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 256  # tokens per program


@triton.jit
def _plan_cut_kernel(w_prev, prev_row, qsl, w_out, source_out, n, T, NO_CUT: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    # rows: w = w_prev[prev] for a row verifying the previous round's drafts, else NO_CUT
    m_r = o < n
    prev = tl.load(prev_row + o, mask=m_r, other=-1)
    w_r = tl.load(w_prev + tl.maximum(prev, 0), mask=m_r & (prev >= 0), other=0)
    tl.store(w_out + o, tl.where(prev >= 0, w_r, NO_CUT).to(tl.int32), mask=m_r)
    # tokens: the row of token t is the number of row ends at or before it (clamped to the last row)
    m_t = o < T
    row = tl.zeros([BLOCK], tl.int32)
    for r in range(0, n):
        end = tl.load(qsl + r + 1)
        row += (end <= o).to(tl.int32)
    row = tl.minimum(row, n - 1)
    start = tl.load(qsl + row, mask=m_t, other=0)
    last = tl.load(qsl + n)
    prev_t = tl.load(prev_row + row, mask=m_t, other=-1)
    w_t = tl.where(prev_t >= 0, tl.load(w_prev + tl.maximum(prev_t, 0), mask=m_t & (prev_t >= 0), other=0), NO_CUT)
    keep = (o - start < w_t) | (o >= last)
    tl.store(source_out + o, tl.where(keep, o, start).to(tl.int64), mask=m_t)


def plan_cut(w_prev: torch.Tensor, prev_row: torch.Tensor, qsl: torch.Tensor, n: int, w_out: torch.Tensor,
             source_out: torch.Tensor, no_cut: int) -> None:
    """Fill ``w_out[:n]`` and ``source_out`` (every entry) in one launch.

    ``w_prev`` ``[N_prev]`` int: the selected length of each row of the previous round; ``prev_row`` ``[n]``
    int64: each row's row in that round, ``-1`` for a row that keeps every token (``w = no_cut``);
    ``qsl`` ``[n + 1]`` int: the step's token offsets. ``source_out[t]`` is ``t`` while ``t`` lies
    below its row's start plus ``w``, or past the step's last token, and the row's first token
    otherwise. Capturable in a CUDA graph (no host reads)."""
    T = source_out.shape[0]
    grid = (triton.cdiv(max(T, n, 1), BLOCK_T),)
    _plan_cut_kernel[grid](w_prev, prev_row, qsl, w_out, source_out, n, T, NO_CUT=no_cut, BLOCK=BLOCK_T)


def plan_cut_torch(w_prev: torch.Tensor, prev_row: torch.Tensor, qsl: torch.Tensor, n: int,
                   w_out: torch.Tensor, source_out: torch.Tensor, no_cut: int) -> None:
    """:func:`plan_cut` as torch ops."""
    w = w_prev.index_select(0, prev_row.clamp(min=0)).to(torch.int32)
    w_out[:n] = torch.where(prev_row >= 0, w, no_cut)
    route_tokens_torch(qsl, n, w_out, source_out)


def route_tokens_torch(qsl: torch.Tensor, n: int, w: torch.Tensor, source_out: torch.Tensor) -> None:
    """``source_out`` of every token, given each row's ``w`` (``[>= n]``): the token itself while its
    position in its row is below the row's ``w``, its row's first token past it; tokens past the
    step's last one keep theirs."""
    t = torch.arange(source_out.shape[0], dtype=torch.int64, device=source_out.device)
    ends = qsl[1 : n + 1].to(torch.int64)
    row = torch.searchsorted(ends, t, right=True).clamp_(max=n - 1)  # [T]
    start = qsl.to(torch.int64).index_select(0, row)
    keep = (t - start < w.index_select(0, row)) | (t >= ends[-1:])
    torch.where(keep, t, start, out=source_out)


def stage0_expand_torch(router_logits: torch.Tensor, qsl: torch.Tensor, w: torch.Tensor, expand: torch.Tensor,
                        no_cut: int, kept: torch.Tensor | None = None) -> None:
    """HybridSpec's Stage 0 at the first MoE router (Algorithm 1 lines 5-11), in place on ``w``: each
    cut row's draft token ``d_{w0}`` (the row's token at position ``w0``, its current ``w``; the anchor
    at 0) is verified too, ``w += 1``, where ``expand[row, n_new]`` says so, ``n_new`` being the experts
    of ``d_{w0}`` that none of the row's tokens before it chose (``policy.selector.new_experts_at``).

    ``router_logits`` ``[T, E]`` (top-k of the logits: a softmax router's choices); ``qsl`` ``[R + 1]``
    non-decreasing (rows past the step have no tokens, vLLM's padding); ``w`` ``[>= R]`` int32,
    ``no_cut`` where a row is not cut; ``expand`` ``[>= R, topk + 1]`` bool
    (``policy.selector.expansion_table``). Rows whose ``d_{w0}`` was not scheduled keep their ``w``.
    ``kept`` (int64 scalar): the rows lengthened are added to it. No host read: capturable in a CUDA
    graph."""
    T = router_logits.shape[0]
    R = qsl.shape[0] - 1
    k = expand.shape[1] - 1
    device = router_logits.device
    ids = router_logits.topk(k, dim=-1).indices  # [T, k], distinct within a token
    q = qsl.to(torch.int64)
    start, end = q[:-1], q[1:]  # [R]
    w0 = w[:R].to(torch.int64)
    t0 = start + w0  # d_{w0}'s token
    valid = (w0 < no_cut) & (t0 < end)
    own = ids.index_select(0, t0.clamp(max=T - 1))  # [R, k]
    t = torch.arange(T, dtype=torch.int64, device=device)
    row = torch.searchsorted(end, t, right=True).clamp_(max=R - 1)  # [T]
    before = (t - start.index_select(0, row) < w0.index_select(0, row)) & (t < end[-1:])  # tokens ahead of d_{w0}
    same = ids[:, :, None] == own.index_select(0, row)[:, None, :]  # [T, k, k]: token expert i == d_{w0}'s j
    seen_by_token = (same.any(dim=1) & before[:, None]).to(torch.int32)  # [T, k]
    seen = torch.zeros(R, k, dtype=torch.int32, device=device).index_add_(0, row, seen_by_token) > 0
    n_new = k - seen.sum(dim=1)  # [R]
    grow = expand[:R].gather(1, n_new[:, None])[:, 0] & valid
    w[:R] += grow.to(w.dtype)
    if kept is not None:
        kept += grow.sum()


# --- sampling: each row's bonus at its cut, the rows ended there -------------------------------------


@triton.jit
def _bonus_at_cut_kernel(cu_drafts, w, bonus_in, bonus_out, v_out, verified, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    cu = tl.load(cu_drafts + o, mask=m, other=0)
    before = tl.load(cu_drafts + o - 1, mask=m & (o > 0), other=0)
    drafts = cu - before
    v = tl.minimum(tl.load(w + o, mask=m, other=1) - 1, drafts)
    tl.store(v_out + o, v, mask=m)
    tl.store(bonus_out + o, (tl.load(bonus_in + o, mask=m, other=0) - (drafts - v)).to(bonus_out.dtype.element_ty),
             mask=m)
    tl.atomic_add(verified, tl.sum(tl.where(m, v, 0).to(tl.int64), axis=0))


def bonus_at_cut(cu_num_draft_tokens: torch.Tensor, w: torch.Tensor, bonus_logits_indices: torch.Tensor,
                 verified: torch.Tensor, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bonus indices at each row's cut [N], v [N] int32)`` in one launch, adding ``sum(v)`` to
    ``verified`` (int64 scalar). ``cu_num_draft_tokens`` ``[N]``: vLLM's cumulative drafts per row;
    ``w`` ``[>= N]`` int32: each row's length; ``v = min(w - 1, drafts)``, the drafts verified. One
    launch on GPUs (``kernel`` None) or where ``kernel`` asks for it, :func:`bonus_at_cut_torch`
    elsewhere."""
    if not (w.is_cuda if kernel is None else kernel):
        return bonus_at_cut_torch(cu_num_draft_tokens, w, bonus_logits_indices, verified)
    n = cu_num_draft_tokens.shape[0]
    v = torch.empty(n, dtype=torch.int32, device=w.device)
    out = torch.empty_like(bonus_logits_indices)
    if n:
        _bonus_at_cut_kernel[(1,)](cu_num_draft_tokens, w, bonus_logits_indices, out, v, verified, n,
                                   BLOCK=max(16, triton.next_power_of_2(n)))
    return out, v


def bonus_at_cut_torch(cu_num_draft_tokens, w, bonus_logits_indices, verified):
    """:func:`bonus_at_cut` as torch ops."""
    cu = cu_num_draft_tokens
    drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    v = torch.minimum(w[: cu.shape[0]] - 1, drafts).to(torch.int32)
    verified += v.sum()
    return (bonus_logits_indices - (drafts - v)).to(bonus_logits_indices.dtype), v


@triton.jit
def _end_rows_kernel(token_ids, stride, bonus, v, out, W, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    m = o < W
    x = tl.load(token_ids + r * stride + o, mask=m, other=-1)
    accepted = tl.sum((x != -1).to(tl.int32), axis=0) - 1
    vr = tl.load(v + r)
    b = tl.load(bonus + r).to(x.dtype)
    full = accepted >= vr
    y = tl.where(full & (o == vr), b, x)
    y = tl.where(full & (o > vr), -1, y)
    tl.store(out + r * W + o, y, mask=m)


def end_rows_at_cut(token_ids: torch.Tensor, bonus: torch.Tensor, v: torch.Tensor,
                    kernel: bool | None = None) -> torch.Tensor:
    """The rejection sampler's ``token_ids`` ``[N, 1 + max drafts]`` (``-1`` past each row's tokens)
    for rows that verify only their first ``v`` drafts: a row that accepted at least ``v`` ends with
    ``bonus`` (``[N]`` or ``[N, 1]``) at position ``v``; a row rejected before ``v`` is unchanged. One
    launch on GPUs (``kernel`` None) or where ``kernel`` asks for it, :func:`end_rows_at_cut_torch`
    elsewhere."""
    if not (token_ids.is_cuda if kernel is None else kernel):
        return end_rows_at_cut_torch(token_ids, bonus, v)
    N, W = token_ids.shape
    out = torch.empty((N, W), dtype=token_ids.dtype, device=token_ids.device)
    if N:
        _end_rows_kernel[(N,)](token_ids, token_ids.stride(0), bonus.reshape(-1), v, out, W,
                               BLOCK=max(16, triton.next_power_of_2(W)))
    return out


def end_rows_at_cut_torch(token_ids: torch.Tensor, bonus: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`end_rows_at_cut` as torch ops."""
    cols = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]
    accepted = (token_ids != -1).sum(dim=1, keepdim=True) - 1
    full = accepted >= v[:, None]
    token_ids = torch.where(full & (cols == v[:, None]), bonus.reshape(-1, 1).to(token_ids.dtype), token_ids)
    return torch.where(full & (cols > v[:, None]), token_ids.new_full((), -1), token_ids)
