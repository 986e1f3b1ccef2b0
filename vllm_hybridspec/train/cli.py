"""``hybridspec train``: registered on the ``hybridspec`` typer app in ``vllm_hybridspec/cli.py``."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def train(
    config: Path = typer.Option(
        ..., "--config", exists=True, dir_okay=False, help="Recipe YAML (see examples/hspec_recipe.yaml)"
    ),
    output_dir: str | None = typer.Option(None, help="Override the recipe's output_dir"),
) -> None:
    """Train an H-Spec (or DFlash) drafter on target-generated responses, as the recipe says."""
    from vllm_hybridspec.train.recipe import Recipe
    from vllm_hybridspec.train.run import train_from_recipe

    recipe = Recipe.from_yaml(config)
    if output_dir is not None:
        recipe = recipe.model_copy(update={"output_dir": output_dir})
    result = train_from_recipe(recipe)
    s = result.summary
    typer.echo(f"checkpoint: {result.checkpoint}\nmetrics: {result.metrics}")
    if "train_loss_first" in s:
        typer.echo(
            f"train loss: {s['train_loss_first']:.4f} (first step) -> {s['train_loss_last']:.4f} (last step)"
        )
    if "val_last" in s:
        val = s["val_last"]
        acc = {
            k.removeprefix("position_").removesuffix("_acc_epoch"): round(v, 3)
            for k, v in val.items()
            if k.startswith("position_")
        }
        typer.echo(
            f"validation: loss {val['loss_epoch']:.4f}, expected accepted length {val['eal_epoch']:.3f}, "
            f"per-position acceptance {json.dumps(acc)}"
        )
