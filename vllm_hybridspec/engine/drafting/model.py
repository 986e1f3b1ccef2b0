"""The H-Spec drafter as a vLLM model (architecture ``HSpecDraftModel``).

The layers are the drafter package's own torch modules (``HSpecLayer``, ``StateInjection``, RoPE, the
DSpark Markov head), so the vLLM drafter computes exactly what training computed. What vLLM adds:

* one ``vllm.attention.Attention`` per drafter attention layer, created with
  ``kv_sharing_target_layer_name`` = the target layer it reads. vLLM then allocates no KV cache for
  it and binds the target layer's cache tensor to it (``layer.kv_cache``); the drafter only reads
  that tensor (``gather_prefix_kv``) and never calls the layer, so nothing is ever written to it.
* the target's embedding and LM head, bound by the proposer after loading (never copied).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from speculators.models.dspark.model_definitions import MarkovHead
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index

from vllm_hybridspec.drafter.attention import RotaryEmbedding
from vllm_hybridspec.drafter.config import HSpecSpeculatorConfig
from vllm_hybridspec.drafter.layers import DraftBlock, HSpecLayer, StateInjection
from vllm_hybridspec.drafter.mamba2 import GatedGroupRMSNorm, Mamba2Mixer
from vllm_hybridspec.engine.drafting.kv_cache import (
    all_kv_heads,
    block_size_of,
    gather_blocks,
    kv_halves_of,
    kv_heads_recoverable,
    paged_kv_views,
)
from vllm_hybridspec.kernels.markov import markov_heads, markov_heads_torch


def target_attention_layers(static_forward_context: dict) -> dict[int, str]:
    """Target decoder-layer index -> name of its full-attention ``Attention`` layer (no sliding
    window, own KV cache)."""
    layers = {}
    for name, module in static_forward_context.items():
        if (
            isinstance(module, Attention)
            and module.sliding_window is None
            and module.kv_sharing_target_layer_name is None
        ):
            layers[extract_layer_index(name)] = name
    return layers


class HSpecForVLLM(nn.Module):
    tp_size = 1  # the engine's tensor parallel size (set in __init__)
    fused_heads: bool | None = None  # the Markov-head kernel (draft_heads); None: on CUDA devices
    candidate_heads: int = 0  # the fused kernel through this many candidate previous tokens; 0: per position
    _compiled_layers = None  # the layers through torch.compile (compile_layers)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config = HSpecSpeculatorConfig.model_validate(hf_config.hspec_config)
        tl = config.transformer_layer_config
        g = config.attention_geometry
        n_attn = len(config.kv_reuse_layer_ids)
        self.layers = nn.ModuleList([HSpecLayer(config, with_attention=i < n_attn) for i in range(config.num_layers)])
        self.state_injection = StateInjection.for_config(config, self.layers[0].mamba.state_shape)
        self.rotary_emb = RotaryEmbedding(g.head_dim, g.rope_theta, g.partial_rotary_factor)
        self.norm = Qwen3RMSNorm(tl.hidden_size, eps=tl.rms_norm_eps)
        vocab = tl.vocab_size
        self.markov_head = (
            MarkovHead(verifier_vocab_size=vocab, draft_vocab_size=vocab, markov_rank=config.markov_rank,
                       hidden_size=tl.hidden_size)
            if config.markov_rank > 0
            else None
        )

        # KV sharing: one vLLM Attention per drafter attention layer, on the target layer's cache
        context = vllm_config.compilation_config.static_forward_context
        targets = target_attention_layers(context)
        missing = [i for i in config.kv_reuse_layer_ids if i not in targets]
        if missing:
            raise ValueError(
                f"kv_reuse_layer_ids {config.kv_reuse_layer_ids}: target layers {missing} have no "
                f"full-attention KV cache in vLLM; the target's are {sorted(targets)}"
            )
        self.target_layer_names = [targets[i] for i in config.kv_reuse_layer_ids]
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        first_free = vllm_config.model_config.hf_text_config.num_hidden_layers
        self.kv_readers = nn.ModuleList()
        for i, target_name in enumerate(self.target_layer_names):
            target = context[target_name]
            # under tensor parallelism each rank caches its shard of the KV heads (or, with fewer KV heads
            # than ranks, one replicated head); the drafter, replicated on every rank, reads all of them
            # through all_kv_heads
            total, tp = g.num_key_value_heads, self.tp_size
            if not kv_heads_recoverable(target.num_kv_heads, tp, total) or target.head_size != g.head_dim:
                raise ValueError(
                    f"drafter attention layer {i} reads {target_name} with {target.num_kv_heads} KV "
                    f"heads of size {target.head_size} per rank (tensor parallel size {tp}), but the "
                    f"drafter has {total} of size {g.head_dim}"
                )
            self.kv_readers.append(
                Attention(
                    num_heads=target.num_heads,
                    head_size=target.head_size,
                    scale=g.head_dim**-0.5,
                    num_kv_heads=target.num_kv_heads,
                    cache_config=vllm_config.cache_config,
                    prefix=f"hspec_draft.layers.{first_free + i}.attn",
                    kv_sharing_target_layer_name=target_name,
                )
            )
        # the target's, bound by HSpecProposer.load_model
        self.embed_tokens: nn.Module | None = None
        self.target_compute_logits = None
        # per-round constants (aranges, the block's causal mask, RoPE frequencies), made once per
        # device and key on first use; plain attributes, not buffers, so the state dict is unchanged
        self._constants: dict[tuple, torch.Tensor] = {}
        self._retired_constants: list[torch.Tensor] = []  # replaced constants graphs may still read
        # parameters kept in float32 by upcast_ssm_parameters: name -> the dtype they were loaded in
        self._upcast_dtypes: dict[str, torch.dtype] = {}

    # --- vLLM model interface (the proposer drives the drafter through `draft`) -----------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.target_compute_logits(hidden_states)

    def forward(self, *args, **kwargs):
        raise RuntimeError("HSpecForVLLM is driven by HSpecProposer.propose through draft()")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith(("verifier_", "embed_tokens.", "lm_head.")) or name in ("t2d", "d2t"):
                continue  # the target's, shared at load time
            if name not in params:
                raise ValueError(f"H-Spec checkpoint weight {name!r} has no counterpart in the vLLM drafter")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"H-Spec checkpoint weight {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(params[name].shape)}"
                )
            if name in self._upcast_dtypes:  # a reload after upcast_ssm_parameters: round as at load
                tensor = tensor.to(self._upcast_dtypes[name])
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded

    @torch.inference_mode(False)
    @torch.no_grad()
    def upcast_ssm_parameters(self) -> None:
        """Store the Mamba mixers' ``A_log``, ``D``, ``dt_bias`` and gated-norm weight in float32.

        The mixer reads each of them as float32 on every call (``A_log.to(float32)``, ``D.float()``,
        ``dt_bias.float()``, ``weight.to(float32)``): a conversion kernel per parameter, layer and
        round. Converting the loaded values once gives every round the same float32 numbers (the
        conversion from bfloat16 / float16 is exact), so drafts are unchanged. Call after the
        weights are loaded; ``load_weights`` rounds later reloads of these to the original dtype."""
        for name, param in self.named_parameters():
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            attr = name.rsplit(".", 1)[1]
            wanted = (isinstance(owner, Mamba2Mixer) and attr in ("A_log", "D", "dt_bias")) or (
                isinstance(owner, GatedGroupRMSNorm) and attr == "weight"
            )
            if not wanted or param.dtype not in (torch.bfloat16, torch.float16):
                continue
            self._upcast_dtypes[name] = param.dtype
            param.data = param.data.float()

    def _constant(self, key: tuple, device: torch.device, make) -> torch.Tensor:
        value = self._constants.get((*key, device))
        if value is None:
            value = self._constants[(*key, device)] = make()
        return value

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        """``torch.arange(n, device=device)`` (int64), a slice of one cached arange. A grown arange
        replaces the cached one, but the old tensor is kept alive: CUDA graphs captured earlier
        (``draft_graphs.py``) read its memory, which must never be handed to anything else."""
        have = self._constants.get(("arange", device))
        if have is None or have.shape[0] < n:
            if have is not None:
                self._retired_constants.append(have)
            have = self._constants["arange", device] = torch.arange(
                max(n, 2 * (have.shape[0] if have is not None else 0), 4096), device=device)
        return have[:n]

    # --- drafting --------------------------------------------------------------------------------------

    @staticmethod
    def _reader_caches(reader) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(kv_cache, k_cache, v_cache)`` of a KV reader (the K/V views ``[num_blocks, kv_heads,
        block_size, D]``), or ``None`` before vLLM has bound a cache to it (profiling)."""
        kv_cache = reader.kv_cache
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0:
            return None
        k_cache, v_cache = paged_kv_views(
            kv_cache, reader.get_attn_backend().get_name(), reader.head_size, getattr(reader.impl, "isa", None))
        return kv_cache, k_cache, v_cache

    def prefix_block_size(self) -> int | None:
        """The smallest KV block size among the target caches the drafter reads (how far a block
        table reaches), or ``None`` before vLLM has bound them (profiling)."""
        caches = [self._reader_caches(reader) for reader in self.kv_readers]
        if not caches or any(c is None for c in caches):
            return None
        return min(block_size_of(k_cache) for _, k_cache, _ in caches)

    def gather_prefix_kv(
        self, block_table: torch.Tensor, capacity: int, prefix_lens: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per drafter attention layer, the target's cached K/V of slots ``[0, capacity)`` of each
        request, ``[N, kv_heads, capacity, head_dim]`` each, read through ``block_table`` ``[N, >=
        ceil(capacity / block_size)]``. A transient read; nothing is kept or written.

        With ``prefix_lens`` ``[N]``, slots at or past each request's prefix are zeroed. The drafter's
        mask excludes them, but the mask is additive: a non-finite value there (the bytes of a block
        slot no request wrote, which vLLM's hybrid allocator may share with float32 GDN state pages)
        would still turn the row's attention into NaN."""
        out = []
        N = block_table.shape[0]
        blocks = {}  # block size -> [N, n_blocks] long, shared by the layers
        stale = None
        if prefix_lens is not None:  # [N, 1, capacity, 1]
            stale = self._arange(capacity, block_table.device)[None, None, :, None] >= prefix_lens.long()[:, None, None, None]
        for reader in self.kv_readers:
            caches = self._reader_caches(reader)
            if caches is None:  # profiling: no cache yet
                g = self.config.attention_geometry
                empty = torch.zeros(N, g.num_key_value_heads, capacity, g.head_dim,
                                    dtype=self.norm.weight.dtype, device=block_table.device)
                out.append((empty, empty))
                continue
            kv_cache, k_cache, v_cache = caches
            block_size = block_size_of(k_cache)
            if block_size not in blocks:
                blocks[block_size] = block_table[:, : -(-capacity // block_size)].long()  # [N, n_blocks]
            heads = self._arange(k_cache.shape[1], block_table.device)
            total = self.config.attention_geometry.num_key_value_heads
            if kv_halves_of(kv_cache, k_cache, v_cache):
                kv = gather_blocks(kv_cache, blocks[block_size], heads, capacity)  # one read for K and V
                D = k_cache.shape[-1]
                kv = all_kv_heads(kv, self.tp_size, total)
                if stale is not None:
                    kv = kv.masked_fill(stale, 0)
                out.append((kv[..., :D], kv[..., D:]))
            else:
                k, v = (all_kv_heads(gather_blocks(c, blocks[block_size], heads, capacity), self.tp_size, total)
                        for c in (k_cache, v_cache))
                if stale is not None:
                    k, v = k.masked_fill(stale, 0), v.masked_fill(stale, 0)
                out.append((k, v))
        return out

    @torch.inference_mode()
    def draft(
        self,
        last_hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
        prefix_lens: torch.Tensor,
        num_draft: int,
    ) -> DraftBlock:
        """One block per request (``HSpecDraftModel.propose`` with vLLM's embedding and LM head):
        ``last_hidden`` ``[N, n_sel * hidden]``, ``anchor_ids`` ``[N]``, ``prefix_lens`` ``[N]``;
        drafts ``num_draft <= block_size - 1`` tokens."""
        N, L = anchor_ids.shape[0], num_draft + 1
        device = anchor_ids.device
        capacity = prefix_kv[0][0].shape[2] if prefix_kv else 0
        prefix_lens = prefix_lens.long()
        positions = prefix_lens[:, None] + self._arange(L, device)  # [N, L]
        mask_ids = self._constant(("mask_ids", L - 1), device, lambda: torch.full(
            (1, L - 1), self.config.mask_token_id, dtype=torch.long, device=device))
        block_ids = torch.cat([anchor_ids[:, None], mask_ids.expand(N, -1)], dim=1)  # [N, L] long
        mask = self._block_mask(prefix_lens, positions, capacity, L)
        state = self.state_injection(last_hidden)  # [N, H, P, S] fp32
        hidden = self.embed_tokens(block_ids)  # [N, L, hidden]
        cos, sin = self._rope(positions, hidden.dtype)
        hidden = self.layer_stack(hidden, state, cos, sin, prefix_kv, mask)
        return self.draft_heads(hidden, anchor_ids)

    def layers_forward(self, hidden: torch.Tensor, state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """The block through the drafter's layers: ``hidden`` ``[N, L, hidden]`` -> ``[N, L, hidden]``."""
        kv = iter(prefix_kv)
        for layer in self.layers:
            hidden = layer(hidden, state, cos, sin, next(kv) if layer.self_attn is not None else None, mask)
        return hidden

    @property
    def layer_stack(self):
        """:meth:`layers_forward`, or its torch.compile'd form after :meth:`compile_layers`."""
        return self._compiled_layers or self.layers_forward

    def compile_layers(self) -> None:
        """Run the layers through torch.compile (Inductor), shapes dynamic: each layer's few hundred
        small operators (norms, dtype conversions, gates, the block's SSD scan in its torch form, masks)
        become a few fused kernels, where eager execution is bound by their launches (4 layers of the
        35B-shape drafter: 1.18 ms at one request, their weights 0.1 ms to read,
        ``docs/benchmarks/h200-2026-12-04b``). The compiled kernels are captured in the round's CUDA
        graphs like the eager ones."""
        for layer in self.layers:
            layer.mamba.use_kernel = False
        self._compiled_layers = torch.compile(self.layers_forward, dynamic=True)

    def _block_mask(self, prefix_lens: torch.Tensor, positions: torch.Tensor, capacity: int, L: int) -> torch.Tensor:
        """``request_block_mask(prefix_lens, capacity, L, sliding_window)`` from cached constants, with
        ``positions`` = its query positions ``prefix_lens[:, None] + arange(L)``. The window term is
        left out when it cannot mask anything: every prefix key ``s < prefix_len <= capacity`` lies
        less than ``capacity + L - 1 < window`` positions before any query."""
        device = prefix_lens.device
        window = self.config.sliding_window
        kv_pos = self._arange(capacity, device)  # [T]
        prefix = kv_pos[None, None, :] < prefix_lens[:, None, None]  # [N, 1, T]
        if window is not None and capacity + L > window:
            prefix = prefix & (kv_pos[None, None, :] > positions[:, :, None] - window)  # [N, L, T]
        block = self._constant(("tril", L), device,
                               lambda: torch.ones(L, L, dtype=torch.bool, device=device).tril())
        N = prefix_lens.shape[0]
        return torch.cat([prefix.expand(-1, L, -1), block.expand(N, -1, -1)], dim=-1)[:, None]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``self.rotary_emb(positions, dtype)`` with the inverse frequencies computed once (by the
        same expression on the same device, so the same numbers)."""
        rope = self.rotary_emb
        device = positions.device
        inv_freq = self._constant(("inv_freq",), device, lambda: 1.0 / (rope.theta ** (
            torch.arange(0, rope.rotary_dim, 2, dtype=torch.float, device=device) / rope.rotary_dim)))
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def draft_heads(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> DraftBlock:
        """``HSpecDraftModel.draft_heads`` with the target's LM head: greedy tokens, top-1 probability
        and entropy per draft position, fp32, all on device.

        On CUDA (or with ``fused_heads`` set) the Markov head runs as one kernel per position over the
        LM head's logits in their own dtype (``kernels.markov.markov_heads``: the bias accumulated in
        fp32, the softmax statistics in one pass); elsewhere as torch ops per position
        (``kernels.markov.markov_heads_torch``). ``candidate_heads = M > 0`` (opt-in) runs the kernel
        with ``candidates = M``: one pass over ``W2`` for every position, the same outputs."""
        N, L, d = hidden.shape
        logits = self.compute_logits(self.norm(hidden[:, 1:]).reshape(-1, d)).view(N, L - 1, -1)
        mh = self.markov_head
        weights = (mh.markov_w1.weight, mh.markov_w2.weight) if mh is not None else ()
        fused = self.fused_heads if self.fused_heads is not None else hidden.is_cuda
        if fused:
            heads = markov_heads(logits, anchor_ids, *weights, candidates=self.candidate_heads)
        else:
            heads = markov_heads_torch(logits, anchor_ids, *weights)
        return DraftBlock(heads.tokens, heads.top1_prob, heads.entropy)
