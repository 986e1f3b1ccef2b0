"""The vLLM 0.26 symbols the replay relies on (engine/replay/proposer.py, lookup.py) keep their shape.

The replay is served through vLLM's "dflash" route as an H-Spec proposer; what H-Spec itself needs of
that route is checked in ``tests/engine/test_vllm_internals.py``. Here: what the replay adds."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import get_args


def _source(fn) -> str:
    return re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(fn)))


def test_dflash_keeps_async_scheduling():
    """``VllmConfig.__post_init__`` leaves async scheduling on (its default) for the methods of
    ``EagleModelTypes``, "dflash" among them; the custom_class route lost it."""
    from vllm.config.speculative import EagleModelTypes
    from vllm.config.vllm import VllmConfig

    def flatten(tp):
        args = get_args(tp)
        return [tp] if not args and isinstance(tp, str) else [s for a in args for s in flatten(a)]

    assert "dflash" in flatten(EagleModelTypes) and "custom_class" not in flatten(EagleModelTypes)
    source = _source(VllmConfig.__post_init__)
    assert "self.speculative_config.methodnotinget_args(EagleModelTypes)" in source
    assert "self.scheduler_config.async_scheduling=True" in source


def test_the_dflash_branch_passes_the_step_k_and_the_anchor():
    """``GPUModelRunner.propose_draft_token_ids`` hands a DFlash proposer the step's K (vLLM's dynamic
    speculative decoding: ``SchedulerOutput.num_spec_tokens_to_schedule``), the anchors, the attention
    metadata and the rejected counts the replay's ``prefix_lens`` come from (``HSpecProposer.propose``)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = _source(GPUModelRunner.propose_draft_token_ids)
    assert "num_spec_tokens_to_schedule=scheduler_output.num_spec_tokens_to_schedule" in source
    branch = source.split("orspec_config.use_dflash()", 1)[1]
    call = branch.split("draft_token_ids=self.drafter.propose(", 1)[1].split(")", 1)[0]
    for argument in ("num_speculative_tokens=num_spec_tokens_to_schedule", "next_token_ids=next_token_ids",
                     "common_attn_metadata=common_attn_metadata", "num_rejected_tokens_gpu=num_rejected_tokens_gpu"):
        assert argument in call, argument
    assert "num_spec_tokens_to_schedule" in {f.name for f in dataclasses.fields(SchedulerOutput)}


def test_what_the_lookup_reads_of_a_request():
    """``ReplayLookup.rows`` reads ``runner.requests[req_id]`` (a ``CachedRequestState``: its prompt
    tokens, prompt length and sampling parameters' ``max_tokens``) for the rows of
    ``runner.input_batch.req_ids``, and the runner's ``max_model_len`` bounds the output."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = {f.name for f in dataclasses.fields(CachedRequestState)}
    assert {"prompt_token_ids", "sampling_params"} <= fields
    assert "self.num_prompt_tokens=" in _source(CachedRequestState.__post_init__)
    assert isinstance(InputBatch.req_ids, property)
    init = _source(GPUModelRunner.__init__)
    assert "self.requests:dict[str,CachedRequestState]={}" in init and "self.max_model_len=" in init
