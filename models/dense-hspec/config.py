"""The ``hspec`` speculator config (speculators format: ``config.json`` with ``speculators_model_type``
and ``speculators_config``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator, model_validator
from speculators import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig, PretrainedConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from vllm_hybridspec.drafter.target import AttentionGeometry, check_kv_reuse, text_config


@SpeculatorModelConfig.register("hspec")
class HSpecSpeculatorConfig(SpeculatorModelConfig):
    """H-Spec (paper section 3.3, Appendix B.1): ``num_layers`` layers of Mamba-2 -> attention -> MLP,
    the first ``len(kv_reuse_layer_ids)`` with attention (layer ``i``'s reads the K/V of target layer
    ``kv_reuse_layer_ids[i]``), the rest Mamba -> MLP only; a DSpark Markov head; the target's
    embeddings and LM head, frozen.

    ``transformer_layer_config`` describes the drafter's attention and MLP (a Qwen3 config with the
    target's hidden size, attention geometry, RoPE and MLP width), as for speculators' DFlash.
    """

    speculators_model_type: Literal["hspec"] = "hspec"
    architectures: list[str] = Field(default_factory=lambda: ["HSpecSpeculator"])

    transformer_layer_config: PretrainedConfig = Field(
        default_factory=Qwen3Config,
        description="Attention/MLP shapes of the drafter layers (Qwen3 config; the target's geometry)",
    )
    draft_vocab_size: int = Field(
        default=32000, description="Size of the (optionally pruned) draft vocabulary"
    )
    block_size: int = Field(
        default=8, description="Tokens per draft block: the anchor plus block_size - 1 drafts"
    )
    mask_token_id: int | None = Field(
        default=None, description="Token id filling the draft positions of a block"
    )
    aux_hidden_state_layer_ids: list[int] = Field(
        default_factory=list,
        description="Selected target layers whose last-token hidden states (inputs of those layers) are "
        "fused into the initial Mamba state",
    )
    kv_reuse_layer_ids: list[int] = Field(
        default_factory=list,
        description="Per drafter attention layer, the full-attention target layer whose K/V it reads",
    )
    num_layers: int = Field(
        default=4, description="Drafter layers; those past len(kv_reuse_layer_ids) have no attention"
    )
    sliding_window: int | None = Field(default=2048, description="Attention window over the target prefix")
    fusion_rank: int | None = Field(
        default=None, description="Rank r of the cross-layer fusion (default: hidden size)"
    )
    mamba_num_heads: int | None = Field(
        default=None,
        description="Mamba heads (default: expand * hidden / head_dim, rounded down to a multiple "
        "of mamba_n_groups)",
    )
    mamba_head_dim: int = 64
    mamba_d_state: int = 4
    mamba_n_groups: int = 4
    mamba_d_conv: int = 4
    mamba_expand: int = 1
    mamba_chunk_size: int = Field(default=64, description="Chunk size of mamba-ssm's kernel")
    markov_rank: int = Field(default=256, description="Rank of the DSpark Markov head; 0 disables it")
    target_model_type: str | None = Field(default=None, description="model_type of the target's text config")

    @field_serializer("transformer_layer_config")
    def _serialize_transformer_config(self, value: PretrainedConfig) -> dict:
        return value.to_diff_dict()

    @field_validator("transformer_layer_config", mode="before")
    @classmethod
    def _validate_transformer_config(cls, value: Any) -> PretrainedConfig:
        if isinstance(value, dict):
            config_class = (
                AutoConfig.for_model(value["model_type"]).__class__ if "model_type" in value else Qwen3Config
            )
            return config_class(**value)
        return value

    @model_validator(mode="after")
    def _check(self) -> HSpecSpeculatorConfig:
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be at least 2 (the anchor plus one draft), got {self.block_size}"
            )
        if len(self.kv_reuse_layer_ids) > self.num_layers:
            raise ValueError(
                f"{len(self.kv_reuse_layer_ids)} kv_reuse_layer_ids but only num_layers="
                f"{self.num_layers} drafter layers"
            )
        if self.mamba_heads % self.mamba_n_groups:
            raise ValueError(
                f"mamba_num_heads ({self.mamba_heads}) must be a multiple of mamba_n_groups "
                f"({self.mamba_n_groups})"
            )
        return self

    @property
    def mamba_heads(self) -> int:
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        heads = self.mamba_expand * self.transformer_layer_config.hidden_size // self.mamba_head_dim
        return max(heads - heads % self.mamba_n_groups, self.mamba_n_groups)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @property
    def attention_geometry(self) -> AttentionGeometry:
        return AttentionGeometry.of(self.transformer_layer_config)

    @classmethod
    def from_target(
        cls,
        target_config: PretrainedConfig,
        verifier_name_or_path: str | None,
        target_layer_ids: list[int],
        kv_reuse_layer_ids: list[int],
        *,
        draft_vocab_size: int | None = None,
        mlp_intermediate_size: int | None = None,
        **fields: Any,
    ) -> HSpecSpeculatorConfig:
        """An H-Spec config for ``target_config``: attention geometry and RoPE copied from the target,
        the KV-reuse mapping validated against its full-attention layers. ``fields`` sets any other
        field (``num_layers``, ``mamba_num_heads``, ``mask_token_id``, ...)."""
        target = text_config(target_config)
        geometry = AttentionGeometry.of(target)
        check_kv_reuse(target, kv_reuse_layer_ids)
        bad = [i for i in target_layer_ids if not 0 <= i <= target.num_hidden_layers]
        if bad or not target_layer_ids:
            raise ValueError(
                f"target_layer_ids {target_layer_ids} must be a non-empty list of layers in "
                f"[0, {target.num_hidden_layers}] (the target has {target.num_hidden_layers} layers)"
            )
        intermediate = (
            mlp_intermediate_size or getattr(target, "intermediate_size", None) or 3 * target.hidden_size
        )
        num_layers = fields.get("num_layers", cls.model_fields["num_layers"].default)
        layer_config = Qwen3Config(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=geometry.num_attention_heads,
            num_key_value_heads=geometry.num_key_value_heads,
            head_dim=geometry.head_dim,
            hidden_act=getattr(target, "hidden_act", "silu"),
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            initializer_range=getattr(target, "initializer_range", 0.02),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": geometry.rope_theta,
                "partial_rotary_factor": geometry.partial_rotary_factor,
            },
            pad_token_id=getattr(target, "pad_token_id", None),
            tie_word_embeddings=False,
        )
        block_size = fields.get("block_size", cls.model_fields["block_size"].default)
        verifier = (
            VerifierConfig.from_pretrained(verifier_name_or_path)
            if verifier_name_or_path
            else VerifierConfig.from_config(target_config, name_or_path=None)
        )
        return cls(
            transformer_layer_config=layer_config,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            aux_hidden_state_layer_ids=list(target_layer_ids),
            kv_reuse_layer_ids=list(kv_reuse_layer_ids),
            target_model_type=target.model_type,
            speculators_config=SpeculatorsConfig(
                algorithm="hspec",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
                default_proposal_method="greedy",
                verifier=verifier,
            ),
            **fields,
        )
