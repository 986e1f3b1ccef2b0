"""Pure-torch references for the gated delta rule as the Qwen GDN layer computes it.

Conventions (shared by the Triton kernels in ``verify.py`` and ``commit.py``):

* ``HK`` key heads, ``HV = G * HK`` value heads; value head ``h`` reads key head ``h // G``.
* ``q, k``: ``[u, HK, K]``; ``v``: ``[u, HV, V]``; ``g`` (per-token log decay, <= 0) and
  ``beta`` (writing strength in (0, 1)): ``[u, HV]``.
* The recurrent state is stored as vLLM stores it: ``[HV, V, K]``, fp32.
* ``q`` and ``k`` are L2-normalised as vLLM's kernels do (``x * rsqrt(sum(x^2) + 1e-6)``);
  the query is then multiplied by ``scale`` (``K ** -0.5`` by default).

Recurrence (HybridSpec paper, "Gated DeltaNet and chunkwise verification", Eq. 1), per head:

    z_i = beta_i * (v_i - alpha_i * S_{i-1} k_i),   S_i = alpha_i * S_{i-1} + z_i k_i^T,
    o_i = S_i (scale * q_i),                        alpha_i = exp(g_i).

With the cumulative log decay ``G_i = sum_{j<=i} g_j`` the state after token ``i`` is
(Eq. 2)  ``S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} z_j k_j^T``, so the *compact factors*
``(z_i, k_i, G_i)`` and ``S_0`` rebuild any ``S_m``.  All ``z`` solve one unit lower-triangular
system (Eq. 3): ``H Z = diag(beta) (V - diag(e^G) K S_0^T)`` with
``H_ij = beta_i e^{G_i - G_j} k_i^T k_j`` for ``j < i``; the outputs are (Eq. 10)
``O = diag(e^G) Q S_0^T + (Gamma * Q K^T) Z`` with ``Gamma_ij = e^{G_i - G_j}`` for ``j <= i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, as vLLM's GDN kernels normalise q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
    softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 gates: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

    Args:
        A_log: ``[HV]``; dt_bias: ``[HV]``; a, b: ``[..., HV]`` (any float dtype).
    Returns:
        ``(g, beta)``, both ``[..., HV]`` fp32 (fp64 if the inputs are fp64).
    """
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    x = a.to(dtype) + dt_bias.to(dtype)
    sp = F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    g = -torch.exp(A_log.to(dtype)) * sp
    beta = torch.sigmoid(b.to(dtype))
    return g, beta


def _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    u, HK, K = k.shape
    HV = v.shape[1]
    if HV % HK != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    dtype = torch.float64 if initial_state.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = K ** -0.5
    group = HV // HK
    # [u, HV, K]: every value head sees its key head
    q = q.repeat_interleave(group, dim=1) * scale
    k = k.repeat_interleave(group, dim=1)
    return q, k, v, g, beta, initial_state.to(dtype), dtype


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (Eq. 1): what a verifier with one state per token computes.

    Args:
        q, k: ``[u, HK, K]``; v: ``[u, HV, V]``; g, beta: ``[u, HV]``;
        initial_state: ``[HV, V, K]`` (fp32, or fp64 for a high-precision reference).
    Returns:
        ``(o, states)``: ``o`` ``[u, HV, V]`` and ``states`` ``[u, HV, V, K]`` (state after each
        token), in the state's precision.
    """
    q, k, v, g, beta, S, dtype = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    outs, states = [], []
    for i in range(k.shape[0]):
        S = S * torch.exp(g[i])[:, None, None]  # [HV, V, K]
        z = beta[i][:, None] * (v[i] - torch.einsum("hvk,hk->hv", S, k[i]))  # [HV, V]
        S = S + z[:, :, None] * k[i][:, None, :]
        outs.append(torch.einsum("hvk,hk->hv", S, q[i]))
        states.append(S)
    return torch.stack(outs), torch.stack(states)


@dataclass
class CompactFactors:
    """What verification keeps of a round instead of per-token states (Eq. 2).

    z: ``[u, HV, V]``; k: ``[u, HK, K]`` (L2-normalised keys); g_cum: ``[u, HV]`` (cumulative
    log decay ``G_i``).  All in the computation's precision (fp32 or fp64).
    """

    z: torch.Tensor
    k: torch.Tensor
    g_cum: torch.Tensor


def chunk_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, CompactFactors]:
    """Verify ``u`` tokens of one sequence in parallel from ``S_0`` (Eqs. 3 and 10).

    Same arguments as :func:`recurrent_gated_delta_rule`.  No intermediate state is formed.

    Returns:
        ``(o, factors)``: ``o`` ``[u, HV, V]`` and the :class:`CompactFactors` of all ``u`` tokens.
    """
    HK = k.shape[1]
    q, k_full, v, g, beta, S0, dtype = _prepare(q, k, v, g, beta, initial_state, scale,
                                                use_qk_l2norm)
    u = k_full.shape[0]
    G = torch.cumsum(g, dim=0).transpose(0, 1)  # [HV, u]
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k_full, v))  # [HV, u, *]
    bh = beta.transpose(0, 1)  # [HV, u]
    diff = G[:, :, None] - G[:, None, :]  # [HV, u(i), u(j)] = G_i - G_j
    causal = torch.ones(u, u, dtype=torch.bool, device=k.device).tril()
    # mask before exp: for j > i the difference is positive and could overflow
    gamma = torch.where(causal, torch.exp(torch.where(causal, diff, torch.zeros_like(diff))),
                        torch.zeros_like(diff))
    strict = torch.ones(u, u, dtype=torch.bool, device=k.device).tril(-1)
    H = torch.eye(u, dtype=dtype, device=k.device) + torch.where(
        strict, bh[:, :, None] * gamma * (kh @ kh.transpose(1, 2)), torch.zeros_like(gamma))
    rhs = bh[:, :, None] * (vh - torch.exp(G)[:, :, None] * (kh @ S0.transpose(1, 2)))
    Z = torch.linalg.solve_triangular(H, rhs, upper=False, unitriangular=True)  # [HV, u, V]
    O = torch.exp(G)[:, :, None] * (qh @ S0.transpose(1, 2)) + (gamma * (qh @ kh.transpose(1, 2))) @ Z
    group = q.shape[1] // HK
    factors = CompactFactors(
        z=Z.transpose(0, 1).contiguous(),
        k=k_full[:, ::group].contiguous(),
        g_cum=G.transpose(0, 1).contiguous(),
    )
    return O.transpose(0, 1).contiguous(), factors


def reconstruct_state(initial_state: torch.Tensor, factors: CompactFactors, m: int) -> torch.Tensor:
    """``S_m`` from ``S_0`` and the factors of tokens ``1..m`` (Eq. 7); ``m = 0`` returns ``S_0``.

    Args:
        initial_state: ``[HV, V, K]``; factors: from :func:`chunk_verify`; m: ``0 <= m <= u``.
    Returns:
        ``[HV, V, K]`` in the factors' precision.
    """
    u = factors.z.shape[0]
    if not 0 <= m <= u:
        raise ValueError(f"m must be in 0..{u} (the verified length), got {m}")
    dtype = factors.z.dtype
    S0 = initial_state.to(dtype)
    if m == 0:
        return S0.clone()
    HV, HK = factors.z.shape[1], factors.k.shape[1]
    G = factors.g_cum[:m]  # [m, HV]
    w = torch.exp(G[m - 1][None, :] - G)  # [m, HV]
    k = factors.k[:m].repeat_interleave(HV // HK, dim=1)  # [m, HV, K]
    return torch.exp(G[m - 1])[:, None, None] * S0 + torch.einsum(
        "jhv,jhk->hvk", factors.z[:m] * w[:, :, None], k)


def commit_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
    slabs: CompactFactors, slab_len: int,
    pending_entry: torch.Tensor, pending_m: torch.Tensor, target_entry: torch.Tensor,
    scale: float | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, CompactFactors]:
    """Lazy commit, then verification, one sequence at a time: what ``fused.gdn_commit_verify`` does.

    Per sequence ``i`` with slot ``state_indices[i] > 0`` and at least one token: when
    ``pending_entry[i] >= 0`` and ``pending_m[i] > 0`` the state advances through the first
    ``pending_m[i]`` tokens of the round stored in that entry (Eq. 7, :func:`reconstruct_state`);
    then the sequence's tokens are verified from it (:func:`chunk_verify`) and their factors
    written to the rows of entry ``target_entry[i]``. Other sequences are skipped.

    Args:
        q, k: ``[T, HK, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]`` (gates, not raw inputs).
        state: pool ``[slots, HV, V, K]`` (fp32, or fp64 for a high-precision reference).
        state_indices: ``[N]`` int slots; cu_seqlens: ``[N + 1]`` int token offsets.
        slabs: :class:`CompactFactors` with ``z`` ``[E * slab_len, HV, V]``, ``k``
            ``[E * slab_len, HK, K]`` and ``g_cum`` ``[E * slab_len, HV]``; entry ``e`` holds a round
            in rows ``e * slab_len ..``.
        pending_entry, pending_m, target_entry: ``[N]`` int (entry of the previous round or -1,
            its committed count ``0..slab_len``, entry for this round's factors).
    Returns:
        ``(o, state, slabs)``: ``o`` ``[T, HV, V]`` (zeros for skipped sequences) and the updated
        copies of the pool and slabs, all in the state's precision; the inputs are not modified.
    """
    dtype = torch.float64 if state.dtype == torch.float64 else torch.float32
    state = state.to(dtype).clone()
    slabs = CompactFactors(*(t.to(dtype).clone() for t in (slabs.z, slabs.k, slabs.g_cum)))
    o = commit_verify_(q, k, v, g, beta, state, state_indices, cu_seqlens, slabs, slab_len, pending_entry,
                       pending_m, target_entry, scale, use_qk_l2norm)
    return o, state, slabs


def commit_verify_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
    slabs: CompactFactors, slab_len: int,
    pending_entry: torch.Tensor, pending_m: torch.Tensor, target_entry: torch.Tensor,
    scale: float | None = None, use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """:func:`commit_verify` in place: ``state`` (any strides, e.g. vLLM's CPU view of its pool) and
    ``slabs`` are updated, and ``o`` ``[T, HV, V]`` in the state's precision is returned. The one-slot
    GDN layer's CPU path. Sequences of one length and one committed count run as one call, their
    heads side by side (:func:`merge_heads`)."""
    dtype = state.dtype
    o = torch.zeros(v.shape, dtype=dtype, device=v.device)
    cu, slots = cu_seqlens.tolist(), state_indices.tolist()
    entries, ms, targets = pending_entry.tolist(), pending_m.tolist(), target_entry.tolist()
    HV = v.shape[1]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(len(slots)):
        if slots[i] > 0 and cu[i + 1] > cu[i]:
            m = ms[i] if entries[i] >= 0 else 0
            groups.setdefault((cu[i + 1] - cu[i], max(m, 0)), []).append(i)
    for (u, m), seqs in groups.items():
        n = len(seqs)
        idx = token_index(cu, seqs, u, v.device)
        slot_t = torch.tensor([slots[i] for i in seqs], device=v.device)
        S = state[slot_t].to(slabs.z.dtype)  # [n, HV, V, K]
        if m > 0:
            rows = token_index([entries[i] * slab_len for i in seqs], range(n), m, v.device)
            factors = CompactFactors(merge_heads(slabs.z, rows), merge_heads(slabs.k, rows),
                                     merge_heads(slabs.g_cum, rows))
            S = reconstruct_state(S.reshape(n * HV, *S.shape[2:]), factors, m).reshape(S.shape)
            state[slot_t] = S.to(dtype)
        out, factors = chunk_verify(*(merge_heads(t, idx) for t in (q, k, v, g, beta)),
                                    S.reshape(n * HV, *S.shape[2:]), scale, use_qk_l2norm)
        o[idx] = split_heads(out, n).to(dtype)
        rows = token_index([targets[i] * slab_len for i in seqs], range(n), u, v.device)
        slabs.z[rows] = split_heads(factors.z, n)
        slabs.k[rows] = split_heads(factors.k, n)
        slabs.g_cum[rows] = split_heads(factors.g_cum, n)
    return o


def token_index(starts: list[int], seqs, u: int, device=None) -> torch.Tensor:
    """``[n, u]`` rows ``starts[i] .. starts[i] + u - 1`` of the sequences ``seqs`` (``starts``: e.g.
    ``cu_seqlens`` as a list)."""
    first = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
    return first[:, None] + torch.arange(u, device=device)


def merge_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Tokens ``idx`` ``[n, u]`` of ``x`` ``[T, H, *D]`` as one ``u``-token sequence of ``n * H`` heads,
    ``[u, n * H, *D]``: head ``i * H + h`` is head ``h`` of sequence ``i``. Every function here treats
    heads independently (value head ``h`` reads key head ``h // G``, which stays in its sequence), so
    ``n`` sequences of one length run as one."""
    y = x[idx].transpose(0, 1)  # [u, n, H, *D]
    return y.reshape(y.shape[0], -1, *y.shape[3:])


def split_heads(y: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`merge_heads` undone: ``[u, n * H, *D]`` -> ``[n, u, H, *D]``."""
    return y.reshape(y.shape[0], n, -1, *y.shape[2:]).transpose(0, 1)
