"""The batch gate in vLLM's scheduler (HybridSpec: draft only at the batch sizes where speculation
pays, per the policy's gate table).

A gated step must cost what a plain step costs. Taken out on the host after vLLM scheduled it
(``trimming.py``), a gated step still carries the ``K`` drafts the scheduler counted: vLLM's runner
corrects its computed-token counts for them on the device and on the host (a wait), and prepares a
drafting round that drafts nothing, a measurable share of a plain step (``docs/benchmarks/choices.md``).
vLLM's own dynamic speculative decoding
(``SpeculativeConfig.num_speculative_tokens_per_batch_size``) instead has the scheduler decide, from
the batch size, how many drafts the next step schedules; a gate table is such a schedule with ``K``
or ``0`` per batch size:

* at engine start, a policy with a gate table (and ``"gate"`` on) becomes that schedule
  (:func:`scheduler_schedule`, set by ``config.resolve_speculative_config``);
* ``LengthSelector.configure`` (``calibrate costs``, ``evaluate``, ``spec-steps``, ``bench --switch``)
  sets the running scheduler's lookup to match (:func:`sync_scheduler`) where the scheduler is in the
  runner's process (vLLM's in-process and single-GPU engines); elsewhere the gate stays on the host;
* a step that verified no draft and drafts none runs no drafting preparation at all
  (``GPUModelRunner.propose_draft_token_ids``), so it is vLLM's plain step plus the drafter's
  auxiliary hidden states.

vLLM runs engines with such a schedule in ``PIECEWISE`` graphs, because other lengths than ``K``
break its uniform-decode graphs; a schedule of ``0`` and ``K`` only makes steps of one token (the
length graphs of ``graphs.py``) or ``K + 1`` tokens per request (vLLM's own), so the engine keeps its
full graphs (``VllmConfig._maybe_override_dynamic_sd_cudagraph_mode``).
"""

from __future__ import annotations

import weakref

from vllm_hybridspec.engine.runner_state import existing_state

BIG_BATCH = 1 << 20  # the end of the last range (vLLM caps it at max_num_seqs)


def gate_schedule(policy, k: int) -> list[list[int]]:
    """vLLM's ``[[range_start, range_end, K or 0], ...]`` of a policy's batch gate: ``Policy.speculate``
    at every batch size (``Policy.gate_ranges``)."""
    return policy.gate_ranges(k, BIG_BATCH)


def gates(policy) -> bool:
    """Whether a policy has a batch gate (a ``speedup`` or a ``gate`` table)."""
    return bool(policy.speedup or policy.gate)


def is_gate_schedule(schedule, k: int) -> bool:
    """Whether a ``num_speculative_tokens_per_batch_size`` only ever schedules ``0`` or ``K`` drafts."""
    return bool(schedule) and all(int(entry[2]) in (0, k) for entry in schedule)


def scheduler_schedule(options, k: int) -> list[list[int]] | None:
    """The schedule of an engine's ``"hybridspec"`` options: its policy's gate table, when the gate is on."""
    if options.policy is None or not options.gate:
        return None
    from vllm_hybridspec.policy.policy_file import Policy

    policy = Policy.load(options.policy)
    return gate_schedule(policy, k) if gates(policy) else None


# --- the running scheduler -----------------------------------------------------------------------

_SCHEDULERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # VllmConfig.instance_id -> Scheduler


def sync_scheduler(vllm_config, selector) -> bool:
    """Set the scheduler's batch-size lookup to ``selector``'s gate: every size off without drafting, the
    policy's table with the gate on, vLLM's static ``K`` otherwise. False when the scheduler is not in
    this process (the gate then stays on the host)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    scheduler = _SCHEDULERS.get(vllm_config.instance_id)
    if scheduler is None:
        return False
    k = selector.k
    if not selector.drafting:
        schedule = [[1, BIG_BATCH, 0]]
    elif selector.gates:
        schedule = gate_schedule(selector.policy, k)
    else:
        schedule = None
    scheduler.dynamic_sd_lookup = None if schedule is None else build_dynamic_sd_schedule_lookup(
        schedule, vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs, vllm_num_speculative_tokens=k)
    return True


def skips_drafting(runner, scheduler_output, spec_decode_metadata) -> bool:
    """A step that verified no draft (``spec_decode_metadata`` is None) and whose next step schedules
    none: the drafting preparation is skipped (the module docstring)."""
    return scheduler_output.num_spec_tokens_to_schedule == 0 and spec_decode_metadata is None


# --- the wrappers (rows of engine/patches/table.py) ------------------------------------------------------


def _registered_scheduler(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        _SCHEDULERS[vllm_config.instance_id] = self

    return __init__


def _full_graphs_for_a_gate(original):
    def _maybe_override_dynamic_sd_cudagraph_mode(self):
        from vllm_hybridspec.engine.options import hybridspec_options

        spec = self.speculative_config
        if (spec is not None and hybridspec_options(self) is not None
                and is_gate_schedule(spec.num_speculative_tokens_per_batch_size, spec.num_speculative_tokens)):
            return None
        return original(self)

    return _maybe_override_dynamic_sd_cudagraph_mode


def _no_round_when_nothing_is_drafted(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs):
        state = existing_state(self)
        selector = None if state is None else state.selector
        if selector is not None and skips_drafting(self, scheduler_output, spec_decode_metadata):
            # an empty drafts tensor, as the drafter returns for K = 0; vLLM's bookkeeping keeps the
            # sampled tokens for the next step's inputs (prev_sampled_token_ids) when no round ran
            state.round = selector.gated(selector.no_drafts(self.input_batch.num_reqs, self.device))
            return state.round.drafts
        return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata, *args, **kwargs)

    return propose_draft_token_ids
