"""Reading the target's paged KV cache in place (H-Spec paper, section 3.3.2: the drafter's attention
attends to the target's K/V and keeps no cache of its own): the key and value views of vLLM's cache
layouts, the gather of a batch's prefix blocks, and, under tensor parallelism, the all-gather that
restores every KV head on each rank (the drafter is replicated)."""

from __future__ import annotations

import torch


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, heads: torch.Tensor, capacity: int) -> torch.Tensor:
    """``cache`` ``[num_blocks, kv_heads, block_size, D]``, ``blocks`` ``[N, n_blocks]`` long,
    ``heads`` ``arange(kv_heads)`` long -> ``[N, kv_heads, capacity, D]``: one gather kernel that
    writes the ``[N, kv_heads, n_blocks, block_size, D]`` layout directly (``cache[blocks]`` followed
    by a transpose would copy twice)."""
    x = cache[blocks[:, None, :], heads[None, :, None]]  # [N, kv_heads, n_blocks, block_size, D]
    N, n_heads, n_blocks, block_size, D = x.shape
    return x.reshape(N, n_heads, n_blocks * block_size, D)[:, :, :capacity]


def kv_halves_of(kv_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``k_cache`` and ``v_cache`` are exactly ``kv_cache[..., :D]`` and ``kv_cache[..., D:]``
    (the FLASH_ATTN / TRITON_ATTN layout), so one gather of ``kv_cache`` reads both."""
    D = k_cache.shape[-1]
    return (
        kv_cache.dim() == 4
        and tuple(kv_cache.shape) == (*k_cache.shape[:-1], 2 * D)
        and k_cache.shape == v_cache.shape
        and k_cache.stride() == v_cache.stride() == kv_cache.stride()
        and k_cache.dtype == v_cache.dtype == kv_cache.dtype
        and k_cache.data_ptr() == kv_cache.data_ptr()
        and v_cache.data_ptr() == kv_cache.data_ptr() + D * kv_cache.element_size()
    )


def all_kv_heads(kv: torch.Tensor, tp_size: int, total_heads: int) -> torch.Tensor:
    """``[N, h, T, D]`` of this rank's cache -> ``[N, total_heads, T, D]``, the target's KV heads in order.

    vLLM's QKV sharding: with at least as many KV heads as ranks, rank ``r`` caches heads
    ``[r * h, (r + 1) * h)`` (``h = total / tp``), and an all-gather in rank order restores them; with
    fewer, each head is replicated on ``tp / total`` consecutive ranks (``h = 1``), and every
    ``tp / total``-th of the gathered heads is a distinct one. A rank that already holds every head
    (``h = total``, e.g. ``tp = 1`` or a single KV head) gathers nothing."""
    heads = kv.shape[1]
    if heads == total_heads:
        return kv
    gathered = tp_all_gather(kv.contiguous(), dim=1)  # [N, tp * h, T, D]
    return gathered if heads * tp_size == total_heads else gathered[:, :: tp_size // total_heads]


def kv_heads_recoverable(per_rank: int, tp_size: int, total_heads: int) -> bool:
    """Whether :func:`all_kv_heads` can restore ``total_heads`` from ranks caching ``per_rank`` each: a
    rank holds all of them, an even shard of them, or one head replicated on ``tp / total`` ranks."""
    return (per_rank == total_heads or per_rank * tp_size == total_heads
            or (per_rank == 1 and total_heads < tp_size and tp_size % total_heads == 0))


def paged_kv_views(kv_cache, backend_name: str, head_size: int, cpu_isa: str | None = None):
    """The key and value views of one layer's paged KV cache, each
    ``[num_blocks, kv_heads, block_size, head_size]`` (strided views, no copy).

    vLLM 0.26's backends all allocate the logical shape ``(num_blocks, kv_heads, block_size,
    2 * head_size)`` (``get_kv_cache_shape``) but split it differently: ``FLASH_ATTN`` and
    ``TRITON_ATTN`` split the last axis into ``[K | V]``; ``CPU_ATTN``
    (``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackendImpl.forward``) views it as
    ``(num_blocks, kv_heads, 2 * block_size, head_size)`` and chunks the token axis, and its
    ``cpu_attn_reshape_and_cache`` op stores the key block transposed, ``[head_size, block_size]``, for
    the ``vec``/``vec16`` kernels (``cpu_isa``, the target layer's ``impl.isa``; the AMX and other
    layouts are not decoded here)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise RuntimeError(
            f"vLLM changed: expected a {backend_name} KV cache of shape (num_blocks, kv_heads, "
            f"block_size, {2 * head_size}), got {tuple(kv_cache.shape)}"
        )
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    if backend_name == "CPU_ATTN":
        if cpu_isa not in ("vec", "vec16"):
            raise NotImplementedError(
                f"the H-Spec drafter cannot read vLLM's CPU KV cache layout for isa={cpu_isa!r} "
                "(only 'vec' and 'vec16'; AMX is chosen for bf16 on AMX CPUs: use float32 there)"
            )
        keys = kv_cache.view(num_blocks, kv_heads, 2, head_size, block_size)[:, :, 0].transpose(-1, -2)
        values = kv_cache.view(num_blocks, kv_heads, 2, block_size, head_size)[:, :, 1]
        return keys, values
    if backend_name in ("FLASH_ATTN", "TRITON_ATTN"):
        return kv_cache.split(head_size, dim=-1)
    raise NotImplementedError(
        f"the H-Spec drafter reads the target's KV cache with the CPU_ATTN, FLASH_ATTN or TRITON_ATTN "
        f"backend; the target's full-attention layers use {backend_name} (choose one with "
        "--attention-backend)"
    )


def tp_all_gather(tensor, dim: int):
    """``vllm.distributed.tensor_model_parallel_all_gather``: the concatenation along ``dim`` of every
    TP rank's ``tensor``, in rank order. The H-Spec drafter is replicated on every rank and reads all of
    the target's KV heads, of which each rank caches its shard."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(tensor, dim=dim)
