"""When the one-slot GDN layer is on (vllm_hybridspec.gdn_layer.gdn_kernel_enabled): the decision
the layer and the page-size classmethods share, and its errors."""

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridspec.gdn_layer import gdn_kernel_enabled, one_slot_state_shape


def vllm_config(k=3, options=None, ssm="float32", mode="none", dtype=torch.bfloat16, tp=1):
    return SimpleNamespace(
        speculative_config=None if k is None else SimpleNamespace(num_speculative_tokens=k),
        additional_config={} if options is None else {"hybridspec": options},
        cache_config=SimpleNamespace(mamba_cache_mode=mode, mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm),
        model_config=SimpleNamespace(dtype=dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )


def test_on_by_default_with_spec_decoding_and_an_fp32_state():
    assert gdn_kernel_enabled(vllm_config())
    assert gdn_kernel_enabled(vllm_config(k=15, options={"gdn_kernel": True}))
    assert not gdn_kernel_enabled(vllm_config(k=None))
    assert not gdn_kernel_enabled(vllm_config(options={"gdn_kernel": False}))
    # "auto" follows the model dtype
    assert gdn_kernel_enabled(vllm_config(ssm="auto", dtype=torch.float32))


@pytest.mark.parametrize("setting, message", [
    ({"ssm": "auto"}, r"mamba_ssm_cache_dtype='auto'.*--mamba-ssm-cache-dtype float32"),
    ({"ssm": "bfloat16"}, r"mamba_ssm_cache_dtype='bfloat16'"),
    ({"mode": "align"}, r"mamba_cache_mode='align'"),
    ({"k": 16}, r"num_speculative_tokens=16"),
])
def test_unmet_requirement_falls_back_by_default_and_is_an_error_when_asked_for(setting, message):
    assert not gdn_kernel_enabled(vllm_config(**setting))
    with pytest.raises(ValueError, match=message):
        gdn_kernel_enabled(vllm_config(**setting, options={"gdn_kernel": True}))


@pytest.mark.parametrize("tp", [1, 2])
def test_one_slot_state_is_the_plain_decoding_state_on_the_local_shard(tp):
    hf = SimpleNamespace(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4)
    conv, ssm = one_slot_state_shape(vllm_config(k=15, tp=tp), hf)
    conv_dim = (2 * 16 * 128 + 32 * 128) // tp
    assert sorted(conv) == sorted((conv_dim, 3))  # K_conv - 1 columns whatever the layout, no spec columns
    assert ssm == (32 // tp, 128, 128)
