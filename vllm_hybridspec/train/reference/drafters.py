"""Drafters for the reference targets, trained with ``train/``'s recipe (``train_from_recipe``).

Both drafters of a target share the recipe's data (the target's greedy responses to train-split
prompts, captured once), loss, schedule and anchors; DFlash's depth is chosen so that its trainable
parameters come closest to H-Spec's (the paper compares at one parameter budget). The Qwen3-Next
reference target has only two full-attention layers (3 and 7), so its H-Spec drafter reuses the K/V
of those two; the dense target's reuses three.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from vllm_hybridspec.train.recipe import DrafterSpec, Recipe, TargetSpec, TrainingSpec
from vllm_hybridspec.train.data import DataSpec

# H-Spec sized for hidden 128: two Mamba heads of 64 (SSM width = hidden), Markov rank 64
HSPEC_SHAPES = dict(num_layers=4, mamba_num_heads=2, mamba_head_dim=64, mamba_n_groups=2, markov_rank=64)


def drafter_recipe(spec, kind: str, drafter: str, dflash_layers: int | None = None) -> Recipe:
    from transformers import AutoConfig

    from vllm_hybridspec.drafter import full_attention_layers

    target = Path(spec.out_dir) / kind
    num_full = len(full_attention_layers(AutoConfig.from_pretrained(target)))
    shapes = HSPEC_SHAPES if drafter == "hspec" else dict(num_layers=dflash_layers, markov_rank=64)
    return Recipe(
        seed=spec.seed,
        output_dir=str(Path(spec.work_dir) / f"{kind}-{drafter}"),
        target=TargetSpec(name_or_path=str(target)),
        data=DataSpec(
            prompts=str(Path(spec.out_dir) / "prompts" / "train.jsonl"),
            max_prompts=spec.num_train_prompts,
            max_prompt_tokens=spec.prompt_tokens,
            max_new_tokens=spec.response_tokens,
            temperature=0.0,
            generation_batch_size=spec.generation_batch_size,
            val_fraction=0.0625,
        ),
        drafter=DrafterSpec(type=drafter, num_attention_layers=min(3, num_full), block_size=8, **shapes),
        training=TrainingSpec(epochs=spec.drafter_epochs, total_seq_len=2048, max_anchors=128),
    )


def matched_dflash_layers(target_path: str | Path, hspec_params: int, mask_token_id: int) -> int:
    """DFlash depth (1..12) whose trainable parameter count is closest to ``hspec_params``."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_path)
    best = None
    for layers in range(1, 13):
        layer_config = create_transformer_layer_config(str(target_path), layers, "qwen3", None, 2048, [])
        model = DFlashDraftModel.from_training_args(
            layer_config, None, None, draft_attn_impl="sdpa", verifier_name_or_path=str(target_path),
            target_layer_ids=[1], block_size=8, mask_token_id=mask_token_id, draft_vocab_size=config.vocab_size,
        )
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if best is None or abs(n - hspec_params) < abs(best[1] - hspec_params):
            best = (layers, n)
    return best[0]


def thin_metrics(src: Path, dst: Path, every: int = 10) -> None:
    """The training log for the model directory: every ``every``-th training step, the last one, and
    every validation row (the full log stays in the work directory)."""
    lines = src.read_text().splitlines()
    train = [i for i, line in enumerate(lines) if '"train"' in line]
    keep = {i for n, i in enumerate(train) if n % every == 0} | set(train[-1:])
    dst.write_text("".join(line + "\n" for i, line in enumerate(lines) if i in keep or '"train"' not in line))


def stage_drafter(spec, kind: str, drafter: str, force: bool = False) -> Path:
    """Train ``drafter`` for target ``kind``; export ``final/`` in bf16 to ``<out_dir>/<kind>-<drafter>``."""
    import torch

    from vllm_hybridspec.train.run import train_from_recipe

    out = Path(spec.out_dir) / f"{kind}-{drafter}"
    if (out / "train_summary.json").exists() and not force:
        return out
    dflash_layers = None
    if drafter == "dflash":
        hspec_summary = Path(spec.out_dir) / f"{kind}-hspec" / "train_summary.json"
        if not hspec_summary.exists():
            raise FileNotFoundError(f"{hspec_summary} is missing; train the H-Spec drafter first (parameter matching)")
        from transformers import AutoTokenizer

        mask = AutoTokenizer.from_pretrained(Path(spec.out_dir) / kind).mask_token_id
        hspec_params = json.loads(hspec_summary.read_text())["trainable_parameters"]
        dflash_layers = matched_dflash_layers(Path(spec.out_dir) / kind, hspec_params, mask)
    recipe = drafter_recipe(spec, kind, drafter, dflash_layers)
    work = Path(recipe.output_dir)
    hspec_data = Path(spec.work_dir) / f"{kind}-hspec" / "data"
    if drafter != "hspec" and (hspec_data / "capture.json").exists() and not (work / "data").exists():
        # same prompts, target and layers: train_from_recipe reuses the capture (its manifest matches)
        shutil.copytree(hspec_data, work / "data")
    start = time.perf_counter()
    result = train_from_recipe(recipe)
    seconds = time.perf_counter() - start

    import speculators

    import vllm_hybridspec.drafter  # noqa: F401  (registers hspec)

    model = speculators.SpeculatorModel.from_pretrained(str(result.checkpoint))
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.bfloat16).save_pretrained(out)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    summary = {**result.summary, "train_seconds": seconds, "device": device}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=float))
    thin_metrics(work / "metrics.jsonl", out / "metrics.jsonl")
    (out / "recipe.yaml").write_text(recipe.to_yaml())
    return out
