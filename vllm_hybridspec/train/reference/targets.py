"""Configurations of the two reference targets: a scaled-down Qwen3-Next (Gated DeltaNet + MoE,
full attention every 4th layer) and a dense Qwen3 of similar size.

Sizes are chosen so that both targets and four drafters stay near 20 MB in bf16 (the working tree
travels with every GPU call), while keeping the shapes vLLM's kernels expect: attention and GDN head
dim 64, KV heads dividing query heads, an expert width that is a multiple of 16. Vocabulary is the
reference tokenizer's (8192) and the input embedding is tied to the LM head (the embedding table is
the largest single tensor at this size).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TargetSize(BaseModel):
    """Shapes of one reference target; the defaults are the hybrid's."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["hybrid", "dense"] = "hybrid"
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = Field(default=384, description="dense MLP width (hybrid: unused)")
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # hybrid only
    full_attention_interval: int = 4
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64


HYBRID = TargetSize(kind="hybrid")
DENSE = TargetSize(kind="dense", intermediate_size=512)


def target_config(size: TargetSize, vocab_size: int, eos_token_id: int):
    """A transformers config (``Qwen3NextConfig`` or ``Qwen3Config``) for ``size``."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        rope_theta=size.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        initializer_range=0.02,
    )
    if size.kind == "dense":
        from transformers import Qwen3Config

        return Qwen3Config(**common, intermediate_size=size.intermediate_size)
    from transformers import Qwen3NextConfig

    if size.num_hidden_layers % size.full_attention_interval:
        raise ValueError(
            f"num_hidden_layers={size.num_hidden_layers} is not a multiple of "
            f"full_attention_interval={size.full_attention_interval}; the last layer must be full attention"
        )
    return Qwen3NextConfig(
        **common,
        # unused by a model whose every layer is MoE; drafters built from this config (H-Spec's and
        # speculators' DFlash) take their dense MLP width from it: 3 x hidden, the usual MoE fallback
        intermediate_size=3 * size.hidden_size,
        full_attention_interval=size.full_attention_interval,
        num_experts=size.num_experts,
        num_experts_per_tok=size.num_experts_per_tok,
        moe_intermediate_size=size.moe_intermediate_size,
        shared_expert_intermediate_size=size.shared_expert_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        linear_num_key_heads=size.linear_num_key_heads,
        linear_num_value_heads=size.linear_num_value_heads,
        linear_key_head_dim=size.linear_key_head_dim,
        linear_value_head_dim=size.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
    )


def build_target(size: TargetSize, vocab_size: int, eos_token_id: int, seed: int = 0):
    """A freshly initialised fp32 target (``AutoModelForCausalLM.from_config``), deterministic in ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(target_config(size, vocab_size, eos_token_id), dtype=torch.float32)
