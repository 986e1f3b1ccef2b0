"""The replay proposer (benchmarking only) in the CPU engine: a tiny dense Qwen3 target with a tiny random
H-Spec drafter that runs every round, under sync and (forced) async scheduling, and the tiny hybrid.
Greedy outputs equal a separate plain engine's (the recording), every round accepts exactly the
replayed plan's count, a request that is not in the recording is counted and accepts nothing, and
bad inputs give errors that name them."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_hybridspec.engine.length.capture import scheduled_draft_counts
from vllm_hybridspec.engine.length.cut import NO_CUT, cut_of
from vllm_hybridspec.engine.replay.proposer import ReplayHSpecProposer
from vllm_hybridspec.policy.records import RoundRecord, save_records

from .conftest import drafter_of, fresh_seed, make_llm, runner_of

pytestmark = pytest.mark.timeout(900)

K, D, MAX_TOKENS, NUM_PROMPTS, NUM_RECORDS = 4, 6, 96, 8, 400
STRANGER_TOKENS = 24  # the unrecorded request's output length
ENGINE = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
          "max_num_seqs": 8, "max_num_batched_tokens": 512, "seed": 0}


def prompts(seed: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    while len(out) < n:
        p = torch.randint(0, 95, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
        if p not in out:
            out.append(p)
    return out


def synthetic_records(path, seed: int, d: int = D, k: int = K, n: int = NUM_RECORDS) -> np.ndarray:
    """Rounds with A_D drawn from a known distribution over 0..D (D > K: the replay caps at K),
    a few truncated rounds (never replayed); returns the replayable min(A_D, K)."""
    rng = np.random.default_rng(seed)
    probs = np.full(d + 1, 0.4 / (d - 2))
    probs[:3] = [0.25, 0.2, 0.15]
    accepted = rng.choice(d + 1, size=n, p=probs / probs.sum())
    truncated = rng.random(n) < 0.05
    records = [RoundRecord(conf=rng.uniform(0.05, 1, d).tolist(), ent=rng.uniform(0, 3, d).tolist(),
                           accepted=int(a), truncated=bool(t)) for a, t in zip(accepted, truncated)]
    save_records(records, path)
    return np.minimum(accepted[~truncated], k)


def no_successor(tokens: list[int], vocab: int) -> bool:
    """No token is followed by ``(token + 1) % vocab``, the draft of a request the replay does not know:
    a greedy target producing ``tokens`` rejects that draft at position 0 in every round."""
    return all(b != (a + 1) % vocab for a, b in itertools.pairwise(tokens))


@pytest.fixture(scope="module")
def replay_setup(target_dir, tmp_path_factory):
    """The recording: plain greedy decoding by a separate engine (``hybridspec replay-record``) of the
    benchmark prompts and of a few candidates for the unrecorded request, which is left out of the
    continuations file."""
    tmp = tmp_path_factory.mktemp("replay")
    seed = fresh_seed("replay_engine_replay_setup")
    ps = prompts(seed, NUM_PROMPTS + 8)
    prompt_file = tmp / "prompts.jsonl"
    # a benchmark cycles its prompts: the recording keeps one line per prompt
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ps + ps[:3]))
    everything = tmp / "everything.jsonl"
    result = subprocess.run([
        sys.executable, "-m", "vllm_hybridspec.cli", "replay-record", "--model", str(target_dir), "-o", str(everything),
        "--prompts", str(prompt_file), "--output-len", str(MAX_TOKENS), "--num-speculative-tokens", str(K),
        "--dtype", "float32", "--max-model-len", "256", "--engine-args",
        json.dumps({k: v for k, v in ENGINE.items() if k not in ("dtype", "max_model_len")})],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    assert f"recorded {NUM_PROMPTS + 8} greedy continuations of {MAX_TOKENS} + {K} tokens" in result.stdout
    recorded = [json.loads(line) for line in everything.read_text().splitlines()]
    assert [r["prompt_token_ids"] for r in recorded] == ps
    assert all(len(r["output_token_ids"]) == MAX_TOKENS + K and r["max_tokens"] == MAX_TOKENS for r in recorded)
    strangers = [r for r in recorded[NUM_PROMPTS:] if no_successor(r["output_token_ids"][:STRANGER_TOKENS], 96)]
    assert strangers, "no candidate for the unrecorded request; rerun"
    cont = tmp / "continuations.jsonl"
    cont.write_text("".join(json.dumps(r) + "\n" for r in recorded[:NUM_PROMPTS]))
    records = tmp / "rounds.jsonl"
    pool = synthetic_records(records, seed)
    return {"prompts": ps[:NUM_PROMPTS], "cont": cont, "records": records, "pool": pool, "seed": seed,
            "recorded": recorded[:NUM_PROMPTS], "stranger": strangers[0]}


def spec(setup, hspec_dir, **replay):
    return {"method": "replay_bench", "model": str(hspec_dir), "num_speculative_tokens": K,
            "replay_bench": {"records": str(setup["records"]), "continuations": str(setup["cont"]),
                             "seed": setup["seed"], **replay}}


def vllm_counters(llm) -> tuple[float, float, float]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return tuple(metrics[f"vllm:spec_decode_num_{n}"].value for n in ("drafts", "draft_tokens", "accepted_tokens"))


class RoundLog:
    """Every round of an engine as the replay planned it (the proposer's per-row plan after each
    ``propose``) and as the target verified it (the rejection sampler's output in the runner's
    after-sampling step of the next step), by request: instance attributes shadow the runner's and
    the proposer's methods."""

    def __init__(self, llm):
        runner = runner_of(llm)
        proposer = runner.drafter
        self.events: list[tuple] = []
        self.prompt_of: dict[str, tuple[int, ...]] = {}
        propose, after = proposer.propose, runner._update_states_after_model_execute

        def logged_propose(*args, **kwargs):
            drafts = propose(*args, **kwargs)
            plan = {}
            if proposer.last_verified is not None:
                n = proposer.last_verified.shape[0]
                plan = dict(zip(runner.input_batch.req_ids[:n],
                                zip(proposer.last_accepted.tolist(), proposer.last_verified.tolist())))
            self.events.append(("plan", plan))
            return drafts

        def logged_after(output_token_ids, scheduler_output):
            after(output_token_ids, scheduler_output)
            kept = (output_token_ids != -1).sum(dim=1).tolist()
            index = runner.input_batch.req_id_to_index
            cut = cut_of(runner)  # the step verified min(scheduled, w - 1) drafts of each row
            w = cut.w[: len(kept)].tolist() if cut is not None and cut.active else [NO_CUT] * len(kept)
            verified = {}
            for req_id, n in scheduled_draft_counts(scheduler_output).items():
                row = index.get(req_id, len(kept))
                if row < len(kept) and min(n, w[row] - 1) > 0:
                    verified[req_id] = (min(n, w[row] - 1), kept[row] - 1)
                    self.prompt_of[req_id] = tuple(runner.requests[req_id].prompt_token_ids)
            self.events.append(("verify", verified))

        proposer.propose = logged_propose
        runner._update_states_after_model_execute = logged_after

    def rounds(self) -> list[tuple]:
        """``(prompt, verified drafts, accepted, planned accepted, planned verified)`` per verified
        round, with the plan of the step that drafted it (``None`` where there was none)."""
        plan: dict = {}
        out = []
        for kind, data in self.events:
            if kind == "plan":
                plan = data
                continue
            for req_id, (n, accepted) in data.items():
                out.append((self.prompt_of[req_id], n, accepted, *plan.get(req_id, (None, None))))
        return out


def check_rounds(log: RoundLog, exact: set, k: int = K) -> list[tuple]:
    """Every verified round of a request in ``exact`` (whose output is the recording's) accepts exactly
    the planned count, with the planned number of drafts. Under async scheduling the scheduler may run a
    request once more after its last token, before it learns that it finished; the replay planned no
    round there (its output limit was reached), vLLM counts none, and so it must be the request's last.
    Returns the other rounds."""
    rounds = log.rounds()
    after_end = [i for i, r in enumerate(rounds) if r[4] == 0]
    last = {r[0]: i for i, r in enumerate(rounds)}
    assert all(last[rounds[i][0]] == i for i in after_end), [rounds[i] for i in after_end]
    counted = [r for i, r in enumerate(rounds) if r[4] != 0]
    checked = [r for r in counted if r[0] in exact]
    assert checked
    bad = [r for r in checked if (r[1], r[2]) != (r[4], r[3])]
    assert not bad, (len(bad), len(checked), bad[:10])
    return counted


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_replay_greedy_identity_and_acceptance(target_dir, hspec_dir, replay_setup, scheduling, request):
    if scheduling == "async":
        request.getfixturevalue("async_scheduling")
    s = replay_setup
    llm = make_llm(target_dir, spec(s, hspec_dir), disable_log_stats=False)
    runner = runner_of(llm)
    assert runner.use_async_scheduling == (scheduling == "async")
    proposer = drafter_of(llm)
    assert type(proposer) is ReplayHSpecProposer
    assert runner.speculative_config.method == "dflash"
    log = RoundLog(llm)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], greedy)

    # (1) greedy output equals the plain engine's (the recording, cut to MAX_TOKENS)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"][:MAX_TOKENS] for r in s["recorded"]}
    assert [list(o.outputs[0].token_ids) for o in outputs] == [plain[tuple(p)] for p in s["prompts"]]

    # (2) every round accepts exactly the replayed count; vLLM's counters equal the plan's
    rounds = check_rounds(log, set(plain))
    drafts, drafted, accepted = vllm_counters(llm)
    stats = proposer.stats()
    pool = s["pool"]
    bound = 4 * pool.std() / math.sqrt(drafts)
    print(f"{scheduling}: vLLM {drafts} drafts, {drafted} draft tokens, {accepted} accepted; engine mean "
          f"{accepted / drafts:.3f} vs records mean {pool.mean():.3f} +- {bound:.3f} (4 sigma); proposer {stats}")
    assert len(rounds) == drafts == stats["rounds"]
    assert (drafted, accepted) == (stats["draft_tokens"], stats["accepted_planned"]) == (K * drafts, sum(r[2] for r in rounds))
    assert stats["unrecorded_requests"] == stats["left_requests"] == stats["unrecorded_rounds"] == 0
    assert abs(stats["records_mean_accepted"] - pool.mean()) < 1e-12
    assert abs(accepted / drafts - pool.mean()) < bound
    # the drafter ran: its signals were replaced by the records' ([N, K] on the engine's device)
    block = proposer.last_draft
    assert block.top1_prob.shape == block.entropy.shape == block.tokens.shape and block.tokens.shape[1] == K
    assert bool((block.top1_prob >= 0.05).all()) and bool((block.entropy >= 0).all())

    # (3) a request that is not in the recording: counted, and every one of its rounds accepts nothing
    stranger = s["stranger"]
    out = llm.generate([{"prompt_token_ids": stranger["prompt_token_ids"]}],
                       SamplingParams(temperature=0, max_tokens=STRANGER_TOKENS, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == stranger["output_token_ids"][:STRANGER_TOKENS]
    after = proposer.stats()
    mine = [r for r in log.rounds() if r[0] == tuple(stranger["prompt_token_ids"]) and r[4] != 0]
    print(f"unrecorded request: {len(mine)} rounds; proposer {after}")
    assert len(mine) == STRANGER_TOKENS - 1 == after["unrecorded_rounds"] and after["unrecorded_requests"] == 1
    assert all((r[2], r[3]) == (0, 0) for r in mine)
    assert vllm_counters(llm)[2] == accepted == after["accepted_planned"]


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


def test_replay_with_the_length_policy(target_dir, hspec_dir, replay_setup, tmp_path):
    """The policy picks lengths from the replayed confidences (the drafter's own are replaced); outputs
    stay plain decoding's, and every round accepts min(A, the selected drafts)."""
    s = replay_setup
    config = {**spec(s, hspec_dir), "hybridspec": {"policy": confidence_policy(tmp_path / "p.json")}}
    llm = make_llm(target_dir, config, disable_log_stats=False)
    proposer = drafter_of(llm)
    log = RoundLog(llm)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], greedy)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"][:MAX_TOKENS] for r in s["recorded"]}
    assert [list(o.outputs[0].token_ids) for o in outputs] == [plain[tuple(p)] for p in s["prompts"]]
    rounds = check_rounds(log, set(plain))
    counters = vllm_counters(llm)
    stats = proposer.stats()
    lengths = proposer.length_selector.stats()["rows_at_length"]
    print(f"replay + policy: vLLM (drafts, draft tokens, accepted) {counters}; proposer {stats}; "
          f"rows at length w {lengths}")
    # the rounds verified exactly the planned drafts, cut on the device from the K vLLM scheduled (vLLM
    # counts those K per row and the cut ones as rejected)
    verified = int(cut_of(runner_of(llm)).verified_drafts)
    assert (stats["rounds"], stats["draft_tokens"], stats["accepted_planned"]) == (
        len(rounds), sum(r[1] for r in rounds), sum(r[2] for r in rounds))
    assert verified == stats["draft_tokens"] and counters[2] == stats["accepted_planned"]
    assert counters[1] == K * counters[0] and verified < counters[1]  # the policy cut drafts
    assert len([w for w, c in lengths.items() if c]) >= 3  # at several lengths


def test_replay_under_vllms_dynamic_speculative_decoding(target_dir, hspec_dir, replay_setup):
    """vLLM's own dynamic speculative decoding (`num_speculative_tokens_per_batch_size`) reaches the
    replay through the dflash route's ``propose(num_speculative_tokens=...)``: one draft per request in
    batches of 3 to 8, K once six requests have finished, every round exact and the output plain
    decoding's."""
    s = replay_setup
    config = {**spec(s, hspec_dir), "num_speculative_tokens_per_batch_size": [[1, 2, K], [3, 8, 1]]}
    llm = make_llm(target_dir, config, disable_log_stats=False)
    log = RoundLog(llm)
    max_tokens = [MAX_TOKENS // 4] * (NUM_PROMPTS - 2) + [MAX_TOKENS] * 2
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in s["prompts"]], params)
    plain = {tuple(r["prompt_token_ids"]): r["output_token_ids"] for r in s["recorded"]}
    assert [list(o.outputs[0].token_ids) for o in outputs] == [plain[tuple(p)][:m] for p, m in zip(s["prompts"], max_tokens)]
    rounds = check_rounds(log, set(plain))
    drafts, drafted, accepted = vllm_counters(llm)
    stats = drafter_of(llm).stats()
    sizes = {n: sum(1 for r in rounds if r[1] == n) for n in range(K + 1)}
    print(f"dynamic speculative decoding: {drafts} drafts, {drafted} draft tokens, {accepted} accepted; "
          f"rounds per draft size {sizes}")
    assert sizes[1] > 0 and sizes[K] > 0 and sizes[1] + sizes[K] == len(rounds)
    assert (drafts, drafted, accepted) == (stats["rounds"], stats["draft_tokens"], stats["accepted_planned"])


def test_bad_replay_configs_fail_at_engine_start(target_dir, hspec_dir, replay_setup, tmp_path):
    from .conftest import save_dflash

    s = replay_setup
    bad_vocab = tmp_path / "vocab.jsonl"
    bad_vocab.write_text(json.dumps({"prompt_token_ids": [1, 2], "output_token_ids": [3, 500], "max_tokens": 1}) + "\n")
    cases = [
        (spec(s, hspec_dir, continuations="/nonexistent/c.jsonl"), r"continuations file '/nonexistent/c.jsonl' does not exist"),
        (spec(s, hspec_dir, records="/nonexistent/r.jsonl"), r"records file '/nonexistent/r.jsonl' does not exist"),
        (spec(s, hspec_dir, seed="x"), r'"replay_bench.seed" must be an integer >= 0'),
        (spec(s, hspec_dir, continuations=str(bad_vocab)), r"token id 500 .* outside the target's vocabulary of 96"),
        ({**spec(s, hspec_dir), "num_speculative_tokens": D + 1},
         rf"D = {D} draft tokens, but the replay proposes K = num_speculative_tokens = {D + 1}"),
        ({**spec(s, hspec_dir), "model": None}, r'"replay_bench" needs "model": an H-Spec checkpoint'),
        ({**spec(s, hspec_dir), "model": str(save_dflash(target_dir, tmp_path / "dflash", 1))},
         r"is not an H-Spec checkpoint"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(target_dir, config)


def test_replay_on_the_tiny_hybrid(tmp_path, request):
    """An 8-layer hybrid Qwen3-Next target (one-slot GDN verification) with an H-Spec drafter reading its
    two full-attention layers, under async scheduling: greedy identity with a plain engine up to
    floating-point ties (the shared check, ``identity.py``), and every round of a request whose
    output is the recording's accepts exactly the replayed count."""
    from transformers import AutoConfig
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm_hybridspec.drafter import HSpecDraftModel
    from vllm_hybridspec.tools.replay_record import record_continuations
    from vllm_hybridspec.train.tiny_target import save_tiny_qwen3_next

    from . import identity
    from .conftest import fresh_seed
    from .test_gdn_layer_engine import check_hybrid_identity, gdn_layers, hybrid_llm

    # the dense engines before this one set up vLLM's process groups without the expert-parallel one
    cleanup_dist_env_and_memory()
    vocab, k, max_tokens, n = 48, 3, 24, 24
    target = save_tiny_qwen3_next(tmp_path / "target", torch.float32, fresh_seed("replay hybrid weights"),
                                  vocab_size=vocab, num_hidden_layers=8, pad_token_id=0)
    # the drafter reads the two full-attention layers' K/V (3 and 7) and the inputs of four layers
    drafter = {"target_layer_ids": [1, 3, 5, 7], "kv_reuse_layer_ids": [3, 7], "mask_token_id": vocab - 1,
               "mamba_num_heads": 4, "mamba_head_dim": 16, "markov_rank": 16}
    torch.manual_seed(fresh_seed("replay H-Spec drafter weights"))
    HSpecDraftModel.from_training_args(AutoConfig.from_pretrained(target), None, None,
                                       verifier_name_or_path=str(target), **drafter).save_pretrained(tmp_path / "hspec")
    gen = torch.Generator().manual_seed(fresh_seed("replay hybrid prompts"))
    ps = [torch.randint(0, vocab - 1, (int(m),), generator=gen).tolist() for m in torch.randint(3, 40, (n,), generator=gen)]
    engine = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
              "max_num_seqs": 4, "max_num_batched_tokens": 64, "seed": 0, "mamba_ssm_cache_dtype": "float32"}
    record_continuations(str(target), ps, max_tokens, k, tmp_path / "cont.jsonl", **engine)
    recorded = {tuple(r["prompt_token_ids"]): r["output_token_ids"]
                for r in map(json.loads, (tmp_path / "cont.jsonl").read_text().splitlines())}
    llm = hybrid_llm(str(target))  # the identity check's reference: plain decoding with the top-2 log-probabilities
    plain_run = identity.generate(llm, [{"prompt_token_ids": p} for p in ps], max_tokens)
    del llm
    pool = synthetic_records(tmp_path / "rounds.jsonl", 0, d=k + 1, k=k)
    request.getfixturevalue("async_scheduling")
    llm = hybrid_llm(str(target), {"method": "replay_bench", "model": str(tmp_path / "hspec"), "num_speculative_tokens": k,
                                   "replay_bench": {"records": str(tmp_path / "rounds.jsonl"),
                                                    "continuations": str(tmp_path / "cont.jsonl")}})
    assert runner_of(llm).use_async_scheduling and all(layer.one_slot for layer in gdn_layers(llm))
    log = RoundLog(llm)
    ours = identity.generate(llm, [{"prompt_token_ids": p} for p in ps], max_tokens)
    outputs = ours.tokens
    plain = [recorded[tuple(p)][:max_tokens] for p in ps]
    same = {tuple(p) for p, o, ref in zip(ps, outputs, plain) if o == ref}
    stats = drafter_of(llm).stats()
    counters = vllm_counters(llm)
    rounds = check_rounds(log, same, k)
    print(f"hybrid replay: {len(same)}/{n} outputs are the recording's; vLLM {counters}; proposer {stats}; "
          f"records mean {pool.mean():.3f}")
    del llm
    check_hybrid_identity(ours, plain_run, "replay on the hybrid", str(target))
    assert stats["left_requests"] <= n - len(same) and stats["unrecorded_requests"] == 0
    assert counters[:2] == (stats["rounds"], stats["draft_tokens"]) == (len(rounds), k * len(rounds))
    # a round where an output leaves its recording (a floating-point tie) accepts less than planned
    assert counters[2] == sum(r[2] for r in rounds) <= stats["accepted_planned"]
    assert (counters[2] == stats["accepted_planned"]) or len(same) < n
    assert sum(r[2] for r in rounds if r[0] in same) > 0
