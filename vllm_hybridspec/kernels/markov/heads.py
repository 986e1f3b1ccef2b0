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
DEFAULT_KEEP = 0  # tiles per program kept in L2 across positions (markov_heads: keep)
PROGRAMS_PER_SM = 2


@triton.jit
def _merge_partials(part_m, part_s, part_t, part_i, base, N, NB, NP: tl.constexpr, NBP: tl.constexpr):
    """Merge the ``NB`` slice summaries of each of ``N`` requests at ``base`` (``[N, NB]`` row-major):
    returns ``(token [NP] int64, top1 [NP], entropy [NP])``, padded rows zero."""
    o_n = tl.arange(0, NP)
    o_b = tl.arange(0, NBP)
    valid = (o_n[:, None] < N) & (o_b[None, :] < NB)
    offs = base + o_n[:, None] * NB + o_b[None, :]
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
    Z = tl.where(o_n < N, Z, 1.0)
    return token.to(tl.int64), 1.0 / Z, tl.log(Z) - T / Z


@triton.jit
def _tile(logits, stride_ln, stride_lv, w2, stride_w2, e, run_m, run_s, run_t, run_i, o_n, m_n, tile, V, R,
          HAS_MARKOV: tl.constexpr, RP: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
          UPCAST: tl.constexpr, EVICT: tl.constexpr):
    """One tile of ``BV`` vocabulary rows folded into the running summaries ``(m, s, t, i)``."""
    o_v = tile * BV + tl.arange(0, BV)
    m_v = o_v < V
    mask = m_n[:, None] & m_v[None, :]
    x = tl.load(logits + o_n[:, None] * stride_ln + o_v[None, :] * stride_lv, mask=mask,
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
    w1, w2, stride_w1, stride_w2,  # [V_prev, R], [V, R]: the Markov head (unused without HAS_MARKOV)
    part_m, part_s, part_t, part_i,  # [K, N, NB] slice summaries: fp32 x 3, int32
    tokens, top1, entropy, stride_on,  # [N, K] outputs: int64, fp32, fp32
    k, N, V, R, NB,
    FIRST: tl.constexpr, HAS_MARKOV: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, NBP: tl.constexpr,
    BV: tl.constexpr, TILES: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, KEEP: tl.constexpr,
):
    pid = tl.program_id(0)
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    if FIRST:
        prev = tl.load(anchors + o_n, mask=m_n, other=0).to(tl.int64)
    else:
        prev, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, (k - 1) * N * NB, N, NB, NP, NBP)
        if pid == 0:  # the previous position's outputs
            tl.store(tokens + o_n * stride_on + k - 1, prev, mask=m_n)
            tl.store(top1 + o_n * stride_on + k - 1, p1, mask=m_n)
            tl.store(entropy + o_n * stride_on + k - 1, ent, mask=m_n)
    if HAS_MARKOV:
        o_r = tl.arange(0, RP)
        e = tl.load(w1 + prev[:, None] * stride_w1 + o_r[None, :], mask=m_n[:, None] & (o_r[None, :] < R),
                    other=0.0)  # [NP, RP]: W1[prev]
        if UPCAST:
            e = e.to(tl.float32)

    run_m = tl.full([NP], float("-inf"), tl.float32)
    run_s = tl.zeros([NP], tl.float32)
    run_t = tl.zeros([NP], tl.float32)
    run_i = tl.zeros([NP], tl.int32)
    if not HAS_MARKOV:
        e = tl.zeros([NP, RP], tl.float32)
    # the first KEEP tiles of each program's slice stay in L2 from one position to the next
    # (evict_last); the rest stream through it (evict_first)
    for j in range(KEEP):
        run_m, run_s, run_t, run_i = _tile(
            logits, stride_ln, stride_lv, w2, stride_w2, e, run_m, run_s, run_t, run_i, o_n, m_n, pid * TILES + j,
            V, R, HAS_MARKOV, RP, BV, PREC, UPCAST, "evict_last")
    for j in range(KEEP, TILES):
        run_m, run_s, run_t, run_i = _tile(
            logits, stride_ln, stride_lv, w2, stride_w2, e, run_m, run_s, run_t, run_i, o_n, m_n, pid * TILES + j,
            V, R, HAS_MARKOV, RP, BV, PREC, UPCAST, "evict_first")
    offs = k * N * NB + o_n * NB + pid
    tl.store(part_m + offs, run_m, mask=m_n)
    tl.store(part_s + offs, run_s, mask=m_n)
    tl.store(part_t + offs, run_t, mask=m_n)
    tl.store(part_i + offs, run_i, mask=m_n)


@triton.jit
def _markov_last_kernel(part_m, part_s, part_t, part_i, tokens, top1, entropy, stride_on, k, N, NB,
                        NP: tl.constexpr, NBP: tl.constexpr):
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    token, p1, ent = _merge_partials(part_m, part_s, part_t, part_i, k * N * NB, N, NB, NP, NBP)
    tl.store(tokens + o_n * stride_on + k, token, mask=m_n)
    tl.store(top1 + o_n * stride_on + k, p1, mask=m_n)
    tl.store(entropy + o_n * stride_on + k, ent, mask=m_n)


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
                 num_warps: int = 4, keep: int = DEFAULT_KEEP, num_stages: int | None = None) -> DraftHeads:
    """The draft heads of :func:`.naive.markov_heads_reference` in ``K + 1`` launches.

    ``logits`` ``[N, K, V]`` in the LM head's dtype (rows may be strided, the vocabulary must be the
    last dimension); ``anchors`` ``[N]`` int; ``w1`` ``[V_prev, R]`` and ``w2`` ``[V, R]`` the Markov
    head's weights (same dtype), or ``None`` for a drafter without it. The bias is accumulated in
    float32 and never rounded to the weights' dtype: the weights are upcast in registers and
    multiplied as TF32 (exact for bfloat16 and float16 values) or, for float32 weights, IEEE float32.
    Returns ``tokens`` ``[N, K]`` int64, ``top1_prob`` and ``entropy`` ``[N, K]`` float32. Every
    launch is capturable in a CUDA graph (no host reads).

    ``keep``: tiles of ``W2`` per program read with ``evict_last``, so that ``programs * keep * BV``
    rows stay in L2 from one position to the next (the other rows stream with ``evict_first``).
    bfloat16 / float16 weights enter ``tl.dot`` as they are on GPUs (their products are exact in
    the float32 accumulator) and as float32 under Triton's interpreter, whose low-precision dot is
    not usable."""
    if (w1 is None) != (w2 is None):
        raise ValueError("give both Markov weights (w1 and w2) or neither")
    N, K, V = logits.shape
    device = logits.device
    tokens = torch.empty(N, K, dtype=torch.int64, device=device)
    top1 = torch.empty(N, K, dtype=torch.float32, device=device)
    entropy = torch.empty(N, K, dtype=torch.float32, device=device)
    if N == 0 or K == 0:
        return DraftHeads(tokens, top1, entropy)
    cfg = launch_config(V, device, BV, programs)
    NB = triton.cdiv(V, cfg["BV"] * cfg["TILES"])
    parts = torch.empty(3, K, N, NB, dtype=torch.float32, device=device)
    part_i = torch.empty(K, N, NB, dtype=torch.int32, device=device)
    has_markov = w1 is not None
    R = w1.shape[1] if has_markov else 16
    if has_markov and (w2.shape != (V, R) or w1.dtype != w2.dtype):
        raise ValueError(f"Markov weights: w2 must be [V={V}, R={R}] of w1's dtype {w1.dtype}, got "
                         f"{tuple(w2.shape)} {w2.dtype}")
    w1_, w2_ = (w1, w2) if has_markov else (logits, logits)  # unused pointers without the head
    NP = max(16, triton.next_power_of_2(N))
    RP = max(16, triton.next_power_of_2(R))
    NBP = max(2, triton.next_power_of_2(NB))
    prec = "ieee" if has_markov and w1.dtype == torch.float32 else "tf32"
    upcast = os.environ.get("TRITON_INTERPRET") == "1" or not logits.is_cuda
    keep = max(0, min(keep, cfg["TILES"]))
    stages = {} if num_stages is None else {"num_stages": num_stages}
    for k in range(K):
        row = logits[:, k]
        _markov_position_kernel[(NB,)](
            row, row.stride(0), row.stride(1), anchors, w1_, w2_, w1_.stride(0), w2_.stride(0),
            parts[0], parts[1], parts[2], part_i, tokens, top1, entropy, tokens.stride(0),
            k, N, V, R, NB, FIRST=k == 0, HAS_MARKOV=has_markov, NP=NP, RP=RP, NBP=NBP, PREC=prec,
            UPCAST=upcast, KEEP=keep, num_warps=num_warps, **stages, **cfg)
    _markov_last_kernel[(1,)](parts[0], parts[1], parts[2], part_i, tokens, top1, entropy, tokens.stride(0),
                              K - 1, N, NB, NP=NP, NBP=NBP, num_warps=num_warps)
    return DraftHeads(tokens, top1, entropy)
