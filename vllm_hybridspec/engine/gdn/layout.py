"""The spec rows of a batch as the one-slot GDN layer verifies them (one object per step and
KV-cache group, read from the GDN builder's metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
