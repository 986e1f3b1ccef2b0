"""``hybridspec train``: a recipe end to end.

1. the target (loaded, or a tiny random one built into ``<output_dir>/target``);
2. the selected target layers and the KV-reuse mapping (Appendix B.1 defaults), validated;
3. prompts -> target responses -> captured hidden states in speculators' format (``data.py``);
4. the drafter: ``hspec`` (this package) or ``dflash`` (speculators'), same data, loss and schedule;
5. speculators' trainer (``trainer.py``), the K/V of the reused layers recomputed from the captured
   hidden states for ``hspec`` (``target.AddTargetKV``);
6. outputs in ``output_dir``: ``checkpoints/<epoch>/`` (speculators' checkpoints, bf16),
   ``final/`` (``save_pretrained``, full precision), ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vllm_hybridspec.train.recipe import DrafterSpec, Recipe


@dataclass
class TrainResult:
    checkpoint: Path  # ``final/``, loadable with ``SpeculatorModel.from_pretrained``
    metrics: Path  # ``metrics.jsonl``
    summary: dict


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_layers(spec: DrafterSpec, target_config) -> tuple[list[int], list[int]]:
    """``(target_layer_ids, kv_reuse_layer_ids)``: the recipe's, or Appendix B.1's defaults."""
    from vllm_hybridspec.drafter import check_kv_reuse, default_layer_selection, full_attention_layers

    selected, kv = default_layer_selection(target_config, spec.num_target_layers, spec.num_attention_layers)
    selected = spec.target_layer_ids or selected
    if spec.kv_reuse_layer_ids is not None:
        kv = spec.kv_reuse_layer_ids
    elif spec.target_layer_ids is not None:
        full = set(full_attention_layers(target_config))
        kv = [i for i in selected if i in full][-spec.num_attention_layers :]
    if spec.type == "hspec":
        check_kv_reuse(target_config, kv)
    return list(selected), list(kv)


def fix_dflash_verifier_norm(model, target_config) -> None:
    """Give speculators' DFlash the target's final-norm convention.

    speculators 0.9 chooses DFlash's frozen ``verifier_norm`` from
    ``speculators.models.utils.GEMMA_STYLE_FINAL_NORM_MODEL_TYPES``, which lacks ``qwen3_next``,
    whose final norm computes ``x * (1 + w)``; DFlash would then train against wrongly scaled target
    logits. The H-Spec drafter picks the convention itself (``ZERO_CENTERED_FINAL_NORM_MODEL_TYPES``).
    """
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from vllm_hybridspec.drafter.model import ZERO_CENTERED_FINAL_NORM_MODEL_TYPES

    if target_config.model_type not in ZERO_CENTERED_FINAL_NORM_MODEL_TYPES or isinstance(
        model.verifier_norm, Gemma3RMSNorm
    ):
        return
    norm = Gemma3RMSNorm(target_config.hidden_size, eps=target_config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(model.verifier_norm.weight)
    model.verifier_norm = norm.requires_grad_(False).to(model.verifier_norm.weight.device)


def _summarize(records: list[dict]) -> dict:
    train = [r["train"] for r in records if "train" in r]
    val = [r["val"] for r in records if "val" in r]
    summary: dict = {"steps": len(train)}
    if train:
        summary["train_loss_first"] = train[0]["loss"]
        summary["train_loss_last"] = train[-1]["loss"]
        summary["train_last"] = train[-1]
    if val:
        summary["val_last"] = val[-1]
    return summary


def train_from_recipe(recipe: Recipe | str | Path) -> TrainResult:
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.utils import resolve_mask_token_id
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from vllm_hybridspec.train.data import prepare_data
    from vllm_hybridspec.train.target import AddTargetKV, TargetKV, load_target
    from vllm_hybridspec.train.tiny_target import build_tiny_target
    from vllm_hybridspec.train.trainer import DraftTrainer, MetricsJsonl, TrainerConfig

    if not isinstance(recipe, Recipe):
        recipe = Recipe.from_yaml(recipe)
    tr, dr = recipe.training, recipe.drafter
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(recipe.to_yaml())
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if tr.device == "auto" else tr.device
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        tr.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    loss_implementation = (
        tr.loss_implementation
        if tr.loss_implementation != "auto"
        else "eager"  # speculators' fused CE kernel fails under DFlash's torch.compile (dynamo) in speculators 0.9
    )
    set_seed(recipe.seed)

    target_path = recipe.target.name_or_path
    if target_path is None:
        target_path = str(build_tiny_target(recipe.target.tiny, out / "target"))
    target, tokenizer = load_target(
        target_path, dtype=dtype, device=device, trust_remote_code=recipe.target.trust_remote_code
    )
    target_config = target.config.get_text_config()
    target_layer_ids, kv_layer_ids = resolve_layers(dr, target_config)
    target_identity = (
        target_path if recipe.target.tiny is None else f"{target_path} {recipe.target.tiny.model_dump_json()}"
    )
    data_dir = prepare_data(
        recipe.data, target, tokenizer, target_identity, target_layer_ids, out / "data", recipe.seed
    )

    mask_token_id = (
        dr.mask_token_id
        if dr.mask_token_id is not None
        else resolve_mask_token_id(
            target_path, target_config.vocab_size, None, trust_remote_code=recipe.target.trust_remote_code
        )
    )
    t2d = d2t = None
    if dr.draft_vocab_size is not None and dr.draft_vocab_size < target_config.vocab_size:
        freq = torch.load(data_dir / "token_freq.pt", weights_only=True)
        d2t, t2d = build_vocab_mappings_from_distribution(freq, dr.draft_vocab_size, target_config.vocab_size)
    draft_vocab_size = dr.draft_vocab_size or target_config.vocab_size

    set_seed(recipe.seed)
    common = dict(
        verifier_name_or_path=target_path,
        target_layer_ids=target_layer_ids,
        block_size=dr.block_size,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab_size,
    )
    if dr.type == "hspec":
        from vllm_hybridspec.drafter import HSpecDraftModel as model_class

        model = model_class.from_training_args(
            target_config,
            t2d,
            d2t,
            kv_reuse_layer_ids=kv_layer_ids,
            num_layers=dr.num_layers or 4,
            sliding_window=dr.sliding_window,
            markov_rank=dr.markov_rank,
            fusion_rank=dr.fusion_rank,
            mamba_num_heads=dr.mamba_num_heads,
            mamba_head_dim=dr.mamba_head_dim,
            mamba_d_state=dr.mamba_d_state,
            mamba_n_groups=dr.mamba_n_groups,
            mamba_d_conv=dr.mamba_d_conv,
            **common,
        )
        # runs in the data loader's collate step on CPU tensors: keep these few layers on the CPU, fp32
        preprocess = AddTargetKV(TargetKV(target, kv_layer_ids, target_layer_ids).to("cpu", torch.float32))
    else:
        from speculators.models.dflash import DFlashDraftModel as model_class
        from speculators.train.cli import create_transformer_layer_config

        layer_config = create_transformer_layer_config(
            target_path,
            dr.num_layers or 5,
            "qwen3",
            None,
            dr.sliding_window,
            [],
            trust_remote_code=recipe.target.trust_remote_code,
        )
        model = model_class.from_training_args(layer_config, t2d, d2t, draft_attn_impl="sdpa", **common)
        fix_dflash_verifier_norm(model, target_config)
        preprocess = None
    del target

    train_loader, val_loader = create_train_val_loaders(
        data_path=str(data_dir),
        total_seq_len=tr.total_seq_len,
        hidden_states_dtype=dtype,
        transfer=None,
        vllm_endpoint="",
        on_missing="raise",
        verifier_name_or_path=target_path,
        request_timeout=None,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=target_config.hidden_size,
        num_target_layers=len(target_layer_ids),
        num_workers=tr.num_workers,
        prefetch_factor=2,
        preprocess=preprocess,
        train_data_ratio=1.0 - recipe.data.val_fraction,
        seed=recipe.seed,
    )
    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(
        loss_fn=tr.loss_fn,
        loss_implementation=loss_implementation,
        dflash_decay_gamma=tr.decay_gamma,
        max_anchors=tr.max_anchors,
    )
    config = TrainerConfig(
        lr=tr.lr,
        num_epochs=tr.epochs,
        save_path=str(out / "checkpoints"),
        resume_from_checkpoint=tr.resume,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        weight_decay=tr.weight_decay,
        scheduler_type=tr.scheduler,
        scheduler_warmup_ratio=tr.warmup_ratio,
        checkpoint_freq=tr.checkpoint_freq,
        hidden_states_dtype=dtype,
        log_freq=tr.log_freq,
        max_steps=tr.max_steps,
    )
    metrics_path = out / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    set_seed(recipe.seed)
    with MetricsJsonl(metrics_path) as log:
        DraftTrainer(model, config, train_loader, val_loader, device).run_training()
    model.save_pretrained(out / "final")
    summary = {
        "drafter": dr.type,
        "target": target_path,
        "target_layer_ids": target_layer_ids,
        "kv_reuse_layer_ids": kv_layer_ids if dr.type == "hspec" else None,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        **_summarize(log.records),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return TrainResult(out / "final", metrics_path, summary)
