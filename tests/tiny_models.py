"""The tiny dense Qwen3 shape shared by the drafter and plugin tests (random weights, CPU)."""

from __future__ import annotations

from transformers import Qwen3Config

VOCAB, MASK = 96, 95


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return Qwen3Config(**{**fields, **overrides})
