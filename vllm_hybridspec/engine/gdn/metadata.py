"""The GDN attention metadata of the one-slot layer's steady state, built once per step.

vLLM 0.26's ``GDNAttentionMetadataBuilder.build`` runs once per GDN KV-cache group every step (its
builder does not support ``update_block_table`` under spec decoding), and a spec-decode batch takes
its general path: boolean masks over the rows, a dozen reductions read back with ``item()``, masked
gathers, a host-to-device copy of the mask, and the copies into the builder's full-graph buffers.
At the reference hybrid that is about 36 torch calls per group and three groups per step, a tenth of
a spec step's host work outside the forward.

:class:`OneSlotGDNMetadataBuilder` returns the same metadata for the batches a spec step serves
almost always, every row verifying drafts (rows with drafts first, padding rows after), from slices
and the rows' counts read as numpy, and it computes the parts that do not depend on the group's block
table (the rows' token offsets, accepted counts, masks and token indices) once per step for all
groups: their full-graph buffers are shared by the groups' builders, since their values are the same
for every group. Any other batch (prefills, rows without drafts, plain decoding, a batch larger than
the graph buffers) goes to vLLM's ``build``. ``tests/engine/gdn/test_metadata.py`` checks the
metadata field by field against vLLM's on random batches.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, mamba_get_block_table_tensor

# the builder buffers whose values do not depend on the group's block table, shared per engine and device
SHARED_BUFFERS = ("spec_sequence_masks", "spec_token_indx", "non_spec_token_indx", "spec_query_start_loc",
                  "num_accepted_tokens")
_SHARED: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


class _StepParts:
    """What one step's spec batch gives every group alike (the first group's build makes it)."""

    __slots__ = ("query_start_loc", "counts", "num_rows", "num_spec", "spec_tokens", "full_graph",
                 "spec_query_start_loc", "spec_sequence_masks", "spec_token_indx", "non_spec_token_indx",
                 "num_accepted_tokens")


class OneSlotGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    """``GDNAttentionMetadataBuilder`` whose pure spec-decode batches take the short path of the module
    docstring; every other batch is vLLM's ``build``."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        key = (str(getattr(vllm_config, "instance_id", id(vllm_config))), str(device))
        shared = _SHARED.get(key)
        if shared is None:
            shared = _SHARED[key] = {name: getattr(self, name) for name in SHARED_BUFFERS}
            # the values vLLM's build copies into its first entries every spec step, whatever the length
            torch.arange(self.spec_token_indx.shape[0], out=self.spec_token_indx)
            weakref.finalize(self, _SHARED.pop, key, None)
        for name in SHARED_BUFFERS:
            setattr(self, name, shared[name])
        self._shared = shared  # the buffers and the latest step's parts ("step"), as the first group built them
        self.fast_builds = 0  # pure spec batches built on the short path

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False) -> GDNAttentionMetadata:
        parts = None
        if self.use_spec_decode and num_decode_draft_tokens_cpu is not None and num_accepted_tokens is not None:
            parts = self._step_parts(common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu)
        if parts is None:
            return super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                                 num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
        self.fast_builds += 1
        m = common_attn_metadata
        block_table = mamba_get_block_table_tensor(m.block_table_tensor, m.seq_lens, self.kv_cache_spec,
                                                   self.vllm_config.cache_config.mamba_cache_mode)
        n = parts.num_spec
        state_indices = block_table[:n, : self.num_spec + 1]
        if parts.full_graph:
            buffer = self.spec_state_indices_tensor
            buffer[:n].copy_(state_indices, non_blocking=True)
            state_indices = buffer[: parts.num_rows]
            state_indices[n:].fill_(NULL_BLOCK_ID)
        return GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=n,
            num_spec_decode_tokens=parts.spec_tokens, num_actual_tokens=m.num_actual_tokens,
            spec_query_start_loc=parts.spec_query_start_loc, spec_state_indices_tensor=state_indices,
            spec_sequence_masks=parts.spec_sequence_masks, spec_token_indx=parts.spec_token_indx,
            non_spec_token_indx=parts.non_spec_token_indx, num_accepted_tokens=parts.num_accepted_tokens)

    def _step_parts(self, m, num_accepted_tokens, counts_cpu) -> _StepParts | None:
        """The group-independent parts of a pure spec batch (every row with drafts first, only
        zero-token padding rows after them), made once per step: later groups of the same step find
        them by the step's ``query_start_loc`` (one tensor object per step, shared by the groups'
        metadata). ``None`` for any other batch."""
        step = self._step_of_other_group(m, counts_cpu)
        if step is not None:
            return step
        counts = counts_cpu.numpy()
        spec = counts >= 0
        n = int(spec.sum())
        rows = m.num_reqs
        if n == 0 or not spec[:n].all() or rows != counts.shape[0] or counts[:n].sum() == 0:
            return None  # vLLM reads a batch whose rows have no draft at all as plain decoding
        qsl_cpu = m.query_start_loc_cpu.numpy()
        if qsl_cpu[0] != 0 or (qsl_cpu[n + 1:] != qsl_cpu[n]).any():
            return None  # a row past the spec rows with tokens: prefills or decodes, vLLM's general path
        tokens = int(qsl_cpu[n])
        if tokens > self.spec_token_indx.shape[0]:
            return None
        parts = _StepParts()
        parts.query_start_loc, parts.counts = m.query_start_loc, counts_cpu
        parts.num_rows, parts.num_spec, parts.spec_tokens = rows, n, tokens
        # vLLM's spec_token_size: at most (K + 1) tokens per spec row
        size = min(n * (self.num_spec + 1), tokens)
        parts.full_graph = bool(self.use_full_cuda_graph and n <= self.decode_cudagraph_max_bs
                                and tokens <= self.decode_cudagraph_max_bs)
        qsl = m.query_start_loc[: n + 1]
        accepted = num_accepted_tokens[:n]
        if parts.full_graph:
            masks = self.spec_sequence_masks[:rows]
            masks[:n].fill_(True)
            masks[n:].fill_(False)
            parts.spec_sequence_masks = masks
            parts.spec_token_indx = self.spec_token_indx[:size]
            parts.non_spec_token_indx = self.non_spec_token_indx[:0]
            self.spec_query_start_loc[: n + 1].copy_(qsl, non_blocking=True)
            parts.spec_query_start_loc = self.spec_query_start_loc[: rows + 1]
            parts.spec_query_start_loc[n + 1:].fill_(tokens)
            self.num_accepted_tokens[:n].copy_(accepted, non_blocking=True)
            parts.num_accepted_tokens = self.num_accepted_tokens[:rows]
            parts.num_accepted_tokens[n:].fill_(1)
        else:
            device = m.query_start_loc.device
            parts.spec_sequence_masks = torch.from_numpy(spec).to(device, non_blocking=True)
            parts.spec_token_indx = torch.arange(size, dtype=torch.int32, device=device)
            parts.non_spec_token_indx = torch.empty(0, dtype=torch.int32, device=device)
            parts.spec_query_start_loc, parts.num_accepted_tokens = qsl, accepted
        self._shared["step"] = parts
        return parts

    def _step_of_other_group(self, m, counts_cpu) -> _StepParts | None:
        """The parts another group's builder made for this same step, if any: same ``query_start_loc``
        object (one per step; the parts hold it, so its id is not reused while they live), same rows'
        counts."""
        step = self._shared.get("step")
        if step is None or step.query_start_loc is not m.query_start_loc or step.num_rows != m.num_reqs:
            return None
        if not np.array_equal(step.counts.numpy(), counts_cpu.numpy()):
            return None
        return step


class OneSlotGDNBackend(GDNAttentionBackend):
    """vLLM's GDN attention backend with :class:`OneSlotGDNMetadataBuilder` (the one-slot layer's)."""

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return OneSlotGDNMetadataBuilder
