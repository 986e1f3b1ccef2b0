"""The vLLM 0.26 symbols the replay relies on (engine/replay/proposer.py, lookup.py) keep their shape.

The replay is served through vLLM's "dflash" route as an H-Spec proposer; what H-Spec itself needs of
that route (the arguments the runner's DFlash branch passes to ``propose``, the step's K among them)
is checked in ``tests/engine/drafting/test_vllm_contract.py``. Here: what the replay adds. It patches
nothing."""

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
