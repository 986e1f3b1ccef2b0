"""One vLLM drafting round (``HSpecForVLLM.gather_prefix_kv`` + ``draft``, no engine) is bit-for-bit the
round as it was first written: the prefix gather as ``cache[blocks]`` + transpose per K and V,
``request_block_mask``, the drafter's ``RotaryEmbedding``, and the Markov head with ``argmax`` /
``gather`` / ``.float()`` per position. The round now builds its constants once, gathers each layer's
K/V in one read, and runs fewer kernels per draft position; none of that may change a bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm_hybridspec.drafter import (
    DraftBlock,
    HSpecDraftModel,
    HSpecSpeculatorConfig,
    default_layer_selection,
)
from vllm_hybridspec.drafter.attention import request_block_mask

from vllm_hybridspec.engine.drafting.model import HSpecForVLLM
from vllm_hybridspec.engine.options import HybridSpecOptions
from vllm_hybridspec.engine.length.selector import LengthSelector
from vllm_hybridspec.engine.drafting.kv_cache import paged_kv_views

from ...tiny_models import MASK, tiny_qwen3_config
from ...seeds import fresh_seed

K = 7


class _Backend:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


class _Reader(nn.Module):
    """What the drafter reads of a vLLM ``Attention`` layer: its bound cache and backend."""

    def __init__(self, kv_cache, head_size, backend):
        super().__init__()
        self.kv_cache, self.head_size, self.backend = kv_cache, head_size, _Backend(backend)
        self.impl = SimpleNamespace(isa="vec")

    def get_attn_backend(self):
        return self.backend


def build(dtype, sliding_window, markov_rank, backend, seed=0, num_blocks=48, block_size=16):
    """An ``HSpecForVLLM`` on a tiny drafter's modules (random weights) reading random paged caches."""
    target = tiny_qwen3_config(head_dim=32, num_hidden_layers=8)
    selected, kv = default_layer_selection(target)
    config = HSpecSpeculatorConfig.from_target(
        target, None, selected, kv, mask_token_id=MASK, mamba_num_heads=4, mamba_head_dim=16,
        markov_rank=markov_rank, num_layers=4, sliding_window=sliding_window)
    torch.manual_seed(seed)
    drafter = HSpecDraftModel(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if not p.isfinite().all():  # the verifier's embedding and LM heads, left for loading
                p.copy_(0.3 * torch.randn(p.shape))
            elif name.endswith(("A_log", "D", "dt_bias", "norm.weight")):  # non-trivial, not all ones
                p.add_(0.3 * torch.randn_like(p))
    assert all(p.isfinite().all() for p in drafter.parameters())
    m = HSpecForVLLM.__new__(HSpecForVLLM)
    nn.Module.__init__(m)
    m.config = drafter.config
    m.layers, m.state_injection, m.rotary_emb = drafter.layers, drafter.state_injection, drafter.rotary_emb
    m.norm, m.markov_head, m.embed_tokens = drafter.norm, drafter.markov_head, drafter.embed_tokens
    m.target_compute_logits = drafter.lm_head
    m._constants, m._upcast_dtypes, m._retired_constants = {}, {}, []
    g = config.attention_geometry
    gen = torch.Generator().manual_seed(seed + 1)
    m.kv_readers = nn.ModuleList(
        _Reader(torch.randn(num_blocks, g.num_key_value_heads, block_size, 2 * g.head_dim, generator=gen).to(dtype),
                g.head_dim, backend)
        for _ in config.kv_reuse_layer_ids)
    return m


# --- the round as first written ---------------------------------------------------------------------


def old_gather_prefix_kv(m, block_table, capacity):
    out = []
    for reader in m.kv_readers:
        k_cache, v_cache = paged_kv_views(reader.kv_cache, reader.get_attn_backend().get_name(), reader.head_size,
                                          reader.impl.isa)
        blocks = block_table[:, : -(-capacity // k_cache.shape[2])].long()
        pair = []
        for cache in (k_cache, v_cache):
            x = cache[blocks]
            N, n_blocks, heads, block_size, _ = x.shape
            pair.append(x.transpose(1, 2).reshape(N, heads, n_blocks * block_size, -1)[:, :, :capacity])
        out.append(tuple(pair))
    return out


def old_draft(m, last_hidden, anchor_ids, prefix_kv, prefix_lens, num_draft):
    N, L = anchor_ids.shape[0], num_draft + 1
    device = anchor_ids.device
    capacity = prefix_kv[0][0].shape[2] if prefix_kv else 0
    positions = prefix_lens[:, None].long() + torch.arange(L, device=device)
    block_ids = torch.full((N, L), m.config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = anchor_ids
    mask = request_block_mask(prefix_lens.long(), capacity, L, m.config.sliding_window)
    state = m.state_injection(last_hidden)
    hidden = m.embed_tokens(block_ids)
    cos, sin = m.rotary_emb(positions, hidden.dtype)
    kv = iter(prefix_kv)
    for layer in m.layers:
        hidden = layer(hidden, state, cos, sin, next(kv) if layer.self_attn is not None else None, mask)
    N, L, d = hidden.shape
    logits = m.compute_logits(m.norm(hidden[:, 1:]).reshape(-1, d)).float().view(N, L - 1, -1)
    prev = anchor_ids
    tokens, top1, entropy = [], [], []
    for k in range(L - 1):
        step = logits[:, k]
        if m.markov_head is not None:
            step = step + m.markov_head.markov_w2(m.markov_head.prev_embeddings(prev)).float()
        logp = torch.log_softmax(step, dim=-1)
        best = logp.argmax(dim=-1)
        top1.append(logp.gather(-1, best[:, None]).squeeze(-1).exp())
        entropy.append(-(logp.exp() * logp).sum(-1))
        prev = best
        tokens.append(best)
    return DraftBlock(torch.stack(tokens, 1), torch.stack(top1, 1), torch.stack(entropy, 1))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(torch.uint8) == b.view(torch.uint8)).all()) \
        if a.is_floating_point() else (a.dtype == b.dtype and torch.equal(a, b))


# --- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "CPU_ATTN"])
@pytest.mark.parametrize(("N", "sliding_window", "markov_rank"), [(1, 2048, 16), (3, 20, 16), (4, 60, 0)])
def test_round_is_bit_identical_to_the_first_version(dtype, backend, N, sliding_window, markov_rank):
    m = build(dtype, sliding_window, markov_rank, backend, seed=N)
    gen = torch.Generator().manual_seed(10 + N)
    prefix_lens = torch.randint(1, 60, (N,), generator=gen, dtype=torch.int32)
    capacity = int(prefix_lens.max()) + 3  # as vLLM's max_seq_len: at least every prefix
    block_table = torch.randperm(48, generator=gen)[: N * 5].view(N, 5).to(torch.int32)
    n_sel = len(m.config.aux_hidden_state_layer_ids)
    last_hidden = torch.randn(N, n_sel * m.config.transformer_layer_config.hidden_size, generator=gen).to(dtype)
    anchors = torch.randint(0, 95, (N,), generator=gen, dtype=torch.int32)

    with torch.inference_mode():
        ref_kv = old_gather_prefix_kv(m, block_table, capacity)
        ref = old_draft(m, last_hidden, anchors, ref_kv, prefix_lens, K)
    m.upcast_ssm_parameters()  # what HSpecProposer.load_model does after loading
    for _ in range(2):  # the second round reads the constants the first one cached
        with torch.inference_mode():
            prefix_kv = m.gather_prefix_kv(block_table, capacity)
            block = m.draft(last_hidden, anchors, prefix_kv, prefix_lens, K)
        for (k, v), (rk, rv) in zip(prefix_kv, ref_kv, strict=True):
            assert bits_equal(k, rk) and bits_equal(v, rv)
        assert bits_equal(block.tokens, ref.tokens)
        assert bits_equal(block.top1_prob, ref.top1_prob)
        assert bits_equal(block.entropy, ref.entropy)


def test_mask_and_rope_equal_the_drafter_functions():
    m = build(torch.float32, 40, 16, "FLASH_ATTN")
    gen = torch.Generator().manual_seed(0)
    for capacity, window in [(1, 40), (30, 40), (33, 40), (70, 40), (50, None)]:
        m.config.sliding_window = window
        prefix_lens = torch.randint(1, capacity + 1, (5,), generator=gen)
        positions = prefix_lens[:, None] + torch.arange(K + 1)
        want = request_block_mask(prefix_lens, capacity, K + 1, window)
        assert torch.equal(m._block_mask(prefix_lens, positions, capacity, K + 1), want)
    for dtype in (torch.float32, torch.bfloat16):
        positions = torch.randint(0, 100_000, (3, K + 1), generator=gen)
        for got, want in zip(m._rope(positions, dtype), m.rotary_emb(positions, dtype), strict=True):
            assert bits_equal(got, want)


def test_upcast_ssm_parameters_and_reload_round_as_loaded():
    m = build(torch.bfloat16, 2048, 16, "FLASH_ATTN")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.upcast_ssm_parameters()
    upcast = {n for n, p in m.named_parameters() if p.dtype == torch.float32}
    assert upcast == set(m._upcast_dtypes) and len(upcast) == 4 * 4  # A_log, D, dt_bias, norm weight x 4
    for n, p in m.named_parameters():
        assert torch.equal(p.float(), before[n].float())  # the same numbers
    name = "layers.0.mamba.A_log"
    gen = torch.Generator().manual_seed(fresh_seed("draft_round_reload"))
    fresh = torch.randn(before[name].shape, dtype=torch.float32, generator=gen)
    m.load_weights([(name, fresh)])
    assert torch.equal(m.get_parameter(name), fresh.to(torch.bfloat16).float())


@pytest.mark.parametrize("fixed", [1, 3, 8])
def test_fixed_length_selection_counts(fixed):
    sel = LengthSelector(HybridSpecOptions(fixed_length=fixed), K, torch.device("cpu"), max_num_reqs=8)
    w_rem = torch.tensor([1, 2, 5, 8, 8], dtype=torch.int64)
    drafts = torch.zeros(5, K, dtype=torch.int64)
    ids = list("abcde")
    gen = torch.Generator().manual_seed(fresh_seed("draft_round_fixed_length"))
    w = sel.select(drafts, torch.rand(5, K, generator=gen), torch.rand(5, K, generator=gen), w_rem, ids).w
    want = torch.minimum(torch.full_like(w_rem, fixed), w_rem)
    assert w.dtype == torch.int32 and w.tolist() == want.tolist()
    sel.select(drafts, torch.rand(5, K, generator=gen), torch.rand(5, K, generator=gen), w_rem, ids)
    counts = torch.zeros(K + 2, dtype=torch.int64)
    counts.index_add_(0, want, torch.full_like(want, 2))
    assert sel.length_counts.tolist() == counts.tolist()

