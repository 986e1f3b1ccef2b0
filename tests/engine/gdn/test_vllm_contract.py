"""The vLLM 0.26 symbols the one-slot GDN layer (``engine/gdn/``) relies on keep their shape, and our GDN
kernels agree with vLLM's own: vLLM's spec-decode GDN kernel (``fused_sigmoid_gating_delta_rule_update``,
one state slot per draft token, found by ``engine/gdn/vllm_path.py``), ``QwenGatedDeltaNetAttention``
(a ``PluggableLayer``: ``op_registry_oot``), ``MambaStateShapeCalculator``, ``MambaSpec``,
``GDNAttentionMetadata`` and its builder, the commit hook ``GPUModelRunner._update_states_after_model_execute``,
and the pending rounds' runner patches (``engine/gdn/runner.py``: ``_prepare_inputs``,
``execute_model``, ``_dummy_run``, the input batch's block tables and the scheduler output)."""

import importlib

import torch
from vllm_hybridspec.kernels.gdn import VerifyFactors, gdn_commit, gdn_verify

from vllm_hybridspec.engine.gdn.vllm_path import (
    FUSED_SIGMOID_GATING_FILE,
    load_vllm_spec_decode_gdn_kernel,
    vllm_package_dir,
)

from ...kernels.gdn_inputs import random_round, random_states, rel_err


def test_vllm_spec_decode_gdn_kernel_is_where_we_expect_it():
    assert (vllm_package_dir() / FUSED_SIGMOID_GATING_FILE).exists()
    source = (vllm_package_dir() / "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py").read_text()
    # vLLM's spec-decode GDN path: one state slot per draft token, selected by num_accepted_tokens
    assert "ssm_state_indices=spec_state_indices_tensor" in source
    assert "num_accepted_tokens=num_accepted_tokens" in source


def test_our_verify_and_commit_equal_vllm_per_token_state_path():
    """Same round through vLLM's kernel (a state slot per token) and ours (one slot + factors)."""
    gen = torch.Generator().manual_seed(42)
    HK, HV, K, V = 2, 4, 16, 32
    lengths, prev_accepted, commits = [5, 3, 8], [2, 1, 4], [3, 3, 1]
    W = max(lengths)
    N = len(lengths)
    r = random_round(gen, lengths, HK, HV, K, V)
    pool = random_states(gen, 1 + N * W, HV, V, K)
    # vLLM: row n holds the slots of sequence n's tokens; the round starts from column accepted-1
    spec_idx = (torch.randperm(N * W, generator=gen) + 1).view(N, W).to(torch.int32)
    vllm_pool = pool.clone()
    fused_sigmoid_gating_delta_rule_update = load_vllm_spec_decode_gdn_kernel()
    o_vllm, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=r.A_log, a=r.a, b=r.b, dt_bias=r.dt_bias, q=r.q[None], k=r.k[None], v=r.v[None],
        initial_state=vllm_pool, inplace_final_state=True, cu_seqlens=r.cu_seqlens,
        ssm_state_indices=spec_idx, num_accepted_tokens=torch.tensor(prev_accepted, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    # ours: one slot per sequence, the one vLLM starts from
    ours_pool = pool.clone()
    slots = torch.tensor([int(spec_idx[n, prev_accepted[n] - 1]) for n in range(N)], dtype=torch.int32)
    o, f = gdn_verify(r.q, r.k, r.v, g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias,
                      state=ours_pool, state_indices=slots, cu_seqlens=r.cu_seqlens, max_len=W)
    assert rel_err(o, o_vllm[0]) < 1e-5
    gdn_commit([ours_pool], VerifyFactors(f.z[None], f.k[None], f.g_cum[None]), r.cu_seqlens,
               slots, torch.tensor(commits, dtype=torch.int32))
    for n in range(N):
        vllm_state = vllm_pool[int(spec_idx[n, commits[n] - 1])]
        assert rel_err(ours_pool[int(slots[n])], vllm_state) < 1e-5, n


def test_symbols_the_one_slot_gdn_layer_relies_on_keep_their_shape():
    import dataclasses
    import inspect
    import re

    from vllm.model_executor import custom_op
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.platforms import interface
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_hybridspec.engine import patches
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    # PluggableLayer: instantiation looks the class name up in op_registry_oot
    layer_row = next(r for r in patches.rows(feature="gdn") if r.attr == "register_oot")
    assert QwenGatedDeltaNetAttention.__name__ == layer_row.key
    assert "op_registry_oot[layer_class_name]" in inspect.getsource(custom_op.PluggableLayer.__new__)
    patches.apply_row(layer_row)
    patches.apply_row(layer_row)  # idempotent
    assert custom_op.op_registry_oot[layer_row.key] is HSpecQwenGDN
    for module in ("qwen3_next", "qwen3_5"):
        source = inspect.getsource(importlib.import_module(f"vllm.model_executor.models.{module}"))
        assert "QwenGatedDeltaNetAttention(" in source, module
    # the projections HSpecQwenGDN.forward_cpu repeats, and the core op it replaces
    forward_cpu = inspect.getsource(QwenGatedDeltaNetAttention.forward_cpu)
    for piece in ("self.in_proj_qkvz(hidden_states)", "self.in_proj_ba(hidden_states)",
                  "self.fix_query_key_value_ordering(", "torch.ops.vllm.cpu_gdn_attention_core(",
                  "self.norm(core_attn_out, z)", "self.out_proj(core_attn_out)"):
        assert piece in forward_cpu, piece
    # the state spec: get_state_shape reads self.num_spec, get_kv_cache_spec builds a MambaSpec
    assert "self.num_spec" in inspect.getsource(QwenGatedDeltaNetAttention.get_state_shape)
    assert "num_spec" in inspect.signature(MambaStateShapeCalculator.gated_delta_net_state_shape).parameters
    assert "num_speculative_blocks" in {f.name for f in dataclasses.fields(MambaSpec)}
    assert "MambaSpec(" in inspect.getsource(MambaBase.get_kv_cache_spec)
    # the builder's metadata fields the layer reads
    used = {"num_prefills", "num_decodes", "num_spec_decodes", "num_spec_decode_tokens", "num_actual_tokens",
            "spec_sequence_masks", "spec_token_indx", "non_spec_token_indx", "spec_query_start_loc",
            "spec_state_indices_tensor", "num_prefill_tokens", "non_spec_query_start_loc",
            "non_spec_state_indices_tensor", "has_initial_state"}
    assert used <= {f.name for f in dataclasses.fields(GDNAttentionMetadata)}
    # rows without drafts next to spec rows: the builder counts them as prefills (SpecLayout.read relies
    # on it to find one-token rows from host ints) and gives them one state slot each
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    build = inspect.getsource(GDNAttentionMetadataBuilder.build).replace(" ", "")
    assert "ifnum_decodes>0andnum_spec_decodes>0:\nnum_prefills+=num_decodes" in build
    assert "non_spec_state_indices_tensor=block_table_tensor[\n~spec_sequence_masks_cpu,0\n]" in build
    assert "has_initial_state=has_initial_state[~spec_sequence_masks_cpu]" in build
    # the commit hook: called by sample_tokens with the rejection sampler's output
    hook = getattr(GPUModelRunner._update_states_after_model_execute, "__wrapped__",
                   GPUModelRunner._update_states_after_model_execute)
    assert list(inspect.signature(hook).parameters) == ["self", "output_token_ids", "scheduler_output"]
    assert "self._update_states_after_model_execute(\n            sampler_output.sampled_token_ids" in \
        inspect.getsource(GPUModelRunner.sample_tokens)
    # ... which first counts each row's kept tokens into num_accepted_tokens.gpu for every hybrid model
    # with a speculative config (PendingRounds.sampled takes its m from there, engine/gdn/runner.py)
    body = re.sub(r"\s+", "", inspect.getsource(hook))
    assert "ifnotself.speculative_configornotself.model_config.is_hybrid:return" in body
    assert "self.num_accepted_tokens.gpu[:num_reqs]=(output_token_ids!=-1).sum(dim=1)" in body
    assert body.index("self.num_accepted_tokens.gpu[:num_reqs]=") < body.index("ifself.cache_config.mamba_cache_mode")
    # the page size comes from the model class before any layer exists
    assert "model_cls.get_mamba_state_shape_from_config(vllm_config)" in inspect.getsource(interface)
    page_rows = [r for r in patches.rows(feature="gdn") if r.attr == "get_mamba_state_shape_from_config"]
    assert [r.owner.rpartition(":")[2] for r in page_rows] == [
        "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
    for row in page_rows:
        cls, name = patches.resolve(row.owner), row.owner
        method = inspect.getattr_static(cls, "get_mamba_state_shape_from_config", None)
        assert method is not None and isinstance(method, classmethod), name
        assert list(inspect.signature(cls.get_mamba_state_shape_from_config).parameters) == ["vllm_config"]
    # GPU: vLLM's custom op dispatches to the layer's _forward_core, which HSpecQwenGDN overrides and
    # calls (for rows without drafts) on a dataclasses.replace of the metadata without spec rows
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    assert "self._forward_core(\n            mixed_qkv=qkv_or_qkvz," in inspect.getsource(
        qwen_gdn_linear_attn.qwen_gdn_attention_core)
    assert list(inspect.signature(QwenGatedDeltaNetAttention._forward_core).parameters) == [
        "self", "mixed_qkv", "b", "a", "core_attn_out"]
    # float32 targets on a GPU: the layer's prefill op is the attribute chunk_gated_delta_rule, called
    # with these keywords (HSpecQwenGDN swaps in cpu_gdn.TorchChunkGatedDeltaRule)
    core_src = inspect.getsource(QwenGatedDeltaNetAttention._forward_core)
    assert "= self.chunk_gated_delta_rule(" in core_src
    assert "self.chunk_gated_delta_rule = ChunkGatedDeltaRule()" in inspect.getsource(
        QwenGatedDeltaNetAttention.__init__)
    assert list(inspect.signature(qwen_gdn_linear_attn.ChunkGatedDeltaRule.forward_native).parameters) == [
        "self", "q", "k", "v", "g", "beta", "initial_state", "output_final_state", "cu_seqlens",
        "chunk_indices", "chunk_offsets", "use_qk_l2norm_in_kernel", "core_attn_out"]
    assert "initial_state = ssm_state[prefill_state_indices]" in core_src  # [N, HV, V, K], no transpose
    assert dataclasses.is_dataclass(GDNAttentionMetadata)
    assert {"num_accepted_tokens", "non_spec_query_start_loc", "non_spec_state_indices_tensor",
            "prefill_query_start_loc", "prefill_state_indices"} <= {f.name for f in dataclasses.fields(GDNAttentionMetadata)}


def test_symbols_the_pending_rounds_rely_on_keep_their_shape():
    """The one-slot layer's runner patches (``engine/gdn/runner.py``): the plan is computed after
    ``_prepare_inputs`` (inside ``synchronize_input_prep``, which guards the pinned host buffers), from
    the draft counts ``_prepare_inputs`` writes for the GDN builder, the input batch's row order,
    computed tokens and block tables, and the scheduler's finished, preempted and resumed requests;
    dummy runs and captures go through ``_dummy_run``."""
    import dataclasses
    import inspect

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.block_table import BlockTable, MultiGroupBlockTable
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = inspect.getsource(getattr(GPUModelRunner._prepare_inputs, "__wrapped__", GPUModelRunner._prepare_inputs))
    assert "self.num_decode_draft_tokens.np[:num_reqs] = num_decode_draft_tokens" in prepare
    assert "if num_scheduled_tokens[req_idx] == draft_len + 1:" in prepare
    execute = inspect.getsource(GPUModelRunner.execute_model)
    assert execute.index("self.synchronize_input_prep()") < execute.index("self._prepare_inputs(") < execute.index(
        "self._model_forward(")
    assert "self.num_decode_draft_tokens.cpu[" in inspect.getsource(GPUModelRunner._build_attention_metadata)
    assert callable(GPUModelRunner._dummy_run)
    assert "self.num_computed_tokens_cpu = " in inspect.getsource(InputBatch.__init__)
    assert callable(BlockTable.get_numpy_array) and callable(MultiGroupBlockTable.__getitem__)
    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"finished_req_ids", "preempted_req_ids", "scheduled_spec_decode_tokens", "num_scheduled_tokens",
            "scheduled_cached_reqs"} <= fields
    assert "resumed_req_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}
    assert "kv_cache_groups" in inspect.getsource(GPUModelRunner.initialize_kv_cache)


def test_symbols_the_one_slot_metadata_builder_relies_on_keep_their_shape():
    """``engine/gdn/metadata.py`` subclasses vLLM's GDN metadata builder: the layer's backend gives the
    builder class (``MambaBase.get_attn_backend``, ``GDNAttentionBackend.get_builder_cls``); the runner
    passes the rows' draft counts and accepted counts to GDN builders by keyword, builds once per
    group from shallow copies of one ``CommonAttentionMetadata`` (one ``query_start_loc`` object per
    step) and reuses a build only for builders that support ``update_block_table`` (GDN's does not); the
    short path mirrors ``build``'s pure spec branch and its full-graph buffer copies, whose buffers it
    shares between groups."""
    import inspect
    import re

    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "get_attn_backend" in vars(MambaBase)
    assert GDNAttentionBackend.get_builder_cls() is GDNAttentionMetadataBuilder
    assert list(inspect.signature(GDNAttentionMetadataBuilder.build).parameters) == [
        "self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens", "num_decode_draft_tokens_cpu",
        "fast_build"]
    assert not GDNAttentionMetadataBuilder.supports_update_block_table
    runner = re.sub(r"\s+", "", inspect.getsource(GPUModelRunner._build_attention_metadata))
    assert "num_decode_draft_tokens_cpu=self.num_decode_draft_tokens.cpu[:num_reqs_padded]" in runner
    assert "cm=copy(cm_base)" in runner
    build = re.sub(r"\s+", "", inspect.getsource(GDNAttentionMetadataBuilder.build))
    for line in (
            ".sum().item()==0",  # no draft in the batch: plain decoding's metadata
            "spec_sequence_masks_cpu=num_decode_draft_tokens_cpu>=0",
            "spec_token_size=min(num_spec_decodes*(self.num_spec+1),query_start_loc_cpu[-1].item(),)",
            "spec_state_indices_tensor=block_table_tensor[spec_sequence_masks_cpu,:self.num_spec+1]",
            "spec_query_start_loc=query_start_loc[:num_spec_decodes+1]",
            "num_accepted_tokens=num_accepted_tokens[spec_sequence_masks_cpu]",
            "spec_state_indices_tensor[num_spec_decodes:].fill_(NULL_BLOCK_ID)",
            "spec_query_start_loc[num_spec_decodes+1:].fill_(spec_num_query_tokens)",
            "num_accepted_tokens[num_spec_decodes:].fill_(1)",
            "self.spec_token_indx[:spec_token_indx.size(0)].copy_(spec_token_indx,non_blocking=True)"):
        assert line in build, line
    from vllm_hybridspec.engine.gdn.metadata import SHARED_BUFFERS

    init = inspect.getsource(GDNAttentionMetadataBuilder.__init__)
    for name in SHARED_BUFFERS:
        assert f"self.{name}: torch.Tensor = torch.empty(" in init, name
