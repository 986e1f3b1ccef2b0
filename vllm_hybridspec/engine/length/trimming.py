"""The runner patches that make the target verify only the selected prefix of each draft
(HybridSpec, throughput-aware verification; docs/architecture.md).

The proposer's :class:`~vllm_hybridspec.engine.length.selector.LengthSelector` holds, for the
drafts tensor it last produced, how many drafts of each input-batch row the target verifies; it is
attached to its runner with :func:`attach_selector`, and the wrappers below cut what vLLM schedules
to those counts. Every wrapper passes through unchanged for a runner without an active selector.
"""

from __future__ import annotations

import weakref

from vllm_hybridspec.engine.compat import wrap_once

_SELECTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model runner -> its LengthSelector


def attach_selector(runner, selector) -> None:
    """Make ``selector`` the one the runner patches consult for ``runner`` (its proposer calls this)."""
    _SELECTORS[runner] = selector


def selector_of(runner):
    """The length selector attached to ``runner``, or ``None``."""
    return _SELECTORS.get(runner)


def _length_selector(runner):
    selector = _SELECTORS.get(runner)
    return selector if selector is not None and selector.active else None


def copy_counts_to_host(cpu, stream, event, counts, n: int) -> None:
    """``vllm.v1.spec_decode.ngram_proposer_gpu.copy_num_valid_draft_tokens``: the async D2H copy of
    per-request draft counts on a side stream with an event, which ``ngram_gpu`` uses for the same
    job (GPU only)."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import copy_num_valid_draft_tokens

    copy_num_valid_draft_tokens(cpu, stream, event, counts, n)


def trim_scheduler_output(event, cpu_counts, scheduler_output, req_id_to_index) -> None:
    """``vllm.v1.spec_decode.ngram_proposer_gpu.update_scheduler_for_invalid_drafts``: waits on
    ``event``, then lowers ``num_scheduled_tokens``, ``total_num_scheduled_tokens`` and cuts
    ``scheduled_spec_decode_tokens`` of every cached request to ``cpu_counts[row]`` (rows of the
    previous step's ``req_id_to_index``). Written for ``ngram_gpu`` but method-agnostic."""
    from vllm.v1.spec_decode.ngram_proposer_gpu import update_scheduler_for_invalid_drafts

    update_scheduler_for_invalid_drafts(event, cpu_counts, scheduler_output, req_id_to_index)


def broadcast_from_tp_rank0(tensor):
    """``vllm.distributed.parallel_state.get_tp_group().broadcast``: every TP rank takes rank 0's
    selected lengths. They become host-side shapes on each rank (scheduled tokens, attention
    metadata), and ranks that disagreed would issue collectives of different shapes and hang. A
    no-op without TP (or outside a distributed run)."""
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:
        return tensor
    group = parallel_state.get_tp_group()
    return tensor if group.world_size == 1 else group.broadcast(tensor, src=0)


def _trimmed_draft_lists(original):
    """Sync scheduling: ``GPUModelRunner._get_draft_token_ids_cpu`` with each row cut to its count."""
    def _get_draft_token_ids_cpu(self):
        drafts, req_ids = original(self)
        selector = _length_selector(self)
        if selector is None or self.use_async_scheduling or isinstance(self._draft_token_ids, list):
            return drafts, req_ids
        counts = selector.host_counts(self._draft_token_ids, len(req_ids))
        if counts is None:
            return drafts, req_ids
        return [row[:n] for row, n in zip(drafts, counts)], req_ids

    return _get_draft_token_ids_cpu


def _copied_scheduler_output(original):
    """Async scheduling: ``GPUModelRunner.execute_model`` on a scheduler output whose two dicts that
    the trimming edits are copies."""
    from dataclasses import replace

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.use_async_scheduling and _length_selector(self) is not None:
            scheduler_output = replace(
                scheduler_output,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens.copy(),
                scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens.copy())
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _trimmed_update_states(original):
    """Async scheduling: ``GPUModelRunner._update_states`` on the cut scheduler output, with
    ``prev_num_draft_len`` restored to the scheduler's untrimmed counts afterwards."""
    def _update_states(self, scheduler_output):
        selector = _length_selector(self)
        found = None
        if selector is not None and self.use_async_scheduling:
            found = selector.counts_for(self._draft_token_ids)
        if found is None:
            return original(self, scheduler_output)
        untrimmed = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        event, cpu_counts = found
        trim_scheduler_output(event, cpu_counts, scheduler_output, self.input_batch.req_id_to_index)
        result = original(self, scheduler_output)
        for req_id, n in untrimmed.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.prev_num_draft_len = n
        return result

    return _update_states


def patch_runner_length_trimming() -> None:
    """Wrap three methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the CPU runner
    inherits them) so the target verifies only the selected prefix of each draft.

    * ``_get_draft_token_ids_cpu`` (sync scheduling): the draft lists handed to
      ``Scheduler.update_draft_token_ids`` are cut to the selected counts, so the scheduler schedules,
      allocates KV for and counts exactly the verified drafts. Not under async scheduling, where the
      same method feeds structured-output validation and penalties of already-scheduled drafts.
    * ``execute_model`` (async scheduling): shallow-copies ``num_scheduled_tokens`` and
      ``scheduled_spec_decode_tokens`` before they are cut, as vLLM does for ``ngram_gpu``
      (``dataclasses.replace`` in ``execute_model``), so the engine core's object is not mutated.
    * ``_update_states`` (async scheduling): before it, waits for the counts and cuts the scheduler
      output (``trim_scheduler_output``); after it, restores each request's ``prev_num_draft_len`` to
      the scheduler's untrimmed count, which the scheduler's ``num_computed_tokens`` counted and the
      next step's optimistic correction subtracts against (what ``_update_states`` itself does for
      ``ngram_gpu`` with ``original_num_spec_per_req``). Cut drafts count as rejected in vLLM's
      spec-decode metrics under async scheduling.

    Every wrapper passes through unchanged unless the runner's drafter has an active
    ``length_selector`` whose counts belong to the drafts tensor vLLM is about to schedule.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_once(GPUModelRunner, "_get_draft_token_ids_cpu", _trimmed_draft_lists)
    wrap_once(GPUModelRunner, "execute_model", _copied_scheduler_output)
    wrap_once(GPUModelRunner, "_update_states", _trimmed_update_states)
