"""The draft heads with a DSpark Markov head in one pass over the vocabulary per position.

Per draft position the heads need, for every request, the greedy token, its probability and the
entropy of ``softmax(logits + W2 @ W1[prev])``, where ``prev`` is the token greedily drafted at the
position before (:func:`.naive.markov_heads_reference`). Done with torch ops that is a log-softmax,
a matmul for the bias and several reductions per position, each a pass over ``[N, V]`` float32
(at the Qwen3.6 vocabulary of 248,320 tokens: about 15 kernels and 4 ms per 15-token block).

Here a position is one kernel. Each program owns a contiguous slice of the vocabulary: it reads its
rows of ``W2`` once for all requests (a ``tl.dot`` with the requests' ``W1[prev]`` rows), adds the
LM-head logits (read in their own dtype, never materialised in float32), and keeps, per request, an
online summary of its slice: the maximum, its first index, ``s = sum exp(x - max)`` and
``t = sum exp(x - max) (x - max)``. The next position's kernel first merges the previous position's
summaries (a few hundred per request) into that position's greedy token, which it needs as ``prev``;
its program 0 also writes that position's outputs. A last one-program kernel finishes the final
position. ``K + 1`` launches per block, and the weight read per position is ``W2`` once, which is
the floor for a bias that depends on the token drafted just before.

With ``candidates`` the positions share one pass over ``W2``: every position is computed for each of
a few candidate previous tokens (the best tokens of the previous position's logits) in one
``tl.dot`` per tile, a small kernel follows each request's chain through the candidates, and a
request runs a per-position pass only where the token drafted before is none of the position's
candidates: at its first such position and, the chain picked up again from the token that pass
drafted, at each later one (on the trained reference drafters the token drafted before is usually
among the few best of the previous position's logits: ``docs/benchmarks/choices.md``).

From the merged summary ``(M, Z = sum exp(x - M), T = sum exp(x - M)(x - M))``: the greedy token's
probability is ``1 / Z`` and the entropy ``log Z - T / Z``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .naive import DraftHeads

DEFAULT_BV = 64  # vocabulary rows per tile
PROGRAMS_PER_SM = 2
DEFAULT_CB = 128  # candidate columns per program of the candidate pass
MERGE_ROWS = 16  # columns per program of the candidates' merge
RESOLVE_ROWS = 16  # requests per program of the resolution


@triton.jit
def _merge_partials(part_m, part_s, part_t, part_i, row_base, rows, NB, NBP: tl.constexpr):
    """Merge the ``NB`` slice summaries of each row (``row_base`` ``[NP]``: where its ``NB`` summaries
    start; ``rows`` ``[NP]``: the rows to merge): returns ``(token [NP] int64, top1 [NP], entropy [NP])``,
    the other rows' values meaningless."""
    o_b = tl.arange(0, NBP)
    valid = rows[:, None] & (o_b[None, :] < NB)
    offs = row_base[:, None] + o_b[None, :]
    m = tl.load(part_m + offs, mask=valid, other=float("-inf"))
    s = tl.load(part_s + offs, mask=valid, other=0.0)
    t = tl.load(part_t + offs, mask=valid, other=0.0)
    idx = tl.load(part_i + offs, mask=valid, other=2147483647)
    M = tl.max(m, axis=1)  # [NP]
    M = tl.where(M > float("-inf"), M, 0.0)
    finite = m > float("-inf")
    scale = tl.where(finite, tl.exp(m - M[:, None]), 0.0)
    d = tl.where(finite, m - M[:, None], 0.0)
    Z = tl.sum(scale * s, axis=1)
    T = tl.sum(scale * (t + d * s), axis=1)
    # the first maximal token: slices are in vocabulary order, each holding its own first maximum
    token = tl.min(tl.where(finite & (m == M[:, None]), idx, 2147483647), axis=1)
    Z = tl.where(rows, Z, 1.0)
    return token.to(tl.int64), 1.0 / Z, tl.log(Z) - T / Z


@triton.jit
def _tile(logits, row, stride_lv, w2, stride_w2, e, run_m, run_s, run_t, run_i, m_n, tile, V, R,
          HAS_MARKOV: tl.constexpr, RP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
          UPCAST: tl.constexpr, EVICT: tl.constexpr):
    """One tile of ``BV`` vocabulary rows folded into the running summaries ``(m, s, t, i)`` of the
    rows whose logits start at ``logits + row`` (``[NP]`` offsets; ``m_n`` the live rows)."""
    o_v = tile * BV + tl.arange(0, BV)
    m_v = o_v < V
    mask = m_n[:, None] & m_v[None, :]
    x = tl.load(logits + row[:, None] + o_v[None, :] * stride_lv, mask=mask,
                other=float("-inf")).to(tl.float32)  # [NP, BV]
    if HAS_MARKOV:
        o_r = tl.arange(0, RP)
        w = tl.load(w2 + o_v[:, None] * stride_w2 + o_r[None, :], mask=m_v[:, None] & (o_r[None, :] < R),
                    other=0.0, eviction_policy=EVICT)  # [BV, RP]
        if UPCAST:
            w = w.to(tl.float32)
        x += tl.dot(e, tl.trans(w), input_precision=PREC)  # the Markov bias, fp32 accumulate
        x = tl.where(mask, x, float("-inf"))
    tile_m = tl.max(x, axis=1)
    tile_i = (tl.argmax(x, axis=1) + tile * BV).to(tl.int32)
    new_m = tl.maximum(run_m, tile_m)
    ref = tl.where(new_m > float("-inf"), new_m, 0.0)
    seen = run_m > float("-inf")
    a = tl.where(seen, tl.exp(run_m - ref), 0.0)
    d = tl.where(seen, run_m - ref, 0.0)
    live = x > float("-inf")
    xd = tl.where(live, x - ref[:, None], 0.0)
    ex = tl.where(live, tl.exp(xd), 0.0)
    run_t = a * (run_t + d * run_s) + tl.sum(ex * xd, axis=1)
    run_s = a * run_s + tl.sum(ex, axis=1)
    run_i = tl.where(tile_m > run_m, tile_i, run_i)
    return new_m, run_s, run_t, run_i


@triton.jit
def _markov_position_kernel(
    logits, stride_ln, stride_lv,  # [N, V] rows of this position, in the LM head's dtype
    anchors,  # [N] int: the previous token at the first position
    first_unresolved,  # [N] int32 (with FALLBACK): rows before it are already drafted
    cand, col_token, col_top1, col_entropy,  # [N * C] (with FALLBACK): the candidate columns
    passes, stride_p,  # [N, K] int32 (with FALLBACK): 1 where the row's position ran a pass here
    w1, w2, stride_w1, stride_w2,  # [V_prev, R], [V, R]: the Markov head (unused without HAS_MARKOV)
    part_m, part_s, part_t, part_i,  # [K, N, NB] slice summaries: fp32 x 3, int32
    tokens, top1, entropy, stride_on,  # [N, K] outputs: int64, fp32, fp32
    k, N, V, R, NB, C, M,
    FIRST: tl.constexpr, HAS_MARKOV: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, NBP: tl.constexpr,
    BV: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    FALLBACK: tl.constexpr = False, MP: tl.constexpr = 2,
):
    pid = tl.program_id(0)
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    if FALLBACK:
        # k >= 1. A row runs a pass at its first unresolved position and at every later position
        # whose previous token is none of the position's candidates; elsewhere the candidate
        # column whose previous token is the one drafted before gives the outputs.
        first = tl.load(first_unresolved + o_n, mask=m_n, other=0)
        ran = tl.load(passes + o_n * stride_p + k - 1, mask=m_n & (first <= k - 1), other=0)
        carried = m_n & (ran != 0)  # rows whose position k - 1 ran a pass: its token is merged here
        at_first = m_n & (first == k)
        later = m_n & (first < k)
        merged, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, (k - 1) * N * NB + o_n * NB,
                                          carried, NB, NBP)
        known = tl.load(tokens + o_n * stride_on + k - 1, mask=m_n & ~carried, other=0)
        prev = tl.where(carried, merged, known)
        o_m = tl.arange(0, MP)
        block = o_n * C + 1 + (k - 1) * M  # [NP]: the first column of this position's candidates
        in_block = later[:, None] & (o_m[None, :] < M)
        cands = tl.load(cand + block[:, None] + o_m[None, :], mask=in_block, other=-1)
        j = tl.min(tl.where(in_block & (cands == prev[:, None]), o_m[None, :], MP), axis=1)
        found = later & (j < MP)
        active = at_first | (later & ~found)
        if pid == 0:
            tl.store(tokens + o_n * stride_on + k - 1, merged, mask=carried)  # the previous position's
            tl.store(top1 + o_n * stride_on + k - 1, p1, mask=carried)
            tl.store(entropy + o_n * stride_on + k - 1, ent, mask=carried)
            col = block + tl.where(found, j, 0)
            tl.store(tokens + o_n * stride_on + k, tl.load(col_token + col, mask=found, other=0), mask=found)
            tl.store(top1 + o_n * stride_on + k, tl.load(col_top1 + col, mask=found, other=0.0), mask=found)
            tl.store(entropy + o_n * stride_on + k, tl.load(col_entropy + col, mask=found, other=0.0),
                     mask=found)
            tl.store(passes + o_n * stride_p + k, active.to(tl.int32), mask=m_n)
    else:
        active = m_n
        if FIRST:
            prev = tl.load(anchors + o_n, mask=m_n, other=0).to(tl.int64)
        else:
            prev, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, (k - 1) * N * NB + o_n * NB,
                                            m_n, NB, NBP)
            if pid == 0:  # the previous position's outputs
                tl.store(tokens + o_n * stride_on + k - 1, prev, mask=m_n)
                tl.store(top1 + o_n * stride_on + k - 1, p1, mask=m_n)
                tl.store(entropy + o_n * stride_on + k - 1, ent, mask=m_n)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        if HAS_MARKOV:
            o_r = tl.arange(0, RP)
            e = tl.load(w1 + prev[:, None] * stride_w1 + o_r[None, :],
                        mask=active[:, None] & (o_r[None, :] < R), other=0.0)  # [NP, RP]: W1[prev]
            if UPCAST:
                e = e.to(tl.float32)
        else:
            e = tl.zeros([NP, RP], tl.float32)
        run_m = tl.full([NP], float("-inf"), tl.float32)
        run_s = tl.zeros([NP], tl.float32)
        run_t = tl.zeros([NP], tl.float32)
        run_i = tl.zeros([NP], tl.int32)
        # W2 streams through L2 (keeping a share of it there across positions was slower,
        # docs/benchmarks/choices.md)
        for jt in range(TILES):
            run_m, run_s, run_t, run_i = _tile(
                logits, o_n * stride_ln, stride_lv, w2, stride_w2, e, run_m, run_s, run_t, run_i, active,
                pid * TILES + jt, V, R, HAS_MARKOV, RP, BV, PREC, UPCAST, "evict_first")
        offs = k * N * NB + o_n * NB + pid
        tl.store(part_m + offs, run_m, mask=active)
        tl.store(part_s + offs, run_s, mask=active)
        tl.store(part_t + offs, run_t, mask=active)
        tl.store(part_i + offs, run_i, mask=active)


@triton.jit
def _markov_last_kernel(part_m, part_s, part_t, part_i, first_unresolved, passes, stride_p, tokens, top1,
                        entropy, stride_on, k, N, NB, NP: tl.constexpr, NBP: tl.constexpr,
                        FALLBACK: tl.constexpr = False):
    o_n = tl.arange(0, NP)
    rows = o_n < N
    if FALLBACK:  # the rows whose last position ran a pass
        first = tl.load(first_unresolved + o_n, mask=rows, other=0)
        rows = rows & (tl.load(passes + o_n * stride_p + k, mask=rows & (first <= k), other=0) != 0)
    token, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, k * N * NB + o_n * NB, rows, NB, NBP)
    tl.store(tokens + o_n * stride_on + k, token, mask=rows)
    tl.store(top1 + o_n * stride_on + k, p1, mask=rows)
    tl.store(entropy + o_n * stride_on + k, ent, mask=rows)


@triton.jit
def _candidate_pass_kernel(
    logits, stride_ln, stride_lk, stride_lv,  # [N, K, V] in the LM head's dtype
    cand,  # [N * C] int64: each column's previous token
    w1, w2, stride_w1, stride_w2,  # [V_prev, R], [V, R]: the Markov head
    part_m, part_s, part_t, part_i,  # [N * C, NB] slice summaries: fp32 x 3, int32
    NC, C, M, V, R, NB,
    CB: tl.constexpr, RP: tl.constexpr, BV: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program ``(c, b)``: columns ``c * CB ..`` over vocabulary slice ``b``. Column ``n * C + j`` is
    request ``n``'s position 0 (``j = 0``) or position ``(j - 1) // M + 1`` with its candidate
    ``(j - 1) % M`` as the previous token; the column blocks of one slice run side by side, so their
    reads of the slice's ``W2`` rows after the first come from L2."""
    pid_c = tl.program_id(0)
    pid = tl.program_id(1)
    o_c = pid_c * CB + tl.arange(0, CB)
    m_c = o_c < NC
    j = o_c % C
    pos = tl.where(j == 0, 0, (j - 1) // M + 1)
    row = (o_c // C) * stride_ln + pos * stride_lk  # [CB]: where each column's logits row starts
    prev = tl.load(cand + o_c, mask=m_c, other=0)
    o_r = tl.arange(0, RP)
    u = tl.load(w1 + prev[:, None] * stride_w1 + o_r[None, :], mask=m_c[:, None] & (o_r[None, :] < R),
                other=0.0)  # [CB, RP]: W1 rows of the candidates
    if UPCAST:
        u = u.to(tl.float32)
    run_m = tl.full([CB], float("-inf"), tl.float32)
    run_s = tl.zeros([CB], tl.float32)
    run_t = tl.zeros([CB], tl.float32)
    run_i = tl.zeros([CB], tl.int32)
    for t in range(TILES):
        run_m, run_s, run_t, run_i = _tile(
            logits, row, stride_lv, w2, stride_w2, u, run_m, run_s, run_t, run_i, m_c, pid * TILES + t,
            V, R, True, RP, BV, PREC, UPCAST, "")
    offs = o_c * NB + pid
    tl.store(part_m + offs, run_m, mask=m_c)
    tl.store(part_s + offs, run_s, mask=m_c)
    tl.store(part_t + offs, run_t, mask=m_c)
    tl.store(part_i + offs, run_i, mask=m_c)


@triton.jit
def _column_merge_kernel(part_m, part_s, part_t, part_i, col_token, col_top1, col_entropy, NC, NB,
                         NP: tl.constexpr, NBP: tl.constexpr):
    """Each column's greedy token, top-1 probability and entropy from its ``NB`` slice summaries."""
    o_c = tl.program_id(0) * NP + tl.arange(0, NP)
    rows = o_c < NC
    token, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, o_c * NB, rows, NB, NBP)
    tl.store(col_token + o_c, token, mask=rows)
    tl.store(col_top1 + o_c, p1, mask=rows)
    tl.store(col_entropy + o_c, ent, mask=rows)


@triton.jit
def _resolve_kernel(cand, col_token, col_top1, col_entropy,  # [N * C]: int64, int64, fp32, fp32
                    tokens, top1, entropy, stride_on,  # [N, K] outputs
                    first_unresolved,  # [N] int32 output
                    passes, stride_p,  # [N, K] int32 output: position 0 (resolved) written here
                    N, C, M, K: tl.constexpr, NP: tl.constexpr, CP: tl.constexpr):
    """Walk each request's positions in order: position 0 is column 0; position ``k`` is the column
    whose candidate is the token drafted at ``k - 1``, until none is (``first_unresolved = k``, else
    ``K``). The request's ``C`` columns stay in registers, so a step is a compare and a select."""
    o_n = tl.program_id(0) * NP + tl.arange(0, NP)
    m_n = o_n < N
    o_j = tl.arange(0, CP)
    mask = m_n[:, None] & (o_j[None, :] < C)
    g = o_n[:, None] * C + o_j[None, :]
    cand_all = tl.load(cand + g, mask=mask, other=-1)  # [NP, CP]
    tok_all = tl.load(col_token + g, mask=mask, other=0)
    p1_all = tl.load(col_top1 + g, mask=mask, other=0.0)
    ent_all = tl.load(col_entropy + g, mask=mask, other=0.0)
    pos = tl.where(o_j == 0, 0, (o_j - 1) // M + 1)  # [CP]: each column's position
    first_col = o_j[None, :] == 0
    prev = tl.sum(tl.where(first_col, tok_all, 0), axis=1)  # [NP] int64
    tl.store(tokens + o_n * stride_on, prev, mask=m_n)
    tl.store(top1 + o_n * stride_on, tl.sum(tl.where(first_col, p1_all, 0.0), axis=1), mask=m_n)
    tl.store(entropy + o_n * stride_on, tl.sum(tl.where(first_col, ent_all, 0.0), axis=1), mask=m_n)
    first = tl.full([NP], 0, tl.int32) + K
    alive = m_n
    for k in range(1, K):
        hit = mask & (pos[None, :] == k) & (cand_all == prev[:, None])
        j = tl.min(tl.where(hit, o_j[None, :], CP), axis=1)  # the first matching candidate's column
        found = alive & (j < CP)
        first = tl.where(alive & ~found, k, first)
        alive = found
        sel = o_j[None, :] == j[:, None]
        prev = tl.sum(tl.where(sel, tok_all, 0), axis=1)
        tl.store(tokens + o_n * stride_on + k, prev, mask=alive)
        tl.store(top1 + o_n * stride_on + k, tl.sum(tl.where(sel, p1_all, 0.0), axis=1), mask=alive)
        tl.store(entropy + o_n * stride_on + k, tl.sum(tl.where(sel, ent_all, 0.0), axis=1), mask=alive)
    tl.store(first_unresolved + o_n, first, mask=m_n)
    tl.store(passes + o_n * stride_p, tl.zeros([NP], tl.int32), mask=m_n)


def launch_config(V: int, device: torch.device, BV: int = DEFAULT_BV, programs: int | None = None) -> dict:
    """``BV`` and ``TILES`` (tiles of ``BV`` rows per program) so that about ``programs`` programs
    (default: ``PROGRAMS_PER_SM`` per SM on CUDA, 4 elsewhere) cover the vocabulary."""
    if programs is None:
        programs = (PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
                    if device.type == "cuda" else 4)
    BV = min(BV, max(16, triton.next_power_of_2(V)))
    tiles = max(1, triton.cdiv(triton.cdiv(V, BV), programs))
    return dict(BV=BV, TILES=tiles)


def markov_heads(logits: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor | None = None,
                 w2: torch.Tensor | None = None, *, BV: int = DEFAULT_BV, programs: int | None = None,
                 num_warps: int = 4, num_stages: int | None = None,
                 candidates: int = 0, columns_per_program: int = DEFAULT_CB, pass_warps: int = 8,
                 first_unresolved: torch.Tensor | None = None, passes: torch.Tensor | None = None) -> DraftHeads:
    """The draft heads of :func:`.naive.markov_heads_reference` in ``K + 1`` launches, or with
    ``candidates`` (``M``) through one pass over ``W2`` for every position.

    ``logits`` ``[N, K, V]`` in the LM head's dtype (rows may be strided, the vocabulary must be the
    last dimension); ``anchors`` ``[N]`` int; ``w1`` ``[V_prev, R]`` and ``w2`` ``[V, R]`` the Markov
    head's weights (same dtype), or ``None`` for a drafter without it. The bias is accumulated in
    float32 and never rounded to the weights' dtype: the weights are upcast in registers and
    multiplied as TF32 (exact for bfloat16 and float16 values) or, for float32 weights, IEEE float32.
    Returns ``tokens`` ``[N, K]`` int64, ``top1_prob`` and ``entropy`` ``[N, K]`` float32. Every
    launch is capturable in a CUDA graph (no host reads).

    bfloat16 / float16 weights enter ``tl.dot`` as they are on GPUs (their products are exact in
    the float32 accumulator) and as float32 under Triton's interpreter, whose low-precision dot is
    not usable.

    ``candidates = M > 0``: the only dependence between positions is the previous token, and the
    token drafted at ``k - 1`` is most often among the ``M`` best of ``logits[:, k - 1]`` (the bias
    is a correction). One kernel computes every position for every candidate previous token at once
    (``C = 1 + (K - 1) M`` columns per request: the anchor for position 0, the top ``M`` of the
    previous position's logits for the others), reading ``W2`` once; a small kernel then walks each
    request's positions through the columns whose candidate is the token drafted before. From the
    first position whose previous token is no candidate (``first_unresolved``, ``[N]`` int32,
    written when given; ``K`` when the candidates resolved every position) the request runs the
    per-position kernel of that position, and of each later position whose previous token (now
    known) is none of its candidates; at the others the column of that token gives the outputs.
    ``passes`` (``[N, K]`` int32, written when given) marks the positions a request ran a
    per-position pass at (every position without candidates); a per-position kernel none of whose
    requests runs a pass returns without reading ``W2``.
    ``columns_per_program`` and ``pass_warps``: the candidate pass's column block and warps. Without
    a Markov head the positions are independent and the per-position kernels run as they are."""
    if (w1 is None) != (w2 is None):
        raise ValueError("give both Markov weights (w1 and w2) or neither")
    if candidates < 0:
        raise ValueError(f"candidates must be 0 (no candidate pass) or a positive count, got {candidates}")
    N, K, V = logits.shape
    device = logits.device
    tokens = torch.empty(N, K, dtype=torch.int64, device=device)
    top1 = torch.empty(N, K, dtype=torch.float32, device=device)
    entropy = torch.empty(N, K, dtype=torch.float32, device=device)
    has_markov = w1 is not None
    use_candidates = candidates > 0 and has_markov
    if first_unresolved is not None:
        if first_unresolved.shape != (N,) or first_unresolved.dtype != torch.int32:
            raise ValueError(f"first_unresolved must be [N={N}] int32, got {tuple(first_unresolved.shape)} "
                             f"{first_unresolved.dtype}")
        if not use_candidates or N == 0 or K == 0:
            first_unresolved.fill_(K)
    if passes is not None:
        if passes.shape != (N, K) or passes.dtype != torch.int32:
            raise ValueError(f"passes must be [N={N}, K={K}] int32, got {tuple(passes.shape)} {passes.dtype}")
        if not use_candidates:
            passes.fill_(1)
    if N == 0 or K == 0:
        return DraftHeads(tokens, top1, entropy)
    cfg = launch_config(V, device, BV, programs)
    NB = triton.cdiv(V, cfg["BV"] * cfg["TILES"])
    parts = torch.empty(3, K, N, NB, dtype=torch.float32, device=device)
    part_i = torch.empty(K, N, NB, dtype=torch.int32, device=device)
    R = w1.shape[1] if has_markov else 16
    if has_markov and (w2.shape != (V, R) or w1.dtype != w2.dtype):
        raise ValueError(f"Markov weights: w2 must be [V={V}, R={R}] of w1's dtype {w1.dtype}, got "
                         f"{tuple(w2.shape)} {w2.dtype}")
    if use_candidates and candidates > V:
        raise ValueError(f"candidates must be at most the vocabulary's {V} tokens, got {candidates}")
    w1_, w2_ = (w1, w2) if has_markov else (logits, logits)  # unused pointers without the head
    NP = max(16, triton.next_power_of_2(N))
    RP = max(16, triton.next_power_of_2(R))
    NBP = max(2, triton.next_power_of_2(NB))
    prec = "ieee" if has_markov and w1.dtype == torch.float32 else "tf32"
    upcast = os.environ.get("TRITON_INTERPRET") == "1" or not logits.is_cuda
    stages = {} if num_stages is None else {"num_stages": num_stages}
    first = anchors  # unused pointers on the plain path
    cols, C = (anchors,) * 4, 1
    ran = tokens
    if use_candidates:
        first = (first_unresolved if first_unresolved is not None
                 else torch.empty(N, dtype=torch.int32, device=device))
        ran = passes if passes is not None else torch.empty(N, K, dtype=torch.int32, device=device)
        cols, C = _candidate_heads(logits, anchors, w1, w2, candidates, cfg, NB, RP, NBP, prec, upcast,
                                   columns_per_program, pass_warps, stages, tokens, top1, entropy, first, ran)
    MP = max(2, triton.next_power_of_2(max(candidates, 1)))
    for k in range(1 if use_candidates else 0, K):
        row = logits[:, k]
        _markov_position_kernel[(NB,)](
            row, row.stride(0), row.stride(1), anchors, first, *cols, ran, ran.stride(0), w1_, w2_,
            w1_.stride(0), w2_.stride(0), parts[0], parts[1], parts[2], part_i, tokens, top1, entropy,
            tokens.stride(0), k, N, V, R, NB, C, max(candidates, 1), FIRST=k == 0, HAS_MARKOV=has_markov,
            NP=NP, RP=RP, NBP=NBP, PREC=prec, UPCAST=upcast, FALLBACK=use_candidates, MP=MP,
            num_warps=num_warps, **stages, **cfg)
    if K > 1 or not use_candidates:
        _markov_last_kernel[(1,)](parts[0], parts[1], parts[2], part_i, first, ran, ran.stride(0), tokens, top1,
                                  entropy, tokens.stride(0), K - 1, N, NB, NP=NP, NBP=NBP,
                                  FALLBACK=use_candidates, num_warps=num_warps)
    return DraftHeads(tokens, top1, entropy)


def candidate_tokens(logits: torch.Tensor, anchors: torch.Tensor, candidates: int) -> torch.Tensor:
    """``[N, C]`` int64, ``C = 1 + (K - 1) M``: each request's anchor, then for every position
    ``k >= 1`` the ``M`` best tokens of ``logits[:, k - 1]`` (the candidates for the token drafted
    at ``k - 1``)."""
    N, K, _ = logits.shape
    first = anchors.long()[:, None]
    if K == 1:
        return first.contiguous()
    top = logits[:, :K - 1].topk(candidates, dim=-1, sorted=False).indices  # [N, K - 1, M]
    return torch.cat([first, top.reshape(N, -1)], dim=1)


def _candidate_heads(logits, anchors, w1, w2, M, cfg, NB, RP, NBP, prec, upcast, columns_per_program,
                     pass_warps, stages, tokens, top1, entropy, first, passes):
    """The candidate pass, its merge and the resolution (:func:`markov_heads` with ``candidates``):
    writes the resolved positions' outputs, ``first`` and ``passes[:, 0]``; returns the columns
    (``cand``, their tokens, top-1 probabilities and entropies, each ``[N * C]``) and ``C``."""
    N, K, V = logits.shape
    R = w1.shape[1]
    device = logits.device
    cand = candidate_tokens(logits, anchors, M).reshape(-1)  # [N * C]
    C = 1 + (K - 1) * M
    NC = N * C
    CB = max(16, min(triton.next_power_of_2(columns_per_program), triton.next_power_of_2(NC)))
    parts = torch.empty(3, NC, NB, dtype=torch.float32, device=device)
    part_i = torch.empty(NC, NB, dtype=torch.int32, device=device)
    _candidate_pass_kernel[(triton.cdiv(NC, CB), NB)](
        logits, logits.stride(0), logits.stride(1), logits.stride(2), cand, w1, w2, w1.stride(0),
        w2.stride(0), parts[0], parts[1], parts[2], part_i, NC, C, M, V, R, NB, CB=CB, RP=RP, PREC=prec,
        UPCAST=upcast, num_warps=pass_warps, **stages, **cfg)
    col_token = torch.empty(NC, dtype=torch.int64, device=device)
    col_top1 = torch.empty(NC, dtype=torch.float32, device=device)
    col_entropy = torch.empty(NC, dtype=torch.float32, device=device)
    _column_merge_kernel[(triton.cdiv(NC, MERGE_ROWS),)](
        parts[0], parts[1], parts[2], part_i, col_token, col_top1, col_entropy, NC, NB, NP=MERGE_ROWS,
        NBP=NBP)
    NPR = max(2, min(RESOLVE_ROWS, triton.next_power_of_2(N)))
    _resolve_kernel[(triton.cdiv(N, NPR),)](
        cand, col_token, col_top1, col_entropy, tokens, top1, entropy, tokens.stride(0), first, passes,
        passes.stride(0), N, C, M, K=K, NP=NPR, CP=max(2, triton.next_power_of_2(C)))
    return (cand, col_token, col_top1, col_entropy), C
