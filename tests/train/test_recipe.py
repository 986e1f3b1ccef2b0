"""``hybridspec train --config recipe.yaml`` end to end on the CPU, for H-Spec and for the DFlash
baseline, and the example recipe's validity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from speculators import SpeculatorModel
from typer.testing import CliRunner
from vllm_hybridspec.drafter import HSpecDraftModel
from vllm_hybridspec.train.recipe import Recipe

from vllm_hybridspec.cli import app

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hspec_recipe.yaml"


def small_recipe(tmp_path: Path, drafter_type: str) -> Path:
    recipe = yaml.safe_load(EXAMPLE.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["data"].update(
        prompts=str(EXAMPLE.parent / "hspec_prompts.jsonl"),
        max_prompts=10,
        max_new_tokens=24,
        generation_batch_size=10,
        val_fraction=0.2,
    )
    recipe["training"].update(epochs=2, total_seq_len=256, max_anchors=16)
    recipe["drafter"]["type"] = drafter_type
    if drafter_type == "dflash":
        for key in ("mamba_num_heads", "mamba_head_dim", "markov_rank"):
            recipe["drafter"].pop(key)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_example_recipe_is_valid():
    recipe = Recipe.from_yaml(EXAMPLE)
    assert recipe.drafter.type == "hspec" and recipe.target.tiny is not None
    assert (EXAMPLE.parent.parent / recipe.data.prompts).exists()
    with pytest.raises(ValueError, match="exactly one of name_or_path and tiny"):
        Recipe.model_validate({**yaml.safe_load(EXAMPLE.read_text()), "target": {}})


def test_hybridspec_train_end_to_end(tmp_path):
    result = CliRunner().invoke(app, ["train", "--config", str(small_recipe(tmp_path, "hspec"))])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "expected accepted length" in result.output
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["drafter"] == "hspec" and summary["kv_reuse_layer_ids"] == [2, 3, 4]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r["train"] for r in records if "train" in r]
    val = [r["val"] for r in records if "val" in r]
    assert len(train) == summary["steps"] > 0 and len(val) == 2
    assert {"loss", "eal", "position_1_acc", "position_7_acc", "accept_len"} <= train[-1].keys()
    assert {"loss_epoch", "eal_epoch", "position_7_acc_epoch"} <= val[-1].keys()

    # the written checkpoints load through speculators' registry and draft
    final = SpeculatorModel.from_pretrained(run / "final")
    epoch = SpeculatorModel.from_pretrained(run / "checkpoints" / "1")
    assert type(final) is HSpecDraftModel and type(epoch) is HSpecDraftModel
    config = final.config
    geometry = config.attention_geometry
    last = torch.randn(2, len(config.aux_hidden_state_layer_ids) * 64)
    kv = [
        (torch.randn(2, geometry.num_key_value_heads, 9, geometry.head_dim),) * 2
        for _ in config.kv_reuse_layer_ids
    ]
    block = final.eval().propose(last, torch.tensor([65, 66]), kv, torch.tensor([9, 4]))
    assert block.tokens.shape == (2, 7)


def test_dflash_baseline_under_the_same_recipe(tmp_path):
    result = CliRunner().invoke(app, ["train", "--config", str(small_recipe(tmp_path, "dflash"))])
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["drafter"] == "dflash" and summary["target_layer_ids"] == [0, 1, 2, 3, 4]
    assert type(SpeculatorModel.from_pretrained(tmp_path / "run" / "final")).__name__ == "DFlashDraftModel"
