"""The model-runner patches of the one-slot GDN layer: the step's plan before every served forward,
a clean plan before vLLM's dummy runs and graph captures, and the committed counts after sampling.

vLLM 0.26 symbols wrapped (``vllm/v1/worker/gpu_model_runner.py``, inherited by the CPU runner):

* ``GPUModelRunner._prepare_inputs`` (a hook of the row in ``engine/patches/table.py``): after it, the
  persistent batch's row order, the draft counts the GDN builder will classify rows by
  (``self.num_decode_draft_tokens``) and the block tables are final, and the model has not run yet.
  The plan (``PendingRounds.plan``) is computed there on the host and copied to the device.
* ``GPUModelRunner._dummy_run`` (a hook of the row in ``engine/patches/table.py``): before it, the plan is reset
  to the scratch slab, so a profiling run, a warm-up or a CUDA-graph capture never touches a request's
  pending round, and the layers' float32 conv taps are converted eagerly (a capture records work
  without running it).
* ``GPUModelRunner._update_states_after_model_execute`` (a hook of the row in ``engine/patches/table.py``): each
  verified row's ``m`` is written on the device for the next round.
* ``GPUModelRunner._check_and_update_cudagraph_mode``: before vLLM resolves the engine's graph mode from
  ``compilation_config.cudagraph_mode``, a GPU engine with the one-slot layer and full decode graphs
  is set to ``PIECEWISE`` when ``"full_graph_spec_steps": false`` asks for it (by default its spec steps
  replay vLLM's full graphs, which are exact: ``docs/benchmarks/choices.md``).
"""

from __future__ import annotations

import logging

import numpy as np

from vllm_hybridspec.engine.gdn.check import any_check_enabled, check_recorded_steps, log_sampled, warm_step_records
from vllm_hybridspec.engine.gdn.commit import flush_rounds
from vllm_hybridspec.engine.gdn.pending import PendingRounds, attach, rounds_of

logger = logging.getLogger(__name__)


def one_slot_layers_by_group(runner) -> dict[int, list]:
    """KV-cache group index -> the group's one-slot GDN layers, in model order
    (``runner.kv_cache_config.kv_cache_groups[g].layer_names``; the block table of group ``g`` is
    ``runner.input_batch.block_table[g]``)."""
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    context = runner.compilation_config.static_forward_context
    groups = {}
    for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        layers = [context[name] for name in group.layer_names
                  if isinstance(context.get(name), HSpecQwenGDN) and context[name].one_slot]
        if layers:
            groups[g] = layers
    return groups


def ensure_rounds(runner) -> PendingRounds | None:
    """The runner's :class:`PendingRounds`, created at its first use; ``None`` without one-slot layers
    (or before the KV cache exists, when there is nothing to plan)."""
    rounds = rounds_of(runner)
    if rounds is not None:
        return rounds
    if not hasattr(runner, "kv_cache_config"):
        return None
    groups = one_slot_layers_by_group(runner)
    if not groups:
        return None
    first = next(iter(groups.values()))[0]
    rounds = PendingRounds(runner.scheduler_config.max_num_seqs, runner.max_num_reqs, first.slab_len, runner.device)
    rounds.groups = groups
    attach(runner, rounds)
    return rounds


def plan_step(runner, scheduler_output) -> None:
    """The plan of a served step (see the module docstring)."""
    rounds = ensure_rounds(runner)
    if rounds is None:
        return
    if not scheduler_output.scheduled_spec_decode_tokens and rounds.quiet:
        rounds.idle_step()  # drafting off or prefills only, nothing pending: no host work
        return
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = list(batch.req_ids[:n])
    if scheduler_output.scheduled_spec_decode_tokens:
        draft_counts = runner.num_decode_draft_tokens.np[:n].copy()
    else:  # no spec metadata this step: the GDN builder takes vLLM's own paths for every row
        draft_counts = np.full(n, -1, dtype=np.int32)
    num_scheduled = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
    num_computed = batch.num_computed_tokens_cpu[:n].copy()
    slots = {g: batch.block_table[g].get_numpy_array()[:n, 0].copy() for g in rounds.groups}
    cached = scheduler_output.scheduled_cached_reqs
    dropped = set(getattr(cached, "resumed_req_ids", set()) or ()) | set(scheduler_output.preempted_req_ids or ())

    def flush(entries, slots_by_group, slabs):
        for g, layers in rounds.groups.items():
            flush_rounds(layers, entries, slots_by_group[g], slabs, rounds.m_of_slab)

    rounds.plan(req_ids, draft_counts, num_scheduled, num_computed, slots, set(scheduler_output.finished_req_ids),
                dropped, flush)


def clean_plan_before_dummy_run(runner) -> None:
    """The before-dummy-run hook: the scratch plan, and what a capture must not create itself."""
    rounds = ensure_rounds(runner)
    if rounds is not None:
        rounds.reset_step()
        for layers in rounds.groups.values():
            for layer in layers:
                layer.warm_conv_taps()  # before any capture inside the dummy run (HSpecQwenGDN._conv_taps_fp32)
                warm_step_records(layer)  # the self-check's stamp counters, likewise (check.warm_step_records)


def committed_counts_after_sampling(runner, output_token_ids, scheduler_output) -> None:
    """The after-sampling hook: each verified row's ``m`` on the device (``PendingRounds.sampled``), from
    the rows' kept-token counts that vLLM's ``_update_states_after_model_execute`` has just written to
    ``runner.num_accepted_tokens.gpu`` (it does so for every hybrid model with a speculative config, the
    only engines with one-slot rounds)."""
    rounds = rounds_of(runner)
    if rounds is not None:
        if any_check_enabled():  # the self-check's hooks (engine/gdn/check.py); off when serving
            check_recorded_steps([layer for layers in rounds.groups.values() for layer in layers])
            log_sampled(rounds, output_token_ids)
        rounds.sampled(runner.num_accepted_tokens.gpu[: output_token_ids.shape[0]])


def piecewise_spec_steps(vllm_config) -> bool:
    """Set ``compilation_config.cudagraph_mode`` to ``PIECEWISE`` when this engine runs the one-slot layer
    on a GPU with full decode graphs and ``"full_graph_spec_steps": false`` is given; returns whether it
    did (a warning says so once per engine)."""
    from vllm.config import CUDAGraphMode

    from vllm_hybridspec.engine.gdn.enable import _on_cuda, gdn_kernel_enabled
    from vllm_hybridspec.engine.options import hybridspec_options

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs() or not _on_cuda() or not gdn_kernel_enabled(vllm_config):
        return False
    options = hybridspec_options(vllm_config)
    if options is None or options.full_graph_spec_steps:
        return False
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
    logger.warning('vllm-hybridspec: cudagraph_mode %s -> PIECEWISE ("hybridspec": {"full_graph_spec_steps": '
                   "false}): the one-slot GDN layer's spec steps run piecewise", mode.name)
    return True


def _piecewise_before_resolving(original):
    # composed with engine/length/graphs.py's wrapper of the same method in engine/patches/table.py: this one
    # acts before vLLM resolves the graph mode, that one after it (keys for the resolved mode)
    def _check_and_update_cudagraph_mode(self, *args, **kwargs):
        piecewise_spec_steps(self.vllm_config)
        return original(self, *args, **kwargs)

    return _check_and_update_cudagraph_mode
