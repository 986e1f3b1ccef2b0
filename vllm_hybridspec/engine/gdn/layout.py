"""The rounds one forward of the one-slot GDN layers verifies, for one KV-cache group: built once per
step and group from the GDN builder's device tensors and the step's plan (``pending.py``), then read
by every layer of the group. Nothing here reads a device tensor on the host, so the same code runs
inside a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hybridspec.engine.gdn.pending import PendingRounds


@dataclass(eq=False)  # identity: the fields hold tensors
class StepLayout:
    """Layout position ``i`` is one round: the spec rows in batch order, then (``num_single > 0``) the
    rows without drafts as one-token rounds, then, in padded full-graph batches, padding rounds
    (slot 0, no tokens). ``n`` positions; ``max_len`` the kernel's round length ``U``.

    slots ``[n]`` int32 and cu ``[n + 1]`` int32: each round's state slot and token offsets;
    token_index ``[T]`` (or ``None``: the layout's tokens are the batch's first ``T``): the batch
    tokens of the rounds in layout order; slab, pending_entry, target_entry, pending_m ``[n]`` int32:
    the step's plan (views of :class:`PendingRounds`' buffers); slab_rows ``[T]`` int64: the row of
    each token's pre-conv input in the layers' input slabs (the scratch slab for tokens of no round)."""

    n: int
    num_spec: int
    num_single: int
    max_len: int
    num_tokens: int
    slots: torch.Tensor
    cu: torch.Tensor
    token_index: torch.Tensor | None
    slab: torch.Tensor
    pending_entry: torch.Tensor
    target_entry: torch.Tensor
    pending_m: torch.Tensor
    slab_rows: torch.Tensor

    @classmethod
    def build(cls, md, rounds: PendingRounds) -> StepLayout:
        step = rounds.step
        mixed = md.num_prefills > 0 or md.num_decodes > 0
        n_spec = md.num_spec_decodes
        if step.rows and step.num_spec != n_spec:
            raise RuntimeError(f"one-slot GDN layer: the step's plan has {step.num_spec} spec rows but vLLM's GDN "
                               f"builder found {n_spec}; the two classifications must agree (vLLM changed?)")
        single = step.num_single if step.rows else 0
        if single and not (md.num_prefills == single and md.num_prefill_tokens == single and md.num_decodes == 0):
            raise RuntimeError(f"one-slot GDN layer: the plan verifies {single} rows without drafts as one-token "
                               f"rounds, but vLLM's GDN builder has {md.num_prefills} prefill rows with "
                               f"{md.num_prefill_tokens} tokens")
        spec_slots = md.spec_state_indices_tensor[:, 0]
        if not mixed:
            # a pure spec batch, padded in full CUDA graphs: every position of the builder's buffers
            n, slots, cu = spec_slots.shape[0], spec_slots, md.spec_query_start_loc
            num_tokens, token_index = md.num_spec_decode_tokens, None
        else:
            spec_tokens = md.num_spec_decode_tokens
            n = n_spec + single
            slots, cu = spec_slots[:n_spec], md.spec_query_start_loc[: n_spec + 1]
            token_index = md.spec_token_indx[:spec_tokens]
            num_tokens = spec_tokens + single
            if single:
                slots = torch.cat([slots, md.non_spec_state_indices_tensor[:single]])
                cu = torch.cat([cu, cu[-1:] + md.non_spec_query_start_loc[1: single + 1]])
                token_index = torch.cat([token_index, md.non_spec_token_indx[:single]])
        if step.rows:
            max_len = step.max_len
        else:  # a dummy run or a graph capture: uniform rounds
            max_len = max(1, num_tokens // max(n_spec, 1))
        slab_rows = _slab_rows(cu, rounds.slab[:n], n, num_tokens, rounds.S, rounds.dummy_slab)
        return cls(n=n, num_spec=n_spec, num_single=single, max_len=max_len, num_tokens=num_tokens,
                   # column 0 of the builder's [batch, K + 1] slot table is a strided view; the kernels
                   # index slots and offsets as contiguous int32
                   slots=slots.to(torch.int32).contiguous(), cu=cu.to(torch.int32).contiguous(),
                   token_index=token_index,
                   slab=rounds.slab[:n], pending_entry=rounds.pending_entry[:n], target_entry=rounds.target_entry[:n],
                   pending_m=rounds.pending_m[:n], slab_rows=slab_rows)


def _slab_rows(cu: torch.Tensor, slab: torch.Tensor, n: int, num_tokens: int, slab_len: int,
               dummy_slab: int) -> torch.Tensor:
    """``[T]`` int64: token ``t`` of round ``i`` (offset ``r`` in it) -> row ``slab[i] * S + r``; tokens past
    the last round's end (padding of a full-graph batch) -> rows of the scratch slab."""
    t = torch.arange(num_tokens, device=cu.device)
    cu = cu.long()
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_(max=n - 1)  # [T]
    r = t - cu[seq]
    live = t < cu[-1]
    return torch.where(live, slab.long()[seq] * slab_len + r, dummy_slab * slab_len + t % slab_len)


# step_layout's cache: id(metadata) -> (metadata, its StepLayout). The entry holds the metadata object,
# so its id cannot be reused by the next step's metadata while the entry lives.
_layouts: dict[int, tuple[object, StepLayout]] = {}
_MAX_CACHED_LAYOUTS = 8


def step_layout(md, rounds: PendingRounds) -> StepLayout:
    """:meth:`StepLayout.build` once per metadata object. vLLM's runner builds a new
    ``GDNAttentionMetadata`` per KV-cache group every step and hands the same object to every layer
    of the group, so a hit means the same step and group; the layers of a group run one after the
    other, so the first one builds and the others reuse (in a captured graph: the first layer's
    captured operations compute it at every replay)."""
    hit = _layouts.get(id(md))
    if hit is not None and hit[0] is md:
        return hit[1]
    if len(_layouts) >= _MAX_CACHED_LAYOUTS:
        _layouts.clear()
    layout = StepLayout.build(md, rounds)
    _layouts[id(md)] = (md, layout)
    return layout
