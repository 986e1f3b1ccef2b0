"""The one-slot GDN layer's convolution of a spec step in one launch per layer: each round's conv window
shifted by its pending round's ``m`` inputs and written back to the pool (the commit of the window),
and the round's tokens convolved from that window. Storing the round's pre-conv inputs in its input
slab (where the window's pending inputs were just read) is left to the caller, an ``index_copy_``
after the launch, so that no memory the kernel reads is written by another thread of it.

One program per round and block of channels computes every token of the round at once. As torch
ops (:func:`spec_conv_torch`, the reference and the path off CUDA) that is dozens of small kernels
per layer and step (index arithmetic, gathers, copies, a float32 reduction), a measurable share of a
spec step's GPU time (``docs/benchmarks/choices.md``). Both compute the taps' products in float32 and add them in
tap order, then the bias, then SiLU; the kernel is launched without floating-point contraction, so
the two agree to the last bit up to SiLU's exponential.

The window shift is in place (column ``c`` takes column ``c + m``), so every read of a program comes
before its barrier and the window's store after it (Triton's interpreter runs a program's loads before
its stores and cannot show a race there; on a GPU ``hybridspec kernels spec-conv`` compares windows,
slabs and outputs with the torch form).
The layer's path on GPUs unless ``"gdn_fused_conv": false``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE = 4096  # tokens x channels per program


@triton.jit
def _spec_conv_kernel(
    conv, x, x_slab, taps, bias, out,  # pool view [slots, D, W]; [T, D]; [rows, D]; [W + 1, D] fp32; [D] fp32; [T, D]
    slots, slab, pending_m, cu,  # [n], [n], [n], [n + 1] int
    D, S,
    stride_cs, stride_cd, stride_cw, stride_x, stride_slab, stride_out,
    W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK: tl.constexpr,
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
    p_conv = conv + slot * stride_cs + o_d[None, :] * stride_cd
    p_slab = x_slab + sb * S * stride_slab + o_d[None, :]

    # everything is read from the pool as it was before any of it is written: the committed window's
    # column c is column m + c of [window ; the pending round's inputs]
    o_w = tl.arange(0, BW)
    j = m + o_w  # [BW]
    m_w = o_w < W
    from_window = tl.load(p_conv + tl.minimum(j, W - 1)[:, None] * stride_cw,
                          mask=(m_w & (j < W))[:, None] & m_d[None, :], other=0.0)
    from_inputs = tl.load(p_slab + tl.maximum(j - W, 0)[:, None] * stride_slab,
                          mask=(m_w & (j >= W))[:, None] & m_d[None, :], other=0.0)
    win = tl.where((j < W)[:, None], from_window, from_inputs.to(from_window.dtype))  # [BW, BLOCK], pool dtype

    # every token of the round at once: tap jj reads the round's input at offset p = r - W + jj, or,
    # for p < 0, the committed window's column W + p (column m + W + p of [window ; pending inputs])
    o_t = tl.arange(0, BT)
    m_t = o_t < length
    acc = tl.zeros([BT, BLOCK], tl.float32)
    for jj in tl.static_range(W + 1):
        p = o_t - W + jj  # [BT]
        jc = m + W + p
        in_x = p >= 0
        v_x = tl.load(x + (start + p)[:, None] * stride_x + o_d[None, :],
                      mask=(m_t & in_x)[:, None] & m_d[None, :], other=0.0)
        v_w = tl.load(p_conv + tl.minimum(tl.maximum(jc, 0), W - 1)[:, None] * stride_cw,
                      mask=(m_t & ~in_x & (jc < W))[:, None] & m_d[None, :], other=0.0)
        v_s = tl.load(p_slab + tl.maximum(jc - W, 0)[:, None] * stride_slab,
                      mask=(m_t & ~in_x & (jc >= W))[:, None] & m_d[None, :], other=0.0)
        v_win = tl.where((jc < W)[:, None], v_w, v_s.to(v_w.dtype)).to(v_x.dtype)  # as the reference: x's dtype
        v = tl.where(in_x[:, None], v_x, v_win).to(tl.float32)
        w_j = tl.load(taps + jj * D + o_d, mask=m_d, other=0.0)
        acc += v * w_j[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out + (start + o_t)[:, None] * stride_out + o_d[None, :], acc.to(out.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])

    # the window shift reads columns that other threads write: every read above before any write
    tl.debug_barrier()
    if slot > 0:
        tl.store(p_conv + o_w[:, None] * stride_cw, win, mask=m_w[:, None] & m_d[None, :])


def spec_conv(conv: torch.Tensor, x: torch.Tensor, x_slab: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
              slots: torch.Tensor, slab: torch.Tensor, pending_m: torch.Tensor, cu: torch.Tensor, slab_len: int,
              max_len: int, silu: bool) -> torch.Tensor:
    """One launch: commit each round's conv window and convolve its tokens (the caller then stores
    the round's inputs in its slab, as :func:`spec_conv_torch` does).

    ``conv`` ``[slots, D, W]`` (any strides): the pool's windows, updated in place for rounds whose slot
    is not 0; ``x`` ``[T, D]``: the step's pre-conv inputs in round order (``cu`` ``[n + 1]`` int
    offsets, no round longer than ``max_len``); ``x_slab`` ``[rows, D]``: the input slabs (read only),
    round ``i``'s at rows ``slab[i] * slab_len`` onwards, holding its pending round's inputs
    (``pending_m[i]`` of them are committed); ``taps`` ``[W + 1, D]`` float32 (the weight's values in
    float32), ``bias`` ``[D]`` float32 or ``None``. Returns ``[T, D]`` in ``x``'s dtype; rows past
    ``cu[n]`` (padding) are zero. One program per round and block of channels, every token of the
    round at once. Capturable in a CUDA graph (no host reads)."""
    T, D = x.shape
    n = slots.shape[0]
    W = conv.shape[-1]
    out = torch.zeros_like(x)
    assert x.stride(-1) == 1 and x_slab.stride(-1) == 1 and taps.is_contiguous() and taps.shape == (W + 1, D)
    if n == 0 or T == 0:
        return out
    BT = triton.next_power_of_2(max(max_len, 1))
    block = max(16, min(128, MAX_TILE // BT))
    grid = (n, triton.cdiv(D, block))
    _spec_conv_kernel[grid](
        conv, x, x_slab, taps, bias if bias is not None else taps, out, slots, slab, pending_m, cu, D, slab_len,
        conv.stride(0), conv.stride(1), conv.stride(2), x.stride(0), x_slab.stride(0), out.stride(0),
        W=W, BW=triton.next_power_of_2(W), BT=BT, HAS_BIAS=bias is not None, SILU=silu, BLOCK=block,
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
                    cu: torch.Tensor, slab_len: int, max_len: int, silu: bool) -> torch.Tensor:
    """:func:`spec_conv` as torch ops: the window commit (:func:`shift_conv_windows`), then each token's
    ``W + 1`` inputs gathered from ``[windows ; x]`` (:func:`spec_conv_index`) in ``x``'s dtype and
    combined in float32. Reads nothing on the host, so it runs inside a CUDA graph too (the layer's
    path with ``"gdn_fused_conv": false``)."""
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
    live = torch.arange(T, device=x.device) < cu[n].long()  # padding tokens past the last round: 0
    return torch.where(live[:, None], acc, 0.0).to(x.dtype)
