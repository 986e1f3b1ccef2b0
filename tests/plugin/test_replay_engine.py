"""The replay proposer (benchmarking only) in the CPU engine with a tiny dense Qwen3 target: greedy
outputs equal plain decoding, vLLM's measured acceptance equals what the replayed rounds plan and
matches the records' mean, and bad inputs give errors that name them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_hybridspec.bench.replay import record_continuations
from vllm_hybridspec.bench.replay_proposer import ReplayBenchProposer
from vllm_hybridspec.policy.records import RoundRecord, save_records

from .conftest import drafter_of, make_llm

pytestmark = pytest.mark.timeout(900)

K, D, MAX_TOKENS, NUM_PROMPTS, NUM_RECORDS = 4, 6, 96, 8, 400
ENGINE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=512, seed=0)


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < NUM_PROMPTS:
        p = torch.randint(0, 95, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
        if not any(q[:len(p)] == p or p[:len(q)] == q for q in out):  # prefix-free, as the replay needs
            out.append(p)
    return out


def synthetic_records(path, seed: int) -> np.ndarray:
    """Rounds with A_D drawn from a known distribution over 0..D (D > K: the replay caps at K),
    a few truncated rounds (never replayed); returns the replayable min(A_D, K)."""
    rng = np.random.default_rng(seed)
    probs = np.array([0.25, 0.2, 0.15, 0.1, 0.1, 0.1, 0.1])
    accepted = rng.choice(D + 1, size=NUM_RECORDS, p=probs)
    truncated = rng.random(NUM_RECORDS) < 0.05
    records = [RoundRecord(conf=rng.uniform(0.05, 1, D).tolist(), ent=rng.uniform(0, 3, D).tolist(),
                           accepted=int(a), truncated=bool(t)) for a, t in zip(accepted, truncated)]
    save_records(records, path)
    return np.minimum(accepted[~truncated], K)


@pytest.fixture(scope="module")
def replay_setup(target_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    ps = prompts(seed)
    cont = tmp / "continuations.jsonl"
    assert record_continuations(str(target_dir), ps, MAX_TOKENS, K, cont, **ENGINE) == NUM_PROMPTS
    recorded = [json.loads(line) for line in cont.read_text().splitlines()]
    records = tmp / "rounds.jsonl"
    pool = synthetic_records(records, seed)
    return dict(prompts=ps, cont=cont, records=records, pool=pool, recorded=recorded, seed=seed)


def spec(setup, **replay):
    return {"method": "replay_bench", "num_speculative_tokens": K,
            "replay_bench": {"records": str(setup["records"]), "continuations": str(setup["cont"]),
                             "seed": setup["seed"], **replay}}


def test_replay_greedy_identity_and_acceptance(target_dir, replay_setup):
    s = replay_setup
    llm = make_llm(target_dir, spec(s), disable_log_stats=False)
    proposer = drafter_of(llm)
    assert type(proposer) is ReplayBenchProposer
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], greedy)

    # (1) greedy output equals plain decoding (the recording run, cut to MAX_TOKENS)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"][:MAX_TOKENS] for r in s["recorded"]}
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [plain[tuple(p)] for p in s["prompts"]]

    # (2) acceptance: exactly what the replayed rounds plan, and close to the records' mean
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    stats = proposer.stats()
    pool = s["pool"]
    mean, sd = pool.mean(), pool.std()
    bound = 4 * sd / math.sqrt(drafts)
    print(f"replay: {drafts} drafts, {drafted} draft tokens, {accepted} accepted; engine mean "
          f"{accepted / drafts:.3f} vs records mean {mean:.3f} +- {bound:.3f} (4 sigma); proposer {stats}")
    assert stats["diverged_requests"] == 0
    assert (drafts, drafted, accepted) == (stats["rounds"], stats["draft_tokens"], stats["accepted_planned"])
    assert drafted == K * drafts
    assert abs(stats["records_mean_accepted"] - mean) < 1e-12
    assert abs(accepted / drafts - mean) < bound
    # the recorded signals, [N, K] on the engine's device
    block = proposer.last_draft
    assert block.top1_prob.shape == block.entropy.shape == block.tokens.shape and block.tokens.shape[1] == K
    assert ((block.top1_prob >= 0.05) | (block.top1_prob == 0)).all() and (block.entropy >= 0).all()

    # (3) a prompt that was not recorded: an error naming it, not a hang
    stranger = [94, 93, 92, 91, 90, 89, 88]
    assert not any(p[:7] == stranger for p in s["prompts"])
    with pytest.raises(Exception, match=r"matches no prompt of the continuations file") as info:
        llm.generate([{"prompt_token_ids": stranger}], greedy)
    print(f"unknown prompt: {info.value}")
    assert "starting [94, 93, 92, 91, 90, 89, 88" in str(info.value) or "starting [94" in str(info.value)
