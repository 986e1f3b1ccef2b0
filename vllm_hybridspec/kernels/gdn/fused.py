"""Lazy commit fused into verification: each GDN state is read once and written once per round.

The unfused round verifies from ``S_0`` (``verify.py``, a read of the state) and, after rejection
sampling, rebuilds ``S_m`` in a separate launch (``commit.py``, a read and a write). Here a layer
keeps the previous round's compact factors in persistent per-entry buffers (*slabs*) and, at its
next forward, first advances each sequence's state through the previous round's ``m`` committed
tokens (Eq. 7), then verifies the new round from the advanced state (Eqs. 3 and 10), in one kernel:
the committed state ``S_m`` is formed on registers, written to the pool once and used at once for
the new round's products. No host-side round object is needed between the two, so a speculative
step can run inside a CUDA graph. HybridSpec paper, "Parallel GDN verification and accepted-state
reconstruction"; the torch reference is :func:`vllm_hybridspec.kernels.gdn.naive.commit_verify`.

Both methods of :func:`gdn_verify` exist fused: "chunk" applies the commit chunk by chunk of the key
dimension inside its key-chunk loop (``h_c = e^{G_m} h_c + (Z diag(w))^T K_c``), "recurrent" applies
it to its ``[BV, K]`` register slice before stepping the recurrence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import _chunk_products, _chunk_solve, _program_round, _recurrent_steps, _store_round
from .verify import (
    MAX_VERIFY_LEN,
    SERIES_FROM,
    VerifyFactors,
    _check_shapes,
    _launch_config,
    _round_inputs,
    recurrent_up_to,
)

FUSED_CHUNK_BV = 32  # value rows per program of the fused chunkwise round (see gdn_commit_verify)


@triton.jit
def _pending_round(pending_entry, pending_m, slab_g, HV: tl.constexpr, SLAB_LEN: tl.constexpr):
    """The program's pending round: ``(commit, first slab row of its entry, m, G_m)``. Without a
    pending round (entry < 0 or m <= 0) ``commit`` is off, ``m = 0`` and ``G_m = 0``; ``m`` is
    clamped to ``SLAB_LEN`` so that no count reads beyond its entry."""
    i_n, i_hv = tl.program_id(1) // HV, tl.program_id(1) % HV
    entry = tl.load(pending_entry + i_n).to(tl.int64)
    m = tl.minimum(tl.load(pending_m + i_n).to(tl.int64), SLAB_LEN)
    commit = (entry >= 0) & (m > 0)
    m = tl.where(commit, m, 0)
    prow = tl.maximum(entry, 0) * SLAB_LEN
    g_m = tl.load(slab_g + (prow + m - 1) * HV + i_hv, mask=commit, other=0.0)
    return commit, prow, m, g_m


@triton.jit
def gdn_commit_verify_kernel(
    q, k, v,  # [T, HK, K], [T, HK, K], [T, HV, V]
    g_or_a, beta_or_b,  # [T, HV]: (g, beta), or the raw gate inputs (a, b) when FUSED_GATING
    A_log, dt_bias,  # [HV], only read when FUSED_GATING
    state, state_indices,  # pool [slots, HV, V, K] fp32, read and written; [N] (<= 0: skipped)
    cu_seqlens,  # [N + 1]
    o, slab_z, slab_k, slab_g,  # [T, HV, V]; slabs [E * SLAB_LEN, HV, V], [.., HK, K], [.., HV] fp32
    pending_entry, pending_m, target_entry,  # [N] each
    scale,
    stride_state_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, U: tl.constexpr, BU: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr, PREC: tl.constexpr,
    SERIES_FROM: tl.constexpr, SLAB_LEN: tl.constexpr, COMMIT_PREC: tl.constexpr,
):
    """:func:`verify.gdn_verify_kernel` with the pending commit folded into its key-chunk loop:
    each ``[BV, BK]`` chunk of ``S_0`` is advanced to ``S_m`` (Eq. 7), stored, and then enters the
    round's products, so the state is read once and written once."""
    i_v, i_hv, i_h, bos, length, slot = _program_round(cu_seqlens, state_indices, HK, HV)
    if (length <= 0) | (slot <= 0):
        return
    commit, prow, m, g_m = _pending_round(pending_entry, pending_m, slab_g, HV, SLAB_LEN)

    o_t = tl.arange(0, BU)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_p = o_t < m
    # Eq. 7's weights e^{G_m - G_j} of the committed tokens j <= m, folded into Z^T: [BV, BU]
    b_pg = tl.load(slab_g + (prow + o_t) * HV + i_hv, mask=m_p, other=0.0)
    w = tl.where(m_p, tl.exp(tl.where(m_p, g_m - b_pg, 0.0)), 0.0)
    zw_t = tl.load(slab_z + ((prow + o_t[None, :]) * HV + i_hv) * V + o_v[:, None],
                   mask=m_p[None, :] & m_v[:, None], other=0.0) * w[None, :]
    e_m = tl.exp(g_m)
    p_h = state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K
    p_pk = slab_k + ((prow + o_t[:, None]) * HK + i_h) * K
    ss_kq = tl.zeros([2 * BU], dtype=tl.float32)
    ss_k = tl.zeros([BU], dtype=tl.float32)
    s_kq = tl.zeros([BV, 2 * BU], dtype=tl.float32)
    k_kq = tl.zeros([BU, 2 * BU], dtype=tl.float32)
    for kc in tl.static_range(0, K, BK):
        o_k = kc + tl.arange(0, BK)
        h_c = tl.load(p_h + o_k[None, :], mask=m_v[:, None], other=0.0)  # [BV, BK] of S_0
        pk_c = tl.load(p_pk + o_k[None, :], mask=m_p[:, None], other=0.0)  # [BU, BK] committed keys
        h_c = e_m * h_c + tl.dot(zw_t, pk_c, input_precision=COMMIT_PREC)  # of S_m
        tl.store(p_h + o_k[None, :], h_c, mask=m_v[:, None] & commit)
        ss_kq, ss_k, s_kq, k_kq = _chunk_products(q, k, h_c, kc, bos, length, i_h, ss_kq, ss_k, s_kq, k_kq,
                                                  HK, K, BK, BU, PREC)
    b_ot, b_zt, g_cum, r_k = _chunk_solve(v, g_or_a, beta_or_b, A_log, dt_bias, bos, length, i_v, i_hv,
                                          ss_kq, ss_k, s_kq, k_kq, scale, HV, V, BV, U, BU,
                                          USE_QK_L2NORM, FUSED_GATING, PREC, SERIES_FROM)
    frow = tl.load(target_entry + tl.program_id(1) // HV).to(tl.int64) * SLAB_LEN
    _store_round(o, slab_z, slab_k, slab_g, k, b_ot, b_zt, g_cum, r_k, bos, frow, length, i_v, i_hv, i_h,
                 HK, HV, K, V, BV, BK, BU)


@triton.jit
def _commit_slice(h, pending_entry, pending_m, slab_z, slab_k, slab_g, i_v, i_hv, i_h,
                  HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BV: tl.constexpr, SLAB_LEN: tl.constexpr):
    """``(S_m, commit)``: the register slice ``h`` ``[BV, K]`` of ``S_0`` advanced through the
    program's pending round (Eq. 7, fp32 FMAs; ``h`` itself without one). The ``SLAB_LEN`` terms are
    unrolled, those past ``m`` masked, so their loads are all issued at once rather than one
    dependent load per token."""
    commit, prow, m, g_m = _pending_round(pending_entry, pending_m, slab_g, HV, SLAB_LEN)
    o_v = i_v * BV + tl.arange(0, BV)
    h = h * tl.exp(g_m)
    for j in tl.static_range(SLAB_LEN):
        live = j < m
        row = prow + j
        w = tl.where(live, tl.exp(g_m - tl.load(slab_g + row * HV + i_hv, mask=live, other=0.0)), 0.0)
        b_z = tl.load(slab_z + (row * HV + i_hv) * V + o_v, mask=(o_v < V) & live, other=0.0)
        b_k = tl.load(slab_k + (row * HK + i_h) * K + tl.arange(0, K), mask=live, other=0.0)
        h += (w * b_z)[:, None] * b_k[None, :]
    return h, commit


@triton.jit
def gdn_commit_verify_recurrent_kernel(
    q, k, v, g_or_a, beta_or_b, A_log, dt_bias,  # as for gdn_commit_verify_kernel
    state, state_indices, cu_seqlens,
    o, slab_z, slab_k, slab_g, pending_entry, pending_m, target_entry,
    scale, stride_state_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, U: tl.constexpr, BU: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr, SLAB_LEN: tl.constexpr,
):
    """:func:`verify.gdn_verify_recurrent_kernel` with the pending commit applied first to the
    program's ``[BV, K]`` register slice of the state, which is stored once and then stepped through
    the new round."""
    i_v, i_hv, i_h, bos, length, slot = _program_round(cu_seqlens, state_indices, HK, HV)
    if (length <= 0) | (slot <= 0):
        return

    o_v = i_v * BV + tl.arange(0, BV)
    p_h = state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K + tl.arange(0, K)[None, :]
    h, commit = _commit_slice(tl.load(p_h, mask=(o_v < V)[:, None], other=0.0), pending_entry, pending_m,
                              slab_z, slab_k, slab_g, i_v, i_hv, i_h, HK, HV, K, V, BV, SLAB_LEN)
    tl.store(p_h, h, mask=(o_v < V)[:, None] & commit)  # [BV, K] of S_m, written once
    acc_o, acc_z, acc_g, acc_rk = _recurrent_steps(h, q, k, v, g_or_a, beta_or_b, A_log, dt_bias, bos, length,
                                                   i_v, i_hv, i_h, scale, HK, HV, K, V, BV, U, BU,
                                                   USE_QK_L2NORM, FUSED_GATING)
    frow = tl.load(target_entry + tl.program_id(1) // HV).to(tl.int64) * SLAB_LEN
    _store_round(o, slab_z, slab_k, slab_g, k, acc_o, acc_z, acc_g, acc_rk, bos, frow, length, i_v, i_hv,
                 i_h, HK, HV, K, V, BV, K, BU)


def _check_slabs(slabs: VerifyFactors, slab_len, max_len, HK, HV, K, V, N, entries):
    if not 1 <= slab_len <= MAX_VERIFY_LEN:
        raise ValueError(f"slab_len must be in 1..{MAX_VERIFY_LEN}, got {slab_len}")
    if max_len > slab_len:
        raise ValueError(f"a round of max_len={max_len} tokens does not fit an entry of "
                         f"slab_len={slab_len} rows; slab_len must be >= max_len")
    rows = slabs.z.shape[0]
    if rows == 0 or rows % slab_len:
        raise ValueError(f"slabs must hold E * slab_len rows for some E >= 1; got {rows} rows "
                         f"with slab_len={slab_len}")
    for name, t, shape in (("z", slabs.z, (rows, HV, V)), ("k", slabs.k, (rows, HK, K)),
                           ("g_cum", slabs.g_cum, (rows, HV))):
        if tuple(t.shape) != shape:
            raise ValueError(f"slabs.{name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"slabs.{name} must be contiguous fp32, got {t.dtype}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    for name, t in entries.items():
        if t.shape != (N,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 (or int64) tensor of shape [N={N}], one entry "
                             f"per sequence like state_indices; "
                             f"got {t.dtype} of shape {list(t.shape)}")


def gdn_commit_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
    slabs: VerifyFactors, slab_len: int,
    pending_entry: torch.Tensor, pending_m: torch.Tensor, target_entry: torch.Tensor,
    scale: float | None = None, use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None, method: str = "auto",
    BV: int | None = None, BK: int | None = None, num_warps: int | None = None, precision: str = "auto",
    series_from: int = SERIES_FROM, commit_precision: str = "tf32x3",
) -> torch.Tensor:
    """Commit each sequence's pending round into its state, then verify its new round from it.

    Per sequence ``i`` with slot ``state_indices[i] > 0`` and at least one token: if
    ``pending_entry[i] >= 0`` and ``pending_m[i] > 0``, ``S = e^{G_m} S_0 + Z_{1:m}^T
    diag(e^{G_m - G_{1:m}}) K_{1:m}`` (Eq. 7) with the factors in that entry's rows and
    ``m = pending_m[i]``, and ``state[slot] = S``; then the tokens of ``cu_seqlens[i] ..
    cu_seqlens[i + 1]`` are verified from ``S`` exactly as :func:`gdn_verify` does (Eqs. 3 and 10),
    their outputs written to ``out`` and their compact factors to rows ``target_entry[i] * slab_len
    + t`` of ``slabs``. Sequences with slot ``<= 0`` or no tokens read and write nothing (their
    pending round is not applied either, so it must stay in its entry until a later launch).

    Contract (not checked: checking it would need a device-to-host read, and this function must
    stay CUDA-graph capturable): no target entry of a sequence that runs is also a pending entry
    read in the same launch, nor another running sequence's target (double-buffer the entries), so
    reading pending rows and writing target rows in one launch is race-free; slots are distinct;
    every length is ``<= max_len``; ``pending_m[i]`` does not exceed the length of the round
    stored in its entry (the kernels clamp it to ``slab_len`` and treat negative counts as 0).

    Args:
        q, k: ``[T, HK, K]`` and v: ``[T, HV, V]`` (any float dtype, raw as for :func:`gdn_verify`).
        g, beta: ``[T, HV]``; or the raw gate inputs ``a``, ``b`` with ``A_log`` and ``dt_bias``
            ``[HV]`` (fused gating, as :func:`gdn_verify`).
        state: fp32 pool ``[slots, HV, V, K]``; committed states are written in place.
        state_indices: ``[N]`` int32 slots (``<= 0``: padding, skipped).
        cu_seqlens: ``[N + 1]`` int32 token offsets; max_len: the compile-time round length ``U``
            (1..16, ``<= slab_len``).
        slabs: :class:`VerifyFactors` of ``[E * slab_len, ...]`` fp32 rows (``z`` ``[E * slab_len, HV,
            V]``, ``k`` ``[E * slab_len, HK, K]``, ``g_cum`` ``[E * slab_len, HV]``); entry ``e`` holds
            one round in rows ``e * slab_len ..``. slab_len: rows per entry (1..16).
        pending_entry: ``[N]`` int32 entry of sequence ``i``'s previous round, or -1 for none.
        pending_m: ``[N]`` int32 tokens of that round to commit (0 = nothing to apply).
        target_entry: ``[N]`` int32 entry this round's factors are written to.
        scale, use_qk_l2norm, out, method, BV, BK, num_warps, precision, series_from: as for
            :func:`gdn_verify` ("auto" picks the method as it does).
        commit_precision: ``tl.dot`` input precision of the chunkwise kernel's commit product, as
            ``precision`` of :func:`gdn_commit` ("tf32x3", "ieee" or "tf32"); the recurrent kernel
            commits with fp32 FMAs.
    Returns:
        ``out``: ``[T, HV, V]`` in ``v.dtype``; rows of skipped sequences are left untouched.
    """
    _check_shapes(q, k, v, state, cu_seqlens, state_indices, max_len)
    _, HK, K = k.shape
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    _check_slabs(slabs, slab_len, max_len, HK, HV, K, V, N, dict(
        pending_entry=pending_entry, pending_m=pending_m, target_entry=target_entry))
    if commit_precision not in ("tf32x3", "ieee", "tf32"):
        raise ValueError(f"commit_precision must be 'tf32x3', 'ieee' or 'tf32', got {commit_precision!r}")
    inputs, fused = _round_inputs(q, k, v, g, beta, A_log, dt_bias)
    if out is None:
        out = torch.empty_like(v)
    if method == "auto":
        method = "recurrent" if max_len <= recurrent_up_to(N) else "chunk"
    if method == "chunk":
        # the commit inside the key-chunk loop wants half the value rows per program of the plain verify,
        # with 4 warps for one sequence and 2 from four on (`hybridspec kernels fused --tune`;
        # docs/benchmarks/choices.md)
        BV = BV or FUSED_CHUNK_BV
        num_warps = num_warps or (4 if N == 1 else 2)
    method, launch = _launch_config(q.dtype, N, K, V, max_len, method, BV, BK, num_warps, precision,
                                    series_from)
    if method == "recurrent":
        kernel = gdn_commit_verify_recurrent_kernel
    else:
        kernel, launch = gdn_commit_verify_kernel, dict(launch, COMMIT_PREC=commit_precision)
    kernel[(triton.cdiv(V, launch["BV"]), N * HV)](
        *inputs, state, state_indices, cu_seqlens, out, slabs.z, slabs.k, slabs.g_cum,
        pending_entry, pending_m, target_entry, K ** -0.5 if scale is None else scale, state.stride(0),
        HK=HK, HV=HV, K=K, V=V, USE_QK_L2NORM=use_qk_l2norm, FUSED_GATING=fused, SLAB_LEN=slab_len,
        **launch)
    return out
