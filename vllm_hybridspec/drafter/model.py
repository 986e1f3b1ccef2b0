"""The H-Spec drafter (paper section 3.3), registered with speculators as ``hspec``.

A forward has three stages, kept separate so a serving engine can call them on its own tensors:

1. :meth:`HSpecDraftModel.initial_state` -- the last-token hidden states of the selected target
   layers, concatenated, projected to rank ``r`` and then to the flattened Mamba state
   ``[heads, head_dim, d_state]``; computed once per forward and shared by every layer.
2. :meth:`HSpecDraftModel.block_forward` -- the block (anchor + mask tokens) through the layers:
   Mamba-2 from the injected state, attention over one target layer's K/V plus the block's own,
   MLP. No state is kept between calls: the drafter owns no cache.
3. :meth:`HSpecDraftModel.draft_heads` -- final norm, the target's LM head, the DSpark Markov head
   (each position's logits biased by the token drafted before it), and per draft position the
   greedy token, its top-1 probability and the entropy of the distribution (fp32).

:meth:`HSpecDraftModel.propose` runs all three for requests whose prefix K/V are explicit tensors;
:meth:`HSpecDraftModel.forward` is the training forward (speculators' trainer calls it): anchored
blocks sampled from a packed sequence, DSpark's loss and metrics.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from speculators.losses import LossConfig, kl_div_loss, resolve_loss_config, tv_loss
from speculators.model import DraftVocabMixin, SpeculatorModel
from speculators.models.dflash.utils import get_base_indices_for_anchored_blocks, select_anchors
from speculators.models.dspark.metrics import compute_metrics
from speculators.models.dspark.model_definitions import MarkovHead
from speculators.models.utils import GEMMA_STYLE_FINAL_NORM_MODEL_TYPES
from torch import nn
from transformers import initialization as init
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from vllm_hybridspec.drafter.attention import RotaryEmbedding, anchored_block_mask, request_block_mask
from vllm_hybridspec.drafter.config import HSpecSpeculatorConfig
from vllm_hybridspec.drafter.layers import DraftBlock, HSpecLayer, StateInjection
from vllm_hybridspec.drafter.mamba2 import Mamba2Mixer

# Final norms computing ``x * (1 + w)``: speculators' list plus Qwen3-Next, whose Qwen3NextRMSNorm does too.
ZERO_CENTERED_FINAL_NORM_MODEL_TYPES = GEMMA_STYLE_FINAL_NORM_MODEL_TYPES | {"qwen3_next"}


@SpeculatorModel.register("hspec")
class HSpecDraftModel(DraftVocabMixin, SpeculatorModel):
    config_class: ClassVar[type[HSpecSpeculatorConfig]] = HSpecSpeculatorConfig  # type: ignore[misc]
    _no_split_modules: ClassVar[list[str]] = ["HSpecLayer"]
    # Verifier-owned weights are rebuilt from the verifier on load (as for speculators' DFlash).
    _keys_to_ignore_on_load_missing: ClassVar[list[str]] = [  # type: ignore[misc]
        "embed_tokens.weight",
        "verifier_norm.weight",
        "verifier_lm_head.weight",
        "t2d",
        "d2t",
    ]
    _keys_to_ignore_on_save: ClassVar[list[str]] = [  # type: ignore[misc,assignment]
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]

    def __init__(self, config: HSpecSpeculatorConfig) -> None:
        super().__init__(config=config)
        self._init_vocab(config)
        tl = config.transformer_layer_config
        g = config.attention_geometry
        n_attn = len(config.kv_reuse_layer_ids)
        self.layers = nn.ModuleList(
            [HSpecLayer(config, with_attention=i < n_attn) for i in range(config.num_layers)]
        )
        self.state_injection = StateInjection.for_config(config, self.layers[0].mamba.state_shape)
        self.rotary_emb = RotaryEmbedding(g.head_dim, g.rope_theta, g.partial_rotary_factor)
        self.norm = Qwen3RMSNorm(tl.hidden_size, eps=tl.rms_norm_eps)
        self.markov_head = (
            MarkovHead(
                verifier_vocab_size=self.verifier_vocab_size,
                draft_vocab_size=self.draft_vocab_size,
                markov_rank=config.markov_rank,
                hidden_size=tl.hidden_size,
            )
            if config.markov_rank > 0
            else None
        )
        norm_class = (
            Gemma3RMSNorm
            if config.target_model_type in ZERO_CENTERED_FINAL_NORM_MODEL_TYPES
            else Qwen3RMSNorm
        )
        self.verifier_norm = norm_class(tl.hidden_size, eps=tl.rms_norm_eps)
        self.verifier_norm.weight.requires_grad = False
        self.block_size = config.block_size
        self.post_init()
        # The full-vocabulary LM head is the verifier's, frozen: rebuild it on load rather than save
        # it. A pruned head is a row subset that runtimes cannot derive, so keep it.
        save_ignore = [*type(self)._keys_to_ignore_on_save, "embed_tokens.weight"]
        load_ignore = list(type(self)._keys_to_ignore_on_load_missing)
        if not self.use_draft_vocab:
            save_ignore.append("lm_head.weight")
            load_ignore.append("lm_head.weight")
        self.__dict__["_keys_to_ignore_on_save"] = save_ignore
        self.__dict__["_keys_to_ignore_on_load_missing"] = load_ignore

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Mamba2Mixer):
            for name, value in module.ssm_parameter_init().items():
                init.copy_(getattr(module, name), value)

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.aux_hidden_state_layer_ids

    @property
    def kv_reuse_layer_ids(self) -> list[int]:
        return self.config.kv_reuse_layer_ids

    @property
    def mask_token_id(self) -> int:
        if self.config.mask_token_id is None:
            raise ValueError(
                "mask_token_id is not set in the H-Spec config; set it (e.g. the tokenizer's mask "
                "token, or an unused token id) before drafting or training"
            )
        return self.config.mask_token_id

    def load_verifier_weights(self) -> None:
        self._load_verifier_weights(overwrite_embed_tokens=True, overwrite_lm_head=not self.use_draft_vocab)

    # --- stage 1 -------------------------------------------------------------------------------------

    def initial_state(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """``last_hidden``: ``[N, len(target_layer_ids) * hidden]``, the inputs of the selected target
        layers at the last prefix position, concatenated in ``target_layer_ids`` order.
        Returns the initial Mamba state ``[N, heads, head_dim, d_state]`` fp32."""
        return self.state_injection(last_hidden)

    # --- stage 2 -------------------------------------------------------------------------------------

    def block_forward(
        self,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        initial_state: torch.Tensor,
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``block_ids``: ``[N, L]`` (anchor then mask tokens); ``initial_state``: ``[N, H, P, S]``;
        ``prefix_kv``: per attention layer, the post-RoPE ``(k, v)`` of its target layer
        (``kv_reuse_layer_ids`` order); ``positions`` and ``mask`` in the attention layout: per request
        ``positions`` ``[N, L]`` with ``prefix_kv`` tensors ``[N, kv_heads, T, head_dim]`` and ``mask``
        ``[N, 1, L, T + L]``, or packed ``positions`` ``[1, N * L]`` with ``prefix_kv`` tensors
        ``[1, kv_heads, T, head_dim]`` and ``mask`` ``[1, 1, N * L, T + N * L]``.
        Returns the last layer's hidden states ``[N, L, hidden]``."""
        if len(prefix_kv) != len(self.config.kv_reuse_layer_ids):
            raise ValueError(
                f"expected prefix K/V for {len(self.config.kv_reuse_layer_ids)} attention layers "
                f"(target layers {self.config.kv_reuse_layer_ids}), got {len(prefix_kv)}"
            )
        hidden = self.embed_tokens(block_ids)  # [N, L, hidden]
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        kv = iter(prefix_kv)
        for layer in self.layers:
            hidden = layer(
                hidden, initial_state, cos, sin, next(kv) if layer.self_attn is not None else None, mask
            )
        return hidden

    # --- stage 3 -------------------------------------------------------------------------------------

    def _to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if not self.use_draft_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]  # speculators' d2t stores target_id - draft_id

    @torch.no_grad()
    def draft_heads(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> DraftBlock:
        """``hidden``: ``[N, L, hidden]`` from :meth:`block_forward`; ``anchor_ids``: ``[N]``.
        Greedy drafts of positions ``1..L-1``; the Markov head makes position ``k`` depend on the
        token drafted at ``k - 1`` (the anchor for ``k = 1``), so the positions run in order."""
        logits = self.lm_head(self.norm(hidden[:, 1:])).float()  # [N, K, draft_vocab]
        prev = anchor_ids
        tokens, top1, entropy = [], [], []
        for k in range(logits.shape[1]):
            step = logits[:, k]
            if self.markov_head is not None:
                step = step + self.markov_head.markov_w2(self.markov_head.prev_embeddings(prev)).float()
            logp = torch.log_softmax(step, dim=-1)
            best = logp.argmax(dim=-1)  # [N] draft-vocabulary ids
            top1.append(logp.gather(-1, best[:, None]).squeeze(-1).exp())
            entropy.append(-(logp.exp() * logp).sum(-1))
            prev = self._to_target_ids(best)
            tokens.append(prev)
        return DraftBlock(torch.stack(tokens, 1), torch.stack(top1, 1), torch.stack(entropy, 1))

    # --- all three, for requests ---------------------------------------------------------------------

    @torch.no_grad()
    def propose(
        self,
        last_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
        prefix_lens: torch.Tensor,
    ) -> DraftBlock:
        """Draft one block per request.

        ``last_hidden``: ``[N, len(target_layer_ids) * hidden]`` at the last prefix position;
        ``anchor_ids``: ``[N]``, the token after the prefix (the target's bonus token);
        ``prefix_kv``: per attention layer ``(k, v)``, each ``[N, kv_heads, T, head_dim]``, the
        target's post-RoPE cache of layer ``kv_reuse_layer_ids[i]`` (slots past ``prefix_lens[i]``
        are ignored); ``prefix_lens``: ``[N]``. The block sits at positions
        ``prefix_lens + [0, block_size)``."""
        N, L = anchor_ids.shape[0], self.block_size
        capacity = prefix_kv[0][0].shape[2] if prefix_kv else 0
        positions = prefix_lens[:, None] + torch.arange(L, device=anchor_ids.device)  # [N, L]
        block_ids = torch.full((N, L), self.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        mask = request_block_mask(prefix_lens, capacity, L, self.config.sliding_window)
        hidden = self.block_forward(block_ids, positions, self.initial_state(last_hidden), prefix_kv, mask)
        return self.draft_heads(hidden, anchor_ids)

    # --- training ------------------------------------------------------------------------------------

    @classmethod
    def from_training_args(
        cls, verifier_config, t2d: torch.Tensor | None = None, d2t: torch.Tensor | None = None, **kwargs
    ) -> HSpecDraftModel:
        """``verifier_config``: the target's config (not a draft-layer config). Reads
        ``verifier_name_or_path``, ``target_layer_ids``, ``kv_reuse_layer_ids``, ``draft_vocab_size``
        and any :class:`HSpecSpeculatorConfig` field from ``kwargs``."""
        set_here = {
            "transformer_layer_config",
            "speculators_config",
            "aux_hidden_state_layer_ids",
            "kv_reuse_layer_ids",
            "draft_vocab_size",
        }
        fields = {
            k: v
            for k, v in kwargs.items()
            if k in HSpecSpeculatorConfig.model_fields and k not in set_here and v is not None
        }
        config = HSpecSpeculatorConfig.from_target(
            verifier_config,
            kwargs["verifier_name_or_path"],
            kwargs["target_layer_ids"],
            kwargs["kv_reuse_layer_ids"],
            draft_vocab_size=kwargs.get("draft_vocab_size"),
            **fields,
        )
        model = cls(config=config)
        model.load_vocab_mappings(t2d, d2t)
        model.load_verifier_weights()
        return model

    @staticmethod
    def get_trainer_kwargs(**kwargs) -> tuple[dict, dict]:
        """DSpark's compound loss (``loss_fn``, e.g. ``'{"ce": 0.1, "tv": 0.9}'``) with DFlash's
        per-position decay ``exp(-(k - 1) / gamma)``."""
        implementation = kwargs.get("loss_implementation", "fused")
        shared = {
            "loss_config": resolve_loss_config(kwargs["loss_fn"], implementation),
            "tv_loss_fn": resolve_loss_config("tv", implementation)["tv"][0],
            "gamma": kwargs.get("dflash_decay_gamma", 4.0),
            "max_anchors": kwargs.get("max_anchors", 512),
            "per_position_loss_weight": kwargs.get("per_position_loss_weight", "fixed-exp-decay"),
            "dpace_alpha": kwargs.get("dpace_alpha", 0.5),
        }
        return dict(shared), dict(shared)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [1, T, len(target_layer_ids) * hidden]
        input_ids: torch.Tensor,  # [1, T]
        loss_mask: torch.Tensor,  # [1, T]
        verifier_last_hidden_states: torch.Tensor,  # [1, T, hidden], before the final norm
        document_ids: torch.Tensor,  # [1, T], -1 for padding
        position_ids: torch.Tensor | None = None,  # [1, T]
        target_kv: torch.Tensor | None = None,  # [1, T, n_attn, 2, kv_heads, head_dim], post-RoPE
        loss_config: LossConfig | None = None,
        tv_loss_fn=tv_loss,
        gamma: float = 4.0,
        max_anchors: int = 512,
        per_position_loss_weight: str = "fixed-exp-decay",
        dpace_alpha: float = 0.5,
        **_: Any,
    ):
        """Training forward on one packed sequence (speculators' batch layout plus ``target_kv``,
        which ``vllm_hybridspec.train.target.TargetKV`` recomputes from ``hidden_states``).
        Returns ``(None, loss, metrics)`` as speculators' trainer expects."""
        if target_kv is None:
            raise ValueError(
                "the H-Spec training forward needs target_kv (the reused layers' K/V); build the "
                "data loader with vllm_hybridspec.train.target.AddTargetKV as its preprocess"
            )
        logits, targets, aligned_mask = self.anchored_logits(
            hidden_states,
            input_ids,
            loss_mask,
            verifier_last_hidden_states,
            document_ids,
            position_ids,
            target_kv,
            max_anchors,
        )
        return (
            None,
            *compute_metrics(
                logits,
                targets,
                None,
                aligned_mask,
                self.block_size,
                loss_config=loss_config or {"kl_div": (kl_div_loss, 1.0)},
                tv_loss_fn=tv_loss_fn,
                gamma=gamma,
                per_position_loss_weight=per_position_loss_weight,
                dpace_alpha=dpace_alpha,
                sample_from_anchor=False,
            ),
        )

    def anchored_logits(
        self,
        hidden_states,
        input_ids,
        loss_mask,
        verifier_last_hidden_states,
        document_ids,
        position_ids,
        target_kv,
        max_anchors: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drafter logits, target logits and loss mask for ``max_anchors`` blocks anchored at random
        response positions (speculators' ``select_anchors``). Each block is drafted exactly as
        :meth:`propose` drafts it for a request whose prefix is the document up to the anchor.
        Returns ``[1, N * L, draft_vocab]``, ``[1, N * L, draft_vocab]``, ``[1, N * L]``."""
        T, L, device = input_ids.shape[1], self.block_size, input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=device)[None]
        pos, docs = position_ids[0], document_ids[0]
        # an anchor needs a prefix in its own document (the last-token hidden state at anchor - 1)
        anchorable = loss_mask.bool() & (position_ids > 0) & (document_ids >= 0)
        anchors, anchor_valid = select_anchors(anchorable, max_anchors, L)  # [N], [N]
        N = anchors.shape[0]

        last_hidden = hidden_states[0, (anchors - 1).clamp(min=0)]  # [N, n_sel * hidden]
        state = self.initial_state(last_hidden)
        block_ids = torch.full((N, L), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = input_ids[0, anchors]
        block_pos = (pos[anchors][:, None] + torch.arange(L, device=device)).reshape(1, N * L)
        mask = anchored_block_mask(docs, pos, anchors, L, self.config.sliding_window)
        prefix_kv = [
            (target_kv[:, :, i, 0].transpose(1, 2), target_kv[:, :, i, 1].transpose(1, 2))
            for i in range(target_kv.shape[2])
        ]  # [1, kv_heads, T, head_dim] each
        hidden = self.block_forward(block_ids, block_pos, state, prefix_kv, mask)  # [N, L, hidden]

        logits = self.lm_head(self.norm(hidden))  # [N, L, draft_vocab]
        idx = get_base_indices_for_anchored_blocks(anchors, L).clamp(max=T - 1)  # [N*L], slot k -> token p+k
        block_tokens = input_ids[0, idx].view(N, L)
        if self.markov_head is not None:
            prev = torch.cat(
                [block_tokens[:, :1], block_tokens[:, :-1]], dim=1
            )  # teacher-forced previous token
            logits = logits + self.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden)
        with torch.no_grad():
            # slot k (k >= 1) is scored against the target's distribution for token p+k, computed at p+k-1
            targets = self.verifier_lm_head(self.verifier_norm(verifier_last_hidden_states[:, idx - 1]))
        same_doc = docs[idx].view(N, L) == docs[anchors][:, None]
        aligned = loss_mask[0, idx].view(N, L).float() * same_doc * anchor_valid[:, None]
        aligned[:, 0] = 0  # the anchor is the target's own token, not a draft
        return logits.reshape(1, N * L, -1), targets, aligned.reshape(1, N * L)
