"""``hybridspec train``: registered on the ``hybridspec`` typer app in ``vllm_hybridspec/cli.py``."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def train(
    config: Path = typer.Option(..., "--config", help="Recipe YAML (see examples/hspec_recipe.yaml)"),
    output_dir: str | None = typer.Option(None, help="Override the recipe's output_dir"),
) -> None:
    """Train an H-Spec (or DFlash) drafter on target-generated responses, as the recipe says.

    The recipe and everything it points at (output folder, target config, layer choice, every prompt
    row) are checked first: a bad value ends the command with exit status 2 and one line naming the
    file, the field and the value, before anything is written."""
    from pydantic import ValidationError

    from vllm_hybridspec.policy.errors import InputError, describe
    from vllm_hybridspec.train.recipe import Recipe
    from vllm_hybridspec.train.run import check_recipe, describe_run, train_from_recipe

    try:
        recipe = Recipe.from_yaml(config)
        if output_dir is not None:
            try:
                recipe = Recipe.model_validate({**recipe.model_dump(), "output_dir": output_dir})
            except ValidationError as e:
                raise describe(e, "--output-dir", Recipe) from None
        checked = check_recipe(recipe, str(config))
    except InputError as e:
        typer.echo(f"hybridspec train: error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(describe_run(checked.previous, Path(recipe.output_dir)), err=True)
    result = train_from_recipe(recipe, str(config), checked)
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
