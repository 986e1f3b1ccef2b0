"""One-launch commit: rebuild the accepted state of every GDN layer from its compact factors.

HybridSpec paper, Eq. 7 ("Parallel GDN verification and accepted-state reconstruction"):
``S_m = e^{G_m} S_0 + Z_{1:m}^T diag(e^{G_m - G_{1:m}}) K_{1:m}``, written in place over ``S_0`` in
each sequence's state slot.  The grid covers (value-row blocks, sequences x value heads, layers),
so the states of all layers are rebuilt in a single launch; accumulation is fp32.
The torch reference is :func:`vllm_hybridspec.kernels.gdn.naive.reconstruct_state`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .verify import MAX_VERIFY_LEN, VerifyFactors


@triton.jit
def gdn_commit_kernel(
    state_ptrs,  # [L] int64 data pointers of the layers' fp32 state pools [slots, HV, V, K]
    z, k, g_cum,  # [L, T, HV, V], [L, T, HK, K], [L, T, HV] fp32 factors
    cu_seqlens, state_indices, num_commit,  # [N + 1], [N], [N] (m = accepted + 1)
    stride_state_slot, stride_z_layer, stride_k_layer, stride_g_layer,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, BU: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_nh, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    m = tl.load(num_commit + i_n).to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    if (m <= 0) | (slot <= 0):
        return

    o_t = tl.arange(0, BU)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < m
    m_v = o_v < V
    tok = bos + o_t

    p_g = g_cum + i_l * stride_g_layer
    b_g = tl.load(p_g + tok * HV + i_hv, mask=m_t, other=0.0)
    g_m = tl.load(p_g + (bos + m - 1) * HV + i_hv)
    w = tl.where(m_t, tl.exp(tl.where(m_t, g_m - b_g, 0.0)), 0.0)  # [BU]

    b_z = tl.load(z + i_l * stride_z_layer + (tok[:, None] * HV + i_hv) * V + o_v[None, :],
                  mask=m_t[:, None] & m_v[None, :], other=0.0)  # [BU, BV]
    zw_t = tl.trans(b_z * w[:, None])  # [BV, BU]
    e_m = tl.exp(g_m)
    base = tl.load(state_ptrs + i_l).to(tl.pointer_type(tl.float32))
    p_h = base + slot * stride_state_slot + i_hv * V * K + o_v[:, None] * K
    p_k = k + i_l * stride_k_layer + (tok[:, None] * HK + i_h) * K
    for kc in tl.static_range(0, K, BK):
        o_k = kc + tl.arange(0, BK)
        b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BU, BK]
        b_h = tl.load(p_h + o_k[None, :], mask=m_v[:, None], other=0.0)  # [BV, BK]
        b_h = e_m * b_h + tl.dot(zw_t, b_k, input_precision=PREC)
        tl.store(p_h + o_k[None, :], b_h, mask=m_v[:, None])


class StatePointers:
    """The data pointers of a fixed list of per-layer state pools, built once for many launches.

    All pools must share shape ``[slots, HV, V, K]``, dtype fp32 and strides (vLLM gives every GDN
    layer its own pool tensor of the same layout).
    """

    def __init__(self, states: Sequence[torch.Tensor]):
        if len(states) == 0:
            raise ValueError("need at least one layer's state pool")
        first = states[0]
        for i, s in enumerate(states):
            if s.dtype != torch.float32:
                raise ValueError(f"state pool of layer {i} must be fp32, got {s.dtype}")
            if s.shape != first.shape or s.stride() != first.stride():
                raise ValueError(f"state pool of layer {i} has shape {tuple(s.shape)} / stride "
                                 f"{s.stride()}, layer 0 has {tuple(first.shape)} / {first.stride()}")
            if s.stride()[1:] != (s.shape[2] * s.shape[3], s.shape[3], 1):
                raise ValueError(f"each state slot of layer {i} must be contiguous [HV, V, K]")
        self.states = list(states)
        self.shape = tuple(first.shape)
        self.stride_slot = first.stride(0)
        ptrs = torch.tensor([s.data_ptr() for s in states], dtype=torch.int64)
        # torch.tensor(..., device="cuda") would copy from pageable memory and wait for the stream
        # (a host sync per build, i.e. per commit launch when built inside gdn_commit); a pinned
        # buffer copied with non_blocking does not, and the copy stays ordered before the launch
        self.ptrs = (ptrs.pin_memory().to(first.device, non_blocking=True) if first.is_cuda
                     else ptrs.to(first.device))


def gdn_commit(
    states: StatePointers | Sequence[torch.Tensor],
    factors: VerifyFactors,
    cu_seqlens: torch.Tensor, state_indices: torch.Tensor, num_commit: torch.Tensor,
    BV: int = 32, BK: int = 64, num_warps: int = 2, precision: str = "tf32x3",
) -> None:
    """Advance every layer's state of every sequence through its ``m`` committed tokens, in place.

    Args:
        states: the per-layer fp32 state pools ``[slots, HV, V, K]`` (or a prebuilt
            :class:`StatePointers`); layer ``l`` pairs with ``factors.*[l]``.
        factors: :class:`VerifyFactors` with a leading layer dimension ``[L, T, ...]``, as filled
            by :func:`gdn_verify` for each layer of the round.
        cu_seqlens: ``[N + 1]`` token offsets of the verified round (the same as for verify).
        state_indices: ``[N]`` slots (``<= 0`` skipped).
        num_commit: ``[N]`` committed tokens ``m`` per sequence (accepted + 1; ``0`` leaves the
            state unchanged); must not exceed the sequence's verified length.
        BV, BK, num_warps, precision: launch tuning. ``precision`` is the ``tl.dot`` input precision
            of the update ``sum_i w_i z_i k_i^T``: "tf32x3" (the default: fp32 accuracy from three
            tensor-core passes), "ieee" (fp32 FMA, no tensor cores) or "tf32" (one pass, about 1e-3
            relative error in the update). "tf32x3" costs what "tf32" costs, "ieee" a third more
            (docs/benchmarks/choices.md).
    """
    if precision not in ("tf32x3", "ieee", "tf32"):
        raise ValueError(f"precision must be 'tf32x3', 'ieee' or 'tf32', got {precision!r}")
    if not isinstance(states, StatePointers):
        states = StatePointers(states)
    L = len(states.states)
    if factors.z.ndim != 4 or factors.z.shape[0] != L:
        raise ValueError(f"factors must be stacked over {L} layers as [L, T, HV, V]; "
                         f"got z of shape {tuple(factors.z.shape)}")
    _, HV, V, K = states.shape
    HK = factors.k.shape[2]
    N = state_indices.shape[0]
    if num_commit.shape[0] != N or cu_seqlens.shape[0] != N + 1:
        raise ValueError(f"num_commit ({num_commit.shape[0]}) and cu_seqlens ({cu_seqlens.shape[0]})"
                         f" must have N={N} and N+1 entries")
    for name, t in (("z", factors.z), ("k", factors.k), ("g_cum", factors.g_cum)):
        if not t.is_contiguous():
            raise ValueError(f"factors.{name} must be contiguous")
    BV = min(BV, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), N * HV, L)
    gdn_commit_kernel[grid](
        states.ptrs, factors.z, factors.k, factors.g_cum,
        cu_seqlens, state_indices, num_commit,
        states.stride_slot, factors.z.stride(0), factors.k.stride(0), factors.g_cum.stride(0),
        HK=HK, HV=HV, K=K, V=V, BV=BV, BK=min(BK, K), BU=MAX_VERIFY_LEN, PREC=precision,
        num_warps=num_warps,
    )
