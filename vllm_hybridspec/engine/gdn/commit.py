"""Committing a pending round (HybridSpec Eq. 7 for the state; the convolution window shifted by the
same ``m`` inputs), outside the fused verification: the conv windows of the rounds a step verifies,
and the flush of rounds that no verification will consume (``pending.py``)."""

from __future__ import annotations

import torch

from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths
from vllm_hybridspec.kernels.gdn import CompactFactors, VerifyFactors, gdn_commit, reconstruct_state
from vllm_hybridspec.kernels.gdn.conv import shift_conv_windows


def commit_conv_windows(layer, slots: torch.Tensor, slab: torch.Tensor, m: torch.Tensor) -> None:
    """Shift the conv window of every round ``i`` of ``layer`` by its ``m[i]`` pending inputs from its
    input slab (``kernels.gdn.conv.shift_conv_windows`` on the layer's pool)."""
    shift_conv_windows(vllm_cpu_gdn_paths().conv_view(layer), layer.input_slab, slots, slab, m, layer.slab_len)


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
