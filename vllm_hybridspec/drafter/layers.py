"""The H-Spec drafter's layers (paper section 3.3): the state injection that starts every Mamba-2
layer from the target's last-token hidden states (section 3.3.1), and one decoder layer (Mamba-2,
optional attention over the target's K/V, MLP). ``DraftBlock`` is what a drafting round returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from vllm_hybridspec.drafter.attention import TargetKVAttention
from vllm_hybridspec.drafter.config import HSpecSpeculatorConfig
from vllm_hybridspec.drafter.mamba2 import Mamba2Mixer


@dataclass
class DraftBlock:
    """One drafted block per request; ``K = block_size - 1`` draft positions."""

    tokens: torch.Tensor  # [N, K] long, target-vocabulary ids
    top1_prob: torch.Tensor  # [N, K] fp32, probability of the drafted token
    entropy: torch.Tensor  # [N, K] fp32, entropy (nats) of the draft distribution


class StateInjection(nn.Module):
    """``S_init = Proj_dS(Proj_r(concat_m h_n^(m)))`` (section 3.3.1), with an RMSNorm after the
    rank-r projection because the selected layers' hidden states differ widely in scale."""

    def __init__(self, in_features: int, rank: int, state_shape: tuple[int, int, int], eps: float):
        super().__init__()
        self.state_shape = state_shape
        self.proj_r = nn.Linear(in_features, rank, bias=False)
        self.norm = Qwen3RMSNorm(rank, eps=eps)
        self.proj_state = nn.Linear(rank, state_shape[0] * state_shape[1] * state_shape[2], bias=False)

    @classmethod
    def for_config(cls, config: HSpecSpeculatorConfig, state_shape: tuple[int, int, int]) -> StateInjection:
        """The injection of ``config``'s drafter: the selected target layers' hidden states in, the
        Mamba-2 state ``state_shape`` out, through rank ``fusion_rank`` (default: the hidden size)."""
        tl = config.transformer_layer_config
        return cls(len(config.aux_hidden_state_layer_ids) * tl.hidden_size, config.fusion_rank or tl.hidden_size,
                   state_shape, tl.rms_norm_eps)

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """``last_hidden``: ``[N, n_selected * hidden]`` -> ``[N, heads, head_dim, d_state]`` fp32."""
        state = self.proj_state(self.norm(self.proj_r(last_hidden.to(self.proj_r.weight.dtype))))
        return state.float().view(-1, *self.state_shape)


class HSpecLayer(nn.Module):
    """Mamba-2 -> attention (optional) -> MLP, each pre-normed with a residual."""

    def __init__(self, config: HSpecSpeculatorConfig, with_attention: bool):
        super().__init__()
        tl = config.transformer_layer_config
        g = config.attention_geometry
        self.mamba_norm = Qwen3RMSNorm(tl.hidden_size, eps=tl.rms_norm_eps)
        self.mamba = Mamba2Mixer(
            tl.hidden_size,
            config.mamba_heads,
            config.mamba_head_dim,
            config.mamba_d_state,
            config.mamba_n_groups,
            config.mamba_d_conv,
            config.mamba_chunk_size,
        )
        self.attn_norm = Qwen3RMSNorm(tl.hidden_size, eps=tl.rms_norm_eps) if with_attention else None
        self.self_attn = (
            TargetKVAttention(
                tl.hidden_size, g.num_attention_heads, g.num_key_value_heads, g.head_dim, tl.rms_norm_eps
            )
            if with_attention
            else None
        )
        self.mlp_norm = Qwen3RMSNorm(tl.hidden_size, eps=tl.rms_norm_eps)
        self.mlp = Qwen3MLP(tl)

    def forward(
        self,
        hidden: torch.Tensor,
        initial_state: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``hidden``: ``[N, L, hidden]``; ``cos``/``sin`` and ``mask`` in the attention layout
        (``[N, L, .]`` per request, or ``[1, N * L, .]`` packed, see ``attention.py``)."""
        N, L, d = hidden.shape
        hidden = hidden + self.mamba(self.mamba_norm(hidden), initial_state)
        if self.self_attn is not None:
            x = self.attn_norm(hidden).reshape(cos.shape[0], -1, d)
            hidden = hidden + self.self_attn(x, cos, sin, *prefix_kv, mask).reshape(N, L, d)
        return hidden + self.mlp(self.mlp_norm(hidden))
