"""The chunkwise torch reference against the token-by-token recurrence, in float64."""

import pytest
import torch
import torch.nn.functional as F

from vllm_hybridspec.kernels.gdn import (
    chunk_verify,
    gdn_gating,
    l2norm,
    reconstruct_state,
    recurrent_gated_delta_rule,
)

from .gdn_inputs import random_round, random_states, rel_err


@pytest.mark.parametrize("strong_decay", [False, True])
@pytest.mark.parametrize("HK,HV", [(1, 1), (2, 4), (3, 6)])
def test_chunk_verify_matches_recurrence_float64(HK, HV, strong_decay):
    gen = torch.Generator().manual_seed(1000 * HK + HV + strong_decay)
    K, V = 16, 24
    for u in range(1, 17):
        r = random_round(gen, [u], HK, HV, K, V, dtype=torch.float64, strong_decay=strong_decay)
        g, beta = r.gates()
        S0 = random_states(gen, 1, HV, V, K)[0].double()
        o_ref, states = recurrent_gated_delta_rule(r.q, r.k, r.v, g, beta, S0)
        o, factors = chunk_verify(r.q, r.k, r.v, g, beta, S0)
        assert rel_err(o, o_ref) < 1e-12, u
        for m in range(0, u + 1):
            expect = S0 if m == 0 else states[m - 1]
            assert rel_err(reconstruct_state(S0, factors, m), expect) < 1e-12, (u, m)
        # the factors of a prefix do not depend on the suffix (Appendix C.1)
        _, f_prefix = chunk_verify(r.q[:1], r.k[:1], r.v[:1], g[:1], beta[:1], S0)
        assert rel_err(f_prefix.z, factors.z[:1]) < 1e-12


def test_recurrence_matches_explicit_single_head_formula():
    """Eq. 1 written out by hand for one head, to pin the conventions (decay, then delta update)."""
    gen = torch.Generator().manual_seed(7)
    K, V, u = 8, 5, 6
    q, k = torch.randn(u, 1, K, generator=gen, dtype=torch.float64), torch.randn(
        u, 1, K, generator=gen, dtype=torch.float64)
    v = torch.randn(u, 1, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(u, 1, generator=gen, dtype=torch.float64)
    beta = torch.rand(u, 1, generator=gen, dtype=torch.float64)
    S = torch.randn(1, V, K, generator=gen, dtype=torch.float64)
    o, states = recurrent_gated_delta_rule(q, k, v, g, beta, S, scale=0.3)
    S = S[0]
    for i in range(u):
        kn, qn = F.normalize(k[i, 0], dim=0, eps=0), F.normalize(q[i, 0], dim=0, eps=0)
        alpha = torch.exp(g[i, 0])
        z = beta[i, 0] * (v[i, 0] - alpha * S @ kn)
        S = alpha * S + torch.outer(z, kn)
        assert torch.allclose(states[i, 0], S, rtol=1e-5, atol=1e-6)
        assert torch.allclose(o[i, 0], S @ (0.3 * qn), rtol=1e-5, atol=1e-6)


def test_gating_matches_qwen_formula():
    gen = torch.Generator().manual_seed(3)
    A_log = torch.randn(6, generator=gen)
    dt_bias = torch.randn(6, generator=gen)
    a = torch.randn(10, 6, generator=gen) * 10  # reaches the softplus threshold
    b = torch.randn(10, 6, generator=gen)
    g, beta = gdn_gating(A_log, a, dt_bias, b)
    x = (a + dt_bias).double()
    sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert torch.allclose(g.double(), -torch.exp(A_log.double()) * sp, rtol=1e-6)
    assert torch.allclose(beta.double(), 1 / (1 + torch.exp(-b.double())), rtol=1e-6)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()


def test_l2norm_uses_vllm_epsilon():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    assert torch.allclose(l2norm(x), x / (25 + 1e-6) ** 0.5)


def test_reconstruct_rejects_bad_m():
    gen = torch.Generator().manual_seed(0)
    r = random_round(gen, [3], 1, 1, 16, 16, dtype=torch.float64)
    g, beta = r.gates()
    S0 = random_states(gen, 1, 1, 16, 16)[0].double()
    _, f = chunk_verify(r.q, r.k, r.v, g, beta, S0)
    with pytest.raises(ValueError, match="m must be in 0..3"):
        reconstruct_state(S0, f, 4)
