"""The vLLM 0.26 symbols the H-Spec drafting (``engine/drafting/``) relies on keep their shape: the K/V
vLLM's CPU attention backend writes (``cpu_attn_reshape_and_cache``, ``_get_attn_isa``) as
``paged_kv_views`` reads them, ``tensor_model_parallel_all_gather`` behind ``tp_all_gather``, and what
``GPUModelRunner.propose_draft_token_ids`` hands a DFlash proposer (``HSpecProposer`` and the replay's
subclass): the step's K (``SchedulerOutput.num_spec_tokens_to_schedule``), the anchors, the attention
metadata and the rejected counts."""

import torch


def test_paged_kv_views_read_what_the_cpu_backend_writes():
    """K/V written by vLLM's own CPU cache op come back through our views, for the layout vLLM picks on
    this machine (``_get_attn_isa``) and for every x86 layout the drafter decodes (``vec``, ``vec16``,
    ``amx``: the cache op is a layout op that runs on any x86 CPU)."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_hybridspec.engine.drafting.kv_cache import block_size_of, gather_blocks, paged_kv_views

    gen = torch.Generator().manual_seed(0)
    cases = [(dtype, block_size, head, _get_attn_isa(dtype, block_size, head))
             for dtype, block_size, head in ((torch.float32, 128, 32), (torch.float32, 16, 32), (torch.bfloat16, 32, 64))]
    cases += [(torch.float32, 32, 64, "vec"), (torch.bfloat16, 32, 80, "vec16"), (torch.bfloat16, 32, 64, "amx")]
    for dtype, block_size, head, isa in cases:
        heads, num_blocks, T = 2, 4, 2 * block_size + 3
        kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head, dtype=dtype)
        keys, values = paged_kv_views(kv_cache, "CPU_ATTN", head, isa)
        assert block_size_of(keys) == block_size_of(values) == block_size
        k = torch.randn(T, heads, head, generator=gen).to(dtype)
        v = torch.randn(T, heads, head, generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
        ops.cpu_attn_reshape_and_cache(k, v, *kv_cache.view(num_blocks, heads, 2 * block_size, head).chunk(2, dim=2),
                                       slots, isa)
        for view, want in ((keys, k), (values, v)):
            every_slot = gather_blocks(view, torch.arange(num_blocks)[None], torch.arange(heads), num_blocks * block_size)
            assert torch.equal(every_slot[0][:, slots].transpose(0, 1), want), (dtype, block_size, isa)


def test_the_dflash_branch_passes_the_step_k_and_the_anchor():
    """``GPUModelRunner.propose_draft_token_ids`` hands a DFlash proposer (``HSpecProposer`` and the
    replay's subclass) the step's K (vLLM's dynamic speculative decoding:
    ``SchedulerOutput.num_spec_tokens_to_schedule``), the anchors, the attention metadata and the
    rejected counts that ``HSpecProposer.propose`` takes the prefix lengths from."""
    import dataclasses
    import inspect
    import re

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = re.sub(r"\s+", "", inspect.getsource(inspect.unwrap(GPUModelRunner.propose_draft_token_ids)))
    assert "num_spec_tokens_to_schedule=scheduler_output.num_spec_tokens_to_schedule" in source
    branch = source.split("orspec_config.use_dflash()", 1)[1]
    call = branch.split("draft_token_ids=self.drafter.propose(", 1)[1].split(")", 1)[0]
    for argument in ("num_speculative_tokens=num_spec_tokens_to_schedule", "next_token_ids=next_token_ids",
                     "common_attn_metadata=common_attn_metadata", "num_rejected_tokens_gpu=num_rejected_tokens_gpu"):
        assert argument in call, argument
    assert "num_spec_tokens_to_schedule" in {f.name for f in dataclasses.fields(SchedulerOutput)}


def test_tp_all_gather_is_vllms_tensor_parallel_all_gather():
    import inspect

    from vllm import distributed

    from vllm_hybridspec.engine.drafting.kv_cache import tp_all_gather

    fn = distributed.tensor_model_parallel_all_gather
    assert list(inspect.signature(fn).parameters) == ["input_", "dim"]
    assert "get_tp_group().all_gather(input_, dim)" in inspect.getsource(fn)
    assert "tensor_model_parallel_all_gather(tensor, dim=dim)" in inspect.getsource(tp_all_gather)
