"""Attention that reads a target layer's K/V in place (H-Spec paper, section 3.3.2).

Each drafter attention module has the target's Q/K/V geometry (heads, KV heads, head dim) and
RoPE (theta, partial rotary factor), so the post-RoPE keys and values the target stored for the
prefix are used as they are. The block's own queries, keys and values come from the drafter's
projections (Qwen3-style per-head RMSNorm on q and k), rotated at positions that continue the
target prefix; the block's K/V live only inside one forward and are never written to the target's
cache. Queries see the prefix inside a sliding window and the block causally.

Keys are laid out ``[prefix (T) | block (Lq)]``; a boolean mask ``[B, 1, Lq, T + Lq]`` says what each
query sees. Two layouts use the same module:

* serving: ``B`` requests, one block of ``L`` queries each, each with its own prefix
  (:func:`request_block_mask`);
* training: ``B = 1``, the ``N`` anchored blocks of one packed sequence laid out one after another
  (``Lq = N * L``), all reading the packed sequence's K/V (:func:`anchored_block_mask`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE on the first ``int(head_dim * partial_rotary_factor)`` channels,
    rotate-half style, as transformers' Qwen3 / Qwen3-Next and vLLM's ``get_rope`` compute it."""

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float = 1.0):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(
                f"head_dim * partial_rotary_factor = {head_dim} * {partial_rotary_factor} "
                "must be a positive even number of rotated channels"
            )
        self.theta = theta

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[B, Lq]`` -> ``(cos, sin)``, each ``[B, Lq, rotary_dim]`` in ``dtype``."""
        # computed per call rather than kept in a buffer: a non-persistent buffer is not restored when
        # transformers builds the model on the meta device in from_pretrained
        exponents = (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.float, device=positions.device) / self.rotary_dim
        )
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[B, heads, Lq, head_dim]``; ``cos``/``sin``: ``[B, Lq, rotary_dim]``."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)`` as two batched
    matmuls with each KV head's query heads stacked (``[B, kv_heads, group * Lq, D]``), the scores and
    the softmax in float32. For a block of a few queries over a short prefix this is four small
    kernels where the fused SDPA kernels tile for long sequences (``docs/benchmarks/choices.md``).

    ``q`` ``[B, heads, Lq, D]``, ``keys`` / ``values`` ``[B, kv_heads, S, D]``, ``mask`` ``[B, 1, Lq, S]``
    bool (every query sees at least one key) -> ``[B, heads, Lq, D]`` in ``q``'s dtype."""
    B, H, Lq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * Lq, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).view(B, Hkv, G, Lq, S).float() * (D ** -0.5)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # mask [B, 1, 1, Lq, S]
    probs = scores.softmax(-1).to(values.dtype).view(B, Hkv, G * Lq, S)
    return torch.matmul(probs, values).view(B, H, Lq, D)


class TargetKVAttention(nn.Module):
    grouped = False  # True: grouped_attention in place of F.scaled_dot_product_attention (use_grouped_attention)

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden``: ``[B, Lq, hidden]``; ``cos``/``sin``: ``[B, Lq, rotary_dim]``;
        ``prefix_k``/``prefix_v``: ``[B, kv_heads, T, head_dim]``, post-RoPE, read in place;
        ``mask``: ``[B, 1, Lq, T + Lq]`` bool. Returns ``[B, Lq, hidden]``."""
        B, Lq, _ = hidden.shape
        if prefix_k.shape[1] != self.num_kv_heads or prefix_k.shape[-1] != self.head_dim:
            raise ValueError(
                f"prefix K/V must be [B, {self.num_kv_heads}, T, {self.head_dim}] to match this "
                f"layer, got {list(prefix_k.shape)}"
            )
        q = self.q_norm(self.q_proj(hidden).view(B, Lq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden).view(B, Lq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden).view(B, Lq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = torch.cat([prefix_k.to(k.dtype), k], dim=2)  # [B, kv_heads, T + Lq, head_dim]
        values = torch.cat([prefix_v.to(v.dtype), v], dim=2)
        if self.grouped:
            out = grouped_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # [B, heads, Lq, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Lq, self.num_heads * self.head_dim))


def request_block_mask(
    prefix_lens: torch.Tensor, prefix_capacity: int, block_size: int, sliding_window: int | None
) -> torch.Tensor:
    """Serving layout: request ``i``'s prefix occupies key slots ``[0, prefix_lens[i])`` of a
    ``prefix_capacity``-long prefix; its block sits at positions ``prefix_lens[i] + [0, block_size)``.

    Returns ``[N, 1, block_size, prefix_capacity + block_size]`` bool."""
    device = prefix_lens.device
    q_pos = prefix_lens[:, None] + torch.arange(block_size, device=device)  # [N, L]
    kv_pos = torch.arange(prefix_capacity, device=device)  # [T]
    prefix = kv_pos[None, None, :] < prefix_lens[:, None, None]  # [N, 1, T]
    if sliding_window is not None:
        prefix = prefix & (kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window)  # [N, L, T]
    prefix = prefix.expand(-1, block_size, -1)
    block = torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril()
    return torch.cat([prefix, block.expand(len(prefix_lens), -1, -1)], dim=-1)[:, None]


def anchored_block_mask(
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Training layout: block ``j`` starts at packed index ``anchors[j]`` and sees the tokens of its
    own document before the anchor (within the window) and its own block causally, exactly what
    :func:`request_block_mask` gives a request whose prefix is that document up to the anchor.

    ``document_ids``, ``position_ids``: ``[T]`` (document -1 is padding); ``anchors``: ``[N]``.
    Returns ``[1, 1, N * L, T + N * L]`` bool."""
    device = anchors.device
    T, N, L = document_ids.shape[0], anchors.shape[0], block_size
    q_anchor = anchors.repeat_interleave(L)  # [N*L]
    q_pos = position_ids[q_anchor] + torch.arange(L, device=device).repeat(N)  # [N*L]
    q_doc = document_ids[q_anchor]
    kv = torch.arange(T, device=device)
    prefix = (
        (document_ids[None, :] == q_doc[:, None]) & (q_doc[:, None] >= 0) & (kv[None, :] < q_anchor[:, None])
    )
    if sliding_window is not None:
        prefix = prefix & (position_ids[None, :] > q_pos[:, None] - sliding_window)
    q_block = torch.arange(N * L, device=device)
    block = (q_block[:, None] // L == q_block[None, :] // L) & (q_block[None, :] <= q_block[:, None])
    return torch.cat([prefix, block], dim=-1)[None, None]


def use_grouped_attention(model: nn.Module, on: bool = True) -> int:
    """Every :class:`TargetKVAttention` of ``model`` through :func:`grouped_attention` (``on``) or SDPA;
    returns how many modules were set."""
    n = 0
    for module in model.modules():
        if isinstance(module, TargetKVAttention):
            module.grouped = on
            n += 1
    return n
