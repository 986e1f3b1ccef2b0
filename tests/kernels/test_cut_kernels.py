"""The device cut's one-launch kernels (``kernels.cut``, Triton's interpreter on the CPU) against their
torch forms on fresh random steps: the plan (every row's ``w`` and every token's router source,
padding tokens past the step included), the bonus indices moved to each row's cut with the verified
count, and the rows ended at their cut; each comparison rejects a planted off-by-one."""

from __future__ import annotations

import pytest
import torch
from vllm_hybridspec.kernels.cut import (
    bonus_at_cut,
    bonus_at_cut_torch,
    end_rows_at_cut,
    end_rows_at_cut_torch,
    plan_cut,
    plan_cut_torch,
    stage0_expand_torch,
)
from vllm_hybridspec.policy.selector import new_experts_at

from ..seeds import fresh_seed

NO_CUT = 1 << 30


def random_plan(gen):
    n = int(torch.randint(1, 40, (), generator=gen))
    lens = torch.randint(1, 17, (n,), generator=gen)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0)
    n_prev = int(torch.randint(1, 50, (), generator=gen))
    w_prev = torch.randint(1, 17, (n_prev,), generator=gen, dtype=torch.int32)  # selected lengths
    prev_row = torch.randint(-1, n_prev, (n,), generator=gen)  # -1: a row that keeps every token
    T = int(qsl[-1]) + int(torch.randint(0, 300, (), generator=gen))  # the buffers' padding past the step
    return w_prev, prev_row, qsl, n, T


def run(fn, w_prev, prev_row, qsl, n, T):
    w = torch.full((64,), 7, dtype=torch.int32)  # rows past n keep what they held
    source = torch.full((T,), -5, dtype=torch.int64)
    fn(w_prev, prev_row, qsl, n, w, source, NO_CUT)
    return w, source


@pytest.mark.parametrize("draw", range(4))
def test_one_launch_plan_equals_the_torch_plan(draw):
    gen = torch.Generator().manual_seed(fresh_seed(f"cut plan kernel {draw}"))
    cut_tokens = 0
    for _ in range(5):
        args = random_plan(gen)
        w, source = run(plan_cut, *args)
        w_ref, source_ref = run(plan_cut_torch, *args)
        assert torch.equal(w, w_ref) and torch.equal(source, source_ref)
        cut_tokens += int((source_ref != torch.arange(len(source_ref))).sum())
    assert cut_tokens > 0  # the draws cut something


def test_the_comparison_rejects_a_plan_keeping_one_token_more():
    gen = torch.Generator().manual_seed(fresh_seed("cut plan kernel control"))
    w_prev, prev_row, qsl, n, T = random_plan(gen)
    prev_row[0] = 0
    w_prev[0] = 1  # row 0 verifies no draft: a token of it is cut whenever it has two or more
    qsl[1:] += 1  # every row one token longer
    qsl[0] = 0
    w_ref, source_ref = run(plan_cut_torch, w_prev, prev_row, qsl, n, T)
    w, source = run(plan_cut, w_prev + 1, prev_row, qsl, n, T)  # planted: one more draft verified
    assert not torch.equal(source, source_ref) and not torch.equal(w, w_ref)


def random_sampled(gen, n, k):
    """A rejection sampler's output ``[n, k + 1]`` (each row's accepted tokens, ``-1`` after), each
    row's drafts, lengths ``w`` and bonus tokens."""
    drafts = torch.randint(0, k + 1, (n,), generator=gen, dtype=torch.int32)
    accepted = (torch.rand(n, generator=gen) * (drafts + 1).float()).long()  # 0..drafts accepted
    token_ids = torch.randint(0, 1000, (n, k + 1), generator=gen)
    token_ids[torch.arange(k + 1)[None, :] > accepted[:, None]] = -1
    w = torch.randint(1, k + 2, (n,), generator=gen, dtype=torch.int32)
    bonus = torch.randint(0, 1000, (n,), generator=gen)
    # row 0 accepted all its k drafts and verifies one: a cut one token later ends it elsewhere
    drafts[0], w[0] = k, 2
    token_ids[0] = torch.randint(0, 1000, (k + 1,), generator=gen)
    return drafts, token_ids, w, bonus


@pytest.mark.parametrize("n", [1, 5, 37])
def test_bonus_at_cut_and_end_rows_equal_their_torch_forms(n):
    gen = torch.Generator().manual_seed(fresh_seed(f"cut sampling kernels {n}"))
    k = 15
    drafts, token_ids, w, bonus = random_sampled(gen, n, k)
    cu = drafts.cumsum(0).to(torch.int32)
    bonus_idx = (cu + torch.arange(1, n + 1, dtype=torch.int32) - 1).to(torch.int32)
    got_verified, ref_verified = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    got_idx, got_v = bonus_at_cut(cu, w, bonus_idx, got_verified, kernel=True)
    ref_idx, ref_v = bonus_at_cut_torch(cu, w, bonus_idx, ref_verified)
    assert torch.equal(got_idx, ref_idx) and torch.equal(got_v, ref_v) and got_idx.dtype == bonus_idx.dtype
    assert int(got_verified) == int(ref_verified) == int(ref_v.sum())
    got = end_rows_at_cut(token_ids, bonus, ref_v, kernel=True)
    ref = end_rows_at_cut_torch(token_ids, bonus, ref_v)
    assert torch.equal(got, ref)
    assert torch.equal(end_rows_at_cut(token_ids, bonus.view(-1, 1), ref_v, kernel=True), ref)
    # planted: one more draft verified per row
    assert not torch.equal(end_rows_at_cut(token_ids, bonus, ref_v + 1, kernel=True), ref)
    planted_idx, _ = bonus_at_cut(cu, w + 1, bonus_idx, torch.zeros((), dtype=torch.int64), kernel=True)
    assert not torch.equal(planted_idx, ref_idx)


# --- Stage 0 at the first MoE router: d_{w0} verified too where the routing correction says so -------


def random_stage0(gen, k=4, experts=12, K=7):
    """A step of ``n`` rows padded to ``R`` (zero-length rows after them, as vLLM pads
    ``query_start_loc``): spec rows of ``K + 1`` tokens cut at ``w0`` in ``1..K + 1``, one-token rows and
    prefills that are not cut, and an expansion table per row."""
    n = int(torch.randint(1, 12, (), generator=gen))
    R = n + int(torch.randint(0, 5, (), generator=gen))
    kind = torch.randint(0, 4, (n,), generator=gen)  # 0-1: spec row, 2: one token, 3: prefill
    lens = torch.where(kind < 2, K + 1, torch.where(kind == 2, 1, torch.randint(2, 20, (n,), generator=gen)))
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1 : n + 1] = lens.cumsum(0)
    qsl[n + 1 :] = qsl[n]
    w = torch.full((R + 3,), NO_CUT, dtype=torch.int32)
    w[:n] = torch.where(kind < 2, torch.randint(1, K + 2, (n,), generator=gen, dtype=torch.int32), NO_CUT)
    T = int(qsl[-1]) + int(torch.randint(0, 5, (), generator=gen))  # graph padding past the step
    logits = torch.randn(T, experts, generator=gen)
    expand = torch.rand(R + 3, k + 1, generator=gen) < 0.5
    return logits, qsl, w, expand


def stage0_reference(logits, qsl, w, expand, include_own=False):
    """Row by row: ``n_new`` of ``d_{w0}`` by the policy's ``new_experts_at`` on the row's own tokens."""
    k = expand.shape[1] - 1
    ids = logits.topk(k, dim=-1).indices
    out = w.clone()
    for r in range(qsl.shape[0] - 1):
        s, e, w0 = int(qsl[r]), int(qsl[r + 1]), int(w[r])
        if w0 >= NO_CUT or s + w0 >= e:
            continue
        if include_own:  # the planted bug: d_{w0} among the tokens before it, so it brings nothing new
            n_new = k - len(set(ids[s + w0].tolist()) & set(ids[s : s + w0 + 1].flatten().tolist()))
        else:
            n_new = int(new_experts_at(ids[s:e][None], torch.tensor([w0]))[0])
        out[r] = w0 + int(expand[r, n_new])
    return out


@pytest.mark.parametrize("draw", range(4))
def test_stage0_expands_each_row_as_the_policys_lookup_says(draw):
    gen = torch.Generator().manual_seed(fresh_seed(f"stage0 {draw}"))
    grown = kept = steps = 0
    # six steps at least, then on until both outcomes were drawn (a step grows a row with probability 0.69 and
    # keeps one with 0.76, measured over 2,000 steps; 64 steps miss either with probability below 1e-32)
    while steps < 6 or not (grown and kept) and steps < 64:
        steps += 1
        logits, qsl, w, expand = random_stage0(gen)
        want = stage0_reference(logits, qsl, w, expand)
        got, counted = w.clone(), torch.zeros((), dtype=torch.int64)
        stage0_expand_torch(logits, qsl, got, expand, NO_CUT, counted)
        assert torch.equal(got, want), (got, want)
        assert int(counted) == int((got != w).sum())  # the rows lengthened, counted on the device
        grown += int((got != w).sum())
        kept += int(((w < NO_CUT) & (got == w)).sum())
    assert grown > 0 and kept > 0  # both outcomes drawn


def test_the_stage0_comparison_rejects_counting_d_w0_among_the_tokens_before_it():
    """Planted: ``d_{w0}``'s own experts counted as already seen, so ``n_new`` is always 0. A random step shows
    the difference with probability 0.54 (measured over 3,000 steps): steps are drawn until one does, at most
    64, which a correct comparison misses with probability 0.46 ** 64 < 1e-21 (six steps missed it for seed
    1466285444)."""
    gen = torch.Generator().manual_seed(fresh_seed("stage0 control"))
    for _ in range(64):
        logits, qsl, w, expand = random_stage0(gen)
        got = w.clone()
        stage0_expand_torch(logits, qsl, got, expand, NO_CUT)
        if not torch.equal(got, stage0_reference(logits, qsl, w, expand, include_own=True)):
            break
    else:
        raise AssertionError("64 random steps and the planted comparison never differed")
