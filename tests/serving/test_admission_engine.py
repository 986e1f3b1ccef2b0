"""KV capacity by admission: on one fixed KV-cache budget (bytes), with ``K = 15`` speculative tokens,
a workload of more concurrent long requests than fit at once runs with as many requests at a time on
the one-slot GDN layer as without speculation, and with far more than on vLLM's own GDN spec path,
which keeps ``1 + K`` states per request and GDN layer. The count is the scheduler's: the largest
number of requests running in one step, not the capacity vLLM reports.

The target is a tiny Qwen3-Next (3 GDN layers, 1 attention layer; bf16, as vLLM's CPU GDN spec path
requires, with the float32 SSM state the one-slot layer requires) with a 12-token vocabulary, so
ngram drafts all ``K`` tokens nearly every step. Each request's prompt and output, with ``K`` drafts on
top, fit in one attention block, so speculation needs no more attention blocks than plain decoding
and the counts differ by the GDN states alone."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from .test_gdn_layer_engine import fresh_seed, gdn_layers, mamba_specs

pytestmark = pytest.mark.timeout(1200)

VOCAB, K = 12, 15
KV_BYTES = 6_000_000  # the KV-cache budget of every engine
NUM_REQUESTS, MAX_TOKENS = 48, 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from vllm_hybridspec.train.tiny_target import save_tiny_qwen3_next

    path = tmp_path_factory.mktemp("admission_hybrid")
    save_tiny_qwen3_next(path, dtype=torch.bfloat16, seed=fresh_seed("admission weights"), vocab_size=VOCAB,
                         pad_token_id=0)
    return str(path)


def engine(target: str, gdn_kernel: bool | None):
    """``gdn_kernel=None``: no speculation."""
    from vllm import LLM

    spec = None
    if gdn_kernel is not None:
        spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "hybridspec": {"gdn_kernel": gdn_kernel}}
    return LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
               max_num_seqs=2 * NUM_REQUESTS, max_num_batched_tokens=2048, seed=0, mamba_ssm_cache_dtype="float32",
               kv_cache_memory_bytes=KV_BYTES, speculative_config=spec, disable_log_stats=False)


def attention_block_size(llm) -> int:
    from vllm.v1.kv_cache_interface import AttentionSpec

    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    (size,) = {g.kv_cache_spec.block_size for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, AttentionSpec)}
    return size


def admitted(llm, prompt_len: int, seed: int) -> tuple[int, int, int]:
    """Run ``NUM_REQUESTS`` requests of ``prompt_len`` random prompt tokens at once; returns the most
    requests the scheduler ran in one step, the pool's block count, and the steps it took."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    running = []
    schedule = scheduler.schedule

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        running.append(len(scheduler.running))
        return out

    scheduler.schedule = counting_schedule
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (prompt_len,), generator=gen).tolist()}
               for _ in range(NUM_REQUESTS)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    return max(running), scheduler.kv_cache_config.num_blocks, len(running)


def test_one_slot_gdn_admits_as_many_requests_as_plain_decoding(target, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")  # it would override kv_cache_memory_bytes (conftest sets it)
    seed = fresh_seed("admission prompts")
    plain = engine(target, None)
    block = attention_block_size(plain)
    # the longest prompt whose request, with K drafts on its last step, stays in one attention block
    prompt_len = block - MAX_TOKENS - K
    counts = {"plain": admitted(plain, prompt_len, seed)}
    del plain

    one_slot = engine(target, True)
    assert all(layer.one_slot for layer in gdn_layers(one_slot))
    assert attention_block_size(one_slot) == block
    assert all(s.num_speculative_blocks == 0 for s in mamba_specs(one_slot))
    counts["one-slot GDN, K=15"] = admitted(one_slot, prompt_len, seed)
    metrics = {m.name: m.value for m in one_slot.get_metrics() if m.name.startswith("vllm:spec_decode_num_draft_tokens")}
    del one_slot

    vllm_path = engine(target, False)
    assert not any(layer.one_slot for layer in gdn_layers(vllm_path))
    assert attention_block_size(vllm_path) == block
    assert all(s.num_speculative_blocks == K for s in mamba_specs(vllm_path))
    counts["vLLM's GDN path, K=15"] = admitted(vllm_path, prompt_len, seed)
    del vllm_path

    print(f"{NUM_REQUESTS} requests of {prompt_len} prompt + {MAX_TOKENS} output tokens on {KV_BYTES} KV bytes "
          f"(attention blocks of {block} tokens); one-slot drafts {metrics}")
    for name, (running, blocks, steps) in counts.items():
        print(f"  {name}: at most {running} requests running at once ({blocks} blocks in the pool, {steps} steps)")
    plain_n, one_slot_n, vllm_n = (counts[name][0] for name in counts)
    assert len({blocks for _, blocks, _ in counts.values()}) == 1  # one pool size: the same budget
    assert plain_n < NUM_REQUESTS  # the budget, not the workload, bounds admission
    assert one_slot_n >= plain_n - 1
    assert vllm_n < one_slot_n / 4
