"""The H-Spec drafter's RMS norms as one kernel each.

In eager torch a ``Qwen3RMSNorm`` is about eight kernels (upcast, square, mean, add, rsqrt, scale,
downcast, weight) and the Mamba mixer's gated group norm about eleven, a few microseconds each for a
few kilobytes: a drafting round's layers are bound by their small kernels, not by bytes
(``docs/benchmarks/choices.md``). Here each norm is one launch with the same arithmetic:

* :func:`rms_norm` as ``Qwen3RMSNorm``: float32 statistics, the normalised row rounded to the input's
  dtype, then multiplied by the weight and rounded to the promoted dtype (torch's ``weight * x``);
* :func:`gated_group_rms_norm` as ``drafter.mamba2.GatedGroupRMSNorm``: ``y * silu(z)`` in float32,
  normalised per group, times the weight in float32, rounded once to ``y``'s dtype.

The sums run in another order than torch's, so a value may differ from the torch module's in its
last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, w, out, stride_x, stride_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    m = o < D
    v = tl.load(x + row * stride_x + o, mask=m, other=0.0)
    f = v.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(f * f, axis=0) / D + eps)
    y = (f * rstd).to(v.dtype).to(tl.float32)  # hidden_states.to(input_dtype)
    wv = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + o, (wv * y).to(out.dtype.element_ty), mask=m)


@triton.jit
def _gated_group_rms_norm_kernel(y, z, w, out, stride_y, stride_z, stride_o, G, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    o = tl.arange(0, BLOCK)
    m = o < G
    c = group * G + o
    a = tl.load(y + row * stride_y + c, mask=m, other=0.0).to(tl.float32)
    g = tl.load(z + row * stride_z + c, mask=m, other=0.0).to(tl.float32)
    a = a * (g / (1.0 + tl.exp(-g)))  # y * silu(z)
    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=0) / G + eps)
    wv = tl.load(w + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + c, (a * rstd * wv).to(out.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Qwen3RMSNorm(weight, eps)(x)`` over the last dimension, one launch."""
    rows = _rows(x)
    M, D = rows.shape
    out = torch.empty((M, D), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if M:
        _rms_norm_kernel[(M,)](rows, weight, out, rows.stride(0), out.stride(0), D, eps,
                               BLOCK=triton.next_power_of_2(D))
    return out.view(*x.shape[:-1], D)


def gated_group_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int,
                         eps: float) -> torch.Tensor:
    """``GatedGroupRMSNorm(weight, groups, eps)(y, z)``: ``rmsnorm(y * silu(z))`` per group of
    ``size // groups`` channels, one launch."""
    rows_y, rows_z = _rows(y), _rows(z)
    M, D = rows_y.shape
    G = D // groups
    out = torch.empty((M, D), dtype=y.dtype, device=y.device)
    if M:
        _gated_group_rms_norm_kernel[(M, groups)](rows_y, rows_z, weight, out, rows_y.stride(0), rows_z.stride(0),
                                                  out.stride(0), G, eps, BLOCK=triton.next_power_of_2(G))
    return out.view(*y.shape[:-1], D)
