"""The AMX causal-conv decision on CPUs with and without AMX (``cpu.patches``: the rows wrapping
``dispatch_cpu_unquantized_gemm`` and ``_cpu_gdn_attention_nonspec``): a float32 conv weight is never
prepacked and its GDN layer takes vLLM's torch conv branch; a bf16 one keeps vLLM's AMX path.

vLLM 0.26's VNNI conv kernels use AVX-512 BF16, not AMX tiles, so with
``torch.cpu._is_amx_tile_supported`` forced to ``True`` the AMX branch runs for real on CPUs without
AMX: its prepack, its float32 failure and its bf16 convolution are vLLM's own code here, not stand-ins."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from vllm_hybridspec.engine import patches
from vllm_hybridspec.engine.cpu.patches import (
    conv_weights_prepacked_only_for_bf16,
    torch_conv_for_unpacked_weights,
)

from ...seeds import fresh_seed

DIM, WIDTH = 64, 4


def _conv_layer(gen, dtype):
    weight = torch.nn.Parameter(torch.randn(DIM, 1, WIDTH, generator=gen).to(dtype), requires_grad=False)
    return types.SimpleNamespace(weight=weight, bias=None)


def _amx(monkeypatch, on: bool):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: on)


def _vllm_dispatch():
    from vllm.model_executor.layers import utils

    return patches.original_of(utils.dispatch_cpu_unquantized_gemm)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_float32_conv_weights_are_never_prepacked_and_bf16_ones_are_where_vllm_prepacks(monkeypatch, amx):
    gen = torch.Generator().manual_seed(fresh_seed(f"amx conv dispatch {amx}"))
    _amx(monkeypatch, amx)
    dispatch = conv_weights_prepacked_only_for_bf16(_vllm_dispatch())
    fp32 = _conv_layer(gen, torch.float32)
    before = fp32.weight.detach().clone()
    if amx:  # what the row fixes: vLLM's own dispatch dies on a float32 conv weight
        with pytest.raises(NotImplementedError, match="not implemented for 'Float'"):
            _vllm_dispatch()(_conv_layer(gen, torch.float32), remove_weight=True)
    dispatch(fp32, remove_weight=True)
    assert torch.equal(fp32.weight, before) and fp32.weight.shape == (DIM, 1, WIDTH)
    assert not hasattr(fp32, "_cpu_unpacked_conv_weight")

    bf16 = _conv_layer(gen, torch.bfloat16)
    plain = bf16.weight.detach().clone()
    dispatch(bf16, remove_weight=True)
    if amx:  # vLLM's prepack ran: the stash is the plain weight, the parameter now holds the packed one
        assert torch.equal(bf16._cpu_unpacked_conv_weight, plain[:, 0])
        assert bf16.weight.shape == (DIM, WIDTH) and not torch.equal(bf16.weight, plain[:, 0])
    else:
        assert torch.equal(bf16.weight, plain) and not hasattr(bf16, "_cpu_unpacked_conv_weight")

    linear = types.SimpleNamespace(weight=torch.nn.Parameter(torch.randn(32, 64, generator=gen)))
    dispatch(linear, remove_weight=False)  # a linear layer still goes to vLLM's dispatch
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(linear.cpu_linear(x, linear.weight, None), x @ linear.weight.T)


def test_the_bf16_layer_keeps_vllms_amx_conv_which_computes_the_convolution(monkeypatch):
    """vLLM's VNNI conv (the AMX branch a bf16 layer keeps) on its prepacked weight agrees with a
    float64 depthwise causal convolution of the same bf16 inputs."""
    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(fresh_seed("amx conv kernel"))
    _amx(monkeypatch, True)
    layer = _conv_layer(gen, torch.bfloat16)
    conv_weights_prepacked_only_for_bf16(_vllm_dispatch())(layer, remove_weight=True)
    T = 9
    x = torch.randn(T, DIM, generator=gen).to(torch.bfloat16)
    states = torch.zeros(2, WIDTH - 1, DIM, dtype=torch.bfloat16).transpose(1, 2)  # SD layout, [slots, dim, W-1]
    out = ops.causal_conv1d_fwd_cpu(x.transpose(0, 1), layer.weight, None, states,
                                    torch.tensor([0, T], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                    torch.tensor([False]), True, True)  # [dim, T]
    w = layer._cpu_unpacked_conv_weight.double()[:, None]  # [dim, 1, W]
    ref = F.silu(F.conv1d(F.pad(x.double().T[None], (WIDTH - 1, 0)), w, groups=DIM))[0]
    # bf16 output: rounded to 8 significant bits (2^-9 relative), from a float32 accumulation
    excess = (out.double() - ref).abs() - (ref.abs() * 2**-8 + 1e-4)
    assert float(excess.max()) <= 0, float((out.double() - ref).abs().max())
    assert torch.equal(states[1], x[-(WIDTH - 1):].T)  # the window it leaves


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_the_gdn_core_sees_amx_only_for_a_prepacked_conv(monkeypatch, amx, dtype):
    """vLLM's ``_cpu_gdn_attention_nonspec`` picks its branch by ``torch.cpu._is_amx_tile_supported()``
    (``test_vllm_contract.py`` holds it to that): the wrapper lets it see AMX only for a weight the
    AMX conv takes, restores the answer after the call, and after a failing call."""
    _amx(monkeypatch, amx)
    seen = []

    def vllm_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        seen.append(torch.cpu._is_amx_tile_supported())
        if core_attn_out == "fail":
            raise RuntimeError("planted")
        return "done"

    nonspec = torch_conv_for_unpacked_weights(vllm_nonspec)
    layer = types.SimpleNamespace(conv1d=types.SimpleNamespace(weight=torch.zeros(DIM, 1, WIDTH, dtype=dtype)))
    assert nonspec(layer, None, None, None, None, None) == "done"
    with pytest.raises(RuntimeError, match="planted"):
        nonspec(layer, None, None, None, None, "fail")
    assert seen == [amx and dtype == torch.bfloat16] * 2
    assert torch.cpu._is_amx_tile_supported() is amx
