"""The training recipe: one YAML file, validated by these pydantic models (``hybridspec train --config``).

Defaults follow the paper's recipe (Appendix B.3) where it applies at any scale -- AdamW, peak LR
6e-4, weight decay 0.01, 1% warmup then half-cosine decay, gradient clipping at 1.0, loss
0.1 * CE + 0.9 * TV with position weights ``exp(-(k - 1) / 4)`` -- and are small elsewhere (sequence
length, anchors, prompts) so that a tiny target trains on a CPU. Relative paths are relative to the
directory the command runs in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from vllm_hybridspec.train.data import DataSpec
from vllm_hybridspec.train.tiny_target import TinyTarget


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetSpec(_Strict):
    name_or_path: str | None = Field(default=None, description="Hub id or local directory of the target")
    tiny: TinyTarget | None = Field(default=None, description="Build a tiny random-weight target instead")
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> TargetSpec:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError("target: set exactly one of name_or_path and tiny")
        return self


class DrafterSpec(_Strict):
    type: Literal["hspec", "dflash"] = "hspec"
    target_layer_ids: list[int] | None = Field(
        default=None,
        description="Selected target layers (default: num_target_layers evenly spaced, Appendix B.1)",
    )
    num_target_layers: int = 5
    kv_reuse_layer_ids: list[int] | None = Field(
        default=None,
        description="hspec: target layer read by each "
        "attention layer (default: the last selected full-attention layers)",
    )
    num_attention_layers: int = 3
    num_layers: int | None = Field(
        default=None, description="Drafter layers (default 4 for hspec, 5 for dflash)"
    )
    block_size: int = 8
    mask_token_id: int | None = Field(default=None, description="Default: the tokenizer's mask token")
    draft_vocab_size: int | None = Field(
        default=None,
        description="Prune the draft vocabulary to the most "
        "frequent response tokens (default: the full target vocabulary)",
    )
    sliding_window: int = 2048
    markov_rank: int = 256
    fusion_rank: int | None = None
    mamba_num_heads: int | None = None
    mamba_head_dim: int = 64
    mamba_d_state: int = 4
    mamba_n_groups: int = 4
    mamba_d_conv: int = 4


class TrainingSpec(_Strict):
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 6e-4
    weight_decay: float = 0.01
    scheduler: Literal["cosine", "linear", "none"] = "cosine"
    warmup_ratio: float = 0.01
    total_seq_len: int = 1024
    max_anchors: int = 64
    loss_fn: str = '{"ce": 0.1, "tv": 0.9}'
    loss_implementation: Literal["auto", "fused", "eager"] = Field(
        default="auto", description="speculators' fused Triton losses or eager torch (auto: fused on CUDA)"
    )
    decay_gamma: float = 4.0
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="auto: bf16 on CUDA, fp32 on CPU"
    )
    checkpoint_freq: float = 1
    log_freq: int = 1
    num_workers: int = 0
    resume: bool = False


class Recipe(_Strict):
    seed: int = 0
    output_dir: str
    target: TargetSpec
    data: DataSpec
    drafter: DrafterSpec = DrafterSpec()
    training: TrainingSpec = TrainingSpec()

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
