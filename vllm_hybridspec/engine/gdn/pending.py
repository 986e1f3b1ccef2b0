"""Pending rounds of the one-slot GDN layer: the commit of a verified round happens at the request's
next forward (HybridSpec, accepted-state reconstruction, Eq. 7, applied lazily).

A one-slot layer verifies a round from the request's one stored state ``S_0`` and keeps the round's
compact factors ``(z, k, G)`` and pre-conv inputs in persistent per-request *slabs*. At the next
forward of the same request the layer first advances ``S_0`` by the round's committed count ``m``
(accepted drafts + 1) and then verifies the new round, in one kernel
(``kernels.gdn.gdn_commit_verify``). Nothing about a round is handed from the forward to the
sampler as a Python object, so every forward of the layer stands alone and can run inside a CUDA
graph.

This module is the host side of that scheme, one :class:`PendingRounds` per model runner:

* each request in the persistent batch owns a slab id ``q`` (``0..E-1``, ``E = max_num_seqs``; ``E``
  itself is the scratch slab of padding rows); its factors alternate between the two entries
  ``2q`` and ``2q + 1`` from round to round, so a round's kernel reads the pending entry and writes
  the other one (no two programs race on an entry);
* before every forward that runs the model (the wrapper of ``GPUModelRunner._prepare_inputs``) it
  decides from host data alone which batch rows the layers verify as rounds (the same rows vLLM's
  GDN builder classes as spec decodes, plus rows without drafts as one-token rounds when every
  such row is one), fills the step's plan (slab, pending entry and target entry per layout
  position) into device buffers with one copy, and commits ("flushes") the pending rounds of
  requests that this step does not verify (rows that take vLLM's own path, requests left out of the
  batch) with one commit per layer, outside any CUDA graph;
* after sampling (the runner's after-sampling hook) it stores each verified row's ``m`` in a device
  array indexed by slab, which the next round's kernel reads: no device->host read anywhere.

Finished and preempted requests drop their pending round (a preempted request's state is
recomputed from its tokens when it resumes; a finished one's slot goes to another request).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_hybridspec.engine.runner_state import existing_state, state_of, state_of_context

logger = logging.getLogger(__name__)

# plan rows, one int32 per layout position (spec rows, then one-token rows, then padding)
PLAN_SLAB, PLAN_PENDING, PLAN_TARGET = 0, 1, 2
# per batch row: the slab whose m the sampler's output sets, and whether m is fixed to 1
ROW_SLAB, ROW_SINGLE = 3, 4
# per layout position: the entry of m_of_slab its pending round's m is read from (the slab, or the
# always-zero entry E + 1 when nothing is pending), so pending_m is one gather
PLAN_M_SOURCE = 5
PLAN_ROWS = 6


@dataclass
class StepPlan:
    """What the layers of one step read on the host (the device side is in :class:`PendingRounds`).

    rows: the batch rows verified as rounds, in layout order (spec rows in batch order, then the
    one-token rows in batch order); num_spec: how many of them are spec rows; max_len: the longest
    round (the kernel's compile-time length ``U``)."""

    rows: list[int] = field(default_factory=list)
    num_spec: int = 0
    max_len: int = 0

    @property
    def num_single(self) -> int:
        return len(self.rows) - self.num_spec


@dataclass
class _Pending:
    half: int  # which entry of the request's slab holds the round: 2q + half
    slots: dict[int, int]  # KV-cache group -> the request's state slot when the round was verified


class PendingRounds:
    """Host bookkeeping and device buffers of the lazy commit, for one model runner's one-slot layers."""

    def __init__(self, max_num_seqs: int, max_num_reqs: int, slab_len: int, device: torch.device):
        # created at the first use, which may be inside vLLM's inference_mode (a dummy run): the buffers
        # must be ordinary tensors, updated in place by every step whatever the mode
        with torch.inference_mode(False):
            self._init(max_num_seqs, max_num_reqs, slab_len, device)

    def _init(self, max_num_seqs: int, max_num_reqs: int, slab_len: int, device) -> None:
        self.E = max_num_seqs
        self.S = slab_len
        self.device = torch.device(device)
        self.slab_of: dict[str, int] = {}
        self.last_half: dict[str, int] = {}  # request -> the half its last verified round went to
        self.pending: dict[str, _Pending] = {}
        self._free = list(range(self.E - 1, -1, -1))
        n = max(max_num_reqs, max_num_seqs)
        pin = self.device.type == "cuda"
        self._host = torch.zeros(PLAN_ROWS, n, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()  # the same memory: the plan is written without torch dispatch
        self._empty_np = np.empty_like(self._host_np)  # the empty plan (see _reset_plan)
        e = self._empty_np
        e[PLAN_SLAB], e[PLAN_PENDING], e[PLAN_TARGET] = self.E, -1, 2 * self.E
        e[ROW_SLAB], e[ROW_SINGLE], e[PLAN_M_SOURCE] = self.E, 0, self.E + 1
        self.plan_dev = torch.zeros(PLAN_ROWS, n, dtype=torch.int32, device=self.device)  # [6, n]
        # [E + 2]: m per slab (E: the scratch slab), and entry E + 1, which stays 0 (nothing pending)
        self.m_of_slab = torch.zeros(self.E + 2, dtype=torch.int32, device=self.device)
        self.pending_m = torch.zeros(n, dtype=torch.int32, device=self.device)  # [n] per layout position
        self.step = StepPlan()
        # for tests and logs: steps that verified rounds, those with one-token rounds and how many, rows
        # next to rounds that took vLLM's path, rounds committed outside a verification
        self.stats: Counter = Counter()
        self._reset_plan()

    # --- device views read by the layers ------------------------------------------------------------

    @property
    def slab(self) -> torch.Tensor:
        return self.plan_dev[PLAN_SLAB]

    @property
    def pending_entry(self) -> torch.Tensor:
        return self.plan_dev[PLAN_PENDING]

    @property
    def target_entry(self) -> torch.Tensor:
        return self.plan_dev[PLAN_TARGET]

    @property
    def dummy_slab(self) -> int:
        return self.E

    @property
    def num_entries(self) -> int:
        """Entries of every layer's factor slabs: two per slab id, the scratch slab's included."""
        return 2 * (self.E + 1)

    def _reset_plan(self) -> None:
        """Every layout position and row points at the scratch slab, nothing pending: what a forward
        that is not a served step (vLLM's dummy runs, graph captures) must see."""
        self._host_np[:] = self._empty_np
        self.plan_dev.copy_(self._host, non_blocking=True)
        self.pending_m.zero_()
        self._plan_is_empty = True  # every position on the scratch slab, nothing pending (plan skips rewriting it)
        self.step = StepPlan()

    # --- per step, on the host ----------------------------------------------------------------------

    def plan(self, req_ids: list[str], draft_counts: np.ndarray, num_scheduled: np.ndarray,
             num_computed: np.ndarray, slots: dict[int, np.ndarray], finished: set[str], dropped: set[str],
             flush) -> StepPlan:
        """The step's layout and device plan, and the flush of every pending round the step does not
        verify. ``req_ids``: the batch rows; ``draft_counts`` ``[N]``: vLLM's ``num_decode_draft_tokens``
        (-1: not a spec decode row); ``num_scheduled`` / ``num_computed`` ``[N]``: tokens this step and
        tokens computed before it; ``slots``: KV-cache group -> ``[N]`` state slot per row;
        ``finished`` / ``dropped``: requests whose pending round is discarded (finished, or preempted
        or resumed, whose state is recomputed); ``flush(entries, slots_by_group, slabs)``: commits
        rounds outside a verification."""
        for req_id in finished | dropped:
            self.pending.pop(req_id, None)
        layout = self._layout_rows(draft_counts, num_scheduled, num_computed)
        if layout.rows:
            self.stats["steps_with_rounds"] += 1
            self.stats["one_token_rows"] += layout.num_single
            self.stats["steps_with_one_token_rows"] += int(layout.num_single > 0)
            self.stats["rows_on_vllm_path"] += len(req_ids) - len(layout.rows)
        in_layout = {req_ids[r] for r in layout.rows}
        in_batch = set(req_ids)
        stale = [r for r in self.pending if r not in in_layout]
        if stale:
            self._flush(stale, flush)
        for req_id in list(self.slab_of):  # slabs of requests gone from the batch with nothing pending
            if req_id not in in_batch and req_id not in self.pending:
                self._free.append(self.slab_of.pop(req_id))
                self.last_half.pop(req_id, None)
        self.step = layout
        if not layout.rows and self._plan_is_empty:
            return layout  # the device holds the empty plan already: a step without rounds costs nothing
        # written through a numpy view of the (pinned) host buffer: no torch op per field
        h = self._host_np
        h[:] = self._empty_np
        for i, row in enumerate(layout.rows):
            req_id = req_ids[row]
            q = self._slab(req_id)
            pend = self.pending.pop(req_id, None)
            target = 1 - self.last_half.get(req_id, 1)
            h[PLAN_SLAB, i] = q
            if pend is not None:
                h[PLAN_PENDING, i] = 2 * q + pend.half
                h[PLAN_M_SOURCE, i] = q
            h[PLAN_TARGET, i] = 2 * q + target
            h[ROW_SLAB, row] = q
            h[ROW_SINGLE, row] = int(i >= layout.num_spec)
            self.last_half[req_id] = target
            self.pending[req_id] = _Pending(target, {g: int(s[row]) for g, s in slots.items()})
        self.plan_dev.copy_(self._host, non_blocking=True)
        # m of each position's pending round, on the device: the sampler of the step that verified it
        # wrote it into m_of_slab, which this step's kernels read (0 where nothing is pending)
        torch.index_select(self.m_of_slab, 0, self.plan_dev[PLAN_M_SOURCE], out=self.pending_m)
        self._plan_is_empty = not layout.rows
        return layout

    @property
    def quiet(self) -> bool:
        """Nothing pending and the empty plan on the device: a step without drafts needs no plan (the
        slabs of requests that left are freed at the next planned step, before any is handed out)."""
        return not self.pending and self._plan_is_empty

    def idle_step(self) -> None:
        """A step without drafts while :attr:`quiet`: what :meth:`plan` would leave, without its work."""
        self.step = StepPlan()

    def _layout_rows(self, draft_counts, num_scheduled, num_computed) -> StepPlan:
        """The rows vLLM's GDN builder classes as spec decodes (``draft_counts >= 0`` when the batch
        has at least one draft, ``GDNAttentionMetadataBuilder.build``), then, when every other row is
        a single token with a state to start from, those rows as one-token rounds; else the others
        take vLLM's path."""
        spec = np.flatnonzero(draft_counts >= 0)
        if spec.size == 0 or int(draft_counts[spec].sum()) == 0:
            return StepPlan()
        rows = spec.tolist()
        others = np.flatnonzero(draft_counts < 0)
        if others.size and bool((num_scheduled[others] == 1).all() and (num_computed[others] > 0).all()):
            rows += others.tolist()
        return StepPlan(rows=rows, num_spec=len(spec), max_len=int(num_scheduled[rows].max()))

    def _slab(self, req_id: str) -> int:
        q = self.slab_of.get(req_id)
        if q is None:
            if not self._free:
                raise RuntimeError(f"one-slot GDN layer: more than max_num_seqs = {self.E} requests hold "
                                   "pending rounds")
            q = self.slab_of[req_id] = self._free.pop()
        return q

    def _flush(self, req_ids: list[str], flush) -> None:
        """Commit the pending rounds of ``req_ids`` now: per KV-cache group, the entries, the slots the
        rounds were verified in and the slabs whose ``m`` the sampler wrote."""
        entries, slabs, slots_by_group = [], [], {}
        for req_id in req_ids:
            pend = self.pending.pop(req_id)
            q = self.slab_of[req_id]
            entries.append(2 * q + pend.half)
            slabs.append(q)
            for g, slot in pend.slots.items():
                slots_by_group.setdefault(g, []).append(slot)
        self.stats["flushed_rounds"] += len(entries)
        flush(entries, slots_by_group, slabs)

    # --- after sampling, on the device --------------------------------------------------------------

    def sampled(self, counts: torch.Tensor) -> None:
        """``counts`` ``[N]`` int32 on the device: the tokens each row of the step's output kept (accepted
        drafts + 1; vLLM's ``GPUModelRunner.num_accepted_tokens``, counted once per step): each verified
        row's ``m`` (a one-token round commits its token whatever the sampler did with it) into
        ``m_of_slab``. Rows without a round write the scratch slab."""
        n = counts.shape[0]
        if n == 0 or not self.step.rows:  # no round this step (a gated step, prefills): nothing to commit
            return
        m = torch.where(self.plan_dev[ROW_SINGLE, :n] > 0, 1, counts)
        self.m_of_slab.index_copy_(0, self.plan_dev[ROW_SLAB, :n].long(), m)

    def reset_step(self) -> None:
        """Before a forward that is not a served step (a dummy run or a capture)."""
        self._reset_plan()


def pending_rounds_of(context: dict) -> PendingRounds | None:
    """The :class:`PendingRounds` of the runner whose static forward context (the dict vLLM hands the
    layers as ``ForwardContext.no_compile_layers``) is ``context`` (``RunnerState.rounds``)."""
    state = state_of_context(context)
    return None if state is None else state.rounds


def attach(runner, rounds: PendingRounds) -> None:
    state_of(runner).rounds = rounds


def rounds_of(runner) -> PendingRounds | None:
    state = existing_state(runner)
    return None if state is None else state.rounds
