"""Reading the target's paged KV cache in place (H-Spec paper, section 3.3.2: the drafter's attention
attends to the target's K/V and keeps no cache of its own): the key and value views of vLLM's cache
layouts, the gather of a batch's prefix blocks, and, under tensor parallelism, the all-gather that
restores every KV head on each rank (the drafter is replicated)."""

from __future__ import annotations

import torch


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, heads: torch.Tensor, capacity: int) -> torch.Tensor:
    """``cache`` a view of :func:`paged_kv_views` (``[num_blocks, kv_heads, block_size, D]``, or the
    AMX layout's ``[num_blocks, kv_heads, block_size / b, b, D / h, h]``), ``blocks`` ``[N, n_blocks]``
    long, ``heads`` ``arange(kv_heads)`` long -> ``[N, kv_heads, capacity, D]``: one gather kernel that
    writes the ``[N, kv_heads, n_blocks, block_size, D]`` layout directly (``cache[blocks]`` followed
    by a transpose would copy twice)."""
    x = cache[blocks[:, None, :], heads[None, :, None]]  # [N, kv_heads, n_blocks, *token axes, *head axes]
    N, n_heads = x.shape[:2]
    return x.reshape(N, n_heads, -1, head_size_of(cache))[:, :, :capacity]


def block_size_of(view: torch.Tensor) -> int:
    """The tokens per block of a K or V view of :func:`paged_kv_views`."""
    return view.shape[2] if view.dim() == 4 else view.shape[2] * view.shape[3]


def head_size_of(view: torch.Tensor) -> int:
    """The head size of a K or V view of :func:`paged_kv_views`."""
    return view.shape[-1] if view.dim() == 4 else view.shape[-2] * view.shape[-1]


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
    """The key and value views of one layer's paged KV cache (strided views, no copy), each
    ``[num_blocks, kv_heads, block_size, head_size]``, or for the AMX layout
    ``[num_blocks, kv_heads, block_size / b, b, head_size / h, h]`` (:func:`amx_kv_views`; token
    ``t = t1 * b + t0``, dimension ``d = d1 * h + d0``; :func:`gather_blocks`, :func:`block_size_of` and
    :func:`head_size_of` read both).

    vLLM 0.26's backends all allocate the logical shape ``(num_blocks, kv_heads, block_size,
    2 * head_size)`` (``get_kv_cache_shape``) but split it differently: ``FLASH_ATTN`` and
    ``TRITON_ATTN`` split the last axis into ``[K | V]``; ``CPU_ATTN``
    (``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackendImpl.forward``) views it as
    ``(num_blocks, kv_heads, 2 * block_size, head_size)`` and chunks the token axis, and its
    ``cpu_attn_reshape_and_cache`` op stores each half as the kernel of ``cpu_isa`` (the target layer's
    ``impl.isa``) reads it: for ``vec``/``vec16`` the key block transposed, ``[head_size, block_size]``,
    and the value block as it is; for ``amx`` in AMX tiles (:func:`amx_kv_views`)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise RuntimeError(
            f"vLLM changed: expected a {backend_name} KV cache of shape (num_blocks, kv_heads, "
            f"block_size, {2 * head_size}), got {tuple(kv_cache.shape)}"
        )
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    if backend_name == "CPU_ATTN":
        if cpu_isa == "amx":
            return amx_kv_views(kv_cache)
        if cpu_isa not in ("vec", "vec16"):
            raise NotImplementedError(
                f"the H-Spec drafter cannot read vLLM's CPU KV cache layout for isa={cpu_isa!r} "
                "(only 'vec', 'vec16' and 'amx', the x86 layouts; the ARM, RISC-V, POWER and s390x ones are not "
                "decoded)"
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


# vLLM 0.26 csrc/cpu/cpu_attn_amx.hpp: a tile row is 64 bytes, a B tile's N is 16 (64 bytes / 4), and
# the dot product (tdpbf16ps) pairs 4 / sizeof(bf16) = 2 consecutive elements of its K axis
AMX_TILE_ROW_BYTES = 64
AMX_B_TILE_N = AMX_TILE_ROW_BYTES // 4
AMX_PAIR = 2


def amx_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value views of a bf16 KV cache ``(num_blocks, kv_heads, block_size, 2 * head_size)``
    in the layout vLLM 0.26's ``AttentionImpl<ISA::AMX>::reshape_and_cache`` (``csrc/cpu/cpu_attn_amx.hpp``)
    writes, each half being ``block_size * head_size`` elements of one (block, head):

    - keys ``[block_size / 16, head_size / 2, 16, 2]``: tokens in groups of 16 (the B tile's N), and
      within a group each token's dimension pair ``(2p, 2p + 1)`` is one 4-byte quad-word, so
      ``key[t, d]`` is at ``[t // 16, d // 2, t % 16, d % 2]``;
    - values ``[head_size / 16, block_size / 2, 16, 2]``: dimensions in groups of 16, and within a
      group the token pair ``(2s, 2s + 1)`` of one dimension is one quad-word, so ``value[t, d]`` is at
      ``[d // 16, t // 2, d % 16, t % 2]``.

    Returned as ``[num_blocks, kv_heads, block_size / b, b, head_size / h, h]`` strided views (keys
    ``b = 16, h = 2``; values ``b = 2, h = 16``) whose axes run in token-then-dimension order."""
    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    D = two_d // 2
    if kv_cache.element_size() != 2 or block_size % (2 * AMX_B_TILE_N) or D % AMX_B_TILE_N:
        raise NotImplementedError(
            f"vLLM's AMX KV cache layout is decoded for 2-byte (bf16) caches with a block size divisible by "
            f"32 and a head size divisible by 16; got {kv_cache.dtype}, block size {block_size}, head size {D}"
        )
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != two_d:
        raise RuntimeError(f"vLLM changed: expected a contiguous (block_size, 2 * head_size) page per head, got "
                           f"strides {kv_cache.stride()}")
    n, pair = AMX_B_TILE_N, AMX_PAIR
    offset = kv_cache.storage_offset()
    keys = kv_cache.as_strided(
        (num_blocks, kv_heads, block_size // n, n, D // pair, pair),
        (s_block, s_head, n * D, pair, n * pair, 1), offset)
    values = kv_cache.as_strided(
        (num_blocks, kv_heads, block_size // pair, pair, D // n, n),
        (s_block, s_head, n * pair, 1, block_size * n, pair), offset + block_size * D)
    return keys, values


def tp_all_gather(tensor, dim: int):
    """``vllm.distributed.tensor_model_parallel_all_gather``: the concatenation along ``dim`` of every
    TP rank's ``tensor``, in rank order. The H-Spec drafter is replicated on every rank and reads all of
    the target's KV heads, of which each rank caches its shard."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(tensor, dim=dim)
