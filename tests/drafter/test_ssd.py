"""The block-parallel Mamba-2 scan equals the token-by-token recurrence from the same injected state."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from vllm_hybridspec.drafter._mamba import mamba_chunk_scan_combined
from vllm_hybridspec.drafter.mamba2 import Mamba2Mixer
from vllm_hybridspec.drafter.ssd import ssd_parallel, ssd_recurrent, ssd_scan


def random_scan_inputs(N=3, L=8, H=8, P=16, G=4, S=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)
    return dict(
        x=r(N, L, H, P),
        dt=r(N, L, H),
        A=-torch.rand(H, generator=g, dtype=dtype) * 2 - 0.1,
        B=r(N, L, G, S),
        C=r(N, L, G, S),
        D=r(H),
        dt_bias=r(H),
        initial_state=r(N, H, P, S),
    )


@pytest.mark.parametrize("L", [1, 8, 13])
def test_parallel_scan_equals_recurrence(L):
    inputs = random_scan_inputs(L=L, seed=L)
    y_ref, s_ref = ssd_recurrent(**inputs)
    y, s = ssd_parallel(**inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)


def test_injected_state_matters_and_matches_a_prefix_run():
    """Running a prefix from zeros and then the block from the prefix's final state equals scanning
    the concatenation: the injected state is exactly a recurrent state."""
    full = random_scan_inputs(L=12, seed=3)
    full["initial_state"] = torch.zeros_like(full["initial_state"])
    y_full, s_full = ssd_recurrent(**full)
    head = {k: (v[:, :5] if v.dim() >= 3 and k != "initial_state" else v) for k, v in full.items()}
    _, s_head = ssd_recurrent(**head)
    tail = {k: (v[:, 5:] if v.dim() >= 3 and k != "initial_state" else v) for k, v in full.items()}
    y_tail, s_tail = ssd_parallel(**{**tail, "initial_state": s_head})
    torch.testing.assert_close(y_tail, y_full[:, 5:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s_tail, s_full, rtol=1e-12, atol=1e-12)
    y_zero, _ = ssd_parallel(**{**tail, "initial_state": torch.zeros_like(s_head)})
    assert (y_zero - y_tail).abs().max() > 1e-3


def test_parallel_scan_gradients():
    inputs = random_scan_inputs(N=1, L=4, H=2, P=3, G=1, S=2, seed=5)
    names = ["x", "dt", "B", "C", "D", "dt_bias", "initial_state"]
    for n in names:
        inputs[n].requires_grad_(True)
    fn = lambda *args: ssd_parallel(**{**inputs, **dict(zip(names, args))})
    assert torch.autograd.gradcheck(fn, tuple(inputs[n] for n in names))


def test_shape_errors_name_the_bad_tensor():
    inputs = random_scan_inputs(H=6, G=4)
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of the number of groups \(4\)"):
        ssd_parallel(**inputs)
    inputs = random_scan_inputs()
    inputs["initial_state"] = inputs["initial_state"][:, :, :, :2]
    with pytest.raises(ValueError, match="initial_state must be"):
        ssd_parallel(**inputs)


def test_mixer_block_equals_token_by_token():
    """The whole Mamba-2 mixer (projection, causal conv, scan, gated norm) over a block equals feeding
    it one token at a time with a rolling convolution window and the recurrent state."""
    torch.manual_seed(0)
    mixer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=8, d_state=4, n_groups=2, d_conv=4).double()
    N, L = 2, 8
    hidden = torch.randn(N, L, 32, dtype=torch.float64)
    state0 = torch.randn(N, *mixer.state_shape, dtype=torch.float64)
    block = mixer(hidden, state0)

    H, P, S, G = mixer.num_heads, mixer.head_dim, mixer.d_state, mixer.n_groups
    z, xbc, dt = mixer.in_proj(hidden).split([mixer.d_ssm, mixer.d_ssm + 2 * G * S, H], dim=-1)
    window = torch.zeros(N, xbc.shape[-1], 4, dtype=torch.float64)  # the conv starts from zeros
    state, outs = state0, []
    for t in range(L):
        window = torch.cat([window[..., 1:], xbc[:, t, :, None]], dim=-1)
        conv = F.silu((window * mixer.conv1d.weight[:, 0]).sum(-1) + mixer.conv1d.bias)
        x, B, C = conv.split([mixer.d_ssm, G * S, G * S], dim=-1)
        y, state = ssd_recurrent(
            x.view(N, 1, H, P),
            dt[:, t : t + 1],
            -torch.exp(mixer.A_log),
            B.view(N, 1, G, S),
            C.view(N, 1, G, S),
            mixer.D,
            mixer.dt_bias,
            state,
        )
        outs.append(mixer.out_proj(mixer.norm(y.flatten(-2), z[:, t : t + 1])))
    torch.testing.assert_close(block, torch.cat(outs, dim=1), rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or mamba_chunk_scan_combined() is None,
    reason="runs mamba-ssm's Triton kernel in Triton's interpreter (TRITON_INTERPRET=1)",
)
def test_mamba_ssm_kernel_matches_torch_path(monkeypatch):
    """The GPU path (mamba-ssm's ``mamba_chunk_scan_combined`` with ``initial_states``), executed by
    Triton's CPU interpreter, equals the torch path. mamba-ssm enters ``torch.cuda.device(index)``
    around its launches, which has no CPU meaning; the test makes it a no-op."""
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    inputs = {k: v.float() for k, v in random_scan_inputs(N=2, L=8, H=4, P=16, G=2, S=4, seed=11).items()}
    y_ref, s_ref = ssd_parallel(**inputs)
    y, s = ssd_scan(**inputs, chunk_size=8, use_kernel=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)
