"""Triton verify + commit kernels against the float64 reference (TRITON_INTERPRET=1 on the CPU).

Every round length u in 2..16 and every committed count m in 1..u, varlen batches, grouped heads,
both gate paths, fp32 and bf16 inputs.  Outputs and factors are poisoned with NaN before each run.
"""

import pytest
import torch

from vllm_hybridspec.kernels.gdn import (
    StatePointers,
    VerifyFactors,
    gdn_commit,
    gdn_verify,
    recurrent_gated_delta_rule,
)

from .gdn_inputs import random_round, random_states, rel_err

FP32_TOL, BF16_TOL = 1e-4, 5e-3


def _poisoned_outputs(r, HK, HV, K, V, num_layers=None):
    T = sum(r.lengths)
    out = torch.full((T, HV, V), float("nan"), dtype=r.v.dtype)
    f = VerifyFactors.empty(T, HK, HV, K, V, "cpu", num_layers=num_layers)
    for t in (f.z, f.k, f.g_cum):
        t.fill_(float("nan"))
    return out, f


def _reference(r, pool, slots, i):
    """fp64 outputs and per-token states of sequence i, from the pool's state before the round."""
    g, beta = r.gates()
    return recurrent_gated_delta_rule(
        r.seq(i, r.q).double(), r.seq(i, r.k).double(), r.seq(i, r.v).double(),
        r.seq(i, g), r.seq(i, beta), pool[slots[i]].double())


def _run_layers(gen, lengths, commits, HK, HV, K, V, dtype, num_layers=2, fused=True,
                strong_decay=False, BV=32, commit_precision="tf32x3", **verify_kw):
    """Verify ``num_layers`` layers of one round, commit all in one launch, return max errors."""
    N = len(lengths)
    slots = torch.randperm(2 * N, generator=gen)[:N] + 1  # slot 0 is the null block
    pools = [random_states(gen, 2 * N + 1, HV, V, K) for _ in range(num_layers)]
    before = [p.clone() for p in pools]
    rounds = [random_round(gen, lengths, HK, HV, K, V, dtype=dtype, strong_decay=strong_decay)
              for _ in range(num_layers)]
    cu = rounds[0].cu_seqlens
    idx = slots.to(torch.int32)
    T = sum(lengths)
    stacked = VerifyFactors.empty(T, HK, HV, K, V, "cpu", num_layers=num_layers)
    for t in (stacked.z, stacked.k, stacked.g_cum):
        t.fill_(float("nan"))
    out_err = 0.0
    for layer, r in enumerate(rounds):
        out, _ = _poisoned_outputs(r, HK, HV, K, V)
        if fused:
            gates = dict(g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias)
        else:
            g, beta = r.gates()
            gates = dict(g=g.float(), beta=beta.float())
        o, _ = gdn_verify(r.q, r.k, r.v, state=pools[layer], state_indices=idx, cu_seqlens=cu,
                          max_len=max(lengths), out=out, factors=stacked.layer(layer), BV=BV,
                          **gates, **verify_kw)
        assert torch.equal(pools[layer], before[layer]), "verify must not write states"
        for i in range(N):
            o_ref, _ = _reference(r, before[layer], slots, i)
            assert not torch.isnan(r.seq(i, o)).any()
            out_err = max(out_err, rel_err(r.seq(i, o), o_ref))
    gdn_commit(StatePointers(pools), stacked, cu, idx, torch.tensor(commits, dtype=torch.int32),
               BV=BV, precision=commit_precision)
    state_err = 0.0
    for layer, r in enumerate(rounds):
        for i in range(N):
            _, states = _reference(r, before[layer], slots, i)
            state_err = max(state_err, rel_err(pools[layer][slots[i]], states[commits[i] - 1]))
        untouched = torch.ones(pools[layer].shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(pools[layer][untouched], before[layer][untouched])
    return out_err, state_err


# the verify kernels: chunkwise with either triangular inversion, and the recurrence on registers
VARIANTS = {"rows": dict(method="chunk", series_from=17), "series": dict(method="chunk", series_from=0),
            "recurrent": dict(method="recurrent")}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("u", list(range(2, 17)))
def test_every_length_and_every_commit_count_fp32(u, variant):
    """u sequences of length u, sequence i commits m = i + 1: all m in 1..u, grouped heads;
    both triangular inversions of the chunkwise kernel (substitution, product series) and the
    recurrent kernel."""
    gen = torch.Generator().manual_seed(u)
    out_err, state_err = _run_layers(gen, [u] * u, list(range(1, u + 1)), HK=2, HV=4, K=16, V=32,
                                     dtype=torch.float32, BK=16, **VARIANTS[variant])
    assert out_err <= FP32_TOL and state_err <= FP32_TOL, (out_err, state_err)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("u", [2, 3, 5, 8, 11, 16])
def test_lengths_bf16_inputs(u, method):
    gen = torch.Generator().manual_seed(100 + u)
    commits = [1, max(1, u // 2), u]
    out_err, state_err = _run_layers(gen, [u] * 3, commits, HK=2, HV=4, K=32, V=32,
                                     dtype=torch.bfloat16, method=method)
    assert out_err <= BF16_TOL and state_err <= BF16_TOL, (out_err, state_err)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
@pytest.mark.parametrize("fused", [True, False])
def test_varlen_batch_precomputed_and_fused_gates(fused, method):
    gen = torch.Generator().manual_seed(11 + fused)
    lengths = [16, 1, 7, 4, 13, 2]
    commits = [9, 1, 7, 1, 13, 2]
    out_err, state_err = _run_layers(gen, lengths, commits, HK=1, HV=3, K=16, V=16,
                                     dtype=torch.float32, num_layers=3, fused=fused, method=method)
    assert out_err <= FP32_TOL and state_err <= FP32_TOL, (out_err, state_err)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_full_head_dims_and_strong_decay(method):
    """The 35B shape's 128 x 128 heads (4 value blocks of 32), with decays down to e^-50."""
    gen = torch.Generator().manual_seed(5)
    out_err, state_err = _run_layers(gen, [16, 9], [5, 9], HK=1, HV=2, K=128, V=128,
                                     dtype=torch.float32, strong_decay=True, num_layers=1, BK=64,
                                     method=method)
    assert out_err <= FP32_TOL and state_err <= FP32_TOL, (out_err, state_err)


def test_auto_method_picks_by_round_length_and_batch(monkeypatch):
    """"auto" runs the recurrent kernel up to RECURRENT_UP_TO[n] tokens (n: the largest key <= the
    number of sequences) and the chunkwise one above; both give the reference's outputs, and an
    unknown method is refused by name."""
    from vllm_hybridspec.kernels.gdn import verify

    launched = []
    for name in ("gdn_verify_kernel", "gdn_verify_recurrent_kernel"):
        kernel = getattr(verify, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                launched.append(self.name)
                return self.kernel[grid]

        monkeypatch.setattr(verify, name, Spy(kernel, name))
    monkeypatch.setattr(verify, "RECURRENT_UP_TO", {1: 4, 2: 2, 5: 1})
    assert [verify.recurrent_up_to(n) for n in (1, 2, 3, 4, 5, 64)] == [4, 2, 2, 2, 1, 1]
    for lengths, expected in (([4], "recurrent"), ([5], "chunk"), ([2, 1], "recurrent"), ([3, 2, 1], "chunk")):
        launched.clear()
        gen = torch.Generator().manual_seed(40 + sum(lengths))
        out_err, state_err = _run_layers(gen, lengths, [1] * len(lengths), HK=1, HV=2, K=16, V=16,
                                         dtype=torch.float32, num_layers=1)
        assert launched == [f"gdn_verify_{expected}_kernel".replace("_chunk", "")], (lengths, launched)
        assert out_err <= FP32_TOL and state_err <= FP32_TOL, (out_err, state_err)
    r = random_round(torch.Generator().manual_seed(1), [2], 1, 2, 16, 16)
    pool = random_states(torch.Generator().manual_seed(2), 2, 2, 16, 16)
    with pytest.raises(ValueError, match="'blocked'"):
        gdn_verify(r.q, r.k, r.v, g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias, state=pool,
                   state_indices=torch.tensor([1], dtype=torch.int32), cu_seqlens=r.cu_seqlens,
                   max_len=2, method="blocked")


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_value_blocks_not_dividing_v_and_one_token_rounds(method):
    """V = 24 in blocks of 16 (a masked last block), and rounds of one token (the recurrent kernel's
    smallest tile)."""
    for lengths, commits, seed in (([5, 3], [5, 2], 61), ([1, 1, 1], [1, 1, 1], 62)):
        gen = torch.Generator().manual_seed(seed)
        out_err, state_err = _run_layers(gen, lengths, commits, HK=1, HV=2, K=16, V=24,
                                         dtype=torch.float32, num_layers=1, BV=16, method=method)
        assert out_err <= FP32_TOL and state_err <= FP32_TOL, (lengths, out_err, state_err)


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_round_after_round_matches_recurrence(method):
    """Two consecutive rounds (commit m, then verify from the committed state) as in decoding."""
    gen = torch.Generator().manual_seed(21)
    HK, HV, K, V = 1, 2, 16, 16
    pool = random_states(gen, 3, HV, V, K)
    S = pool[2].double().clone()
    idx = torch.tensor([2], dtype=torch.int32)
    errs = []
    for u, m in ((8, 3), (5, 5), (16, 1)):
        r = random_round(gen, [u], HK, HV, K, V)
        o, f = gdn_verify(r.q, r.k, r.v, g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias,
                          state=pool, state_indices=idx, cu_seqlens=r.cu_seqlens, max_len=u,
                          method=method)
        g, beta = r.gates()
        o_ref, states = recurrent_gated_delta_rule(r.q.double(), r.k.double(), r.v.double(),
                                                   g, beta, S)
        errs.append(rel_err(o, o_ref))
        stacked = VerifyFactors(f.z[None], f.k[None], f.g_cum[None])
        gdn_commit([pool], stacked, r.cu_seqlens, idx, torch.tensor([m], dtype=torch.int32))
        S = states[m - 1]
        errs.append(rel_err(pool[2], S))
    assert max(errs) <= FP32_TOL, errs


@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_null_slot_and_zero_commit_are_skipped(method):
    gen = torch.Generator().manual_seed(8)
    HK, HV, K, V = 1, 2, 16, 16
    r = random_round(gen, [4, 4], HK, HV, K, V)
    pool = random_states(gen, 3, HV, V, K)
    before = pool.clone()
    idx = torch.tensor([0, 2], dtype=torch.int32)  # sequence 0 points at vLLM's null block
    out, f = _poisoned_outputs(r, HK, HV, K, V)
    o, f = gdn_verify(r.q, r.k, r.v, g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias,
                      state=pool, state_indices=idx, cu_seqlens=r.cu_seqlens, max_len=4, out=out,
                      method=method)
    assert torch.isnan(o[:4]).all() and not torch.isnan(o[4:]).any()
    stacked = VerifyFactors(f.z[None], f.k[None], f.g_cum[None])
    gdn_commit([pool], stacked, r.cu_seqlens, idx, torch.tensor([3, 0], dtype=torch.int32))
    assert torch.equal(pool, before)


def test_bad_inputs_name_the_bad_value():
    gen = torch.Generator().manual_seed(1)
    r = random_round(gen, [4], 1, 2, 16, 16)
    pool = random_states(gen, 2, 2, 16, 16)
    kw = dict(g=r.a, beta=r.b, A_log=r.A_log, dt_bias=r.dt_bias, state_indices=torch.tensor([1]),
              cu_seqlens=r.cu_seqlens)
    with pytest.raises(ValueError, match="max_len must be in 1..16, got 17"):
        gdn_verify(r.q, r.k, r.v, state=pool, max_len=17, **kw)
    with pytest.raises(ValueError, match="state pool must be fp32"):
        gdn_verify(r.q, r.k, r.v, state=pool.double(), max_len=4, **kw)
    with pytest.raises(ValueError, match=r"state pool must be \[slots, HV=2, V=16, K=16\]"):
        gdn_verify(r.q, r.k, r.v, state=pool[:, :1], max_len=4, **kw)
    with pytest.raises(ValueError, match="state pool of layer 1 must be fp32"):
        StatePointers([pool, pool.double()])
    _, f = gdn_verify(r.q, r.k, r.v, state=pool, max_len=4, **kw)
    stacked = VerifyFactors(f.z[None], f.k[None], f.g_cum[None])
    with pytest.raises(ValueError, match="precision must be 'tf32x3', 'ieee' or 'tf32', got 'fp16'"):
        gdn_commit([pool], stacked, r.cu_seqlens, torch.tensor([1]), torch.tensor([2], dtype=torch.int32),
                   precision="fp16")


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_commit_precisions_fp32(precision):
    """The commit's two fp32-accurate dot precisions, every m of a 16-token round."""
    gen = torch.Generator().manual_seed(1600 + len(precision))
    out_err, state_err = _run_layers(gen, [16] * 16, list(range(1, 17)), HK=2, HV=4, K=16, V=32,
                                     dtype=torch.float32, BK=16, commit_precision=precision)
    assert out_err <= FP32_TOL and state_err <= FP32_TOL, (out_err, state_err)
