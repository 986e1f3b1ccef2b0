"""The padded rounds ``DraftGraphs`` replays (batch padded to a bucket, prefix capacity padded to a power
of two) draft what the eager round of the unpadded batch drafts. On the CPU the padded rounds run
without ``torch.cuda.CUDAGraph`` (``capture=False``); the inputs, padding and outputs are the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridspec.engine.drafting.graphs import (
    DraftGraphs,
    batch_buckets,
    bucket,
    capacity_bucket,
    drafter_graphs_enabled,
)

from .test_draft_round import K, build


def _inputs(m, N, gen, dtype, max_prefix=60, width=5, num_blocks=48):
    prefix_lens = torch.randint(1, max_prefix, (N,), generator=gen, dtype=torch.int32)
    block_table = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(N)]).to(torch.int32)
    n_sel = len(m.config.aux_hidden_state_layer_ids)
    last_hidden = torch.randn(N, n_sel * m.config.transformer_layer_config.hidden_size, generator=gen).to(dtype)
    anchors = torch.randint(0, 95, (N,), generator=gen)
    return last_hidden, anchors, block_table, prefix_lens


def _eager(m, last_hidden, anchors, block_table, prefix_lens, capacity):
    with torch.inference_mode():
        return m.draft(last_hidden, anchors, m.gather_prefix_kv(block_table, capacity), prefix_lens, K)


def _config(options=None, enforce_eager=False, mode="FULL_AND_PIECEWISE"):
    return SimpleNamespace(additional_config={} if options is None else {"hybridspec": options},
                           model_config=SimpleNamespace(enforce_eager=enforce_eager),
                           compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode)))


def test_graphs_are_on_for_gpu_engines_that_use_graphs():
    assert drafter_graphs_enabled(_config(), "cuda:0")
    assert drafter_graphs_enabled(_config({"gdn_kernel": True}), "cuda")
    assert not drafter_graphs_enabled(_config(), "cpu")
    assert not drafter_graphs_enabled(_config(enforce_eager=True), "cuda:0")
    assert not drafter_graphs_enabled(_config(mode="NONE"), "cuda:0")
    assert not drafter_graphs_enabled(_config({"drafter_cudagraphs": False}), "cuda:0")


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(256)[-3:] == (128, 192, 256)
    sizes = (1, 2, 4, 8)
    assert [bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [capacity_bucket(c, 1000) for c in (1, 64, 65, 200, 513, 999, 1000, 5000)] == [
        64, 64, 128, 256, 1000, 1000, 1000, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("sliding_window", "markov_rank"), [(2048, 16), (20, 0)])
def test_padded_rounds_draft_what_the_eager_round_drafts(dtype, sliding_window, markov_rank):
    """Batches of 3, 4, 1 and 3 again (padded to 4, 4, 1, 4: the third N = 3 round meets the stale rows
    of the N = 4 round), capacities from 9 to 63 (padded to 64)."""
    m = build(dtype, sliding_window, markov_rank, "FLASH_ATTN", seed=5)
    m.upcast_ssm_parameters()
    graphs = DraftGraphs(m, batch_sizes=(1, 2, 4, 8), capture=False)
    gen = torch.Generator().manual_seed(21)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for N in (3, 4, 1, 3):
        last_hidden, anchors, block_table, prefix_lens = _inputs(m, N, gen, dtype)
        capacity = int(prefix_lens.max()) + 2
        ref = _eager(m, last_hidden, anchors, block_table, prefix_lens, capacity)
        with torch.inference_mode():
            got = graphs.run(last_hidden, anchors, block_table, prefix_lens, capacity, K)
        assert got is not None and got.tokens.shape == (N, K)
        assert torch.equal(got.tokens, ref.tokens)
        torch.testing.assert_close(got.top1_prob, ref.top1_prob, rtol=tol, atol=tol)
        torch.testing.assert_close(got.entropy, ref.entropy, rtol=tol, atol=tol)
    assert set(graphs.rounds) == {(4, 64, K, 5), (1, 64, K, 5)}


def test_returned_drafts_are_not_the_rounds_buffers():
    """The caller may keep (and the selector trims) a round's drafts while the next round runs."""
    m = build(torch.float32, 2048, 16, "FLASH_ATTN", seed=6)
    graphs = DraftGraphs(m, batch_sizes=(2,), capture=False)
    gen = torch.Generator().manual_seed(22)
    first_in = _inputs(m, 2, gen, torch.float32)
    with torch.inference_mode():
        first = graphs.run(*first_in, 62, K)  # prefixes are < 60 tokens long
        kept = first.tokens.clone()
        graphs.run(*_inputs(m, 2, gen, torch.float32), 62, K)
    assert torch.equal(first.tokens, kept)
    ref = _eager(m, *first_in, 62)
    assert torch.equal(kept, ref.tokens)


def test_rounds_past_the_buckets_or_the_block_tables_reach_run_eagerly():
    m = build(torch.float32, 2048, 16, "FLASH_ATTN", seed=7)
    graphs = DraftGraphs(m, batch_sizes=(1, 2), capture=False)
    gen = torch.Generator().manual_seed(23)
    with torch.inference_mode():
        assert graphs.run(*_inputs(m, 3, gen, torch.float32), 62, K) is None  # 3 requests > largest bucket
        # a 5-block table of 16-token blocks reaches 80 slots
        assert graphs.run(*_inputs(m, 2, gen, torch.float32), 81, K) is None
        assert graphs.run(*_inputs(m, 2, gen, torch.float32), 80, K) is not None
    assert list(graphs.rounds) == [(2, 80, K, 5)]


@pytest.mark.parametrize(("total", "tp"), [(4, 2), (2, 4), (1, 2), (8, 8), (3, 1)])
def test_all_kv_heads_restores_the_targets_heads_from_the_ranks_shards(monkeypatch, total, tp):
    """vLLM's KV-head sharding: ``total >= tp``: rank r caches heads [r*total/tp, (r+1)*total/tp); fewer
    heads than ranks: rank r caches head r * total // tp (replicated). The all-gather (faked here as
    the concatenation of every rank's shard, in rank order) must give the heads in order, once each."""
    from vllm_hybridspec.engine.drafting import kv_cache as hspec

    gen = torch.Generator().manual_seed(total * 10 + tp)
    full = torch.randn(3, total, 5, 8, generator=gen)  # [N, heads, T, D], fresh per case
    per_rank = max(total // tp, 1)
    shards = [full[:, r * per_rank:(r + 1) * per_rank] if total >= tp else full[:, r * total // tp:][:, :1]
              for r in range(tp)]
    gathers = []
    monkeypatch.setattr(hspec, "tp_all_gather", lambda t, dim: gathers.append(t) or torch.cat(shards, dim=dim))
    assert hspec.kv_heads_recoverable(per_rank, tp, total)
    for r in range(tp):
        got = hspec.all_kv_heads(shards[r], tp, total)
        assert torch.equal(got, full), r
    assert len(gathers) == (0 if per_rank == total else tp)  # a rank holding every head gathers nothing


def test_masked_prefix_slots_cannot_poison_a_round_and_graphs_keep_the_arange_they_read():
    """Slots past a request's prefix may hold any bytes (vLLM's hybrid allocator shares pages with
    float32 GDN state): a NaN there must not reach the drafts (the gather zeroes them). And a grown
    cached arange must stay alive for graphs captured with the old one."""
    m = build(torch.float32, 2048, 16, "FLASH_ATTN", seed=8)
    gen = torch.Generator().manual_seed(24)
    last_hidden, anchors, block_table, prefix_lens = _inputs(m, 3, gen, torch.float32)
    capacity = int(prefix_lens.max()) + 2
    ref = _eager(m, last_hidden, anchors, block_table, prefix_lens, capacity)
    # poison every cache slot past request 0's prefix in its own blocks (block_size 16)
    for reader in m.kv_readers:
        for pos in range(int(prefix_lens[0]), capacity):
            reader.kv_cache[int(block_table[0, pos // 16]), :, pos % 16] = float("nan")
    with torch.inference_mode():
        got = m.draft(last_hidden, anchors, m.gather_prefix_kv(block_table, capacity, prefix_lens), prefix_lens, K)
        unguarded = m.draft(last_hidden, anchors, m.gather_prefix_kv(block_table, capacity), prefix_lens, K)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.top1_prob, ref.top1_prob)
    assert not unguarded.top1_prob[0].isfinite().all()  # what the zeroing prevents
    before = m._constants[("arange", torch.device("cpu"))]
    m._arange(before.shape[0] + 1, torch.device("cpu"))
    assert m._constants[("arange", torch.device("cpu"))] is not before and before in m._retired_constants


def test_kv_head_layouts_the_drafter_cannot_read_are_refused():
    from vllm_hybridspec.engine.drafting.kv_cache import kv_heads_recoverable

    assert not kv_heads_recoverable(2, 2, 3)  # 2 per rank on 2 ranks is not 3 heads
    assert not kv_heads_recoverable(1, 4, 3)  # 3 heads cannot be replicated evenly on 4 ranks
    assert not kv_heads_recoverable(2, 1, 4)  # one rank holding half the heads
