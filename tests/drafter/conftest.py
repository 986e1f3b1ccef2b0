"""Tiny random targets and H-Spec drafters for the drafter tests (fresh random weights, CPU)."""

from __future__ import annotations

import os

# mamba-ssm picks one kernel config instead of benchmarking several (which needs a GPU driver) when
# deterministic; read when its kernels are first imported, so set before any test imports them.
os.environ.setdefault("MAMBA_DETERMINISTIC", "1")

import pytest
import torch
from transformers import Qwen3ForCausalLM
from vllm_hybridspec.drafter import HSpecDraftModel, default_layer_selection

from ..tiny_models import MASK, VOCAB, tiny_qwen3_config

@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A saved tiny dense Qwen3 target (the drafter's verifier)."""
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("qwen3_target")
    Qwen3ForCausalLM(tiny_qwen3_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def target(target_dir):
    return Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def make_drafter(target_dir, seed: int = 0, t2d=None, d2t=None, **fields) -> HSpecDraftModel:
    config = tiny_qwen3_config()
    selected, kv = default_layer_selection(config)
    fields = {"mask_token_id": MASK, "mamba_num_heads": 4, "mamba_head_dim": 16, "markov_rank": 16, **fields}
    torch.manual_seed(seed)
    return HSpecDraftModel.from_training_args(
        config,
        t2d,
        d2t,
        verifier_name_or_path=str(target_dir),
        target_layer_ids=selected,
        kv_reuse_layer_ids=kv,
        **fields,
    ).eval()


@pytest.fixture
def drafter(target_dir):
    return make_drafter(target_dir)


def target_context(target, drafter, ids: torch.Tensor):
    """Run the target over ``ids`` ``[1, T]``: the selected layers' inputs concatenated ``[T, n * hidden]``
    and the post-RoPE cache ``(k, v)`` ``[1, kv_heads, T, head_dim]`` of each KV-reuse layer."""
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, use_cache=True)
    # transformers' hidden_states[i] is the input of layer i (i < num_layers)
    hidden = torch.cat([out.hidden_states[i][0] for i in drafter.target_layer_ids], dim=-1)
    kv = [
        (out.past_key_values.layers[i].keys, out.past_key_values.layers[i].values)
        for i in drafter.kv_reuse_layer_ids
    ]
    return hidden, kv
