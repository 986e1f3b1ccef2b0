"""The selected length reaches the target on the device (HybridSpec, throughput-aware verification:
the two-stage verification at the router boundary). Nothing of it is read on the host.

vLLM schedules every draft of a row, as it does without the selector, so one full CUDA graph per
batch size serves every length; the step then verifies only the first ``w - 1`` drafts of each row,
``w`` being the length the selector picked for the row in the round before:

* **Rows** (after ``GPUModelRunner._prepare_inputs``): each spec-decode row's ``w`` is gathered on the
  device from the lengths of the round this step verifies (``RunnerState.round``, rows of the input
  batch then, matched to this step's rows by request id on the host); every other row keeps all
  its tokens. From it, per token of the step: ``keep`` (position in its row ``< w``) and ``source``
  (the token itself, or its row's first token where it is cut), into persistent buffers.
* **Experts** (``MoERunner._apply_quant_method``): the router logits of a cut token are those of its
  row's first token (the anchor, always verified), so the experts the step reads are the verified
  tokens' own. A cut token's output is never read: attention, the GDN recurrence and the convolution
  are causal, so no verified position depends on a later one, and the sampler stops at ``w``.
  With a policy that has routing tables (HybridSpec's routing correction, Algorithm 1 lines 5-11), the
  first MoE layer's router is Stage 0: the selector picked ``w0`` and, per count of new Layer-0 experts,
  whether ``d_{w0}`` is worth verifying too; there each row's ``n_new`` is counted from the router's
  top-k choices and its ``w`` becomes ``w0`` or ``w0 + 1`` before any token is routed
  (``StepCut.stage0``), for every later layer and the sampler alike.
* **Sampling** (``GPUModelRunner._sample``): the rejection sampler runs on every draft as vLLM's own,
  with each row's bonus token sampled from the target's distribution at position ``w - 1`` instead of
  after the last draft; a row that accepted its first ``w - 1`` drafts then ends with that bonus token.
  The accept/reject decisions of those drafts are the ones a round of ``w`` would make, and the bonus
  is an independent sample of the same distribution, so greedy output and the sampling distribution
  are the target's, as with drafts verified one by one. The sampled ids (``-1`` past each row's
  tokens) are what every consumer reads: the runner's accepted counts, the one-slot GDN layer's commit,
  the drafter's next anchors. The cut drafts count as rejected in vLLM's acceptance metrics.

Log-probabilities are those of the tokens the rows end with (the sampler's logprob gather sees the
cut rows). A step cuts nothing (``w = K + 1`` everywhere) when a request asks for logits that depend
on the drafts before the bonus: penalties, bad words, a thinking budget. Rows without drafts
(prefills) keep every token.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_hybridspec.engine.length.selector import RoundLayout
from vllm_hybridspec.engine.runner_state import existing_state, state_of, state_of_forward
from vllm_hybridspec.kernels.cut import (
    bonus_at_cut,
    end_rows_at_cut,
    plan_cut,
    plan_cut_torch,
    route_tokens_torch,
    stage0_expand_torch,
)

NO_CUT = 1 << 30  # the length of a row that keeps every token


class StepCut:
    """Per model runner: the device buffers the step's cut lives in (fixed addresses, so full CUDA
    graphs captured with them read each step's values) and whether this step cuts."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device, pin: bool):
        self.w = torch.full((max_num_reqs,), NO_CUT, dtype=torch.int32, device=device)  # [R] per row
        self.source = torch.arange(max_num_tokens, dtype=torch.int64, device=device)  # [T] router row of each token
        self._tokens = torch.arange(max_num_tokens, dtype=torch.int64, device=device)
        self._prev_row = torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=pin)  # [R] host staging
        self._prev_row_dev = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.active = False  # this step cuts (the sampler reads it)
        self.steps_cut = 0
        self.verified_drafts = torch.zeros((), dtype=torch.int64, device=device)  # sum of v over cut rows
        self.stage0_kept = torch.zeros((), dtype=torch.int64, device=device)  # rows Stage 0 lengthened
        # the routing correction (enable_routing): per row, whether d_{w0} is kept given n new Layer-0
        # experts; the first MoE layer's name; the runner's query_start_loc buffer (all rows, padded)
        self.expand: torch.Tensor | None = None  # [R, topk + 1] bool
        self._moe_layers: list[str] | None = None
        self.query_start_loc: torch.Tensor | None = None

    def enable_routing(self, topk: int, moe_layers: list[str]) -> None:
        """HybridSpec's Stage 0 at the first MoE router of every step that cuts (module docstring,
        "Experts"). ``moe_layers``: vLLM's ``compilation_config.static_all_moe_layers``, filled in model
        order while the model is built."""
        self.expand = torch.zeros(self.w.shape[0], topk + 1, dtype=torch.bool, device=self.w.device)
        self._moe_layers = moe_layers

    def is_stage0_layer(self, layer_name) -> bool:
        return self.expand is not None and bool(self._moe_layers) and layer_name == self._moe_layers[0]

    def reset(self) -> None:
        """Every token routed as its own and no row cut: a forward that is not a served step (vLLM's
        dummy runs and graph captures), or a step that cuts nothing."""
        self.w.fill_(NO_CUT)
        self.source.copy_(self._tokens)
        if self.expand is not None:
            self.expand.zero_()
        self.active = False

    def plan(self, round: RoundLayout, req_ids: list[str], spec_rows: np.ndarray,
             query_start_loc: torch.Tensor) -> None:
        """``round``: the previous drafting round, with lengths selected (its ``w`` ``[N_prev]`` on the device,
        its ``rows`` mapping request ids to its rows, its ``expand`` ``[N_prev, topk + 1]`` the routing
        correction's tables or ``None``: no row grows); ``req_ids``: this step's rows; ``spec_rows`` ``[N]``
        bool: rows that verify drafts this step; ``query_start_loc`` ``[N + 1]`` (device): the step's
        token offsets. Fills ``w``, ``source`` (and ``expand``) on the device, without a host read."""
        n = len(req_ids)
        prev = self._prev_row.numpy()
        prev[:n] = [round.rows.get(r, -1) if s else -1 for r, s in zip(req_ids, spec_rows)]
        self._prev_row_dev[:n].copy_(self._prev_row[:n], non_blocking=True)
        plan = plan_cut if self.w.is_cuda else plan_cut_torch  # one launch on GPUs
        plan(round.w, self._prev_row_dev[:n], query_start_loc, n, self.w, self.source, NO_CUT)
        if self.expand is not None:
            if round.expand is None:
                self.expand[:n].zero_()
            else:
                rows = self._prev_row_dev[:n]
                self.expand[:n] = round.expand.index_select(0, rows.clamp(min=0)) & (rows >= 0)[:, None]
        self.active = True
        self.steps_cut += 1

    def route(self, router_logits: torch.Tensor, capturing: bool = False,
              one_token_per_request: bool = False) -> torch.Tensor:
        """``router_logits`` ``[T, E]`` of the step's tokens: a cut token's row replaced by its row's
        first token's (one gather; the identity when nothing is cut).

        No gather where no token can be cut: an eager forward of a step that does not cut, or a CUDA
        graph captured for one token per request (plain decoding's graphs, which drafting off
        replays: every token is its row's first). Any other graph keeps the gather, since the steps
        that replay it may cut."""
        T = router_logits.shape[0]
        if T > self.source.shape[0] or not self.may_cut(capturing, one_token_per_request):
            return router_logits
        return router_logits.index_select(0, self.source[:T])

    def may_cut(self, capturing: bool, one_token_per_request: bool) -> bool:
        """Whether this forward may cut a token (``route``'s rule: a step that cuts, or a CUDA graph other
        than plain decoding's, since the steps that replay it may cut)."""
        return not one_token_per_request if capturing else self.active

    def stage0(self, router_logits: torch.Tensor) -> None:
        """At the first MoE router: each cut row's ``d_{w0}`` kept or not from its new Layer-0 experts
        (``kernels.cut.stage0_expand_torch``), then every token's router source again for the rows'
        final lengths, which the later layers' routing and the sampler's bonus read."""
        qsl = self.query_start_loc
        stage0_expand_torch(router_logits, qsl, self.w, self.expand, NO_CUT, self.stage0_kept)
        route_tokens_torch(qsl, qsl.shape[0] - 1, self.w, self.source)

    def bonus_at_cut(self, metadata, num_rows: int):
        """``(metadata with each row's bonus index at its cut, v [N])``: ``v`` the drafts verified
        per row (``min(w - 1, drafts scheduled)``, ``kernels.cut.bonus_at_cut``)."""
        from dataclasses import replace

        bonus, v = bonus_at_cut(metadata.cu_num_draft_tokens, self.w[:num_rows], metadata.bonus_logits_indices,
                                self.verified_drafts)
        return replace(metadata, bonus_logits_indices=bonus), v


def cuts_nothing(sampling_metadata) -> bool:
    """Whether a request of the batch asks for logits that depend on the drafts before the bonus
    (penalties, bad words, a thinking budget), which the cut would change. Logits processors are not
    among them: vLLM applies them alike at every position of a row
    (``RejectionSampler.apply_logits_processors``), the bonus's included."""
    m = sampling_metadata
    holder = getattr(m, "thinking_budget_state_holder", None)
    return (not m.no_penalties or bool(m.bad_words_token_ids)
            or (holder is not None and holder.has_tracked_requests()))


# --- per runner ------------------------------------------------------------------------------------


def attach_cut(runner) -> StepCut:
    """The runner's :class:`StepCut` (``RunnerState.cut``), made at the first call (the proposer makes it
    at construction, before vLLM captures any graph)."""
    state = state_of(runner)
    if state.cut is None:
        device = torch.device(runner.device)
        state.cut = StepCut(runner.max_num_reqs, runner.max_num_tokens, device, device.type == "cuda")
    return state.cut


def cut_of(runner) -> StepCut | None:
    state = existing_state(runner)
    return None if state is None else state.cut


def one_token_per_request() -> bool:
    """Whether the running forward has one token per request (``vllm.forward_context``'s
    ``BatchDescriptor``: ``num_reqs`` given, as for full CUDA graphs, and equal to ``num_tokens``)."""
    from vllm.forward_context import get_forward_context

    descriptor = get_forward_context().batch_descriptor
    return (descriptor is not None and descriptor.num_reqs is not None
            and descriptor.num_tokens <= descriptor.num_reqs)


def plan_step_cut(runner, scheduler_output) -> None:
    """After ``_prepare_inputs``: this step's cut from the round it verifies (``RunnerState.round``), or
    none."""
    state = existing_state(runner)
    cut = None if state is None else state.cut
    if cut is None:
        return
    round = state.round
    n = runner.input_batch.num_reqs
    if (round is None or not round.selected or not scheduler_output.scheduled_spec_decode_tokens
            or cuts_nothing(runner.input_batch.sampling_metadata)):
        if cut.active:
            cut.reset()
        return
    spec_rows = runner.num_decode_draft_tokens.np[:n] > 0  # decode rows with drafts (others keep every token)
    cut.query_start_loc = runner.query_start_loc.gpu
    cut.plan(round, list(runner.input_batch.req_ids[:n]), spec_rows, runner.query_start_loc.gpu[: n + 1])


def end_round_after_sampling(runner, output_token_ids, scheduler_output) -> None:
    """The after-sampling hook: the round the step verified is done (``RunnerState.round``). vLLM sets its
    drafts aside right after this point of ``sample_tokens``, then either proposes the next round (the
    proposer sets ``round`` again) or zeroes the drafts (no round: the next step cuts and trims nothing)."""
    state = existing_state(runner)
    if state is not None:
        state.round = None


def sample_with_cut(runner, original, logits, spec_decode_metadata):
    """``GPUModelRunner._sample`` with the step's cut (the module docstring, "Sampling")."""
    cut = cut_of(runner)
    if cut is None or not cut.active or spec_decode_metadata is None:
        return original(runner, logits, spec_decode_metadata)
    n = runner.input_batch.num_reqs
    metadata, v = cut.bonus_at_cut(spec_decode_metadata, n)
    rejection = runner.rejection_sampler
    sampler = rejection.sampler
    bonus = []
    sample, gather_logprobs = sampler.forward, rejection._get_logprobs_tensors

    def recording_forward(*args, **kwargs):  # Sampler.forward, recording the bonus tokens
        out = sample(*args, **kwargs)
        if kwargs.get("predict_bonus_token"):
            bonus.append(out.sampled_token_ids)
        return out

    def logprobs_of_cut_rows(*args):  # RejectionSampler._get_logprobs_tensors(..., sampled_token_ids)
        return gather_logprobs(*args[:-1], end_rows_at_cut(args[-1], bonus[0], v))

    # instance attributes for this call only
    sampler.forward, rejection._get_logprobs_tensors = recording_forward, logprobs_of_cut_rows
    try:
        out = original(runner, logits, metadata)
    finally:
        del sampler.forward, rejection._get_logprobs_tensors
    if len(bonus) != 1:
        raise RuntimeError(f"vllm-hybridspec: the rejection sampler sampled {len(bonus)} bonus batches in one "
                           "step, expected 1 (vllm.v1.sample.rejection_sampler.RejectionSampler.forward changed)")
    out.sampled_token_ids = end_rows_at_cut(out.sampled_token_ids, bonus[0], v)
    return out


# --- the wrappers and hooks (rows of engine/patches/table.py) ---------------------------------------------


def reset_before_dummy_run(runner) -> None:
    cut = cut_of(runner)
    if cut is not None:
        cut.query_start_loc = runner.query_start_loc.gpu  # what a captured Stage 0 reads
        cut.reset()


def _cut_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        return sample_with_cut(self, original, logits, spec_decode_metadata)

    return _sample


def _routed_at_cut(original):
    def _apply_quant_method(self, hidden_states, router_logits, *args, **kwargs):
        # traced by torch.compile only where vLLM calls the MoE eagerly inside the compiled model (the
        # CPU and TPU platforms); there the tokens keep their own experts, which changes no output
        state = None if torch.compiler.is_compiling() else state_of_forward()
        cut = None if state is None else state.cut
        if state is not None and state.capture is not None:  # calibration: the tokens' own experts
            state.capture.routed(getattr(self, "layer_name", None), router_logits,
                                 self.moe_config.experts_per_token)
        if cut is not None:
            capturing = router_logits.is_cuda and torch.cuda.is_current_stream_capturing()
            one_token = capturing and one_token_per_request()
            if cut.is_stage0_layer(getattr(self, "layer_name", None)) and cut.may_cut(capturing, one_token):
                cut.stage0(router_logits)  # the routing correction: the rows' final lengths, from Layer 0's experts
            router_logits = cut.route(router_logits, capturing, one_token)
        return original(self, hidden_states, router_logits, *args, **kwargs)

    return _apply_quant_method
