"""Negative controls of the shared identity check (``identity.py``): five bugs planted in the running
engine, each of which the check must fail, next to the same engines without the bug, which it must
pass. A tiny random hybrid Qwen3-Next target (float32, one-slot GDN layer) against a separate plain
engine, 24 prompts x 24 tokens:

- **commit m - 1**: the lazy commit advances each round's state by one token fewer than it accepted
  (``PendingRounds.sampled`` is handed each row's output less its last accepted token, so ``m`` is
  one short; the emitted tokens are untouched), ngram drafts;
- **no conv shift**: the verification reads the conv window without shifting in the pending round's
  ``m`` inputs (``layer.commit_conv_windows`` a no-op, the planted bug of ``engine/gdn/check.py``'s
  self-check test), ngram drafts;
- **router cuts one more** and **bonus after the last draft**: the two halves of the device-side cut
  (``engine/length/cut.py``) disagree by one token, under async scheduling, H-Spec drafts at a fixed
  length of 2 (vLLM schedules all 4): each row's last verified token is routed to its anchor's
  experts as if it were cut; or the rows stop at the cut while the bonus token comes from the
  logits after the last scheduled draft. A cut that is one token longer or shorter in both halves
  alike only verifies a different number of drafts: greedy output cannot change
  (``test_selection.py`` counts the verified drafts against the selector's);
- **Stage 0 routes as before**: with a routing policy (HybridSpec's routing correction), Stage 0 at the
  first MoE router lengthens rows for the sampler but the router's sources stay the selector's cut, so
  each draft it keeps is verified with its anchor's experts; next to the same engine without the bug,
  which must pass and must have kept some drafts and dropped others.

The controls pass because the check fails (and would fail if it passed the planted bug)."""

from __future__ import annotations

import pytest
import torch

from . import identity
from .conftest import fresh_seed, runner_of
from .identity import TIES, judge
from .test_gdn_layer_engine import ENGINE, check_hybrid_identity, gdn_layers, hybrid_llm

pytestmark = pytest.mark.timeout(900)

VOCAB, NUM_PROMPTS, MAX_TOKENS, MIN_IDENTICAL = 12, 24, 24, 20
# H-Spec rounds verify the anchor and one draft of the 4 vLLM schedules: a cut bug shows in every
# round whose first draft is accepted (about one in twelve with the random drafter)
FIXED = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "hybridspec": {"gdn_kernel": True}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The 4-layer tiny hybrid (layer 3 full attention) and a random H-Spec drafter reading layer 3."""
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection
    from vllm_hybridspec.train.tiny_target import save_tiny_qwen3_next

    root = tmp_path_factory.mktemp("identity_controls")
    target = save_tiny_qwen3_next(root / "target", torch.float32, fresh_seed("controls hybrid weights"),
                                  vocab_size=VOCAB, pad_token_id=0)
    config = AutoConfig.from_pretrained(target)
    selected, kv = default_layer_selection(config, num_selected=3, num_kv_reuse=1)
    torch.manual_seed(fresh_seed("controls H-Spec drafter weights"))
    HSpecDraftModel.from_training_args(
        config, None, None, verifier_name_or_path=str(target), target_layer_ids=selected, kv_reuse_layer_ids=kv,
        mask_token_id=VOCAB - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16,
    ).save_pretrained(root / "hspec")
    return str(target), str(root / "hspec")


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(fresh_seed("controls prompts"))
    lengths = torch.randint(3, 60, (NUM_PROMPTS,), generator=gen)
    # no mask token (the drafter's, VOCAB - 1) in the prompts
    return [{"prompt_token_ids": torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def plain(models, prompts):
    llm = hybrid_llm(models[0])
    run = identity.generate(llm, prompts, MAX_TOKENS)
    del llm
    return run


def hspec(models):
    return {"method": "hspec", "model": models[1], "num_speculative_tokens": 4,
            "hybridspec": {"gdn_kernel": True, "fixed_length": FIXED}}


def speculative_run(model, spec, prompts, async_scheduling=False):
    llm = hybrid_llm(model, spec)
    assert runner_of(llm).use_async_scheduling == async_scheduling
    assert all(layer.one_slot for layer in gdn_layers(llm))
    ours = identity.generate(llm, prompts, MAX_TOKENS)
    metrics = {m.name: m.value for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num_") and not m.name.endswith("per_pos")}
    del llm
    drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"{metrics['vllm:spec_decode_num_drafts']} drafts, {drafted} draft tokens, {accepted} accepted")
    assert drafted > accepted > 0
    return ours


def caught(ours, plain, label, model):
    """The shared check's verdict on a bugged engine (check_hybrid_identity's, float64 reference and
    all, without the assert): it must fail."""
    verdict = judge(ours, plain, label, tie=TIES["tiny-hybrid"], min_identical=MIN_IDENTICAL,
                    router_margin=lambda tokens: identity.routing_margin(model, tokens, **ENGINE),
                    reference=identity.float64_reference(model))
    print(verdict)
    assert not verdict.ok, f"the identity check passed the planted bug {label!r}"
    return verdict


def plant_commit_one_short(monkeypatch) -> None:
    """The planted "commit m - 1": ``PendingRounds.sampled`` gets each row's kept-token count less one
    (its last accepted token not committed; shared with ``test_sampling_engine_hybrid.py``)."""
    from vllm_hybridspec.engine.gdn.pending import PendingRounds

    sampled = PendingRounds.sampled

    def one_short(self, counts):
        return sampled(self, counts - 1)

    monkeypatch.setattr(PendingRounds, "sampled", one_short)


def test_ngram_without_a_planted_bug_passes(models, prompts, plain):
    check_hybrid_identity(speculative_run(models[0], NGRAM, prompts), plain, "control: ngram, no bug", models[0])


@pytest.mark.parametrize("bug", ["commit m - 1", "no conv shift"])
def test_a_planted_gdn_bug_fails_the_check(models, prompts, plain, monkeypatch, bug):
    from vllm_hybridspec.engine.gdn import layer as layer_module

    if bug == "commit m - 1":
        plant_commit_one_short(monkeypatch)
    else:
        monkeypatch.setattr(layer_module, "commit_conv_windows", lambda *args: None)
    verdict = caught(speculative_run(models[0], NGRAM, prompts), plain, f"control: ngram, {bug}", models[0])
    assert verdict.identical < MIN_IDENTICAL


def test_hspec_at_a_fixed_length_under_async_scheduling_passes(models, prompts, plain, async_scheduling):
    ours = speculative_run(models[0], hspec(models), prompts, async_scheduling=True)
    check_hybrid_identity(ours, plain, f"control: H-Spec, fixed length {FIXED}, async, no bug", models[0])


def plant_router_cuts_one_too_many(monkeypatch) -> None:
    """The planted "router cuts one more": each row's last verified token is routed to its anchor's
    experts as if cut, while the sampler verifies it (the plan's router sources made from ``w - 1``;
    ``kernels.cut.plan_cut_torch``, the CPU's plan)."""
    from vllm_hybridspec.engine.length import cut as cut_module
    from vllm_hybridspec.kernels.cut import route_tokens_torch

    plan = cut_module.plan_cut_torch

    def plan_one_short(w_prev, prev_row, qsl, n, w_out, source_out, no_cut):
        plan(w_prev, prev_row, qsl, n, w_out, source_out, no_cut)
        route_tokens_torch(qsl, n, (w_out - 1).clamp(min=1), source_out)

    monkeypatch.setattr(cut_module, "plan_cut_torch", plan_one_short)


def plant_bonus_after_the_last_draft(monkeypatch) -> None:
    """The planted "bonus after the last draft": rows stop at their cut, but the bonus token is sampled
    after the last scheduled draft, as vLLM would without the cut."""
    from vllm_hybridspec.engine.length import cut as cut_module

    bonus_at_cut = cut_module.StepCut.bonus_at_cut

    def bonus_unmoved(self, metadata, num_rows):
        _, v = bonus_at_cut(self, metadata, num_rows)
        return metadata, v

    monkeypatch.setattr(cut_module.StepCut, "bonus_at_cut", bonus_unmoved)


@pytest.mark.parametrize("bug", ["router cuts one more", "bonus after the last draft"])
def test_a_planted_cut_bug_fails_the_check(models, prompts, plain, async_scheduling, monkeypatch, bug):
    """The device-side cut (``engine/length/cut.py``) with one of its two halves off by one token."""
    if bug == "router cuts one more":
        plant_router_cuts_one_too_many(monkeypatch)
    else:
        plant_bonus_after_the_last_draft(monkeypatch)
    ours = speculative_run(models[0], hspec(models), prompts, async_scheduling=True)
    verdict = caught(ours, plain, f"control: H-Spec, fixed length {FIXED}, async, {bug}", models[0])
    assert verdict.identical < MIN_IDENTICAL


# --- HybridSpec's routing correction: Stage 0 at the first MoE router ---------------------------------


def routing_policy(path) -> str:
    """A policy for the controls' drafter (K = 4, the tiny target's 2 of 8 experts per token) whose
    acceptance estimate is 0.4 for every first draft whatever the drafter says, so with target cost
    ``C(w) = w`` and rate 0.5 every round's nominal length is ``w0 = 1``; its routing tables keep
    ``d_1`` when it brings at most one expert the anchor did not choose (``rho dL_c`` 0.075 or less,
    below 0.4) and drop it when both of its experts are new (0.45): Stage 0's answer depends on the
    router alone, and both occur in any draw of weights."""
    from ..policy.helpers import hand_policy

    k = 4
    routing = {"s": 0.6, "eta": 0.5, "experts_per_token": 2, "later_layers": False,
               "n_all": [1.0] * k, "n_all_given": [[0.0, 0.5, 2.0]] * k}
    policy = hand_policy(draft_len=k, c=0.4, rate=0.5, quadratic=(1.0, 1.0, 0.0), fixed=1.0, routing=routing,
                         min_length=1)
    path.write_text(policy.model_dump_json())
    return str(path)


@pytest.fixture(scope="module")
def routed(models, tmp_path_factory):
    """One engine for both routing tests: greedy H-Spec with the routing policy (the planted bug is
    patched in and out around a generate call, so it needs no engine of its own)."""
    spec = {"method": "hspec", "model": models[1], "num_speculative_tokens": 4,
            "hybridspec": {"gdn_kernel": True,
                           "policy": routing_policy(tmp_path_factory.mktemp("routing") / "routing.json")}}
    llm = hybrid_llm(models[0], spec)
    selector = runner_of(llm).drafter.length_selector
    assert selector.routes and selector.stage0_ready
    yield llm
    del llm


def routed_run(llm, prompts):
    """The outputs, the rows at each length the selector picked in this run and the rows Stage 0
    lengthened (``d_{w0}`` verified too)."""
    from vllm_hybridspec.engine.length.cut import cut_of

    runner = runner_of(llm)
    selector, cut = runner.drafter.length_selector, cut_of(runner)
    rows_before, kept_before = dict(selector.stats()["rows_at_length"]), int(cut.stage0_kept)
    ours = identity.generate(llm, prompts, MAX_TOKENS)
    rows = {w: n - rows_before.get(w, 0) for w, n in selector.stats()["rows_at_length"].items()}
    kept = int(cut.stage0_kept) - kept_before
    print("rows at each selected length:", rows, "| rows Stage 0 lengthened:", kept)
    return ours, rows, kept


def test_routing_correction_verifies_some_drafts_past_the_selected_length_exactly(models, prompts, plain, routed):
    ours, rows, kept = routed_run(routed, prompts)
    check_hybrid_identity(ours, plain, "routing correction, no bug", models[0])
    # every round selected w0 = 1 (rows at the end of a request's budget too), and Stage 0 kept d_1 in
    # some of them and not in others
    assert set(rows) == {1} and 0 < kept < rows[1]


def test_a_planted_stage0_bug_fails_the_check(models, prompts, plain, routed, monkeypatch):
    """Planted: Stage 0 lengthens the rows for the sampler but leaves the router's sources as the
    selector's lengths cut them, so each kept ``d_{w0}`` is verified with its anchor's experts."""
    from vllm_hybridspec.engine.length import cut as cut_module

    monkeypatch.setattr(cut_module, "route_tokens_torch", lambda *args: None)
    ours, _, kept = routed_run(routed, prompts)
    assert kept > 0
    verdict = caught(ours, plain, "control: routing correction, sources not updated", models[0])
    assert verdict.identical < MIN_IDENTICAL
