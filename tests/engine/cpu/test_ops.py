"""The torch stand-ins for vLLM's CPU GDN ops agree with each other and with the recurrence, and
the patch installs them where vLLM's CPU GDN layer looks them up."""

import torch
from vllm_hybridspec.kernels.gdn import recurrent_gated_delta_rule

from vllm_hybridspec.engine.cpu import ops as cpu_gdn
from vllm_hybridspec.engine import patches
from vllm_hybridspec.engine.cpu.ops import CPU_GDN_OPS

from ...kernels.gdn_inputs import random_round, random_states, rel_err

HK, HV, K, V = 2, 4, 16, 16


def _pool_view(pool):
    """The [slots, HV, K, V] view vLLM's CPU layer passes for its [slots, HV, V, K] pool."""
    return pool.view(pool.shape[0], HV, K, V)


def _state(pool, slot):
    """The state S [HV, V, K] the torch ops keep in a slot (stored as view[slot] = S^T)."""
    return _pool_view(pool)[slot].transpose(-1, -2)


def test_prefill_then_decode_equals_one_recurrence():
    """A 37-token prefill (chunks of 16) then 3 decode steps, for 2 sequences, vs the recurrence."""
    gen = torch.Generator().manual_seed(0)
    pre, dec = [37, 5], 3
    r = random_round(gen, pre + [1] * (2 * dec), HK, HV, K, V)
    g, beta = r.gates()
    pool = random_states(gen, 4, HV, V, K)
    view = _pool_view(pool)
    slots = [3, 1]
    start = {n: _state(pool, s).double().clone() for n, s in enumerate(slots)}
    # prefill both sequences from their slots' states
    cu = torch.tensor([0, pre[0], pre[0] + pre[1]], dtype=torch.int32)
    T = cu[-1]
    o, final = cpu_gdn.chunk_gated_delta_rule_cpu(
        r.q[None, :T], r.k[None, :T], r.v[None, :T], g[None, :T].float(), beta[None, :T].float(),
        view[slots].clone(), True, cu, False, True)
    view[slots] = final
    for step in range(dec):
        s = T + 2 * step
        cpu_gdn.fused_sigmoid_gating_delta_rule_update_cpu(
            r.A_log, r.dt_bias, r.q[None, s:s + 2], r.k[None, s:s + 2], r.v[None, s:s + 2],
            r.a[s:s + 2], r.b[s:s + 2], view, torch.tensor(slots), torch.tensor([0, 1, 2]), True)
    for n, slot in enumerate(slots):
        tokens = list(range(int(cu[n]), int(cu[n + 1]))) + [int(T) + 2 * i + n for i in range(dec)]
        idx = torch.tensor(tokens)
        o_ref, states = recurrent_gated_delta_rule(r.q[idx].double(), r.k[idx].double(),
                                                   r.v[idx].double(), g[idx], beta[idx], start[n])
        assert rel_err(o[0, cu[n]:cu[n + 1]], o_ref[:pre[n]]) < 1e-5
        assert rel_err(_state(pool, slot), states[-1]) < 1e-5


def test_torch_chunk_op_on_vllms_gpu_state_layout_equals_the_recurrence():
    """``TorchChunkGatedDeltaRule`` (float32 GPU prefill): states [N, HV, V, K] as vLLM's GPU pool keeps
    them (no transpose), three sequences of 1, 16 and 41 tokens (chunk edges), vLLM's call with
    in-kernel L2 norm off after normalising q/k itself, and the caller's output buffer filled."""
    gen = torch.Generator().manual_seed(3)
    lens = [1, 16, 41]
    r = random_round(gen, lens, HK, HV, K, V)
    g, beta = r.gates()
    init = random_states(gen, len(lens), HV, V, K)  # [N, HV, V, K] fp32, fresh random
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    qn = torch.nn.functional.normalize(r.q, dim=-1)
    kn = torch.nn.functional.normalize(r.k, dim=-1)
    buf = torch.full((1, int(cu[-1]), HV, V), float("nan"))
    op = cpu_gdn.TorchChunkGatedDeltaRule()
    o, final = op(q=qn[None], k=kn[None], v=r.v[None], g=g[None].float(), beta=beta[None].float(),
                  initial_state=init.clone(), output_final_state=True, cu_seqlens=cu, chunk_indices=None,
                  chunk_offsets=None, use_qk_l2norm_in_kernel=False, core_attn_out=buf)
    assert final.shape == init.shape and final.dtype == torch.float32
    for n in range(len(lens)):
        s, e = int(cu[n]), int(cu[n + 1])
        o_ref, states = recurrent_gated_delta_rule(qn[s:e].double(), kn[s:e].double(), r.v[s:e].double(),
                                                   g[s:e], beta[s:e], init[n].double(), use_qk_l2norm=False)
        assert rel_err(o[0, s:e], o_ref) < 1e-5
        assert rel_err(final[n], states[-1]) < 1e-5
    assert torch.equal(buf, o)
    _, none = op(qn[None], kn[None], r.v[None], g[None].float(), beta[None].float(), init.clone(), False,
                 cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
    assert none is None


def test_float32_targets_on_cuda_prefill_through_the_torch_op():
    from vllm_hybridspec.engine.gdn.enable import needs_torch_prefill

    assert needs_torch_prefill(torch.float32, on_cuda=True)
    assert not needs_torch_prefill(torch.bfloat16, on_cuda=True)
    assert not needs_torch_prefill(torch.float16, on_cuda=True)
    assert not needs_torch_prefill(torch.float32, on_cuda=False)  # the CPU ops are patched instead


def test_spec_op_reads_accepted_slot_and_writes_one_state_per_token():
    gen = torch.Generator().manual_seed(1)
    lengths, accepted = [4, 2], [3, 1]
    r = random_round(gen, lengths, HK, HV, K, V)
    g, beta = r.gates()
    pool = random_states(gen, 9, HV, V, K)
    before = pool.clone()
    idx = torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]], dtype=torch.int32)
    o = cpu_gdn.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        r.A_log, r.dt_bias, r.q, r.k, r.v, r.a, r.b, _pool_view(pool), idx,
        torch.tensor(accepted, dtype=torch.int32), r.cu_seqlens, True)
    for n in range(2):
        s = slice(int(r.cu_seqlens[n]), int(r.cu_seqlens[n + 1]))
        S0 = _state(before, int(idx[n, accepted[n] - 1])).double()
        o_ref, states = recurrent_gated_delta_rule(r.q[s].double(), r.k[s].double(), r.v[s].double(),
                                                   g[s], beta[s], S0)
        assert rel_err(o[s], o_ref) < 1e-5
        for t in range(lengths[n]):
            assert rel_err(_state(pool, int(idx[n, t])), states[t]) < 1e-5
    assert torch.equal(pool[0], before[0]), "the null block is never written"


def test_gating_shapes_match_vllm():
    gen = torch.Generator().manual_seed(2)
    r = random_round(gen, [5], HK, HV, K, V, dtype=torch.bfloat16)
    g, beta = cpu_gdn.fused_gdn_gating_cpu(r.A_log, r.a, r.b, r.dt_bias)
    assert g.shape == (1, 5, HV) and g.dtype == torch.float32
    assert beta.shape == (1, 5, HV) and beta.dtype == torch.bfloat16
    g_ref, beta_ref = r.gates()
    assert rel_err(g[0], g_ref) < 1e-6


def test_patch_installs_every_op_where_vllm_looks():
    import vllm._custom_ops as ops

    rows = [r for r in patches.rows(feature="cpu") if r.owner == "vllm._custom_ops"]
    assert sorted(r.attr for r in rows) == sorted(CPU_GDN_OPS)
    for row in rows + rows:  # idempotent
        patches.apply_row(row)
    for name in CPU_GDN_OPS:
        assert getattr(ops, name) is getattr(cpu_gdn, name)
    from vllm_hybridspec.engine.gdn.vllm_path import vllm_package_dir

    layer_src = (vllm_package_dir() / "model_executor/layers/mamba/ops/cpu/gdn_attention.py").read_text()
    assert "import vllm._custom_ops as ops" in layer_src
    for name in CPU_GDN_OPS:
        assert f"ops.{name}(" in layer_src, name


def test_sequences_of_one_length_run_side_by_side_as_each_alone():
    """The ops run sequences of one length as one call (heads side by side): prefill of 5, 0, 5, 12
    and 5 tokens, a decode step of four sequences (one on the null block) and a spec step of
    3, 3 and 2 tokens, each sequence against its own recurrence from its own state."""
    gen = torch.Generator().manual_seed(4)
    lens = [5, 0, 5, 12, 5]
    r = random_round(gen, lens, HK, HV, K, V)
    g, beta = r.gates()
    pool = random_states(gen, 12, HV, V, K)
    view = _pool_view(pool)
    slots = [7, 2, 9, 4, 11]
    before = {s: _state(pool, s).double().clone() for s in range(12)}
    o, final = cpu_gdn.chunk_gated_delta_rule_cpu(
        r.q[None], r.k[None], r.v[None], g[None].float(), beta[None].float(), view[slots].clone(), True,
        r.cu_seqlens, False, True)
    cu = r.cu_seqlens.tolist()
    for n, slot in enumerate(slots):
        s, e = cu[n], cu[n + 1]
        if e == s:
            assert torch.equal(final[n], view[slot].float())
            continue
        o_ref, states = recurrent_gated_delta_rule(r.q[s:e].double(), r.k[s:e].double(), r.v[s:e].double(),
                                                   g[s:e], beta[s:e], before[slot])
        assert rel_err(o[0, s:e], o_ref) < 1e-5
        assert rel_err(final[n].transpose(-1, -2), states[-1]) < 1e-5

    d = random_round(gen, [1, 1, 1, 1], HK, HV, K, V)
    gd, bd = d.gates()
    decode_slots = torch.tensor([3, 0, 5, 8])
    o = cpu_gdn.fused_sigmoid_gating_delta_rule_update_cpu(
        d.A_log, d.dt_bias, d.q[None], d.k[None], d.v[None], d.a, d.b, view, decode_slots, d.cu_seqlens, True)
    for n, slot in enumerate(decode_slots.tolist()):
        if slot == 0:
            assert torch.equal(o[n], torch.zeros_like(o[n])) and torch.equal(_state(pool, 0), before[0].float())
            continue
        o_ref, states = recurrent_gated_delta_rule(d.q[n:n + 1].double(), d.k[n:n + 1].double(),
                                                   d.v[n:n + 1].double(), gd[n:n + 1], bd[n:n + 1], before[slot])
        assert rel_err(o[n], o_ref) < 1e-5
        assert rel_err(_state(pool, slot), states[-1]) < 1e-5

    spec_lens, accepted = [3, 3, 2], [2, 1, 1]
    sr = random_round(gen, spec_lens, HK, HV, K, V)
    gs, bs = sr.gates()
    start = pool.clone()
    idx = torch.tensor([[1, 6, 10], [2, 3, 0], [4, 5, 0]], dtype=torch.int32)
    o = cpu_gdn.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        sr.A_log, sr.dt_bias, sr.q, sr.k, sr.v, sr.a, sr.b, view, idx, torch.tensor(accepted, dtype=torch.int32),
        sr.cu_seqlens, True)
    cu = sr.cu_seqlens.tolist()
    for n in range(3):
        s, e = cu[n], cu[n + 1]
        S0 = _state(start, int(idx[n, accepted[n] - 1])).double()
        o_ref, states = recurrent_gated_delta_rule(sr.q[s:e].double(), sr.k[s:e].double(), sr.v[s:e].double(),
                                                   gs[s:e], bs[s:e], S0)
        assert rel_err(o[s:e], o_ref) < 1e-5
        for t in range(e - s):
            if int(idx[n, t]) > 0:
                assert rel_err(_state(pool, int(idx[n, t])), states[t]) < 1e-5
    assert torch.equal(pool[0], start[0])
