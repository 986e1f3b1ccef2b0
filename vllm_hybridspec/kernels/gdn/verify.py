"""Block-parallel GDN verification: all tokens of a round from ``S_0``, no per-token state.

HybridSpec paper, "Parallel GDN verification and accepted-state reconstruction" and the appendix
paragraph "Triangular solve for short inputs".  The torch reference is
:func:`vllm_hybridspec.kernels.gdn.naive.chunk_verify`; the conventions are in ``naive.py``.

One program handles one (sequence, value head, block of ``BV`` value rows).  It reads its slice of
``S_0`` once, inverts the ``u x u`` unit lower-triangular matrix of Eq. 3 and writes the outputs and
the compact factors ``(z, k, G)``.  Two exact inversions are available, chosen per round length:
row-by-row substitution (``u - 1`` cheap steps on registers) and the product series
``H^{-1} = (I + X + X^2 + X^3)(I + X^4 + X^8 + X^12)`` (``X = I - H`` is nilpotent for ``u <= 16``;
five matrix products deep).  The maximal round length ``U`` is a compile-time constant, so every
length 2..16 gets its own specialisation and short rounds skip the work they do not need.

A second kernel, :func:`gdn_verify_recurrent_kernel`, gives the same outputs and factors by stepping
the recurrence on a register copy of the program's slice of ``S_0`` (read once, never written; no
per-token state reaches memory). Its dependent chain is ``u`` short steps instead of the solve's
matrix products, which wins for short rounds; ``gdn_verify(method="auto")`` picks by round length
and batch (``RECURRENT_UP_TO``, set from the H200 measurements in docs/benchmarks/gdn_kernels.md).
Both kernels are assembled from the program building blocks in ``tiles.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tiles import _chunk_products, _chunk_solve, _program_round, _recurrent_steps, _store_round

MAX_VERIFY_LEN = 16
# "auto" steps rounds of at most RECURRENT_UP_TO[n] tokens through the recurrence on registers
# (gdn_verify_recurrent_kernel), n the largest key <= the number of sequences, and solves longer ones
# chunkwise (gdn_verify_kernel): the recurrence wins short rounds of few sequences, its lead shrinking
# with more sequences, so from five sequences on only one-token rounds use it (the measurements of this
# and the constants below: docs/benchmarks/choices.md). (Per-layer CUDA graphs, gdn_graphs.py, verify
# with U = K + 1 and so run chunkwise.)
RECURRENT_UP_TO = {1: 4, 2: 2, 5: 1}
# launch defaults of each method (value rows per program, warps); recurrent: the fastest candidate of a
# launch sweep over round lengths and one and four sequences
LAUNCH_DEFAULTS = {"chunk": {"BV": 64, "num_warps": 4}, "recurrent": {"BV": 8, "num_warps": 1}}
# a single sequence verifies recurrently with BV = 4: twice the programs fill more of the device
RECURRENT_BV_ONE_SEQ = 4
# the chunkwise inverse uses the product series from this round length on, where it is the faster one
SERIES_FROM = 9
# tl.dot input precisions of the chunkwise verify (``precision`` of gdn_verify)
PRECISIONS = ("auto", "tf32", "tf32x3", "ieee")


def recurrent_up_to(num_seqs: int) -> int:
    """The longest round ``method="auto"`` verifies with the recurrent kernel for ``num_seqs`` sequences."""
    keys = [n for n in RECURRENT_UP_TO if n <= num_seqs]
    return RECURRENT_UP_TO[max(keys)] if keys else RECURRENT_UP_TO[min(RECURRENT_UP_TO)]


@triton.jit
def gdn_verify_kernel(
    q, k, v,  # [T, HK, K], [T, HK, K], [T, HV, V]
    g_or_a, beta_or_b,  # [T, HV]: (g, beta), or the raw gate inputs (a, b) when FUSED_GATING
    A_log, dt_bias,  # [HV], only read when FUSED_GATING
    state, state_indices,  # pool [slots, HV, V, K]; [N] slot per sequence (<= 0: skipped)
    cu_seqlens,  # [N + 1]
    o, z_out, k_out, g_out,  # [T, HV, V]; [T, HV, V] fp32; [T, HK, K] fp32; [T, HV] fp32
    scale,
    stride_state_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, U: tl.constexpr, BU: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr, PREC: tl.constexpr,
    SERIES_FROM: tl.constexpr,  # rounds of U >= SERIES_FROM use the product series
):
    """Eqs. 3 and 10 on transposed tiles: the state's value rows (``BV``) lead the big products.
    The key dimension is walked in chunks of ``BK`` (``S_0`` read once, no whole fp32 state slice in
    registers)."""
    i_v, i_hv, i_h, bos, length, slot = _program_round(cu_seqlens, state_indices, HK, HV)
    if (length <= 0) | (slot <= 0):
        return

    o_v = i_v * BV + tl.arange(0, BV)
    p_h = state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K
    ss_kq = tl.zeros([2 * BU], dtype=tl.float32)
    ss_k = tl.zeros([BU], dtype=tl.float32)
    s_kq = tl.zeros([BV, 2 * BU], dtype=tl.float32)
    k_kq = tl.zeros([BU, 2 * BU], dtype=tl.float32)
    for kc in tl.static_range(0, K, BK):
        # [BV, BK] of S_0
        h_c = tl.load(p_h + kc + tl.arange(0, BK)[None, :], mask=(o_v < V)[:, None], other=0.0)
        ss_kq, ss_k, s_kq, k_kq = _chunk_products(q, k, h_c, kc, bos, length, i_h, ss_kq, ss_k, s_kq, k_kq,
                                                  HK, K, BK, BU, PREC)
    b_ot, b_zt, g_cum, r_k = _chunk_solve(v, g_or_a, beta_or_b, A_log, dt_bias, bos, length, i_v, i_hv,
                                          ss_kq, ss_k, s_kq, k_kq, scale, HV, V, BV, U, BU,
                                          USE_QK_L2NORM, FUSED_GATING, PREC, SERIES_FROM)
    _store_round(o, z_out, k_out, g_out, k, b_ot, b_zt, g_cum, r_k, bos, bos, length, i_v, i_hv, i_h,
                 HK, HV, K, V, BV, BK, BU)


@triton.jit
def gdn_verify_recurrent_kernel(
    q, k, v, g_or_a, beta_or_b, A_log, dt_bias, state, state_indices, cu_seqlens,
    o, z_out, k_out, g_out,
    scale,
    stride_state_slot,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, U: tl.constexpr, BU: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, FUSED_GATING: tl.constexpr,
):
    """The same outputs and compact factors as :func:`gdn_verify_kernel`, by stepping the recurrence
    (Eq. 1) through the round on a register copy of the program's ``[BV, K]`` slice of ``S_0``.

    For short rounds this is a shorter dependent chain than the triangular solve. Nothing about the
    round is kept but what verification keeps anyway: ``S_0`` is read once and not written, no
    per-token state reaches memory, and ``z_i = beta_i (v_i - alpha_i S_{i-1} k_i)`` are exactly the
    compact factors the commit folds in. The steps of one program are sequential; all sequences,
    heads and value blocks still run in parallel."""
    i_v, i_hv, i_h, bos, length, slot = _program_round(cu_seqlens, state_indices, HK, HV)
    if (length <= 0) | (slot <= 0):
        return

    o_v = i_v * BV + tl.arange(0, BV)
    h = tl.load(state + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K + tl.arange(0, K)[None, :],
                mask=(o_v < V)[:, None], other=0.0)  # [BV, K] fp32 of S_0
    acc_o, acc_z, acc_g, acc_rk = _recurrent_steps(h, q, k, v, g_or_a, beta_or_b, A_log, dt_bias, bos, length,
                                                   i_v, i_hv, i_h, scale, HK, HV, K, V, BV, U, BU,
                                                   USE_QK_L2NORM, FUSED_GATING)
    _store_round(o, z_out, k_out, g_out, k, acc_o, acc_z, acc_g, acc_rk, bos, bos, length, i_v, i_hv, i_h,
                 HK, HV, K, V, BV, K, BU)


@dataclass
class VerifyFactors:
    """Compact factors of one layer's round for a batch (flattened tokens, as ``cu_seqlens``).

    z: ``[T, HV, V]`` fp32; k: ``[T, HK, K]`` fp32 (normalised); g_cum: ``[T, HV]`` fp32.
    """

    z: torch.Tensor
    k: torch.Tensor
    g_cum: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, HK: int, HV: int, K: int, V: int, device,
              num_layers: int | None = None) -> "VerifyFactors":
        """Allocate factor buffers; with ``num_layers`` they get a leading layer dimension."""
        lead = () if num_layers is None else (num_layers,)
        f32 = torch.float32
        return cls(z=torch.empty(*lead, num_tokens, HV, V, dtype=f32, device=device),
                   k=torch.empty(*lead, num_tokens, HK, K, dtype=f32, device=device),
                   g_cum=torch.empty(*lead, num_tokens, HV, dtype=f32, device=device))

    def layer(self, i: int) -> "VerifyFactors":
        return VerifyFactors(self.z[i], self.k[i], self.g_cum[i])


def _check_shapes(q, k, v, state, cu_seqlens, state_indices, max_len):
    if q.shape != k.shape or q.ndim != 3:
        raise ValueError(f"q and k must both be [T, HK, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    T, HK, K = k.shape
    if v.ndim != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T={T}, HV, V]; got {tuple(v.shape)}")
    HV, V = v.shape[1:]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if K & (K - 1) or K < 16:
        raise ValueError(f"key head dim must be a power of two >= 16, got {K}")
    if state.ndim != 4 or tuple(state.shape[1:]) != (HV, V, K):
        raise ValueError(f"state pool must be [slots, HV={HV}, V={V}, K={K}]; got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"state pool must be fp32, got {state.dtype}")
    if state.stride()[1:] != (V * K, K, 1):
        raise ValueError("each state slot must be contiguous [HV, V, K]")
    if not 1 <= max_len <= MAX_VERIFY_LEN:
        raise ValueError(f"max_len must be in 1..{MAX_VERIFY_LEN}, got {max_len}")
    if cu_seqlens.shape[0] != state_indices.shape[0] + 1:
        raise ValueError(f"cu_seqlens has {cu_seqlens.shape[0]} entries, expected "
                         f"len(state_indices) + 1 = {state_indices.shape[0] + 1}")


def _round_inputs(q, k, v, g, beta, A_log, dt_bias) -> tuple[tuple, bool]:
    """The kernels' leading arguments ``(q, k, v, g_or_a, beta_or_b, A_log, dt_bias)`` and whether
    the gates are computed in the kernel (fused gating)."""
    fused = A_log is not None
    if fused != (dt_bias is not None):
        raise ValueError("A_log and dt_bias must be given together (fused gating) or not at all")
    # without fused gating the kernels never read A_log and dt_bias; any tensor fills their places
    return (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            A_log if fused else g, dt_bias if fused else g), fused


def _launch_config(dtype, N, K, V, max_len, method, BV, BK, num_warps, precision, series_from
                   ) -> tuple[str, dict]:
    """The method ("auto" resolved) and its kernel's launch keywords, defaults filled in (the
    arguments as :func:`gdn_verify` documents them; ``dtype`` is q's)."""
    if method == "auto":
        method = "recurrent" if max_len <= recurrent_up_to(N) else "chunk"
    if method not in LAUNCH_DEFAULTS:
        raise ValueError(f"method must be 'chunk', 'recurrent' or 'auto', got {method!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if BV is None:
        BV = RECURRENT_BV_ONE_SEQ if method == "recurrent" and N == 1 else LAUNCH_DEFAULTS[method]["BV"]
    launch = dict(BV=min(BV, triton.next_power_of_2(V)), U=max_len,
                  num_warps=num_warps or LAUNCH_DEFAULTS[method]["num_warps"])
    if method == "recurrent":
        return method, dict(launch, BU=max(2, triton.next_power_of_2(max_len)))
    if precision == "auto":
        precision = "tf32x3" if dtype == torch.float32 else "tf32"
    if BK is None:
        BK = 128 if precision == "tf32" else 64
    return method, dict(launch, BK=min(BK, K), BU=MAX_VERIFY_LEN, PREC=precision, SERIES_FROM=series_from)


def gdn_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
    scale: float | None = None, use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None, factors: VerifyFactors | None = None,
    BV: int | None = None, BK: int | None = None, num_warps: int | None = None, precision: str = "auto",
    series_from: int = SERIES_FROM, method: str = "auto",
) -> tuple[torch.Tensor, VerifyFactors]:
    """Verify a batch of rounds in parallel, reading each sequence's ``S_0`` from the state pool.

    Args:
        q, k: ``[T, HK, K]`` and v: ``[T, HV, V]`` for all sequences' tokens, flattened
            (any float dtype; raw, i.e. before the L2 norm when ``use_qk_l2norm``).
        g, beta: ``[T, HV]`` log decay and writing strength; or, when ``A_log`` and ``dt_bias``
            (``[HV]``) are given, the raw gate inputs ``a`` and ``b`` of the Qwen layer, and the
            gates are computed in the kernel as :func:`naive.gdn_gating` does.
        state: fp32 state pool ``[slots, HV, V, K]``; it is only read.
        state_indices: ``[N]`` int slot of each sequence; slots ``<= 0`` (vLLM's null block and
            padding) are skipped and their outputs left untouched.
        cu_seqlens: ``[N + 1]`` int token offsets; every length must be ``<= max_len``.
        max_len: the compile-time round length ``U`` (1..16).
        out, factors: optional preallocated outputs (for CUDA graphs).
        BV, BK, num_warps, precision: launch tuning (value rows per program, key chunk, warps, ``tl.dot``
            input precision: "tf32x3", about fp32 accuracy on tensor cores; "tf32", one pass;
            "ieee"; or "auto": "tf32x3" for fp32 inputs and "tf32" for bf16/fp16 inputs, whose
            errors then stay within bf16's own (measured on the H200: 2e-3 relative for outputs,
            4e-4 for states, against 1.7e-3 from rounding the output to bf16 alone).  ``BK``
            defaults to 128 with "tf32" and 64 otherwise; these defaults were the fastest on the
            H200 (docs/benchmarks/gdn_kernels.md).
            ``series_from``: the round length from which the triangular inverse uses the product
            series instead of substitution (:data:`SERIES_FROM`, as measured on the H200).
            ``BV`` and ``num_warps`` default per method (:data:`LAUNCH_DEFAULTS`); ``BK``,
            ``precision`` and ``series_from`` only concern "chunk".
        method: "chunk" (the triangular solve of Eq. 3 over the whole round, all tokens in one set of
            matrix products), "recurrent" (:func:`gdn_verify_recurrent_kernel`: the recurrence stepped
            on a register copy of ``S_0``; the same outputs and factors, exact to fp32 rounding) or
            "auto": "recurrent" for ``max_len <= recurrent_up_to(N)``, else "chunk".
    Returns:
        ``(o, factors)``: ``o`` ``[T, HV, V]`` in ``v.dtype`` and the round's :class:`VerifyFactors`.
    """
    _check_shapes(q, k, v, state, cu_seqlens, state_indices, max_len)
    T, HK, K = k.shape
    HV, V = v.shape[1:]
    N = state_indices.shape[0]
    inputs, fused = _round_inputs(q, k, v, g, beta, A_log, dt_bias)
    if out is None:
        out = torch.empty_like(v)
    if factors is None:
        factors = VerifyFactors.empty(T, HK, HV, K, V, v.device)
    method, launch = _launch_config(q.dtype, N, K, V, max_len, method, BV, BK, num_warps, precision,
                                    series_from)
    kernel = gdn_verify_recurrent_kernel if method == "recurrent" else gdn_verify_kernel
    kernel[(triton.cdiv(V, launch["BV"]), N * HV)](
        *inputs, state, state_indices, cu_seqlens, out, factors.z, factors.k, factors.g_cum,
        K ** -0.5 if scale is None else scale, state.stride(0),
        HK=HK, HV=HV, K=K, V=V, USE_QK_L2NORM=use_qk_l2norm, FUSED_GATING=fused, **launch)
    return out, factors
