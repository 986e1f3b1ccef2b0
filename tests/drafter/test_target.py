"""Target introspection: full-attention layers, the KV-reuse checks and Appendix B.1's layer choice."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config, Qwen3NextConfig
from vllm_hybridspec.drafter import (
    AttentionGeometry,
    HSpecSpeculatorConfig,
    check_kv_reuse,
    default_layer_selection,
    full_attention_layers,
)

from .conftest import tiny_qwen3_config


def qwen3_next(layers=8, interval=4):
    return Qwen3NextConfig(
        num_hidden_layers=layers,
        full_attention_interval=interval,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
    )


def test_full_attention_layers():
    assert full_attention_layers(tiny_qwen3_config()) == list(range(6))
    assert full_attention_layers(qwen3_next(8, 4)) == [3, 7]
    older = PretrainedConfig(num_hidden_layers=8, full_attention_interval=4)  # no layer_types
    assert full_attention_layers(older) == [3, 7]
    sliding = Qwen3Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert full_attention_layers(sliding) == [
        i for i, t in enumerate(sliding.layer_types) if t == "full_attention"
    ]


def test_paper_layer_selection():
    assert default_layer_selection(Qwen3Config(num_hidden_layers=36)) == ([1, 9, 17, 25, 34], [17, 25, 34])
    assert default_layer_selection(LlamaConfig(num_hidden_layers=32)) == ([1, 8, 15, 22, 30], [15, 22, 30])
    # Qwen3-Next (full attention at 3, 7, ..., 47): 23, 34, 46 move to the nearest full-attention layers
    assert default_layer_selection(qwen3_next(48, 4)) == ([1, 12, 23, 35, 47], [23, 35, 47])


def test_kv_reuse_must_point_at_full_attention_layers():
    with pytest.raises(
        ValueError,
        match=r"target layers \[2\] are not full-attention layers; the target's "
        r"full-attention layers are \[3, 7\]",
    ):
        check_kv_reuse(qwen3_next(8, 4), [2, 7])
    check_kv_reuse(qwen3_next(8, 4), [3, 7])
    with pytest.raises(ValueError, match="are not full-attention"):
        HSpecSpeculatorConfig.from_target(qwen3_next(8, 4), None, [1, 3, 5, 7], [3, 5])


def test_attention_geometry_must_match():
    target = tiny_qwen3_config()
    drafter = AttentionGeometry(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=1e6, partial_rotary_factor=1.0
    )
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads: drafter 4 vs target 2, rope_theta: drafter "
        r"1000000.0 vs target 10000.0",
    ):
        check_kv_reuse(target, [2], drafter)
    check_kv_reuse(target, [2], AttentionGeometry.of(target))


def test_geometry_is_copied_from_the_target():
    config = HSpecSpeculatorConfig.from_target(qwen3_next(8, 4), None, [1, 3, 7], [3, 7])
    geometry = config.attention_geometry
    assert geometry == AttentionGeometry.of(qwen3_next(8, 4))
    assert geometry.partial_rotary_factor == 0.25 and geometry.head_dim == 16
    assert config.target_model_type == "qwen3_next"
    assert (
        config.num_draft_tokens == 7 and config.speculators_config.proposal_methods[0].speculative_tokens == 7
    )


def test_unsupported_rope_is_refused():
    config = LlamaConfig(
        num_hidden_layers=4,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        AttentionGeometry.of(config)


def test_mamba_heads_must_divide_into_groups():
    with pytest.raises(ValueError, match=r"mamba_num_heads \(6\) must be a multiple of mamba_n_groups \(4\)"):
        HSpecSpeculatorConfig.from_target(tiny_qwen3_config(), None, [1, 2], [2], mamba_num_heads=6)
