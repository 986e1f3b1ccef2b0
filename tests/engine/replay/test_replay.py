"""The replay's logic (benchmarking only), without an engine: draws, corruption, the files, the
config's refusals, and a simulated greedy target driving the device lookup (``ReplayLookup``) round
by round, paired with the host reference (``replayed_rounds``, ``corrupt``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hybridspec.engine.config import resolve_speculative_config
from vllm_hybridspec.engine.replay.config import parse_replay_options, resolve_replay_speculative_config
from vllm_hybridspec.engine.replay.data import (
    Continuations,
    corrupt,
    load_continuations,
    load_replay_rounds,
    replayed_rounds,
    save_continuations,
)
from vllm_hybridspec.engine.replay.lookup import COUNTERS, ReplayLookup
from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.records import RoundRecord, save_records
from ...seeds import fresh_seed

VOCAB = 96


@pytest.fixture
def rng():
    seed = fresh_seed("replay_rng")
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
        "empty": ([], r"holds no requests"),
    }
    for name, (lines, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
        with pytest.raises(InputError, match=message):
            load_continuations(path)
    with pytest.raises(InputError, match=r"does not exist; record one with `hybridspec replay-record`"):
        load_continuations(tmp_path / "missing.jsonl")


def test_continuations_are_found_by_their_exact_prompt(tmp_path, rng):
    """A request's continuation is found by its whole prompt, so one prompt may be a prefix of another."""
    prompts = prefix_free_prompts(rng, 40)
    prompts.append(prompts[0] + [7, 8])  # prompts[0] is a prefix of this one
    outputs = [rng.integers(0, VOCAB, 30).tolist() for _ in prompts]
    save_continuations([(p, o, 20) for p, o in zip(prompts, outputs)], tmp_path / "c.jsonl")
    cont = load_continuations(tmp_path / "c.jsonl")
    assert isinstance(cont, Continuations) and len(cont.entries) == 41
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        assert cont.index(p) == i and cont.find(np.array(p)).output.tolist() == o
    assert cont.index(prompts[0] + [7]) is None and cont.find(prompts[1][:-1]) is None


def test_replay_config_refusals_name_the_bad_value(tmp_path, rng):
    """What is refused before an H-Spec checkpoint is read (the engine tests cover the rest)."""
    write_records(tmp_path / "r.jsonl", rng, 50, 6)
    save_continuations([([1, 2, 3], [4, 5, 6, 7, 8], 2)], tmp_path / "c.jsonl")
    raw = {"records": str(tmp_path / "r.jsonl"), "continuations": str(tmp_path / "c.jsonl")}
    assert parse_replay_options(raw, 4, VOCAB) == {**raw, "seed": 0}
    target = SimpleNamespace(get_vocab_size=lambda: VOCAB)
    bad = [
        ({"model": "h", "num_speculative_tokens": 4}, r'needs "replay_bench"'),
        ({"num_speculative_tokens": 4, "replay_bench": raw}, r'needs "model": an H-Spec checkpoint .* got None'),
        ({"model": "", "replay_bench": raw}, r"needs \"model\": an H-Spec checkpoint .* got ''"),
        ({"model": "h", "num_speculative_tokens": 0, "replay_bench": raw}, r'"num_speculative_tokens" >= 1, got 0'),
    ]
    for spec_dict, message in bad:
        with pytest.raises(ValueError, match=message):
            resolve_replay_speculative_config({"method": "replay_bench", **spec_dict}, target,
                                              resolve_hspec=resolve_speculative_config)
    bad_options = [
        ({**raw, "seed": -1}, 4, r"seed\" must be an integer >= 0"),
        ({**raw, "record": "x"}, 4, r"unknown \"replay_bench\" keys"),
        ({"records": raw["records"]}, 4, r'needs "continuations"'),
        ([1], 4, r"must be a JSON object"),
        (raw, 7, r"D = 6 draft tokens"),
    ]
    for options, k, message in bad_options:
        with pytest.raises(ValueError, match=message):
            parse_replay_options(options, k, VOCAB)
    with pytest.raises(ValueError, match=r"token id 8 .* outside the target's vocabulary of 8"):
        parse_replay_options(raw, 4, vocab_size=8)


def no_successor_sequence(rng, n):
    """Random tokens in which no token is followed by ``(token + 1) % VOCAB``: the lookup's fallback
    draft is never what such a target produces, so it is rejected at position 0."""
    out = [int(rng.integers(VOCAB))]
    while len(out) < n:
        t = int(rng.integers(VOCAB))
        if t != (out[-1] + 1) % VOCAB:
            out.append(t)
    return out


def states_of(requests):
    """What the lookup reads of vLLM's ``CachedRequestState``."""
    return {r["id"]: SimpleNamespace(prompt_token_ids=r["prompt"], num_prompt_tokens=len(r["prompt"]),
                                     sampling_params=SimpleNamespace(max_tokens=r["max_tokens"])) for r in requests}


def simulate(lookup, requests, rng, k_max, order_rng, cut=None):
    """A greedy target over shuffled batches: each round accepts the drafts' prefix that matches the
    request's ``truth`` (what the target produces) plus one token; k per step drawn from 1..k_max;
    ``cut(n)`` gives the drafts a length selector leaves. Requests that finished stay one more round in
    the batch (as under async scheduling). Returns {(id, g): (planned, accepted, k, replayed)}."""
    states = states_of(requests)
    generated = {r["id"]: [r["truth"][0]] for r in requests}  # the prefill's token
    by_id = {r["id"]: r for r in requests}
    lingering: set[str] = set()
    seen = {}
    while True:
        live = [r["id"] for r in requests if len(generated[r["id"]]) < r["max_tokens"]]
        if not live:
            return seen
        ids = [live[i] for i in order_rng.permutation(len(live))] + sorted(lingering)
        k = int(rng.integers(1, k_max + 1))
        prefix = torch.tensor([len(by_id[i]["prompt"]) + len(generated[i]) - 1 for i in ids], dtype=torch.int32)
        anchors = torch.tensor([generated[i][-1] for i in ids], dtype=torch.int32)
        replay = lookup.plan(lookup.rows(ids, states), anchors, prefix, k)
        kept = None if cut is None else torch.as_tensor(cut(len(ids)), dtype=torch.int32)
        planned, verified = lookup.count(replay, kept)
        lingering = set()
        for row, i in enumerate(ids):
            g = len(generated[i])
            if g >= by_id[i]["max_tokens"]:
                assert not replay.live[row] and verified[row] == 0
                continue
            draft = replay.tokens[row, : int(verified[row])].tolist()
            truth = by_id[i]["truth"][g: g + len(draft) + 1]
            accepted = int(np.cumprod(np.array(draft) == np.array(truth[: len(draft)])).sum()) if draft else 0
            seen[(i, g)] = (int(planned[row]), accepted, k, bool(replay.accepted[row] > 0 or (
                replay.live[row] and not replay.unrecorded[row] and not replay.left[row])))
            generated[i] += truth[: accepted + 1]
            if len(generated[i]) >= by_id[i]["max_tokens"]:
                lingering.add(i)


def replay_requests(rng, k, max_tokens, n=10):
    """Recorded requests (the target produces their recording), one whose target output leaves its
    recording at position 30, and one that was never recorded."""
    prompts = [rng.integers(0, VOCAB, rng.integers(3, 20)).tolist() for _ in range(n + 1)]
    prompts.append(prompts[0] + [5])  # one prompt a prefix of another
    recorded = [rng.integers(0, VOCAB, max_tokens + k).tolist() for _ in range(n + 1)]
    requests = [{"id": f"r{i}", "prompt": p, "truth": o, "max_tokens": max_tokens}
                for i, (p, o) in enumerate(zip(prompts, recorded))]
    leaving = requests[n]
    leaving["truth"] = recorded[n][:30] + no_successor_sequence(rng, max_tokens + k - 30)
    if leaving["truth"][30] == recorded[n][30]:
        leaving["truth"][30] = (recorded[n][30] + 2) % VOCAB
    unrecorded = {"id": "stranger", "prompt": [VOCAB - 1] * 25, "truth": no_successor_sequence(rng, max_tokens + k),
                  "max_tokens": max_tokens}
    entries = [(r["prompt"], o, max_tokens) for r, o in zip(requests, recorded)]
    return requests + [unrecorded], entries


def make_lookup(tmp_path, rng, k, max_tokens, d=None, num_slots=64, seed=None):
    d = d or k + 2
    probs = rng.dirichlet(np.ones(d + 1))
    write_records(tmp_path / "r.jsonl", rng, 500, d, probs=probs, truncated_frac=0.1)
    requests, entries = replay_requests(rng, k, max_tokens)
    save_continuations(entries, tmp_path / "c.jsonl")
    seed = int(rng.integers(1 << 30)) if seed is None else seed
    rounds = load_replay_rounds(tmp_path / "r.jsonl", k)
    lookup = ReplayLookup(load_continuations(tmp_path / "c.jsonl"), rounds, seed, VOCAB, 4096, "cpu", num_slots)
    return lookup, requests, rounds, seed


def test_lookup_against_a_simulated_greedy_target(tmp_path, rng):
    k, max_tokens = 5, 90
    lookup, requests, rounds, seed = make_lookup(tmp_path, rng, k, max_tokens, num_slots=2)
    seen = simulate(lookup, requests, rng, k, rng)
    stats = lookup.stats()
    print(f"{len(seen)} rounds; stats {stats}")
    by_id = {r["id"]: r for r in requests}
    leaving, stranger = requests[-2]["id"], "stranger"
    # (1) the draft is the host reference's: the recording corrupted at min(A_D, k) of the drawn record
    cont = lookup.continuations
    for (i, g), (planned, accepted, kk, replayed) in seen.items():
        if not replayed:
            continue
        entry = cont.find(by_id[i]["prompt"])
        a = int(rounds.accepted[replayed_rounds(seed, entry.key, g + 1, len(rounds.accepted))[g]])
        assert planned == min(a, kk), (i, g)
        draft = corrupt(entry.output[g: g + kk], a, VOCAB)
        assert int(np.cumprod(draft == np.array(by_id[i]["truth"][g: g + kk])).sum()) == accepted
    # (2) every round accepts exactly the plan, but the one where the leaving request's output
    # leaves its recording (the recording promised more there)
    for (i, g), (planned, accepted, _, _) in seen.items():
        if i == leaving and g <= 30:
            assert accepted <= planned
        else:
            assert accepted == planned, (i, g)
    assert all(p == a == 0 for (i, g), (p, a, _, _) in seen.items() if i == stranger or (i == leaving and g > 30))
    # (3) the counters
    rounds_of = lambda i: sum(1 for (j, _) in seen if j == i)
    assert stats["rounds"] == len(seen) and stats["draft_tokens"] == sum(kk for (_, _, kk, _) in seen.values())
    assert stats["accepted_planned"] == sum(p for (p, _, _, _) in seen.values())
    assert stats["unrecorded_requests"] == 1 and stats["unrecorded_rounds"] == rounds_of(stranger) == max_tokens - 1
    assert stats["left_requests"] == 1
    assert stats["left_rounds"] == sum(1 for (i, g) in seen if i == leaving and g > 30)
    assert set(stats) == {*COUNTERS, "unrecorded_requests", "records_mean_accepted"}
    # (4) the replayed acceptance follows the records' (k varies per step: compare min(A, k))
    full = [(p, kk) for (i, _), (p, _, kk, r) in seen.items() if r and kk == k]
    values = np.array([p for p, _ in full])
    bound = 4 * rounds.accepted.std() / math.sqrt(len(values))
    assert abs(values.mean() - rounds.accepted.mean()) < bound, (values.mean(), rounds.accepted.mean(), bound)
    # (5) another batch order and fresh slots: the same rounds at the same places
    again_lookup = ReplayLookup(cont, rounds, seed, VOCAB, 4096, "cpu", 64)
    again = simulate(again_lookup, requests, np.random.default_rng(7), k, np.random.default_rng(8))
    common = set(seen) & set(again)
    assert len(common) > len(seen) / 4
    assert all(seen[x][1] == again[x][1] or x[0] == leaving for x in common if seen[x][2] == again[x][2])


def test_lookup_with_the_selectors_cut(tmp_path, rng):
    """The length selector's kept drafts cap what is verified, and a greedy target accepts min(A, kept)."""
    k, max_tokens = 4, 50
    lookup, requests, _, _ = make_lookup(tmp_path, rng, k, max_tokens)
    seen = simulate(lookup, requests, rng, k, rng, cut=lambda n: rng.integers(0, k + 1, n))
    assert all(a == p for (i, g), (p, a, _, _) in seen.items() if i != requests[-2]["id"])
    stats = lookup.stats()
    print(stats)
    assert stats["rounds"] < len(seen)  # rows cut to 0 drafts are no round
    assert stats["accepted_planned"] == sum(p for (p, _, _, _) in seen.values())


def test_a_new_request_in_a_used_slot_starts_on_the_recording(tmp_path, rng):
    """Slots of finished requests are reused (two slots for twelve requests here); the flag of a request
    that left its recording is not inherited."""
    k, max_tokens = 3, 40
    lookup, requests, _, _ = make_lookup(tmp_path, rng, k, max_tokens, num_slots=2)
    leaving = requests[-2]
    first = [leaving, requests[-1]]
    simulate(lookup, first, rng, k, rng)
    before = lookup.stats()
    assert before["left_requests"] == 1 and before["left_rounds"] > 0 and lookup.left.numel() == 2
    rest = requests[:-2]  # the first two finished: the runner no longer holds them
    seen = simulate(lookup, rest, rng, k, rng)
    after = lookup.stats()
    assert all(a == p for (a, p, _, _) in seen.values())
    assert (after["left_requests"], after["left_rounds"]) == (1, before["left_rounds"])
    assert after["accepted_planned"] - before["accepted_planned"] == sum(p for (p, _, _, _) in seen.values()) > 0
    assert lookup.left.numel() >= len(rest)  # all ten decode together: the flags grew


def test_a_config_only_drafter_serves_the_replay_with_dummy_weights(tmp_path, rng):
    """The 35B-shape recipe's drafter (``hybridspec full-shape``'s ``hspec/``) has a config.json and no
    weights: the replay resolves as ``"hspec"`` does, with the engine's load format, so dummy weights
    pass and a missing weight file is refused otherwise."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig

    from vllm_hybridspec.engine.config import resolve_speculative_config

    models = Path(__file__).resolve().parents[3] / "models"
    drafter = tmp_path / "hspec"
    drafter.mkdir()
    shutil.copy(models / "dense-hspec" / "config.json", drafter / "config.json")
    hf_config = AutoConfig.from_pretrained(models / "dense")
    target = SimpleNamespace(hf_config=hf_config, get_vocab_size=lambda: hf_config.vocab_size)
    write_records(tmp_path / "r.jsonl", rng, 50, 6)
    save_continuations([([1, 2, 3], [4, 5, 6, 7, 8], 2)], tmp_path / "c.jsonl")
    spec = {"method": "replay_bench", "model": str(drafter), "num_speculative_tokens": 4,
            "replay_bench": {"records": str(tmp_path / "r.jsonl"), "continuations": str(tmp_path / "c.jsonl")}}
    resolved, extra = resolve_speculative_config(spec, target, "dummy")
    assert resolved == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    assert extra["replay_bench"]["seed"] == 0
    with pytest.raises(ValueError, match=r"has no weights: .*load_format='dummy' for random weights"):
        resolve_speculative_config(spec, target, "auto")
