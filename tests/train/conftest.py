"""A tiny random target and data captured from it, shared by the training tests (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_hybridspec.train.data import DataSpec, prepare_data
from vllm_hybridspec.train.target import load_target
from vllm_hybridspec.train.tiny_target import TinyTarget, build_tiny_target

PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "hspec_prompts.jsonl"
LAYERS, KV_LAYERS = [1, 2, 3, 4], [2, 3, 4]  # of a 6-layer target


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return build_tiny_target(TinyTarget(num_hidden_layers=6, seed=7), tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_target(tiny_target_dir)


def data_spec(**overrides) -> DataSpec:
    fields = dict(
        prompts=str(PROMPTS),
        max_prompts=12,
        max_prompt_tokens=40,
        max_new_tokens=24,
        generation_batch_size=12,
        val_fraction=0.25,
    )
    return DataSpec(**{**fields, **overrides})


@pytest.fixture(scope="session")
def data_dir(tiny_target, tiny_target_dir, tmp_path_factory):
    model, tokenizer = tiny_target
    torch.manual_seed(0)
    return prepare_data(
        data_spec(),
        model,
        tokenizer,
        str(tiny_target_dir),
        LAYERS,
        tmp_path_factory.mktemp("data") / "captured",
        seed=0,
    )
