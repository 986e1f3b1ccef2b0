"""``hybridspec train``: a recipe end to end.

1. the target (loaded, or a tiny random one built into ``<output_dir>/target``);
2. the selected target layers and the KV-reuse mapping (Appendix B.1 defaults), validated;
3. prompts -> target responses -> captured hidden states in speculators' format (``data.py``);
4. the drafter: ``hspec`` (this package) or ``dflash`` (speculators'), same data, loss and schedule;
5. speculators' trainer (``trainer.py``), the K/V of the reused layers recomputed from the captured
   hidden states for ``hspec`` (``target.AddTargetKV``);
6. outputs in ``output_dir``: ``checkpoints/<epoch>/`` (speculators' checkpoints, bf16),
   ``final/`` (``save_pretrained``, full precision), ``metrics.jsonl`` and ``summary.json``.

Before any of it, :func:`check_recipe` checks what the recipe points at (the output folder, the target's
config, the layer choice against it, every prompt row): a bad input is one ``InputError`` line and
nothing is written. ``run.json`` says what the folder holds and how far the run got (a rerun reuses
the captured data made with the same settings, and ``training.resume`` continues from the last
checkpoint); ``target/``, ``data/``, ``final/`` and the JSON files appear whole or not at all.
"""

from __future__ import annotations

import datetime
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from vllm_hybridspec.policy.errors import InputError
from vllm_hybridspec.policy.files import atomic_dir, check_output_dir, write_text_atomic
from vllm_hybridspec.train.recipe import DrafterSpec, Recipe

RUN_FORMAT = "hybridspec-train-run"
# what ``hybridspec train`` writes into output_dir; a folder holding anything else is not reused
OUTPUTS = ("run.json", "recipe.yaml", "target", "data", "checkpoints", "final", "metrics.jsonl", "summary.json")


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


@dataclass
class Checked:
    """What :func:`check_recipe` found: the target's (text) config, the layer choice, the prompt
    count, and the earlier run's ``run.json`` in ``output_dir`` (or ``None``)."""

    target_config: object
    target_layer_ids: list[int]
    kv_layer_ids: list[int]
    num_prompts: int
    previous: dict | None


def check_recipe(recipe: Recipe, source: str = "recipe") -> Checked:
    """Everything the run will read, checked before it writes anything; :class:`InputError` in one line
    ``<source>: field '<field>': <problem>`` otherwise (``source``: the recipe file)."""
    from vllm_hybridspec.train.data import check_prompts

    def bad(field: str, problem: str) -> InputError:
        return InputError(f"{source}: field '{field}': {problem}")

    try:
        check_output_dir(recipe.output_dir, "output_dir")
    except InputError as e:
        raise bad("output_dir", str(e).removeprefix("output_dir ")) from None
    previous = read_run(Path(recipe.output_dir), source)
    if recipe.training.resume and not _checkpoint_epochs(Path(recipe.output_dir)):
        raise bad("training.resume", f"true, but output_dir '{recipe.output_dir}' holds no checkpoints to "
                  "resume from; set it to false for a fresh run")
    config = target_text_config(recipe, bad)
    dr = recipe.drafter
    n = config.num_hidden_layers
    for field in ("target_layer_ids", "kv_reuse_layer_ids"):
        ids = getattr(dr, field) or []
        if ids and max(ids) >= n:
            raise bad(f"drafter.{field}", f"{ids}: layer {max(ids)} does not exist; the target has {n} "
                      f"layers (0..{n - 1})")
    try:
        selected, kv = resolve_layers(dr, config)
    except ValueError as e:
        raise bad("drafter", str(e)) from None
    for field, value in (("mask_token_id", dr.mask_token_id), ("draft_vocab_size", dr.draft_vocab_size)):
        limit = config.vocab_size - (field == "mask_token_id")
        if value is not None and value > limit:
            raise bad(f"drafter.{field}", f"{value} is outside the target's vocabulary of "
                      f"{config.vocab_size} tokens; give at most {limit}")
    try:
        num_prompts = check_prompts(recipe.data, recipe.seed)
    except ValueError as e:
        raise InputError(f"{source}: {e}") from None
    return Checked(config, selected, kv, num_prompts, previous)


def target_text_config(recipe: Recipe, bad):
    """The target's text config, read without loading weights (a tiny target's is built)."""
    from vllm_hybridspec.train.tiny_target import tiny_target_config, tiny_vocab_size

    target = recipe.target
    if target.tiny is not None:
        return tiny_target_config(target.tiny, tiny_vocab_size())
    from transformers import AutoConfig

    name = target.name_or_path
    path = Path(name).expanduser()
    if path.exists() or name.startswith(("/", ".", "~")):
        if not path.is_dir():
            raise bad("target.name_or_path", f"'{name}' {'is a file' if path.exists() else 'does not exist'}; "
                      "expected a transformers model directory (with config.json) or a hub model id")
        if not (path / "config.json").is_file():
            raise bad("target.name_or_path", f"'{name}' has no config.json; expected a transformers model "
                      "directory or a hub model id")
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=target.trust_remote_code)
    except Exception as e:  # hub lookups and config classes fail in many ways, over many lines
        text = " ".join(str(e).split()) or type(e).__name__
        raise bad("target.name_or_path", f"'{name}' could not be read as a model config ({text[:300]})") from None
    return config.get_text_config()


def _checkpoint_epochs(out: Path) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []


def read_run(out: Path, source: str = "recipe") -> dict | None:
    """The ``run.json`` of an earlier run in ``out``, or ``None`` for a new or empty folder;
    :class:`InputError` for a folder holding anything ``hybridspec train`` does not write."""
    if not out.is_dir():
        return None
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS and not p.name.startswith("."))
    if foreign:
        raise InputError(f"{source}: field 'output_dir': '{out}' holds {', '.join(foreign[:3])}"
                         f"{' ...' if len(foreign) > 3 else ''}, which hybridspec train does not write; give a "
                         "new or empty directory, or the output_dir of an earlier run")
    path = out / "run.json"
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
        run = None
    if not isinstance(run, dict) or run.get("format") != RUN_FORMAT:
        raise InputError(f"{path}: not a hybridspec train run record (field 'format' must be '{RUN_FORMAT}'); "
                         "remove it or give another output_dir")
    return run


def describe_run(run: dict | None, out: Path) -> str:
    """One line on what an earlier run left in ``out``."""
    if run is None:
        return f"output_dir {out}: new"
    parts = [f"{k} ({v})" if isinstance(v, str) else k for k, v in run.get("contents", {}).items()]
    status = run.get("status")
    error = f": {run['error']}" if run.get("error") else ""
    return (f"output_dir {out}: earlier run {status}{error}, updated {run.get('updated')}; holds "
            f"{', '.join(parts) or 'nothing yet'}")


class RunRecord:
    """``run.json``: the recipe, the status (running, complete, failed) and what the folder holds so
    far, rewritten whole after each stage."""

    def __init__(self, out: Path, recipe: Recipe, previous: dict | None):
        self.path = out / "run.json"
        contents = dict((previous or {}).get("contents", {}))
        self.doc = {"format": RUN_FORMAT, "version": 1, "status": "running", "error": None,
                    "started": _now(), "updated": None, "recipe": recipe.model_dump(mode="json"),
                    "contents": contents}
        self.write()

    def add(self, name: str, what: str | None = None) -> None:
        self.doc["contents"][name] = what or True
        self.write()

    def finish(self, status: str, error: str | None = None) -> None:
        self.doc.update(status=status, error=error)
        self.write()

    def write(self) -> None:
        self.doc["updated"] = _now()
        write_text_atomic(self.path, json.dumps(self.doc, indent=2) + "\n")


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


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


def train_from_recipe(
    recipe: Recipe | str | Path, source: str | None = None, checked: Checked | None = None
) -> TrainResult:
    """Run ``recipe`` (or the recipe file at that path); ``source`` names the recipe in errors.
    Raises :class:`InputError` before writing anything when an input is bad (``checked``: what
    :func:`check_recipe` already found for this recipe)."""
    if not isinstance(recipe, Recipe):
        source = source or str(recipe)
        recipe = Recipe.from_yaml(recipe)
    checked = checked or check_recipe(recipe, source or "recipe")
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = RunRecord(out, recipe, checked.previous)
    try:
        result = _train(recipe, checked, out, run)
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        run.finish(status, " ".join(f"{type(e).__name__}: {e}".split())[:500])
        raise
    run.finish("complete")
    return result


def _train(recipe: Recipe, checked: Checked, out: Path, run: RunRecord) -> TrainResult:
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.utils import resolve_mask_token_id
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from vllm_hybridspec.train.data import prepare_data
    from vllm_hybridspec.train.target import AddTargetKV, TargetKV, load_target
    from vllm_hybridspec.train.tiny_target import build_tiny_target
    from vllm_hybridspec.train.trainer import DraftTrainer, MetricsJsonl, TrainerConfig

    tr, dr = recipe.training, recipe.drafter
    write_text_atomic(out / "recipe.yaml", recipe.to_yaml())
    run.add("recipe.yaml")
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
        with atomic_dir(out / "target") as tmp:
            build_tiny_target(recipe.target.tiny, tmp)
        target_path = str(out / "target")
        run.add("target", f"tiny {recipe.target.tiny.model_type} target, random weights")
    target, tokenizer = load_target(
        target_path, dtype=dtype, device=device, trust_remote_code=recipe.target.trust_remote_code
    )
    target_config = target.config.get_text_config()
    target_layer_ids, kv_layer_ids = checked.target_layer_ids, checked.kv_layer_ids
    target_identity = (
        target_path if recipe.target.tiny is None else f"{target_path} {recipe.target.tiny.model_dump_json()}"
    )
    data_dir = prepare_data(
        recipe.data, target, tokenizer, target_identity, target_layer_ids, out / "data", recipe.seed
    )
    run.add("data", f"{checked.num_prompts} prompts with target responses, hidden states of layers "
            f"{target_layer_ids}")

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
    if not tr.resume:
        metrics_path.unlink(missing_ok=True)
    set_seed(recipe.seed)
    with MetricsJsonl(metrics_path) as log:
        DraftTrainer(model, config, train_loader, val_loader, device).run_training()
    run.add("metrics.jsonl")
    run.add("checkpoints", f"epochs {_checkpoint_epochs(out)}")
    with atomic_dir(out / "final") as tmp:
        model.save_pretrained(tmp)
    run.add("final", f"{dr.type} drafter, full precision")
    summary = {
        "drafter": dr.type,
        "target": target_path,
        "target_layer_ids": target_layer_ids,
        "kv_reuse_layer_ids": kv_layer_ids if dr.type == "hspec" else None,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        **_summarize(log.records),
    }
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=float))
    run.add("summary.json")
    return TrainResult(out / "final", metrics_path, summary)
