"""Mamba-2's state-space scan (SSD) started from an injected state (H-Spec paper, section 3.3.1).

Per head ``h``, with ``dt_t = softplus(dt_raw_t + dt_bias_h)`` and ``A_h < 0``:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t + D_h x_t,

``S_0`` being the state projected from the target's last-token hidden states. With the cumulative
log decay ``G_t = sum_{s<=t} dt_s A_h`` the whole block is one parallel expression:

    y_t = exp(G_t) S_0 C_t + sum_{s<=t} exp(G_t - G_s) (C_t . B_s) dt_s x_s + D_h x_t,

which is what lets H-Spec draft a whole block in one forward pass.

Conventions (those of ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``):

* ``x``: ``[N, L, H, P]``; ``dt``: ``[N, L, H]`` before the softplus; ``A``, ``D``, ``dt_bias``: ``[H]``;
* ``B``, ``C``: ``[N, L, G, S]`` with ``H % G == 0``; head ``h`` reads group ``h // (H // G)``;
* states (initial and final): ``[N, H, P, S]`` fp32; ``y`` comes back in ``x``'s dtype.

``ssd_recurrent`` is the token-by-token reference, ``ssd_parallel`` the block-parallel torch path
used on the CPU (and for training wherever the kernel is absent), ``ssd_scan`` picks mamba-ssm's
Triton kernel on CUDA tensors and ``ssd_parallel`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm_hybridspec.drafter._mamba import mamba_chunk_scan_combined


def _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state) -> None:
    N, L, H, P = x.shape
    G, S = B.shape[-2:]
    if dt.shape != (N, L, H):
        raise ValueError(f"dt must be [N, L, H] = {[N, L, H]}, got {list(dt.shape)}")
    if B.shape != (N, L, G, S) or C.shape != (N, L, G, S):
        raise ValueError(
            f"B and C must both be [N, L, G, S] = {[N, L, G, S]}, got {list(B.shape)} and {list(C.shape)}"
        )
    if H % G != 0:
        raise ValueError(f"the number of heads ({H}) must be a multiple of the number of groups ({G})")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t.shape != (H,):
            raise ValueError(f"{name} must be [H] = [{H}], got {list(t.shape)}")
    if initial_state.shape != (N, H, P, S):
        raise ValueError(
            f"initial_state must be [N, H, P, S] = {[N, H, P, S]}, got {list(initial_state.shape)}"
        )


def _prepare(x, dt, A, B, C, D, dt_bias):
    H, G = x.shape[2], B.shape[2]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    dt = F.softplus(dt.to(dtype) + dt_bias.to(dtype))  # [N, L, H]
    B = B.to(dtype).repeat_interleave(H // G, dim=2)  # [N, L, H, S]
    C = C.to(dtype).repeat_interleave(H // G, dim=2)  # [N, L, H, S]
    return x.to(dtype), dt, A.to(dtype), B, C, D.to(dtype), dtype


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence (the reference). Returns ``(y [N, L, H, P], final_state [N, H, P, S])``."""
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state)
    xs, dt, A, B, C, D, dtype = _prepare(x, dt, A, B, C, D, dt_bias)
    state = initial_state.to(dtype)  # [N, H, P, S]
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)  # [N, H]
        write = (dt[:, t, :, None] * xs[:, t])[..., None] * B[:, t, :, None, :]  # [N, H, P, S]
        state = decay[..., None, None] * state + write
        ys.append(torch.einsum("nhps,nhs->nhp", state, C[:, t]) + D[:, None] * xs[:, t])
    return torch.stack(ys, dim=1).to(x.dtype), state


def ssd_parallel(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All ``L`` positions at once (the quadratic SSD form; ``L`` is a draft block, a handful of
    tokens). Same arguments and results as :func:`ssd_recurrent`."""
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state)
    xs, dt, A, B, C, D, dtype = _prepare(x, dt, A, B, C, D, dt_bias)
    L = x.shape[1]
    G = torch.cumsum(dt * A, dim=1)  # [N, L, H], cumulative log decay, <= 0
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # [t, s]
    seg = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = torch.exp(seg)  # [N, t, s, H], exp(G_t - G_s) for s <= t, else 0
    scores = torch.einsum("nthk,nshk->ntsh", C, B) * decay * dt[:, None, :, :]  # [N, t, s, H]
    state = initial_state.to(dtype)  # [N, H, P, S]
    y = torch.einsum("ntsh,nshp->nthp", scores, xs)
    y = y + torch.exp(G)[..., None] * torch.einsum("nthk,nhpk->nthp", C, state)
    y = y + D[:, None] * xs
    to_end = torch.exp(G[:, -1:, :] - G) * dt  # [N, L, H], exp(G_L - G_s) dt_s
    final = torch.exp(G[:, -1])[..., None, None] * state + torch.einsum("nsh,nshp,nshk->nhpk", to_end, xs, B)
    return y.to(x.dtype), final


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan from ``initial_state``: mamba-ssm's Triton kernel when ``use_kernel`` (default:
    the tensors are on CUDA and mamba-ssm imports), else :func:`ssd_parallel`. Same arguments and
    results as :func:`ssd_recurrent`."""
    kernel = mamba_chunk_scan_combined()
    if use_kernel is None:
        use_kernel = x.is_cuda and kernel is not None
    if not use_kernel:
        return ssd_parallel(x, dt, A, B, C, D, dt_bias, initial_state)
    if kernel is None:
        raise RuntimeError(
            "use_kernel=True but mamba-ssm's Triton kernels could not be imported; "
            "install mamba-ssm==2.3.2.post1 (see the README)"
        )
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state)
    y, final = kernel(
        x,
        dt,
        A.float(),
        B,
        C,
        chunk_size,
        D=D.float(),
        dt_bias=dt_bias.float(),
        initial_states=initial_state.float(),
        dt_softplus=True,
        return_final_states=True,
    )
    return y.to(x.dtype), final.float()
