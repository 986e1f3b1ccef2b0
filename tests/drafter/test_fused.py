"""The drafter with its norms as one kernel each (``drafter.fused.fuse_norms``, Triton's interpreter on
the CPU): every norm of the model is replaced, and a float32 round drafts what the torch modules draft,
with the block's hidden states within float32 rounding."""

from __future__ import annotations

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from vllm_hybridspec.drafter.fused import fuse_norms
from vllm_hybridspec.drafter.mamba2 import GatedGroupRMSNorm

from .conftest import make_drafter
from .test_model import requests


def test_fused_norms_draft_what_the_torch_norms_draft(target, target_dir):
    drafter = make_drafter(target_dir, seed=3).eval()
    last, anchors, kv, lens = requests(target, drafter, [5, 17, 9], seed=4)
    with torch.no_grad():
        want = drafter.propose(last, anchors, kv, lens)
        norms = sum(isinstance(m, (Qwen3RMSNorm, GatedGroupRMSNorm)) for m in drafter.modules())
        assert fuse_norms(drafter) == norms > 0
        got = drafter.propose(last, anchors, kv, lens)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.top1_prob, want.top1_prob, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-5)
    assert set(drafter.state_dict()) == set(make_drafter(target_dir, seed=3).state_dict())
