"""What the drafter must know about its target: attention geometry, which layers are full attention,
and the default choice of target layers (Appendix B.1).

All functions take the target's transformers config (a multimodal config's text config is used).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class AttentionGeometry:
    """The shapes and RoPE a drafter attention layer must share with the target to read its K/V."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float

    @classmethod
    def of(cls, config: PretrainedConfig) -> AttentionGeometry:
        config = text_config(config)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if (
            "full_attention" in rope
        ):  # per-layer-type RoPE (e.g. Gemma-style): H-Spec reads full-attention layers
            rope = dict(rope["full_attention"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"the target uses rope_type={rope_type!r}; the H-Spec drafter implements only "
                "'default' RoPE (optionally partial), which Qwen3 and Qwen3-Next use"
            )
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ValueError(f"cannot find rope_theta in the target config ({type(config).__name__})")
        prf = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
        )


def full_attention_layers(config: PretrainedConfig) -> list[int]:
    """Indices of the target's full-attention layers: ``layer_types`` when the config has it,
    else every ``full_attention_interval``-th layer (Qwen3-Next), else every layer."""
    config = text_config(config)
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [i for i, t in enumerate(layer_types) if t == "full_attention"]
    interval = getattr(config, "full_attention_interval", None)
    if interval:
        return [i for i in range(n) if (i + 1) % interval == 0]
    return list(range(n))


def check_kv_reuse(
    config: PretrainedConfig, kv_reuse_layer_ids: list[int], drafter: AttentionGeometry | None = None
) -> None:
    """Raise ``ValueError`` unless every KV-reuse layer is a full-attention layer of the target and
    the drafter's attention geometry (when given) equals the target's."""
    full = full_attention_layers(config)
    bad = [i for i in kv_reuse_layer_ids if i not in full]
    if bad:
        raise ValueError(
            f"kv_reuse_layer_ids {kv_reuse_layer_ids}: target layers {bad} are not full-attention "
            f"layers; the target's full-attention layers are {full}"
        )
    if len(set(kv_reuse_layer_ids)) != len(kv_reuse_layer_ids):
        raise ValueError(f"kv_reuse_layer_ids {kv_reuse_layer_ids} must be distinct")
    if drafter is not None:
        target = AttentionGeometry.of(config)
        diff = {
            k: (getattr(drafter, k), getattr(target, k))
            for k in target.__dataclass_fields__
            if getattr(drafter, k) != getattr(target, k)
        }
        if diff:
            raise ValueError(
                "the drafter's attention must match the target's to read its K/V; mismatched "
                + ", ".join(f"{k}: drafter {d} vs target {t}" for k, (d, t) in diff.items())
            )


def default_layer_selection(
    config: PretrainedConfig, num_selected: int = 5, num_kv_reuse: int = 3
) -> tuple[list[int], list[int]]:
    """Appendix B.1's choice: ``num_selected`` evenly spaced layers from 1 to ``L - 2`` (1, 9, 17, 25,
    34 for 36-layer Qwen3; 1, 8, 15, 22, 30 for 32-layer Llama-3.1), the last ``num_kv_reuse`` of
    them reused for K/V. On hybrid targets each reused layer is moved to the nearest full-attention
    layer not already chosen. Returns ``(target_layer_ids, kv_reuse_layer_ids)``."""
    config = text_config(config)
    n = config.num_hidden_layers
    full = full_attention_layers(config)
    if num_kv_reuse > len(full):
        raise ValueError(
            f"cannot reuse K/V of {num_kv_reuse} layers: the target has {len(full)} "
            f"full-attention layers ({full})"
        )
    num_selected = max(num_selected, num_kv_reuse)
    top = max(n - 2, 1)
    selected = [math.floor(1 + i * (top - 1) / max(num_selected - 1, 1)) for i in range(num_selected)]
    kv: list[int] = []
    for layer in reversed(selected[len(selected) - num_kv_reuse :]):
        candidates = [f for f in full if f not in kv]
        kv.append(min(candidates, key=lambda f: (abs(f - layer), -f)))
    kv = sorted(kv)
    rest = [s for s in selected[: len(selected) - num_kv_reuse] if s not in kv]
    selected = sorted(set(rest) | set(kv))
    if len(selected) < num_selected:  # tiny targets: fill with unused layers
        selected = sorted(
            set(selected) | set([i for i in range(n) if i not in selected][: num_selected - len(selected)])
        )
    return selected, kv
