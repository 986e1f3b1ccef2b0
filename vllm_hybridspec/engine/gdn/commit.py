"""The one-slot GDN layer's commit after rejection sampling: every layer's verified round rebuilds
``S_m`` (HybridSpec Eq. 7) and shifts its conv window by the same ``m`` tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hybridspec.engine.cpu.core import vllm_cpu_gdn_paths
from vllm_hybridspec.engine.gdn.layout import SpecLayout, _layouts
from vllm_hybridspec.kernels.gdn import CompactFactors, VerifyFactors


@dataclass
class VerifiedRound:
    """What a layer keeps between verify (forward) and commit (after rejection sampling).

    layout: the round's :class:`SpecLayout` (rows, slots, token offsets); x: the spec sequences'
    pre-conv inputs ``[T_spec, conv_dim]`` (model dtype), packed as ``layout.cu`` (one copy per
    layer rather than one per sequence); factors: per sequence :class:`CompactFactors` (CPU), or the
    batch's ``VerifyFactors`` ``[T_spec, ...]`` from ``gdn_verify`` (GPU)."""

    layout: SpecLayout
    x: torch.Tensor
    factors: list[CompactFactors] | VerifyFactors


def commit_rounds(runner, sampled_token_ids: torch.Tensor, scheduler_output=None) -> None:
    """After rejection sampling: commit every one-slot GDN layer's verified round.
    sampled_token_ids ``[num_reqs, max_spec_len + 1]`` with -1 after each row's accepted tokens
    (``m`` = accepted drafts + 1 = the non-(-1) count). On a GPU no device->host read: ``m`` stays
    on the device for both the states (``gdn_commit``) and the conv windows (:func:`_commit_convs_gpu`)."""
    from vllm_hybridspec.engine.gdn.layer import HSpecQwenGDN

    layers = [layer for layer in runner.compilation_config.static_forward_context.values()
              if isinstance(layer, HSpecQwenGDN) and layer.verified_round is not None]
    _layouts.clear()  # this step's layouts live on in the verified rounds; the next step reads anew
    if layers and scheduler_output is not None and not scheduler_output.scheduled_spec_decode_tokens:
        # this step verified no draft, so a round still held was left by a forward that sampled nothing
        # (a dummy batch) and its step ran as a full-graph replay, which runs no Python to clear it
        for layer in layers:
            layer.verified_round = None
        return
    if not layers:
        return
    num_committed_dev = (sampled_token_ids != -1).sum(dim=1)
    if sampled_token_ids.is_cuda:
        # no device->host read: states and conv windows are committed from device tensors
        _commit_states_gpu(layers, num_committed_dev)
        _commit_convs_gpu(layers, num_committed_dev)
    else:
        num_committed = num_committed_dev.tolist()  # CPU tensors: no sync to save
        for layer in layers:
            layer.commit_state_cpu(num_committed)
            layer.commit_conv(num_committed)
    for layer in layers:
        layer.verified_round = None


def _commit_states_gpu(layers, num_committed_dev) -> None:
    """``gdn_commit``: one launch per set of layers that share state slots (vLLM's hybrid allocator
    gives each KV-cache group of GDN layers its own block ids). The offsets, slots and rows are the
    layout's device tensors: no host->device copies (each was a stream sync)."""
    from vllm_hybridspec.kernels.gdn import gdn_commit

    groups: dict[tuple, list] = {}
    for layer in layers:
        groups.setdefault(layer.verified_round.layout.key, []).append(layer)
    for group in groups.values():
        rounds = [layer.verified_round for layer in group]
        layout = rounds[0].layout  # the group's layouts are equal (same key, same batch rows)
        factors = VerifyFactors(torch.stack([r.factors.z for r in rounds]), torch.stack([r.factors.k for r in rounds]),
                                torch.stack([r.factors.g_cum for r in rounds]))
        gdn_commit([layer.kv_cache[1] for layer in group], factors, layout.cu_dev, layout.slots_dev,
                   layout.committed(num_committed_dev).to(torch.int32))


def _commit_convs_gpu(layers, num_committed_dev) -> None:
    """:meth:`HSpecQwenGDN.commit_conv` without its host loop and without a device->host read.

    Per set of layers that share a layout (and a conv-state shape and dtype): the gather indices
    are built once on the device from ``cu_dev``, ``rows_dev`` and ``num_committed_dev``; sequence
    ``i`` takes the last ``W = K_conv - 1`` columns of ``[old window ; x[cu_i : cu_i + m_i]]``, i.e.
    column ``j = m_i + t`` (``t < W``) of that concatenation: the old window's column ``j`` when
    ``j < W``, else input ``cu_i + j - W``. One source ``[old windows ; x]`` per layer, all layers
    in one ``cat`` and one gather, then one ``index_copy_`` per layer into its slots. Pure copies, so
    the windows are bit-identical to :meth:`~HSpecQwenGDN.commit_conv`'s.

    Sequences that :meth:`~HSpecQwenGDN.commit_conv` skips (slot 0, vLLM's null block used as
    padding; ``m = 0``, a discarded row) get ``m = 0`` here: their window is written back unchanged
    (identical values, also where padding repeats slot 0). ``m`` is clamped to the round's length,
    which it never exceeds (``m`` = accepted drafts + 1), so no index can leave ``x``."""
    conv_view = vllm_cpu_gdn_paths().conv_view
    groups: dict[tuple, list] = {}
    for layer in layers:
        layout = layer.verified_round.layout
        if not layout.slots:
            continue
        conv = conv_view(layer)  # [slots, conv_dim, W] (a view when the storage is [slots, W, conv_dim])
        key = (layout.key, tuple(layout.rows), tuple(conv.shape[1:]), conv.dtype, conv.device)
        groups.setdefault(key, []).append(layer)
    for group in groups.values():
        layout = group[0].verified_round.layout  # equal layouts (same slots, offsets and rows)
        convs = [conv_view(layer).transpose(-1, -2) for layer in group]  # [slots, W, conv_dim] views
        xs = [layer.verified_round.x for layer in group]  # [T, conv_dim] each
        W, D = convs[0].shape[1:]
        ns, T = len(layout.slots), xs[0].shape[0]
        if any(x.shape != (T, D) for x in xs):
            raise RuntimeError(f"one-slot GDN commit: pre-conv inputs {[tuple(x.shape) for x in xs]}, "
                               f"expected ({T}, {D})")
        device = convs[0].device
        slots = layout.slots_dev.long()
        cu = layout.cu_dev.long()
        m = torch.minimum(layout.committed(num_committed_dev).long(), cu[1:] - cu[:-1])
        m = torch.where(slots > 0, m, torch.zeros_like(m))
        j = m[:, None] + torch.arange(W, device=device)[None]  # [Ns, W]
        seq = torch.arange(ns, device=device)[:, None]
        idx = torch.where(j < W, seq * W + j, ns * W + cu[:-1, None] + j - W)  # into [old (Ns*W) ; x (T)]
        per_layer = ns * W + T
        idx = (torch.arange(len(group), device=device)[:, None] * per_layer + idx.reshape(1, -1)).reshape(-1)
        pieces = []
        for conv, x in zip(convs, xs):
            pieces.append(conv.index_select(0, slots).reshape(ns * W, D))  # old windows, before any write
            pieces.append(x.to(conv.dtype))
        new = torch.cat(pieces).index_select(0, idx).view(len(group), ns, W, D)
        for conv, window in zip(convs, new):
            conv.index_copy_(0, slots, window)
