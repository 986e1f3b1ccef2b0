"""The vLLM 0.26 symbols length selection (``engine/length/``) relies on keep their shape: the trimming
(``trimming.py``: ``ngram_proposer_gpu``'s draft-count helpers, ``GPUModelRunner._get_draft_token_ids_cpu``,
``_update_states``, ``sample_tokens``, ``SchedulerOutput``, ``CachedRequestState.prev_num_draft_len``,
the TP group), the device cut (``cut.py``: ``RejectionSampler.forward`` and ``_get_logprobs_tensors``,
``GPUModelRunner._sample``, ``MoERunner._apply_quant_method``, the forward context) and the scheduler
gate (``gate.py``: vLLM's dynamic speculative decoding, ``Scheduler.dynamic_sd_lookup``,
``VllmConfig``'s PIECEWISE switch, ``GPUModelRunner._bookkeeping_sync``)."""

import torch
from ...seeds import fresh_seed


def test_symbols_the_length_trimming_relies_on_keep_their_shape():
    import inspect

    from vllm.distributed import parallel_state
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.spec_decode import ngram_proposer_gpu
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def params(fn):
        return list(inspect.signature(inspect.unwrap(fn)).parameters)

    assert params(ngram_proposer_gpu.update_scheduler_for_invalid_drafts) == [
        "num_valid_draft_tokens_event", "num_valid_draft_tokens_cpu", "scheduler_output", "req_id_to_index"]
    assert params(ngram_proposer_gpu.copy_num_valid_draft_tokens) == [
        "num_valid_draft_tokens_cpu", "num_valid_draft_tokens_copy_stream", "num_valid_draft_tokens_event",
        "num_valid_draft_tokens", "batch_size"]
    assert params(GPUModelRunner._get_draft_token_ids_cpu) == ["self"]
    assert params(GPUModelRunner._update_states) == ["self", "scheduler_output"]
    assert params(GPUModelRunner.execute_model)[:2] == ["self", "scheduler_output"]
    fields = {f.name for f in __import__("dataclasses").fields(SchedulerOutput)}
    assert {"num_scheduled_tokens", "scheduled_spec_decode_tokens", "total_num_scheduled_tokens",
            "scheduled_cached_reqs"} <= fields
    state_fields = {f.name for f in __import__("dataclasses").fields(CachedRequestState)}
    assert {"prev_num_draft_len", "sampling_params"} <= state_fields
    # the runner sets prev_num_draft_len from the (cut) scheduled drafts; the patch restores it after
    source = inspect.getsource(InputBatch.update_req_spec_token_ids)
    assert "request.prev_num_draft_len = num_spec_tokens" in source
    # a round lives from the proposer's return to the next step's sampling (RunnerState.round): in
    # sample_tokens, _update_states_after_model_execute (whose hook ends the round) comes before vLLM sets
    # the drafts aside and either proposes the next round or zeroes them
    source = inspect.getsource(inspect.unwrap(GPUModelRunner.sample_tokens))
    hook = source.index("self._update_states_after_model_execute(")
    assert hook < source.index("self._draft_token_ids = None") < source.index(
        "self._draft_token_ids = self.propose_draft_token_ids(")
    assert hook < source.index("self._draft_token_ids = torch.zeros(")
    assert source.count("self._update_states_after_model_execute(") == 1
    assert hasattr(parallel_state, "_TP") and callable(parallel_state.get_tp_group)


class _FakeRunner:
    """What the trimming wrappers read of ``GPUModelRunner``; an active selector and the round the next
    step verifies reach them through ``RunnerState``, as the proposer sets them."""

    def __init__(self, round, async_scheduling):
        from types import SimpleNamespace

        from vllm_hybridspec.engine.runner_state import state_of

        self.use_async_scheduling, self.requests = async_scheduling, {}
        self.input_batch = SimpleNamespace(req_id_to_index={})
        state_of(self).selector = SimpleNamespace(active=True)
        state_of(self).round = round


def _gated(drafts):
    from vllm_hybridspec.engine.length.selector import RoundLayout

    return RoundLayout(drafts, gated=True)


_fake_runner = _FakeRunner


def test_sync_trimming_empties_a_gated_steps_draft_lists():
    from vllm_hybridspec.engine.length.trimming import _trimmed_draft_lists

    gen = torch.Generator().manual_seed(fresh_seed("vllm_contract_sync_trimming_empties_a_ga"))
    n, k = 6, 5
    drafts = torch.randint(0, 100, (n, k), generator=gen)
    req_ids = [f"r{i}" for i in range(n)]
    wrapped = _trimmed_draft_lists(lambda self: (drafts.tolist(), req_ids))
    got, ids = wrapped(_fake_runner(_gated(drafts), async_scheduling=False))
    assert ids == req_ids and got == [[] for _ in range(n)]
    # drafts of a step that was not gated (the selected lengths are cut on the device), or of no round the
    # plugin made (vLLM's zeroed drafts), are left alone
    from vllm_hybridspec.engine.length.selector import RoundLayout

    for round in (RoundLayout(drafts, torch.ones(n, dtype=torch.int32), {}), None):
        got, _ = wrapped(_fake_runner(round, async_scheduling=False))
        assert got == drafts.tolist()  # the lists vLLM made, untouched
    # async scheduling: the lists feed already-scheduled drafts, never cut here
    got, _ = wrapped(_fake_runner(_gated(drafts), async_scheduling=True))
    assert got == drafts.tolist()


def test_async_trimming_of_a_gated_step_cuts_every_draft_and_restores_prev_num_draft_len():
    """What the runner's own ngram_gpu path does, with every count 0: scheduled tokens lowered by the
    cut drafts, every request loses its entry, and prev_num_draft_len (set by _update_states from the
    cut lists) is put back to the scheduler's untrimmed count."""
    from types import SimpleNamespace

    from vllm_hybridspec.engine.length.trimming import _trimmed_update_states
    from vllm_hybridspec.engine.runner_state import state_of

    gen = torch.Generator().manual_seed(fresh_seed("vllm_contract_async_trimming_of_a_gated"))
    k, req_ids = 7, ["a", "b", "c", "d"]
    drafts = torch.randint(0, 100, (4, k), generator=gen)

    def scheduler_output():
        return SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(req_ids=req_ids),
                               scheduled_spec_decode_tokens={r: [-1] * k for r in req_ids},
                               num_scheduled_tokens={r: 1 + k for r in req_ids},
                               total_num_scheduled_tokens=4 * (1 + k))

    seen = {}

    def original(self, scheduler_output):
        seen["spec"] = {r: len(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
        for r in req_ids:  # what update_req_spec_token_ids does
            self.requests[r].prev_num_draft_len = len(scheduler_output.scheduled_spec_decode_tokens.get(r, ()))
        return "done"

    runner = _fake_runner(_gated(drafts), async_scheduling=True)
    runner.input_batch.req_id_to_index = {r: i for i, r in enumerate(req_ids)}
    runner.requests = {r: SimpleNamespace(prev_num_draft_len=None) for r in req_ids}
    out = scheduler_output()
    assert _trimmed_update_states(original)(runner, out) == "done"
    assert seen["spec"] == {}
    assert out.num_scheduled_tokens == {r: 1 for r in req_ids} and out.total_num_scheduled_tokens == 4
    assert {r: s.prev_num_draft_len for r, s in runner.requests.items()} == {r: k for r in req_ids}
    # a step that drafted (no gated round): nothing cut on the host
    state_of(runner).round = None
    out = scheduler_output()
    assert _trimmed_update_states(original)(runner, out) == "done"
    assert seen["spec"] == {r: k for r in req_ids} and out.total_num_scheduled_tokens == 4 * (1 + k)


def test_symbols_the_device_cut_relies_on_keep_their_shape():
    """``engine/length/cut.py``: the rejection sampler samples the bonus tokens once per step from
    ``logits[metadata.bonus_logits_indices]`` with ``predict_bonus_token=True`` and hands the sampled ids
    last to ``_get_logprobs_tensors``; the runner's ``_sample`` calls it with the metadata it is given;
    the MoE runner routes inside ``_apply_quant_method(hidden_states, router_logits, ...)`` and knows its
    top-k (``moe_config.experts_per_token``) and layer name; the runner
    buffers and forward-context functions the plan reads exist."""
    import dataclasses
    import inspect
    import re

    from vllm import forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def params(fn):
        return list(inspect.signature(inspect.unwrap(fn)).parameters)

    forward = re.sub(r"\s+", "", inspect.getsource(RejectionSampler.forward))
    assert "bonus_logits_indices=metadata.bonus_logits_indices" in forward
    assert "bonus_logits=logits[bonus_logits_indices]" in forward
    assert forward.count("self.sampler(") == 1 and "predict_bonus_token=True" in forward
    assert "bonus_token_ids=bonus_sampler_output.sampled_token_ids" in forward
    assert re.search(r"self\._get_logprobs_tensors\([^)]*output_token_ids,?\)", forward)
    assert params(RejectionSampler._get_logprobs_tensors)[-1] == "sampled_token_ids"
    assert {"bonus_logits_indices", "cu_num_draft_tokens"} <= {f.name for f in dataclasses.fields(SpecDecodeMetadata)}
    assert params(GPUModelRunner._sample) == ["self", "logits", "spec_decode_metadata"]
    sample = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(GPUModelRunner._sample)))
    assert "self.rejection_sampler(spec_decode_metadata," in sample
    assert params(MoERunner._apply_quant_method)[:3] == ["self", "hidden_states", "router_logits"]
    impl = inspect.getsource(MoERunner._forward_impl)
    assert "self._apply_quant_method(" in impl and "router_logits=router_logits" in impl
    # the calibration capture's expert ids: the MoE runner's config and layer name
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    assert "experts_per_token" in {f.name for f in dataclasses.fields(FusedMoEConfig)}
    runner_init = inspect.getsource(MoERunner.__init__)
    assert "self.moe_config = moe_config" in runner_init and "self.layer_name = layer_name" in runner_init
    init = inspect.getsource(GPUModelRunner.__init__)
    for buffer in ("self.query_start_loc =", "self.num_decode_draft_tokens =", "self.max_num_tokens =",
                   "self.rejection_sampler ="):
        assert buffer in init, buffer
    execute = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(GPUModelRunner.execute_model)))
    assert execute.index("self.synchronize_input_prep()") < execute.index("self._prepare_inputs(")
    assert callable(forward_context.get_forward_context) and callable(forward_context.is_forward_context_available)
    assert "no_compile_layers" in {f.name for f in dataclasses.fields(forward_context.ForwardContext)}
    # Stage 0 (the routing correction) finds the first MoE layer by its name, first in the list the
    # MoE layers register into while the model is built, and reads every row of query_start_loc, which
    # vLLM keeps non-decreasing past the step's rows and copies to the device whole
    from vllm.config.compilation import CompilationConfig
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    assert "static_all_moe_layers" in {f.name for f in dataclasses.fields(CompilationConfig)}
    register = re.sub(r"\s+", "", inspect.getsource(moe_runner.register_layer_for_moe_forward_op))
    assert "prefix=layer.layer_name" in register and "compilation_config.static_all_moe_layers.append(prefix)" in register
    prepare = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(GPUModelRunner._prepare_inputs)))
    assert "self.query_start_loc.np[num_reqs+1:].fill(cu_num_tokens[-1])" in prepare
    assert prepare.index("self.query_start_loc.np[num_reqs+1:].fill(") < prepare.index("self.query_start_loc.copy_to_gpu()")


def test_symbols_the_scheduler_gate_relies_on_keep_their_shape():
    """``engine/length/gate.py``: vLLM's dynamic speculative decoding reads the schedule at scheduler
    construction into ``dynamic_sd_lookup`` indexed by the step's request count; ``VllmConfig`` switches
    such engines to PIECEWISE in one method called from ``__post_init__``; the runner's drafting entry
    takes the scheduler output first and the spec metadata seventh; a step without spec decoding keeps
    the sampled tokens for the next step's inputs in bookkeeping when no round set them."""
    import dataclasses
    import inspect
    import re

    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.vllm import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def params(fn):
        return list(inspect.signature(inspect.unwrap(fn)).parameters)

    assert params(Scheduler.__init__)[:2] == ["self", "vllm_config"]
    init = inspect.getsource(inspect.unwrap(Scheduler.__init__))
    assert "self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(" in init
    schedule = re.sub(r"\s+", "", inspect.getsource(Scheduler.schedule))
    assert "num_spec_tokens_to_schedule=self.dynamic_sd_lookup[len(num_scheduled_tokens)]" in schedule
    assert params(build_dynamic_sd_schedule_lookup) == [
        "num_speculative_tokens_per_batch_size", "vllm_max_batch_size", "vllm_num_speculative_tokens"]
    assert "num_speculative_tokens_per_batch_size" in {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert "num_spec_tokens_to_schedule" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert "self._maybe_override_dynamic_sd_cudagraph_mode()" in inspect.getsource(VllmConfig.__post_init__)
    assert params(GPUModelRunner.propose_draft_token_ids)[:8] == [
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata"]
    bookkeeping = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "if self.input_batch.prev_sampled_token_ids is None:" in bookkeeping
    assert "self.input_batch.prev_sampled_token_ids = sampled_token_ids" in bookkeeping
    assert "instance_id" in {f.name for f in dataclasses.fields(VllmConfig)}


def test_tp_broadcast_is_a_no_op_without_tensor_parallelism():
    from vllm_hybridspec.engine.compat import broadcast_from_tp_rank0

    t = torch.arange(5, dtype=torch.int32)
    assert broadcast_from_tp_rank0(t) is t
