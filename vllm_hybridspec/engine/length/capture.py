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

Not captured: the Layer-0 expert counts (``n_new_l0``/``n_new_later``, optional in the format), so
policies fitted from these records have no routing correction.

Capture copies each round's signals to the host (one sync per step): it is for calibration runs, not
for serving. Under tensor parallelism only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from vllm_hybridspec.engine.runner_state import existing_state

logger = logging.getLogger(__name__)


class RoundCapture:
    def __init__(self, path: str, num_speculative_tokens: int):
        from vllm.distributed import get_tensor_model_parallel_rank

        self.k = num_speculative_tokens
        self.path = Path(path)
        self.rounds = 0
        self._request_numbers: dict[str, int] = {}  # vLLM request id -> the records' integer "request"
        self._pending: tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
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

    def sampled(self, runner, output_token_ids: torch.Tensor, scheduler_output) -> None:
        """The step that verified the pending round: one record per request whose drafts it verified."""
        if self._pending is None:
            return
        req_ids, top1, ent, w_rem = self._pending
        self._pending = None
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
            self.rounds += 1
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def capture_after_sampling(runner, output_token_ids: torch.Tensor, scheduler_output) -> None:
    """The runner hook (``engine.compat.patch_runner_after_sampling``)."""
    state = existing_state(runner)
    capture = None if state is None else state.capture
    if capture is not None:
        capture.sampled(runner, output_token_ids, scheduler_output)


def scheduled_draft_counts(scheduler_output) -> dict[str, int]:
    """Draft tokens the scheduler scheduled per request this step
    (``SchedulerOutput.scheduled_spec_decode_tokens``: request id -> draft ids, or ``-1``
    placeholders under async scheduling)."""
    return {req_id: len(tokens) for req_id, tokens in scheduler_output.scheduled_spec_decode_tokens.items()}
