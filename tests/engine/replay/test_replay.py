"""The replay proposer's logic (benchmarking only), without an engine: draws, corruption, the files,
and a simulated greedy target driving ``ReplayBenchProposer`` round by round."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_hybridspec.engine.replay.config import parse_replay_options, resolve_replay_speculative_config
from vllm_hybridspec.engine.replay.data import (
    Continuations,
    corrupt,
    load_continuations,
    load_replay_rounds,
    replayed_rounds,
    save_continuations,
)
from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.records import RoundRecord, save_records

VOCAB = 96


@pytest.fixture
def rng():
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def write_records(path, rng, n, d, probs=None, truncated_frac=0.0):
    probs = probs if probs is not None else np.full(d + 1, 1 / (d + 1))
    accepted = rng.choice(d + 1, size=n, p=probs)
    truncated = rng.random(n) < truncated_frac
    save_records([RoundRecord(conf=rng.uniform(0, 1, d).tolist(), ent=rng.uniform(0, 4, d).tolist(),
                              accepted=int(a), truncated=bool(t)) for a, t in zip(accepted, truncated)], path)
    return accepted, truncated


def prefix_free_prompts(rng, n, lo=3, hi=20):
    out = []
    while len(out) < n:
        p = rng.integers(0, VOCAB, rng.integers(lo, hi)).tolist()
        if not any(q[:len(p)] == p or p[:len(q)] == q for q in out):
            out.append(p)
    return out


def test_corrupt_rejects_exactly_at_a(rng):
    for _ in range(200):
        k = int(rng.integers(1, 16))
        true = rng.integers(0, VOCAB, k)
        a = int(rng.integers(0, k + 1))
        draft = corrupt(true, a, VOCAB)
        matches = np.cumprod(draft == true)  # greedy verification: the accepted prefix
        assert int(matches.sum()) == a
        assert (draft >= 0).all() and (draft < VOCAB).all()
        assert (true == corrupt(true, a, VOCAB)[:a].tolist() + true[a:].tolist()).sum() >= k - 1
    assert corrupt(np.array([95, 3]), 0, VOCAB).tolist() == [0, 3]  # wraps inside the vocabulary


def test_replayed_rounds_uniform_and_deterministic(rng):
    r, n = 7, 70_000
    seed, key = int(rng.integers(1 << 30)), int(rng.integers(1 << 62))
    table = replayed_rounds(seed, key, n, r)
    counts = np.bincount(table, minlength=r)
    expected, sd = n / r, math.sqrt(n * (1 / r) * (1 - 1 / r))
    assert np.abs(counts - expected).max() < 5 * sd, counts
    assert (replayed_rounds(seed, key, n, r) == table).all()           # same seed and prompt: same rounds
    assert (replayed_rounds(seed, key, 50, r) == table[:50]).all()     # independent of the table length
    assert (replayed_rounds(seed + 1, key, n, r) != table).mean() > 0.8  # another seed: other rounds
    assert (replayed_rounds(seed, key + 1, n, r) != table).mean() > 0.8  # another prompt: other rounds


def test_load_replay_rounds(tmp_path, rng):
    path = tmp_path / "r.jsonl"
    accepted, truncated = write_records(path, rng, 300, 8, truncated_frac=0.1)
    rounds = load_replay_rounds(path, 5)
    assert rounds.conf.shape == rounds.ent.shape == ((~truncated).sum(), 5)
    assert (rounds.accepted == np.minimum(accepted[~truncated], 5)).all()
    assert rounds.mean_accepted == pytest.approx(np.minimum(accepted[~truncated], 5).mean())
    with pytest.raises(InputError, match=r"D = 8 draft tokens, but the replay proposes K = num_speculative_tokens = 9"):
        load_replay_rounds(path, 9)
    save_records([RoundRecord(conf=[0.5], ent=[0.1], accepted=1, truncated=True)], tmp_path / "t.jsonl")
    with pytest.raises(InputError, match="only truncated rounds"):
        load_replay_rounds(tmp_path / "t.jsonl", 1)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"conf": [0.5, 0.4], "ent": [0.1, 0.2], "accepted": 3}) + "\n")
    with pytest.raises(InputError, match=r"line 1.*accepted"):
        load_replay_rounds(tmp_path / "bad.jsonl", 1)
    with pytest.raises(InputError, match="does not exist"):
        load_replay_rounds(tmp_path / "missing.jsonl", 1)


def test_continuations_file_errors(tmp_path, rng):
    good = {"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5, 6, 7], "max_tokens": 3}
    cases = {
        "not json": (["{oops"], r"line 1: not valid JSON"),
        "no output": ([{"prompt_token_ids": [1], "max_tokens": 1}], r"line 1: field 'output_token_ids'"),
        "negative id": ([good, {**good, "prompt_token_ids": [9, -1]}], r"line 2: field 'prompt_token_ids'"),
        "max_tokens": ([{**good, "max_tokens": 5}], r"line 1: field 'max_tokens' must be an integer in 1..len"),
        "extra": ([{**good, "prompt": "x"}], r"unknown fields \['prompt'\]"),
        "duplicate": ([good, good], r"prompt of 3 tokens starting \[1, 2, 3\] appears twice"),
        "prefix": ([good, {**good, "prompt_token_ids": [1, 2, 3, 9]}], r"is a prefix of another prompt \(4 tokens\)"),
        "empty": ([], r"holds no requests"),
    }
    for name, (lines, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
        with pytest.raises(InputError, match=message):
            load_continuations(path)
    with pytest.raises(InputError, match=r"does not exist; record one with `hybridspec replay-record`"):
        load_continuations(tmp_path / "missing.jsonl")


def test_continuations_find(tmp_path, rng):
    prompts = prefix_free_prompts(rng, 40)
    outputs = [rng.integers(0, VOCAB, 30).tolist() for _ in prompts]
    save_continuations([(p, o, 20) for p, o in zip(prompts, outputs)], tmp_path / "c.jsonl")
    cont = load_continuations(tmp_path / "c.jsonl")
    assert isinstance(cont, Continuations) and len(cont.entries) == 40
    for p, o in zip(prompts, outputs):
        g = int(rng.integers(0, 31))
        found = cont.find(np.array(p + o[:g]))
        assert found is not None and found.prompt.tolist() == p and found.output.tolist() == o
    assert cont.find(np.array([95] * 25)) is None or cont.find(np.array([95] * 25)).prompt.tolist() in prompts


def test_options_and_speculative_config(tmp_path, rng):
    write_records(tmp_path / "r.jsonl", rng, 50, 6)
    save_continuations([([1, 2, 3], [4, 5, 6, 7, 8], 2)], tmp_path / "c.jsonl")
    raw = {"records": str(tmp_path / "r.jsonl"), "continuations": str(tmp_path / "c.jsonl")}
    target = SimpleNamespace(get_vocab_size=lambda: VOCAB)
    spec, extra = resolve_replay_speculative_config(
        {"method": "replay_bench", "num_speculative_tokens": 4, "replay_bench": raw}, target)
    assert spec == {"method": "custom_class", "num_speculative_tokens": 4,
                    "model": "vllm_hybridspec.engine.replay.proposer.ReplayBenchProposer"}
    assert extra == {"replay_bench": {**raw, "seed": 0}}
    bad = [
        ({"num_speculative_tokens": 4}, r'needs "replay_bench"'),
        ({"num_speculative_tokens": 4, "replay_bench": raw, "model": "x"}, r'takes no "model"'),
        ({"num_speculative_tokens": 0, "replay_bench": raw}, r'"num_speculative_tokens" >= 1, got 0'),
        ({"num_speculative_tokens": 7, "replay_bench": raw}, r"D = 6 draft tokens"),
        ({"num_speculative_tokens": 4, "replay_bench": {**raw, "seed": -1}}, r"seed\" must be an integer >= 0"),
        ({"num_speculative_tokens": 4, "replay_bench": {**raw, "record": "x"}}, r"unknown \"replay_bench\" keys"),
        ({"num_speculative_tokens": 4, "replay_bench": {"records": raw["records"]}}, r'needs "continuations"'),
        ({"num_speculative_tokens": 4, "replay_bench": [1]}, r"must be a JSON object"),
    ]
    for spec_dict, message in bad:
        with pytest.raises(ValueError, match=message):
            resolve_replay_speculative_config({"method": "replay_bench", **spec_dict}, target)
    with pytest.raises(ValueError, match=r"token id 8 .* outside the target's vocabulary of 8"):
        parse_replay_options(raw, 4, vocab_size=8)


def test_spec_config_routes_replay_bench(tmp_path, rng):
    from vllm_hybridspec.engine.config import resolve_speculative_config

    write_records(tmp_path / "r.jsonl", rng, 50, 6)
    save_continuations([([1, 2, 3], [4, 5, 6, 7, 8], 2)], tmp_path / "c.jsonl")
    raw = {"records": str(tmp_path / "r.jsonl"), "continuations": str(tmp_path / "c.jsonl"), "seed": 3}
    spec, extra = resolve_speculative_config(
        {"method": "replay_bench", "num-speculative-tokens": 4, "replay_bench": raw,
         "hybridspec": {"fixed_length": 3}}, SimpleNamespace(get_vocab_size=lambda: VOCAB))
    assert spec["method"] == "custom_class" and extra["replay_bench"]["seed"] == 3
    assert extra["hybridspec"]["fixed_length"] == 3
    with pytest.raises(ValueError, match="'replay_bench', for benchmarking only"):
        resolve_speculative_config({"method": "replay-bench", "num_speculative_tokens": 4}, None)


def fake_vllm_config(tmp_path, k, seed, hybridspec=None, max_num_seqs=16):
    extra = {"replay_bench": {"records": str(tmp_path / "r.jsonl"), "continuations": str(tmp_path / "c.jsonl"),
                              "seed": seed}}
    if hybridspec is not None:
        extra["hybridspec"] = hybridspec
    return SimpleNamespace(
        additional_config=extra, speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=4096),
        device_config=SimpleNamespace(device="cpu"), scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def simulate(proposer, prompts, outputs, max_tokens, order_rng):
    """A greedy target over a shuffled batch: each round accepts the drafts' matching prefix of the
    true continuation plus one token. Returns {(prompt index, position): accepted} and the draft lengths."""
    k = proposer.k
    generated = {i: [outputs[i][0]] for i in range(len(prompts))}  # the prefill's token
    seen, lengths = {}, []
    while True:
        live = [i for i in generated if len(generated[i]) < max_tokens]
        if not live:
            return seen, lengths
        rows = list(order_rng.permutation(live))
        width = max(len(prompts[i]) + len(generated[i]) for i in rows)
        token_ids = np.zeros((len(rows), width + k + 1), dtype=np.int32)
        num = np.zeros(len(rows), dtype=np.int32)
        for r, i in enumerate(rows):
            seq = prompts[i] + generated[i]
            token_ids[r, :len(seq)], num[r] = seq, len(seq)
        drafts = proposer.propose([[1]] * len(rows), num, token_ids)
        for r, i in enumerate(rows):
            g = len(generated[i])
            true = outputs[i][g: g + len(drafts[r]) + 1]
            a = int(np.cumprod(np.array(drafts[r]) == np.array(true[:len(drafts[r])])).sum())
            assert a == proposer.last_accepted[r]
            seen[(i, g)] = a
            lengths.append(len(drafts[r]))
            generated[i] += true[:a + 1]


def test_proposer_against_a_simulated_greedy_target(tmp_path, rng):
    from vllm_hybridspec.engine.replay.proposer import ReplayBenchProposer

    k, d, max_tokens = 5, 7, 120
    probs = rng.dirichlet(np.ones(d + 1))
    accepted, truncated = write_records(tmp_path / "r.jsonl", rng, 500, d, probs=probs, truncated_frac=0.1)
    pool = np.minimum(accepted[~truncated], k)
    prompts = prefix_free_prompts(rng, 12)
    outputs = [rng.integers(0, VOCAB, max_tokens + k).tolist() for _ in prompts]
    save_continuations([(p, o, max_tokens) for p, o in zip(prompts, outputs)], tmp_path / "c.jsonl")
    seed = int(rng.integers(1 << 30))

    proposer = ReplayBenchProposer(fake_vllm_config(tmp_path, k, seed))
    seen, lengths = simulate(proposer, prompts, outputs, max_tokens, rng)
    assert set(lengths) == {k}  # outputs recorded K past max_tokens: every round drafts K
    values = np.array(list(seen.values()))
    bound = 4 * pool.std() / math.sqrt(len(values))
    print(f"{len(values)} rounds: mean accepted {values.mean():.3f}, records {pool.mean():.3f} +- {bound:.3f}")
    assert abs(values.mean() - pool.mean()) < bound
    stats = proposer.stats()
    assert stats["rounds"] == len(values) and stats["accepted_planned"] == values.sum()
    assert stats["draft_tokens"] == k * len(values) and stats["diverged_requests"] == 0
    assert proposer.last_draft.tokens.shape == proposer.last_draft.top1_prob.shape == (len(proposer.last_accepted), k)

    # another batch order (and a fresh proposer): the same rounds at the same places
    again, _ = simulate(ReplayBenchProposer(fake_vllm_config(tmp_path, k, seed)), prompts, outputs, max_tokens, rng)
    assert again == seen

    # unknown prompt: an error naming it
    with pytest.raises(ValueError, match=r"batch row 0, 3 tokens so far, starting \[95, 95, 95\]\) matches no "
                                         r"prompt of the continuations file"):
        stranger = np.array([[95, 95, 95]], dtype=np.int32)
        if proposer.continuations.find(stranger[0].astype(np.int64)) is not None:
            pytest.fail("the random prompts happen to start with 95 95 95; rerun")
        proposer.propose([[1]], np.array([3]), stranger)


def test_proposer_with_fixed_verification_length(tmp_path, rng):
    """The length selector (here "fixed_length": 3 verifies 2 drafts) cuts the replayed drafts; a
    greedy target then accepts min(A, 2)."""
    from vllm_hybridspec.engine.replay.proposer import ReplayBenchProposer

    k, d, max_tokens = 4, 4, 60
    write_records(tmp_path / "r.jsonl", rng, 200, d)
    prompts = prefix_free_prompts(rng, 6)
    outputs = [rng.integers(0, VOCAB, max_tokens + k).tolist() for _ in prompts]
    save_continuations([(p, o, max_tokens) for p, o in zip(prompts, outputs)], tmp_path / "c.jsonl")
    proposer = ReplayBenchProposer(fake_vllm_config(tmp_path, k, 1, hybridspec={"fixed_length": 3, "gate": False}))
    seen, lengths = simulate(proposer, prompts, outputs, max_tokens, rng)
    assert max(lengths) == 2 and set(lengths) <= {0, 1, 2}  # fewer only at the end of the output budget
    assert lengths.count(2) > 0.8 * len(lengths)
    assert max(seen.values()) <= 2 and proposer.length_selector.stats()["rows_at_length"].get(3, 0) > 0


def test_vllm_custom_class_interface(monkeypatch):
    """The vLLM 0.26 symbols the replay proposer relies on (vllm_internals.check_custom_class_proposer_interface)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybridspec.engine.replay.proposer import check_custom_class_proposer_interface

    check_custom_class_proposer_interface()

    def changed(self, scheduler_output, sampled_token_ids, *args):
        if self.speculative_config.method == "custom_class":
            return self.drafter.propose(sampled_token_ids, self.input_batch.token_ids_cpu)
        return None

    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", changed)
    with pytest.raises(RuntimeError, match="vLLM changed: GPUModelRunner.propose_draft_token_ids no longer calls"):
        check_custom_class_proposer_interface()
