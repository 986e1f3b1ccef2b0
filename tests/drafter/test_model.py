"""The H-Spec drafter: the draft heads, request batching, training layout = serving layout, the
speculators format and registry."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from speculators import SpeculatorModel, SpeculatorModelConfig
from vllm_hybridspec.drafter import DraftBlock, HSpecDraftModel, HSpecSpeculatorConfig
from vllm_hybridspec.drafter.attention import anchored_block_mask, request_block_mask

from .conftest import MASK, VOCAB, make_drafter, target_context
from ..seeds import fresh_seed


def requests(target, drafter, lengths, seed=0):
    """Random contexts of the given lengths, padded into one batch for ``propose``."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths) + 1
    last, anchors, ks, vs = (
        [],
        [],
        [[] for _ in drafter.kv_reuse_layer_ids],
        [[] for _ in drafter.kv_reuse_layer_ids],
    )
    for n in lengths:
        ids = torch.randint(0, VOCAB - 1, (1, n + 1), generator=g)
        hidden, kv = target_context(target, drafter, ids[:, :n])
        last.append(hidden[n - 1])
        anchors.append(ids[0, n])
        for i, (k, v) in enumerate(kv):
            pad = torch.randn(1, k.shape[1], T - n, k.shape[3], generator=g)  # garbage in unused slots
            ks[i].append(torch.cat([k, pad], dim=2)), vs[i].append(torch.cat([v, pad], dim=2))
    kv = [(torch.cat(k), torch.cat(v)) for k, v in zip(ks, vs)]
    return torch.stack(last), torch.stack(anchors), kv, torch.tensor(lengths)


def test_propose_returns_tokens_top1_and_entropy(target, drafter):
    last, anchors, kv, lens = requests(target, drafter, [5, 17, 9])
    block = drafter.propose(last, anchors, kv, lens)
    assert isinstance(block, DraftBlock)
    for t in (block.tokens, block.top1_prob, block.entropy):
        assert t.shape == (3, 7)
    assert block.tokens.dtype == torch.long and block.top1_prob.dtype == block.entropy.dtype == torch.float32
    assert ((block.tokens >= 0) & (block.tokens < VOCAB)).all()
    # recompute the heads by hand: greedy token, its probability and the entropy, Markov bias from the
    # previously drafted token
    with torch.no_grad():
        positions = lens[:, None] + torch.arange(8)
        ids = torch.full((3, 8), MASK)
        ids[:, 0] = anchors
        hidden = drafter.block_forward(
            ids,
            positions,
            drafter.initial_state(last),
            kv,
            request_block_mask(lens, kv[0][0].shape[2], 8, 2048),
        )
        logits = drafter.lm_head(drafter.norm(hidden[:, 1:]))
        prev = anchors
        for k in range(7):
            step = logits[:, k] + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev))
            p = torch.softmax(step.double(), -1)
            torch.testing.assert_close(block.tokens[:, k], p.argmax(-1))
            torch.testing.assert_close(block.top1_prob[:, k].double(), p.max(-1).values, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                block.entropy[:, k].double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5
            )
            prev = block.tokens[:, k]


def test_batched_requests_equal_one_at_a_time(target, drafter):
    lengths = [5, 17, 9]
    last, anchors, kv, lens = requests(target, drafter, lengths, seed=1)
    batched = drafter.propose(last, anchors, kv, lens)
    for i, n in enumerate(lengths):
        single = drafter.propose(
            last[i : i + 1],
            anchors[i : i + 1],
            [(k[i : i + 1, :, :n], v[i : i + 1, :, :n]) for k, v in kv],
            lens[i : i + 1],
        )
        assert torch.equal(single.tokens, batched.tokens[i : i + 1])
        torch.testing.assert_close(single.top1_prob, batched.top1_prob[i : i + 1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(single.entropy, batched.entropy[i : i + 1], rtol=1e-5, atol=1e-5)


def test_training_layout_equals_serving_layout(target, drafter):
    """Blocks anchored in a packed two-document sequence (training) give the hidden states that
    ``propose``'s per-request layout gives for the same prefixes."""
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB - 1, (1, n), generator=g) for n in (14, 11)]
    contexts = [target_context(target, drafter, d) for d in docs]
    hidden = torch.cat([c[0] for c in contexts])  # [25, n_sel * hidden]
    kv = [
        (torch.cat([c[1][i][0] for c in contexts], 2), torch.cat([c[1][i][1] for c in contexts], 2))
        for i in range(len(drafter.kv_reuse_layer_ids))
    ]
    ids = torch.cat(docs, 1)[0]
    document_ids = torch.tensor([0] * 14 + [1] * 11)
    position_ids = torch.cat([torch.arange(14), torch.arange(11)])
    anchors, L = torch.tensor([4, 9, 17, 22]), 8
    N = len(anchors)
    block_ids = torch.full((N, L), MASK)
    block_ids[:, 0] = ids[anchors]
    with torch.no_grad():
        packed = drafter.block_forward(
            block_ids,
            (position_ids[anchors][:, None] + torch.arange(L)).reshape(1, N * L),
            drafter.initial_state(hidden[anchors - 1]),
            kv,
            anchored_block_mask(document_ids, position_ids, anchors, L, drafter.config.sliding_window),
        )
        for j, a in enumerate(anchors.tolist()):
            start = 0 if a < 14 else 14
            n = a - start
            mask = request_block_mask(torch.tensor([n]), n, L, drafter.config.sliding_window)
            single = drafter.block_forward(
                block_ids[j : j + 1],
                (n + torch.arange(L))[None],
                drafter.initial_state(hidden[a - 1][None]),
                [(k[:, :, start:a], v[:, :, start:a]) for k, v in kv],
                mask,
            )
            torch.testing.assert_close(packed[j : j + 1], single, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_is_bit_exact(tmp_path, target, target_dir, drafter):
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "hspec"
    assert config["speculators_config"]["algorithm"] == "hspec"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert config["aux_hidden_state_layer_ids"] == drafter.target_layer_ids
    assert config["kv_reuse_layer_ids"] == drafter.kv_reuse_layer_ids
    assert config["block_size"] == 8 and config["mask_token_id"] == MASK
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # the frozen target embeddings / LM head / final norm are rebuilt from the verifier, not saved
    assert not {k for k in keys if k.startswith(("embed_tokens", "lm_head", "verifier_"))}
    assert any(k.endswith("mamba.A_log") for k in keys) and "state_injection.proj_state.weight" in keys

    loaded = SpeculatorModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is HSpecDraftModel
    before, after = drafter.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    last, anchors, kv, lens = requests(target, drafter, [6, 13], seed=3)
    a, b = drafter.propose(last, anchors, kv, lens), loaded.propose(last, anchors, kv, lens)
    assert (
        torch.equal(a.tokens, b.tokens)
        and torch.equal(a.top1_prob, b.top1_prob)
        and torch.equal(a.entropy, b.entropy)
    )


def test_registry_resolves_hspec_from_a_saved_config(tmp_path, drafter):
    drafter.config.save_pretrained(tmp_path)
    config = SpeculatorModelConfig.from_pretrained(tmp_path)
    assert type(config) is HSpecSpeculatorConfig
    assert config.kv_reuse_layer_ids == drafter.kv_reuse_layer_ids
    assert SpeculatorModel.registry["hspec"] is HSpecDraftModel
    assert SpeculatorModel.registered_model_class_from_config(config) is HSpecDraftModel
    assert SpeculatorModelConfig.registry["hspec"] is HSpecSpeculatorConfig


def test_pruned_draft_vocabulary(tmp_path, target, target_dir):
    gen = torch.Generator().manual_seed(fresh_seed("model_pruned_vocabulary"))
    keep = torch.tensor(sorted(torch.randperm(VOCAB - 1, generator=gen)[:40].tolist()))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[keep] = True
    d2t = keep - torch.arange(40)
    drafter = make_drafter(target_dir, t2d=t2d, d2t=d2t, draft_vocab_size=40)
    assert drafter.lm_head.weight.shape == (40, 64)
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight[keep])
    last, anchors, kv, lens = requests(target, drafter, [7, 12], seed=4)
    block = drafter.propose(last, anchors, kv, lens)
    assert torch.isin(block.tokens, keep).all()
    drafter.save_pretrained(tmp_path)
    loaded = SpeculatorModel.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.propose(last, anchors, kv, lens).tokens, block.tokens)


def test_missing_mask_token_is_reported(target_dir):
    drafter = make_drafter(target_dir, mask_token_id=None)
    with pytest.raises(ValueError, match="mask_token_id is not set"):
        _ = drafter.mask_token_id


def test_prefix_kv_count_is_checked(target, drafter):
    last, anchors, kv, lens = requests(target, drafter, [5])
    with pytest.raises(
        ValueError, match=r"expected prefix K/V for 3 attention layers \(target layers \[2, 3, 4\]\), got 2"
    ):
        drafter.propose(last, anchors, kv[:2], lens)
