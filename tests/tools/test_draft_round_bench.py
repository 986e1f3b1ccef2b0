"""``hybridspec kernels draft-round`` without a GPU: at a tiny shape, its accuracy checks pass (the
torch heads and the fused kernel through Triton's interpreter against float64 on the round's own
logits; the candidate heads likewise; the compiled and the fused-norm layers against the eager ones), the
rounds draft the same tokens, and the floor counts every weight the round reads."""

from __future__ import annotations

import torch
from vllm_hybridspec.tools.kernels import draft_round as dr

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, intermediate_size=128, bos_token_id=0, eos_token_id=0)


def test_the_tiny_round_checks_and_drafts_the_same_with_both_heads():
    torch.manual_seed(0)
    model = dr.build_drafter(torch.device("cpu"), block_size=8, markov_rank=16, target_overrides=TINY)
    model = model.float()  # the CPU's bf16 matmuls are slow; the check is the same
    r = dr.Round(model, 3, 40, torch.device("cpu"), seed=1)
    assert dr.check(r) == []
    dr.compile_block_forward(model)
    with torch.inference_mode():
        assert dr.check_compiled(r, tol=1e-4) == []
    with torch.inference_mode():
        tokens, top1, ent = r.round_torch()
        fused = r.round_fused()
        fused_norms = r.round_fused_norms()
        grouped = r.round_grouped()
        candidates = r.round_candidates()
        both = r.round_compiled_candidates()
        grouped_candidates = r.round_grouped_candidates()
        compiled_grouped = r.round_compiled_grouped_candidates()
        w1 = model.markov_head.markov_w1.weight.clone()
        scaled = dr.scaled_markov(r, (0.5, 0.01), lambda fn: (fn(), 1.0)[1])
    # the scaled runs leave the Markov weights as they were; a bias 100x smaller resolves every position
    assert torch.equal(model.markov_head.markov_w1.weight, w1)
    assert [x["scale"] for x in scaled] == [0.5, 0.01] and scaled[1]["resolved"] == 1.0
    assert scaled[1]["missed"] == 0.0 and scaled[1]["w2_passes"] == 0  # no per-position kernel reads W2
    assert all(x["heads_candidates_ms"] == x["round_grouped_candidates_ms"] == 1.0 for x in scaled)
    assert torch.equal(both.tokens, candidates.tokens) and torch.equal(grouped_candidates.tokens, candidates.tokens)
    assert torch.equal(compiled_grouped.tokens, candidates.tokens)
    assert torch.equal(tokens, fused.tokens) and torch.equal(tokens, fused_norms.tokens)
    assert torch.equal(tokens, grouped.tokens)
    assert torch.allclose(top1, fused.top1_prob, atol=2e-6) and torch.allclose(ent, fused.entropy, atol=2e-5)
    assert torch.equal(candidates.tokens, fused.tokens)
    assert torch.allclose(candidates.top1_prob, fused.top1_prob, atol=2e-6)
    assert torch.allclose(candidates.entropy, fused.entropy, atol=2e-5)
    stats = r.pass_stats()
    assert 0.0 <= stats["resolved"] <= 1.0 and 0.0 <= stats["missed"] <= 1.0 - stats["resolved"] + 1e-9
    assert 0 <= stats["w2_passes"] <= 6
    table = dr.format_table([{**{f"{k}_ms": 1.0 for k in ("layers", "layers_fused_norms", "layers_grouped",
                                                          "layers_compiled", "layers_compiled_grouped", "lm_head",
                                                          "heads_torch", "heads_fused", "heads_candidates",
                                                          "round_torch", "round_fused", "round_fused_norms",
                                                          "round_grouped", "round_candidates", "round_compiled",
                                                          "round_grouped_candidates",
                                                          "round_compiled_grouped_candidates", "floor")},
                              "B": 1, "round_over_floor": 1.0, **stats}])
    assert len(table.splitlines()) == 3 and all(line.count("|") == 23 for line in table.splitlines())
    nbytes = dr.round_bytes(model, 3, 40)
    mh = model.markov_head
    assert nbytes["markov_w2"] == 7 * mh.markov_w2.weight.numel() * 4
    assert nbytes["lm_head"] == 512 * 64 * 4
    assert nbytes["prefix_kv"] == 2 * 3 * 40 * 2 * 32 * 4 * len(model.config.kv_reuse_layer_ids)
    layer_params = sum(p.numel() for p in model.layers.parameters()) * 4
    assert layer_params < nbytes["drafter_layers"] < layer_params + 4 * 10**6
