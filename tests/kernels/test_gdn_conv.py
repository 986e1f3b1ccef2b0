"""The one-slot layer's fused spec-step convolution (``kernels.gdn.conv.spec_conv``, Triton's interpreter
on the CPU) against its torch form and a float64 recomputation, on fresh random steps: rounds of 0 to
``S`` tokens with 0 to ``S`` pending inputs to commit, padding rounds on slot 0, padding tokens past the
last round, both pool layouts, float32 and bfloat16. A kernel that commits one input too few is caught. The
benchmark's check (``tools/kernels/spec_conv.py``) adds the slab store after the launch."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridspec.kernels.gdn.conv import spec_conv, spec_conv_torch

from ..seeds import fresh_seed

W, S, SLOTS, SLABS = 3, 5, 12, 8


def random_step(gen, D, dtype, dim_first):
    n_real = int(torch.randint(1, 7, (), generator=gen))
    n_pad = int(torch.randint(0, 3, (), generator=gen))
    lens = torch.randint(1, S + 1, (n_real,), generator=gen).tolist() + [0] * n_pad
    slots = (torch.randperm(SLOTS - 1, generator=gen)[:n_real] + 1).tolist() + [0] * n_pad
    slab = torch.randperm(SLABS, generator=gen)[: n_real + n_pad].tolist()
    m = torch.randint(0, S + 1, (n_real + n_pad,), generator=gen)
    m[0] = 0  # a round with nothing pending
    cu = torch.zeros(n_real + n_pad + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    T = int(cu[-1]) + int(torch.randint(0, 4, (), generator=gen))  # padding tokens
    pool = torch.randn((SLOTS, D, W) if dim_first else (SLOTS, W, D), generator=gen).to(dtype)
    conv = pool if dim_first else pool.transpose(1, 2)  # [slots, D, W] view, as vLLM's
    x = torch.randn(T, D, generator=gen).to(dtype)
    x_slab = torch.randn(SLABS * S, D, generator=gen).to(dtype)
    taps = (torch.randn(W + 1, D, generator=gen) * 0.5).to(dtype).float()
    bias = (torch.randn(D, generator=gen) * 0.1).to(dtype).float()
    ints = dict(slots=torch.tensor(slots, dtype=torch.int32), slab=torch.tensor(slab, dtype=torch.int32),
                pending_m=m.to(torch.int32), cu=cu)
    return pool, conv, x, x_slab, taps, bias, ints


def run(fn, pool, conv, x, x_slab, taps, bias, ints, m_shift=0):
    dim_first = conv.stride() == pool.stride()
    pool, x_slab = pool.clone(), x_slab.clone()
    view = pool if dim_first else pool.transpose(1, 2)
    pending = (ints["pending_m"] + m_shift).clamp(min=0)
    out = fn(view, x, x_slab, taps, bias, ints["slots"], ints["slab"], pending, ints["cu"], S, S, True)
    return out, pool, x_slab


def float64_conv(pool_before, conv, x, x_slab_before, taps, bias, ints):
    """Each real token's output from the committed window in float64."""
    view = pool_before.double() if conv.stride() == pool_before.stride() else pool_before.double().transpose(1, 2)
    cu, out = ints["cu"].tolist(), torch.zeros(x.shape, dtype=torch.float64)
    for i, (slot, sb, m) in enumerate(zip(ints["slots"].tolist(), ints["slab"].tolist(), ints["pending_m"].tolist())):
        if cu[i + 1] == cu[i]:
            continue
        hist = torch.cat([view[slot].T, x_slab_before[sb * S: sb * S + m].double()])[-W:] if slot else view[slot].T
        seq = torch.cat([hist, x[cu[i]: cu[i + 1]].double()])
        for r in range(cu[i + 1] - cu[i]):
            out[cu[i] + r] = torch.nn.functional.silu((seq[r: r + W + 1] * taps.double()).sum(0) + bias.double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim_first", [False, True])
def test_fused_spec_conv_equals_the_torch_form_and_float64(dtype, dim_first):
    gen = torch.Generator().manual_seed(fresh_seed(f"spec conv {dtype} {dim_first}"))
    committed = 0
    for _ in range(4):
        D = int(torch.randint(100, 300, (), generator=gen))  # not a multiple of the block
        step = random_step(gen, D, dtype, dim_first)
        pool, conv, x, x_slab, taps, bias, ints = step
        out, pool_k, slab_k = run(spec_conv, *step)
        out_t, pool_t, slab_t = run(spec_conv_torch, *step)
        assert torch.equal(pool_k, pool_t)  # the committed windows: copies
        assert torch.equal(slab_k, x_slab) and torch.equal(slab_t, x_slab)  # the slabs are only read
        end = int(ints["cu"][-1])
        assert torch.count_nonzero(out[end:]) == 0 and torch.count_nonzero(out_t[end:]) == 0
        ulp = 1e-6 if dtype == torch.float32 else 8e-3  # SiLU's exponential; bf16: one rounding of the output
        assert (out.float() - out_t.float()).abs().max() <= ulp * (1 + out_t.float().abs().max())
        ref = float64_conv(pool, conv, x, x_slab, taps, bias, ints)
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err < (2e-6 if dtype == torch.float32 else 1e-2), err
        committed += int(((ints["pending_m"] > 0) & (ints["slots"] > 0)).sum())
    assert committed > 0  # the draws committed pending inputs


def test_the_comparison_catches_a_commit_one_input_short():
    gen = torch.Generator().manual_seed(fresh_seed("spec conv control"))
    step = random_step(gen, 160, torch.float32, False)
    step[-1]["pending_m"][0] = 2  # round 0 (a real one) commits two inputs
    out, pool_k, _ = run(spec_conv, *step, m_shift=-1)
    out_t, pool_t, _ = run(spec_conv_torch, *step)
    assert not torch.equal(pool_k, pool_t)
    assert (out - out_t).abs().max() > 1e-2
