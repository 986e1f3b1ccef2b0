"""Triton building blocks of one GDN verification program, shared by the kernels of ``verify.py``
(verify from ``S_0``) and ``fused.py`` (advance ``S_0`` by the previous round's commit, then verify).

A program handles one (sequence, value head, block of ``BV`` value rows) of a round of at most ``U``
tokens; tiles are transposed, value rows first. HybridSpec paper, "Parallel GDN verification and
accepted-state reconstruction" (Eqs. 1, 3 and 10) and the appendix paragraph "Triangular solve for
short inputs"; the conventions are in ``naive.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _inverse_unit_lower_series(X, I, U: tl.constexpr, PREC: tl.constexpr):
    """``(I - X)^{-1}`` for strictly lower-triangular ``X`` of size ``BU``, nonzero in ``U`` rows."""
    inv = I + X
    if U > 2:
        X2 = tl.dot(X, X, input_precision=PREC)
        inv += X2
        if U > 3:
            inv += tl.dot(X2, X, input_precision=PREC)
            if U > 4:
                X4 = tl.dot(X2, X2, input_precision=PREC)
                tail = I + X4
                if U > 8:
                    X8 = tl.dot(X4, X4, input_precision=PREC)
                    tail += X8
                    if U > 12:
                        tail += tl.dot(X8, X4, input_precision=PREC)
                inv = tl.dot(inv, tail, input_precision=PREC)
    return inv


@triton.jit
def _inverse_unit_lower_rows(X, I, rows, U: tl.constexpr):
    """Same inverse by substitution: row ``i`` of ``A = (I - X)^{-1}`` is ``e_i + X[i, :i] A[:i]``."""
    XT = tl.trans(X)  # column i of XT is row i of X, laid out along dim 0 like A's rows
    A = I
    for i in tl.static_range(1, U):
        x_i = tl.sum(tl.where(rows[None, :] == i, XT, 0.0), axis=1)  # [BU] = X[i, :]
        A += tl.where(rows[:, None] == i, tl.sum(x_i[:, None] * A, axis=0)[None, :], 0.0)
    return A


@triton.jit
def _program_round(cu_seqlens, state_indices, HK: tl.constexpr, HV: tl.constexpr):
    """This program's value block, value head, key head, and its sequence's first token, length
    and state slot (grid: value blocks x sequences * value heads)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    slot = tl.load(state_indices + i_n).to(tl.int64)
    return i_v, i_hv, i_hv // (HV // HK), bos, length, slot


@triton.jit
def _gates(g_or_a, beta_or_b, A_log, dt_bias, idx, mask, i_hv, FUSED_GATING: tl.constexpr):
    """``(g, beta)`` in fp32 at ``idx`` (0 where ``mask`` is off): loaded, or computed from the Qwen
    layer's raw ``a``, ``b`` as :func:`naive.gdn_gating` does."""
    if FUSED_GATING:
        x = tl.load(g_or_a + idx, mask=mask, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
        softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)
        b_g = tl.where(mask, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * softplus, 0.0)
        b_beta = tl.where(mask, tl.sigmoid(tl.load(beta_or_b + idx, mask=mask, other=0.0).to(tl.float32)), 0.0)
    else:
        b_g = tl.load(g_or_a + idx, mask=mask, other=0.0).to(tl.float32)
        b_beta = tl.load(beta_or_b + idx, mask=mask, other=0.0).to(tl.float32)
    return b_g, b_beta


@triton.jit
def _chunk_products(q, k, h_c, kc, bos, length, i_h, ss_kq, ss_k, s_kq, k_kq,
                    HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BU: tl.constexpr,
                    PREC: tl.constexpr):
    """Add key chunk ``kc .. kc + BK`` to the round's running products, ``h_c`` ``[BV, BK]`` being
    that chunk of the program's rows of ``S_0``. q and k are interleaved into one ``[2 BU, BK]``
    operand (row ``r``: token ``r // 2``, its key for even ``r``, its query for odd), so a chunk costs
    two matrix products; they use raw q and k, and the L2 norms are applied after the last chunk."""
    o_k = kc + tl.arange(0, BK)
    o_t = tl.arange(0, BU)
    o_r = tl.arange(0, 2 * BU)
    m_r = (o_r // 2) < length
    p_kq = tl.where(o_r % 2 == 0, k, q) + ((bos + o_r // 2) * HK + i_h) * K
    kq_c = tl.load(p_kq[:, None] + o_k[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    k_c = tl.load(k + ((bos + o_t[:, None]) * HK + i_h) * K + o_k[None, :],
                  mask=(o_t < length)[:, None], other=0.0).to(tl.float32)
    ss_kq += tl.sum(kq_c * kq_c, axis=1)
    ss_k += tl.sum(k_c * k_c, axis=1)
    kq_t = tl.trans(kq_c)
    s_kq += tl.dot(h_c, kq_t, input_precision=PREC)  # S_0 [k; q]^T
    k_kq += tl.dot(k_c, kq_t, input_precision=PREC)  # k [k; q]^T
    return ss_kq, ss_k, s_kq, k_kq


@triton.jit
def _chunk_solve(v, g_or_a, beta_or_b, A_log, dt_bias, bos, length, i_v, i_hv, ss_kq, ss_k, s_kq, k_kq,
                 scale, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, U: tl.constexpr,
                 BU: tl.constexpr, USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr,
                 PREC: tl.constexpr, SERIES_FROM: tl.constexpr):
    """Eqs. 3 and 10 on transposed tiles, from the products of :func:`_chunk_products` over all key
    chunks: ``(O^T [BV, BU], Z^T [BV, BU], G [BU], 1 / |k| [BU])``. Rounds of ``U >= SERIES_FROM``
    invert with the product series, shorter ones by substitution."""
    o_t = tl.arange(0, BU)
    o_r = tl.arange(0, 2 * BU)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < length
    tok = bos + o_t
    # [BV, BU]: v transposed
    b_vt = tl.load(v + (tok[None, :] * HV + i_hv) * V + o_v[:, None],
                   mask=m_t[None, :] & (o_v < V)[:, None], other=0.0).to(tl.float32)
    b_g, b_beta = _gates(g_or_a, beta_or_b, A_log, dt_bias, tok * HV + i_hv, m_t, i_hv, FUSED_GATING)
    if USE_QK_L2NORM:
        r_kq = tl.rsqrt(ss_kq + 1e-6)
        r_k = tl.rsqrt(ss_k + 1e-6)
    else:
        r_kq = tl.full([2 * BU], 1.0, dtype=tl.float32)
        r_k = tl.full([BU], 1.0, dtype=tl.float32)
    r_kq = tl.where(o_r % 2 == 0, r_kq, r_kq * scale)
    ks_t, qs_t = tl.split(tl.reshape(s_kq * r_kq[None, :], [BV, BU, 2]))  # [BV, BU] each
    kk, qk_t = tl.split(tl.reshape(k_kq * r_kq[None, :], [BU, BU, 2]))
    kk = kk * r_k[:, None]  # k_i . k_j
    qk_t = qk_t * r_k[:, None]  # [j, i] = k_j . q_i

    g_cum = tl.cumsum(b_g, axis=0)
    e_g = tl.exp(g_cum)
    diff = g_cum[:, None] - g_cum[None, :]  # [a, b] = G_a - G_b
    strict = o_t[:, None] > o_t[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    X = tl.where(strict, -b_beta[:, None] * tl.exp(tl.where(strict, diff, 0.0)) * kk, 0.0)
    if U >= SERIES_FROM:
        h_inv = _inverse_unit_lower_series(X, eye, U, PREC)
    else:
        h_inv = _inverse_unit_lower_rows(X, eye, o_t, U)
    rhs_t = b_beta[None, :] * (b_vt - e_g[None, :] * ks_t)  # [BV, BU]
    b_zt = tl.dot(rhs_t, tl.trans(h_inv), input_precision=PREC)  # Z^T = rhs^T H^-T
    # (Gamma * Q K^T)^T [j, i] = e^{G_i - G_j} k_j . q_i for j <= i
    m_t2 = tl.where(o_t[:, None] <= o_t[None, :],
                    qk_t * tl.exp(tl.where(o_t[:, None] <= o_t[None, :], -diff, 0.0)), 0.0)
    b_ot = e_g[None, :] * qs_t + tl.dot(b_zt, m_t2, input_precision=PREC)
    return b_ot, b_zt, g_cum, r_k


@triton.jit
def _store_round(o, z_out, k_out, g_out, k, b_ot, b_zt, g_cum, r_k, bos, frow, length, i_v, i_hv, i_h,
                 HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, BK: tl.constexpr, BU: tl.constexpr):
    """Store the round's outputs ``O^T`` ``[BV, BU]`` at its tokens ``bos ..`` and its compact factors
    at factor rows ``frow ..``: ``Z^T``, and from the first value block ``G`` and (from the first value
    head of each key head) the keys scaled by ``r_k``, re-read in chunks of ``BK``."""
    o_t = tl.arange(0, BU)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < length
    tok = bos + o_t
    row = frow + o_t
    m_vt = (o_v < V)[:, None] & m_t[None, :]
    tl.store(o + (tok[None, :] * HV + i_hv) * V + o_v[:, None], b_ot.to(o.dtype.element_ty), mask=m_vt)
    tl.store(z_out + (row[None, :] * HV + i_hv) * V + o_v[:, None], b_zt, mask=m_vt)
    if i_v == 0:
        tl.store(g_out + row * HV + i_hv, g_cum, mask=m_t)
        if i_hv % (HV // HK) == 0:
            for kc in tl.static_range(0, K, BK):
                o_k = kc + tl.arange(0, BK)
                k_c = tl.load(k + (tok[:, None] * HK + i_h) * K + o_k[None, :], mask=m_t[:, None],
                              other=0.0).to(tl.float32)
                tl.store(k_out + (row[:, None] * HK + i_h) * K + o_k[None, :], k_c * r_k[:, None],
                         mask=m_t[:, None])


@triton.jit
def _recurrent_steps(h, q, k, v, g_or_a, beta_or_b, A_log, dt_bias, bos, length, i_v, i_hv, i_h, scale,
                     HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BV: tl.constexpr, U: tl.constexpr, BU: tl.constexpr,
                     USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr):
    """Step the recurrence (Eq. 1) through the round on the register slice ``h`` ``[BV, K]`` of the
    state: ``(O^T [BV, BU], Z^T [BV, BU], G [BU], 1 / |k| [BU])``. Outputs and ``z`` are gathered in
    registers, so the loads of every step are free to be issued early. Rows shorter than ``U`` run
    the missing steps with ``alpha = 1, beta = 0`` (a no-op)."""
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BU)
    m_v = o_v < V
    acc_o = tl.zeros([BV, BU], dtype=tl.float32)
    acc_z = tl.zeros([BV, BU], dtype=tl.float32)
    acc_g = tl.zeros([BU], dtype=tl.float32)
    acc_rk = tl.full([BU], 1.0, dtype=tl.float32)
    g_run = 0.0
    for t in tl.static_range(U):
        live = t < length
        tok = bos + t
        b_k = tl.load(k + (tok * HK + i_h) * K + o_k, mask=live, other=0.0).to(tl.float32)
        b_q = tl.load(q + (tok * HK + i_h) * K + o_k, mask=live, other=0.0).to(tl.float32)
        b_v = tl.load(v + (tok * HV + i_hv) * V + o_v, mask=m_v & live, other=0.0).to(tl.float32)
        b_g, b_beta = _gates(g_or_a, beta_or_b, A_log, dt_bias, tok * HV + i_hv, live, i_hv, FUSED_GATING)
        if USE_QK_L2NORM:
            r_k = tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
            b_k = b_k * r_k
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            acc_rk = tl.where(o_t == t, r_k, acc_rk)
        b_q = b_q * scale
        g_run += b_g
        h = h * tl.exp(b_g)
        b_z = b_beta * (b_v - tl.sum(h * b_k[None, :], axis=1))  # [BV]
        h += b_z[:, None] * b_k[None, :]
        b_o = tl.sum(h * b_q[None, :], axis=1)  # [BV]
        here = o_t[None, :] == t
        acc_o = tl.where(here, b_o[:, None], acc_o)
        acc_z = tl.where(here, b_z[:, None], acc_z)
        acc_g = tl.where(o_t == t, g_run, acc_g)
    return acc_o, acc_z, acc_g, acc_rk
