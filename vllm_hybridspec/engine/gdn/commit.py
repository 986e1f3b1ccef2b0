"""Committing a pending round (HybridSpec Eq. 7 for the state; the convolution window shifted by the
same ``m`` inputs), outside the fused verification: the conv windows of the rounds a step verifies,
and the flush of rounds that no verification will consume (``pending.py``)."""

from __future__ import annotations

import torch

from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths
from vllm_hybridspec.kernels.gdn import CompactFactors, VerifyFactors, gdn_commit, reconstruct_state


def commit_conv_windows(layer, slots: torch.Tensor, slab: torch.Tensor, m: torch.Tensor) -> None:
    """Shift the conv window of every round ``i`` by its ``m[i]`` pending inputs: the window becomes
    the last ``W = K_conv - 1`` columns of ``[window ; inputs 0..m-1 of slab[i]]``. ``slots``, ``slab``,
    ``m``: ``[n]`` (slot 0, vLLM's null block, and ``m = 0`` leave a window as it is). Pure copies
    with device indices (CUDA-graph safe); the windows are read before any is written."""
    conv = vllm_cpu_gdn_paths().conv_view(layer).transpose(-1, -2)  # [slots, W, conv_dim] view
    x_slab = layer.input_slab  # [(E + 1) * S, conv_dim]
    W = conv.shape[1]
    n = slots.shape[0]
    S = layer.slab_len
    slots = slots.long()
    m = torch.where(slots > 0, m.long().clamp(0, S), 0)  # [n]
    j = m[:, None] + torch.arange(W, device=m.device)[None]  # [n, W]: column of [window ; inputs]
    old = conv.index_select(0, slots)  # [n, W, D]
    from_window = old.gather(1, j.clamp(max=W - 1)[..., None].expand(n, W, old.shape[-1]))
    rows = (slab.long()[:, None] * S + (j - W).clamp(min=0)).reshape(-1)
    from_inputs = x_slab.index_select(0, rows).view(n, W, -1).to(conv.dtype)
    conv.index_copy_(0, slots, torch.where((j < W)[..., None], from_window, from_inputs))


def commit_state_cpu(state: torch.Tensor, slabs: CompactFactors, slab_len: int, entries: list[int],
                     slots: list[int], ms: list[int]) -> None:
    """``S_m`` from the stored factors for each (entry, slot, m), in place (``state`` ``[slots, HV, V,
    K]``, any strides; the torch reference :func:`reconstruct_state`, CPU path)."""
    for e, slot, m in zip(entries, slots, ms):
        if slot > 0 and m > 0:
            rows = slice(e * slab_len, (e + 1) * slab_len)
            f = CompactFactors(slabs.z[rows], slabs.k[rows], slabs.g_cum[rows])
            state[slot] = reconstruct_state(state[slot].float(), f, m).to(state.dtype)


def flush_rounds(layers: list, entries: list[int], slots: list[int], slabs: list[int],
                 m_of_slab: torch.Tensor) -> None:
    """Commit the pending rounds in ``entries`` (slab ids ``slabs``, state ``slots``) of every layer of
    one KV-cache group: the conv windows (:func:`commit_conv_windows`) and the states (``gdn_commit``
    per layer; the torch reference on the CPU), with ``m`` from ``m_of_slab`` on the device. Runs
    before a forward, outside any CUDA graph, and only when a step does not verify a request that
    holds a pending round (drafting turned off, a row taking vLLM's path, a request left out)."""
    if not layers or not entries:
        return
    device = m_of_slab.device
    slab_dev = torch.tensor(slabs, dtype=torch.int32).to(device, non_blocking=True)
    slots_dev = torch.tensor(slots, dtype=torch.int32).to(device, non_blocking=True)
    m_dev = m_of_slab.index_select(0, slab_dev.long())
    for layer in layers:
        commit_conv_windows(layer, slots_dev, slab_dev, m_dev)
    S = layers[0].slab_len
    if not layers[0].kernels:
        ms = m_dev.tolist()
        for layer in layers:
            commit_state_cpu(layer.state_pool(), layer.factor_slabs, S, entries, slots, ms)
        return
    # gdn_commit reads rows cu[i] .. cu[i] + m[i] - 1: an entry's first rows (cu[N] is not read)
    cu = torch.tensor([e * S for e in entries] + [0], dtype=torch.int32).to(device, non_blocking=True)
    for layer in layers:
        f = layer.factor_slabs
        gdn_commit(layer.state_pointers(), VerifyFactors(f.z[None], f.k[None], f.g_cum[None]), cu, slots_dev, m_dev)
