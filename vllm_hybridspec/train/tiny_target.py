"""Tiny random-weight targets (a dense Qwen3 or a Qwen3-Next GDN + MoE hybrid) with a byte-level
tokenizer, saved as ordinary transformers model directories, for CPU tests and examples."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, model_validator
from vllm_hybridspec.policy.errors import USER_FILE

BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyTarget(BaseModel):
    """A random-weight target small enough to generate and capture on two CPU cores."""

    model_config = USER_FILE

    model_type: Literal["qwen3", "qwen3_next"] = "qwen3"
    hidden_size: int = Field(default=64, ge=1)
    intermediate_size: int = Field(default=128, ge=2)
    num_hidden_layers: int = Field(default=6, ge=1)
    num_attention_heads: int = Field(default=4, ge=1)
    num_key_value_heads: int = Field(default=2, ge=1)
    head_dim: int = Field(default=16, ge=2)
    max_position_embeddings: int = Field(default=4096, ge=1)
    initializer_range: float = Field(default=0.02, gt=0, description="std of the random weights")
    # qwen3_next only: full attention every full_attention_interval-th layer, GDN elsewhere, MoE MLPs
    full_attention_interval: int = Field(default=2, ge=1)
    num_experts: int = Field(default=4, ge=1)
    num_experts_per_tok: int = Field(default=2, ge=1)
    seed: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _shapes(self) -> TinyTarget:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok = {self.num_experts_per_tok} exceeds num_experts = {self.num_experts}"
            )
        return self


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with ``<|endoftext|>`` (eos and pad),
    ``<|mask|>``, ``<|im_start|>``/``<|im_end|>`` and a ChatML-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = BYTE_CHAT_TEMPLATE
    return fast


def tiny_target_config(spec: TinyTarget, vocab_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
    )
    if spec.model_type == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **common,
        full_attention_interval=spec.full_attention_interval,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.intermediate_size // 2,
        shared_expert_intermediate_size=spec.intermediate_size // 2,
        linear_num_key_heads=spec.num_key_value_heads,
        linear_num_value_heads=spec.num_attention_heads,
        linear_key_head_dim=spec.head_dim,
        linear_value_head_dim=spec.head_dim,
    )


def tiny_vocab_size(tokenizer=None) -> int:
    """The vocabulary of a tiny target: the byte tokenizer's, rounded up to a multiple of 8."""
    return (len(tokenizer or byte_tokenizer()) + 7) // 8 * 8


def build_tiny_target(spec: TinyTarget, out_dir: str | Path) -> Path:
    """Write a random-weight target (config, ``model.safetensors``, tokenizer) to ``out_dir``;
    deterministic in ``spec.seed``. Returns ``out_dir``."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = byte_tokenizer()
    config = tiny_target_config(spec, tiny_vocab_size(tokenizer))
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# A tiny hybrid Qwen3-Next in the shapes vLLM's GDN path expects (attention head dim 64, GDN heads
# 2 key / 4 value of dim 32, full attention every 4th layer, 8 experts), as transformers config
# fields; the vLLM engine tests and examples/gdn_layer_gpu_check.py build it (overriding
# ``vocab_size`` and more as they need). The large init std spreads the random logits.
TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [],
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "initializer_range": 0.2,
}


def save_tiny_qwen3_next(out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 1234,
                         **overrides) -> Path:
    """Write random weights (no tokenizer) of :data:`TINY_QWEN3_NEXT`, its fields updated by
    ``overrides``, to ``out_dir``; deterministic in ``seed``. Returns ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, **overrides})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(out_dir)
    return Path(out_dir)
