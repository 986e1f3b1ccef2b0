"""The frozen target during training: loading it, capturing its hidden states, and recomputing the
K/V of the layers the drafter reads from those hidden states.

Hidden-state conventions are speculators' (and vLLM's auxiliary hidden states): "layer ``i``" is the
input of decoder layer ``i``, and layer ``num_hidden_layers`` is the output of the last layer before
the final norm. Speculators stores one sample as ``hidden_states [T, len(layer_ids) + 1, hidden]``,
the extra last slot being that pre-norm output (the "verifier last hidden states").
"""

from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


def use_torch_gated_delta_rule() -> None:
    """Make transformers' Qwen3-Next run its GDN layers with its torch reference.

    Patches ``transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule`` and
    ``torch_recurrent_gated_delta_rule``: when fla is installed transformers binds them to fla's
    Triton kernels, which need a GPU; the wrapped torch functions are the references they fall back to.
    """
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(qwen3_next, name, inspect.unwrap(getattr(qwen3_next, name)))


def load_target(
    name_or_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """``(model, tokenizer)``, the model in eval mode with gradients off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if torch.device(device).type == "cpu":
        use_torch_gated_delta_rule()
    model = (
        AutoModelForCausalLM.from_pretrained(
            str(name_or_path), dtype=dtype, trust_remote_code=trust_remote_code
        )
        .to(device)
        .eval()
    )
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _decoder(target: nn.Module) -> nn.Module:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    if not hasattr(decoder, "layers"):
        raise TypeError(f"cannot find the decoder layers of {type(target).__name__}")
    return decoder


@torch.no_grad()
def capture_hidden_states(target: nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Run the target over one sequence and return the inputs of ``layer_ids`` plus the pre-norm
    output of the last layer: ``[T, len(layer_ids) + 1, hidden]`` in the target's dtype (speculators'
    layout).

    ``input_ids``: ``[T]``."""
    decoder = _decoder(target)
    n = len(decoder.layers)
    bad = [i for i in layer_ids if not 0 <= i <= n]
    if bad:
        raise ValueError(f"layer ids {bad} are outside [0, {n}] for a target with {n} layers")
    captured: dict[int, torch.Tensor] = {}

    def grab(index):
        def hook(_module, args, kwargs):
            captured[index] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    handles = [
        layer.register_forward_pre_hook(grab(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)
    ]
    handles.append(decoder.norm.register_forward_pre_hook(grab(n), with_kwargs=True))
    try:
        decoder(input_ids=input_ids[None].to(target.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([captured[i][0] for i in [*layer_ids, n]], dim=1).cpu()


class TargetKV(nn.Module):
    """K/V of target layers ``kv_layer_ids``, recomputed from their captured inputs with the frozen
    target weights: input layernorm, ``k_proj``/``v_proj``, the per-head ``k_norm`` (Qwen3 family)
    and the target's own RoPE, exactly as the target's attention writes its cache.

    Every KV-reuse layer must be one of the selected layers: its input is what the recomputation needs.
    """

    def __init__(self, target: nn.Module, kv_layer_ids: list[int], target_layer_ids: list[int]):
        super().__init__()
        missing = [i for i in kv_layer_ids if i not in target_layer_ids]
        if missing:
            raise ValueError(
                f"kv_reuse_layer_ids {missing} are not among the captured target_layer_ids "
                f"{target_layer_ids}; recomputing a layer's K/V needs that layer's input"
            )
        decoder = _decoder(target)
        self.slots = [target_layer_ids.index(i) for i in kv_layer_ids]
        self.num_selected = len(target_layer_ids)
        self.input_norms = nn.ModuleList(
            copy.deepcopy(decoder.layers[i].input_layernorm) for i in kv_layer_ids
        )
        self.attns = nn.ModuleList(_key_value_part(decoder.layers[i].self_attn) for i in kv_layer_ids)
        self.rotary_emb = copy.deepcopy(decoder.rotary_emb)
        attn = decoder.layers[kv_layer_ids[0]].self_attn
        self.apply_rotary_pos_emb = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.head_dim = attn.head_dim
        self.num_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.requires_grad_(False).eval()

    @torch.no_grad()
    def forward(self, layer_inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``layer_inputs``: ``[T, len(kv_layer_ids), hidden]``; ``position_ids``: ``[T]``.
        Returns ``[T, len(kv_layer_ids), 2, kv_heads, head_dim]`` fp32."""
        dtype = next(self.parameters()).dtype
        x = layer_inputs.to(dtype)
        cos, sin = self.rotary_emb(x, position_ids[None].to(x.device))
        out = []
        for i, (norm, attn) in enumerate(zip(self.input_norms, self.attns)):
            h = norm(x[None, :, i])  # [1, T, hidden]
            k = attn.k_proj(h).unflatten(-1, (-1, attn.head_dim))  # [1, T, kv_heads, D]
            if attn.k_norm is not None:
                k = attn.k_norm(k)
            v = attn.v_proj(h).unflatten(-1, (-1, attn.head_dim))
            k = k.transpose(1, 2)  # [1, kv_heads, T, D]
            _, k = self.apply_rotary_pos_emb(k, k, cos, sin)
            out.append(torch.stack([k.transpose(1, 2)[0], v[0]], dim=1))  # [T, 2, kv_heads, D]
        return torch.stack(out, dim=1).float()


class AddTargetKV:
    """speculators ``CollateFn`` preprocess adding ``item["target_kv"]`` (``[T, len(kv_layer_ids), 2,
    kv_heads, head_dim]`` fp32) from ``item["hidden_states"]`` (``[T, len(target_layer_ids) * hidden]``,
    the selected layers concatenated) and ``item["position_ids"]``."""

    def __init__(self, target_kv: TargetKV):
        self.target_kv = target_kv

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        kv = self.target_kv
        hidden = item["hidden_states"]
        T = hidden.shape[0]
        if T == 0:  # speculators' placeholder for an empty batch
            item["target_kv"] = torch.zeros(0, len(kv.slots), 2, kv.num_kv_heads, kv.head_dim)
            return item
        item["target_kv"] = kv(hidden.view(T, kv.num_selected, -1)[:, kv.slots], item["position_ids"])
        return item


def _key_value_part(attn: nn.Module) -> nn.Module:
    """The K/V half of a target attention module (the query side is not needed)."""
    part = nn.Module()
    part.k_proj = copy.deepcopy(attn.k_proj)
    part.v_proj = copy.deepcopy(attn.v_proj)
    part.k_norm = copy.deepcopy(getattr(attn, "k_norm", None))
    part.head_dim = attn.head_dim
    return part
