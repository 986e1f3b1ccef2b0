"""The drafter's norms as one kernel each (``kernels.norms``), for inference on GPUs.

:func:`fuse_norms` replaces the ``forward`` of every ``Qwen3RMSNorm`` and
:class:`~vllm_hybridspec.drafter.mamba2.GatedGroupRMSNorm` of a module tree with the one-launch kernel
of the same arithmetic; parameters and state dict are unchanged. Training keeps the torch modules
(the kernels have no backward).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from vllm_hybridspec.drafter.mamba2 import GatedGroupRMSNorm
from vllm_hybridspec.kernels.norms import gated_group_rms_norm, rms_norm


def _rms_forward(self: Qwen3RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _gated_forward(self: GatedGroupRMSNorm, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return gated_group_rms_norm(y, z, self.weight, self.groups, self.eps)


def fuse_norms(model: nn.Module) -> int:
    """Run every RMS norm of ``model`` as one kernel from now on; returns how many were replaced."""
    n = 0
    for module in model.modules():
        if isinstance(module, Qwen3RMSNorm):
            module.forward = types.MethodType(_rms_forward, module)
        elif isinstance(module, GatedGroupRMSNorm):
            module.forward = types.MethodType(_gated_forward, module)
        else:
            continue
        n += 1
    return n


def unfuse_norms(model: nn.Module) -> None:
    """Undo :func:`fuse_norms`: the torch modules' own ``forward`` again."""
    for module in model.modules():
        if isinstance(module, (Qwen3RMSNorm, GatedGroupRMSNorm)):
            module.__dict__.pop("forward", None)
