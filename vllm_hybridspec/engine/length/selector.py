"""Verifier-side length selection inside vLLM's V1 runner (HybridSpec, throughput-aware verification).

After each drafting round the proposer hands the draft's per-token top-1 probability and entropy
``[N, K]`` to :class:`LengthSelector`, which picks on device how many of each request's ``K`` drafts
the target verifies next step (``w - 1`` for the policy's length ``w``; ``w = 1`` verifies none),
capped by the request's remaining output budget. The lengths stay on the device: vLLM schedules every
draft and the step verifies the selected prefix of each (``cut.py``), so nothing waits for them on the
host. They depend only on the drafter's outputs, never on the target's sampling, so greedy output and
the sampling distribution are unchanged.

The batch gate turns drafting off for a whole step when the policy's gate table says plain decoding
is faster at this batch size: no drafter forward, every count 0, known on the host. vLLM's scheduler
applies the same table where it can (``gate.py``), so the step schedules no draft; elsewhere
``trimming.py`` takes the drafts out of what vLLM schedules, without waiting for anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hybridspec.engine.compat import broadcast_from_tp_rank0
from vllm_hybridspec.engine.options import HybridSpecOptions
from vllm_hybridspec.policy.policy_file import Policy
from vllm_hybridspec.policy.selector import select_shared_length


@dataclass(frozen=True, eq=False)  # the fields hold tensors
class RoundLayout:
    """What a drafting round decided for the step that verifies it, made once by the selector
    (:meth:`LengthSelector.select`, :meth:`LengthSelector.gated`), held by the runner's state
    (``RunnerState.round``, set by the proposer) and read by the runner patches: ``drafts`` ``[N, K]`` (the
    tensor the proposer hands vLLM), ``w`` ``[N]`` int32 on the device (tokens each row verifies, the first
    included; ``None`` when every draft is verified or the step is gated), ``rows`` (request id -> row of
    ``drafts``), ``expand`` ``[N, topk + 1]`` bool (the routing correction's table, or ``None``) and
    ``gated`` (the batch gate turned the step off on the host: its drafts are verified nowhere)."""

    drafts: torch.Tensor
    w: torch.Tensor | None = None
    rows: dict[str, int] | None = None
    expand: torch.Tensor | None = None
    gated: bool = False

    @property
    def selected(self) -> bool:
        """Whether the step verifying this round verifies the selected prefix of each row (``cut.py``)."""
        return self.w is not None

    @property
    def gated_with_drafts(self) -> bool:
        """Whether a gated round has drafts to take out of what vLLM schedules (``trimming.py``; a step
        the scheduler itself gated has none)."""
        return self.gated and self.drafts.shape[1] > 0


class LengthSelector:
    def __init__(self, options: HybridSpecOptions, num_speculative_tokens: int, device: torch.device,
                 max_num_reqs: int, verifies_every_draft: bool = False):
        self.engine_options = options  # as the engine started: configure's defaults
        # the target's GDN layers run vLLM's own spec path, which is not exact with trimmed lengths
        # (engine.gdn.enable.on_vllm_gdn_path): configure refuses them
        self.verifies_every_draft = verifies_every_draft
        self.k = num_speculative_tokens
        self.device = device
        self.drafting = True  # False: every step runs without drafts (configure(drafting=False))
        self._apply(options)
        # rows verified at each length w (index w = 1..K+1) since the engine started, on device
        self.length_counts = torch.zeros(self.k + 2, dtype=torch.int64, device=device)
        self.steps = 0
        self.gated_steps = 0
        self.on_configure = None  # called with the selector after configure (gate.sync_scheduler)
        self.stage0_ready = False  # the step's cut runs Stage 0 (set with StepCut.enable_routing at engine start)
        self._ones = torch.ones(max_num_reqs, dtype=torch.int64, device=device)  # index_add_ sources
        self._no_drafts: dict[int, torch.Tensor] = {}  # n -> an [n, 0] drafts tensor (no_drafts)

    def _apply(self, options: HybridSpecOptions) -> None:
        policy = Policy.load(options.policy, self.device) if options.policy else None  # may raise: nothing set yet
        self.options, self.policy = options, policy
        self.trims = bool(options.select or options.fixed_length is not None)
        # HybridSpec's routing correction: per-request selection with a policy that has routing tables
        self.routes = bool(options.select and not options.batched and options.routing is not False
                           and policy is not None and policy.routing is not None)
        self.gates = bool(options.gate and self.policy is not None and (self.policy.gate or self.policy.speedup))

    def configure(self, *, fixed_length: int | None = None, policy: str | None = None,
                  gate: bool | None = None, batched: bool | None = None, drafting: bool = True,
                  trim: bool = True) -> None:
        """Switch a running engine's selector between measurements (``calibrate costs``,
        ``evaluate.py``): verify exactly ``fixed_length`` tokens per request; or select lengths with
        the policy file ``policy`` (with its batch gate unless ``gate`` is false, and its shared-length
        variant when ``batched``; ``None`` takes the engine's ``"hybridspec"`` setting); or, with
        ``drafting=False``, run every step without drafts (what the batch gate does for a step, i.e.
        vLLM's plain decode path). No length verifies everything, through the selector (each row cut
        to its remaining budget, the counts read on the host before the next step); ``trim=False``
        verifies everything without the selector (vLLM's own scheduling of every draft: no counts,
        nothing read on the host, the engine as without ``"hybridspec"`` options). Raises
        ``ValueError`` naming a bad value, as the ``"hybridspec"`` options do at engine start, and
        then leaves the selector as it was."""
        if fixed_length is not None and policy is not None:
            raise ValueError("configure: give fixed_length or policy, not both")
        if not trim and (fixed_length is not None or policy is not None):
            raise ValueError("configure: trim=False verifies every draft without the selector; give no "
                             "fixed_length or policy with it")
        start = self.engine_options
        raw = {**start.model_dump(), "fixed_length": fixed_length, "policy": policy, "select": policy is not None,
               "gate": start.gate if gate is None else gate,
               "batched": policy is not None and (start.batched if batched is None else batched)}
        if fixed_length is None and policy is None and trim:
            raw["fixed_length"] = self.k + 1  # verify everything
        options = HybridSpecOptions.model_validate(raw)
        options.check(self.k)
        if self.verifies_every_draft and (options.select or (options.fixed_length or self.k + 1) < self.k + 1):
            raise ValueError(f"configure: fixed_length={fixed_length}, policy={policy!r} verifies fewer tokens than "
                             "were drafted, and this target's GDN layers run vLLM's own spec-decode path, which is "
                             'not exact then (start the engine with the one-slot GDN layer, "gdn_kernel": true)')
        self._apply(options)
        self.drafting = drafting
        if self.on_configure is not None:
            self.on_configure(self)

    @property
    def active(self) -> bool:
        return self.trims or self.gates or not self.drafting

    # --- per round, called by the proposer --------------------------------------------------------

    def speculate(self, batch: int) -> bool:
        """The batch gate (a host decision of the batch size, identical on every TP rank)."""
        if not self.drafting:
            return False
        return not self.gates or self.policy.speculate(batch)

    def gated(self, drafts: torch.Tensor) -> RoundLayout:
        """A step the gate turned off: ``drafts`` [N, K] is verified nowhere."""
        self.steps += 1
        self.gated_steps += 1
        return RoundLayout(drafts, gated=True)

    def no_drafts(self, n: int, device) -> torch.Tensor:
        """An ``[n, 0]`` int64 drafts tensor (a step that drafts nothing), made once per ``n``: it holds
        no element, so the same object serves every such step."""
        empty = self._no_drafts.get(n)
        if empty is None:
            empty = self._no_drafts[n] = torch.empty(n, 0, dtype=torch.int64, device=device)
        return empty

    def select(self, drafts: torch.Tensor, top1_prob: torch.Tensor, entropy: torch.Tensor,
               w_rem: torch.Tensor, req_ids: list[str]) -> RoundLayout:
        """drafts, top1_prob, entropy: [N, K] (input-batch rows); w_rem: [N] int64, the most tokens
        a round may still produce for each request (>= 1); ``req_ids``: the requests of the ``N`` rows.
        Returns the round's :class:`RoundLayout`, its ``w`` [N] int32 the selected lengths (tokens to
        verify per row, the first included) on the device (nothing is copied to the host)."""
        n, k = drafts.shape
        self.steps += 1
        expand = None
        if self.options.fixed_length is not None:
            w = w_rem.clamp(max=self.options.fixed_length)  # min(fixed_length, w_rem), one kernel
        elif not self.options.select or k != self.policy.draft_len:
            # gate only (or a step vLLM asked for fewer than K drafts): verify everything
            w = torch.full_like(w_rem, k + 1)
        elif self.options.batched:
            p, _, _ = self.policy.draft_side(top1_prob.float(), entropy.float(), w_rem)
            c = self.policy.batched_cost(n)
            shared = select_shared_length(p, c.candidates, c.cost, c.rate, w_rem)
            w = torch.minimum(shared.expand(n), w_rem)
        else:
            p, w0, u = self.policy.draft_side(top1_prob.float(), entropy.float(), w_rem)
            w = torch.minimum(w0, w_rem)
            if self.routes and self.stage0_ready:  # Stage 0 at the first MoE router decides d_{w0} (cut.py)
                expand = self.policy.expansion_table(p, w0, u)
        w = w.to(torch.int32)  # [N]
        if self.options.tp_broadcast:
            w = broadcast_from_tp_rank0(w)
            if expand is not None:  # as bytes: not every collective backend broadcasts bool tensors
                expand = broadcast_from_tp_rank0(expand.to(torch.uint8)).bool()
        self.length_counts.index_add_(0, w, self._ones[:n])  # length_counts[w] += 1
        return RoundLayout(drafts, w, {r: i for i, r in enumerate(req_ids[:n])}, expand)

    def stats(self) -> dict[str, object]:
        """Counters for tests and logs: rows verified at each length ``w``, steps, gated steps."""
        counts = self.length_counts.tolist()
        return {"rows_at_length": {w: c for w, c in enumerate(counts) if w >= 1 and c},
                "steps": self.steps, "gated_steps": self.gated_steps}


def draft_signals(logits: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 probability and entropy of each row of draft ``logits`` [R, vocab] (float32 maths,
    in row chunks: [R, vocab] fp32 softmax is GBs at R = 256 * 15): ``top1 = exp(max - lse)``,
    ``entropy = lse - sum softmax * logits``. Returns two [R] float32 tensors."""
    top1 = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(top1)
    for start in range(0, logits.shape[0], rows_per_chunk):
        x = logits[start:start + rows_per_chunk].float()
        lse = torch.logsumexp(x, dim=-1)
        top1[start:start + rows_per_chunk] = torch.exp(x.max(dim=-1).values - lse)
        ent[start:start + rows_per_chunk] = lse - (torch.softmax(x, dim=-1) * x).sum(dim=-1)
    return top1, ent


def remaining_budget(runner, prefix_lens: torch.Tensor, k: int, cache: "BudgetCache | None" = None) -> torch.Tensor:
    """``w_rem`` [N] int64: the tokens each request may still emit after the anchor, as a round
    length cap in ``1..K+1`` (a round of length ``w`` emits at most ``w`` tokens).

    ``budget_end`` = prompt + min(max_tokens, max_model_len - prompt) is host data of the input batch
    (vLLM keeps ``max_tokens`` only on the host); ``prefix_lens + 1`` (cached tokens plus the anchor)
    is on device and exact without a sync even under async scheduling. With ``cache`` the device copy
    of ``budget_end`` is reused while the rows hold the same requests (:class:`BudgetCache`).
    """
    end_dev = (cache or BudgetCache()).budget_end(runner, prefix_lens.shape[0], prefix_lens.device)
    return torch.sub(end_dev, prefix_lens).clamp_(1, k + 1)  # int64 - int32/int64 -> int64


class BudgetCache:
    """``budget_end - 1`` per row on the device, rebuilt only when the rows' requests change: a
    request's prompt length and ``max_tokens`` are fixed, so a step with the same requests in the same
    rows (every decode step of a steady batch) needs no host loop, no pinned staging and no copy."""

    def __init__(self):
        self._states: list = []  # the rows' CachedRequestState objects (held: identity is the key)
        self._end: torch.Tensor | None = None

    def budget_end(self, runner, n: int, device: torch.device) -> torch.Tensor:
        batch = runner.input_batch
        requests = runner.requests
        states = [requests[req_id] for req_id in batch.req_ids[:n]]
        end = self._end
        if (end is not None and end.device == device and len(states) == len(self._states)
                and all(a is b for a, b in zip(states, self._states))):
            return end
        max_model_len = runner.max_model_len
        host = np.empty(n, dtype=np.int64)  # budget_end - 1: the anchor's "+ 1" folded in on the host
        for i, state in enumerate(states):
            prompt = state.num_prompt_tokens
            max_tokens = state.sampling_params.max_tokens if state.sampling_params is not None else None
            host[i] = prompt + min(max_tokens if max_tokens is not None else max_model_len, max_model_len - prompt) - 1
        end_host = torch.from_numpy(host)
        if device.type == "cuda":
            # from pageable memory a "non_blocking" copy may wait for the stream (CUDA's API sync notes:
            # the driver may synchronize with the stream to stage pageable memory); from pinned memory it
            # is queued (the caching host allocator keeps the block until the copy is done)
            end_host = end_host.pin_memory()
        self._end = end_host.to(device, non_blocking=True)
        self._states = states
        return self._end
