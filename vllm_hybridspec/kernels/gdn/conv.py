"""The one-slot GDN layer's convolution of a spec step in one launch per layer: each round's conv window
shifted by its pending round's ``m`` inputs and written back to the pool (the commit of the window),
and the round's tokens convolved from that window. Storing the round's pre-conv inputs in its input
slab (where the window's pending inputs were just read) is left to the caller, an ``index_copy_``
after the launch, so that no memory the kernel reads is written by another thread of it.

As torch ops (:func:`spec_conv_torch`, the reference and the path off CUDA) that is about thirty
small kernels per layer and step (index arithmetic, gathers, copies, a float32 reduction): on the
35B-shape slice's nine GDN layers, 0.4-0.5 ms of a spec step's GPU time
(``docs/benchmarks/h200-2026-12-04d``). Both compute the taps' products in float32 and add them in
tap order, then the bias, then SiLU; the kernel is launched without floating-point contraction, so
the two agree to the last bit up to SiLU's exponential.

Not yet the layer's path: its first H200 check (``hybridspec kernels spec-conv``, 2026-12-04, with the
slab store inside the kernel) found the windows or slabs of one of six shapes (16 requests of 2
tokens) different from the torch form's; the store has moved out since, unmeasured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 128  # channels per program


@triton.jit
def _spec_conv_kernel(
    conv, x, x_slab, taps, bias, out,  # pool view [slots, D, W]; [T, D]; [rows, D]; [W + 1, D] fp32; [D] fp32; [T, D]
    slots, slab, pending_m, cu,  # [n], [n], [n], [n + 1] int
    D, S,
    stride_cs, stride_cd, stride_cw, stride_x, stride_slab, stride_out,
    W: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    o_d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    slot = tl.load(slots + i).to(tl.int64)
    sb = tl.load(slab + i).to(tl.int64)
    m = tl.load(pending_m + i)
    m = tl.where(slot > 0, tl.minimum(tl.maximum(m, 0), S), 0).to(tl.int64)
    start = tl.load(cu + i).to(tl.int64)
    length = tl.load(cu + i + 1).to(tl.int64) - start

    # the committed window: column c of [window ; the pending round's inputs] at m + c
    o_w = tl.arange(0, BW)
    j = m + o_w  # [BW]
    m_w = o_w < W
    from_window = tl.load(conv + slot * stride_cs + o_d[None, :] * stride_cd + tl.minimum(j, W - 1)[:, None] * stride_cw,
                          mask=(m_w & (j < W))[:, None] & m_d[None, :], other=0.0)
    from_inputs = tl.load(x_slab + (sb * S + tl.maximum(j - W, 0))[:, None] * stride_slab + o_d[None, :],
                          mask=(m_w & (j >= W))[:, None] & m_d[None, :], other=0.0)
    win = tl.where((j < W)[:, None], from_window, from_inputs.to(from_window.dtype))  # [BW, BLOCK], pool dtype
    if slot > 0:
        tl.store(conv + slot * stride_cs + o_d[None, :] * stride_cd + o_w[:, None] * stride_cw, win,
                 mask=m_w[:, None] & m_d[None, :])
    win32 = win.to(x.dtype.element_ty).to(tl.float32)  # as the reference: the inputs in x's dtype, then float32
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.0)
    for r in range(0, length):
        t = start + r
        acc = tl.zeros([BLOCK], tl.float32)
        for jj in tl.static_range(W + 1):
            p = r - W + jj  # input offset in the round; p < 0: window column W + p
            w_j = tl.load(taps + jj * D + o_d, mask=m_d, other=0.0)
            x_p = tl.load(x + (start + p) * stride_x + o_d, mask=m_d & (p >= 0), other=0.0)
            x_p = x_p.to(tl.float32)
            w_p = tl.sum(tl.where((o_w == W + p)[:, None], win32, 0.0), axis=0)
            acc += tl.where(p >= 0, x_p, w_p) * w_j
        if HAS_BIAS:
            acc += b
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out + t * stride_out + o_d, acc.to(out.dtype.element_ty), mask=m_d)


def spec_conv(conv: torch.Tensor, x: torch.Tensor, x_slab: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
              slots: torch.Tensor, slab: torch.Tensor, pending_m: torch.Tensor, cu: torch.Tensor, slab_len: int,
              silu: bool) -> torch.Tensor:
    """One launch: commit each round's conv window and convolve its tokens (the caller then stores
    the round's inputs in its slab, as :func:`spec_conv_torch` does).

    ``conv`` ``[slots, D, W]`` (any strides): the pool's windows, updated in place for rounds whose slot
    is not 0; ``x`` ``[T, D]``: the step's pre-conv inputs in round order (``cu`` ``[n + 1]`` int
    offsets); ``x_slab`` ``[rows, D]``: the input slabs (read only), round ``i``'s at rows
    ``slab[i] * slab_len`` onwards, holding its pending round's inputs (``pending_m[i]`` of them are
    committed); ``taps`` ``[W + 1, D]`` float32 (the weight's values in float32), ``bias``
    ``[D]`` float32 or ``None``. Returns ``[T, D]`` in ``x``'s dtype; rows past ``cu[n]`` (padding)
    are zero. Capturable in a CUDA graph (no host reads)."""
    T, D = x.shape
    n = slots.shape[0]
    W = conv.shape[-1]
    out = torch.zeros_like(x)
    assert x.stride(-1) == 1 and x_slab.stride(-1) == 1 and taps.is_contiguous() and taps.shape == (W + 1, D)
    if n == 0 or T == 0:
        return out
    grid = (n, triton.cdiv(D, BLOCK_D))
    _spec_conv_kernel[grid](
        conv, x, x_slab, taps, bias if bias is not None else taps, out, slots, slab, pending_m, cu, D, slab_len,
        conv.stride(0), conv.stride(1), conv.stride(2), x.stride(0), x_slab.stride(0), out.stride(0),
        W=W, BW=triton.next_power_of_2(W), HAS_BIAS=bias is not None, SILU=silu, BLOCK=BLOCK_D,
        enable_fp_fusion=False)
    return out


# --- torch ------------------------------------------------------------------------------------------


def shift_conv_windows(conv: torch.Tensor, x_slab: torch.Tensor, slots: torch.Tensor, slab: torch.Tensor,
                       m: torch.Tensor, slab_len: int) -> None:
    """Shift the conv window of every round ``i`` by its ``m[i]`` pending inputs: the window becomes
    the last ``W`` columns of ``[window ; inputs 0..m-1 of slab[i]]``. ``conv`` ``[slots, D, W]`` (a
    view of the pool), ``slots``, ``slab``, ``m``: ``[n]`` (slot 0, vLLM's null block, and ``m = 0``
    leave a window as it is). Pure copies with device indices (CUDA-graph safe); the windows are read
    before any is written."""
    conv = conv.transpose(-1, -2)  # [slots, W, D]
    W = conv.shape[1]
    n = slots.shape[0]
    S = slab_len
    slots = slots.long()
    m = torch.where(slots > 0, m.long().clamp(0, S), 0)  # [n]
    j = m[:, None] + torch.arange(W, device=m.device)[None]  # [n, W]: column of [window ; inputs]
    old = conv.index_select(0, slots)  # [n, W, D]
    from_window = old.gather(1, j.clamp(max=W - 1)[..., None].expand(n, W, old.shape[-1]))
    rows = (slab.long()[:, None] * S + (j - W).clamp(min=0)).reshape(-1)
    from_inputs = x_slab.index_select(0, rows).view(n, W, -1).to(conv.dtype)
    conv.index_copy_(0, slots, torch.where((j < W)[..., None], from_window, from_inputs))


def spec_conv_index(cu: torch.Tensor, n: int, num_tokens: int, W: int) -> torch.Tensor:
    """``[W + 1, T]`` rows of ``[windows (n * W rows, round-major) ; x (T rows)]`` that token ``t``
    convolves with tap ``j``: its round ``i``'s input at offset ``r - W + j`` (``r`` = the token's
    offset in its round), which is window column ``r + j`` when ``r + j < W``, else input
    ``t + j - W``. Built on the device from the offsets."""
    device = cu.device
    t = torch.arange(num_tokens, device=device)
    cu = cu.long()
    # tokens past the last round's end (padding) count as the last round's, so their (unused)
    # indices stay inside the source
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=n - 1)
    r = t - cu[seq]
    j = torch.arange(W + 1, device=device)[:, None]
    return torch.where(r + j < W, seq * W + r + j, n * W + t + j - W)


def spec_conv_torch(conv: torch.Tensor, x: torch.Tensor, x_slab: torch.Tensor, taps: torch.Tensor,
                    bias: torch.Tensor | None, slots: torch.Tensor, slab: torch.Tensor, pending_m: torch.Tensor,
                    cu: torch.Tensor, slab_len: int, silu: bool) -> torch.Tensor:
    """:func:`spec_conv` as torch ops: the window commit (:func:`shift_conv_windows`), then each token's
    ``W + 1`` inputs gathered from ``[windows ; x]`` (:func:`spec_conv_index`) in ``x``'s dtype and
    combined in float32."""
    n, T = slots.shape[0], x.shape[0]
    W = conv.shape[-1]
    shift_conv_windows(conv, x_slab, slots, slab, pending_m, slab_len)
    if n == 0 or T == 0:
        return torch.zeros_like(x)
    idx = spec_conv_index(cu, n, T, W)
    windows = conv.index_select(0, slots.long()).transpose(1, 2).reshape(n * W, -1)
    src = torch.cat([windows.to(x.dtype), x])
    inputs = src.index_select(0, idx.reshape(-1)).view(W + 1, T, -1).float()
    acc = inputs[0] * taps[0]
    for j in range(1, W + 1):
        acc = acc + inputs[j] * taps[j]
    if bias is not None:
        acc = acc + bias
    if silu:
        acc = torch.nn.functional.silu(acc)
    out = acc.to(x.dtype)
    out[int(cu[n]):] = 0
    return out
