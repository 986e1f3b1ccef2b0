"""A tiny dense Qwen3 target (real random weights, saved) and tiny H-Spec / DFlash drafters for it,
and a helper that starts vLLM in-process on the CPU."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: real tracebacks
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

from ..seeds import fresh_seed  # noqa: F401  (re-exported for the engine tests)
from ..tiny_models import MASK, VOCAB
from ..tiny_models import tiny_qwen3_config as shared_tiny_qwen3_config


@pytest.fixture(autouse=True)
def float32_default_dtype():
    """Every test starts and ends with torch's default dtype at float32: an in-process vLLM engine
    leaves it at bfloat16, and a model built after one (a random drafter, say) would silently be
    bf16, so the test's draw would depend on which tests ran before it."""
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(torch.float32)


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    """The plugin tests' target: the shared tiny shape with 32-wide heads and 512 positions."""
    return shared_tiny_qwen3_config(**{"head_dim": 32, "max_position_embeddings": 512, **overrides})


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("qwen3_target")
    # a larger init than the default 0.02 so greedy outputs are not one repeated token
    Qwen3ForCausalLM(tiny_qwen3_config(initializer_range=0.3)).save_pretrained(path)
    return path


def save_hspec(target_dir, out_dir, seed: int = 0, **fields):
    config = tiny_qwen3_config()
    selected, kv = default_layer_selection(config)
    fields = {"target_layer_ids": selected, "kv_reuse_layer_ids": kv, "mask_token_id": MASK,
              "mamba_num_heads": 4, "mamba_head_dim": 16, "markov_rank": 16, **fields}
    torch.manual_seed(seed)
    model = HSpecDraftModel.from_training_args(config, None, None, verifier_name_or_path=str(target_dir),
                                               **fields)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def hspec_dir(target_dir, tmp_path_factory):
    return save_hspec(target_dir, tmp_path_factory.mktemp("hspec"))


def make_llm(target, speculative_config=None, **kwargs):
    from vllm import LLM

    args = dict(model=str(target), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, seed=0,
                speculative_config=speculative_config)
    return LLM(**{**args, **kwargs})


def save_dflash(target_dir, out_dir, num_layers: int):
    """speculators' DFlash drafter with the same layer shapes as the H-Spec one (for KV capacity)."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer_config = create_transformer_layer_config(str(target_dir), num_layers, "qwen3", None, 2048, [])
    selected, _ = default_layer_selection(tiny_qwen3_config())
    torch.manual_seed(0)
    model = DFlashDraftModel.from_training_args(
        layer_config, None, None, draft_attn_impl="sdpa", verifier_name_or_path=str(target_dir),
        target_layer_ids=selected, block_size=8, mask_token_id=MASK, draft_vocab_size=VOCAB)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture
def async_scheduling(monkeypatch):
    """``CpuPlatform.check_and_update_config`` turns async scheduling off; keep it on, as a GPU has it."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))


def runner_of(llm):
    """The in-process engine's model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def drafter_of(llm):
    """The in-process engine's proposer."""
    return runner_of(llm).drafter


def kv_capacity_tokens(llm) -> int:
    """The KV-cache capacity the engine reports ("GPU KV cache size: N tokens", group-aware)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    core = llm.llm_engine.engine_core.engine_core
    return get_kv_cache_capacity(llm.llm_engine.vllm_config, core.scheduler.kv_cache_config)[0]
