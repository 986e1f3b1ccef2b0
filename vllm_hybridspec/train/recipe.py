"""The training recipe: one YAML file, validated by these pydantic models (``hybridspec train --config``).

Defaults follow the paper's recipe (Appendix B.3) where it applies at any scale -- AdamW, peak LR
6e-4, weight decay 0.01, 1% warmup then half-cosine decay, gradient clipping at 1.0, loss
0.1 * CE + 0.9 * TV with position weights ``exp(-(k - 1) / 4)`` -- and are small elsewhere (sequence
length, anchors, prompts) so that a tiny target trains on a CPU. Relative paths are relative to the
directory the command runs in.

Every value is checked here, before anything is written: unknown keys (with the near miss named),
wrong types (never coerced: ``epochs: "2"`` or ``epochs: 1.5`` is refused), numbers out of range or
not finite, and what one section implies for another. :meth:`Recipe.from_yaml` turns every problem
into one :class:`~vllm_hybridspec.policy.errors.InputError` line naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from vllm_hybridspec.policy.errors import USER_FILE, InputError, describe
from vllm_hybridspec.policy.files import not_text
from vllm_hybridspec.train.data import DataSpec
from vllm_hybridspec.train.tiny_target import TinyTarget


class _Strict(BaseModel):
    model_config = USER_FILE


class TargetSpec(_Strict):
    name_or_path: str | None = Field(default=None, description="Hub id or local directory of the target")
    tiny: TinyTarget | None = Field(default=None, description="Build a tiny random-weight target instead")
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> TargetSpec:
        if (self.name_or_path is None) == (self.tiny is None):
            got = "neither" if self.tiny is None else "both"
            raise ValueError(f"set exactly one of name_or_path and tiny, got {got}")
        return self


class DrafterSpec(_Strict):
    type: Literal["hspec", "dflash"] = "hspec"
    target_layer_ids: list[int] | None = Field(
        default=None,
        description="Selected target layers (default: num_target_layers evenly spaced, Appendix B.1)",
    )
    num_target_layers: int = Field(default=5, ge=1)
    kv_reuse_layer_ids: list[int] | None = Field(
        default=None,
        description="hspec: target layer read by each "
        "attention layer (default: the last selected full-attention layers)",
    )
    num_attention_layers: int = Field(default=3, ge=1)
    num_layers: int | None = Field(
        default=None, ge=1, description="Drafter layers (default 4 for hspec, 5 for dflash)"
    )
    block_size: int = Field(default=8, ge=2, description="anchor + draft tokens")
    mask_token_id: int | None = Field(
        default=None, ge=0, description="Default: the tokenizer's mask token"
    )
    draft_vocab_size: int | None = Field(
        default=None,
        ge=1,
        description="Prune the draft vocabulary to the most "
        "frequent response tokens (default: the full target vocabulary)",
    )
    sliding_window: int = Field(default=2048, ge=1)
    markov_rank: int = Field(default=256, ge=1)
    fusion_rank: int | None = Field(default=None, ge=1)
    mamba_num_heads: int | None = Field(default=None, ge=1)
    mamba_head_dim: int = Field(default=64, ge=1)
    mamba_d_state: int = Field(default=4, ge=1)
    mamba_n_groups: int = Field(default=4, ge=1)
    mamba_d_conv: int = Field(default=4, ge=1)

    @field_validator("target_layer_ids", "kv_reuse_layer_ids")
    @classmethod
    def _layer_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one layer index, or leave the key out for the default")
        if min(v) < 0 or len(set(v)) != len(v):
            raise ValueError(f"layer indices must be distinct and >= 0, got {v}")
        return v


class TrainingSpec(_Strict):
    epochs: int = Field(default=1, ge=1, description="passes over the training split")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many optimizer steps")
    lr: float = Field(default=6e-4, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    scheduler: Literal["cosine", "linear", "none"] = "cosine"
    warmup_ratio: float = Field(default=0.01, ge=0, lt=1)
    total_seq_len: int = Field(default=1024, ge=2, description="tokens per packed training sequence")
    max_anchors: int = Field(default=64, ge=1)
    loss_fn: str = Field(
        default='{"ce": 0.1, "tv": 0.9}',
        description="a speculators loss name, or a JSON object of loss names and weights",
    )
    loss_implementation: Literal["auto", "fused", "eager"] = Field(
        default="auto", description="speculators' fused Triton losses or eager torch (auto: fused on CUDA)"
    )
    decay_gamma: float = Field(default=4.0, gt=0)
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 on CUDA, fp32 on CPU"
    )
    checkpoint_freq: float = Field(default=1, gt=0, description="epochs between checkpoints")
    log_freq: int = Field(default=1, ge=1)
    num_workers: int = Field(default=0, ge=0)
    resume: bool = Field(default=False, description="continue from the last checkpoint in output_dir")

    @field_validator("loss_fn")
    @classmethod
    def _loss(cls, v: str) -> str:
        from speculators.losses.utils import resolve_loss_config

        config = resolve_loss_config(v, "eager")  # ValueError naming the loss and the valid ones
        bad = {k: w for k, (_, w) in config.items() if not (math.isfinite(w) and w >= 0)}
        if bad or not any(w > 0 for _, w in config.values()):
            raise ValueError(f"loss weights must be finite, >= 0 and not all 0, got {json.loads(v)}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", v):
            if v.startswith("cuda"):
                import torch

                count = torch.cuda.device_count()
                index = int(v.partition(":")[2] or 0)
                if index >= count:
                    raise ValueError(f"{v!r} is not a device here ({count} CUDA devices); use auto or cpu")
            return v
        raise ValueError(f"{v!r} is not a device; use auto, cpu, cuda or cuda:N")


class Recipe(_Strict):
    seed: int = Field(default=0, ge=0, lt=2**32, description="numpy, torch and data-shuffle seed")
    output_dir: str = Field(min_length=1)
    target: TargetSpec
    data: DataSpec
    drafter: DrafterSpec = DrafterSpec()
    training: TrainingSpec = TrainingSpec()

    @model_validator(mode="after")
    def _sections_agree(self) -> Recipe:
        dr = self.drafter
        if dr.type == "hspec" and dr.kv_reuse_layer_ids is not None and dr.target_layer_ids is not None:
            missing = sorted(set(dr.kv_reuse_layer_ids) - set(dr.target_layer_ids))
            if missing:
                raise ValueError(
                    f"drafter.kv_reuse_layer_ids {dr.kv_reuse_layer_ids}: layers {missing} are not in "
                    f"drafter.target_layer_ids {dr.target_layer_ids}; the drafter reads K/V only of "
                    "selected layers"
                )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        """The recipe in ``path``; :class:`InputError` in one line naming the file, the field, the
        value and what would be valid."""
        path = Path(path)
        doc = load_yaml(path, "recipe")
        if not isinstance(doc, dict):
            raise InputError(
                f"{path}: a recipe is a YAML mapping with keys {', '.join(cls.model_fields)}, "
                f"got {'an empty file' if doc is None else type(doc).__name__}"
            )
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            raise describe(e, str(path), cls) from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with two fixes for hand-written recipes: ``6e-4`` is a number (YAML 1.2;
    PyYAML follows YAML 1.1, which needs ``6.0e-4`` and would read text), and a key given twice in
    one mapping is an error instead of the last one silently winning."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: Path, what: str):
    """The YAML document in ``path`` (a ``what``: "recipe"); :class:`InputError` naming the file, and the
    line and column of a syntax error."""
    if path.is_dir():
        raise InputError(f"{what} '{path}' is a directory; give a YAML file")
    if not path.is_file():
        raise InputError(f"{what} '{path}' does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise not_text(path, f"a {what} in YAML") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise InputError(f"{path}: not valid YAML ({' '.join(problem.split())}{where})") from None
