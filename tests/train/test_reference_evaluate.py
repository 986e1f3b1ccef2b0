"""Acceptance arithmetic on hand-made cases, bootstrap intervals, and capture records that the
policy's loader accepts."""

from __future__ import annotations

import torch
from vllm_hybridspec.policy.records import Rounds, load_records, save_records
from vllm_hybridspec.train.reference.evaluate import (
    accepted_length,
    bootstrap_ci,
    bootstrap_counts,
    position_acceptance,
    rounds_from_drafts,
    summarize,
    to_records,
    walk_rounds,
)
from ..seeds import fresh_seed


def test_accepted_length_counts_leading_matches():
    truth = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, -1, -1]])
    draft = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 8]])
    assert accepted_length(draft, truth).tolist() == [4, 1, 0, 2]


def test_walk_rounds():
    assert walk_rounds([2, 0, 0, 1, 0, 0, 3]) == [0, 3, 5, 6]
    assert walk_rounds([0] * 4) == [0, 1, 2, 3]
    assert walk_rounds([7, 0, 0]) == [0]


def test_rounds_from_drafts_hand_made():
    # response r0..r9 = 10..19; D = 3; the drafter is right twice from offset 0, never from 3, ...
    D, R = 3, 10
    truth = torch.cat([torch.arange(10, 20), torch.full((D,), -1)])
    idx = torch.arange(R)[:, None] + torch.arange(1, D + 1)
    draft = truth[idx].clone()  # perfect drafts, then spoil some
    draft[0, 2] = 0  # offset 0 accepts 2 -> next round at 3
    draft[3, 0] = 0  # offset 3 accepts 0 -> next at 4
    # offset 4 accepts 3 -> next at 8; offset 8 reaches past the response (truncated)
    gen = torch.Generator().manual_seed(fresh_seed("evaluate_rounds_hand_made"))
    conf = torch.rand(R, D, generator=gen)
    ent = torch.rand(R, D, generator=gen)
    rounds = rounds_from_drafts(7, draft, conf, ent, truth, max_new_tokens=10)
    assert [r.accepted for r in rounds] == [2, 0, 3, 1]
    assert [r.truncated for r in rounds] == [False, False, False, True]
    assert [r.remaining for r in rounds] == [10, 7, 6, 2]
    assert rounds[2].conf == conf[4].tolist() and rounds[0].prompt == 7
    s = summarize(rounds, D, n_bootstrap=50)
    assert s["rounds"] == 3 and abs(s["tau"] - (1 + 5 / 3)) < 1e-12
    assert s["alpha"] == [2 / 3, 2 / 3, 1 / 3]


def test_position_acceptance_and_bootstrap():
    D = 7
    g = torch.Generator().manual_seed(fresh_seed("reference_evaluate_position_acceptance_a"))
    # geometric acceptance with per-token rate 0.7, 40 prompts x 25 rounds
    accepted = torch.distributions.Geometric(probs=torch.tensor(0.3)).sample((1000,)).long().clamp(max=D)
    prompt_ids = torch.arange(40).repeat_interleave(25)
    alpha = position_acceptance(accepted, D)
    assert torch.all(alpha[1:] <= alpha[:-1])
    expected = torch.tensor([0.7**k for k in range(1, D + 1)], dtype=torch.float64)
    assert torch.allclose(alpha, expected, atol=0.06)
    r = bootstrap_ci(accepted, prompt_ids, D, n=500, seed=int(torch.randint(0, 100, (), generator=g)))
    assert r["tau_ci95"][0] < r["tau"] < r["tau_ci95"][1]
    assert abs(r["tau"] - (1 + accepted.double().mean())) < 1e-12
    assert r["tau_ci95"][1] - r["tau_ci95"][0] < 0.5
    for a, (lo, hi) in zip(r["alpha"], r["alpha_ci95"]):
        assert lo <= a <= hi
    # one prompt only: every resample is the same
    one = bootstrap_ci(accepted[:25], torch.zeros(25, dtype=torch.long), D, n=100)
    assert one["tau_ci95"][0] == one["tau_ci95"][1] == one["tau"]


def test_bootstrap_from_per_prompt_counts_equals_bootstrap_from_rounds():
    """vLLM gives per-prompt counts (rounds, rounds with A >= k), not rounds: the same intervals from them."""
    gen = torch.Generator().manual_seed(fresh_seed("evaluate_bootstrap_counts"))
    D, P = 7, int(torch.randint(5, 30, (), generator=gen))
    per_prompt = torch.randint(1, 40, (P,), generator=gen)
    prompt_ids = torch.arange(P).repeat_interleave(per_prompt)
    accepted = torch.randint(0, D + 1, (len(prompt_ids),))
    k = torch.arange(1, D + 1)
    ge = torch.zeros(P, D, dtype=torch.float64).index_add_(0, prompt_ids, (accepted[:, None] >= k).double())
    seed = int(torch.randint(0, 100, (), generator=gen))
    from_rounds = bootstrap_ci(accepted, prompt_ids, D, n=300, seed=seed)
    from_counts = bootstrap_counts(per_prompt, ge, n=300, seed=seed)
    assert from_counts["rounds"] == len(accepted) and from_counts["prompts"] == P
    assert abs(from_counts["tau"] - (1 + accepted.double().mean())) < 1e-12
    for key in ("tau", "alpha"):
        assert torch.allclose(torch.tensor(from_counts[key]), torch.tensor(from_rounds[key]), atol=1e-12)
    for key in ("tau_ci95", "alpha_ci95"):
        assert torch.allclose(torch.tensor(from_counts[key]), torch.tensor(from_rounds[key]), atol=1e-12)
    # a prompt without rounds (a wrong counter read) is refused, not averaged in
    import pytest

    with pytest.raises(ValueError, match="rounds"):
        bootstrap_counts(torch.cat([per_prompt, torch.zeros(1, dtype=torch.long)]), torch.cat([ge, ge[:1]]))


def test_records_validate_with_the_policy_loader(tmp_path):
    gen = torch.Generator().manual_seed(fresh_seed("evaluate_records"))
    D, R = 7, 30
    truth = torch.cat([torch.randint(2, 100, (R,), generator=gen), torch.full((D,), -1)])
    idx = torch.arange(R)[:, None] + torch.arange(1, D + 1)
    draft = torch.where(torch.rand(R, D, generator=gen) < 0.8, truth[idx], torch.tensor(0))
    logits = torch.randn(R, D, 50, generator=gen)
    p = logits.softmax(-1)
    rounds = rounds_from_drafts(0, draft, p.max(-1).values, -(p * p.log()).sum(-1), truth, R)
    save_records(to_records(rounds), tmp_path / "records.jsonl")
    loaded = load_records(tmp_path / "records.jsonl")
    assert [r.accepted for r in loaded] == [r.accepted for r in rounds]
    t = Rounds.from_records(loaded)
    # a round is truncated where its block reaches past the response (offset p = R - remaining); the last
    # round need not be: one that accepts every draft token can end the response exactly
    offsets = [R - r.remaining for r in rounds]
    assert t.draft_len == D and t.truncated.tolist() == [p + D >= R for p in offsets] and offsets[0] == 0
    # signals kept to 1e-4 (SIGNAL_DECIMALS): within half a unit of the fourth decimal, not more
    err = (t.conf - torch.tensor([r.conf for r in rounds], dtype=torch.float64)).abs().max()
    assert err <= 0.5e-4 + 1e-12
    assert (t.ent - torch.tensor([r.ent for r in rounds], dtype=torch.float64)).abs().max() <= 0.5e-4 + 1e-12


def test_thinned_metrics_keep_every_tenth_step_the_last_and_all_validation(tmp_path):
    import json

    from vllm_hybridspec.train.reference.drafters import thin_metrics

    rows = []
    for step in range(53):
        rows.append({"step": step, "train": {"loss": 1.0 / (step + 1)}})
        if step % 20 == 19:
            rows.append({"step": step, "val": {"loss_epoch": 0.5}, "epoch": step // 20})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    thin_metrics(tmp_path / "m.jsonl", tmp_path / "out.jsonl")
    kept = [json.loads(line) for line in (tmp_path / "out.jsonl").open()]
    assert [r["step"] for r in kept if "train" in r] == [0, 10, 20, 30, 40, 50, 52]
    assert [r["step"] for r in kept if "val" in r] == [19, 39]
    assert [r["step"] for r in kept] == sorted(r["step"] for r in kept)  # order kept


def test_greedy_responses_batched_by_length_equal_one_by_one():
    from transformers import Qwen3ForCausalLM

    from vllm_hybridspec.train.reference.evaluate import greedy_responses

    from ..tiny_models import tiny_qwen3_config

    torch.manual_seed(3)
    target = Qwen3ForCausalLM(tiny_qwen3_config(initializer_range=0.3)).eval()
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 7, 12, 7, 12, 5)]
    eos = int(torch.randint(0, vocab, (1,), generator=gen))
    batched = greedy_responses(target, prompts, max_new_tokens=10, eos_token_id=eos, batch_size=2)
    for prompt, response in zip(prompts, batched):
        alone = greedy_responses(target, [prompt], max_new_tokens=10, eos_token_id=eos)[0]
        assert response == alone
        assert 1 <= len(response) <= 10 and (eos not in response[:-1])
