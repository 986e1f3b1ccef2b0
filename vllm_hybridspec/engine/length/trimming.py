"""The runner patches that take a gated step's drafts out of what vLLM schedules (HybridSpec's batch
gate; docs/architecture.md).

When the batch gate turns drafting off, the proposer hands vLLM a drafts tensor of zeros that no row
verifies (``LengthSelector.gated``), and the wrappers below cut every row's scheduled drafts to none.
The decision is made on the host from the batch size, so nothing waits for the device. Selected
lengths never pass here: vLLM schedules every draft and the step verifies the selected prefix on the
device (``cut.py``). Every wrapper passes through unchanged for a runner without a gated step. The
wrappers, of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the CPU runner inherits them; rows of
``engine/patches/table.py``):

* ``_get_draft_token_ids_cpu`` (sync scheduling): the draft lists handed to
  ``Scheduler.update_draft_token_ids`` are empty, so the scheduler schedules, allocates KV for and
  counts no draft. Not under async scheduling, where the same method feeds structured-output
  validation and penalties of already-scheduled drafts.
* ``execute_model`` (async scheduling): shallow-copies ``num_scheduled_tokens`` and
  ``scheduled_spec_decode_tokens`` before they are cut, as vLLM does for ``ngram_gpu``
  (``dataclasses.replace`` in ``execute_model``), so the engine core's object is not mutated.
* ``_update_states`` (async scheduling): before it, cuts the scheduler output to no drafts
  (``trim_to_no_drafts``); after it, restores each request's ``prev_num_draft_len`` to the
  scheduler's untrimmed count, which the scheduler's ``num_computed_tokens`` counted and the next
  step's optimistic correction subtracts against (what ``_update_states`` itself does for
  ``ngram_gpu`` with ``original_num_spec_per_req``). The cut drafts count as rejected in vLLM's
  spec-decode metrics under async scheduling.
"""

from __future__ import annotations

from vllm_hybridspec.engine.runner_state import existing_state


def selector_of(runner):
    """The runner's length selector (``RunnerState.selector``, set by its proposer), or ``None``."""
    state = existing_state(runner)
    return None if state is None else state.selector


def gated_round(runner) -> bool:
    """Whether the round the runner's next step verifies (``RunnerState.round``) is a gated one with drafts
    to take out of what vLLM schedules, under an active selector."""
    state = existing_state(runner)
    if state is None or state.selector is None or not state.selector.active or state.round is None:
        return False
    return state.round.gated_with_drafts


class _Ready:
    """Stands in for the CUDA event ``update_scheduler_for_invalid_drafts`` waits on: a gated step's
    counts are on the host already."""

    def synchronize(self) -> None:
        pass


def trim_to_no_drafts(scheduler_output, req_id_to_index) -> None:
    """``vllm.v1.spec_decode.ngram_proposer_gpu.update_scheduler_for_invalid_drafts`` with every count
    0: lowers ``num_scheduled_tokens`` and ``total_num_scheduled_tokens`` and drops the
    ``scheduled_spec_decode_tokens`` entry of every cached request that had a row in the previous step
    (``req_id_to_index``). Written for ``ngram_gpu`` but method-agnostic."""
    import torch
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    zeros = torch.zeros(max(req_id_to_index.values(), default=-1) + 1, dtype=torch.int32)
    update_scheduler_for_invalid_drafts(_Ready(), zeros, scheduler_output, req_id_to_index)


def _trimmed_draft_lists(original):
    """Sync scheduling: ``GPUModelRunner._get_draft_token_ids_cpu`` with a gated step's rows empty."""
    def _get_draft_token_ids_cpu(self):
        drafts, req_ids = original(self)
        if self.use_async_scheduling or not gated_round(self):
            return drafts, req_ids
        return [[] for _ in drafts], req_ids

    return _get_draft_token_ids_cpu


def _copied_scheduler_output(original):
    """Async scheduling: ``GPUModelRunner.execute_model`` of a gated step on a scheduler output whose two
    dicts that the trimming edits are copies."""
    from dataclasses import replace

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.use_async_scheduling and gated_round(self):
            scheduler_output = replace(
                scheduler_output,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens.copy(),
                scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens.copy())
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _trimmed_update_states(original):
    """Async scheduling: ``GPUModelRunner._update_states`` on the scheduler output of a gated step cut
    to no drafts, with ``prev_num_draft_len`` restored to the scheduler's untrimmed counts afterwards."""
    def _update_states(self, scheduler_output):
        if not self.use_async_scheduling or not gated_round(self):
            return original(self, scheduler_output)
        untrimmed = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        trim_to_no_drafts(scheduler_output, self.input_batch.req_id_to_index)
        result = original(self, scheduler_output)
        for req_id, n in untrimmed.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.prev_num_draft_len = n
        return result

    return _update_states
