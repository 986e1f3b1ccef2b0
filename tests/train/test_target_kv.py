"""Capturing the target and recomputing its K/V from captured hidden states, for a dense Qwen3 and a
Qwen3-Next (GDN + MoE, full attention every other layer) target."""

from __future__ import annotations

import pytest
import torch
from vllm_hybridspec.drafter import HSpecDraftModel, full_attention_layers
from vllm_hybridspec.train.target import AddTargetKV, TargetKV, capture_hidden_states, load_target
from vllm_hybridspec.train.tiny_target import TinyTarget, build_tiny_target
from ..seeds import fresh_seed


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def target(request, tmp_path_factory):
    path = build_tiny_target(
        TinyTarget(model_type=request.param, num_hidden_layers=4, seed=3),
        tmp_path_factory.mktemp(request.param),
    )
    model, _ = load_target(path)
    return model, path


def run_target(model, n=21, seed=0):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True, use_cache=True)
    return ids, out


def test_capture_matches_transformers(target):
    model, _ = target
    ids, out = run_target(model)
    layers = [0, 1, 2, 3, 4]  # 4 = the last layer's output before the final norm
    hidden = capture_hidden_states(model, ids, layers)
    assert hidden.shape == (21, len(layers) + 1, 64)
    for j, layer in enumerate(layers[:-1]):
        torch.testing.assert_close(hidden[:, j], out.hidden_states[layer][0], rtol=0, atol=0)
    torch.testing.assert_close(hidden[:, -1], hidden[:, -2])
    torch.testing.assert_close(model.model.norm(hidden[:, -1]), out.hidden_states[-1][0], rtol=0, atol=0)


def test_recomputed_kv_equals_the_targets_cache(target):
    """Input layernorm, k/v projections, per-head k_norm and the target's RoPE applied to a layer's
    captured input give exactly the K/V the target's forward stores in its DynamicCache."""
    model, _ = target
    ids, out = run_target(model, n=29, seed=1)
    kv_layers = full_attention_layers(model.config)
    layers = sorted(set([0, 1] + kv_layers))
    hidden = capture_hidden_states(model, ids, layers)
    item = AddTargetKV(TargetKV(model, kv_layers, layers))(
        {"hidden_states": hidden[:, :-1].flatten(1), "position_ids": torch.arange(29)}
    )
    assert item["target_kv"].shape == (29, len(kv_layers), 2, 2, 16)
    for j, layer in enumerate(kv_layers):
        cache = out.past_key_values.layers[layer]
        torch.testing.assert_close(item["target_kv"][:, j, 0], cache.keys[0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(
            item["target_kv"][:, j, 1], cache.values[0].transpose(0, 1), rtol=0, atol=0
        )


def test_recompute_uses_positions_per_document(target):
    """In a packed sequence every document's positions restart at 0; so does the recomputed RoPE."""
    gen = torch.Generator().manual_seed(fresh_seed("target_kv_positions"))
    model, _ = target
    kv_layers = full_attention_layers(model.config)
    recompute = TargetKV(model, kv_layers, kv_layers)
    a, b = torch.randint(0, 256, (9,), generator=gen), torch.randint(0, 256, (6,), generator=gen)
    separate = [
        recompute(capture_hidden_states(model, x, kv_layers)[:, :-1], torch.arange(len(x))) for x in (a, b)
    ]
    packed_hidden = torch.cat([capture_hidden_states(model, x, kv_layers)[:, :-1] for x in (a, b)])
    packed = recompute(packed_hidden, torch.cat([torch.arange(9), torch.arange(6)]))
    torch.testing.assert_close(packed, torch.cat(separate))  # matmul blocking differs with T: not bitwise


def test_drafter_attention_over_the_cache_equals_over_recomputed_kv(target):
    """The drafter reading the target's KV cache in place drafts exactly what it drafts from K/V
    recomputed from the captured hidden states (the training path)."""
    model, path = target
    kv_layers = full_attention_layers(model.config)[-2:]
    layers = sorted(set([1, 2] + kv_layers))
    torch.manual_seed(0)
    drafter = HSpecDraftModel.from_training_args(
        model.config,
        verifier_name_or_path=str(path),
        target_layer_ids=layers,
        kv_reuse_layer_ids=kv_layers,
        mask_token_id=257,
        mamba_num_heads=4,
        mamba_head_dim=16,
        markov_rank=8,
    ).eval()
    ids, out = run_target(model, n=18, seed=2)
    hidden = capture_hidden_states(model, ids, layers)
    n = 17  # prefix = tokens [0, 17), anchor = token 17
    last = hidden[n - 1, :-1].flatten()[None]
    cache_kv = [
        (out.past_key_values.layers[i].keys[:, :, :n], out.past_key_values.layers[i].values[:, :, :n])
        for i in kv_layers
    ]
    recomputed = TargetKV(model, kv_layers, layers)(
        hidden[:n, [layers.index(i) for i in kv_layers]], torch.arange(n)
    )
    recomputed_kv = [
        (recomputed[:, j, 0].transpose(0, 1)[None], recomputed[:, j, 1].transpose(0, 1)[None])
        for j in range(len(kv_layers))
    ]
    a = drafter.propose(last, ids[n : n + 1], cache_kv, torch.tensor([n]))
    b = drafter.propose(last, ids[n : n + 1], recomputed_kv, torch.tensor([n]))
    assert (
        torch.equal(a.tokens, b.tokens)
        and torch.equal(a.top1_prob, b.top1_prob)
        and torch.equal(a.entropy, b.entropy)
    )


def test_kv_layers_must_have_been_captured(target):
    model, _ = target
    kv_layers = full_attention_layers(model.config)
    with pytest.raises(
        ValueError, match=rf"kv_reuse_layer_ids \[{kv_layers[-1]}\] are not among the captured"
    ):
        TargetKV(model, kv_layers, kv_layers[:-1])


def test_training_targets_are_the_targets_logits(target):
    """Both drafters score against ``lm_head(final_norm(pre-norm output))`` = the target's logits; for
    Qwen3-Next this needs the ``x * (1 + w)`` final norm (speculators' DFlash gets it from our fix)."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from vllm_hybridspec.train.run import fix_dflash_verifier_norm

    model, path = target
    ids, out = run_target(model, n=12, seed=4)
    pre_norm = capture_hidden_states(model, ids, [1])[:, -1]
    kv = full_attention_layers(model.config)[-1:]
    hspec = HSpecDraftModel.from_training_args(
        model.config,
        verifier_name_or_path=str(path),
        target_layer_ids=kv,
        kv_reuse_layer_ids=kv,
        mask_token_id=257,
        mamba_num_heads=4,
        mamba_head_dim=16,
        markov_rank=8,
    )
    dflash = DFlashDraftModel.from_training_args(
        create_transformer_layer_config(str(path), 1, "qwen3", None, 2048, []),
        verifier_name_or_path=str(path),
        target_layer_ids=kv,
        draft_attn_impl="sdpa",
        mask_token_id=257,
        draft_vocab_size=model.config.vocab_size,
    )
    fix_dflash_verifier_norm(dflash, model.config)
    with torch.no_grad():
        for drafter in (hspec, dflash):
            torch.testing.assert_close(
                drafter.verifier_lm_head(drafter.verifier_norm(pre_norm)), out.logits[0]
            )
