"""The drafter reads the target's KV pages in vLLM's CPU ``amx`` layout (bf16 on AMX CPUs) as it reads
``vec``: the caches here are written by vLLM's own ``cpu_attn_reshape_and_cache`` with ``isa="amx"``
(a layout op with no AMX instruction, so it runs on any x86 CPU), and every read is checked against
the K/V that were written, gathered in float64 through the block table; planted layout bugs fail
the same check."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridspec.engine.drafting.kv_cache import (
    block_size_of,
    gather_blocks,
    head_size_of,
    paged_kv_views,
)

from ...seeds import fresh_seed
from .test_draft_round import build


def _write(kv_cache, k, v, slots, isa):
    """vLLM 0.26's write path, as ``CPUAttentionBackendImpl.do_kv_cache_update`` calls it."""
    import vllm._custom_ops as ops

    num_blocks, heads, block_size, two_d = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)


def _random_cache(gen, num_blocks, heads, block_size, head, isa):
    """A bf16 cache with every slot written by vLLM's op (random slot order); the K/V ``[slots, heads, D]``."""
    slots = num_blocks * block_size
    k = torch.randn(slots, heads, head, generator=gen).to(torch.bfloat16)
    v = torch.randn(slots, heads, head, generator=gen).to(torch.bfloat16)
    kv_cache = torch.full((num_blocks, heads, block_size, 2 * head), float("nan"), dtype=torch.bfloat16)
    order = torch.randperm(slots, generator=gen)
    _write(kv_cache, k[order], v[order], order, isa)
    return kv_cache, k, v


def _read_back_errors(keys, values, k, v) -> tuple[float, float]:
    """Max |read - written| over every slot, reading through ``gather_blocks`` (all blocks, in order)."""
    num_blocks, heads = keys.shape[:2]
    blocks = torch.arange(num_blocks)[None]
    slots = num_blocks * block_size_of(keys)
    out = []
    for view, want in ((keys, k), (values, v)):
        got = gather_blocks(view, blocks, torch.arange(heads), slots)[0]  # [heads, slots, D]
        out.append(float((got.double() - want.transpose(0, 1).double()).abs().max()))
    return out[0], out[1]


@pytest.mark.parametrize("block_size,head,heads", [(32, 64, 2), (64, 128, 1), (128, 32, 4), (32, 256, 1)])
def test_amx_views_read_what_vllms_amx_cache_op_wrote(block_size, head, heads):
    gen = torch.Generator().manual_seed(fresh_seed(f"amx kv {block_size} {head} {heads}"))
    kv_cache, k, v = _random_cache(gen, 3, heads, block_size, head, "amx")
    keys, values = paged_kv_views(kv_cache, "CPU_ATTN", head, "amx")
    assert block_size_of(keys) == block_size_of(values) == block_size
    assert head_size_of(keys) == head_size_of(values) == head
    for view in (keys, values):  # views of the cache, no copy
        assert view.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    assert _read_back_errors(keys, values, k, v) == (0.0, 0.0)


def test_planted_layout_bugs_fail_the_read_back():
    """Negative control: reading the AMX cache with the ``vec`` layout, or with one stride of the AMX
    views wrong, reads other slots' values."""
    gen = torch.Generator().manual_seed(fresh_seed("amx kv planted"))
    block_size, head, heads = 32, 64, 2
    kv_cache, k, v = _random_cache(gen, 3, heads, block_size, head, "amx")
    keys, values = paged_kv_views(kv_cache, "CPU_ATTN", head, "amx")
    assert _read_back_errors(keys, values, k, v) == (0.0, 0.0)
    vec = paged_kv_views(kv_cache, "CPU_ATTN", head, "vec")
    planted = {
        "the vec layout": vec,
        "key token stride 1, not 2": (keys.as_strided(keys.shape, (*keys.stride()[:3], 1, *keys.stride()[4:]),
                                                      keys.storage_offset()), values),
        "value dimension stride 1, not 2": (keys, values.as_strided(values.shape, (*values.stride()[:5], 1),
                                                                      values.storage_offset())),
        "value token pairs swapped with dimension pairs": (keys, values.as_strided(
            values.shape, (*values.stride()[:3], 2, values.stride()[4], 1), values.storage_offset())),
    }
    for name, (bad_k, bad_v) in planted.items():
        errors = _read_back_errors(bad_k, bad_v, k, v)
        print(f"{name}: max read-back errors (K, V) {errors}")
        assert max(errors) > 0.5, name


def test_the_drafting_round_reads_the_amx_cache_as_the_vec_one():
    """``HSpecForVLLM.gather_prefix_kv`` on caches in the AMX layout returns the float64 reference gather
    of the written K/V through a random block table (zeros past each prefix), and a draft on it is
    bit-for-bit the draft on the same K/V in the ``vec`` layout."""
    seed = fresh_seed("amx drafting round")
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks, N, capacity = 32, 12, 3, 80
    m = build(torch.bfloat16, sliding_window=None, markov_rank=0, backend="CPU_ATTN", seed=seed % 1000,
              num_blocks=num_blocks, block_size=block_size)
    m_vec = build(torch.bfloat16, sliding_window=None, markov_rank=0, backend="CPU_ATTN", seed=seed % 1000,
                  num_blocks=num_blocks, block_size=block_size)
    written = []
    for reader, reader_vec in zip(m.kv_readers, m_vec.kv_readers):
        _, heads, _, two_d = reader.kv_cache.shape
        reader.kv_cache, k, v = _random_cache(gen, num_blocks, heads, block_size, two_d // 2, "amx")
        reader.impl.isa = "amx"
        reader_vec.kv_cache = torch.zeros_like(reader.kv_cache)
        _write(reader_vec.kv_cache, k, v, torch.arange(num_blocks * block_size), "vec")
        written.append((k, v))
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:4] for _ in range(N)]).to(torch.int32)
    prefix_lens = torch.randint(1, capacity + 1, (N,), generator=gen)
    got = m.gather_prefix_kv(block_table, capacity, prefix_lens)
    positions = torch.arange(capacity)
    slots = block_table.long()[:, positions // block_size] * block_size + positions % block_size  # [N, capacity]
    live = (positions[None] < prefix_lens[:, None])[:, None, :, None]  # [N, 1, capacity, 1]
    for (k, v), (gk, gv) in zip(written, got):
        for g, w in ((gk, k), (gv, v)):
            ref = w.double()[slots].permute(0, 2, 1, 3) * live  # [N, heads, capacity, D]
            assert g.dtype == torch.bfloat16 and torch.equal(g.double(), ref)

    n_sel = len(m.config.aux_hidden_state_layer_ids)
    last_hidden = torch.randn(N, n_sel * m.config.transformer_layer_config.hidden_size, generator=gen).to(torch.bfloat16)
    anchors = torch.randint(0, 95, (N,), generator=gen, dtype=torch.int32)
    for model in (m, m_vec):
        model.upcast_ssm_parameters()  # what HSpecProposer.load_model does after loading
    with torch.inference_mode():
        draft = m.draft(last_hidden, anchors, got, prefix_lens, 3)
        draft_vec = m_vec.draft(last_hidden, anchors, m_vec.gather_prefix_kv(block_table, capacity, prefix_lens),
                                prefix_lens, 3)
    assert torch.equal(draft.tokens, draft_vec.tokens)
    assert torch.equal(draft.top1_prob, draft_vec.top1_prob) and torch.equal(draft.entropy, draft_vec.entropy)
