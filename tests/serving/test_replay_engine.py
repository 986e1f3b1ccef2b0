"""The replay proposer (benchmarking only) in the CPU engine with a tiny dense Qwen3 target: greedy
outputs equal plain decoding, vLLM's measured acceptance equals what the replayed rounds plan and
matches the records' mean, and bad inputs give errors that name them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_hybridspec.engine.replay.proposer import ReplayBenchProposer
from vllm_hybridspec.policy.records import RoundRecord, save_records

from .conftest import drafter_of, make_llm

pytestmark = pytest.mark.timeout(900)

K, D, MAX_TOKENS, NUM_PROMPTS, NUM_RECORDS = 4, 6, 96, 8, 400
ENGINE = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
          "max_num_seqs": 8, "max_num_batched_tokens": 512, "seed": 0}


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
    prompt_file = tmp / "prompts.jsonl"
    # a benchmark cycles its prompts: the recording keeps one line per prompt
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ps + ps[:3]))
    result = subprocess.run([
        sys.executable, "-m", "vllm_hybridspec.cli", "replay-record", "--model", str(target_dir), "-o", str(cont),
        "--prompts", str(prompt_file), "--output-len", str(MAX_TOKENS), "--num-speculative-tokens", str(K),
        "--dtype", "float32", "--max-model-len", "256", "--engine-args",
        json.dumps({k: v for k, v in ENGINE.items() if k not in ("dtype", "max_model_len")})],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    assert f"recorded {NUM_PROMPTS} greedy continuations of {MAX_TOKENS} + {K} tokens" in result.stdout
    recorded = [json.loads(line) for line in cont.read_text().splitlines()]
    assert [r["prompt_token_ids"] for r in recorded] == ps
    assert all(len(r["output_token_ids"]) == MAX_TOKENS + K and r["max_tokens"] == MAX_TOKENS for r in recorded)
    records = tmp / "rounds.jsonl"
    pool = synthetic_records(records, seed)
    return {"prompts": ps, "cont": cont, "records": records, "pool": pool, "recorded": recorded, "seed": seed}


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


def confidence_policy(path, slope=15.0, midpoint=0.5, rate=0.35):
    """Every draft token accepted with ``sigmoid(slope (conf - midpoint))``, cost ``C(w) = w``: a row
    verifies ``w = 1 + #{i : p_i > rate}`` tokens, so the replayed confidences decide the lengths."""
    from vllm_hybridspec.policy.acceptance import FEATURES
    from vllm_hybridspec.policy.policy_file import PolicyFile

    obj = {"draft_len": K, "min_length": 1,
           "acceptance": {"features": list(FEATURES), "entropy_eps": 1e-4,
                          "isotonic": [{"x": [0.0, 1.0], "y": [0.0, 1.0]}] * K,
                          "coef": [slope, 0.0, 0.0, 0.0, 0.0], "intercept": -slope * midpoint},
           "cost": {"measured_lengths": [1, 2, 3], "quadratic": [1.0, 1.0, 0.0], "fixed": 1.0,
                    "curve": [float(w) for w in range(1, K + 2)]},
           "rate": rate}
    path.write_text(PolicyFile.model_validate(obj).model_dump_json())
    return str(path)


def test_replay_with_the_length_policy(target_dir, replay_setup, tmp_path):
    """The policy picks lengths from the replayed confidences; outputs stay plain decoding's and vLLM's
    counters still equal the replay's plan (cut drafts are neither drafted nor accepted)."""
    s = replay_setup
    config = {**spec(s), "hybridspec": {"policy": confidence_policy(tmp_path / "p.json")}}
    llm = make_llm(target_dir, config, disable_log_stats=False)
    proposer = drafter_of(llm)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], greedy)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"][:MAX_TOKENS] for r in s["recorded"]}
    assert [list(o.outputs[0].token_ids) for o in outputs] == [plain[tuple(p)] for p in s["prompts"]]
    metrics = {m.name: m for m in llm.get_metrics()}
    counters = tuple(metrics[f"vllm:spec_decode_num_{n}"].value for n in ("drafts", "draft_tokens", "accepted_tokens"))
    stats = proposer.stats()
    lengths = proposer.length_selector.stats()["rows_at_length"]
    print(f"replay + policy: vLLM (drafts, draft tokens, accepted) {counters}; proposer {stats}; "
          f"rows at length w {lengths}")
    assert counters == (stats["rounds"], stats["draft_tokens"], stats["accepted_planned"])
    assert stats["diverged_requests"] == 0
    assert counters[1] < K * counters[0]                   # the policy cut drafts
    assert len([w for w, c in lengths.items() if c]) >= 3  # at several lengths


@pytest.mark.parametrize("replay, message", [
    ({"continuations": "/nonexistent/c.jsonl"}, r"continuations file '/nonexistent/c.jsonl' does not exist"),
    ({"records": "/nonexistent/r.jsonl"}, r"records file '/nonexistent/r.jsonl' does not exist"),
    ({"seed": "x"}, r'"replay_bench.seed" must be an integer >= 0'),
])
def test_bad_replay_config_fails_at_engine_start(target_dir, replay_setup, replay, message):
    with pytest.raises(ValueError, match=message):
        make_llm(target_dir, spec(replay_setup, **replay))


def test_records_shorter_than_k_fail_at_engine_start(target_dir, replay_setup):
    config = {**spec(replay_setup), "num_speculative_tokens": D + 1}
    with pytest.raises(ValueError, match=rf"D = {D} draft tokens, but the replay proposes K = "
                                         rf"num_speculative_tokens = {D + 1}"):
        make_llm(target_dir, config)


def test_replay_under_vllms_dynamic_speculative_decoding(target_dir, replay_setup):
    """vLLM's own dynamic speculative decoding (the issue-7 baseline `num_speculative_tokens_per_batch_size`)
    runs with the replay proposer: the scheduler verifies one draft token per request in batches of 3 to
    8, and the output is still plain decoding's."""
    s = replay_setup
    config = {**spec(s), "num_speculative_tokens_per_batch_size": [[1, 2, K], [3, 8, 1]]}
    llm = make_llm(target_dir, config, disable_log_stats=False)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], greedy)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"][:MAX_TOKENS] for r in s["recorded"]}
    assert [list(o.outputs[0].token_ids) for o in outputs] == [plain[tuple(p)] for p in s["prompts"]]
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts, drafted, accepted = (metrics[f"vllm:spec_decode_num_{n}"].value
                                 for n in ("drafts", "draft_tokens", "accepted_tokens"))
    print(f"dynamic speculative decoding: {drafts} drafts, {drafted} draft tokens, {accepted} accepted")
    # the 8 requests decode together nearly throughout: one draft token per request and step, a few
    # steps with fewer requests (while prompts are still being prefilled) draft K; without the
    # schedule every draft has K = 4 tokens (test_replay_greedy_identity_and_acceptance)
    assert drafts > 0 and drafts <= drafted < 1.5 * drafts and 0 < accepted <= drafted
    # the proposer's own bookkeeping follows the cut drafts exactly
    proposer = drafter_of(llm)
    stats = proposer.stats()
    assert proposer.draft_limit in (1, K)
    assert (drafts, drafted, accepted) == (stats["rounds"], stats["draft_tokens"], stats["accepted_planned"])
