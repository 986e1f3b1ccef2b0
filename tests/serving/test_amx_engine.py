"""Engines under an AMX CPU's decisions, on any x86 CPU: ``torch.cpu._is_amx_tile_supported`` answers
``True`` in this process (the engines run in it), so vLLM makes every choice it makes on a Sapphire
Rapids: it prepacks conv weights (``dispatch_cpu_unquantized_gemm``), stores the conv state ``SD``
(``VLLM_SSM_CONV_STATE_LAYOUT``), keeps the SSM state in float32, picks the AMX branch of its CPU GDN
core and sends float32 MoE layers to its torch path. A float32 hybrid target then loads and decodes
as without AMX (plain decoding token for token), H-Spec equals plain decoding there, and without the
plugin's two conv rows the same engine dies at load, as on an AMX CPU.

float32 only: in bf16 vLLM's attention and MoE pick AMX-tile kernels, which need AMX hardware (the
drafter's reads of the bf16 ``amx`` KV layout are checked against vLLM's own cache op in
``tests/engine/drafting/test_amx_kv.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from . import identity
from .conftest import fresh_seed
from .test_cpu_gdn_engine import TINY_QWEN3_NEXT
from .test_gdn_layer_engine import HSPEC_BATCHED_TOKENS, VOCAB, check_hybrid_identity, gdn_layers, hybrid_llm

pytestmark = pytest.mark.timeout(900)

NUM_PROMPTS, MAX_TOKENS = 16, 24
LAYOUT = "VLLM_SSM_CONV_STATE_LAYOUT"


@pytest.fixture
def amx_decisions(monkeypatch):
    """vLLM decides as on an AMX CPU; its environment (the conv layout the platform sets, the envs cache
    an engine start turns on) is restored afterwards."""
    import vllm.envs as envs

    saved = os.environ.get(LAYOUT)
    envs.disable_envs_cache()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    yield
    envs.disable_envs_cache()
    if saved is None:
        os.environ.pop(LAYOUT, None)
    else:
        os.environ[LAYOUT] = saved


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """An 8-layer float32 hybrid target (random weights), a random H-Spec drafter reading its two
    full-attention layers, prompts, and plain decoding without the AMX decisions."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

    tmp = tmp_path_factory.mktemp("amx_hybrid")
    config = AutoConfig.for_model(**{**TINY_QWEN3_NEXT, "vocab_size": VOCAB, "num_hidden_layers": 8, "pad_token_id": 0})
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(fresh_seed("amx hybrid weights"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp / "target")
    selected, kv = default_layer_selection(config, num_selected=4, num_kv_reuse=2)
    torch.manual_seed(fresh_seed("amx H-Spec drafter weights"))
    HSpecDraftModel.from_training_args(
        config, None, None, verifier_name_or_path=str(tmp / "target"), target_layer_ids=selected,
        kv_reuse_layer_ids=kv, mask_token_id=VOCAB - 1, mamba_num_heads=4, mamba_head_dim=16, markov_rank=16,
    ).save_pretrained(tmp / "hspec")
    gen = torch.Generator().manual_seed(fresh_seed("amx prompts"))
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB - 1, (int(n),), generator=gen).tolist()}
               for n in torch.randint(3, 40, (NUM_PROMPTS,), generator=gen)]
    import vllm.envs as envs

    envs.disable_envs_cache()
    llm = hybrid_llm(str(tmp / "target"), max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.float32
    plain = identity.generate(llm, prompts, MAX_TOKENS)
    del llm
    return {"target": str(tmp / "target"), "hspec": str(tmp / "hspec"), "prompts": prompts, "plain": plain}


def _amx_decisions_were_made(llm):
    """What vLLM decided under AMX: the SD conv state (which the non-AMX CPU default is not), float32
    conv weights left unpacked (the plugin's row), and the GDN layers still the one-slot layer's."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    assert os.environ.get(LAYOUT) == "SD" and not is_conv_state_dim_first()
    for layer in gdn_layers(llm):
        assert layer.conv1d.weight.dim() == 3 and not hasattr(layer.conv1d, "_cpu_unpacked_conv_weight")


def test_float32_hybrid_under_amx_decisions_decodes_as_without_and_hspec_equals_plain(hybrid, amx_decisions):
    llm = hybrid_llm(hybrid["target"], max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
    _amx_decisions_were_made(llm)
    plain_amx = identity.generate(llm, hybrid["prompts"], MAX_TOKENS)
    del llm
    same = sum(a == b for a, b in zip(plain_amx.tokens, hybrid["plain"].tokens))
    print(f"plain decoding under AMX decisions: {same}/{NUM_PROMPTS} prompts identical to plain without")
    assert same == NUM_PROMPTS

    llm = hybrid_llm(hybrid["target"], {"method": "hspec", "model": hybrid["hspec"], "num_speculative_tokens": 7},
                     max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
    _amx_decisions_were_made(llm)
    assert all(layer.one_slot for layer in gdn_layers(llm))
    ours = identity.generate(llm, hybrid["prompts"], MAX_TOKENS)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    print(f"H-Spec under AMX decisions: {drafted} draft tokens, {accepted} accepted")
    assert drafted > accepted > 0
    del llm
    check_hybrid_identity(ours, plain_amx, "H-Spec under AMX decisions", hybrid["target"], min_identical=NUM_PROMPTS - 3,
                          max_num_batched_tokens=HSPEC_BATCHED_TOKENS)


@pytest.mark.parametrize("removed", ["both conv rows", "the GDN core row"])
def test_without_the_conv_rows_the_float32_hybrid_dies_under_amx_decisions(hybrid, amx_decisions, monkeypatch, removed):
    """Negative controls: vLLM's own dispatch and GDN core, as on an AMX CPU before the fix, die at load
    (the float32 conv weight cannot be prepacked); with only the dispatch row, the first prefill dies in
    the AMX branch of vLLM's GDN core (its C++ conv has no float32 path)."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    from vllm_hybridspec.engine import patches

    vllm_own = [(gdn_attention, "_cpu_gdn_attention_nonspec")]
    if removed == "both conv rows":
        vllm_own.append((utils, "dispatch_cpu_unquantized_gemm"))
    for module, name in vllm_own:
        monkeypatch.setattr(module, name, patches.original_of(getattr(module, name)))
    error = "causal_conv1d_fwd_kernel_impl\" not implemented for 'Float'"
    if removed == "both conv rows":
        with pytest.raises(NotImplementedError, match=error):
            hybrid_llm(hybrid["target"], max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
        return
    from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths

    vllm_cpu_gdn_paths.cache_clear()  # the one-slot layer looks vLLM's GDN helpers up once per process
    try:
        llm = hybrid_llm(hybrid["target"], max_num_batched_tokens=HSPEC_BATCHED_TOKENS)
        _amx_decisions_were_made(llm)
        with pytest.raises(NotImplementedError, match=error):
            identity.generate(llm, hybrid["prompts"][:2], 2)
        del llm
    finally:
        monkeypatch.undo()
        vllm_cpu_gdn_paths.cache_clear()
