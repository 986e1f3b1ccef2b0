"""Target-KV-reuse attention: RoPE identical to the target's, masks, and the two layouts."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rope
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb as qwen3_next_rope
from vllm_hybridspec.drafter import AttentionGeometry
from vllm_hybridspec.drafter.attention import (
    RotaryEmbedding,
    TargetKVAttention,
    anchored_block_mask,
    apply_rotary,
    grouped_attention,
    request_block_mask,
    use_grouped_attention,
)
from vllm_hybridspec.drafter import attention as attention_module

from ..seeds import fresh_seed

from .conftest import tiny_qwen3_config


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_rope_matches_the_targets(family):
    """Block queries/keys are rotated exactly as the target rotates the keys it caches, including
    Qwen3-Next's partial rotary factor (0.25)."""
    if family == "qwen3":
        config, rotary, rope = (
            tiny_qwen3_config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
            Qwen3RotaryEmbedding,
            qwen3_rope,
        )
    else:
        config = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        rotary, rope = Qwen3NextRotaryEmbedding, qwen3_next_rope
    g = AttentionGeometry.of(config)
    assert (family == "qwen3_next") == (g.partial_rotary_factor == 0.25)
    gen = torch.Generator().manual_seed(fresh_seed(f"attention_rope_{family}"))
    positions = torch.randint(0, 3000, (2, 9), generator=gen)
    x = torch.randn(2, 3, 9, g.head_dim, generator=gen)
    cos_t, sin_t = rotary(config)(x, positions)
    _, expected = rope(x, x, cos_t, sin_t)
    cos, sin = RotaryEmbedding(g.head_dim, g.rope_theta, g.partial_rotary_factor)(positions, x.dtype)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=0, atol=0)


def reference_attention(attn, hidden, positions, prefix_k, prefix_v, prefix_lens, window):
    """One query at a time: softmax over the visible prefix keys and the block keys up to itself."""
    B, L, _ = hidden.shape
    rope = RotaryEmbedding(attn.head_dim, 1e4)
    cos, sin = rope(positions, hidden.dtype)
    q = apply_rotary(attn.q_norm(attn.q_proj(hidden).view(B, L, -1, attn.head_dim)).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.k_norm(attn.k_proj(hidden).view(B, L, -1, attn.head_dim)).transpose(1, 2), cos, sin)
    v = attn.v_proj(hidden).view(B, L, -1, attn.head_dim).transpose(1, 2)
    group = attn.num_heads // attn.num_kv_heads
    out = torch.zeros(B, attn.num_heads, L, attn.head_dim, dtype=hidden.dtype)
    for b in range(B):
        for h in range(attn.num_heads):
            for i in range(L):
                qpos = positions[b, i].item()
                keys, values = [], []
                for j in range(prefix_lens[b].item()):
                    if j > qpos - window:
                        keys.append(prefix_k[b, h // group, j]), values.append(prefix_v[b, h // group, j])
                for j in range(i + 1):
                    keys.append(k[b, h // group, j]), values.append(v[b, h // group, j])
                scores = torch.stack(keys) @ q[b, h, i] / math.sqrt(attn.head_dim)
                out[b, h, i] = torch.softmax(scores, 0) @ torch.stack(values)
    return attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))


def test_attention_over_prefix_and_block_matches_reference():
    torch.manual_seed(0)
    attn = TargetKVAttention(64, 4, 2, 16, 1e-6).double()
    T, L, window = 12, 5, 6
    prefix_lens = torch.tensor([12, 7, 3])
    positions = prefix_lens[:, None] + torch.arange(L)
    hidden = torch.randn(3, L, 64, dtype=torch.float64)
    prefix_k, prefix_v = torch.randn(2, 3, 2, T, 16, dtype=torch.float64)
    cos, sin = RotaryEmbedding(16, 1e4)(positions, hidden.dtype)
    out = attn(hidden, cos, sin, prefix_k, prefix_v, request_block_mask(prefix_lens, T, L, window))
    torch.testing.assert_close(
        out, reference_attention(attn, hidden, positions, prefix_k, prefix_v, prefix_lens, window)
    )


def _grouped_error(seed: int, dtype: torch.dtype) -> float:
    """Largest |grouped - float64 reference| of a TargetKVAttention (8 heads over 2 KV heads, window 6)
    at ``dtype``, on fresh random inputs."""
    torch.manual_seed(seed)
    attn = TargetKVAttention(64, 8, 2, 16, 1e-6)
    T, L, window = 12, 5, 6
    prefix_lens = torch.randint(1, T + 1, (3,))
    positions = prefix_lens[:, None] + torch.arange(L)
    hidden = torch.randn(3, L, 64, dtype=torch.float64)
    prefix_k, prefix_v = torch.randn(2, 3, 2, T, 16, dtype=torch.float64)
    ref = reference_attention(attn.double(), hidden, positions, prefix_k, prefix_v, prefix_lens, window)
    attn = attn.to(dtype)
    assert use_grouped_attention(attn) == 1
    cos, sin = RotaryEmbedding(16, 1e4)(positions, dtype)
    out = attn(hidden.to(dtype), cos, sin, prefix_k.to(dtype), prefix_v.to(dtype),
               request_block_mask(prefix_lens, T, L, window))
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


def test_grouped_attention_matches_the_reference(monkeypatch):
    """The grouped matmul form (what the engine's drafter runs on GPUs) against the float64 loop
    reference: float32 to rounding, bfloat16 within a few bf16 ulps of the output's scale; a planted
    bug, the query heads grouped by ``h % kv_heads`` instead of ``h // group``, is caught."""
    seed = fresh_seed("grouped attention")
    assert _grouped_error(seed, torch.float32) < 1e-5
    assert _grouped_error(seed, torch.bfloat16) < 3e-2

    def interleaved(q, keys, values, mask):  # the planted bug
        B, H, Lq, D = q.shape
        G = H // keys.shape[1]
        qi = q.view(B, G, H // G, Lq, D).transpose(1, 2)
        out = grouped_attention(qi.reshape(B, H, Lq, D), keys, values, mask)
        return out.view(B, H // G, G, Lq, D).transpose(1, 2).reshape(B, H, Lq, D)

    monkeypatch.setattr(attention_module, "grouped_attention", interleaved)
    assert _grouped_error(seed, torch.float32) > 1e-2


def test_grouped_attention_equals_sdpa_on_random_shapes():
    """grouped_attention against torch's SDPA (float64), over random batch, group, query and key counts."""
    g = torch.Generator().manual_seed(fresh_seed("grouped attention shapes"))
    for _ in range(6):
        B, Hkv, G, Lq, T, D = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                               ((1, 5), (1, 4), (1, 5), (1, 17), (0, 40), (4, 33)))
        q = torch.randn(B, Hkv * G, Lq, D, generator=g, dtype=torch.float64)
        k, v = torch.randn(2, B, Hkv, T + Lq, D, generator=g, dtype=torch.float64)
        mask = request_block_mask(torch.randint(0, T + 1, (B,), generator=g), T, Lq, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(grouped_attention(q, k, v, mask), ref, rtol=1e-6, atol=1e-6)


def test_prefix_padding_and_window_are_ignored():
    """Garbage in unused prefix slots (beyond a request's length, or outside the window) changes nothing."""
    torch.manual_seed(1)
    attn = TargetKVAttention(64, 4, 2, 16, 1e-6)
    T, L = 10, 4
    prefix_lens = torch.tensor([6, 10])
    positions = prefix_lens[:, None] + torch.arange(L)
    hidden = torch.randn(2, L, 64)
    k, v = torch.randn(2, 2, 2, T, 16)
    cos, sin = RotaryEmbedding(16, 1e4)(positions, hidden.dtype)
    mask = request_block_mask(prefix_lens, T, L, sliding_window=8)
    base = attn(hidden, cos, sin, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 6:], v2[0, :, 6:] = 1e3, -1e3  # request 0's padding
    k2[1, :, :3], v2[1, :, :3] = 1e3, -1e3  # request 1: positions 10..13 with window 8 see prefix 3..9 only
    torch.testing.assert_close(attn(hidden, cos, sin, k2, v2, mask), base)


def test_anchored_mask_equals_request_masks():
    """Each training block sees exactly what a request whose prefix ends at its anchor sees."""
    document_ids = torch.tensor([0] * 9 + [1] * 7 + [-1] * 4)
    position_ids = torch.cat([torch.arange(9), torch.arange(7), torch.zeros(4, dtype=torch.long)])
    anchors, L, T = torch.tensor([3, 8, 11, 14]), 3, 20
    mask = anchored_block_mask(document_ids, position_ids, anchors, L, sliding_window=4)[
        0, 0
    ]  # [N*L, T + N*L]
    for j, a in enumerate(anchors.tolist()):
        doc_start = (document_ids == document_ids[a]).nonzero()[0].item()
        prefix_len = a - doc_start
        expected = request_block_mask(torch.tensor([prefix_len]), prefix_len, L, sliding_window=4)[0, 0]
        rows = mask[j * L : (j + 1) * L]
        torch.testing.assert_close(rows[:, doc_start:a], expected[:, :prefix_len])
        assert not rows[:, :doc_start].any() and not rows[:, a:T].any()
        torch.testing.assert_close(rows[:, T + j * L : T + (j + 1) * L], expected[:, prefix_len:])
        assert rows[:, T:].sum() == expected[:, prefix_len:].sum()  # nothing from other blocks
