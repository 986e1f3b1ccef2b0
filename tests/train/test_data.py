"""Target-generated training data in speculators' format, read back by speculators' own loaders."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from speculators.train.data import ArrowDataset, CollateFn
from vllm_hybridspec.train.data import DataSpec, load_prompts, prepare_data, prompt_messages, tokenize_prompt
from vllm_hybridspec.train.target import AddTargetKV, TargetKV, capture_hidden_states

from .conftest import KV_LAYERS, LAYERS, PROMPTS, data_spec


def test_prompts_from_jsonl_rows_of_either_kind(tiny_target):
    _, tokenizer = tiny_target
    rows = load_prompts(DataSpec(prompts=str(PROMPTS), max_prompts=32), seed=0)
    assert len(rows) == 32
    messages = [prompt_messages(row, None) for row in rows]
    assert all(m[0]["role"] == "user" and m[0]["content"] for m in messages)
    conversation = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "more"},
        ]
    }
    assert prompt_messages(conversation, None) == [{"role": "user", "content": "hi"}]
    ids = tokenize_prompt(tokenizer, messages[0], max_tokens=1000)
    assert tokenizer.decode(ids).startswith("<|im_start|>user\n") and tokenizer.decode(ids).endswith(
        "assistant\n"
    )
    assert len(tokenize_prompt(tokenizer, messages[0], max_tokens=5)) == 5
    with pytest.raises(ValueError, match="no prompt in row"):
        prompt_messages({"answer": "x"}, None)


def test_prepare_data_writes_speculators_format(data_dir, tiny_target):
    model, _ = tiny_target
    dataset = load_from_disk(str(data_dir))
    assert len(dataset) == 12 and set(dataset.column_names) == {"input_ids", "loss_mask", "seq_len"}
    row = dataset[0]
    assert row["loss_mask"].sum() > 0 and row["loss_mask"][0] == 0  # the prompt is not trained on
    sample = load_file(data_dir / "hidden_states" / "hs_0.safetensors")
    assert torch.equal(sample["token_ids"], row["input_ids"])
    assert sample["hidden_states"].shape == (row["seq_len"], len(LAYERS) + 1, 64)
    torch.testing.assert_close(
        sample["hidden_states"], capture_hidden_states(model, row["input_ids"], LAYERS)
    )
    assert isinstance(torch.load(data_dir / "token_freq.pt", weights_only=True), dict)
    assert json.loads((data_dir / "capture.json").read_text())["layer_ids"] == LAYERS


def test_prepare_data_reuses_matching_data(data_dir, tiny_target, tiny_target_dir):
    model, tokenizer = tiny_target
    stamp = (data_dir / "capture.json").stat().st_mtime_ns
    prepare_data(data_spec(), model, tokenizer, str(tiny_target_dir), LAYERS, data_dir, seed=0)
    assert (data_dir / "capture.json").stat().st_mtime_ns == stamp


def test_speculators_loader_with_recomputed_target_kv(data_dir, tiny_target):
    """speculators' ArrowDataset + CollateFn read the data; the H-Spec preprocess adds target_kv."""
    model, _ = tiny_target
    dataset = ArrowDataset(
        max_len=256, datapath=str(data_dir), on_missing="raise", train_ratio=0.75, split="train"
    )
    collate = CollateFn(
        256,
        64,
        num_target_layers=len(LAYERS),
        dtype=torch.float32,
        preprocess=AddTargetKV(TargetKV(model, KV_LAYERS, LAYERS)),
    )
    batch = collate([dataset[0], dataset[1]])
    assert batch["hidden_states"].shape == (1, 256, len(LAYERS) * 64)
    assert batch["target_kv"].shape == (1, 256, len(KV_LAYERS), 2, 2, 16)
    assert batch["verifier_last_hidden_states"].shape == (1, 256, 64)
    n0 = dataset[0]["input_ids"].shape[0]
    assert (batch["document_ids"][0, :n0] == 0).all() and (batch["document_ids"][0, n0] == 1)
    assert batch["position_ids"][0, n0] == 0  # positions restart per document
