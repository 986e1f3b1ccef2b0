"""The drafter's one-launch norms (``kernels.norms``, Triton's interpreter on the CPU) against the torch
modules they replace, ``Qwen3RMSNorm`` and ``GatedGroupRMSNorm``, on fresh random rows: in float16 the
same values but for under 1 % of them, within two units in the last place (a last-bit difference of the
normalised value, scaled by the weight), in float32 within a few units in the last place
(the sums of up to 2,048 squares run in another order), in bfloat16 within two (the interpreter rounds
float32 to bfloat16 by truncation, twice per value; GPUs round to nearest).
The comparison rejects a planted bug: the weight applied before the downcast instead of after."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from vllm_hybridspec.drafter.mamba2 import GatedGroupRMSNorm
from vllm_hybridspec.kernels.norms import gated_group_rms_norm, rms_norm

from ..seeds import fresh_seed

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}
BOUND = {torch.float16: 2.01, torch.bfloat16: 2.01, torch.float32: 8.0}  # units in the last place


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    ulps, share = differences(got, want)
    return ulps <= BOUND[want.dtype] and (want.dtype != torch.float16 or share < 0.01)


def differences(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest difference in units in the last place of ``want``, share of values that differ)."""
    scale = want.float().abs().clamp(min=torch.finfo(want.dtype).tiny) * ULP[want.dtype]
    d = (got.float() - want.float()).abs()
    return float((d / scale).max()), float((d > 0).float().mean())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 2048), (2, 16, 16, 256), (3, 100)])
def test_rms_norm_is_qwen3s(dtype, shape):
    gen = torch.Generator().manual_seed(fresh_seed(f"rms norm {dtype} {shape}"))
    D = shape[-1]
    module = Qwen3RMSNorm(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(D, generator=gen))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    want = module(x).detach()
    got = rms_norm(x, module.weight, module.variance_epsilon)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert close(got, want), differences(got, want)


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                 (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_gated_group_rms_norm_is_the_mixers(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(fresh_seed(f"gated norm {dtype} {weight_dtype}"))
    module = GatedGroupRMSNorm(512, 4).to(weight_dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(512, generator=gen))
    y, z = (torch.randn(2, 16, 512, generator=gen).to(dtype) for _ in range(2))
    want = module(y, z).detach()
    got = gated_group_rms_norm(y, z, module.weight, module.groups, module.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert close(got, want), differences(got, want)


def test_the_comparison_rejects_the_weight_before_the_downcast():
    gen = torch.Generator().manual_seed(fresh_seed("rms norm control"))
    module = Qwen3RMSNorm(256, eps=1e-6).to(torch.float16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(256, generator=gen) * 3)
    x = torch.randn(64, 256, generator=gen).to(torch.float16)
    f = x.float()
    planted = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6) * module.weight.float()).to(torch.float16)
    assert not close(planted, module(x).detach()), differences(planted, module(x).detach())
